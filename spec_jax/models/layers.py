"""Layer primitives of the model code: RMSNorm, rotate-half RoPE and the matrix-product front door.

The target model (`llama`) and the draft heads (`spec_jax.heads`) take their layer math from here.
`matmul` / `dot_f32` take a plain [K, N] matrix or a `PackedWeight` (the CPU kernel's panel
layout, `pallas_kernels.cpu.gemm`): a packed matrix goes to the FFI kernel, which also applies the
product's norm / SwiGLU before it and RoPE / residual after it (its prologue and epilogue) where it
is built and takes the operands; everything else is XLA's ops. `rms_norm` and `rotate_half` are
the kernel's own pure-JAX semantics of that prologue and epilogue (defined once, in
`pallas_kernels.cpu.gemm`), so both paths use one definition.

Imports point one way: models import kernels, kernels never import spec_jax.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.cpu import gemm
from pallas_kernels.cpu.gemm import PackedWeight, rms_norm, rotate_half

__all__ = ["PackedWeight", "dot_f32", "matmul", "rms_norm", "rotate_half"]


def matmul(x, w, rows=None, norm=None, glu: bool = False, rope=None, residual=None):
    """x [..., K] @ w [K, N] -> [..., N]; w a plain matrix or a PackedWeight.

    rows: None, or int32 [B] for x [B, T, K] (a padded prefill): the kernel for float32,
    bfloat16 or code panels computes only each batch row's first rows[b] tokens, the rest of y
    being zeros (elsewhere every row is computed: the results differ only in those rows). Not
    differentiable.
    norm: (g [K], eps as a Python float): the product of Llama's RMSNorm of x instead of x.
    glu: x [..., 2K] = [a, b]: the product of silu(a) * b (SwiGLU) instead of x.
    rope: (cs [..., D], cols): the first `cols` columns of the product rotated in heads of D
      (Hugging Face's rotate-half RoPE; cs holds each row's cos then sin of D/2 frequencies).
    residual: [..., N], added to the product.
    With a PackedWeight the kernel does these itself (its prologue and epilogue), so they cost
    no XLA op of their own; results match the ops' to float32 rounding, not to the bit, and
    rows stay independent of each other. Otherwise they are the JAX ops
    (`gemm.prologue_reference`, `gemm.epilogue_reference`)."""
    if (norm is not None and glu) or (rope is not None and residual is not None):
        raise ValueError("matmul takes one of norm and glu, and one of rope and residual")
    fused = norm is not None or glu or rope is not None or residual is not None
    if fused and not (isinstance(w, PackedWeight) and gemm.fuses(x, w, rows)):
        y = matmul(gemm.prologue_reference(x, norm, glu), w, rows)
        return gemm.epilogue_reference(y, rope, residual)
    if not isinstance(w, PackedWeight):
        return x @ w
    return gemm.product(x, w, rows, norm=norm, glu=glu, rope=rope, residual=residual)


def dot_f32(x, w):
    """x [..., K] @ w [K, N] with float32 results (logits); w a plain matrix or a PackedWeight."""
    if isinstance(w, PackedWeight):
        return matmul(x.astype(jnp.float32), w)
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
