"""Training forward passes and losses for each draft method (teacher-forced, batched).

A batch holds tokens [B, L], the frozen target's final hidden states `feats` [B, L, H] (pre-norm),
its fused hidden states `aux` [B, L, 3H] (EAGLE-3 only) and `mask` [B, L] (1 on response tokens).
Pair j of a feature drafter is (feature at j, token j+1) at position j, predicting the feature at
j+1 and the token at j+2, exactly as at inference.

Unrolled draft steps ("training-time test", EAGLE-3; also used for MTP chains): step i feeds back
the head's own output of step i-1 and the true token j+i; its query attends to the teacher-forced
causal context (step-1 keys at positions <= j) plus only the same-position keys of earlier
unrolled steps, which is what a chain or tree node sees at inference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from spec_jax.features import shift as _shift
from spec_jax.features import unrolled_features
from spec_jax.heads.vocab import shared_head_logits, to_draft_labels


def _top1(logits, d_labels, in_vocab, mask):
    """Top-1 accuracy over all labels (a token outside the draft vocabulary counts as a miss)."""
    acc = (jnp.argmax(logits, -1) == d_labels).astype(jnp.float32) * in_vocab
    return acc.sum() / jnp.maximum(mask.sum(), 1.0)


def _ce(logits, labels, mask, dparams):
    """Mean cross-entropy over draft-vocabulary labels and top-1 accuracy (`_top1`):
    logits [..., Vd], target-id labels [...]."""
    d_labels, in_vocab = to_draft_labels(dparams, labels, mask)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, d_labels)
    return (ce * in_vocab).sum() / jnp.maximum(in_vocab.sum(), 1.0), _top1(logits, d_labels,
                                                                            in_vocab, mask)


def _soft_ce(logits, target_logits, labels, mask, dparams):
    """Cross-entropy against the target's own distribution over the draft vocabulary (EAGLE's
    loss: the runners-up it would also accept at temperature > 0, and the ranking a tree's
    top-k expands, are taught too) and top-1 accuracy against the data's labels, as `_ce`.
    logits, target_logits [..., Vd]; labels, mask [...]."""
    p = jax.nn.softmax(jax.lax.stop_gradient(target_logits), axis=-1)
    ce = optax.softmax_cross_entropy(logits, p)
    d_labels, in_vocab = to_draft_labels(dparams, labels, mask)
    return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0), _top1(logits, d_labels, in_vocab, mask)


def feature_unrolled(drafter, dparams, tparams, tcfg, batch, steps: int, key, noise: float,
                     feat_loss_weight: float, ce_weight: float, decay: float, soft: bool = False):
    """Loss of a feature drafter unrolled for `steps` draft steps. Returns (loss, metrics).

    soft: cross-entropy against the target's distribution at the next position (its final norm and
    LM head over the cached features) instead of the data's next token."""
    toks, feats, mask = batch["tokens"], batch["feats"], batch["mask"].astype(jnp.float32)
    l = toks.shape[1]
    clean = drafter.target_feature(dparams, tparams, tcfg, feats, batch.get("aux"))
    t_feat = clean
    if noise > 0:
        t_feat = t_feat + noise * jax.random.uniform(key, t_feat.shape, minval=-1.0, maxval=1.0)
    total, metrics = 0.0, {}
    if soft:  # the target's logits at position j predict the token j + 1
        t_logits = shared_head_logits(dparams, tparams, tcfg, feats)
    for i, feat in enumerate(unrolled_features(drafter, dparams, tparams, tcfg, toks, t_feat, steps)):
        # step i at position j predicts the token j + i + 2, where the data has one
        labels = _shift(toks, i + 2)
        valid = _shift(mask, i + 2) * (jnp.arange(l)[None] < l - i - 2)
        logits = drafter.logits(dparams, tparams, tcfg, feat)
        if soft:
            ce, acc = _soft_ce(logits, _shift(t_logits, i + 1), labels, valid, dparams)
        else:
            ce, acc = _ce(logits, labels, valid, dparams)
        total = total + decay ** i * ce_weight * ce
        metrics[f"acc{i + 1}"] = acc
        if i == 0 and feat_loss_weight > 0:
            target = jax.lax.stop_gradient(_shift(clean, 1))
            fl = optax.huber_loss(feat, target).mean(-1)
            total = total + feat_loss_weight * (fl * valid).sum() / jnp.maximum(valid.sum(), 1.0)
    metrics["loss"] = total
    return total, metrics


def heads_loss(head_logits, dparams, tparams, tcfg, batch, num_heads: int, decay: float):
    """Cross-entropy per head of heads that read every depth off the target's feature at once
    (Medusa: head k at position j predicts the token j + k + 2). `head_logits(dparams, tparams,
    tcfg, feats [B, L, H])` -> [B, L, num_heads, V] (spec_jax.heads.method.Method.head_logits)."""
    toks, feats, mask = batch["tokens"], batch["feats"], batch["mask"].astype(jnp.float32)
    l = feats.shape[1]
    logits = head_logits(dparams, tparams, tcfg, feats)
    total, metrics = 0.0, {}
    for k in range(num_heads):
        labels = _shift(toks, k + 2)
        valid = _shift(mask, k + 2) * (jnp.arange(l)[None] < l - k - 2)
        ce, acc = _ce(logits[:, :, k], labels, valid, dparams)
        total = total + decay ** k * ce
        metrics[f"acc{k + 1}"] = acc
    metrics["loss"] = total
    return total, metrics
