"""How often greedy speculative output equals plain greedy output, token for token, when the
target runs in bfloat16, and where the first difference comes from.

In float32 (with "highest" matmul precision) spec_jax's greedy speculative output equals plain
decoding exactly. In bfloat16 a tree step computes a token's logits in a batch of T queries,
a plain step in a batch of one: the matmuls and attention round differently, and where the top
two logits of a position are within that rounding, the argmax can flip. This script decodes
the first N MT-bench prompts plainly and with each drafter, compares the tokens, and at each
first difference prints the gap between the target's two best logits there (recomputed over the
whole sequence in float32 and in bfloat16): a gap at the scale of bfloat16 rounding (~1e-2 of
the logits' size) is such a near tie, not an error.

    .venv/bin/python scripts/bf16_agreement.py --limit 8 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import spec_jax
from spec_jax.data import prompt_set, read_prompts, spread

ROOT = Path(__file__).resolve().parents[1]


def top2_gap(target, ids) -> float:
    """The target's best minus second-best logit for the token after `ids`."""
    logits = np.sort(target.logits(ids)[-1])
    return float(logits[-1] - logits[-2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--heads", nargs="*", default=[str(ROOT / "checkpoints" / f"smollm2-135m-instruct-{m}")
                                                  for m in ("eagle", "eagle3")])
    ap.add_argument("--tree", default="dynamic:8,5,32")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    bf16 = spec_jax.load_target(a.model, dtype="bfloat16", layers="scan")
    f32 = spec_jax.load_target(a.model, layers="scan")
    drafts = {"ngram": ("ngram", "chain:4")}
    for h in a.heads:
        heads = spec_jax.load_draft(h)
        drafts[heads.method] = (heads, a.tree)
    prompts = [p.text for p in spread(read_prompts(prompt_set("mt_bench")), a.limit)]
    same = {name: 0 for name in drafts}
    print(f"bfloat16 target, greedy, {len(prompts)} MT-bench prompts, {a.max_new_tokens} tokens")
    for i, p in enumerate(prompts):
        plain = spec_jax.generate(bf16, p, a.max_new_tokens).token_ids
        prompt_ids = bf16.encode(p)
        for name, (draft, tree) in drafts.items():
            spec = spec_jax.generate(bf16, p, a.max_new_tokens, draft=draft, tree=tree).token_ids
            if spec == plain:
                same[name] += 1
                continue
            k = next((j for j, (x, y) in enumerate(zip(spec, plain)) if x != y),
                     min(len(spec), len(plain)))
            prefix = prompt_ids + plain[:k]
            print(f"  prompt {i} {name}: first difference at token {k} of {len(plain)} "
                  f"(plain {plain[k] if k < len(plain) else 'end'}, speculative "
                  f"{spec[k] if k < len(spec) else 'end'}); top-2 logit gap there: "
                  f"{top2_gap(bf16, prefix):.4f} in bfloat16, {top2_gap(f32, prefix):.4f} in float32",
                  flush=True)
    for name, n in same.items():
        print(f"{name:8} ({drafts[name][1]}): {n}/{len(prompts)} outputs equal plain decoding token for token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
