"""Attention kernels on a device mesh: the kernel call wrapped in `jax.shard_map`, per shard.

A Pallas kernel (Mosaic on TPU, Triton on GPU) or the CPU FFI kernel is a custom call that XLA's
SPMD partitioner cannot split ("cannot be automatically partitioned"). Tree attention needs no
communication between (row, head) pairs, so each device runs the kernel on its own rows and heads:

  rows (the batch)      split over ROWS ("data") where the batch divides by that axis's size,
  heads                 split over HEADS ("model") where the query heads and the KV heads both
                        divide by it (query head h reads KV head h // G, so contiguous blocks of
                        each stay together),
  everything else       replicated: a dimension that does not divide, and any other mesh axis.
                        Each device then computes the whole dimension (duplicated work, the same
                        values): never an error, never padding.

The mesh is the ambient one (`jax.set_mesh`) if set, else the one the operands carry: an array
placed with a `NamedSharding` carries its mesh in its type through `jax.jit`'s tracing and into
the values computed from it. Operands on no mesh (one device) run the kernel as they are.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

ROWS, HEADS = "data", "model"


def _operand_mesh(x):
    """The (abstract) mesh `x`'s type says it is placed on, or None."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def mesh_of(*operands):
    """The mesh to run a kernel per shard on: the ambient mesh, else the first operand's; None
    where there is none, it has one device, or an axis is already manual (inside a shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = next((m for m in map(_operand_mesh, operands) if m is not None), None)
    if mesh is None or mesh.size == 1 or getattr(mesh, "manual_axes", ()):
        return None
    return mesh


def split_axes(mesh, batch: int, heads: int, kv_heads: int, rows_axis: str = ROWS,
               heads_axis: str = HEADS) -> tuple[str | None, str | None]:
    """(mesh axis of the rows, mesh axis of the heads): each None where it does not divide."""
    size = dict(mesh.shape)
    r, m = size.get(rows_axis, 1), size.get(heads_axis, 1)
    rows = rows_axis if r > 1 and batch % r == 0 else None
    split = m > 1 and heads % m == 0 and kv_heads % m == 0
    return rows, heads_axis if split else None


def attention_specs(rows: str | None, heads: str | None) -> tuple[tuple[P, ...], P]:
    """In and out PartitionSpecs of tree attention's operands (q [B, T, H, D]; k_cache, v_cache
    [B, KVH, S, D]; slot_valid [B, S]; length [B]; k_new, v_new [B, N, KVH, D]; tree_mask
    [B, T, N]) and of its output [B, T, H, D]."""
    token_major = P(rows, None, heads, None)
    cache = P(rows, heads, None, None)
    return ((token_major, cache, cache, P(rows, None), P(rows), token_major, token_major,
             P(rows, None, None)), token_major)


def per_shard(fn: Callable, mesh, q, k_cache, v_cache, slot_valid, length, k_new, v_new,
              tree_mask, *, rows_axis: str = ROWS, heads_axis: str = HEADS):
    """fn(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask) -> [B, T, H, D], run
    by each device of `mesh` on its rows and heads (`split_axes`)."""
    rows, heads = split_axes(mesh, q.shape[0], q.shape[2], k_cache.shape[1], rows_axis,
                             heads_axis)
    in_specs, out_spec = attention_specs(rows, heads)
    # check_vma off: the kernels' custom calls declare no varying axes; the output is what
    # out_spec says (replicated over every axis it does not name: each device computed it alike)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
        q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask)
