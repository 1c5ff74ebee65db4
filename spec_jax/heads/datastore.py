"""Datastore drafting (REST, He et al. 2023): the context's last n tokens looked up in a corpus.

The corpus is the target's own earlier output (the responses of a `spec-jax distill` set), so the
drafted continuation is what the target itself wrote after the same n tokens elsewhere: stock
phrases of its chat answers, idioms of its code. The n-gram drafter (spec_jax.heads.ngram) looks
only at the current context; the two are grafted together onto a heads' tree (spec_jax.compose.graft,
written `TREE+ds:N` or `TREE+ngram:8+ds:8`).

Built once on the host: for every n-gram of the corpus (n from `min_ngram` to `max_ngram`), the
continuation that most of its occurrences share, chosen token by token (a majority walk down the
trie of continuations), keyed by two 32-bit hashes. A draft step is one binary search per n and
one gather, inside the jitted loop; the longest n found wins. Verification is untouched, so the
output is too.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from spec_jax.errors import SpecJaxError
from spec_jax.target import same_target

_MULT = (np.uint32(0x01000193), np.uint32(0x5BD1E995))
_SEED = (np.uint32(0x9E3779B1), np.uint32(0x85EBCA77))


def ngram_hash(cols, n: int, which: int):
    """uint32 hash of n-grams given as a list of n uint32 columns (token id + 1), numpy or jax.

    The same arithmetic (wrapping uint32) on both sides, so host-built keys match in-graph queries."""
    xp = np if isinstance(cols[0], np.ndarray) else jnp
    h = xp.full(cols[0].shape, (n * int(_SEED[which])) & 0xFFFFFFFF, dtype=xp.uint32)
    for c in cols:
        h = (h * _MULT[which]) ^ c.astype(xp.uint32)
        h = h ^ (h >> 15)
    return h * np.uint32(0x2C1B3C6D) ^ (h >> 12)


@dataclasses.dataclass(eq=False)
class Datastore:
    """A token corpus (-1 between documents) and the lookup tables built from it.

    tokens: [N] int32. info: where the corpus came from and the target's identity."""

    tokens: np.ndarray
    info: dict
    max_ngram: int = 8
    min_ngram: int = 2
    depth: int = 8
    min_count: int = 1
    _tables: dict | None = dataclasses.field(default=None, repr=False)
    _priors: tuple | None = dataclasses.field(default=None, repr=False)

    def check_target(self, target) -> None:
        mine, theirs = self.info.get("target", {}), target.identity()
        bad = same_target(mine, theirs)
        if bad:
            raise SpecJaxError(f"this datastore was built from another target's output ({', '.join(bad)} "
                               "differ): build one for this target with `spec-jax datastore`")

    def fingerprint(self) -> str:
        """A short hash of the corpus and settings (keys the tree calibration made with it)."""
        import hashlib

        h = hashlib.sha256(np.ascontiguousarray(self.tokens, np.int32).tobytes())
        h.update(json.dumps([self.min_ngram, self.max_ngram, self.depth, self.min_count]).encode())
        return h.hexdigest()[:16]

    def tables(self) -> dict:
        """{"ds_h1": [G] uint32 sorted, "ds_h2": [G] uint32, "ds_cont": [G, depth] int32 (-1 past
        the end)}: device arrays, built on first use and kept."""
        if self._tables is None:
            h1, h2, cont = build_tables(self.tokens, self.min_ngram, self.max_ngram, self.depth,
                                        self.min_count)
            self._tables = {"ds_h1": jnp.asarray(h1), "ds_h2": jnp.asarray(h2),
                            "ds_cont": jnp.asarray(cont)}
        return self._tables

    def priors(self, ngram_depth: int, ds_depth: int, ngram_max: int) -> dict:
        """How often each grafted chain's tokens are right, measured on this corpus (the target's
        own output): {"ngram_prior": [ngram_max + 1, ngram_depth], "ds_prior": [max_ngram + 1,
        ds_depth]} float32 log-probabilities that a chain's first i + 1 tokens are all the
        target's next tokens, given the length of the context suffix the chain continues. Device
        arrays, built on first use and kept (a few seconds). See `chain_priors`."""
        key = (ngram_depth, ds_depth, ngram_max)
        if self._priors is None or self._priors[0] != key:
            ng, ds = chain_priors(self.tokens, ngram_depth, ngram_max, ds_depth, self.min_ngram,
                                  self.max_ngram, self.min_count)
            self._priors = (key, {"ngram_prior": jnp.asarray(ng), "ds_prior": jnp.asarray(ds)})
        return self._priors[1]

    def chain(self, depth: int) -> DatastoreChain:
        if not 1 <= depth <= self.depth:
            raise SpecJaxError(f"this datastore drafts at most {self.depth} tokens: write +ds:N with "
                               f"N <= {self.depth}, or rebuild it with a larger depth")
        return DatastoreChain(depth=depth, min_ngram=self.min_ngram, max_ngram=self.max_ngram)


def build_tables(tokens, min_ngram: int, max_ngram: int, depth: int, min_count: int = 1):
    """Host-side build (numpy): sorted keys and majority continuations of every n-gram."""
    toks = np.asarray(tokens, np.int64)
    n_tok = len(toks)
    h1s, h2s, conts = [], [], []
    for n in range(min_ngram, max_ngram + 1):
        m = n_tok - n  # grams toks[s:s+n] whose next token toks[s+n] exists
        if m <= 0:
            continue
        cols = [toks[k:k + m] for k in range(n)]
        ok = toks[n:n + m] >= 0
        for c in cols:
            ok &= c >= 0
        start = np.nonzero(ok)[0]
        cols = [(c[start] + 1).astype(np.uint32) for c in cols]
        h1, h2 = ngram_hash(cols, n, 0), ngram_hash(cols, n, 1)
        order = np.lexsort((h2, h1))
        h1, h2, first = h1[order], h2[order], start[order] + n  # first continuation token
        new = np.ones(len(h1), bool)
        new[1:] = (h1[1:] != h1[:-1]) | (h2[1:] != h2[:-1])
        group = np.cumsum(new) - 1
        count = np.bincount(group)
        cont = _majority_walk(toks, first, group, len(count), depth)
        keep = count >= min_count
        h1s.append(h1[new][keep])
        h2s.append(h2[new][keep])
        conts.append(cont[keep])
    if not h1s:
        raise SpecJaxError(f"the datastore corpus has fewer than {min_ngram + 1} tokens")
    h1, h2, cont = np.concatenate(h1s), np.concatenate(h2s), np.concatenate(conts)
    order = np.argsort(h1, kind="stable")
    h1, h2, cont = h1[order], h2[order], cont[order]
    uniq = np.ones(len(h1), bool)  # rare 32-bit collisions of h1: the first entry keeps the key
    uniq[1:] = h1[1:] != h1[:-1]
    return h1[uniq], h2[uniq], cont[uniq].astype(np.int32)


def _log_rate(hits, count):
    """Smoothed log(hits / count) per row, kept non-increasing along each row (float32)."""
    rate = (np.minimum.accumulate(hits, axis=1) + 0.1) / (count[:, None] + 1.0)
    return np.log(rate).astype(np.float32)


def chain_priors(tokens, ngram_depth: int, ngram_max: int, ds_depth: int, min_ngram: int,
                 max_ngram: int, min_count: int = 1, holdout: int = 10):
    """Replay both grafted chains over a corpus of the target's own output (documents split by -1;
    greedy verification accepts exactly its next tokens) and count, per length of the matched
    suffix, how often a chain's first i + 1 tokens are all right. Returns log-rates
    ([ngram_max + 1, ngram_depth], [max_ngram + 1, ds_depth]), row = suffix length.

    The n-gram chain looks back in its own document, as it does in the context. The datastore
    chain is looked up in tables built without every `holdout`-th document, and replayed on those,
    so that no document finds itself."""
    toks = np.asarray(tokens, np.int64)
    cut = np.nonzero(toks < 0)[0]
    docs = [d[d >= 0] for d in np.split(toks, cut)]
    docs = [d for d in docs if len(d) > 1]
    ng_hits, ng_count = np.zeros((ngram_max + 1, ngram_depth)), np.zeros(ngram_max + 1)
    for d in docs:
        _replay_ngram(d.tolist(), ngram_depth, ngram_max, ng_hits, ng_count)
    held = [d for i, d in enumerate(docs) if i % holdout == 0]
    rest = [d for i, d in enumerate(docs) if i % holdout != 0]
    ds_hits, ds_count = np.zeros((max_ngram + 1, ds_depth)), np.zeros(max_ngram + 1)
    if held and rest:
        join = lambda ds: np.concatenate([np.r_[d, -1] for d in ds])
        tables = build_tables(join(rest), min_ngram, max_ngram, ds_depth, min_count)
        _replay_datastore(join(held), tables, min_ngram, max_ngram, ds_depth, ds_hits, ds_count)
    return _log_rate(ng_hits, ng_count), _log_rate(ds_hits, ds_count)


def _replay_ngram(doc: list, depth: int, max_n: int, hits, count) -> None:
    """NgramDrafter.search on every prefix of `doc` (the latest earlier occurrence of the longest
    suffix), with its chain scored against what follows; adds into hits/count."""
    last = [dict() for _ in range(max_n + 1)]  # n -> {n-gram: end of its latest occurrence}
    size = len(doc)
    for t in range(size - 1):
        n_best, end = 0, -1
        for n in range(1, min(max_n, t + 1) + 1):
            e = last[n].get(tuple(doc[t + 1 - n:t + 1]))
            if e is None:
                break
            n_best, end = n, e
        for n in range(1, min(max_n, t + 1) + 1):
            last[n][tuple(doc[t + 1 - n:t + 1])] = t
        if end < 0:
            continue
        count[n_best] += 1
        for i in range(depth):
            src = end + 1 + i
            if src > t or t + 1 + i >= size or doc[src] != doc[t + 1 + i]:
                break
            hits[n_best, i] += 1


def _replay_datastore(toks, tables, min_n: int, max_n: int, depth: int, hits, count) -> None:
    """`lookup` (host side) at every position of toks (documents split by -1), scored against what
    follows each position; adds into hits/count."""
    h1s, h2s, cont = tables
    size = len(toks)
    best = np.full(size, -1, np.int64)
    length = np.zeros(size, np.int64)
    for n in range(min_n, max_n + 1):
        end = np.arange(n - 1, size)
        cols = [toks[end - n + 1 + k] for k in range(n)]
        ok = np.all([c >= 0 for c in cols], axis=0)
        cols = [(np.maximum(c, 0) + 1).astype(np.uint32) for c in cols]
        q1, q2 = ngram_hash(cols, n, 0), ngram_hash(cols, n, 1)
        i = np.minimum(np.searchsorted(h1s, q1), len(h1s) - 1)
        hit = ok & (h1s[i] == q1) & (h2s[i] == q2)
        best[end[hit]] = i[hit]
        length[end[hit]] = n
    at = np.nonzero((best >= 0) & (toks >= 0))[0]
    at = at[at + 1 < size]
    at = at[toks[at + 1] >= 0]  # a next token exists in this document
    np.add.at(count, length[at], 1)
    run = np.ones(len(at), bool)
    for i in range(depth):
        nxt = toks[np.minimum(at + 1 + i, size - 1)]
        run &= (at + 1 + i < size) & (nxt >= 0) & (cont[best[at], i] == nxt)
        np.add.at(hits[:, i], length[at], run)


def _majority_walk(toks, first, group, n_groups: int, depth: int) -> np.ndarray:
    """[n_groups, depth]: per group of occurrences (continuations starting at `first`), the token
    most of them have at each depth, among those that agreed with the choices so far."""
    n_tok = len(toks)
    out = np.full((n_groups, depth), -1, np.int64)
    alive = np.ones(len(first), bool)
    vocab = int(toks.max()) + 1
    for d in range(depth):
        pos = first + d
        tok = np.where(alive & (pos < n_tok), toks[np.minimum(pos, n_tok - 1)], -1)
        live = tok >= 0
        if not live.any():
            break
        keys, counts = np.unique(group[live] * vocab + tok[live], return_counts=True)
        g, t = keys // vocab, keys % vocab
        order = np.lexsort((-counts, g))  # per group, the most frequent token (lowest id on ties)
        g, t = g[order], t[order]
        head = np.ones(len(g), bool)
        head[1:] = g[1:] != g[:-1]
        out[g[head], d] = t[head]
        alive = live & (tok == out[group, d])
    return out


def lookup(tables: dict, hist, hlen, min_ngram: int, max_ngram: int, depth: int):
    """The datastore's continuation of each row's context (in-graph).

    hist [B, S] tokens so far (the root last), hlen [B]. Returns (tokens [B, depth],
    valid [B, depth]; valid is a prefix per row, all False when no n-gram of the context is in the
    datastore; the length [B] of the context's suffix it continues, 0 for none)."""
    b, s = hist.shape
    rows = jnp.arange(b)[:, None]
    h1s, h2s, cont = tables["ds_h1"], tables["ds_h2"], tables["ds_cont"]
    g = h1s.shape[0]
    best = jnp.full((b,), -1, jnp.int32)
    length = jnp.zeros((b,), jnp.int32)
    for n in range(min_ngram, max_ngram + 1):  # longer n overrides shorter
        pos = jnp.clip(hlen[:, None] - n + jnp.arange(n)[None, :], 0, s - 1)
        grams = hist[rows, pos].astype(jnp.uint32) + 1  # [B, n]
        cols = [grams[:, k] for k in range(n)]
        q1, q2 = ngram_hash(cols, n, 0), ngram_hash(cols, n, 1)
        i = jnp.minimum(jnp.searchsorted(h1s, q1), g - 1).astype(jnp.int32)
        hit = (h1s[i] == q1) & (h2s[i] == q2) & (hlen >= n)
        best = jnp.where(hit, i, best)
        length = jnp.where(hit, n, length)
    tok = cont[jnp.maximum(best, 0), :depth]
    valid = (best[:, None] >= 0) & (jnp.cumprod(tok >= 0, axis=1) > 0)
    return jnp.where(valid, tok, 0).astype(jnp.int32), valid, length


@dataclasses.dataclass(frozen=True)
class DatastoreChain:
    """The datastore's chain as a graft (static settings; the tables come in the draft params)."""

    depth: int = 8
    min_ngram: int = 2
    max_ngram: int = 8

    def continuation(self, tables: dict, state):
        """(tokens [B, depth], valid [B, depth]) from an NgramState's history."""
        return self.match(tables, state)[:2]

    def match(self, tables: dict, state):
        """(tokens [B, depth], valid [B, depth], length [B] of the suffix it continues)."""
        return lookup(tables, state.hist, state.hlen, self.min_ngram, self.max_ngram, self.depth)


# ---- build, save, load ----

def build_datastore(target, sequences, prompt_lens=None, info: dict | None = None,
                    **kw) -> Datastore:
    """A datastore of token sequences (the responses after each prompt_lens[i] tokens, or whole
    sequences) from `target`'s output. kw: max_ngram, min_ngram, depth, min_count."""
    parts = []
    for i, s in enumerate(sequences):
        s = np.asarray(s, np.int32)
        parts += [s[(prompt_lens[i] if prompt_lens is not None else 0):], np.array([-1], np.int32)]
    if not parts:
        raise SpecJaxError("no sequences to build a datastore from")
    info = {**(info or {}), "target": target.identity()}
    return Datastore(tokens=np.concatenate(parts), info=info, **kw)


_MANIFEST_KEYS = ("prompt_source", "mix", "seed", "samples", "max_new_tokens", "temperature",
                  "target", "target_fingerprint")


def datastore_from_distill(target, paths, **kw) -> Datastore:
    """A datastore of the responses of `spec-jax distill` sets (each checked to be this target's)."""
    from spec_jax.data import load_sets

    seqs, plens, manifests = load_sets(paths, target)
    info = {"sources": [str(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)],
            "samples": len(seqs), "manifests": [{k: m[k] for k in _MANIFEST_KEYS if k in m} for m in manifests]}
    return build_datastore(target, seqs, plens, info, **kw)


def save_datastore(ds: Datastore, out_dir, force: bool = False) -> Path:
    from spec_jax.io import atomic_dir

    out_dir = Path(out_dir)
    with atomic_dir(out_dir, force=force) as tmp:
        np.savez_compressed(tmp / "tokens.npz", tokens=ds.tokens.astype(np.int32))
        (tmp / "spec_jax.json").write_text(json.dumps(
            {"kind": "datastore", "tokens": int((ds.tokens >= 0).sum()), "max_ngram": ds.max_ngram,
             "min_ngram": ds.min_ngram, "depth": ds.depth, "min_count": ds.min_count, **ds.info},
            indent=2))
    return out_dir


def load_datastore(path) -> Datastore:
    from spec_jax.io import read_meta

    path = Path(path)
    meta = read_meta(path, "datastore", "build one with `spec-jax datastore --data DISTILLED --out DIR`")
    tokens = np.load(path / "tokens.npz")["tokens"]
    kw = {k: meta.pop(k) for k in ("max_ngram", "min_ngram", "depth", "min_count") if k in meta}
    meta.pop("kind"), meta.pop("tokens", None)
    return Datastore(tokens=tokens, info=meta, **kw)
