"""Plain decoding where speculation does not pay: per row, from its recent acceptance.

A tree step costs more than a one-token step (on a 2-core CPU, a 4-token verify and its draft
about 1.8x a plain step), so speculation pays only where enough tokens are accepted per step: on
SmolLM2's MT-bench answers the sized 4-token tree ran 1.37x plain on `extraction` and 0.82x on
`humanities` (docs/bench/run44). A `Fallback` is a setting of the loop (`LoopSettings.fallback`),
given where the sizing measured that it pays (`spec_jax.sizing.choose`): the break-even
acceptance `plain_below`
(the sizing's measured step time of the tree over a plain step's, in plain steps) and a `prior`:
the tree's measured acceptance, or just above the break-even where that is lower (a tree that
loses to plain decoding on average, kept for the requests it suits). Each row keeps a running
mean of the tokens its tree steps accepted, starting at the prior; below the break-even the row
wants plain steps, and while it takes them its mean drifts back toward the prior (nothing was
observed), so it probes with a tree step again after a while: soon after a near miss, later
after a run of bad steps. The loop (`spec_jax.step.decode`) runs a tree step when any running
row wants one, else a plain step.

The drafter's state must follow every committed token. Plain steps do not run it: they buffer
each step's token, target hidden state and position, and the next tree step (or a full buffer of
`window` steps) hands the buffered run to the drafter's `after_verify` at once, as one accepted
chain (`flush`). Draft heads read a chunk of tokens at about the cost of one, so a plain step
costs what plain decoding does. Which step runs depends only on accepted counts, never on the
current step's random draws, so outputs keep the target's distribution (and greedy outputs equal
plain decoding's).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.heads.base import Drafter, VerifyContext
from spec_jax.tree import Tree


@flax.struct.dataclass
class FallbackState:
    mean: jax.Array  # [B] running mean of tokens accepted per tree step
    plain: jax.Array  # [B] plain steps taken (a statistic)
    tok: jax.Array  # [B, W] buffered plain steps' tokens (each step's root)
    hidden: jax.Array  # [B, W, H] the target's hidden state at each
    aux: Any  # [B, W, n*H] its fused features (EAGLE-3), or None
    pos0: jax.Array  # [B] position of the first buffered token
    count: jax.Array  # [B] buffered tokens (a row that stopped has fewer: rows never restart, so
    # each row's tokens are its first count entries, and the plain steps buffered are max(count))


@dataclasses.dataclass(frozen=True)
class Fallback:
    """Plain steps while a row's running mean of accepted tokens per tree step is below
    `plain_below`. The mean starts at `prior`, weighs each tree step by `weight` and drifts back to
    the prior by `relax` of the gap per plain step; `window` plain steps are buffered for the
    drafter at most. Static: part of the compiled loop's settings."""

    plain_below: float = 0.0
    prior: float = 0.0
    weight: float = 0.25
    relax: float = 1 / 16
    window: int = 16

    def init(self, drafter: Drafter, tcfg, batch: int, dtype) -> FallbackState:
        """The empty buffer and prior means for `drafter` (its fused features buffered too)."""
        w, h = self.window, tcfg.hidden_size
        n_aux = len(drafter.aux_layers)
        zi = jnp.zeros((batch,), jnp.int32)
        return FallbackState(
            mean=jnp.full((batch,), self.prior, jnp.float32), plain=zi,
            tok=jnp.zeros((batch, w), jnp.int32), hidden=jnp.zeros((batch, w, h), dtype),
            aux=jnp.zeros((batch, w, n_aux * h), dtype) if n_aux else None, pos0=zi, count=zi)

    def wants_tree(self, fb: FallbackState, active):
        """Whether any running row wants a tree step now (a scalar)."""
        return jnp.any(active & (fb.mean >= self.plain_below))

    def after_tree(self, fb: FallbackState, n_accepted, active) -> FallbackState:
        mean = (1 - self.weight) * fb.mean + self.weight * n_accepted.astype(jnp.float32)
        return fb.replace(mean=jnp.where(active, mean, fb.mean))

    def buffer(self, fb: FallbackState, root, hidden, aux, pos, active) -> FallbackState:
        """Append one plain step: root [B] at position pos [B], its hidden [B, H] (aux [B, nH])."""
        rows = jnp.arange(root.shape[0])
        i = jnp.where(active, fb.count, self.window)  # inactive rows: dropped
        put = lambda buf, x: buf.at[rows, i].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
        return fb.replace(
            tok=put(fb.tok, root), hidden=put(fb.hidden, hidden),
            aux=None if fb.aux is None else put(fb.aux, aux),
            pos0=jnp.where(fb.count == 0, pos, fb.pos0), count=fb.count + active.astype(jnp.int32),
            plain=fb.plain + active.astype(jnp.int32),
            mean=jnp.where(active, fb.mean + self.relax * (self.prior - fb.mean), fb.mean))

    def full(self, fb: FallbackState):
        """Whether the buffer holds `window` plain steps (a scalar): time to flush."""
        return jnp.max(fb.count) >= self.window

    def flush(self, drafter: Drafter, dparams, tparams, tcfg, state, fb: FallbackState, bonus):
        """`drafter`'s state after the buffered plain steps (none: unchanged), and an empty
        buffer. bonus [B]: the token after the last buffered one (the loop's current root)."""

        def run(state):
            b, w = fb.tok.shape
            idx = jnp.arange(w, dtype=jnp.int32)
            path = jnp.where(idx[None, :] < fb.count[:, None], idx[None, :], -1)
            chain = Tree(tokens=fb.tok, parent=jnp.broadcast_to(idx - 1, (b, w)),
                         depth=jnp.broadcast_to(idx, (b, w)),
                         mask=jnp.broadcast_to(jnp.tril(jnp.ones((w, w), bool)), (b, w, w)),
                         children=jnp.broadcast_to(jnp.where(idx + 1 < w, idx + 1, -1)[:, None],
                                                   (b, w, 1)))
            ctx = VerifyContext(tree=chain, path=path, n_accepted=jnp.maximum(fb.count, 1),
                                bonus=bonus, hidden=fb.hidden, aux_hidden=fb.aux,
                                root_pos=fb.pos0, active=fb.count > 0)
            return drafter.after_verify(dparams, tparams, tcfg, state, ctx)

        state = jax.lax.cond(jnp.any(fb.count > 0), run, lambda s: s, state)
        return state, fb.replace(count=jnp.zeros_like(fb.count))
