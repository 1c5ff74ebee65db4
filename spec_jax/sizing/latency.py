"""Costs, measured as they run inside the generation loop on this backend and batch: the target's
forward over T tree tokens (`verify_latency`) and a drafter's step for a tree (`draft_latency`)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.step import loop_precision


def verify_latency(target, sizes, batch: int = 1, fill: int = 256, iters: int = 8,
                   repeats: int = 4, attn_impl: str = "auto") -> dict:
    """Seconds of one target forward over T block tokens against `fill` cached tokens, as it runs
    inside the generation loop: `iters` dependent forwards in one `fori_loop` (so per-call dispatch
    is not counted), per forward, best of `repeats`. The sizes take turns within each repeat, so a
    burst of load on a shared host slows one reading of each size rather than every reading of
    one size (it once made 8 tokens look 1.5x the cost of 4, and every 8-token tree lost)."""
    from pallas_kernels.cpu.argmax import argmax
    from spec_jax.models.llama import causal_mask, forward

    cfg = target.cfg
    runs = {}
    for t in sizes:
        cache = target.new_cache(batch, fill + t + 128)
        cache = cache.replace(length=jnp.full((batch,), fill, jnp.int32),
                              valid=cache.valid.at[:, :fill].set(True))
        pos = fill + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))

        def run(params, cache, toks, t=t, pos=pos):
            def body(_, tk):  # the next block depends on this one's logits: no hoisting
                logits = forward(params, cfg, tk, pos, cache, causal_mask(batch, t),
                                 attn_impl=attn_impl).logits
                return argmax(logits)

            return jax.lax.fori_loop(0, iters, body, toks)

        with jax.default_matmul_precision(loop_precision(cfg)):  # as generate compiles it
            f = jax.jit(run).lower(target.params, cache, jnp.zeros((batch, t), jnp.int32)).compile()
        runs[t] = (f, (target.params, cache, jnp.zeros((batch, t), jnp.int32)))
    best = {t: float("inf") for t in sizes}
    for _ in range(repeats + 1):  # the first round warms up
        for t, (f, args) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            best[t] = min(best[t], time.perf_counter() - t0)
    return {t: v / iters for t, v in best.items()}


def draft_latency(target, heads, tree, batch: int = 1, fill: int = 256, iters: int = 8,
                  repeats: int = 3, datastore=None) -> float:
    """Seconds of one draft step for `tree` as it runs inside the generation loop: propose, then
    the bookkeeping after a verification (re-running the accepted tokens into the draft's cache),
    `iters` steps in one `fori_loop` after a `fill`-token prefill, per step, best of `repeats`."""
    from spec_jax.drafting import build
    from spec_jax.heads.base import PrefillContext, VerifyContext
    from spec_jax.tree_spec import parse

    spec = parse(tree)  # the draft model's attention as the sizing has always timed it: "xla"
    drafter, dparams = build(target, heads, spec, datastore if spec.ds else None, attn_impl="xla")
    cfg = target.cfg
    h, n_aux = cfg.hidden_size, len(drafter.aux_layers)
    slots = fill + iters * (drafter.max_depth + 1) + drafter.tree_size + 64
    feats = lambda n: jnp.full((batch, n, h), 0.1)  # noqa: E731
    auxs = lambda n: jnp.full((batch, n, n_aux * h), 0.1) if n_aux else None  # noqa: E731

    def prefill(dparams, tparams):
        state = drafter.init_state(dparams, tparams, cfg, batch, slots)
        return drafter.after_prefill(dparams, tparams, cfg, state, PrefillContext(
            tokens=jnp.ones((batch, fill), jnp.int32), prompt_len=jnp.full((batch,), fill, jnp.int32),
            hidden=feats(fill), aux_hidden=auxs(fill), first_token=jnp.ones((batch,), jnp.int32)))

    def steps(dparams, tparams, n):
        def body(i, carry):
            state, root = carry
            tree_, state = drafter.propose(dparams, tparams, cfg, state, root, jax.random.PRNGKey(0))
            t = tree_.tokens.shape[1]
            path = jnp.full((batch, drafter.max_depth + 1), -1, jnp.int32).at[:, 0].set(0)
            state = drafter.after_verify(dparams, tparams, cfg, state, VerifyContext(
                tree=tree_, path=path, n_accepted=jnp.ones((batch,), jnp.int32),
                bonus=tree_.tokens[:, -1], hidden=feats(t), aux_hidden=auxs(t),
                root_pos=jnp.full((batch,), fill, jnp.int32) + i, active=jnp.ones((batch,), bool)))
            return state, tree_.tokens[:, -1]

        return jax.lax.fori_loop(0, n, body, (prefill(dparams, tparams), jnp.ones((batch,), jnp.int32)))

    f = jax.jit(steps, static_argnums=2)
    with jax.default_matmul_precision(loop_precision(cfg)):  # as generate compiles it
        whole = _best_time(f, (dparams, target.params, iters), repeats)
        once = _best_time(f, (dparams, target.params, 0), repeats)  # prefill alone
    return max(whole - once, 0.0) / iters


def _best_time(f, args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _interp(table: dict, t: int) -> float:
    xs = sorted(table)
    return float(np.interp(t, xs, [table[x] for x in xs]))
