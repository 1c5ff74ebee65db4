"""The interface every drafter implements (frozen dataclasses: hashable, static under jit).

A drafter turns the target's state into a draft tree each step and keeps any state of its own in
fixed-shape arrays (a pytree `state`). The generation loop calls, inside one jitted function:

  state = init_state(dparams, tparams, tcfg, batch, num_slots)
  state = after_prefill(dparams, tparams, tcfg, state, ctx)       # ctx: PrefillContext
  loop:  tree, state = propose(dparams, tparams, tcfg, state, root, key)
         ... target verifies the tree ...
         state = after_verify(dparams, tparams, tcfg, state, vctx)  # vctx: VerifyContext
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from spec_jax.tree import Tree


class PrefillContext(NamedTuple):
    tokens: jax.Array  # [B, P] prompt (right-padded)
    prompt_len: jax.Array  # [B]
    hidden: jax.Array  # [B, P, H] target final hidden states (pre-norm)
    aux_hidden: Any  # [B, P, n*H] or None
    first_token: jax.Array  # [B] the token sampled after the prompt


class VerifyContext(NamedTuple):
    tree: Tree
    path: jax.Array  # [B, D+1] accepted node ids, root first, -1 padded
    n_accepted: jax.Array  # [B] path length including the root
    bonus: jax.Array  # [B]
    hidden: jax.Array  # [B, T, H] target hidden states at the tree nodes
    aux_hidden: Any  # [B, T, n*H] or None
    root_pos: jax.Array  # [B] position of the root token
    active: jax.Array  # [B] rows that were still generating


@dataclasses.dataclass(frozen=True)
class Drafter:
    """Base class: no drafting (plain decoding: a one-node tree)."""

    method: str = "none"

    @property
    def tree_size(self) -> int:
        return 1

    @property
    def max_depth(self) -> int:
        return 0

    @property
    def max_children(self) -> int:
        return 1

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return ()

    def with_attn_impl(self, impl: str) -> "Drafter":
        """This drafter with its draft model's attention implementation set (if it has one)."""
        return self

    def init_state(self, dparams, tparams, tcfg, batch: int, num_slots: int):
        return ()

    def after_prefill(self, dparams, tparams, tcfg, state, ctx: PrefillContext):
        return state

    def propose(self, dparams, tparams, tcfg, state, root, key):
        b = root.shape[0]
        tree = Tree(tokens=root[:, None], parent=jnp.full((b, 1), -1, jnp.int32),
                    depth=jnp.zeros((b, 1), jnp.int32), mask=jnp.ones((b, 1, 1), bool),
                    children=jnp.full((b, 1, 1), -1, jnp.int32))
        return tree, state

    def after_verify(self, dparams, tparams, tcfg, state, ctx: VerifyContext):
        return state


def accepted_chunk(ctx: VerifyContext):
    """The newly committed tokens as EAGLE-style pairs.

    Returns (node [B, A], next_tok [B, A], valid [B, A]) with A = D+1: pair j is the tree node
    path[j] (whose target feature is known) and the token that follows it (path[j+1]'s token, or
    the bonus for the last accepted node)."""
    b, a = ctx.path.shape
    rows = jnp.arange(b)[:, None]
    j = jnp.arange(a)[None, :]
    node = jnp.maximum(ctx.path, 0)
    nxt_node = jnp.maximum(jnp.concatenate([ctx.path[:, 1:], jnp.full((b, 1), -1, jnp.int32)], 1), 0)
    nxt_tok = ctx.tree.tokens[rows, nxt_node]
    is_last = j == (ctx.n_accepted[:, None] - 1)
    nxt_tok = jnp.where(is_last, ctx.bonus[:, None], nxt_tok)
    valid = (j < ctx.n_accepted[:, None]) & ctx.active[:, None]
    return node, nxt_tok, valid
