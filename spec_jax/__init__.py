"""spec_jax: speculative decoding with in-model draft heads (EAGLE-1/2/3, Medusa, MTP) in JAX."""
from spec_jax._xla import apply_defaults as _apply_xla_defaults
from spec_jax._xla import enable_compilation_cache

_apply_xla_defaults()

from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError
from spec_jax.generate import GenerationResult, TextStream, generate, generate_batch, stream
from spec_jax.target import Target, load_target, random_target


def init_draft(target, method, seed=0, **kwargs):
    """Randomly initialised draft heads of `method` (eagle, eagle3, medusa, mtp) for `target`."""
    from spec_jax.heads.registry import init_draft as _init

    return _init(target, method, seed=seed, **kwargs)


def load_draft(path):
    """Trained draft heads saved by `spec-jax train` (Orbax, with method and shapes)."""
    from spec_jax.heads.registry import load_draft as _load

    return _load(path)


def import_heads(format, src, target, out=None, force=False):
    """Published heads (format eagle, eagle3, medusa or mtp) in `src` as spec_jax heads for
    `target` (a Target or its directory), saved to `out` when given (see spec_jax.convert.heads_io)."""
    from spec_jax.convert.heads_io import import_heads as _import

    return _import(format, src, target, out=out, force=force)


def export_heads(format, src, out, target=None, force=False):
    """spec_jax heads (DraftHeads or their directory) written to `out` in the published layout of
    `format` (eagle, eagle3, medusa)."""
    from spec_jax.convert.heads_export import export_heads as _export

    return _export(format, src, out, target=target, force=force)


def draft_logits(target, heads, token_ids):
    """The heads' first draft step along `token_ids`: float32 [n-1, vocab], row j for token
    j+2 (see spec_jax.heads.teacher)."""
    from spec_jax.heads.teacher import draft_logits as _dl

    return _dl(target, heads, token_ids)


def load_datastore(path):
    """A datastore (a corpus of the target's own output) saved by `spec-jax datastore`."""
    from spec_jax.heads.datastore import load_datastore as _load

    return _load(path)


__all__ = ["GenerationResult", "ModelConfig", "SpecJaxError", "Target", "draft_logits",
           "enable_compilation_cache", "export_heads", "generate", "generate_batch", "import_heads",
           "init_draft", "load_datastore", "load_draft", "load_target", "random_target", "stream",
           "TextStream"]
