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

NUCLEUS_TOP_K = 64  # probabilities read for the nucleus before falling back to bisection


class Verdict(NamedTuple):
    path: jax.Array  # [B, D+1] accepted node ids (root first), -1 padded
    n_accepted: jax.Array  # [B] nodes on the path including the root (>= 1)
    bonus: jax.Array  # [B] the target's token after the path


def _bisect_threshold(probs, top_p):
    """The nucleus threshold by bisection over the bit patterns of non-negative floats (31
    masked sums over V): every row, whatever its shape. probs [..., V], top_p [..., 1] or a
    scalar -> [..., 1]."""
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
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def nucleus_threshold(probs, top_p):
    """Nucleus (top-p): keep every token with p >= t for the largest t whose kept mass is still
    >= top_p — the smallest set of most likely tokens with that mass, ties at its edge included.
    probs [..., V], top_p a scalar or per row [..., 1] -> t [..., 1]; a row with top_p >= 1
    keeps every token (t = 0).

    Read off a row's NUCLEUS_TOP_K largest probabilities when their mass reaches top_p (for
    SmolLM2 at temperature 0.7 and top_p 0.9, 99% of rows), else by bisection
    (`_bisect_threshold`): of those rows alone while they are at most an eighth of all, of all
    rows otherwise. Never by sorting V: XLA's CPU sort of [32, 49152] took ~0.7 s."""
    lead, v = probs.shape[:-1], probs.shape[-1]
    flat = probs.reshape(-1, v)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), lead + (1,)).reshape(-1, 1)
    top = jax.lax.top_k(flat, min(NUCLEUS_TOP_K, v))[0]  # [N, k] descending
    cum = jnp.cumsum(top, axis=-1)
    whole = top_p[:, 0] >= 1.0
    short = (cum[:, -1] < top_p[:, 0]) & ~whole  # [N] rows whose top-k mass is below top_p
    t = jnp.take_along_axis(top, jnp.argmax(cum >= top_p, axis=-1)[:, None], axis=-1)
    few = max(1, flat.shape[0] // 8)

    def some_rows():
        idx = jnp.nonzero(short, size=few, fill_value=0)[0]
        bis = _bisect_threshold(flat[idx], top_p[idx])
        return t.at[idx].set(jnp.where(short[idx, None], bis, t[idx]))

    def all_rows():
        return jnp.where(short[:, None], _bisect_threshold(flat, top_p), t)

    n_short = jnp.sum(short)
    t = jax.lax.cond(n_short == 0, lambda: t,
                     lambda: jax.lax.cond(n_short <= few, some_rows, all_rows))
    return jnp.where(whole[:, None], 0.0, t).reshape(lead + (1,))


def _per_row(x, ndim: int):
    """A sampling setting, a scalar or one value per row [B], shaped to broadcast against
    [B, ..., 1] arrays of `ndim` dimensions."""
    x = jnp.asarray(x, jnp.float32)
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _processed(logits, temperature, top_p):
    """Temperature and nucleus as numbers to apply: (z [..., V] scaled logits, zmax and norm
    [..., 1] with softmax(z) = exp(z - zmax) / norm, zt [..., 1] the nucleus threshold on z,
    mass [..., 1] the kept mass). The processed probability of x is exp(z_x - zmax) / norm / mass
    where z_x >= zt, else 0.

    The threshold is found on probabilities but applied to z: a token's z is read from one array
    wherever it is gathered, while exp(z - zmax) / norm computed again in another fusion can round
    differently by an ulp, which at the nucleus's edge dropped the edge token from one computation
    and not from another.

    temperature and top_p: scalars, or one per row of the leading axis ([B], per-request settings
    in a batch). Temperature 0 is greedy: all the mass on the argmax (the first of equal
    maxima, as `argmax`), so a greedy row verifies and emits exactly as greedy decoding does even
    in a sampled batch. top_p >= 1 keeps every token (t = 0, mass = 1); a batch without top_p < 1
    skips the nucleus."""
    temperature = _per_row(temperature, logits.ndim)
    top_p = _per_row(top_p, logits.ndim)
    z = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)

    def with_greedy_rows():
        first_max = jax.nn.one_hot(argmax(logits.astype(jnp.float32)), z.shape[-1], dtype=bool)
        return jnp.where(temperature > 0, z, jnp.where(first_max, 0.0, -jnp.inf))

    z = jax.lax.cond(jnp.any(temperature <= 0), with_greedy_rows, lambda: z)
    zmax = jnp.max(z, axis=-1, keepdims=True)
    norm = jnp.sum(jnp.exp(z - zmax), axis=-1, keepdims=True)

    def nucleus():
        p = jnp.exp(z - zmax) / norm
        kept = p >= nucleus_threshold(p, jnp.broadcast_to(top_p, norm.shape))
        whole = top_p >= 1.0
        zt = jnp.where(whole, -jnp.inf, jnp.min(jnp.where(kept, z, jnp.inf), -1, keepdims=True))
        mass = jnp.where(whole, 1.0, jnp.sum(jnp.where(z >= zt, p, 0.0), axis=-1, keepdims=True))
        return zt, mass

    zt, mass = jax.lax.cond(jnp.any(top_p < 1.0), nucleus,
                            lambda: (jnp.full_like(norm, -jnp.inf), jnp.ones_like(norm)))
    return z, zmax, norm, zt, mass


def _kept(z, zmax, norm, zt):
    """softmax probabilities exp(z - zmax) / norm, 0 where z is below the nucleus threshold zt
    (not yet divided by the kept mass); z may be a gather of the scaled logits."""
    return jnp.where(z >= zt, jnp.exp(z - zmax) / norm, 0.0)


def target_probs(logits, temperature, top_p):
    """Processed target distribution: temperature, then nucleus (top-p). logits [..., V] f32;
    temperature, top_p scalars or per row [B] (`_processed`)."""
    z, zmax, norm, zt, mass = _processed(logits, temperature, top_p)
    return _kept(z, zmax, norm, zt) / mass


SAMPLE_BLOCK = 128  # tokens per block of the two-level inverse-CDF sampler


def _first_above(cum, u, weights):
    """Index of the first entry of cum [B, N] above u [B, 1] (cum: running sums of weights
    [B, N]); the last positive weight where rounding left u at or above the total."""
    n = cum.shape[-1]
    i = jnp.sum(cum <= u, axis=-1)
    last = n - 1 - jnp.argmax((weights > 0)[:, ::-1], axis=-1)
    return jnp.where(i < n, i, last).astype(jnp.int32)


def row_uniform(keys, shape=()):
    """Uniform [0, 1) draws of `shape` for each row, from that row's own key: keys [B, 2] ->
    [B, *shape]. A row's draws depend on its key alone, never on the batch around it."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32))(keys)


def split_rows(keys, n: int):
    """Per-row keys [B, 2] -> n per-row key arrays, each [B, 2]."""
    split = jax.vmap(lambda k: jax.random.split(k, n))(keys)  # [B, n, 2]
    return tuple(split[:, i] for i in range(n))


def sample_categorical(keys, weights):
    """One index per row with probability weights / their sum. keys [B, 2] (one per row),
    weights [B, V] >= 0, some > 0.

    Inverse CDF in two levels: pick a block of SAMPLE_BLOCK tokens by its mass, then a token in
    it, so one pass over V and two short running sums, where `jax.random.categorical` draws V
    Gumbel variates (1.8 ms per row on this CPU, more than the rest of a sampled verify); the
    running sums stay short, so their rounding stays at float32's last bit. A zero weight is
    never drawn."""
    b, v = weights.shape
    nb = -(-v // SAMPLE_BLOCK)
    w = jnp.pad(weights, ((0, 0), (0, nb * SAMPLE_BLOCK - v))).reshape(b, nb, SAMPLE_BLOCK)
    sums = jnp.sum(w, axis=-1)  # [B, nb]
    cum = jnp.cumsum(sums, axis=-1)
    u = row_uniform(keys, (1,)) * cum[:, -1:]
    blk = _first_above(cum, u, sums)
    rows = jnp.arange(b)
    inner = w[rows, blk]  # [B, SAMPLE_BLOCK]
    u_in = u - (cum[rows, blk] - sums[rows, blk])[:, None]
    tok = _first_above(jnp.cumsum(inner, axis=-1), u_in, inner)
    return blk * SAMPLE_BLOCK + tok


def sample_token(logits, keys, greedy: bool, temperature, top_p):
    """One token per row from logits [B, V]; keys [B, 2], one per row."""
    if greedy:
        return argmax(logits)
    return sample_categorical(keys, target_probs(logits, temperature, top_p))


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


# "exact": lossless verification; "broken": a deliberately wrong rule (see `verify`) for tests
ACCEPT_RULES = ("exact", "broken")


def verify(logits, tree: Tree, keys, *, greedy: bool, max_depth: int, temperature=1.0,
           top_p=1.0, accept_rule: str = "exact") -> Verdict:
    """The accepted path and bonus token. logits [B, T, V] are the target's at every node; keys
    [B, 2], one per row (sampling only).

    Greedy: `greedy_walk` over the argmax at every node. Sampling: the module docstring's walk in
    closed form. At a node whose children hold tokens x1..xk (processed probabilities p1..pk),
    trying them in order accepts child c with probability pc exactly (after x1..xc-1 were
    rejected the residual's mass is 1 - p1 - ... - pc-1), so one uniform u per node picks the
    first c with u < p1 + ... + pc, or none. Picks are made for every node at once and
    `greedy_walk` follows them; the bonus is drawn at the node where the walk stops from its
    distribution less its children's tokens (all rejected there, or none: a leaf). Only the
    [B, T, K] probabilities of the children's tokens are read, plus one [B, V] row for the bonus.

    accept_rule="broken" accepts any child whose target probability exceeds 0 (a deliberately
    wrong rule that tests use to show that the losslessness test has teeth)."""
    if greedy:
        return greedy_walk(argmax(logits), tree, max_depth)
    b, t, v = logits.shape
    k = tree.children.shape[-1]
    rows = jnp.arange(b)
    z, zmax, norm, thr, mass = _processed(logits, temperature, top_p)  # [B, T, V], [B, T, 1] x4
    valid = tree.children >= 0  # [B, T, K]
    ctok = jnp.take_along_axis(tree.tokens, jnp.maximum(tree.children, 0).reshape(b, t * k), axis=1)
    ctok = ctok.reshape(b, t, k)
    # [B, T, K] processed p of each child's token
    pc = _kept(jnp.take_along_axis(z, ctok, axis=2), zmax, norm, thr) / mass
    # a child repeating an earlier sibling's token (grafts can) is tried after that token was
    # rejected, so it is never picked; `greedy_walk` still follows the deeper of the equal paths,
    # which changes no token
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [c, c'] c' < c
    dup = jnp.any((ctok[..., :, None] == ctok[..., None, :]) & valid[..., None, :] & earlier, -1)
    pc = jnp.where(valid & ~dup, pc, 0.0)
    k_u, k_bonus = split_rows(keys, 2)
    if accept_rule == "broken":
        pick = pc > 0
    else:
        pick = row_uniform(k_u, (t, 1)) < jnp.cumsum(pc, axis=-1)
    first = jnp.argmax(pick, axis=-1)[..., None]  # [B, T, 1]
    chosen = jnp.where(jnp.any(pick, -1), jnp.take_along_axis(ctok, first, axis=-1)[..., 0], -1)
    walk = greedy_walk(chosen, tree, max_depth)
    cur = walk.path[rows, walk.n_accepted - 1]
    p = _kept(z[rows, cur], zmax[rows, cur], norm[rows, cur], thr[rows, cur])  # [B, V]
    gone = jnp.zeros((b, v), bool).at[rows[:, None], ctok[rows, cur]].max(valid[rows, cur])
    residual = jnp.where(gone, 0.0, p)
    # rejections can leave only a rounding error's worth of mass; sampling needs some left
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)
    bonus = sample_categorical(k_bonus, residual)
    return Verdict(path=walk.path, n_accepted=walk.n_accepted, bonus=bonus)
