"""Pallas tree attention: a flash-style kernel over the committed cache, merged with a small dense
attention over the step's own block (the tree) under its ancestor mask.

Cache kernel (one semantics, two lowerings):
  * TPU (Mosaic; also the CPU interpret path): grid (batch, cache blocks). Per-row lengths arrive by
    scalar prefetch; blocks at or past a row's length are skipped (`pl.when`) and their index maps
    point back at the last live block, so no new DMA is issued for them. Each program handles all
    KV heads of its block: a (KVH, block, D) tile of the heads-major cache [B, KVH, S, D] (the last
    two tile dims are a multiple of 8 and the full head dim), and each query-head group is a
    [T*G, D] slab, so K/V are never repeated in memory (GQA).
  * GPU (Triton): split-K, as in flash-decoding: grid (batch, KV heads, cache chunks), an
    in-kernel loop over the blocks of its chunk of the contiguous [S, D] head matrix that lie
    below the row's length (blocks past the written region are never visited), partial results
    merged by log-sum-exp. Without the split a decode step had batch x KV-head programs (3 for
    SmolLM2 at batch 1) on a GPU with 132 multiprocessors.
Both return the un-normalised partial (output, log-sum-exp) that `reference.merge` combines with
the block attention.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import reference

NEG = -1e30
LANES = 128


def _group_queries(q, kvh, rows_to):
    """q [B, T, H, D] -> [B, KVH, R, D] with rows (t, g) and R padded to a multiple of rows_to."""
    b, t, h, d = q.shape
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    r = t * g
    r_pad = rows_to(r)
    if r_pad != r:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r_pad - r), (0, 0)))
    return qg, r


def _ungroup(o, lse, b, t, h, d, kvh):
    g = h // kvh
    o = o[:, :, : t * g].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
    lse = lse[:, :, : t * g].reshape(b, kvh, t, g).transpose(0, 2, 1, 3).reshape(b, t, h)
    return o, lse


# ----------------------------------------------------------------------------- TPU / interpret
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


def cache_attention_tpu(q, k_cache, v_cache, slot_valid, length, scale, *, block=256,
                        interpret=False):
    """Partial attention over the cache with the Mosaic (TPU) kernel. Returns (o, lse) f32."""
    from jax.experimental.pallas import tpu as pltpu

    b, t, h, d = q.shape
    _, kvh, s, _ = k_cache.shape
    block = min(block, -(-s // LANES) * LANES)
    n_blocks = -(-s // block)
    qg, _ = _group_queries(q, kvh, lambda r: -(-r // 8) * 8)
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
        out_shape=[jax.ShapeDtypeStruct((b, kvh, r_pad, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, r_pad, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_cache_tpu",
    )(length.astype(jnp.int32), qg, k_cache, v_cache, valid)
    return _ungroup(o, lse[..., 0], b, t, h, d, kvh)


# ----------------------------------------------------------------------------- GPU (Triton)
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
    qg, _ = _group_queries(q, kvh, pow2)
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
    return _ungroup(o, lse, b, t, h, d, kvh)


# ----------------------------------------------------------------------------- entry point
def tree_attention_pallas(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask, *,
                          scale=None, interpret=False, block_size=None, platform=None):
    """Cache part by a Pallas kernel, block part dense, merged exactly. Returns [B, T, H, D].

    platform: "tpu" (Mosaic) or "gpu" (Triton); default: the current backend, and the Mosaic
    kernel's semantics under the interpreter on CPU."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda"):
        o1, lse1 = cache_attention_triton(q, k_cache, v_cache, slot_valid, length, scale,
                                          block=block_size or 64, interpret=interpret)
    else:
        o1, lse1 = cache_attention_tpu(q, k_cache, v_cache, slot_valid, length, scale,
                                       block=block_size or 256, interpret=interpret)
    o2, lse2 = reference.block_attention(q, k_new, v_new, tree_mask, scale)
    return reference.merge(o1, lse1, o2, lse2).astype(q.dtype)
