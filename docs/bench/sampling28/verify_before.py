"""Verification: accept the longest path of the draft tree that the target agrees with.

Greedy: a child is accepted iff it is the target's argmax at its parent; the bonus token is the
argmax after the last accepted node.

Sampling (temperature > 0, top-p): recursive rejection sampling for deterministic (top-k) drafts,
as in EAGLE-2/SGLang/vLLM: at the current node, try its children in order; accept child x with
probability p(x) / sum(p), where p is the target's processed distribution at the node; on rejection
set p(x) = 0 (the residual max(p - q, 0) with q one-hot at x) and try the next child; if all are
rejected, the bonus token is drawn from the residual. The output distribution is exactly the
target's, whatever the draft proposes.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.cpu.argmax import argmax
from spec_jax.tree import Tree


class Verdict(NamedTuple):
    path: jax.Array  # [B, D+1] accepted node ids (root first), -1 padded
    n_accepted: jax.Array  # [B] nodes on the path including the root (>= 1)
    bonus: jax.Array  # [B] the target's token after the path


def target_probs(logits, temperature, top_p):
    """Processed target distribution: temperature, then nucleus (top-p). logits [..., V] f32.

    Nucleus keeps the smallest set of most likely tokens with mass >= top_p (ties at its edge
    included): every token with p >= t for the largest t whose kept mass is still >= top_p. t is
    found by bisection over the bit patterns of non-negative floats (31 masked sums over V)
    rather than by sorting V: XLA's CPU sort of [32, 49152] took ~0.7 s, more than a whole
    decode step. top_p >= 1 skips it."""
    logits = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    probs = jax.nn.softmax(logits, axis=-1)

    def nucleus(probs):
        def kept_mass(bits):
            t = jax.lax.bitcast_convert_type(bits, jnp.float32)
            return jnp.sum(jnp.where(probs >= t, probs, 0.0), axis=-1, keepdims=True)

        def halve(_, lo_hi):
            lo, hi = lo_hi
            mid = lo + (hi - lo) // 2
            ok = kept_mass(mid) >= top_p
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)  # t = 0 keeps everything
        hi = jnp.full_like(lo, jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32) + 1)
        lo, _ = jax.lax.fori_loop(0, 31, halve, (lo, hi))
        kept = jnp.where(probs >= jax.lax.bitcast_convert_type(lo, jnp.float32), probs, 0.0)
        return kept / jnp.sum(kept, axis=-1, keepdims=True)

    return jax.lax.cond(top_p < 1.0, nucleus, lambda p: p, probs)


def sample_token(logits, key, greedy: bool, temperature, top_p):
    """One token per row from logits [B, V]."""
    if greedy:
        return argmax(logits)
    p = target_probs(logits, temperature, top_p)
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)


def greedy_walk(best, tree: Tree, max_depth: int) -> Verdict:
    """Greedy verification without a walk: best [B, T] is the target's argmax at every node.

    A node is accepted when it is listed among its parent's children, its token is its parent's
    argmax, and the same holds for all its ancestors (tree.mask); the path ends at the deepest
    accepted node. Sibling tokens are distinct in drafted trees, so the accepted nodes form one
    chain; where a graft repeats a token, the deeper of the equal paths is taken (the tokens,
    hence the output, are the same)."""
    b, t = best.shape
    rows = jnp.arange(b)
    listed = jnp.zeros((b, t), bool).at[rows[:, None, None], jnp.maximum(tree.children, 0)].max(
        tree.children >= 0).at[:, 0].set(True)
    parent_best = jnp.take_along_axis(best, jnp.maximum(tree.parent, 0), axis=1)
    ok = listed & ((tree.tokens == parent_best) | (jnp.arange(t) == 0))  # [B, T]
    accepted = jnp.all(~tree.mask | ok[:, None, :], axis=-1)  # [B, T] the node and its ancestors
    cur = jnp.argmax(jnp.where(accepted, tree.depth, -1), axis=1).astype(jnp.int32)
    on_path = tree.mask[rows, cur]  # [B, T] ancestors-or-self of the deepest accepted node
    at_depth = on_path[:, None, :] & (tree.depth[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    path = jnp.where(jnp.any(at_depth, -1), jnp.argmax(at_depth, -1), -1).astype(jnp.int32)
    return Verdict(path=path, n_accepted=tree.depth[rows, cur] + 1, bonus=best[rows, cur])


def verify(logits, tree: Tree, key, *, greedy: bool, max_depth: int, temperature=1.0,
           top_p=1.0, accept_rule: str = "exact") -> Verdict:
    """The accepted path and bonus token. logits [B, T, V] are the target's at every node.
    Greedy: `greedy_walk`. Sampling: walk the tree from the root, as the module docstring says.

    accept_rule="broken" accepts any child whose target probability exceeds 0 (a deliberately
    wrong rule that tests use to show that the losslessness test has teeth)."""
    if greedy:
        return greedy_walk(argmax(logits), tree, max_depth)
    b, t, v = logits.shape
    k = tree.children.shape[-1]
    rows = jnp.arange(b)
    probs = target_probs(logits, temperature, top_p)  # [B, T, V]
    keys = jax.random.split(key, max_depth * k + 1)

    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    p = probs[rows, cur]
    path = jnp.full((b, max_depth + 1), -1, jnp.int32).at[:, 0].set(0)
    n_acc = jnp.ones((b,), jnp.int32)
    for d in range(max_depth):
        accepted = jnp.zeros((b,), bool)
        nxt = cur
        for c in range(k):
            child = tree.children[rows, cur, c]  # [B]
            has = alive & ~accepted & (child >= 0)
            tok = tree.tokens[rows, jnp.maximum(child, 0)]
            px = p[rows, tok]
            u = jax.random.uniform(keys[d * k + c], (b,))
            if accept_rule == "broken":
                ok = has & (px > 0)
            else:
                ok = has & (u * jnp.sum(p, axis=-1) < px)
            # rejected: remove x from the residual
            p = jnp.where((has & ~ok)[:, None], p.at[rows, tok].set(0.0), p)
            nxt = jnp.where(ok, child, nxt)
            accepted = accepted | ok
        cur = nxt
        p = jnp.where(accepted[:, None], probs[rows, cur], p)
        path = path.at[:, d + 1].set(jnp.where(accepted, cur, -1))
        n_acc = n_acc + accepted.astype(jnp.int32)
        alive = alive & accepted
    bonus = jax.random.categorical(keys[-1], jnp.log(p), axis=-1).astype(jnp.int32)
    return Verdict(path=path, n_accepted=n_acc, bonus=bonus)
