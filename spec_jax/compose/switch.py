"""Switch drafting: each step, a row's tree tokens go to the drafter likelier to be accepted there.

A budget of T tree tokens can hold the head's tree, an n-gram (prompt lookup) chain, or a mix, and
which pays depends on the context. Where its last tokens occurred before (a list, code, a quoted
paragraph, the model repeating itself), the n-gram chain accepts 3-5 tokens and the head's
runners-up are wasted; where they did not, the chain is dead weight and a wider head tree accepts
more. A switch holds arms of T tokens each (a head tree plus an n-gram chain of g tokens, g from 0
to T - 1) and picks one per row from the length (0..8) of the context's longest suffix that
occurred earlier, by a policy the sizing learns from its calibration profile (spec_jax.sizing).
On SmolLM2-135M's own MT-bench answers, replayed: tau 2.61 against 2.39 for the best fixed mix
of the same 8 tokens (run 20, docs/results.md).

The choice depends on the context only, never on random draws, so verification stays exact; only
the chosen arm is drafted when all rows agree (always at batch 1).

Given as a `spec_jax.tree_spec.Switch`, written as a dict (the sizing's choice, cached as JSON):
  {"switch": [{"base": PATHS, "ngram": G}, ...], "policy": [ARM for match length 0, 1, ..., 8]}
where PATHS is a static tree's paths ([] for the root alone).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.compose.graft import GraftDrafter, graft
from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext
from spec_jax.heads.ngram import NgramDrafter
from spec_jax.tree import StaticTree, Tree
from spec_jax.tree_spec import Switch


def switch_drafter(heads_drafter, spec: Switch) -> "SwitchDrafter":
    """The SwitchDrafter for `spec`; `heads_drafter(tree)` builds the heads' drafter for a
    StaticTree (the union of the arms' trees: its state serves every arm)."""
    union = sorted({p for a in spec.arms for p in a.paths}, key=lambda p: (len(p), p))
    state = heads_drafter(StaticTree.from_paths(union)) if union else Drafter()
    arms = tuple((state.proposing(StaticTree.from_paths(a.paths)) if a.paths else Drafter(), a.ngram)
                 for a in spec.arms)
    policy = list(spec.policy)
    policy += policy[-1:] * (NgramDrafter.max_ngram + 1 - len(policy))
    return SwitchDrafter(state_drafter=state, arms=arms, policy=tuple(policy))


@dataclasses.dataclass(frozen=True)
class SwitchDrafter(Drafter):
    """Per row, arm `policy[n-gram match length]` of `arms` ((head drafter sharing
    `state_drafter`'s state, n-gram tokens) pairs of equal tree size)."""

    state_drafter: Drafter = Drafter()
    arms: tuple = ()
    policy: tuple = ()
    method: str = ""

    def __post_init__(self):
        object.__setattr__(self, "method", self.state_drafter.method + "+switch")

    @property
    def ngram(self) -> NgramDrafter:
        return NgramDrafter(depth=max(max(g for _, g in self.arms), 1))

    @property
    def tree_size(self):
        main, g = self.arms[0]
        return main.tree_size + g

    @property
    def max_depth(self):
        return max(max(m.max_depth, g) for m, g in self.arms)

    @property
    def max_children(self):
        return max(m.max_children + (g > 0) for m, g in self.arms)

    @property
    def aux_layers(self):
        return self.state_drafter.aux_layers

    def with_attn_impl(self, impl):
        return dataclasses.replace(self, state_drafter=self.state_drafter.with_attn_impl(impl),
                                   arms=tuple((m.with_attn_impl(impl), g) for m, g in self.arms))

    @property
    def _graft(self) -> GraftDrafter:
        """The state's keeper: the heads' state and the token history, as a graft keeps them."""
        return GraftDrafter(main=self.state_drafter, ngram=self.ngram)

    def init_state(self, dparams, tparams, tcfg, batch, num_slots):
        return self._graft.init_state(dparams, tparams, tcfg, batch, num_slots)

    def after_prefill(self, dparams, tparams, tcfg, state, ctx: PrefillContext):
        return self._graft.after_prefill(dparams, tparams, tcfg, state, ctx)

    def after_verify(self, dparams, tparams, tcfg, state, ctx: VerifyContext):
        return self._graft.after_verify(dparams, tparams, tcfg, state, ctx)

    def choice(self, state):
        """Arm per row [B] and the n-gram chain ([B, G] tokens, valid) it may graft."""
        chain, valid, length = self.ngram.match(state[1])
        return jnp.asarray(self.policy, jnp.int32)[length], chain, valid

    def propose(self, dparams, tparams, tcfg, state, root, key):
        arm, chain, valid = self.choice(state)
        trees = []
        for a, (main, g) in enumerate(self.arms):
            def build(main=main, g=g):
                tree, _ = main.propose(dparams, tparams, tcfg, state[0], root, key)
                if g:
                    return graft(tree, chain[:, :g], valid[:, :g], self.max_depth, self.max_children)
                k = self.max_children - tree.children.shape[2]
                return tree._replace(children=jnp.pad(tree.children, ((0, 0), (0, 0), (0, k)),
                                                      constant_values=-1))

            shapes = jax.eval_shape(build)
            trees.append(jax.lax.cond(jnp.any(arm == a), build,
                                      lambda s=shapes: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), s)))
        tree = trees[0]
        for a in range(1, len(trees)):
            pick = arm == a
            tree = Tree(*(jnp.where(pick.reshape((-1,) + (1,) * (x.ndim - 1)), y, x)
                          for x, y in zip(tree, trees[a])))
        return tree, state
