"""The jitted draft-verify loop: `prefill`, then `decode`, a `lax.while_loop` over fixed-shape steps.

One step: the drafter proposes a tree of T nodes (root = last accepted token); the target scores
the whole tree in one forward pass (tree mask over its committed cache + the tree's own keys, RoPE
position = length + depth); verification accepts the longest agreeing path and draws the bonus
token; only the accepted path's K/V is scattered into the target cache (at most D+1 rows a layer),
so rejected nodes never occupy a slot and everything past `length` stays masked as invalid.
Plain decoding is the same loop with the one-node tree of `heads.base.Drafter`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.cache import KVCache, commit
from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError
from spec_jax.fallback import Fallback
from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext
from spec_jax.models.llama import causal_mask, forward, lm_head
from spec_jax.verify import sample_token, split_rows, verify

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
# a row whose target logits turned non-finite (NaN/inf): it stops before emitting from them
FINISH_ERROR = 3


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Static settings of one compiled loop."""

    out_len: int  # output tokens per row: at least the longest row's limit (each row stops at its
    # own, an input of the loop; `generate_batch` rounds it up to a multiple of 32)
    greedy: bool = True
    eos_ids: tuple[int, ...] = ()
    attn_impl: str = "auto"
    accept_rule: str = "exact"
    fallback: Fallback | None = None  # plain steps where a row's trees do not pay (spec_jax.fallback)


PRECISIONS = ("default", "high", "highest")


def loop_precision(cfg: ModelConfig, precision: str | None = None) -> str:
    """Matmul precision the loop is compiled under: `precision`, or for None "highest" for float32
    targets and the backend's "default" otherwise.

    On NVIDIA GPUs the default runs float32 matmuls in TF32, whose rounding differs between a
    one-token pass and a tree-sized pass; on an H200 greedy speculative output then drifted from
    plain greedy output (first difference at token 169 of 256), and matched it under "highest"
    (scripts/gpu_check.py, docs/gpu.md). On CPU both are the same float32 arithmetic."""
    if precision is None:
        return "highest" if cfg.dtype == "float32" else "default"
    if precision not in PRECISIONS:
        raise SpecJaxError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return precision


@flax.struct.dataclass
class LoopState:
    cache: KVCache
    dstate: Any
    root: jax.Array  # [B] last emitted token (its K/V not yet in the cache)
    out: jax.Array  # [B, N + D + 1] emitted tokens
    n_out: jax.Array  # [B]
    finish: jax.Array  # [B] FINISH_*
    calls: jax.Array  # [] target forward passes after prefill
    hist: jax.Array  # [B, D + 1] accepted draft tokens per step (histogram)
    drafted: jax.Array  # [B, N + D + 1] int8, 1 where `out` holds an accepted draft token (0: a
    # step's bonus token, or the prefill's): each step emits a run of 1s and its 0 (unless cut)
    key: jax.Array  # [B, 2] each row's own random key
    fb: Any = None  # the fallback's FallbackState (plain steps where trees do not pay), or None


def _emit(state_out, n_out, finish, new, count, eos_ids, max_new, active, drafted=None,
          new_drafted=None):
    """Append new [B, A] (count [B] valid) to the outputs, stopping at EOS or max_new; and
    new_drafted [B, A] to `drafted` at the same positions (when given). Returns (out, n_out,
    finish, drafted)."""
    b, a = new.shape
    j = jnp.arange(a)[None, :]
    count = jnp.where(active, count, 0)
    if eos_ids:
        is_eos = jnp.isin(new, jnp.asarray(eos_ids)) & (j < count[:, None])
        first = jnp.min(jnp.where(is_eos, j, a), axis=1)
        hit_eos = first < count
        count = jnp.where(hit_eos, first + 1, count)
    else:
        hit_eos = jnp.zeros((b,), bool)
    room = max_new - n_out
    hit_len = count >= room
    count = jnp.minimum(count, room)
    idx = jnp.where(j < count[:, None], n_out[:, None] + j, state_out.shape[1])
    out = state_out.at[jnp.arange(b)[:, None], idx].set(new, mode="drop")
    if drafted is not None:
        drafted = drafted.at[jnp.arange(b)[:, None], idx].set(new_drafted, mode="drop")
    finish = jnp.where(active & hit_eos, FINISH_STOP,
                       jnp.where(active & hit_len, FINISH_LENGTH, finish))
    return out, n_out + count, finish, drafted


def prefill(params, dparams, tokens, prompt_len, cache: KVCache, key, temperature, top_p,
            row_max_new, *, cfg: ModelConfig, drafter: Drafter, settings: LoopSettings) -> LoopState:
    """The prompt's forward pass, its first token and the drafter's state: the loop's start.
    tokens [B, P] right-padded, prompt_len [B], key [B, 2] (each row's own), temperature and
    top_p [B] (per row; read only when the settings are not greedy), row_max_new [B] each row's
    new-token limit (at most settings.out_len). No shape of the state depends on P, so one
    compiled `decode` serves every prompt length that fits the cache. Pure; jit it."""
    b, p = tokens.shape
    n_slots = cache.num_slots
    t_size, depth = drafter.tree_size, drafter.max_depth
    greedy, out_len = settings.greedy, settings.out_len
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    fwd = forward(params, cfg, tokens, positions, cache, causal_mask(b, p),
                  aux_layers=drafter.aux_layers, return_logits=False, attn_impl=settings.attn_impl,
                  rows=prompt_len)  # the padding's products are skipped
    rows = jnp.arange(b)
    last_h = fwd.hidden[rows, prompt_len - 1]  # [B, H]
    key, k0 = split_rows(key, 2)
    first_logits = lm_head(params, cfg, last_h)
    first = sample_token(first_logits, k0, greedy, temperature, top_p)
    first_ok = jnp.isfinite(first_logits[rows, first])  # [B] see `_emitted_finite`
    select = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = commit(cache, fwd.k_new, fwd.v_new, positions, select, prompt_len)
    dstate = drafter.init_state(dparams, params, cfg, b, n_slots)
    dstate = drafter.after_prefill(dparams, params, cfg, dstate, PrefillContext(
        tokens=tokens, prompt_len=prompt_len, hidden=fwd.hidden, aux_hidden=fwd.aux_hidden,
        first_token=first))
    out = jnp.zeros((b, out_len + depth + 1), jnp.int32)
    finish = jnp.full((b,), FINISH_RUNNING, jnp.int32)
    out, n_out, finish, _ = _emit(out, jnp.zeros((b,), jnp.int32), finish, first[:, None],
                               jnp.ones((b,), jnp.int32), settings.eos_ids, row_max_new,
                               first_ok)
    finish = jnp.where(first_ok, finish, FINISH_ERROR)
    finish = jnp.where((finish == FINISH_RUNNING) & (cache.length + t_size > n_slots),
                       FINISH_LENGTH, finish)
    fb = (None if settings.fallback is None
          else settings.fallback.init(drafter, cfg, b, fwd.hidden.dtype))
    return LoopState(cache=cache, dstate=dstate, root=first, out=out, n_out=n_out, finish=finish,
                     calls=jnp.zeros((), jnp.int32), hist=jnp.zeros((b, depth + 1), jnp.int32),
                     drafted=jnp.zeros(out.shape, jnp.int8), key=key, fb=fb)


def _emitted(tree, verdict, depth: int):
    """The tokens a step emits [B, depth + 1]: the accepted draft tokens (path[1:]), then the
    bonus at index n_accepted - 1 (later entries are not emitted)."""
    b = tree.tokens.shape[0]
    j = jnp.arange(depth + 1)[None, :]
    nxt = jnp.concatenate([verdict.path[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
    toks = tree.tokens[jnp.arange(b)[:, None], jnp.maximum(nxt, 0)]
    return jnp.where(j == (verdict.n_accepted[:, None] - 1), verdict.bonus[:, None], toks)


def _emitted_finite(logits, verdict, new):
    """[B] whether every token a row emits this step has a finite logit at the node that chose
    it: a row whose target logits turned NaN or infinite (every logit, as non-finite weights or
    activations make them) would otherwise emit argmax's token 0 or a sample of garbage. B x
    (depth + 1) gathered values: no pass over the [B, T, V] logits."""
    b, a = new.shape
    node = jnp.maximum(verdict.path[:, :a], 0)
    vals = logits[jnp.arange(b)[:, None], node, new]
    emitted = jnp.arange(a)[None, :] < verdict.n_accepted[:, None]
    return jnp.all(jnp.isfinite(vals) | ~emitted, axis=-1)


def decode(params, dparams, state: LoopState, temperature, top_p, row_max_new, until_calls, *,
           cfg: ModelConfig, drafter: Drafter, settings: LoopSettings):
    """The speculative loop from `prefill`'s state until every row stops or `until_calls` (an
    int32 scalar, an input: one compiled loop serves any budget) target calls have run since the
    prefill; returns the state (its `out` [B, N + D + 1]: the first n_out [B] of each row are its
    tokens), whose buffers are the donated state's. A state returned at the budget goes back in
    with a larger one to run on: `generate` passes no limit (one call), `stream` a few steps at a
    time. Pure; jit it."""
    b = state.root.shape[0]
    rows = jnp.arange(b)
    n_slots = state.cache.num_slots
    t_size, depth = drafter.tree_size, drafter.max_depth
    greedy = settings.greedy

    def cond(s: LoopState):
        return jnp.any(s.finish == FINISH_RUNNING) & (s.calls < until_calls)

    fallback = settings.fallback

    def score_tree(s: LoopState, dstate, kd, kv):
        """Draft a tree, score it, verify it: (tree, drafter state, forward outputs, verdict)."""
        with jax.named_scope("draft"):
            tree, dstate = drafter.propose(dparams, params, cfg, dstate, s.root, kd)
        with jax.named_scope("target"):
            fwd = forward(params, cfg, tree.tokens, s.cache.length[:, None] + tree.depth, s.cache,
                          tree.mask, aux_layers=drafter.aux_layers, attn_impl=settings.attn_impl)
        with jax.named_scope("verify"):
            verdict = verify(fwd.logits, tree, kv, greedy=greedy, max_depth=depth,
                             temperature=temperature, top_p=top_p, accept_rule=settings.accept_rule)
            finite = _emitted_finite(fwd.logits, verdict, _emitted(tree, verdict, depth))
        return tree, dstate, fwd._replace(logits=finite), verdict  # logits: [B] all finite

    def score_root(s: LoopState, dstate, kd, kv):
        """`score_tree`'s outputs for a plain step (the root alone), padded to the tree's shapes."""
        tree, _ = Drafter().propose((), params, cfg, (), s.root, kd)
        with jax.named_scope("target"):
            fwd = forward(params, cfg, tree.tokens, s.cache.length[:, None], s.cache, tree.mask,
                          aux_layers=drafter.aux_layers, attn_impl=settings.attn_impl)
        with jax.named_scope("verify"):
            verdict = verify(fwd.logits, tree, kv, greedy=greedy, max_depth=0,
                             temperature=temperature, top_p=top_p, accept_rule=settings.accept_rule)
            finite = _emitted_finite(fwd.logits, verdict, _emitted(tree, verdict, 0))
        pad = lambda x, axis, value=0: jnp.pad(  # noqa: E731
            x, [(0, t_size - 1 if i == axis else 0) for i in range(x.ndim)], constant_values=value)
        k = drafter.max_children
        tree = tree._replace(tokens=pad(tree.tokens, 1), parent=pad(tree.parent, 1, -1),
                             depth=pad(tree.depth, 1), mask=pad(pad(tree.mask, 1), 2),
                             children=jnp.pad(tree.children, ((0, 0), (0, t_size - 1), (0, k - 1)),
                                              constant_values=-1))
        fwd = fwd._replace(logits=finite, hidden=pad(fwd.hidden, 1), k_new=pad(fwd.k_new, 2),
                           v_new=pad(fwd.v_new, 2),
                           aux_hidden=None if fwd.aux_hidden is None else pad(fwd.aux_hidden, 1))
        verdict = verdict._replace(path=jnp.pad(verdict.path, ((0, 0), (0, depth)),
                                                constant_values=-1))
        return tree, dstate, fwd, verdict

    def body(s: LoopState):
        key, kd, kv = split_rows(s.key, 3)
        active = s.finish == FINISH_RUNNING
        root_pos = s.cache.length
        dstate, fb = s.dstate, s.fb
        if fallback is not None:
            use_tree = fallback.wants_tree(fb, active)
            with jax.named_scope("draft_update"):  # the drafter catches up on the plain steps
                dstate, fb = jax.lax.cond(
                    use_tree, lambda: fallback.flush(drafter, dparams, params, cfg, dstate, fb,
                                                     s.root),
                    lambda: (dstate, fb))
            # only reads of the cache inside the branches: its writes (commit) stay outside, in
            # place (written inside, XLA copied every layer's cache buffer each step)
            tree, dstate, fwd, verdict = jax.lax.cond(
                use_tree, score_tree, score_root, s, dstate, kd, kv)
            k_new, v_new = fwd.k_new, fwd.v_new
        else:
            tree, dstate, fwd, verdict = score_tree(s, dstate, kd, kv)
            # The commit writes the cache in place; tie it to the scores so XLA orders it after
            # every layer's cache read (plain decoding's commit does not depend on them otherwise,
            # and XLA then copies each cache buffer every step to keep the reads safe).
            k_new, v_new, _ = jax.lax.optimization_barrier((fwd.k_new, fwd.v_new, verdict))
        positions = root_pos[:, None] + tree.depth
        n_acc = jnp.where(active, verdict.n_accepted, 0)
        cache = commit(s.cache, k_new, v_new, positions, jnp.maximum(verdict.path, 0), n_acc)
        new = _emitted(tree, verdict, depth)
        broken = active & ~fwd.logits  # non-finite logits: the row stops, emitting nothing
        drafted = (jnp.arange(depth + 1)[None, :] < verdict.n_accepted[:, None] - 1)
        out, n_out, finish, drafted = _emit(s.out, s.n_out, s.finish, new, verdict.n_accepted,
                                            settings.eos_ids, row_max_new, active & ~broken,
                                            s.drafted, drafted.astype(jnp.int8))
        finish = jnp.where(broken, FINISH_ERROR, finish)
        finish = jnp.where((finish == FINISH_RUNNING) & (cache.length + t_size > n_slots),
                           FINISH_LENGTH, finish)
        root = jnp.where(active, verdict.bonus, s.root)
        ctx = VerifyContext(tree=tree, path=verdict.path, n_accepted=verdict.n_accepted,
                            bonus=verdict.bonus, hidden=fwd.hidden, aux_hidden=fwd.aux_hidden,
                            root_pos=root_pos, active=active)
        with jax.named_scope("draft_update"):
            if fallback is not None:
                dstate, fb = jax.lax.cond(use_tree, lambda: after_tree(dstate, fb, ctx),
                                          lambda: after_root(dstate, fb, ctx, root))
            else:
                dstate = drafter.after_verify(dparams, params, cfg, dstate, ctx)
        hist = s.hist.at[rows, verdict.n_accepted - 1].add(active.astype(jnp.int32))
        return LoopState(cache=cache, dstate=dstate, root=root, out=out, n_out=n_out,
                         finish=finish, calls=s.calls + 1, hist=hist, drafted=drafted, key=key,
                         fb=fb)

    def after_tree(dstate, fb, ctx: VerifyContext):
        dstate = drafter.after_verify(dparams, params, cfg, dstate, ctx)
        return dstate, fallback.after_tree(fb, ctx.n_accepted, ctx.active)

    def after_root(dstate, fb, ctx: VerifyContext, root):
        """A plain step: buffer the drafter's inputs; a full buffer goes to the drafter now."""
        aux = None if ctx.aux_hidden is None else ctx.aux_hidden[:, 0]
        fb = fallback.buffer(fb, ctx.tree.tokens[:, 0], ctx.hidden[:, 0], aux, ctx.root_pos,
                             ctx.active)
        return jax.lax.cond(fallback.full(fb),
                            lambda: fallback.flush(drafter, dparams, params, cfg, dstate, fb, root),
                            lambda: (dstate, fb))

    return jax.lax.while_loop(cond, body, state)


def compiled_prefill(cfg: ModelConfig, drafter: Drafter, settings: LoopSettings):
    """The jitted `prefill` for these static settings; the cache (argument 4) is donated."""
    fn = functools.partial(prefill, cfg=cfg, drafter=drafter, settings=settings)
    return jax.jit(fn, donate_argnums=(4,))


def compiled_loop(cfg: ModelConfig, drafter: Drafter, settings: LoopSettings):
    """The jitted `decode` loop for these static settings; the state (argument 2) is donated."""
    fn = functools.partial(decode, cfg=cfg, drafter=drafter, settings=settings)
    return jax.jit(fn, donate_argnums=(2,))
