"""Switch drafting: each step, a row's tree tokens go to the drafter likelier to be accepted there.

A budget of T tree tokens can hold the head's tree, an n-gram (prompt lookup) chain, or a mix, and
which pays depends on the context. Where its last tokens occurred before (a list, code, a quoted
paragraph, the model repeating itself), the n-gram chain accepts 3-5 tokens and the head's
runners-up are wasted; where they did not, the chain is dead weight and a wider head tree accepts
more. A switch holds arms of T tokens each (a head tree plus an n-gram chain of g tokens, g from 0
to T - 1) and picks one per row from the length (0..8) of the context's longest suffix that
occurred earlier, by a policy the sizing learns from its calibration profile (spec_jax.sizing).
On SmolLM2-135M's own MT-bench answers, replayed: tau 2.61 against 2.39 for the best fixed mix
of the same 8 tokens (docs/benchmarks.md).

The choice depends on the context only, never on random draws, so verification stays exact; only
the chosen arm is drafted when all rows agree (always at batch 1).

Written as a dict (the sizing's choice, cached as JSON):
  {"switch": [{"base": PATHS, "ngram": G}, ...], "policy": [ARM for match length 0, 1, ..., 8]}
where PATHS is a static tree's paths ([] for the root alone).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.errors import SpecJaxError
from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext
from spec_jax.heads.graft import GraftDrafter, graft
from spec_jax.heads.ngram import NgramDrafter
from spec_jax.tree import StaticTree, Tree, tree_object


FIX = ('write {"switch": [{"base": [[0], [1], [0, 0]], "ngram": 0}, {"base": [], "ngram": 3}], '
       '"policy": [0, 0, 1]}: arms of equal tree tokens, an arm per n-gram match length 0..8')


def as_switch(tree) -> dict | None:
    """The switch `tree` spells (a dict, or its JSON text as the CLI's --tree passes it), or None."""
    tree = tree_object(tree)
    return tree if isinstance(tree, dict) and "switch" in tree else None


def check_switch(spec: dict) -> None:
    """Raise SpecJaxError unless `spec` is a well-formed switch (see the module docstring)."""
    arms, policy, fix = spec.get("switch"), spec.get("policy"), FIX
    if not isinstance(arms, list) or not arms or not isinstance(policy, list) or not policy:
        raise SpecJaxError(f"a switch tree needs a list of arms and a policy: {fix}")
    sizes = set()
    for a in arms:
        if not isinstance(a, dict) or "base" not in a or int(a.get("ngram", 0)) < 0:
            raise SpecJaxError(f"bad switch arm {a!r}: {fix}")
        sizes.add(len(a["base"]) + 1 + int(a.get("ngram", 0)))
    if len(sizes) != 1:
        raise SpecJaxError(f"switch arms differ in tree tokens ({sorted(sizes)}): {fix}")
    if len(policy) > NgramDrafter.max_ngram + 1 or any(not 0 <= int(p) < len(arms) for p in policy):
        raise SpecJaxError(f"bad switch policy {policy!r}: {fix}")


def switch_drafter(heads_drafter, spec: dict) -> "SwitchDrafter":
    """The SwitchDrafter for `spec`; `heads_drafter(tree)` builds the heads' drafter for a static
    tree (the union of the arms' trees: its state serves every arm)."""
    check_switch(spec)
    bases = [[tuple(p) for p in a["base"]] for a in spec["switch"]]
    union = sorted({p for b in bases for p in b}, key=lambda p: (len(p), p))
    state = heads_drafter([list(p) for p in union]) if union else Drafter()
    arms = tuple((state.proposing(StaticTree.from_paths(b)) if b else Drafter(),
                  int(a.get("ngram", 0))) for a, b in zip(spec["switch"], bases))
    policy = [int(p) for p in spec["policy"]]
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
