"""Acceptance profiles: the ranks of the true tokens among the draft's candidates along true
continuations (`rank_profile`), the n-gram and datastore chains' agreement with them
(`chain_profile`), the context's n-gram match lengths (`match_profile`), and greedy decoding
replayed over them (`replay_tau`): a static tree's tau without running it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.heads.methods import method_of


def profile_depth(heads) -> int:
    """Draft depths the acceptance profile of these heads covers (`Method.profile_depth`)."""
    return method_of(heads.method).profile_depth(heads.hparams)


def rank_profile(target, heads, seqs, plens, depth: int, max_rank: int = 8) -> list[np.ndarray]:
    """Ranks of the true tokens among the draft's candidates along the true paths.

    seqs: token sequences (prompt + the target's greedy continuation), plens: prompt lengths.
    Returns per sequence an int array [N, depth] over its N positions j whose root token (j + 1)
    is a generated token with `depth` tokens after it, in order: entry d is the rank of the true
    token at depth d + 1 among the draft's candidates, or -1 (not among the first max_rank, or
    outside the draft vocabulary)."""
    from spec_jax.features import feature_cache, shift
    from spec_jax.heads.vocab import to_draft_labels

    method = method_of(heads.method)
    drafter = heads.drafter()
    dparams = heads.bind(target)
    tcfg = target.cfg
    seq_len = max(64, -(-max(len(s) for s in seqs) // 64) * 64)
    toks, mask, feats, aux = feature_cache(target, seqs, plens, seq_len,
                                           aux_layers=drafter.aux_layers, batch=len(seqs))

    @jax.jit
    def ranks_fn(dparams, tparams, toks, feats, aux):
        logits = method.profile_logits(drafter, dparams, tparams, tcfg, toks, feats, aux, depth)
        out = []
        for i, lg in enumerate(logits):
            labels = shift(toks, i + 2)
            d_labels, in_vocab = to_draft_labels(dparams, labels, jnp.ones_like(labels, jnp.float32))
            true = jnp.take_along_axis(lg, d_labels[..., None], axis=-1)
            rank = jnp.sum(lg > true, axis=-1)
            out.append(jnp.where((in_vocab > 0) & (rank < max_rank), rank, -1))
        return jnp.stack(out, -1)

    r = np.asarray(ranks_fn(dparams, target.params, jnp.asarray(toks), jnp.asarray(feats),
                            None if aux is None else jnp.asarray(aux)))
    out = []
    for i, (s, p) in enumerate(zip(seqs, plens)):
        # root token j + 1 generated (j >= p - 1) and the tokens j + 2 .. j + depth + 1 exist
        last = min(len(s), seq_len) - depth - 2
        out.append(r[i, p - 1:max(last + 1, p - 1)])
    return out


def _prefixes(row):
    """Rank prefixes accepted at one position: (r1,), (r1, r2), ... up to the first miss."""
    out = []
    for d in range(len(row)):
        if row[d] < 0:
            break
        out.append(tuple(int(x) for x in row[:d + 1]))
    return out


def _head_accepted(row, tree: set) -> int:
    """Tokens a static tree (a set of rank-prefix tuples) accepts at a position of the profile."""
    a = 0
    for p in _prefixes(row):
        if p not in tree:
            break
        a = len(p)
    return a


def _roots(accepted: list[np.ndarray]) -> list[np.ndarray]:
    """The positions greedy decoding visits as step roots when it accepts accepted[k][i] draft
    tokens at position i of sequence k: from each root, move past the accepted tokens and the
    bonus token."""
    out = []
    for acc in accepted:
        i, roots = 0, []
        while i < len(acc):
            roots.append(i)
            i += int(acc[i]) + 1
        out.append(np.asarray(roots, np.int64))
    return out


def _replay(accepted: list[np.ndarray]) -> float:
    """Tau of greedy decoding over the profile: tokens emitted (accepted + bonus) per step."""
    roots = _roots(accepted)
    steps = sum(len(r) for r in roots)
    emitted = sum(int(np.sum(acc[r])) + len(r) for acc, r in zip(accepted, roots))
    return emitted / steps if steps else 1.0


def _accepted(profile: list[np.ndarray], paths, ngram=None, graft: int = 0, ds=None,
              ds_graft: int = 0) -> list[np.ndarray]:
    """Draft tokens the static tree `paths` (with its grafted chains) accepts at each position of
    the profile, per sequence: the longest accepted of tree and chains."""
    tree = {tuple(p) for p in paths}
    accepted = []
    for k, ranks in enumerate(profile):
        a = np.array([_head_accepted(row, tree) for row in ranks], np.int64)
        if graft:
            a = np.maximum(a, np.minimum(ngram[k], graft))
        if ds_graft:
            a = np.maximum(a, np.minimum(ds[k], ds_graft))
        accepted.append(a)
    return accepted


def replay_tau(profile: list[np.ndarray], paths, ngram=None, graft: int = 0, ds=None,
               ds_graft: int = 0) -> float:
    """Accepted tokens per target call of greedy decoding with the static tree `paths`, replayed
    over the rank profile (see `rank_profile`): exact where teacher forcing matches inference.
    With `graft` > 0, a `graft`-token n-gram chain is grafted on (`ngram`: see `chain_profile`),
    with `ds_graft` > 0 a datastore chain (`ds`); the longest accepted of tree and chains wins."""
    return _replay(_accepted(profile, paths, ngram, graft, ds, ds_graft))


def chain_profile(seqs, plens, profile, depth: int, continuation=None) -> list[np.ndarray]:
    """For the positions of `rank_profile` (same order): how many leading tokens of a chain
    drafted from that root's context are the true continuation. `continuation(NgramState)` ->
    (tokens [B, depth], valid [B, depth]) drafts it; the default is the n-gram drafter's
    (spec_jax.heads.ngram). A grafted tree accepts the longer of its own path and this."""
    from spec_jax.heads.ngram import NgramDrafter

    continuation = continuation or NgramDrafter(depth=depth).continuation
    out = []
    for s, p, ranks in zip(seqs, plens, profile):
        n = len(ranks)
        if n == 0:
            out.append(np.zeros((0,), np.int32))
            continue
        s = np.asarray(s, np.int32)
        state = _histories(s, p, n)
        hlen = np.asarray(state.hlen)
        tok, valid = continuation(state)
        true = np.full((n, depth), -1, np.int32)
        for i, h in enumerate(hlen):
            nxt = s[h:h + depth]
            true[i, :len(nxt)] = nxt
        agree = np.asarray(valid) & (np.asarray(tok) == true)
        out.append(np.cumprod(agree, axis=1).sum(axis=1).astype(np.int32))
    return out


def _histories(seq: np.ndarray, plen: int, n: int):
    """The n-gram drafter's state at the roots of a sequence's first n profile positions (rank
    row i has its root at token plen + i)."""
    from spec_jax.heads.ngram import NgramState

    hlen = plen + 1 + np.arange(n)
    return NgramState(hist=jnp.asarray(np.broadcast_to(seq, (n, len(seq)))), hlen=jnp.asarray(hlen))


def match_profile(seqs, plens, profile) -> list[np.ndarray]:
    """For the positions of `rank_profile`: the length (0..8) of the longest suffix of the context
    at that root which occurred earlier in it, as the n-gram drafter finds it (what a switch's
    policy reads, spec_jax.compose.switch)."""
    from spec_jax.heads.ngram import NgramDrafter

    out = []
    for s, p, ranks in zip(seqs, plens, profile):
        if len(ranks) == 0:
            out.append(np.zeros((0,), np.int32))
            continue
        out.append(np.asarray(NgramDrafter().search(_histories(np.asarray(s, np.int32), p,
                                                               len(ranks)))[1]))
    return out
