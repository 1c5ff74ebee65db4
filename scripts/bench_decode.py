"""Plain decoding speed on SmolLM2-135M-Instruct: spec_jax vs transformers vs the weights-read bound.

Prints, from one run on this machine: spec_jax plain greedy tokens/s (float32, batch 1, 256 new
tokens, compile excluded), transformers' greedy `generate` tokens/s, their ratio, and the
weights-read bound (bytes of weights read per token / read bandwidth measured in the same run),
from two read bandwidths: all cores (XLA's multi-threaded sum) and one core (numpy's sum).
Decoding is a chain of dependent matrix-vector products; XLA:CPU's own dot runs each on one core,
spec_jax's packed CPU kernel (the default layout on CPU, `pallas_kernels/cpu/gemm.cc`) on all
cores, so the all-core bound is the one to approach; both are printed. A benchmark, not a test:
it asserts nothing.

    python scripts/bench_decode.py [--model checkpoints/smollm2-135m-instruct] [--tokens 256]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import spec_jax  # noqa: F401  (XLA CPU defaults)

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def read_bandwidth(nbytes=512 * 2**20, reps=10):
    """GB/s of a pure streaming read (a sum over a large array) in XLA, best of reps."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def one_core_read_bandwidth(nbytes=512 * 2**20, reps=10):
    """GB/s of a streaming read on one core (numpy's sum is single-threaded), best of reps."""
    x = np.ones(nbytes // 4, np.float32)
    x.sum()
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    target = spec_jax.load_target(a.model)
    # bytes read per token: every matrix once; with a separate (or packed) LM head the embedding
    # table is only gathered from, one row per token
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
    if "lm_head" in target.params:
        param_bytes -= target.params["embed"].nbytes
    spec_jax.generate(target, PROMPT, a.tokens, stop_at_eos=False)  # compile
    ours = []
    for _ in range(a.repeats):
        r = spec_jax.generate(target, PROMPT, a.tokens, stop_at_eos=False)
        ours.append(r.stats["tokens_per_second"])

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(f"{a.model}/hf", dtype=torch.float32).eval()
    ids = torch.tensor([target.encode(PROMPT)])
    kw = dict(max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)  # warm-up
        theirs = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = hf.generate(ids, **kw)
            theirs.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))

    read_bw, read_bw1 = read_bandwidth(), one_core_read_bandwidth()
    bound, bound1 = read_bw * 1e9 / param_bytes, read_bw1 * 1e9 / param_bytes
    best_ours, best_theirs = max(ours), max(theirs)
    print(f"machine: {jax.device_count()} {jax.default_backend()} device(s), jax {jax.__version__}")
    codes = ", uint8 codes" if target.weight_codes else ""
    print(f"weights read per token: {param_bytes / 1e6:.1f} MB (layout: {target.layout}{codes})")
    print(f"spec_jax plain greedy:      {best_ours:6.1f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in ours)})")
    print(f"transformers greedy:        {best_theirs:6.1f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in theirs)})")
    print(f"ratio spec_jax/transformers: {best_ours / best_theirs:5.2f}x")
    print(f"read bandwidth, all cores {read_bw:.1f} GB/s -> weights-read bound {bound:.1f} tok/s; "
          f"spec_jax reaches {best_ours / bound:.0%} of it")
    print(f"read bandwidth, one core  {read_bw1:.1f} GB/s -> weights-read bound {bound1:.1f} tok/s; "
          f"spec_jax reaches {best_ours / bound1:.0%} of it")


if __name__ == "__main__":
    main()
