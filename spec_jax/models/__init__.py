"""Target model families. All Llama-family models (Llama 2/3, SmolLM2, Mistral, Qwen2) share one file."""
from spec_jax.models.llama import ForwardOut, forward, init_params, rope_inv_freq

__all__ = ["ForwardOut", "forward", "init_params", "rope_inv_freq"]
