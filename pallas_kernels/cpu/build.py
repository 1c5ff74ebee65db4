"""Build and register spec_jax's CPU kernels (`gemm.cc`, `attention.cc`, `argmax.cc` beside this
file: XLA FFI calls).

The shared library is compiled from the sources with the system C++ compiler on first use
(`-march=native`), cached under $SPEC_JAX_CACHE (default ~/.cache/spec_jax) by source, compiler
and CPU, and registered with XLA once per process. Without a compiler, `available()` is False and
callers keep XLA's ops: nothing is lost but the speed. `SPEC_JAX_CPU_KERNELS=0` turns them off.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

_DIR = Path(__file__).parent
SOURCES = (_DIR / "gemm.cc", _DIR / "attention.cc", _DIR / "argmax.cc")
HEADERS = (_DIR / "pool.h",)
# FFI target name -> the handler symbol exported by the library
TARGETS = {"spec_jax_packed_gemm": "SpecJaxPackedGemm",
           "spec_jax_packed_gemm_bf16": "SpecJaxPackedGemmBf16",
           "spec_jax_packed_gemm_affine": "SpecJaxPackedGemmAffine",
           "spec_jax_packed_gemm_rows": "SpecJaxPackedGemmRows",
           "spec_jax_packed_gemm_bf16_rows": "SpecJaxPackedGemmBf16Rows",
           "spec_jax_packed_gemm_affine_rows": "SpecJaxPackedGemmAffineRows",
           "spec_jax_tree_attention": "SpecJaxTreeAttention",
           "spec_jax_argmax": "SpecJaxArgmax"}


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


def _command(compiler: str, src_dir: Path = _DIR) -> list[str]:
    return [compiler, "-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared",
            "-fPIC", f"-I{jax.ffi.include_dir()}", f"-I{src_dir}",
            *(str(src_dir / s.name) for s in SOURCES)]


def _build_key(cmd: list[str], src_dir: Path = _DIR) -> str:
    """The build's identity: the sources' contents, the compile command and the CPU. Where the
    checkout and JAX's headers lie is left out (JAX's version is kept), so a clone or a moved
    checkout reuses the library, and with it the tree sizing measured with that build."""
    command = " ".join(cmd).replace(str(jax.ffi.include_dir()), f"<jax {jax.__version__}>")
    key = hashlib.sha256()
    for part in (*((src_dir / s.name).read_bytes() for s in SOURCES + HEADERS),
                 command.replace(str(src_dir), "<src>").encode(), _cpu_id().encode()):
        key.update(part)
    return key.hexdigest()[:16]


def _compile(cmd: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        res = subprocess.run(cmd + ["-o", str(lib)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {res.stderr.strip()[-2000:]}")
        digest = Path(tmp) / "digest"
        digest.write_text(_digest(lib))
        os.replace(lib, out)  # atomic: concurrent builders never see a half-written library
        os.replace(digest, _digest_file(out))


def _digest(lib: Path) -> str:
    return hashlib.sha256(lib.read_bytes()).hexdigest()


def _digest_file(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _intact(lib: Path) -> bool:
    """Whether the cached library is the one its build wrote: its SHA-256 is the one recorded
    beside it. A truncated or emptied file (a full disk, a killed copy) would otherwise crash the
    process when loaded ("Bus error") or fail to register; a library without a record (an older
    cache) is rebuilt once."""
    try:
        return lib.is_file() and _digest_file(lib).read_text().strip() == _digest(lib)
    except OSError:
        return False


@functools.cache
def _load() -> str | None:
    """Build (or reuse) and register the kernels; None when they cannot be built here."""
    if os.environ.get("SPEC_JAX_CPU_KERNELS", "1") == "0":
        return None
    import warnings

    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        warnings.warn("spec_jax: no C++ compiler (g++) found, so CPU matmuls and attention use "
                      "XLA's ops (slower decoding); install g++, or set SPEC_JAX_CPU_KERNELS=0 to "
                      "silence this")
        return None
    cmd = _command(compiler)
    lib = _cache_dir() / f"cpu_kernels-{_build_key(cmd)}.so"
    try:
        if not _intact(lib):
            _compile(cmd, lib)
        import ctypes

        handle = ctypes.cdll.LoadLibrary(str(lib))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        warnings.warn(f"spec_jax: CPU kernels unavailable ({e}); using XLA's ops")
        return None
    return str(lib)


def library():
    """The loaded kernels as a ctypes library (for their plain C queries), None where not in use."""
    lib = _load() if jax.default_backend() == "cpu" else None
    if lib is None:
        return None
    import ctypes

    return ctypes.cdll.LoadLibrary(lib)


def build_id() -> str:
    """The loaded kernels' build hash (of source, compiler command and CPU), '' where they are not
    in use: costs measured with one build do not hold for another."""
    lib = _load() if jax.default_backend() == "cpu" else None
    return Path(lib).stem.rsplit("-", 1)[-1] if lib else ""


def available() -> bool:
    """True when the kernels are built and registered (CPU backend only)."""
    return jax.default_backend() == "cpu" and _load() is not None
