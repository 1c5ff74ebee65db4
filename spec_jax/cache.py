"""Static-size KV cache: fixed shapes, per-slot validity and positions, writes in place.

Keys and values are stored heads-major, [L, B, KVH, S, D], so each (row, KV head) is one contiguous
[S, D] matrix: attention reads it with a plain matmul (no transposed copy per layer and step, which
on XLA:CPU cost more than the attention itself) and Pallas kernels tile it directly.
With `per_layer=True` the layers are a tuple of [B, KVH, S, D] buffers instead of one stacked
array: unrolled layers then read their cache without a slice copy, as XLA:CPU copies a slice of a
stacked array before using it (the same reason unrolled weights are per-layer buffers).

Slots `[0, length[b])` of row b hold committed tokens; everything at or past `length[b]` is
invalid (stale draft K/V, padding) and masked out, never freed or reallocated. A step computes the
K/V of its T block tokens outside the cache, then `commit` scatters only the accepted ones into
slots `[length, length + n)`, so the cache stays dense and never grows by rejected tokens.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, KVH, S, D], or a tuple of L [B, KVH, S, D] (per_layer)
    v: jax.Array  # same as k
    valid: jax.Array  # [B, S] bool: slot holds a committed token
    pos: jax.Array  # [B, S] int32: RoPE position of the token in the slot (-1 when empty)
    length: jax.Array  # [B] int32: next free slot

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[-2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, (list, tuple))


def init_cache(num_layers, batch, num_slots, num_kv_heads, head_dim, dtype=jnp.float32,
               per_layer: bool = False) -> KVCache:
    if per_layer:
        shape = (batch, num_kv_heads, num_slots, head_dim)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    else:
        shape = (num_layers, batch, num_kv_heads, num_slots, head_dim)
        k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return KVCache(
        k=k,
        v=v,
        valid=jnp.zeros((batch, num_slots), bool),
        pos=jnp.full((batch, num_slots), -1, jnp.int32),
        length=jnp.zeros((batch,), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "num_slots", "per_layer"))
def cache_for(cfg, batch: int, num_slots: int, per_layer: bool = False) -> KVCache:
    """An empty cache for `cfg`'s target, made by one compiled program (built op by op, a
    per-layer cache of 60 buffers took ~5 ms a `generate` call)."""
    return init_cache(cfg.num_layers, batch, num_slots, cfg.num_kv_heads, cfg.head_dim,
                      jnp.dtype(cfg.dtype), per_layer=per_layer)


def commit(cache: KVCache, k_new, v_new, positions, select, count) -> KVCache:
    """Append selected block tokens to each row, in place.

    k_new, v_new: [L, B, T, KVH, D] K/V of the step's block; positions: [B, T] their positions;
    select: [B, A] block indices to keep, in order; count: [B] how many of them are real.
    Entry j of row b lands in slot length[b] + j; entries j >= count[b] (and anything past the
    cache end) are routed to the out-of-range slot S and dropped, never wrapped.
    """
    s = cache.num_slots
    b_idx = jnp.arange(select.shape[0])[:, None]  # [B, 1]
    j = jnp.arange(select.shape[1])[None, :]  # [1, A]
    slot = cache.length[:, None] + j
    slot = jnp.where((j < count[:, None]) & (slot < s), slot, s)  # [B, A]
    kk = k_new[:, b_idx, select]  # [L, B, A, KVH, D]
    vv = v_new[:, b_idx, select]
    # index (row, slot, head) -> cache[:, row, head, slot]; the value keeps kk's [L, B, A, KVH, D]
    h_idx = jnp.arange(cache.k[0].shape[-3])[None, None, :]
    bi, si = b_idx[:, :, None], slot[:, :, None]
    if cache.per_layer:
        k = tuple(c.at[bi, h_idx, si].set(kk[i].astype(c.dtype), mode="drop")
                  for i, c in enumerate(cache.k))
        v = tuple(c.at[bi, h_idx, si].set(vv[i].astype(c.dtype), mode="drop")
                  for i, c in enumerate(cache.v))
    else:
        k = cache.k.at[:, bi, h_idx, si].set(kk.astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, bi, h_idx, si].set(vv.astype(cache.v.dtype), mode="drop")
    valid = cache.valid.at[b_idx, slot].set(True, mode="drop")
    pos = cache.pos.at[b_idx, slot].set(jnp.take_along_axis(positions, select, axis=1), mode="drop")
    length = jnp.minimum(cache.length + count, s)
    return KVCache(k=k, v=v, valid=valid, pos=pos, length=length)


def rollback(cache: KVCache, new_length) -> KVCache:
    """Mark slots at or past new_length [B] invalid (used by drafters that re-run a suffix)."""
    slots = jnp.arange(cache.num_slots)[None, :]
    keep = slots < new_length[:, None]
    return cache.replace(valid=cache.valid & keep, length=jnp.minimum(cache.length, new_length))
