"""Packed-weight matrix products for small row counts on CPU (`cpu_gemm.cc`, an XLA FFI call).

Decoding and tree verification multiply a few rows (B x T) by every weight matrix, so their speed
is the speed of reading the weights. XLA:CPU reads them at ~24 GB/s for one row but 13-17 GB/s for
2-8 rows; the packed kernel streams contiguous panels at ~32 GB/s for 1-8 rows alike (SmolLM2's
whole forward in the generation loop: 21.2 / 21.0 / 23.2 / 26.2 ms at T = 1/2/4/8, against
23.2 / 33.2 / 37.0 / 44.3 ms with XLA's dot; docs/benchmarks.md).

`pack(w [K, N]) -> PackedWeight(panels [N/32, K, 32])` is a one-time layout change (see
`spec_jax.models.llama.pack_layers`); `matmul(x [..., K], w)` takes either layout. Rows beyond
`MAX_ROWS` (prefill, training) go to XLA's dot on the unpacked matrix, where XLA's blocked GEMM wins.

The shared library is compiled from `cpu_gemm.cc` with the system C++ compiler on first use
(`-march=native`), cached under $SPEC_JAX_CACHE (default ~/.cache/spec_jax) by source, compiler
and CPU, and registered with XLA once per process. Without a compiler, `available()` is False and
callers keep XLA's dot: nothing is lost but the speed.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 32
MAX_ROWS = 64
TARGET = "spec_jax_packed_gemm"
_SOURCE = Path(__file__).with_name("cpu_gemm.cc")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] float32 matrix stored as N/32 contiguous column panels: panels [N/32, K, 32]."""
    panels: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        p, k, c = self.panels.shape[-3:]
        return (k, p * c)

    @property
    def dtype(self):
        return self.panels.dtype


def pack(w) -> PackedWeight:
    """[K, N] -> PackedWeight; N must be a multiple of 32 (see `packable`)."""
    k, n = w.shape
    return PackedWeight(jnp.asarray(w).reshape(k, n // PANEL, PANEL).transpose(1, 0, 2))


def unpack(w: PackedWeight) -> jax.Array:
    p, k, c = w.panels.shape
    return w.panels.transpose(1, 0, 2).reshape(k, p * c)


def packable(w) -> bool:
    return (getattr(w, "ndim", 0) == 2 and w.shape[1] % PANEL == 0
            and jnp.dtype(w.dtype) == jnp.float32)


def pack_matrices(params: dict, keys) -> dict:
    """`params` (nested dicts) with its packable matrices under `keys` packed; the rest as is."""
    return {k: pack_matrices(v, keys) if isinstance(v, dict) else
            pack(v) if k in keys and packable(v) else v for k, v in params.items()}


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
    if (rows == 0 or rows > MAX_ROWS or x.dtype != jnp.float32 or panels.dtype != jnp.float32
            or not available()):
        return x @ unpack(PackedWeight(panels)).astype(x.dtype)
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32),
                         vmap_method="sequential")(
        x.reshape(rows, k), panels)
    return y.reshape(*lead, n)


@_packed_matmul.defjvp
def _packed_matmul_jvp(primals, tangents):
    x, panels = primals
    dx, dp = tangents
    w = unpack(PackedWeight(panels))
    return _packed_matmul(x, panels), dx @ w + x @ unpack(PackedWeight(dp))


def _cache_dir() -> Path:
    root = os.environ.get("SPEC_JAX_CACHE") or Path.home() / ".cache" / "spec_jax"
    return Path(root) / "kernels"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [l for l in info.splitlines() if l.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "|" + "|".join(lines)


def _command(compiler: str) -> list[str]:
    return [compiler, "-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared",
            "-fPIC", f"-I{jax.ffi.include_dir()}", str(_SOURCE)]


def _compile(cmd: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        res = subprocess.run(cmd + ["-o", str(lib)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {res.stderr.strip()[-2000:]}")
        os.replace(lib, out)  # atomic: concurrent builders never see a half-written library


@functools.cache
def _load() -> str | None:
    """Build (or reuse) and register the kernel; None when it cannot be built here."""
    if os.environ.get("SPEC_JAX_CPU_GEMM", "1") == "0":
        return None
    import warnings

    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        warnings.warn("spec_jax: no C++ compiler (g++) found, so CPU matmuls use XLA's dot (slower "
                      "decoding); install g++, or set SPEC_JAX_CPU_GEMM=0 to silence this")
        return None
    cmd = _command(compiler)
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(cmd).encode(), _cpu_id().encode()):
        key.update(part)
    lib = _cache_dir() / f"cpu_gemm-{key.hexdigest()[:16]}.so"
    try:
        if not lib.is_file():
            _compile(cmd, lib)
        import ctypes

        handle = ctypes.cdll.LoadLibrary(str(lib))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.SpecJaxPackedGemm),
                                    platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        warnings.warn(f"spec_jax: CPU packed-matmul kernel unavailable ({e}); using XLA's dot")
        return None
    return str(lib)


def available() -> bool:
    """True when the kernel is built and registered (CPU backend only)."""
    return jax.default_backend() == "cpu" and _load() is not None
