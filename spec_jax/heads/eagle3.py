"""EAGLE-3 head: fuses the target's hidden states at the input of layers 2, L//2 and L-3
(3H->H fc, no bias). Its decoder layer reads concat(input_norm(embed), hidden_norm(feature)) (2H)
into q/k/v, keeps the residual from the feature, and after the first step feeds back its own
(pre-norm) hidden state. Its own LM head covers a draft vocabulary (the most frequent target
tokens); `d2t` maps draft ids to target ids."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from spec_jax.heads.eagle import init_layer
from spec_jax.heads.feature import FeatureDrafter, draft_attention
from spec_jax.heads.method import Method, dynamic_settings, feature_drafter
from spec_jax.heads.vocab import vocab_maps
from spec_jax.models.layers import dot_f32, matmul, rms_norm
from spec_jax.models.llama import apply_rope, embed, rope_table


def init_params(cfg, key, scale=0.02, draft_vocab: int | None = None, d2t=None):
    h = cfg.hidden_size
    vd = min(draft_vocab or cfg.vocab_size, cfg.vocab_size)
    ks = jax.random.split(key, 3)
    dt = jnp.dtype(cfg.dtype)
    layer = init_layer(cfg, ks[1], scale, in_dim=2 * h, input_norm=False)
    layer.update(input_norm=jnp.ones((h,), dt), hidden_norm=jnp.ones((h,), dt))
    return {"fc_w": (scale * jax.random.normal(ks[0], (3 * h, h))).astype(dt),
            "layer": layer, "norm": jnp.ones((h,), dt),
            "lm_head": (scale * jax.random.normal(ks[2], (h, vd))).astype(dt),
            **vocab_maps(jnp.arange(vd) if d2t is None else d2t, cfg.vocab_size)}


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(FeatureDrafter):
    method: str = "eagle3"
    fused_layers: tuple[int, ...] = ()

    @property
    def aux_layers(self):
        return self.fused_layers

    def target_feature(self, dparams, tparams, tcfg, hidden, aux_hidden, rows=None):
        return matmul(aux_hidden, dparams["fc_w"], rows=rows).astype(hidden.dtype)

    def cell(self, dparams, tparams, tcfg, module, feat, tokens, positions, cache_k, cache_v,
             cache_valid, cache_len, extra_k, extra_v, extra_mask, own_mask, rows=None):
        mm = functools.partial(matmul, rows=rows)
        lp = dparams["layer"]
        b, t, _ = feat.shape
        d = tcfg.head_dim
        e = embed(tparams, tokens).astype(feat.dtype)
        x_in = jnp.concatenate([rms_norm(e, lp["input_norm"], tcfg.rms_norm_eps),
                                rms_norm(feat, lp["hidden_norm"], tcfg.rms_norm_eps)], axis=-1)
        rope = rope_table(positions, tcfg)
        q = apply_rope(mm(x_in, lp["wq"]).reshape(b, t, tcfg.num_heads, d), rope)
        k = apply_rope(mm(x_in, lp["wk"]).reshape(b, t, tcfg.num_kv_heads, d), rope)
        v = mm(x_in, lp["wv"]).reshape(b, t, tcfg.num_kv_heads, d)
        a = draft_attention(q, cache_k[0], cache_v[0], cache_valid, cache_len, extra_k[0],
                            extra_v[0], extra_mask, k, v, own_mask, self.attn_impl)
        x = feat + mm(a.reshape(b, t, -1), lp["wo"])
        h = rms_norm(x, lp["mlp_norm"], tcfg.rms_norm_eps)
        x = x + mm(jax.nn.silu(mm(h, lp["w_gate"])) * mm(h, lp["w_up"]), lp["w_down"])
        return x, (k,), (v,)

    def logits(self, dparams, tparams, tcfg, feat):
        h = rms_norm(feat, dparams["norm"], tcfg.rms_norm_eps)
        return dot_f32(h, dparams["lm_head"])


def _init(tcfg, key, scale, hparams: dict, d2t):
    """Fresh heads over a draft vocabulary of at most the target's, fusing the target's
    `eagle3_layers`."""
    hparams = {**hparams, "draft_vocab": min(hparams["draft_vocab"], tcfg.vocab_size),
               "fused_layers": list(tcfg.eagle3_layers)}
    return init_params(tcfg, key, scale, draft_vocab=hparams["draft_vocab"], d2t=d2t), hparams


METHOD = Method(
    name="eagle3", title="EAGLE-3",
    defaults={"top_k": 8, "depth": 6, "total_tokens": 32, "draft_vocab": 8192},
    init_params=_init,
    drafter=lambda hp, tree: feature_drafter(
        lambda **dyn: Eagle3Drafter(fused_layers=tuple(hp["fused_layers"]), **dyn),
        dynamic_settings(hp), tree),
    own_vocab=True, aux_layers=lambda tcfg: tcfg.eagle3_layers,
    # training-time test: unrolled draft steps, cross-entropy only
    unroll=lambda hp, cfg: dict(steps=cfg.ttt_steps, noise=0.0, feat_loss_weight=0.0,
                                ce_weight=1.0, decay=cfg.decay),
    train_record=lambda hp, cfg: {"ttt_steps": cfg.ttt_steps})
