"""Where spec_jax keeps what it makes once and reuses on this machine: $SPEC_JAX_CACHE
(~/.cache/spec_jax by default) holds the tree sizings (spec_jax.sizing), packed target layouts
(spec_jax.target), compiled XLA programs (spec_jax._xla) and downloaded wheels (spec_jax.convert)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("SPEC_JAX_CACHE", Path.home() / ".cache" / "spec_jax"))
