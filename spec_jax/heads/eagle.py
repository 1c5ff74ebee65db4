"""EAGLE-1/2 head: fc(concat(embed(token), feature)) 2H->H, one Llama decoder layer without its
input norm (`layer`; the paper's head) and optionally more full ones (`layer_1`, ...), then the
target's frozen LM head (over the draft vocabulary if the heads have one, see
spec_jax.heads.vocab). EAGLE-2 = this head + dynamic tree.

Features (hparam `features`): "post" is the reference's — the target's final hidden states after
its final norm (what Hugging Face returns as the last hidden state), regressed and fed straight to
the LM head (the default for fresh heads: from scratch on SmolLM2 it learned faster at every
step, run 25 in docs/training.md; the shipped SmolLM2 head is one); "pre" (heads saved without the
setting, as every SmolLM2 head was until run 26) takes them before the final
norm and applies the norm before the LM head."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.errors import SpecJaxError
from spec_jax.heads.feature import FeatureDrafter, draft_attention
from spec_jax.heads.method import Method, dynamic_settings, feature_drafter
from spec_jax.heads.vocab import shared_head_weight
from spec_jax.models.layers import dot_f32, matmul, rms_norm
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


def init_params(cfg, key, scale=0.02, num_layers: int = 1):
    h = cfg.hidden_size
    k1, k2 = jax.random.split(key)  # as before extra layers existed: same one-layer heads
    dt = jnp.dtype(cfg.dtype)
    params = {"fc_w": (scale * jax.random.normal(k1, (2 * h, h))).astype(dt),
              "fc_b": jnp.zeros((h,), dt),
              "layer": init_layer(cfg, k2, scale, input_norm=False)}
    return add_layers(params, cfg, num_layers, jax.random.fold_in(key, 1), scale)


def num_layers_of(params) -> int:
    return 1 + sum(1 for k in params if k.startswith("layer_"))


def add_layers(params, cfg, num_layers: int, key, scale=0.02):
    """`params` with full decoder layers appended up to `num_layers`. A new layer's output
    projections (wo, w_down) are zero, so it starts as the identity: a trained head grown this way
    predicts exactly what it did, and training moves on from there."""
    params = dict(params)
    for i, k in zip(range(num_layers_of(params), num_layers),
                    jax.random.split(key, max(num_layers, 1))):
        lp = init_layer(cfg, k, scale, input_norm=True)
        params[f"layer_{i}"] = {**lp, "wo": jnp.zeros_like(lp["wo"]),
                                "w_down": jnp.zeros_like(lp["w_down"])}
    return params


def features_of(hparams) -> str:
    """The features setting of saved EAGLE hparams; heads saved before it existed read pre-norm."""
    return hparams.get("features", "pre")


def check_features(features: str) -> None:
    if features not in ("pre", "post"):
        raise SpecJaxError(f"EAGLE features {features!r}: choose 'post' (after the target's final "
                           "norm, the reference's) or 'pre' (before it)")


@dataclasses.dataclass(frozen=True)
class EagleDrafter(FeatureDrafter):
    method: str = "eagle"
    features: str = "pre"  # "post": after the target's final norm, as the reference trains

    def __post_init__(self):
        check_features(self.features)

    def target_feature(self, dparams, tparams, tcfg, hidden, aux_hidden, rows=None):
        if self.features == "post":
            return rms_norm(hidden, tparams["final_norm"], tcfg.rms_norm_eps)
        return hidden

    def logits(self, dparams, tparams, tcfg, feat):
        if self.features == "post":
            return dot_f32(feat, shared_head_weight(dparams, tparams, tcfg))
        return super().logits(dparams, tparams, tcfg, feat)

    def cell(self, dparams, tparams, tcfg, module, feat, tokens, positions, cache_k, cache_v,
             cache_valid, cache_len, extra_k, extra_v, extra_mask, own_mask, rows=None):
        e = embed(tparams, tokens).astype(feat.dtype)
        x = matmul(jnp.concatenate([e, feat], axis=-1), dparams["fc_w"], rows=rows)
        x = x + dparams["fc_b"]

        rope = rope_table(positions, tcfg)
        ks, vs = [], []
        for i in range(self.num_layers):
            def attend(q, k, v, i=i):
                return draft_attention(q, cache_k[i], cache_v[i], cache_valid, cache_len,
                                       extra_k[i], extra_v[i], extra_mask, k, v, own_mask,
                                       self.attn_impl)

            lp = dparams["layer"] if i == 0 else dparams[f"layer_{i}"]
            x, k, v = decoder_layer(lp, tcfg, x, rope, attend, input_norm=i > 0, rows=rows)
            ks.append(k)
            vs.append(v)
        return x, tuple(ks), tuple(vs)


def _drafter(hparams: dict, tree):
    return feature_drafter(lambda **dyn: EagleDrafter(num_layers=hparams.get("num_layers", 1),
                                                      features=features_of(hparams), **dyn),
                           dynamic_settings(hparams), tree)


def _grow(params, hparams: dict, target, wanted: dict, seed: int):
    """Heads grown by identity layers up to the `num_layers` wanted (`add_layers`); heads that read
    other features than `wanted` cannot be."""
    have = features_of(hparams)
    want = wanted.get("features", have)
    if want != have:
        raise SpecJaxError(f"--init heads read {have}-norm features, not {want}-norm: train a "
                           f"fresh head for {want}")
    layers = wanted.get("num_layers", 1)
    if layers > hparams.get("num_layers", 1):
        params = add_layers(params, target.cfg, layers, jax.random.PRNGKey(seed))
        hparams = {**hparams, "num_layers": layers}
    return params, hparams


METHOD = Method(
    name="eagle", title="EAGLE",
    defaults={"top_k": 8, "depth": 5, "total_tokens": 32, "num_layers": 1, "features": "post"},
    init_params=lambda tcfg, key, scale, hp, d2t: (
        init_params(tcfg, key, scale, num_layers=hp["num_layers"]), hp),
    drafter=_drafter, check=lambda hp: check_features(hp["features"]), grow=_grow,
    # the paper's loss: SmoothL1 on the next feature beside the (weighted) cross-entropy
    unroll=lambda hp, cfg: dict(steps=cfg.eagle_ttt_steps, noise=cfg.noise, feat_loss_weight=1.0,
                                ce_weight=cfg.eagle_ce_weight, decay=cfg.decay),
    train_record=lambda hp, cfg: {"ttt_steps": cfg.eagle_ttt_steps,
                                  "ce_weight": cfg.eagle_ce_weight},
    flags=("--layers", "--eagle-features"),
    flag_hparams=lambda layers, features, own_lm_heads: (
        (("num_layers", layers),) + ((("features", features),) if features else ())))
