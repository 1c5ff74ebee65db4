"""Pallas tree attention over the committed cache, TPU (Mosaic) lowering; also what the CPU
interpret path runs (`dispatch.tree_attention_pallas`).

Grid (batch, cache blocks). Per-row lengths arrive by scalar prefetch; blocks at or past a row's
length are skipped (`pl.when`) and their index maps point back at the last live block, so no new
DMA is issued for them. Each program handles all KV heads of its block: a (KVH, block, D) tile of
the heads-major cache [B, KVH, S, D] (the last two tile dims are a multiple of 8 and the full head
dim), and each query-head group is a [T*G, D] slab, so K/V are never repeated in memory (GQA).
Returns the un-normalised partial (output, log-sum-exp) that `reference.merge` combines with the
block attention. The call declares its cost (every slot read, as a bound: the live length is only
known when it runs), so that XLA's cost analysis of a program counts the kernel's work.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.reference import NEG_INF as NEG
from pallas_kernels.reference import group_queries, ungroup

LANES = 128


def _tpu_kernel(len_ref, q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
                block, kvh, d, scale, n_blocks):
    b, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    length = len_ref[b]

    @pl.when(i * block < length)
    def _compute():
        slots = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        ok = (valid_ref[0] != 0) & (slots < length)  # [1, block]
        # rows past the array end hold garbage (NaN under the interpreter): zero them in V
        row_ok = (i * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)) < length
        for j in range(kvh):
            q = q_ref[0, j].astype(jnp.float32)  # [R, D]
            k = k_ref[0, j].astype(jnp.float32)  # [block, D]
            v = jnp.where(row_ok, v_ref[0, j].astype(jnp.float32), 0.0)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale  # [R, block]
            s = jnp.where(ok, s, NEG)
            m_prev = m_sc[j]  # [R, LANES], lane-replicated
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(ok, jnp.exp(s - m_new[:, :1]), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_sc[j] = alpha * l_sc[j] + jnp.sum(p, axis=1, keepdims=True)
            acc_sc[j] = acc_sc[j] * alpha[:, :1] + jnp.dot(p, v, preferred_element_type=jnp.float32)
            m_sc[j] = m_new

    @pl.when(i == n_blocks - 1)
    def _finish():
        for j in range(kvh):
            l = l_sc[j]
            o_ref[0, j] = (acc_sc[j] / jnp.maximum(l[:, :1], 1e-30)).astype(o_ref.dtype)
            lse_ref[0, j] = jnp.where(l > 0, m_sc[j] + jnp.log(jnp.maximum(l, 1e-30)), NEG)


def _cost(qg, k_cache, valid) -> pl.CostEstimate:
    """Two [R, D] x [D, S] products per (row, KV head), an exp per score; K and V read once."""
    b, kvh, r, d = qg.shape
    s = k_cache.shape[2]
    item = lambda x: x.size * x.dtype.itemsize  # noqa: E731
    out = b * kvh * r * (d + LANES) * 4
    return pl.CostEstimate(flops=4 * b * kvh * r * s * d, transcendentals=b * kvh * r * s,
                           bytes_accessed=item(qg) + 2 * item(k_cache) + item(valid) + out)


def cache_attention_tpu(q, k_cache, v_cache, slot_valid, length, scale, *, block=256,
                        interpret=False):
    """Partial attention over the cache with the Mosaic (TPU) kernel. Returns (o, lse) f32."""
    from jax.experimental.pallas import tpu as pltpu

    b, t, h, d = q.shape
    _, kvh, s, _ = k_cache.shape
    block = min(block, -(-s // LANES) * LANES)
    n_blocks = -(-s // block)
    qg, _ = group_queries(q, kvh, lambda r: -(-r // 8) * 8)
    r_pad = qg.shape[2]
    valid = slot_valid.astype(jnp.int32)[:, None, :]

    def live(bi, i, lens):  # the last block holding written slots; skipped blocks map here
        # lax.div, not //: floor division lowers through `sign`, which needs a TPU to lower
        return jnp.minimum(i, jnp.maximum(jax.lax.div(lens[bi] + block - 1, block) - 1, 0))

    kernel = functools.partial(_tpu_kernel, block=block, kvh=kvh, d=d, scale=scale,
                               n_blocks=n_blocks)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, n_blocks),
        in_specs=[
            pl.BlockSpec((1, kvh, r_pad, d), lambda bi, i, lens: (bi, 0, 0, 0)),
            pl.BlockSpec((1, kvh, block, d), lambda bi, i, lens: (bi, 0, live(bi, i, lens), 0)),
            pl.BlockSpec((1, kvh, block, d), lambda bi, i, lens: (bi, 0, live(bi, i, lens), 0)),
            pl.BlockSpec((1, 1, block), lambda bi, i, lens: (bi, 0, live(bi, i, lens))),
        ],
        out_specs=[
            pl.BlockSpec((1, kvh, r_pad, d), lambda bi, i, lens: (bi, 0, 0, 0)),
            pl.BlockSpec((1, kvh, r_pad, LANES), lambda bi, i, lens: (bi, 0, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((kvh, r_pad, LANES), jnp.float32),
                        pltpu.VMEM((kvh, r_pad, LANES), jnp.float32),
                        pltpu.VMEM((kvh, r_pad, d), jnp.float32)],
    )
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        cost_estimate=_cost(qg, k_cache, valid),
        out_shape=[jax.ShapeDtypeStruct((b, kvh, r_pad, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, r_pad, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_cache_tpu",
    )(length.astype(jnp.int32), qg, k_cache, v_cache, valid)
    return ungroup(o, lse[..., 0], b, t, h, d, kvh)
