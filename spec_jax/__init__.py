"""spec_jax: speculative decoding with in-model draft heads (EAGLE-1/2/3, Medusa, MTP) in JAX."""
from spec_jax._xla import apply_defaults as _apply_xla_defaults
from spec_jax._xla import enable_compilation_cache

_apply_xla_defaults()

from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError
from spec_jax.generate import GenerationResult, generate, generate_batch
from spec_jax.target import Target, load_target, random_target


def init_draft(target, method, seed=0, **kwargs):
    """Randomly initialised draft heads of `method` (eagle, eagle3, medusa, mtp) for `target`."""
    from spec_jax.heads.registry import init_draft as _init

    return _init(target, method, seed=seed, **kwargs)


def load_draft(path):
    """Trained draft heads saved by `spec-jax train` (Orbax, with method and shapes)."""
    from spec_jax.heads.registry import load_draft as _load

    return _load(path)


def load_datastore(path):
    """A datastore (a corpus of the target's own output) saved by `spec-jax datastore`."""
    from spec_jax.heads.datastore import load_datastore as _load

    return _load(path)


__all__ = ["GenerationResult", "ModelConfig", "SpecJaxError", "Target", "enable_compilation_cache",
           "generate", "generate_batch", "init_draft", "load_datastore", "load_draft", "load_target",
           "random_target"]
