"""Tree attention on CPU as one FFI call per layer (`attention.cc`).

Same semantics as `reference.tree_attention_reference` (one softmax over the valid cache slots
and the block keys the tree mask allows); queries that see nothing give zeros. XLA:CPU runs the
pure-JAX version as ~10 small ops per layer and reads every cache slot; the kernel reads only
slots below each row's length and is row-independent: a query's output does not depend on T or
on the other queries, so verification and plain decoding agree to the bit.

Differentiable (the tangent is the pure-JAX version's), so training through it works. Float32
only, head_dim a multiple of 16, at most 16 query heads per KV head: `supported()` says when, and
`dispatch` falls back to XLA otherwise.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import build
from pallas_kernels.reference import tree_attention_xla

TARGET = "spec_jax_tree_attention"


def supported(q, k_cache, k_new) -> bool:
    f32 = all(jnp.dtype(x.dtype) == jnp.float32 for x in (q, k_cache, k_new))
    group = q.shape[2] // k_cache.shape[1]
    return (f32 and q.shape[-1] % 16 == 0 and group <= 16 and q.shape[0] > 0
            and build.available())


@functools.partial(jax.custom_jvp, nondiff_argnums=(8,))
def tree_attention_cpu(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask, scale):
    """q [B,T,H,D]; caches [B,KVH,S,D]; slot_valid [B,S]; length [B]; new K/V [B,N,KVH,D];
    tree_mask [B,T,N] -> [B,T,H,D] float32. Call only when `supported(...)`."""
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")(
        q, k_cache, v_cache, slot_valid.astype(bool), length.astype(jnp.int32), k_new, v_new,
        tree_mask.astype(bool), scale=np.float32(scale))


@tree_attention_cpu.defjvp
def _jvp(scale, primals, tangents):
    def ref(q, kc, vc, kn, vn):
        return tree_attention_xla(q, kc, vc, primals[3], primals[4], kn, vn, primals[7],
                                  scale=scale)

    q, kc, vc, _, _, kn, vn, _ = primals
    dq, dkc, dvc, _, _, dkn, dvn, _ = tangents
    _, t_out = jax.jvp(ref, (q, kc, vc, kn, vn), (dq, dkc, dvc, dkn, dvn))
    return tree_attention_cpu(*primals, scale), t_out
