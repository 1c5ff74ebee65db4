"""Pick the attention implementation; the choice is static (a Python string)."""
from __future__ import annotations

import jax

from pallas_kernels import reference

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
        from pallas_kernels import cpu_build

        return "cpu" if cpu_build.available() else "xla"
    return impl


def tree_attention(q, k_cache, v_cache, slot_valid, length, k_new, v_new, tree_mask, *,
                   scale=None, impl: str = "xla", block_size: int | None = None):
    """Attention of T block queries over the committed cache and the block itself. [B, T, H, D]."""
    impl = resolve_impl(impl)
    if impl == "cpu":
        from pallas_kernels import cpu_attention

        if cpu_attention.supported(q, k_cache, k_new):
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            return cpu_attention.tree_attention_cpu(q, k_cache, v_cache, slot_valid, length, k_new,
                                                    v_new, tree_mask, scale).astype(q.dtype)
        impl = "xla"
    if impl == "xla":
        return reference.tree_attention_xla(q, k_cache, v_cache, slot_valid, length, k_new, v_new,
                                            tree_mask, scale=scale)
    from pallas_kernels import kernels  # imported lazily: Pallas is only needed when asked for

    return kernels.tree_attention_pallas(q, k_cache, v_cache, slot_valid, length, k_new, v_new,
                                         tree_mask, scale=scale,
                                         interpret=(impl == "pallas_interpret"),
                                         block_size=block_size)
