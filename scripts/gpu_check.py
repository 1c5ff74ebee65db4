"""GPU (or TPU) check of the kernels and the draft-verify step: correctness and timings, one script.

Written for a short stay on an accelerator: every section appends to OUT/gpu_results.json and
prints a Markdown block as soon as it finishes, sections run in order of importance, and a section
is skipped when less time is left than it needs (--budget). No checkpoint is read: the targets have
random weights of the real shapes (SmolLM2-135M, and a Llama-3.2-1B-shaped model), because step
and kernel timings do not depend on weight values and acceptance is measured on CPU with the
trained heads (the step has a fixed shape: a step costs the same whatever it accepts).

Sections:
  1. kernels: Pallas tree attention vs the XLA path vs a float32 HIGHEST-precision reference,
     float32 and bfloat16, ragged rows, masked (rejected) slots, random trees.
  2. verify cost: one target forward over T tree tokens (T = 1..64), XLA and Pallas attention.
  3. generation: plain and speculative greedy decoding (EAGLE-2 tree, EAGLE-3, Medusa, MTP, n-gram)
     end to end, per-step time, and equality of every speculative output with plain decoding.
  4. draft cost per depth (EAGLE and EAGLE-3 chains, and their dynamic trees).
  5. kernel timings at serving shapes (cache 4k and 32k slots).
  6. bfloat16 and batch 4; 7. the 1B-shaped target.

    SPEC_JAX_DEFAULT_XLA_FLAGS=0 python scripts/gpu_check.py --out DIR [--budget 420]
        [--sections 1_,5b,8_] [--quick]      (--quick: tiny shapes, a dry run on CPU)
Results on an H200: docs/gpu.md.
"""
import argparse
import json
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import spec_jax
from pallas_kernels import tree_attention
from pallas_kernels.reference import tree_attention_reference
from spec_jax.config import ModelConfig
from spec_jax.tree import ancestor_mask_np

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
               tie_word_embeddings=True, max_position_embeddings=8192)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=5e5,
                tie_word_embeddings=True, max_position_embeddings=8192)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


class Run:
    def __init__(self, out: Path, budget: float, only=()):
        self.out, self.t0, self.budget, self.only = out, time.perf_counter(), budget, only
        self.results = {"jax": jax.__version__, "backend": jax.default_backend(),
                        "device": jax.devices()[0].device_kind, "sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def section(self, name, fn, needs: float):
        if self.only and not any(name.startswith(x) for x in self.only):
            return
        if self.left() < needs:
            print(f"\n## {name}: skipped ({self.left():.0f} s left, needs {needs:.0f})", flush=True)
            self.results["sections"][name] = {"skipped": True}
        else:
            t0 = time.perf_counter()
            print(f"\n## {name}", flush=True)
            try:
                self.results["sections"][name] = fn()
            except Exception as e:  # noqa: BLE001 -- report and go on: the time on the device is short
                traceback.print_exc()
                self.results["sections"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            self.results["sections"][name + "_seconds"] = time.perf_counter() - t0
        (self.out / "gpu_results.json").write_text(json.dumps(self.results, indent=1, default=str))


def loop_time(f, x0, reps: int = 3) -> float:
    """Seconds per call of f inside one fori_loop of n dependent calls (no per-call dispatch)."""
    from spec_jax.sizing import _best_time

    n = 20
    run = jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda _, y: f(y), x))
    return _best_time(run, (x0,), reps) / n


def pallas_impl() -> str:
    """The Pallas attention this backend runs: compiled on GPU/TPU, interpreted on CPU."""
    return "pallas" if jax.default_backend() in ("gpu", "tpu") else "pallas_interpret"


def attn_inputs(b, t, kvh, g, d, s, lengths, dtype, seed):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    valid = rng.random((b, s)) < 0.8  # rejected tree positions stay in the cache, masked
    parent = np.asarray([-1] + [int(rng.integers(0, i)) for i in range(1, t)])
    mask = np.broadcast_to(ancestor_mask_np(parent), (b, t, t))
    return (f(b, t, kvh * g, d), f(b, kvh, s, d), f(b, kvh, s, d), jnp.asarray(valid),
            jnp.asarray(lengths, jnp.int32), f(b, t, kvh, d), f(b, t, kvh, d), jnp.asarray(mask))


def kernels(quick):
    impl = pallas_impl()
    cases = [(1, 1, 3, 3, 64, 1024, [700]), (2, 8, 3, 3, 64, 2048, [1500, 37]),
             (3, 32, 8, 4, 128, 4096, [4096, 0, 2900]), (2, 64, 3, 3, 64, 1000, [999, 400])]
    if quick:
        cases = cases[:2]
    rows = []
    print("| B | T | KVH x G | D | slots | dtype | impl | max err vs f32 HIGHEST ref |")
    print("|---|---|---|---|---|---|---|---|")
    for i, case in enumerate(cases):
        for dt in (jnp.float32, jnp.bfloat16):
            args = attn_inputs(*case, dt, seed=i)
            f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
            with jax.default_matmul_precision("highest"):
                ref = np.asarray(jax.jit(tree_attention_reference)(*f32))
            for im in ("xla", impl):
                out = jax.jit(lambda *a, im=im: tree_attention(*a, impl=im))(*args)
                err = float(np.max(np.abs(np.asarray(out, np.float32) - ref)))
                b, t, kvh, g, d, s, _ = case
                rows.append(dict(b=b, t=t, kvh=kvh, g=g, d=d, slots=s, dtype=jnp.dtype(dt).name,
                                 impl=im, max_err=err))
                print(f"| {b} | {t} | {kvh}x{g} | {d} | {s} | {jnp.dtype(dt).name} | {im} | {err:.1e} |",
                      flush=True)
    # float32 matmul precision of this backend's default (TF32 on recent NVIDIA GPUs?)
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    exact = x.astype(np.float64) @ x.astype(np.float64)
    errs = {}
    for p in ("default", "highest"):
        with jax.default_matmul_precision(p):
            y = np.asarray(jax.jit(jnp.matmul)(x, x), np.float64)
        errs[p] = float(np.max(np.abs(y - exact)) / np.max(np.abs(exact)))
    print(f"\nfloat32 512x512 matmul, max error relative to float64: default {errs['default']:.1e}, "
          f"highest {errs['highest']:.1e}")
    return {"rows": rows, "matmul_rel_err": errs}


def make_target(shape, dtype="float32", seed=0):
    cfg = ModelConfig(**shape, dtype=dtype)
    t = spec_jax.random_target(cfg, seed=seed, scale=0.02)
    if dtype != "float32":
        t.params = jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), t.params)
    return t


def verify_cost(target, impls, sizes=(1, 2, 4, 8, 16, 32, 64), batch=1):
    from spec_jax import sizing

    out = {}
    for im in impls:
        lat = sizing.verify_latency(target, sizes, batch=batch, attn_impl=im)
        out[im] = {str(k): v for k, v in lat.items()}
        print(f"{im}: " + ", ".join(f"T={k} {v * 1e3:.2f} ms" for k, v in lat.items())
              + "  (x T=1: " + ", ".join(f"{v / lat[1]:.2f}" for v in lat.values()) + ")", flush=True)
    return out


def prompts(vocab, n, seed=0, length=100):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def heads_for(target, quick):
    dv = 256 if quick else 8192
    return {"eagle": (spec_jax.init_draft(target, "eagle", d2t=list(range(dv))), "dynamic:8,5,32"),
            "eagle3": (spec_jax.init_draft(target, "eagle3", draft_vocab=dv), "dynamic:8,6,32"),
            "medusa": (spec_jax.init_draft(target, "medusa"), None),
            "mtp": (spec_jax.init_draft(target, "mtp"), None),
            "ngram": ("ngram", None)}


def generation(target, impls, methods, quick, batch=1, tokens=256, repeats=2):
    """Best-of-`repeats` tokens/s and per-step ms of each (method, impl); equality with plain."""
    hs = heads_for(target, quick)
    ps = prompts(target.cfg.vocab_size, batch)
    rows, plain_tokens = [], {}
    print("| method | attn | tok/s | ms/step | steps | tau | compile s | equal to plain |")
    print("|---|---|---|---|---|---|---|---|")
    for im in impls:
        for m in ("plain",) + tuple(methods):
            draft, tree = (None, None) if m == "plain" else hs[m]
            best, compile_s = None, 0.0
            for _ in range(repeats):
                rs = spec_jax.generate_batch(target, ps, tokens, chat=False, draft=draft, tree=tree,
                                             attn_impl=im, stop_at_eos=False)
                compile_s += rs[0].stats["compile_seconds"]
                if best is None or rs[0].stats["wall_seconds"] < best[0].stats["wall_seconds"]:
                    best = rs
            st = best[0].stats
            toks = [r.token_ids for r in best]
            steps = st["batch_steps"]
            n_new = sum(len(t) for t in toks)
            tau = float(np.mean([r.stats["mean_accepted"] for r in best]))
            if m == "plain":
                plain_tokens[im] = toks
                equal = "-"
            else:
                ref = plain_tokens[im]
                equal = sum(a == b for a, b in zip(toks, ref))
                first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                         for a, b in zip(toks, ref)]
            row = dict(method=m, attn=im, batch=batch, tokens_per_second=n_new / st["wall_seconds"],
                       ms_per_step=st["wall_seconds"] / max(steps, 1) * 1e3, steps=steps, tau=tau,
                       compile_seconds=compile_s, tree_tokens=st["tree_tokens"],
                       equal_rows=equal, rows=batch)
            if m != "plain":
                row["first_divergence"] = first
            rows.append(row)
            eq = "-" if m == "plain" else f"{equal}/{batch}" + ("" if equal == batch else f" (first diff at {first})")
            print(f"| {m} | {im} | {row['tokens_per_second']:.1f} | {row['ms_per_step']:.2f} | {steps} | "
                  f"{tau:.2f} | {row['compile_seconds']:.1f} | {eq} |", flush=True)
    return rows


def draft_cost(target, quick):
    from spec_jax import sizing
    from spec_jax.tree import StaticTree

    hs = heads_for(target, quick)
    out = {}
    for m in ("eagle", "eagle3"):
        heads, dyn = hs[m]
        lat = {str(d): sizing.draft_latency(target, heads, StaticTree.chain(d)) for d in (1, 2, 3, 4, 6)}
        lat[dyn] = sizing.draft_latency(target, heads, dyn)
        out[m] = lat
        print(f"{m}: " + ", ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in lat.items()), flush=True)
    return out


def kernel_timing(quick, slots=(4096, 32768), ts=(1, 8, 32, 64)):
    impl = pallas_impl()
    layouts = {"smollm2": (3, 3, 64), "llama3-8b": (8, 4, 128)}
    rows = []
    print("| layout | slots (written) | T | xla us | pallas us | pallas / xla |")
    print("|---|---|---|---|---|---|")
    for name, (kvh, g, d) in layouts.items():
        for s in ((1024,) if quick else slots):
            for t in ((1, 8) if quick else ts):
                args = attn_inputs(1, t, kvh, g, d, s, [s // 2], jnp.float32, seed=t)
                us = {}
                for im in ("xla", impl):
                    def f(q, im=im):
                        o = tree_attention(q, *args[1:], impl=im)
                        return q + 1e-3 * o  # the next call depends on this one

                    us[im] = loop_time(f, args[0]) * 1e6
                rows.append(dict(layout=name, slots=s, t=t, xla_us=us["xla"], pallas_us=us[impl]))
                print(f"| {name} | {s} ({s // 2}) | {t} | {us['xla']:.1f} | {us[impl]:.1f} | "
                      f"{us[impl] / us['xla']:.2f} |", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/gpu")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds this script may use")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run)")
    ap.add_argument("--sections", default="", help="comma-separated name prefixes to run (all)")
    a = ap.parse_args()
    run = Run(Path(a.out), a.budget, tuple(x for x in a.sections.split(",") if x))
    acc = jax.default_backend() in ("gpu", "tpu")
    impls = ("xla", "pallas") if acc else ("xla",)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}, "
          f"default matmul precision {jax.config.jax_default_matmul_precision}", flush=True)
    small = TINY if a.quick else SMOLLM2
    tokens = 32 if a.quick else 256
    state = {}

    def target():
        if "t" not in state:
            state["t"] = make_target(small)
        return state["t"]

    run.section("1_kernels", lambda: kernels(a.quick), 20)
    run.section("2_verify_cost_smollm2_f32", lambda: verify_cost(target(), impls), 40)
    run.section("3_generation_smollm2_f32", lambda: generation(
        target(), impls[-1:], ("eagle", "eagle3", "ngram", "medusa", "mtp"), a.quick, tokens=tokens), 90)
    if acc:  # the XLA attention path too (on CPU section 3 already used it)
        run.section("3b_generation_smollm2_f32_xla", lambda: generation(
            target(), ("xla",), ("eagle",), a.quick, tokens=tokens), 60)
    run.section("4_draft_cost_smollm2_f32", lambda: draft_cost(target(), a.quick), 40)
    run.section("5_kernel_timing", lambda: kernel_timing(a.quick), 40)
    run.section("5b_kernel_timing_long", lambda: kernel_timing(a.quick, (32768,), (1, 8, 32)), 30)

    def highest():  # is plain vs speculative equality a matter of TF32 matmuls?
        with jax.default_matmul_precision("highest"):
            return {"verify": verify_cost(make_target(small), impls[-1:], sizes=(1, 8, 32)),
                    "generation": generation(make_target(small), impls[-1:],
                                             ("ngram", "medusa", "eagle"), a.quick, tokens=tokens)}

    run.section("8_f32_highest_precision", highest, 60)
    run.section("6_generation_smollm2_bf16", lambda: generation(
        make_target(small, "bfloat16"), impls[-1:], ("eagle",), a.quick, tokens=tokens), 60)
    run.section("6b_generation_smollm2_f32_batch4", lambda: generation(
        target(), impls[-1:], ("eagle",), a.quick, batch=4, tokens=tokens), 60)

    def big():
        t = make_target(TINY if a.quick else LLAMA_1B, "bfloat16", seed=1)
        return {"verify": verify_cost(t, impls[-1:]),
                "generation": generation(t, impls[-1:], ("eagle",), a.quick, tokens=tokens)}

    run.section("7_llama1b_shape_bf16", big, 90)
    print(f"\ntotal {time.perf_counter() - run.t0:.0f} s; results in {run.out / 'gpu_results.json'}")


if __name__ == "__main__":
    main()
