"""Where a generation loop's time goes: per target call, by part of the step and by kind of op.

Runs one `generate` under `jax.profiler`, matches each executed thunk to the compiled HLO
instruction it runs and that instruction's named scope (`spec_jax/step.py` names `draft`,
`target`, `verify` and `draft_update`; the rest of the loop body is `other`, prefill and setup
`outside`), and prints milliseconds per target call per scope, per (scope, op kind) — the CPU
kernels by FFI name, XLA fusions by their root op — and the costliest fusions of the target's
forward. Tracing adds a few microseconds per thunk, so the parts sum to more than the untraced
step; compare parts with each other, and times with the untraced figure printed first. A
profile, not a test: it asserts nothing.

    python scripts/profile_step.py [--model checkpoints/smollm2-135m-instruct]
        [--heads checkpoints/smollm2-135m-instruct-eagle] [--tree "[[0],[1],[0,0]]+ngram:4"]
        [--prompt "..."] [--max-new-tokens 256]

--heads none profiles plain decoding; without --tree the heads use their sized (`auto`) tree.
"""
import argparse
import collections
import gzip
import json
import re
import tempfile
from pathlib import Path

import jax

import spec_jax

SCOPES = ("draft", "target", "verify", "draft_update")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def hlo_index(hlo_text: str) -> dict:
    """HLO instruction name -> (named scope, op kind) for every instruction with metadata."""
    index = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*op_name=\"([^\"]*)\"", line)
        if not m:
            continue
        op_name = m.group(2)
        parts = op_name.split("/")
        scope = next((p for p in parts if p in SCOPES), "other")
        if not any(p.startswith("while") for p in parts):
            scope = "outside"
        ffi = re.search(r'custom_call_target="([^"]*)"', line)
        kind = ffi.group(1) if ffi else (re.search(r"= \S+ ([\w\-]+)\(", line) or [None, "?"])[1]
        index[m.group(1)] = (scope, kind, op_name)
    return index


def thunk_events(trace_dir: Path):
    path = next(trace_dir.rglob("*.trace.json.gz"))
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("ph") == "X"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    ap.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--layers", default="auto", help="the target's layout (load_target's layers)")
    args = ap.parse_args()

    target = spec_jax.load_target(args.model, layers=args.layers)
    kw = {}
    if args.heads != "none":
        kw = {"draft": spec_jax.load_draft(args.heads), "tree": args.tree}
    run = lambda: spec_jax.generate(target, args.prompt, args.max_new_tokens,  # noqa: E731
                                    stop_at_eos=False, **kw)
    run()  # compile
    r = run()
    calls = r.stats["target_calls"]
    print(f"untraced: {r.stats['wall_seconds'] * 1e3 / calls:.2f} ms per target call, "
          f"{calls} calls, tau {r.stats['mean_accepted']:.2f}, tree {r.stats['tree_tokens']} tokens")
    loop = [v for k, v in target.compiled.items() if k[0] == "loop"][-1]
    index = hlo_index(loop.as_text())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            r = run()
        events = thunk_events(Path(d))
    calls = r.stats["target_calls"]
    per_scope, per_kind, count = (collections.Counter() for _ in range(3))
    fusions = collections.Counter()
    for e in events:
        hit = index.get(e.get("name", ""))
        if hit is None:
            continue
        scope, kind, op_name = hit
        per_scope[scope] += e["dur"]
        per_kind[(scope, kind)] += e["dur"]
        count[(scope, kind)] += 1
        if scope == "target" and kind == "fusion":
            fusions[re.sub(r"\d+", "#", op_name.split("/target/")[-1])] += e["dur"]
    ms = lambda us: us / 1e3 / calls  # noqa: E731
    print(f"traced: {r.stats['wall_seconds'] * 1e3 / calls:.2f} ms per target call")
    print("\nms per target call, by part of the step:")
    for scope, us in per_scope.most_common():
        print(f"  {scope:14s} {ms(us):7.3f}")
    print("\nby part and kind of op (thunks per call):")
    for (scope, kind), us in per_kind.most_common(16):
        print(f"  {scope:14s} {kind:28s} {ms(us):7.3f}  ({count[(scope, kind)] / calls:.1f})")
    print("\ncostliest fusions of the target's forward (by the op that names them):")
    for name, us in fusions.most_common(8):
        print(f"  {ms(us):7.3f}  {name[:100]}")


if __name__ == "__main__":
    main()
