"""Shared by the tests that hold our models against transformers' PyTorch ones: a transformers
model's weights in our layout (in memory, no files), and the one logits comparison (float32,
1e-4) every family's parity test makes."""
import jax.numpy as jnp
import numpy as np

from spec_jax.cache import cache_for
from spec_jax.config import ModelConfig
from spec_jax.convert.hf import params_from_hf
from spec_jax.models.llama import causal_mask, forward

TOL = 1e-4  # float32 logits, ours against transformers'


def perturb_norms(model, scale: float, biases: bool = True):
    """Random, non-trivial norms (and biases): a fresh transformers model has them all ones and
    zeros, under which a wrong norm or a dropped bias would go unseen."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or (biases and name.endswith(".bias")):
                p.add_(scale * torch.randn_like(p))
    return model


def ours(model):
    """(our ModelConfig, our params) for a transformers model, converted in memory."""
    d = model.config.to_dict()
    d["architectures"] = [type(model).__name__]
    cfg = ModelConfig.from_hf_dict(d)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return cfg, params_from_hf(state, cfg)


def reference_logits(model, toks) -> np.ndarray:
    """transformers' float32 logits for token ids [B, T]."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(toks))).logits.numpy()


def assert_logits_match(model, cfg, params, batch: int = 2, length: int = 40, seed: int = 1):
    """Our forward over random tokens [batch, length] equals transformers' within TOL."""
    toks = np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, length))
    ref = reference_logits(model, toks)
    pos = jnp.broadcast_to(jnp.arange(length), (batch, length))
    out = forward(params, cfg, jnp.asarray(toks), pos, cache_for(cfg, batch, 8),
                  causal_mask(batch, length))
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=TOL, rtol=0)
