"""Where a generation loop's time goes: per target call, by part of the step and by kind of op.

Prints `spec_jax.profile.profile_generation`'s figures for one prompt: milliseconds per target
call per scope of the step (`draft`, `target`, `verify`, `draft_update`, `other`), per (scope, op
kind) — the CPU kernels by FFI name, XLA fusions by their root op — and the costliest fusions of
the target's forward. Tracing adds a few microseconds per thunk, so the parts sum to more than
the untraced step; compare parts with each other, and times with the untraced figure printed
first. A profile, not a test: it asserts nothing.

    python scripts/profile_step.py [--model checkpoints/smollm2-135m-instruct]
        [--heads checkpoints/smollm2-135m-instruct-eagle] [--tree "[[0],[1],[0,0]]+ngram:4"]
        [--prompt "..."] [--max-new-tokens 256] [--layers packed_f32]

--heads none profiles plain decoding; without --tree the heads use their sized (`auto`) tree.
"""
import argparse

import spec_jax
from spec_jax.profile import profile_generation

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


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
    p = profile_generation(target, args.prompt, args.max_new_tokens, **kw)
    print(f"untraced: {p['untraced_ms_per_call']:.2f} ms per target call, {p['calls']} calls, "
          f"tau {p['tau']:.2f}, tree {p['tree_tokens']} tokens")
    print(f"traced: {p['traced_ms_per_call']:.2f} ms per target call")
    print("\nms per target call, by part of the step:")
    for scope, ms in p["scopes"].items():
        print(f"  {scope:14s} {ms:7.3f}")
    print("\nby part and kind of op (thunks per call):")
    for (scope, kind), (ms, n) in list(p["kinds"].items())[:16]:
        print(f"  {scope:14s} {kind:28s} {ms:7.3f}  ({n:.1f})")
    print("\ncostliest fusions of the target's forward (by the op that names them):")
    for name, ms in list(p["fusions"].items())[:8]:
        print(f"  {ms:7.3f}  {name[:100]}")


if __name__ == "__main__":
    main()
