"""EAGLE-1/2 head: fc(concat(embed(token), feature)) 2H->H, one Llama decoder layer without its
input norm, then the target's frozen final norm and LM head (over the draft vocabulary if the
heads have one, see spec_jax.heads.vocab). EAGLE-2 = this head + dynamic tree."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_gemm import matmul
from spec_jax.heads.feature import FeatureDrafter, draft_attention
from spec_jax.models.llama import decoder_layer, embed, rope_table


def init_layer(cfg, key, scale, in_dim=None, input_norm=True):
    """Parameters of one (unstacked) Llama decoder layer; q/k/v read `in_dim` features."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    in_dim = in_dim or h
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dt = jnp.dtype(cfg.dtype)
    ks = jax.random.split(key, 7)
    nrm = lambda k, shape: (scale * jax.random.normal(k, shape)).astype(dt)
    p = {"wq": nrm(ks[0], (in_dim, nq)), "wk": nrm(ks[1], (in_dim, nkv)),
         "wv": nrm(ks[2], (in_dim, nkv)), "wo": nrm(ks[3], (nq, h)), "mlp_norm": jnp.ones((h,), dt),
         "w_gate": nrm(ks[4], (h, i)), "w_up": nrm(ks[5], (h, i)), "w_down": nrm(ks[6], (i, h))}
    if input_norm:
        p["attn_norm"] = jnp.ones((h,), dt)
    return p


def init_params(cfg, key, scale=0.02):
    h = cfg.hidden_size
    k1, k2 = jax.random.split(key)
    dt = jnp.dtype(cfg.dtype)
    return {"fc_w": (scale * jax.random.normal(k1, (2 * h, h))).astype(dt),
            "fc_b": jnp.zeros((h,), dt),
            "layer": init_layer(cfg, k2, scale, input_norm=False)}


@dataclasses.dataclass(frozen=True)
class EagleDrafter(FeatureDrafter):
    method: str = "eagle"

    def cell(self, dparams, tparams, tcfg, module, feat, tokens, positions, cache_k, cache_v,
             cache_valid, cache_len, extra_k, extra_v, extra_mask, own_mask):
        e = embed(tparams, tokens).astype(feat.dtype)
        x = matmul(jnp.concatenate([e, feat], axis=-1), dparams["fc_w"]) + dparams["fc_b"]

        def attend(q, k, v):
            return draft_attention(q, cache_k, cache_v, cache_valid, cache_len, extra_k, extra_v,
                                   extra_mask, k, v, own_mask, self.attn_impl)

        rope = rope_table(positions, tcfg)
        out, k, v = decoder_layer(dparams["layer"], tcfg, x, rope, attend, input_norm=False)
        return out, k, v
