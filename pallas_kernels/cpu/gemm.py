"""Packed-weight matrix products for small row counts on CPU (`gemm.cc`, an XLA FFI call).

Decoding and tree verification multiply a few rows (B x T) by every weight matrix, so their speed
is the speed of reading the weights. XLA:CPU reads them at ~24 GB/s for one row but 13-17 GB/s for
2-8 rows; the packed kernel streams contiguous panels at ~32 GB/s for 1-8 rows alike on an
AVX-512 host (SmolLM2's whole forward in the generation loop: 21.2 / 21.0 / 23.2 / 26.2 ms at
T = 1/2/4/8, against 23.2 / 33.2 / 37.0 / 44.3 ms with XLA's dot; with the panel prefetched 32
rows ahead, on a later Zen 4 host, ~12 / 14 / 16 ms at T = 1/4/8). On an AVX2 host it is
compute-bound from ~3 rows: 34 / 31 / 21 / 20 GB/s at 1/2/4/8 rows (XLA: 30 / 21 / 14 / 14;
run 15 in docs/results.md) with 32-column panels; 16-column panels and prefetching (the AVX2 build's
layout, `panel_width()`) lift 4 rows to ~30 GB/s.

`pack(w [K, N]) -> PackedWeight(panels [N/P, K, P])` is a one-time layout change (see
`spec_jax.models.llama.pack_layers`); `product(x [..., K], w)` multiplies by it, and the model
code's front door `spec_jax.models.layers.matmul` takes either layout. Panels may be
bfloat16 (`pack(w, jnp.bfloat16)`, what draft heads use: `spec_jax.heads.registry.PACKED_DTYPE`):
half the bytes to stream, each weight widened exactly to float32 in registers, so the product is
the float32 kernel's over the rounded weights. Cold-cache reads of a [576, 8192] matrix (a draft
LM-head slice): 0.82 -> 0.52 ms for 1-4 rows. Prefills use
the kernel too (rows in cache-sized blocks): sending their rows to XLA's dot meant unpacking every
matrix on every call, which was 281 of the 350 ms that a 127-token prompt's prefill took; the
kernel runs 190-225 GFLOP/s from 8 to 4 096 rows, level with XLA's blocked GEMM on plain matrices.

A matrix that is exactly a GGUF Q4_1 / Q8_0 dequantization (SmolLM2's: the project's checkpoint
is converted from such a file) packs as uint8 codes with a float16 (d, m) per 32 rows and column
(`pack_exact`), Q4_1's 4-bit codes two to a byte, so 0.625 bytes a weight stream (1.125 for Q8_0)
instead of 4. The codes rebuild the float32 weights exactly (`unpack`), and the kernel computes
sum_k x w = d * sum_k x q + m * sum_k x per block of 32 rows: a weight costs its conversion and
the row's FMA, not also a d * q + m, and the products match the float32 kernel's to float32
rounding (not to the bit), each row's still independent of the others. SmolLM2's one-token pass:
17.7 ms with float32 panels, 6.6-7.4 with byte codes and float32 scales, 5.75-5.8 with 4-bit
codes, float16 scales and q/k/v and gate/up each joined into one call
(`spec_jax.models.llama.pack_layers`), 5.3 with the sums per block; 8 tokens ~15.4 ms with codes
against 19.9, where the arithmetic, not the stream, sets the time. At one row the coded kernel is
arithmetic-bound too (a 4-bit panel streams no faster than a byte panel: the widening and
conversion cost more per weight than the bytes do).

A call may also transform x before the product and y after it (`product`'s norm, glu, rope and
residual: the kernel's prologue and epilogue): Llama's RMSNorm before the q/k/v, gate/up and
LM-head products, SwiGLU before the down product, RoPE on the q and k columns of the q/k/v
product, and the residual add after the o and down products (`spec_jax.models.llama
.decoder_layer`). Each row is transformed alone, so rows stay independent of each other. They
replace 9 of the 14 XLA fusions a layer had: SmolLM2's float32 forward spent 0.91-0.93 ms in
fusions at 8 tokens and 0.34-0.36 at one token, 0.20-0.21 and 0.10-0.14 with both (run 53,
docs/results.md).

The kernel is built with g++ on first use (`build`); without a compiler, `available()` is
False and callers keep XLA's dot: nothing is lost but the speed.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import build

DEFAULT_PANEL = 32  # where the kernels are not built (the layout is then only unpacked again)
TARGETS = {jnp.dtype(jnp.float32): "spec_jax_packed_gemm",
           jnp.dtype(jnp.bfloat16): "spec_jax_packed_gemm_bf16",
           jnp.dtype(jnp.uint8): "spec_jax_packed_gemm_affine"}
BLOCK = 32  # rows of K that share one scale and offset in uint8 panels (GGUF's block size)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels", "scales"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] matrix stored as N/P contiguous column panels: panels [N/P, K, P], float32, or
    bfloat16 for draft heads (half the bytes to read; products still accumulate in float32), or
    uint8 codes q with float16 `scales` [N/P, K/32, 2, P] (d, m): weight = d * q + m, exactly the
    float32 matrix it was packed from (`pack_exact`). Codes that all fit 4 bits are stored two to a
    byte, panels [N/P, K, P/2]: byte j of a panel row holds column j (low half) and j + P/2."""
    panels: jax.Array
    scales: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        p, k, c = self.panels.shape[-3:]
        return (k, p * (c if self.scales is None else self.scales.shape[-1]))

    @property
    def nibbles(self) -> bool:
        """True when the codes are 4-bit pairs (panels [N/P, K, P/2])."""
        return self.scales is not None and 2 * self.panels.shape[-1] == self.scales.shape[-1]

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
    panels = w.panels
    if w.nibbles:
        panels = jnp.concatenate([panels & 15, panels >> 4], axis=-1)
    if w.scales is not None:  # d * q + m: d * q is exact, so this is the float32 weight to the bit
        s = jnp.repeat(w.scales.astype(jnp.float32), BLOCK, axis=1)  # [N/P, K, 2, P]
        panels = s[:, :, 0] * panels.astype(jnp.float32) + s[:, :, 1]
    p, k, c = panels.shape
    return panels.transpose(1, 0, 2).reshape(k, p * c)


def affine_codes(w):
    """w [K, N] float32 as uint8 codes q [K, N] and per-(32-row block, column) d, m [K/32, N]
    float16 with w == d * q + m bit for bit, or None where some block has no such form.

    Finds the two forms GGUF's blocks dequantize to: Q4_1 (m = the block's minimum, d a float16
    near (max - min) / 15, q in 0..15) and Q8_0 (d a float16 of max |w| / 127, q + 128 with
    m = -128 d). d is a float16 in both, so d * q (q < 256) is exact in float32 and the only
    rounding is the add's, which a fused multiply-add repeats. m must be a float16 too (GGUF
    stores Q4_1's minimum as one; Q8_0's -128 d is one), so scales take 4 bytes per 32 weights."""
    if (getattr(w, "ndim", 0) != 2 or jnp.dtype(w.dtype) != jnp.float32
            or w.shape[0] % BLOCK):
        return None
    q, d, m, ok = _affine_codes(jnp.asarray(w))
    return (q, d, m) if bool(ok) else None


@jax.jit
def _affine_codes(w):
    k, n = w.shape
    b = w.reshape(k // BLOCK, BLOCK, n)
    lo, hi = b.min(axis=1), b.max(axis=1)
    f16 = lambda a: a.astype(jnp.float16).astype(jnp.float32)
    d1 = f16((hi - lo) / 15)
    d2 = f16(jnp.maximum(-lo, hi) / 127)
    best = None
    for dc, mc in ((d1, lo), (d2, -128 * d2)):
        safe = jnp.where(dc > 0, dc, 1)[:, None]
        qc = jnp.clip(jnp.where(dc[:, None] > 0, jnp.rint((b - mc[:, None]) / safe), 0), 0, 255)
        ok = jnp.all((dc[:, None] * qc + mc[:, None] == b) & jnp.isfinite(dc)[:, None], axis=1)
        ok &= f16(mc) == mc
        cur = (qc.astype(jnp.uint8), dc, mc, ok)
        if best is None:
            best = cur
        else:  # keep the first form that fits each block
            q0, d0, m0, ok0 = best
            best = (jnp.where(ok0[:, None], q0, cur[0]), jnp.where(ok0, d0, dc),
                    jnp.where(ok0, m0, mc), ok0 | ok)
    q, d, m, ok = best
    return q.reshape(k, n), d.astype(jnp.float16), m.astype(jnp.float16), jnp.all(ok)


def pack_exact(w) -> PackedWeight:
    """[K, N] float32 -> uint8 code panels with float16 scales where `affine_codes` finds the
    matrix's exact form (a GGUF-quantized checkpoint's matrices: 1.125 bytes a weight to stream
    instead of 4, 0.625 when every code fits 4 bits, products equal to float32 rounding), else
    float32 panels (`pack`)."""
    codes = affine_codes(w) if packable(w) else None
    if codes is None:
        return pack(w)
    q, d, m = codes
    k, n = q.shape
    p = panel_width()
    panels = q.reshape(k, n // p, p).transpose(1, 0, 2)
    if int(jnp.max(q)) < 16:
        panels = panels[..., : p // 2] | (panels[..., p // 2:] << 4)
    scales = jnp.stack([d, m], axis=1).reshape(k // BLOCK, 2, n // p, p).transpose(2, 0, 1, 3)
    return PackedWeight(panels, scales)


def concat(ws) -> PackedWeight | None:
    """Packed matrices [K, N_i] with the same K and storage as one [K, sum N_i] (their panels side
    by side, so each column's products are unchanged), or None where the storage differs."""
    if not all(isinstance(w, PackedWeight) for w in ws):
        return None
    if len({(w.panels.dtype, w.panels.shape[1:], w.nibbles) for w in ws}) != 1:
        return None
    scales = None if ws[0].scales is None else jnp.concatenate([w.scales for w in ws])
    return PackedWeight(jnp.concatenate([w.panels for w in ws]), scales)


def unpack_all(tree):
    """`tree` with every PackedWeight back in the plain [K, N] layout (what checkpoints store)."""
    return jax.tree.map(lambda x: unpack(x) if isinstance(x, PackedWeight) else x, tree,
                        is_leaf=lambda x: isinstance(x, PackedWeight))


def packable(w) -> bool:
    return (getattr(w, "ndim", 0) == 2 and w.shape[1] % panel_width() == 0
            and jnp.dtype(w.dtype) == jnp.float32)


def pack_matrices(params: dict, keys, dtype=None) -> dict:
    """`params` (nested dicts) with its packable matrices under `keys` packed (as `dtype`, None
    keeping float32, "exact" as `pack_exact`); the rest as is."""
    one = pack_exact if dtype == "exact" else functools.partial(pack, dtype=dtype)
    return {k: pack_matrices(v, keys, dtype) if isinstance(v, dict) else
            one(v) if k in keys and packable(v) else v for k, v in params.items()}


ROWS_TARGETS = {jnp.dtype(jnp.float32): "spec_jax_packed_gemm_rows",
                jnp.dtype(jnp.bfloat16): "spec_jax_packed_gemm_bf16_rows",
                jnp.dtype(jnp.uint8): "spec_jax_packed_gemm_affine_rows"}


def fuses(x, w: PackedWeight, rows=None) -> bool:
    """Whether the kernel applies a product's prologue and epilogue itself (`product`'s norm, glu,
    rope and residual) for x @ w with these rows; elsewhere the caller applies them as JAX ops
    (`prologue_reference`, `epilogue_reference`) around the plain product."""
    return _kernel_takes(x, w) and (rows is None or w.panels.dtype in ROWS_TARGETS)


def product(x, w: PackedWeight, rows=None, norm=None, glu: bool = False, rope=None,
            residual=None):
    """x [..., K] @ w [K, N] for a PackedWeight: the FFI kernel for w's storage, XLA's dot on the
    unpacked matrix where the kernel cannot take x. The arguments are those of the front door,
    `spec_jax.models.layers.matmul` (which validates them); pass norm, glu, rope or residual only
    where `fuses(x, w, rows)`."""
    pro = PROLOGUE_NORM if norm is not None else PROLOGUE_GLU if glu else 0
    epi = EPILOGUE_ROPE if rope is not None else EPILOGUE_RESIDUAL if residual is not None else 0
    if pro or epi:
        g, eps = norm if norm is not None else (_NONE, 0.0)
        aux, cols = (rope if rope is not None else
                     (residual, 0) if residual is not None else (_NONE, 0))
        spec = (pro, float(eps), epi, int(cols))
        if rows is not None:
            return _kernel_product(x, w, rows, spec, g, aux)
        return _fused_matmul(x, g.astype(jnp.float32), aux.astype(jnp.float32), w, spec)
    if rows is not None and w.panels.dtype in ROWS_TARGETS:
        return _kernel_product(x, w, rows)
    if w.scales is not None:
        return _affine_matmul(x, w.panels, w.scales)
    return _packed_matmul(x, w.panels)


PROLOGUE_NORM, PROLOGUE_GLU = 1, 2  # the kernel's `prologue` attribute (gemm.cc)
EPILOGUE_ROPE, EPILOGUE_RESIDUAL = 1, 2  # its `epilogue` attribute
_NONE = np.zeros((1,), np.float32)  # the kernel's g or aux operand where a call has none


# The prologue's and epilogue's semantics as JAX ops. RMSNorm and rotate-half are defined here
# once: the model code takes them from `spec_jax.models.layers`, which re-exports these.
def rms_norm(x, w, eps):
    """Llama's RMSNorm over the last axis, in float32: x * rsqrt(mean(x^2) + eps) * w."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rotate_half(x, cos, sin):
    """x [..., D] rotated by cos, sin [..., D/2] (Hugging Face's rotate-half RoPE), in float32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def prologue_reference(x, norm=None, glu: bool = False):
    """What `product`'s norm / glu apply to x, in JAX ops."""
    if norm is not None:
        return rms_norm(x, *norm)
    if glu:
        a, b = jnp.split(x, 2, axis=-1)
        return jax.nn.silu(a) * b
    return x


def epilogue_reference(y, rope=None, residual=None):
    """What `product`'s rope / residual apply to its product y, in JAX ops."""
    if rope is not None:
        cs, cols = rope
        d = cs.shape[-1]
        lead = y.shape[:-1]
        heads = y[..., :cols].reshape(*lead, cols // d, d)
        rot = rotate_half(heads, cs[..., None, : d // 2], cs[..., None, d // 2:])
        y = jnp.concatenate([rot.reshape(*lead, cols), y[..., cols:]], axis=-1)
    if residual is not None:
        y = residual + y
    return y


def _kernel_takes(x, w: PackedWeight) -> bool:
    """Whether the FFI kernel computes x @ w (else XLA's dot on the unpacked matrix does)."""
    r = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (r > 0 and x.dtype == jnp.float32 and w.panels.dtype in TARGETS and available()
            and w.shape[1] // w.panels.shape[0] == panel_width())


def _kernel_product(x, w: PackedWeight, rows=None, spec=(0, 0.0, 0, 0), g=_NONE, aux=_NONE):
    """x [..., K] @ w through the FFI kernel for w's panel dtype, or XLA's dot on the unpacked
    matrix where the kernel cannot take it (x empty or not float32, kernel not built here).
    `rows` as in `product`; `spec` (prologue, eps, epilogue, rotated columns) with the operands g
    (the norm's weights) and aux (cos/sin or the residual) as `product`'s norm, glu, rope and
    residual ask."""
    k, n = w.shape
    lead = x.shape[:-1]
    r = int(np.prod(lead, dtype=np.int64))
    targets = TARGETS if rows is None else ROWS_TARGETS
    pro, eps, epi, cols = spec
    if not _kernel_takes(x, w) or w.panels.dtype not in targets:
        return _spec_reference(x, w, spec, g, aux)
    aux = jnp.asarray(aux, jnp.float32)
    aux = aux.reshape(r, aux.shape[-1]) if epi else aux.reshape(1, -1)
    operands = (jnp.asarray(g, jnp.float32), aux, w.panels)
    operands += () if w.scales is None else (w.scales,)
    if rows is not None:
        if x.ndim != 3 or rows.shape != x.shape[:1]:
            raise ValueError(f"rows {rows.shape} must hold one count per row of x [B, T, K], "
                             f"got x {x.shape}")
        operands += (rows.astype(jnp.int32),)
    y = jax.ffi.ffi_call(targets[w.panels.dtype], jax.ShapeDtypeStruct((r, n), jnp.float32),
                         vmap_method="sequential")(
        x.reshape(r, x.shape[-1]), *operands, prologue=np.int32(pro), eps=np.float32(eps),
        epilogue=np.int32(epi), rotate=np.int32(cols))
    return y.reshape(*lead, n)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _fused_matmul(x, g, aux, w: PackedWeight, spec):
    return _kernel_product(x, w, None, spec, g, aux)


@_fused_matmul.defjvp
def _fused_matmul_jvp(spec, primals, tangents):
    """Through x, g and aux only, as the JAX ops would be (the weights are frozen here)."""
    x, g, aux, w = primals
    _, dy = jax.jvp(lambda x, g, aux: _spec_reference(x, w, spec, g, aux), (x, g, aux),
                    tangents[:3])
    return _fused_matmul(x, g, aux, w, spec), dy


def _spec_reference(x, w: PackedWeight, spec, g, aux):
    """`_kernel_product`'s prologue, product and epilogue (`spec`) as JAX ops on w's matrix."""
    pro, eps, epi, cols = spec
    h = prologue_reference(x, (g, eps) if pro == PROLOGUE_NORM else None, pro == PROLOGUE_GLU)
    return epilogue_reference(h @ unpack(w).astype(h.dtype),
                              (aux, cols) if epi == EPILOGUE_ROPE else None,
                              aux if epi == EPILOGUE_RESIDUAL else None)


@jax.custom_jvp
def _packed_matmul(x, panels):
    return _kernel_product(x, PackedWeight(panels))


@_packed_matmul.defjvp
def _packed_matmul_jvp(primals, tangents):
    x, panels = primals
    dx, dp = tangents
    w = unpack(PackedWeight(panels)).astype(x.dtype)
    return _packed_matmul(x, panels), dx @ w + x @ unpack(PackedWeight(dp)).astype(x.dtype)


@jax.custom_jvp
def _affine_matmul(x, panels, scales):
    return _kernel_product(x, PackedWeight(panels, scales))


@_affine_matmul.defjvp
def _affine_matmul_jvp(primals, tangents):
    """Through x only: uint8 codes and their scales are a frozen target's, never trained."""
    x, panels, scales = primals
    dx = tangents[0]
    return (_affine_matmul(x, panels, scales),
            dx @ unpack(PackedWeight(panels, scales)).astype(x.dtype))


@functools.cache
def panel_width() -> int:
    """Columns per panel that the built kernel expects: 32 with AVX-512, 16 with AVX2 (one cache
    line per panel row, so every row tile streams its panel in one pass)."""
    lib = build.library() if available() else None
    return int(lib.spec_jax_gemm_panel()) if lib is not None else DEFAULT_PANEL


def available() -> bool:
    """True when the CPU kernels are built and registered (see `build`)."""
    return build.available()
