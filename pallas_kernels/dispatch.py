"""Pick the attention implementation (the choice is static: a Python string) and run it.

`tree_attention_pallas` joins a Pallas cache kernel (`tpu`: Mosaic, also the interpret path;
`gpu`: Triton) with the dense attention over the step's own block (`reference`). On a mesh a
kernel runs per shard (`sharded`): XLA cannot partition a custom call.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import sharded
from pallas_kernels.reference import block_attention, merge, tree_attention_xla

IMPLS = ("auto", "xla", "cpu", "pallas", "pallas_interpret")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        # TPU/GPU keep XLA's path: the Pallas kernel's float32 dots do not compile under the
        # "highest" precision the loop uses for float32 targets (docs/gpu.md); ask for "pallas".
        return "cpu" if jax.default_backend() == "cpu" else "xla"
    return impl


def default_impl() -> str:
    """What "auto" runs here, as sizing caches it: "cpu" only when the kernel is built."""
    impl = resolve_impl("auto")
    if impl == "cpu":
        from pallas_kernels.cpu import build

        return "cpu" if build.available() else "xla"
    return impl


def tree_attention(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask, *,
                   scale=None, impl: str = "xla", block_size: int | None = None, mesh=None):
    """Attention of T block queries over the committed cache and the block itself. [B, T, H, D].

    On a mesh (`mesh`, else the ambient one or the operands', see `sharded.mesh_of`) a kernel runs
    per shard under `jax.shard_map` (rows over "data", heads over "model" where they divide);
    XLA's attention is left to XLA's partitioner."""
    impl = resolve_impl(impl)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if impl == "cpu":
        from pallas_kernels.cpu import attention

        if not attention.supported(q, k_cache, k_new):  # per shard too: the group size holds
            impl = "xla"
    if impl == "xla":
        return tree_attention_xla(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask,
                                  scale=scale)
    run = functools.partial(_kernel_attention, impl=impl, scale=scale, block_size=block_size)
    args = (q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask)
    mesh = mesh if mesh is not None else sharded.mesh_of(*args)
    return run(*args) if mesh is None or mesh.size == 1 else sharded.per_shard(run, mesh, *args)


def _kernel_attention(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask, *, impl,
                      scale, block_size):
    """`tree_attention` by a kernel ("cpu", "pallas", "pallas_interpret") on one device's
    operands."""
    if impl == "cpu":
        from pallas_kernels.cpu import attention

        return attention.tree_attention_cpu(q, k_cache, v_cache, slot_valid, length, k_new, v_new,
                                            tree_mask, scale).astype(q.dtype)
    return tree_attention_pallas(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask,
                                 scale=scale, interpret=(impl == "pallas_interpret"),
                                 block_size=block_size)


def tree_attention_pallas(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask, *,
                          scale=None, interpret=False, block_size=None, platform=None):
    """Cache part by a Pallas kernel, block part dense, merged exactly. Returns [B, T, H, D].

    platform: "tpu" (Mosaic) or "gpu" (Triton); default: the current backend, and the Mosaic
    kernel's semantics under the interpreter on CPU."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    platform = platform or jax.default_backend()
    # imported lazily: Pallas is only needed when asked for
    if platform in ("gpu", "cuda"):
        from pallas_kernels.gpu import cache_attention_triton

        o1, lse1 = cache_attention_triton(q, k_cache, v_cache, slot_valid, length, scale,
                                          block=block_size or 64, interpret=interpret)
    else:
        from pallas_kernels.tpu import cache_attention_tpu

        o1, lse1 = cache_attention_tpu(q, k_cache, v_cache, slot_valid, length, scale,
                                       block=block_size or 256, interpret=interpret)
    o2, lse2 = block_attention(q, k_new, v_new, tree_mask, scale)
    return merge(o1, lse1, o2, lse2).astype(q.dtype)
