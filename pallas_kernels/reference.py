"""Pure-JAX tree attention: the semantics every kernel must match, and the CPU default.

The attention of a draft-verify step: T new queries (the tree, a chain, a prompt chunk, or one
decode token) attend to
  * the committed KV cache, where slot s counts iff `slot_valid[b, s]` and `s < length[b]`, and
  * the T new keys themselves, under `tree_mask[b, i, j]` (ancestor-or-self for a tree, causal for
    a chain or prompt).
Shapes: q [B, T, H, D]; k_cache, v_cache [B, KVH, S, D] (heads-major, as spec_jax.cache stores
them); k_new, v_new [B, N, KVH, D] (token-major, as a layer produces them);
slot_valid [B, S] bool; length [B] int32; tree_mask [B, T, N] bool (N = T for a target step; a
draft step's queries also see a buffer of earlier tree nodes, so N >= T there). H is a multiple of KVH
(grouped-query attention: query head h reads KV head h // (H // KVH)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def _grouped(q, num_kv_heads):
    b, t, h, d = q.shape
    return q.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def cache_attention(q, k_cache, v_cache, slot_valid, length, scale):
    """Attention of q over the committed cache only. Returns (out [B,T,H,D] f32, lse [B,T,H] f32).

    Per (row, KV head) this is two plain matmuls over the contiguous [S, D] cache matrix, with the
    head group's queries as a [T*G, D] slab."""
    b, t, h, d = q.shape
    kvh, s_len = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    s = jnp.einsum("bkrd,bksd->bkrs", qg.astype(jnp.float32), k_cache.astype(jnp.float32)) * scale
    ok = (slot_valid & (jnp.arange(s_len)[None, :] < length[:, None]))[:, None, None, :]  # [B,1,1,S]
    s = jnp.where(ok, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkrs,bksd->bkrd", p, v_cache.astype(jnp.float32)) / jnp.maximum(l, 1e-30)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.maximum(l[..., 0], 1e-30)), NEG_INF)
    o = o.reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
    return o, lse.reshape(b, kvh, t, g).transpose(0, 2, 1, 3).reshape(b, t, h)


def block_attention(q, k_new, v_new, tree_mask, scale):
    """Attention of q over the T new keys under tree_mask. Returns (out, lse) like cache_attention."""
    b, t, h, d = q.shape
    kvh = k_new.shape[2]
    qg = _grouped(q, kvh).astype(jnp.float32)
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k_new.astype(jnp.float32)) * scale
    mask = tree_mask[:, :, None, None, :]
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("btkgs,bskd->btkgd", p, v_new.astype(jnp.float32)) / jnp.maximum(l, 1e-30)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.maximum(l[..., 0], 1e-30)), NEG_INF)
    return o.reshape(b, t, h, d), lse.reshape(b, t, h)


def merge(o1, lse1, o2, lse2):
    """Combine two partial softmax attentions over disjoint key sets."""
    m = jnp.maximum(lse1, lse2)
    w1 = jnp.exp(lse1 - m)[..., None]
    w2 = jnp.exp(lse2 - m)[..., None]
    return (o1 * w1 + o2 * w2) / jnp.maximum(w1 + w2, 1e-30)


def tree_attention_xla(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask,
                       scale=None):
    """The XLA implementation: cache part and block part, merged (no concatenated copy of the
    cache). Equal to the reference up to float rounding. [B, T, H, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o1, lse1 = cache_attention(q, k_cache, v_cache, slot_valid, length, scale)
    o2, lse2 = block_attention(q, k_new, v_new, tree_mask, scale)
    return merge(o1, lse1, o2, lse2).astype(q.dtype)


def tree_attention_reference(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask,
                             scale=None):
    """Exact attention over cache + tree (one softmax over the concatenated keys). [B,T,H,D]."""
    b, t, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    kvh, s_len = k_cache.shape[1], k_cache.shape[2]
    qg = _grouped(q, kvh).astype(jnp.float32)
    tok_major = lambda c: c.transpose(0, 2, 1, 3)  # [B, KVH, S, D] -> [B, S, KVH, D]
    k = jnp.concatenate([tok_major(k_cache), k_new.astype(k_cache.dtype)], axis=1).astype(jnp.float32)
    v = jnp.concatenate([tok_major(v_cache), v_new.astype(v_cache.dtype)], axis=1).astype(jnp.float32)
    slots = jnp.arange(s_len)
    ok_cache = slot_valid & (slots[None, :] < length[:, None])  # [B, S]
    ok = jnp.concatenate([jnp.broadcast_to(ok_cache[:, None, :], (b, t, s_len)),
                          tree_mask], axis=-1)  # [B, T, S+T]
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k) * scale
    s = jnp.where(ok[:, :, None, None, :], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("btkgs,bskd->btkgd", p, v)
    return o.reshape(b, t, h, d).astype(q.dtype)


# The query layout of the Pallas kernels (`tpu`, `gpu`): each KV head's query group as one slab.
def group_queries(q, kvh, rows_to):
    """q [B, T, H, D] -> [B, KVH, R, D] with rows (t, g) and R padded to a multiple of rows_to."""
    b, t, h, d = q.shape
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    r = t * g
    r_pad = rows_to(r)
    if r_pad != r:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r_pad - r), (0, 0)))
    return qg, r


def ungroup(o, lse, b, t, h, d, kvh):
    """group_queries' inverse for a kernel's results: o [B, KVH, R, D], lse [B, KVH, R] ->
    [B, T, H, D], [B, T, H] (padding rows dropped)."""
    g = h // kvh
    o = o[:, :, : t * g].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
    lse = lse[:, :, : t * g].reshape(b, kvh, t, g).transpose(0, 2, 1, 3).reshape(b, t, h)
    return o, lse
