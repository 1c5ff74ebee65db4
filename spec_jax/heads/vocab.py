"""Draft vocabulary (FR-Spec's idea): a head may propose only from the `Vd` most frequent tokens of
its training responses. Its LM head then reads [H, Vd] per draft step instead of [H, V] (8192 of
SmolLM2's 49152 tokens: 6x less memory traffic, and a 6x cheaper training loss); verification still
scores the full vocabulary, so outputs stay exactly the target's.

EAGLE-3 trains its own [H, Vd] LM head (Medusa may: one per head). EAGLE-1/2, Medusa and MTP
otherwise read through the target's frozen LM head: for them `bind_target` adds its [H, Vd]
column slice as `lm_sub`, derived from the target at load time and never saved. `d2t` [Vd] maps
draft ids to target ids, `t2d` [V] back (-1 outside).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import gemm as cpu_gemm
from spec_jax.models.layers import dot_f32, rms_norm
from spec_jax.models.llama import lm_head_weight

DERIVED = ("lm_sub",)  # parameters rebuilt from the target, never saved or trained


def vocab_maps(d2t, vocab_size: int) -> dict:
    """{"d2t": [Vd], "t2d": [V]} for the draft vocabulary `d2t` (target ids)."""
    d2t = jnp.asarray(d2t, jnp.int32)
    t2d = jnp.full((vocab_size,), -1, jnp.int32).at[d2t].set(jnp.arange(len(d2t), dtype=jnp.int32))
    return {"d2t": d2t, "t2d": t2d}


def frequent_tokens(tokens, mask, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent tokens where mask > 0, as sorted target ids [size]."""
    counts = np.bincount(np.asarray(tokens)[np.asarray(mask) > 0].ravel(), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")[:size]
    return np.sort(order).astype(np.int32)


def shared_head_weight(dparams, tparams, tcfg):
    """The target's LM head [H, Vd] over the heads' draft vocabulary ([H, V] without one)."""
    if "lm_sub" in dparams:
        return dparams["lm_sub"]
    w = lm_head_weight(tparams)  # packed on CPU
    if "d2t" not in dparams:
        return w
    if isinstance(w, cpu_gemm.PackedWeight):
        w = cpu_gemm.unpack(w)
    return jnp.take(w, dparams["d2t"], axis=1)


def bind_target(params: dict, tparams, tcfg) -> dict:
    """Head params ready to run: a draft vocabulary over the target's LM head gets its slice once,
    instead of a gather inside every draft step."""
    if "d2t" not in params or any(k in params for k in ("lm_head", "lm_heads", "lm_sub")):
        return params
    return {**params, "lm_sub": shared_head_weight(params, tparams, tcfg)}


def shared_head_logits(dparams, tparams, tcfg, hidden):
    """The target's final norm + LM head over the draft vocabulary: [..., H] -> f32 [..., Vd]."""
    h = rms_norm(hidden, tparams["final_norm"], tcfg.rms_norm_eps)
    return dot_f32(h, shared_head_weight(dparams, tparams, tcfg))


def to_target_ids(dparams, ids):
    return dparams["d2t"][ids] if "d2t" in dparams else ids


def to_draft_labels(dparams, labels, valid):
    """Target-id labels -> (draft-id labels, valid and inside the draft vocabulary)."""
    if "t2d" not in dparams:
        return labels, valid
    d = dparams["t2d"][labels]
    return jnp.maximum(d, 0), valid * (d >= 0)


def topk_logp(logits, dparams, k):
    """Top-k log-probabilities of draft logits [..., Vd] and their target ids, each [..., k]."""
    v, i = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return v, to_target_ids(dparams, i.astype(jnp.int32))
