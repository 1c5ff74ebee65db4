"""Teacher-forced passes along true token sequences, shared by training (spec_jax.train) and
tree sizing's acceptance profile (spec_jax.sizing): the frozen target's hidden states over a set
of sequences (`feature_cache`), a feature drafter's outputs unrolled along the true tokens
(`unrolled_features`) and the shift that lines position j up with the token j + i (`shift`)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def shift(x, i, fill=0):
    """x[:, j + i] at position j (padded with `fill` past the end)."""
    if i == 0:
        return x
    pad = jnp.full((x.shape[0], i) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, i:], pad], axis=1)


def token_arrays(seqs, plens, seq_len):
    """Sequences truncated and zero-padded to seq_len: tokens [N, L] and mask [N, L], 1 from the
    last prompt token on (the positions whose next token is a response token)."""
    n = len(seqs)
    toks = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        s = s[:seq_len]
        toks[i, :len(s)] = s
        mask[i, max(p - 1, 0):len(s)] = 1.0
    return toks, mask


def feature_cache(target, seqs, plens, seq_len, aux_layers=(), batch=8, chunk="auto",
                  progress=False):
    """Run the frozen target once over every sequence (truncated to seq_len); `progress` shows a
    bar over sequences (the pass takes ~1 s a sequence on a 2-core CPU).

    Returns tokens [N, L], mask [N, L] (see token_arrays), feats [N, L, H], aux or None.
    chunk: run each batch `chunk` tokens at a time against a KV cache (a chunked prefill) instead
    of all at once. "auto" picks 64 // batch for targets in the packed CPU layout (as fast as one
    pass now that the packed kernel takes any row count: 12.6-13.3 s for 32 sequences of 256
    tokens either way, in less activation memory), and None (one pass) otherwise."""
    toks, mask = token_arrays(seqs, plens, seq_len)
    n = len(seqs)
    cfg = target.cfg
    if chunk == "auto":
        chunk = max(64 // batch, 1) if target.layout == "packed" else None
    fwd = jax.jit(functools.partial(_target_features, target=target, aux_layers=aux_layers,
                                    chunk=chunk))
    feats = np.zeros((n, seq_len, cfg.hidden_size), np.float32)
    aux = np.zeros((n, seq_len, cfg.hidden_size * len(aux_layers)), np.float32) if aux_layers else None
    # batches of similar length, each cut to its longest sequence (rounded up to 64 tokens: few
    # shapes to compile); causal attention makes a position's features independent of the cut
    lengths = np.minimum([len(x) for x in seqs], seq_len)
    order = np.argsort(lengths, kind="stable")
    from tqdm import tqdm
    bar = tqdm(total=n, disable=not progress, desc="target features", unit="seq")
    for i in range(0, n, batch):
        idx = order[i:i + batch]
        cut = min(seq_len, -(-int(lengths[idx].max()) // 64) * 64)
        part = np.pad(toks[idx, :cut], ((0, batch - len(idx)), (0, 0)))
        hidden, aux_hidden = fwd(target.params, jnp.asarray(part))
        feats[idx, :cut] = np.asarray(hidden[:len(idx)], np.float32)
        if aux is not None:
            aux[idx, :cut] = np.asarray(aux_hidden[:len(idx)], np.float32)
        bar.update(len(idx))
    bar.close()
    return toks, mask, feats, aux


def _target_features(params, tokens, *, target, aux_layers, chunk):
    """tokens [B, L] -> (hidden [B, L, H], aux [B, L, H * len(aux_layers)] or None)."""
    from spec_jax.cache import cache_for, commit
    from spec_jax.models.llama import causal_mask, forward

    cfg = target.cfg
    b, length = tokens.shape
    if chunk is None or chunk >= length:
        out = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32),
                      tokens.shape), cache_for(cfg, b, 1), causal_mask(b, length),
                      aux_layers=aux_layers, return_logits=False)
        return out.hidden, out.aux_hidden
    steps = -(-length // chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, steps * chunk - length)))
    arange = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))

    def body(cache, i):
        pos = i * chunk + arange
        out = forward(params, cfg, jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1),
                      pos, cache, causal_mask(b, chunk), aux_layers=aux_layers,
                      return_logits=False, attn_impl="auto")
        # commit after every layer's cache read (see step.py), so the cache is updated in place
        k, v, hidden, aux = jax.lax.optimization_barrier(
            (out.k_new, out.v_new, out.hidden, out.aux_hidden))
        cache = commit(cache, k, v, pos, arange, jnp.full((b,), chunk, jnp.int32))
        return cache, (hidden, aux)

    _, (hidden, aux) = jax.lax.scan(body, target.new_cache(b, steps * chunk), jnp.arange(steps))
    join = lambda x: None if x is None else jnp.moveaxis(x, 0, 1).reshape(b, steps * chunk, -1)[:, :length]
    return join(hidden), join(aux)


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
        out, k, v = cell(m, t_feat, shift(toks, 1), nokv, nokv, nomask, causal)
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
            feat, k, v = cell(m, feat, shift(toks, i + 1), ex_k, ex_v, ex_mask, eye)
        else:
            k, v = ctx[0]
        diag_k.append(k)
        diag_v.append(v)
        feats.append(feat)
    return feats
