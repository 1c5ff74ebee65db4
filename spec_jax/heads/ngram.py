"""n-gram (prompt lookup) drafter: no weights. Proposes the continuation of the latest earlier
occurrence of the context's last n tokens (n from `max_ngram` down to 1) as a chain."""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext, accepted_chunk
from spec_jax.tree import StaticTree, static_tree_batch


@flax.struct.dataclass
class NgramState:
    hist: jax.Array  # [B, S] every token so far, the root last
    hlen: jax.Array  # [B]


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
    method: str = "ngram"
    depth: int = 6
    max_ngram: int = 8

    @property
    def tree_size(self):
        return self.depth + 1

    @property
    def max_depth(self):
        return self.depth

    def init_state(self, dparams, tparams, tcfg, batch, num_slots):
        return NgramState(hist=jnp.zeros((batch, num_slots + self.depth + 2), jnp.int32),
                          hlen=jnp.zeros((batch,), jnp.int32))

    def _append(self, state, toks, count):
        b, a = toks.shape
        j = jnp.arange(a)[None, :]
        size = state.hist.shape[1]
        idx = jnp.where(j < count[:, None], state.hlen[:, None] + j, size)
        hist = state.hist.at[jnp.arange(b)[:, None], idx].set(toks, mode="drop")
        return NgramState(hist=hist, hlen=jnp.minimum(state.hlen + count, size))

    def after_prefill(self, dparams, tparams, tcfg, state, ctx: PrefillContext):
        b, p = ctx.tokens.shape
        state = self._append(state, ctx.tokens, ctx.prompt_len)
        return self._append(state, ctx.first_token[:, None], jnp.ones((b,), jnp.int32))

    def after_verify(self, dparams, tparams, tcfg, state, ctx: VerifyContext):
        _, next_tok, valid = accepted_chunk(ctx)
        return self._append(state, next_tok, jnp.sum(valid, axis=1).astype(jnp.int32))

    def search(self, state: NgramState):
        """Where the context's suffix last occurred: (end [B] of the latest earlier occurrence of
        the longest matching suffix, -1 if none; that suffix's length [B], 0..max_ngram)."""
        hist, hlen = state.hist, state.hlen
        b, s = hist.shape
        i = jnp.arange(s)[None, :]  # candidate end of an earlier match
        rows = jnp.arange(b)[:, None]
        match = jnp.ones((b, s), bool)
        best = jnp.full((b,), -1, jnp.int32)
        length = jnp.zeros((b,), jnp.int32)
        for n in range(1, self.max_ngram + 1):
            off = n - 1
            suffix_tok = hist[rows[:, 0], jnp.maximum(hlen - 1 - off, 0)]  # [B]
            shifted = jnp.roll(hist, off, axis=1)  # shifted[i] = hist[i - off]
            match = match & (shifted == suffix_tok[:, None]) & (i - off >= 0)
            ok = match & (i <= hlen[:, None] - 2) & (hlen[:, None] - 1 - off >= 0)
            cand = jnp.max(jnp.where(ok, i, -1), axis=1)
            best = jnp.where(cand >= 0, cand, best)  # longer n overrides shorter
            length = jnp.where(cand >= 0, n, length)
        return best, length

    def continuation(self, state: NgramState):
        """The proposed chain: (tokens [B, depth], valid [B, depth]; valid is a prefix per row)."""
        return self._chain(state, self.search(state)[0])

    def _chain(self, state: NgramState, best):
        hist, hlen = state.hist, state.hlen
        rows = jnp.arange(hist.shape[0])[:, None]
        j = jnp.arange(1, self.depth + 1)[None, :]
        src = best[:, None] + j
        valid = (best[:, None] >= 0) & (src < hlen[:, None])
        return jnp.where(valid, hist[rows, jnp.clip(src, 0, hist.shape[1] - 1)], 0).astype(jnp.int32), valid

    def match(self, state: NgramState):
        """(chain tokens [B, depth], valid [B, depth], length [B] of the suffix it continues)."""
        best, length = self.search(state)
        tok, valid = self._chain(state, best)
        return tok, valid, length

    def propose(self, dparams, tparams, tcfg, state: NgramState, root, key):
        tok, _ = self.continuation(state)
        tokens = jnp.concatenate([root[:, None], tok], axis=1).astype(jnp.int32)
        return static_tree_batch(StaticTree.chain(self.depth), tokens, root.shape[0]), state
