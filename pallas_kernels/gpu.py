"""Pallas tree attention over the committed cache, GPU (Triton) lowering
(`dispatch.tree_attention_pallas`).

Split-K, as in flash-decoding: grid (batch, KV heads, cache chunks), an in-kernel loop over the
blocks of its chunk of the contiguous [S, D] head matrix that lie below the row's length (blocks
past the written region are never visited), partial results merged by log-sum-exp. Without the
split a decode step had batch x KV-head programs (3 for SmolLM2 at batch 1) on a GPU with 132
multiprocessors. Returns the un-normalised partial (output, log-sum-exp) that `reference.merge`
combines with the block attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.reference import NEG_INF as NEG
from pallas_kernels.reference import group_queries, ungroup


def _triton_kernel(q_ref, k_ref, v_ref, valid_ref, len_ref, o_ref, lse_ref, *, block, chunk, scale,
                   n_slots):
    """One (row, KV head, cache chunk): flash attention over the chunk's written slots."""
    from jax.experimental.pallas import triton as plgpu

    q = q_ref[...].astype(jnp.float32)  # [R, D]
    r, d = q.shape
    lo = pl.program_id(2) * chunk
    hi = jnp.minimum(lo + chunk, len_ref[0])  # slots past the row's length are never visited
    idx = jnp.arange(block)

    def body(i, carry):
        acc, m, l = carry
        start = lo + i * block
        slots = start + idx
        in_range = slots < n_slots
        k = plgpu.load(k_ref.at[pl.ds(start, block), :], mask=in_range[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(start, block), :], mask=in_range[:, None], other=0.0)
        ok = plgpu.load(valid_ref.at[pl.ds(start, block)], mask=in_range, other=0)
        ok = (ok != 0) & (slots < hi)
        # TF32 whatever the ambient precision: under "highest" the exact float32 dots asked for
        # more shared memory than an H200 has (295 KB of 232 KB) and did not compile
        s = plgpu.dot(q, k.astype(jnp.float32), trans_b=True, allow_tf32=True) * scale
        s = jnp.where(ok[None, :], s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p, v.astype(jnp.float32), allow_tf32=True)
        return acc, m_new, l

    n_live = jnp.maximum(jax.lax.div(hi - lo + block - 1, block), 0)
    acc, m, l = jax.lax.fori_loop(0, n_live, body, (jnp.zeros((r, d), jnp.float32),
                                                     jnp.full((r,), NEG, jnp.float32),
                                                     jnp.zeros((r,), jnp.float32)))
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), NEG)


def merge_splits(o, lse):
    """Combine partial attentions over disjoint key chunks: o [..., N, R, D], lse [..., N, R]."""
    m = jnp.max(lse, axis=-2, keepdims=True)
    w = jnp.where(lse > NEG / 2, jnp.exp(lse - m), 0.0)  # [..., N, R]
    total = jnp.sum(w, axis=-2)
    out = jnp.sum(o * w[..., None], axis=-3) / jnp.maximum(total, 1e-30)[..., None]
    return out, jnp.where(total > 0, m[..., 0, :] + jnp.log(jnp.maximum(total, 1e-30)), NEG)


def cache_attention_triton(q, k_cache, v_cache, slot_valid, length, scale, *, block=64,
                           chunk=512, interpret=False):
    """Partial attention over the cache with the Triton (GPU) kernel. Returns (o, lse) f32.

    Split-K (flash-decoding): grid (batch, KV heads, cache chunks of `chunk` slots), so a decode
    step with few rows and heads still fills the GPU's multiprocessors; chunks at or past a row's
    length exit at once, and the partial results are merged by log-sum-exp."""
    from jax.experimental.pallas import triton as plgpu

    b, t, h, d = q.shape
    _, kvh, s, _ = k_cache.shape
    pow2 = lambda r: max(16, 1 << (r - 1).bit_length())  # noqa: E731
    qg, _ = group_queries(q, kvh, pow2)
    r_pad = qg.shape[2]
    chunk = max(block, -(-min(chunk, s) // block) * block)
    n_split = -(-s // chunk)
    kernel = functools.partial(_triton_kernel, block=block, chunk=chunk, scale=scale, n_slots=s)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, n_split),
        in_specs=[
            pl.BlockSpec((None, None, r_pad, d), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, s, d), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, s, d), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, s), lambda bi, hi, si: (bi, 0)),
            pl.BlockSpec((None, 1), lambda bi, hi, si: (bi, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, r_pad, d), lambda bi, hi, si: (bi, hi, si, 0, 0)),
            pl.BlockSpec((None, None, None, r_pad), lambda bi, hi, si: (bi, hi, si, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, n_split, r_pad, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, n_split, r_pad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="tree_attention_cache_triton",
    )(qg, k_cache, v_cache, slot_valid.astype(jnp.int32), length.astype(jnp.int32)[:, None])
    o, lse = merge_splits(o, lse)
    return ungroup(o, lse, b, t, h, d, kvh)
