"""Packed-weight matrix products for small row counts on CPU (`cpu_gemm.cc`, an XLA FFI call).

Decoding and tree verification multiply a few rows (B x T) by every weight matrix, so their speed
is the speed of reading the weights. XLA:CPU reads them at ~24 GB/s for one row but 13-17 GB/s for
2-8 rows; the packed kernel streams contiguous panels at ~32 GB/s for 1-8 rows alike on an
AVX-512 host (SmolLM2's whole forward in the generation loop: 21.2 / 21.0 / 23.2 / 26.2 ms at
T = 1/2/4/8, against 23.2 / 33.2 / 37.0 / 44.3 ms with XLA's dot; with the panel prefetched 32
rows ahead, on a later Zen 4 host, ~12 / 14 / 16 ms at T = 1/4/8). On an AVX2 host it is
compute-bound from ~3 rows: 34 / 31 / 21 / 20 GB/s at 1/2/4/8 rows (XLA: 30 / 21 / 14 / 14;
docs/benchmarks.md) with 32-column panels; 16-column panels and prefetching (the AVX2 build's
layout, `panel_width()`) lift 4 rows to ~30 GB/s.

`pack(w [K, N]) -> PackedWeight(panels [N/P, K, P])` is a one-time layout change (see
`spec_jax.models.llama.pack_layers`); `matmul(x [..., K], w)` takes either layout. Panels may be
bfloat16 (`pack(w, jnp.bfloat16)`, what draft heads use: `spec_jax.heads.registry.PACKED_DTYPE`):
half the bytes to stream, each weight widened exactly to float32 in registers, so the product is
the float32 kernel's over the rounded weights. Cold-cache reads of a [576, 8192] matrix (a draft
LM-head slice): 0.82 -> 0.52 ms for 1-4 rows. Prefills use
the kernel too (rows in cache-sized blocks): sending their rows to XLA's dot meant unpacking every
matrix on every call, which was 281 of the 350 ms that a 127-token prompt's prefill took; the
kernel runs 190-225 GFLOP/s from 8 to 4 096 rows, level with XLA's blocked GEMM on plain matrices.

The kernel is built with g++ on first use (`cpu_build`); without a compiler, `available()` is
False and callers keep XLA's dot: nothing is lost but the speed.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build

DEFAULT_PANEL = 32  # where the kernels are not built (the layout is then only unpacked again)
TARGETS = {jnp.dtype(jnp.float32): "spec_jax_packed_gemm",
           jnp.dtype(jnp.bfloat16): "spec_jax_packed_gemm_bf16"}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] matrix stored as N/P contiguous column panels: panels [N/P, K, P], float32, or
    bfloat16 for draft heads (half the bytes to read; products still accumulate in float32)."""
    panels: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        p, k, c = self.panels.shape[-3:]
        return (k, p * c)

    @property
    def dtype(self):
        return self.panels.dtype


def pack(w, dtype=None) -> PackedWeight:
    """[K, N] -> PackedWeight in this build's panel width, stored as `dtype` (float32 or bfloat16;
    None keeps w's); N must be a multiple of the width (`packable`)."""
    k, n = w.shape
    p = panel_width()
    w = jnp.asarray(w)
    return PackedWeight(w.astype(dtype or w.dtype).reshape(k, n // p, p).transpose(1, 0, 2))


def unpack(w: PackedWeight) -> jax.Array:
    p, k, c = w.panels.shape
    return w.panels.transpose(1, 0, 2).reshape(k, p * c)


def unpack_all(tree):
    """`tree` with every PackedWeight back in the plain [K, N] layout (what checkpoints store)."""
    return jax.tree.map(lambda x: unpack(x) if isinstance(x, PackedWeight) else x, tree,
                        is_leaf=lambda x: isinstance(x, PackedWeight))


def packable(w) -> bool:
    return (getattr(w, "ndim", 0) == 2 and w.shape[1] % panel_width() == 0
            and jnp.dtype(w.dtype) == jnp.float32)


def pack_matrices(params: dict, keys, dtype=None) -> dict:
    """`params` (nested dicts) with its packable matrices under `keys` packed (as `dtype`, None
    keeping float32); the rest as is."""
    return {k: pack_matrices(v, keys, dtype) if isinstance(v, dict) else
            pack(v, dtype) if k in keys and packable(v) else v for k, v in params.items()}


def matmul(x, w):
    """x [..., K] @ w [K, N] -> [..., N]; w a plain matrix or a PackedWeight."""
    if not isinstance(w, PackedWeight):
        return x @ w
    return _packed_matmul(x, w.panels)


def dot_f32(x, w):
    """x [..., K] @ w [K, N] with float32 results (logits); w a plain matrix or a PackedWeight."""
    if isinstance(w, PackedWeight):
        return _packed_matmul(x.astype(jnp.float32), w.panels)
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


@jax.custom_jvp
def _packed_matmul(x, panels):
    k, n = panels.shape[1], panels.shape[0] * panels.shape[2]
    lead = x.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    if (rows == 0 or x.dtype != jnp.float32 or panels.dtype not in TARGETS
            or not available() or panels.shape[2] != panel_width()):
        return x @ unpack(PackedWeight(panels)).astype(x.dtype)
    y = jax.ffi.ffi_call(TARGETS[panels.dtype], jax.ShapeDtypeStruct((rows, n), jnp.float32),
                         vmap_method="sequential")(
        x.reshape(rows, k), panels)
    return y.reshape(*lead, n)


@_packed_matmul.defjvp
def _packed_matmul_jvp(primals, tangents):
    x, panels = primals
    dx, dp = tangents
    w = unpack(PackedWeight(panels)).astype(x.dtype)
    return _packed_matmul(x, panels), dx @ w + x @ unpack(PackedWeight(dp)).astype(x.dtype)


@functools.cache
def panel_width() -> int:
    """Columns per panel that the built kernel expects: 32 with AVX-512, 16 with AVX2 (one cache
    line per panel row, so every row tile streams its panel in one pass)."""
    lib = cpu_build.library() if available() else None
    return int(lib.spec_jax_gemm_panel()) if lib is not None else DEFAULT_PANEL


def available() -> bool:
    """True when the CPU kernels are built and registered (see `cpu_build`)."""
    return cpu_build.available()
