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

from spec_jax.heads.vocab import shared_head_logits, to_draft_labels


def _shift(x, i, fill=0):
    """x[:, j + i] at position j (padded with `fill` past the end)."""
    if i == 0:
        return x
    pad = jnp.full((x.shape[0], i) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, i:], pad], axis=1)


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


def unrolled_features(drafter, dparams, tparams, tcfg, toks, t_feat, steps: int):
    """Draft output features of `steps` unrolled draft steps along the true tokens.

    toks [B, L] token ids, t_feat [B, L, H'] the draft's input features from the target.
    Returns a list of `steps` arrays [B, L, H]: step i at position j predicts the token j + i + 2.
    Used by the training losses and by tree sizing's acceptance profile."""
    b, l = toks.shape
    kvh, hd = tcfg.num_kv_heads, tcfg.head_dim
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    nl, dt = drafter.num_layers, jnp.dtype(tcfg.dtype)
    empty_k = (jnp.zeros((b, 1, kvh, hd), dt),) * nl
    no_valid, zero_len = jnp.zeros((b, 1), bool), jnp.zeros((b,), jnp.int32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((l, l), bool)), (b, l, l))
    eye = jnp.broadcast_to(jnp.eye(l, dtype=bool), (b, l, l))

    def cell(module, feat, tokens, ex_k, ex_v, ex_mask, own):
        return drafter.cell(dparams, tparams, tcfg, module, feat, tokens, pos, empty_k, empty_k,
                            no_valid, zero_len, ex_k, ex_v, ex_mask, own)

    nomask = jnp.zeros((b, l, 0), bool)
    nokv = (jnp.zeros((b, 0, kvh, hd), dt),) * nl
    # teacher-forced context per module (module m's keys over the real pairs)
    ctx = {}
    out1 = None
    for m in sorted({i % drafter.num_modules for i in range(steps)}):
        out, k, v = cell(m, t_feat, _shift(toks, 1), nokv, nokv, nomask, causal)
        ctx[m] = (k, v)
        if m == 0:
            out1 = out
    feat, diag_k, diag_v, feats = out1, [], [], []
    for i in range(steps):
        m = i % drafter.num_modules
        if i > 0:
            ck, cv = ctx[m]
            # per layer: the teacher-forced context, then each earlier unrolled step's keys
            ex_k = tuple(jnp.concatenate([ck[j]] + [d[j] for d in diag_k], axis=1) for j in range(nl))
            ex_v = tuple(jnp.concatenate([cv[j]] + [d[j] for d in diag_v], axis=1) for j in range(nl))
            ex_mask = jnp.concatenate([causal] + [eye] * len(diag_k), axis=2)
            feat, k, v = cell(m, feat, _shift(toks, i + 1), ex_k, ex_v, ex_mask, eye)
        else:
            k, v = ctx[0]
        diag_k.append(k)
        diag_v.append(v)
        feats.append(feat)
    return feats


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


def medusa_loss(dparams, tparams, tcfg, batch, num_heads: int, decay: float):
    """Cross-entropy per Medusa head (head k at position j predicts the token j + k + 2)."""
    from spec_jax.heads.medusa import medusa_logits

    toks, feats, mask = batch["tokens"], batch["feats"], batch["mask"].astype(jnp.float32)
    b, l, h = feats.shape
    logits = medusa_logits(dparams, tparams, tcfg, feats.reshape(b * l, h)).reshape(b, l, num_heads, -1)
    total, metrics = 0.0, {}
    for k in range(num_heads):
        labels = _shift(toks, k + 2)
        valid = _shift(mask, k + 2) * (jnp.arange(l)[None] < l - k - 2)
        ce, acc = _ce(logits[:, :, k], labels, valid, dparams)
        total = total + decay ** k * ce
        metrics[f"acc{k + 1}"] = acc
    metrics["loss"] = total
    return total, metrics
