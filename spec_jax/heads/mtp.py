"""MTP head (DeepSeek-V3 multi-token prediction): module m computes
proj(concat(enorm(embed(token)), hnorm(hidden))) (2H->H), one full transformer block, then the
target's shared final norm and LM head. Used as a chain drafter: depth d runs module (d-1) % M.

Imported checkpoints (spec_jax.convert.heads_io) set two things fresh heads do not: hparam
`features` "post" (the target's last hidden state after its final norm, what serving engines hand
their MTP modules; "pre", the default, before it) and an `out_norm` param (the modules' own output
norm, DeepSeek's `shared_head.norm`, MiMo's `final_layernorm`) used instead of the target's final
norm before the shared LM head."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.heads.eagle import init_layer
from spec_jax.heads.feature import FeatureDrafter, draft_attention
from spec_jax.heads.method import Method, feature_drafter
from spec_jax.heads.vocab import shared_head_weight
from spec_jax.models.layers import dot_f32, rms_norm
from spec_jax.models.llama import decoder_layer, embed, rope_table


def init_params(cfg, key, scale=0.02, num_modules: int = 1):
    h = cfg.hidden_size
    dt = jnp.dtype(cfg.dtype)
    mods = []
    for mk in jax.random.split(key, num_modules):
        k1, k2 = jax.random.split(mk)
        mods.append({"enorm": jnp.ones((h,), dt), "hnorm": jnp.ones((h,), dt),
                     "eh_proj": (scale * jax.random.normal(k1, (2 * h, h))).astype(dt),
                     "layer": init_layer(cfg, k2, scale, input_norm=True)})
    return {"modules": jax.tree.map(lambda *a: jnp.stack(a), *mods)}


@dataclasses.dataclass(frozen=True)
class MtpDrafter(FeatureDrafter):
    method: str = "mtp"
    features: str = "pre"  # "post": the target's hidden state after its final norm (imports)

    def target_feature(self, dparams, tparams, tcfg, hidden, aux_hidden, rows=None):
        if self.features == "post":
            return rms_norm(hidden, tparams["final_norm"], tcfg.rms_norm_eps)
        return hidden

    def logits(self, dparams, tparams, tcfg, feat):
        if "out_norm" in dparams:  # the modules' own output norm (imported checkpoints)
            h = rms_norm(feat, dparams["out_norm"], tcfg.rms_norm_eps)
            return dot_f32(h, shared_head_weight(dparams, tparams, tcfg))
        return super().logits(dparams, tparams, tcfg, feat)

    def cell(self, dparams, tparams, tcfg, module, feat, tokens, positions, cache_k, cache_v,
             cache_valid, cache_len, extra_k, extra_v, extra_mask, own_mask, rows=None):
        mp = jax.tree.map(lambda a: a[module], dparams["modules"])
        e = embed(tparams, tokens).astype(feat.dtype)
        x = jnp.concatenate([rms_norm(e, mp["enorm"], tcfg.rms_norm_eps),
                             rms_norm(feat, mp["hnorm"], tcfg.rms_norm_eps)], axis=-1) @ mp["eh_proj"]

        def attend(q, k, v):
            return draft_attention(q, cache_k[0], cache_v[0], cache_valid, cache_len, extra_k[0],
                                   extra_v[0], extra_mask, k, v, own_mask, self.attn_impl)

        x, k, v = decoder_layer(mp["layer"], tcfg, x, rope_table(positions, tcfg), attend,
                                rows=rows)
        return x, (k,), (v,)


def _depth(hparams: dict) -> int:
    return hparams.get("depth", 3)


METHOD = Method(
    name="mtp", title="MTP",
    defaults={"num_modules": 1, "depth": 3},
    init_params=lambda tcfg, key, scale, hp, d2t: (
        init_params(tcfg, key, scale, num_modules=hp["num_modules"]), hp),
    # a chain: the top-1 dynamic tree of its depth
    drafter=lambda hp, tree: feature_drafter(
        lambda **dyn: MtpDrafter(num_modules=hp.get("num_modules", 1),
                                 features=hp.get("features", "pre"), **dyn),
        {"top_k": 1, "depth": _depth(hp), "total_tokens": _depth(hp) + 1}, tree),
    profile_depth=lambda hp: int(_depth(hp)),
    unroll=lambda hp, cfg: dict(steps=_depth(hp), noise=0.0, feat_loss_weight=0.0, ce_weight=1.0,
                                decay=1.0))
