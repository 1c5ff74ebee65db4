"""Time tree attention (Pallas kernel vs the XLA reference) at serving shapes on this backend.

Shapes: cache of 1k-32k slots (half of them written), T in {1, 8, 32, 64} tree queries, SmolLM2
(9 query / 3 KV heads, head dim 64) and Llama-3-8B (32 / 8, head dim 128) layouts, batch 1.
Prints time per call and achieved memory bandwidth (bytes of the K/V slots read / time) as a
fraction of the device's peak (measured here on CPU; the published figure on GPU/TPU).
On CPU the Pallas kernel can only run under the interpreter, which is not a speed measurement:
there the script times the XLA reference and checks the interpreted kernel on the smallest shape.

    python scripts/bench_attention.py [--max-slots 32768] [--dtype float32]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import spec_jax  # noqa: F401
from pallas_kernels import tree_attention

PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "TPU v5 lite": 819.0, "TPU v4": 1200.0,
            "TPU v5p": 2765.0, "TPU v6 lite": 1640.0}
LAYOUTS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def peak_bandwidth():
    kind = jax.devices()[0].device_kind
    for k, v in PEAK_GBS.items():
        if k.lower() in kind.lower():
            return v, f"{kind} (published {v:.0f} GB/s)"
    x = jnp.ones((128 * 2**20,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        f(x).block_until_ready()
    bw = x.nbytes * 5 / (time.perf_counter() - t0) / 1e9
    return bw, f"{kind} (measured read {bw:.1f} GB/s)"


def timeit(f, *args, reps=10):
    f(*args).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-slots", type=int, default=32768)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    dt = jnp.dtype(a.dtype)
    backend = jax.default_backend()
    peak, peak_desc = peak_bandwidth()
    impls = ["xla"] + (["pallas"] if backend in ("gpu", "tpu") else [])
    print(f"backend {backend}: {peak_desc}; dtype {a.dtype}")
    print("| layout | slots | T | impl | ms | GB/s | % of peak | max err vs xla |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, (h, kvh, d) in LAYOUTS.items():
        s = 1024
        while s <= a.max_slots:
            for t in (1, 8, 32, 64):
                f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dt)
                length = jnp.array([s // 2], jnp.int32)
                args = (f(1, t, h, d), f(1, kvh, s, d), f(1, kvh, s, d), jnp.ones((1, s), bool),
                        length, f(1, t, kvh, d), f(1, t, kvh, d),
                        jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (1, t, t)))
                ref = None
                for impl in impls:
                    fn = jax.jit(lambda *x, impl=impl: tree_attention(*x, impl=impl))
                    sec = timeit(fn, *args)
                    out = fn(*args)
                    ref = out if ref is None else ref
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                    nbytes = 2 * (s // 2) * kvh * d * dt.itemsize
                    gbs = nbytes / sec / 1e9
                    print(f"| {name} | {s} | {t} | {impl} | {sec * 1e3:.3f} | {gbs:.1f} | "
                          f"{gbs / peak:.0%} | {err:.1e} |", flush=True)
            s *= 4
    if backend == "cpu":
        h, kvh, d = LAYOUTS["smollm2"]
        f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dt)
        args = (f(1, 8, h, d), f(1, kvh, 1024, d), f(1, kvh, 1024, d), jnp.ones((1, 1024), bool),
                jnp.array([700], jnp.int32), f(1, 8, kvh, d), f(1, 8, kvh, d),
                jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (1, 8, 8)))
        err = float(jnp.max(jnp.abs(tree_attention(*args, impl="pallas_interpret")
                                    - tree_attention(*args, impl="xla"))))
        print(f"\n(CPU: Pallas kernels run only under the interpreter here; interpreted kernel vs "
              f"XLA on smollm2, 1024 slots, T=8: max error {err:.1e})")


if __name__ == "__main__":
    main()
