"""Grafted drafting: any drafter's tree plus the n-gram (prompt lookup) continuation, as one trie.

Small targets repeat themselves (list items, code, text quoted from the prompt or from their own
earlier output) where a head trained on a few hundred thousand tokens has to guess; the n-gram
chain is free to draft and costs `depth` more tree tokens to verify. The chain follows the main
tree while its tokens match a node's child and branches off as new nodes where they stop matching,
so no token is tried twice under one parent. Chain slots that were not needed (and the whole chain
when the context has no match) are dead nodes: scored, never reachable, so never accepted.

Written `TREE+ngram:N` wherever a tree is given (e.g. `dynamic:8,5,32+ngram:4`, `auto+ngram:4`;
see spec_jax.tree_spec). A datastore chain (spec_jax.heads.datastore: what the target wrote after the same n tokens in a
corpus of its own output) is grafted the same way: `TREE+ds:N`, or both, `TREE+ngram:8+ds:8`.

Ranked grafts (`dynamic:8,5,32+ngram:24+ds:8+ranked`): instead of adding N tokens to the tree, the
chains' tokens compete with the dynamic tree's candidates for its TOTAL tokens, by EAGLE-2's own
rule: the likeliest to be accepted win. A head candidate's estimate is its cumulative draft
probability; a chain token's is how often the chain was right that far, given how long a suffix of
the context it continues, measured by replaying both chains over the datastore's corpus
(`Datastore.priors`). A long match (a list, code, an answer being rewritten) gets a long chain; a
one-token match gets none and the head's tree keeps the tokens. Needs a dynamic tree and a
datastore; the tree still has TOTAL tokens.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext
from spec_jax.heads.datastore import DatastoreChain
from spec_jax.heads.ngram import NgramDrafter
from spec_jax.tree import Tree, ancestor_mask, best_nodes_tree, children_table, merge_chain


def with_graft(drafter: Drafter, n: int) -> Drafter:
    """`drafter` with an n-token n-gram chain grafted on (replacing any graft it has); n=0: as is."""
    if not n:
        return drafter
    if isinstance(drafter, GraftDrafter):
        drafter = drafter.main
    return GraftDrafter(main=drafter, ngram=NgramDrafter(depth=n))


def with_datastore(drafter: Drafter, chain: DatastoreChain | None) -> Drafter:
    """`drafter` with a datastore chain grafted on (beside any n-gram chain it has); None: as is."""
    if chain is None:
        return drafter
    if isinstance(drafter, GraftDrafter):
        return dataclasses.replace(drafter, ds=chain)
    if isinstance(drafter, NgramDrafter):  # the standalone n-gram drafter: its chain stays
        return GraftDrafter(main=Drafter(), ngram=drafter, ds=chain)
    return GraftDrafter(main=drafter, ngram=NgramDrafter(depth=0), ds=chain)


@dataclasses.dataclass(frozen=True)
class GraftDrafter(Drafter):
    """`main`'s tree with `ngram`'s chain (none at depth 0) and `ds`'s chain grafted on (see the
    module docstring). The n-gram state (the token history) also serves the datastore lookup; the
    datastore's tables come in the draft params, under "datastore"."""

    main: Drafter = Drafter()
    ngram: NgramDrafter = NgramDrafter(depth=4)
    ds: DatastoreChain | None = None
    ranked: bool = False  # the chains compete for main's tree tokens (see the module docstring)
    method: str = ""

    def __post_init__(self):
        object.__setattr__(self, "method", self.main.method + "+ngram" * (self.ngram.depth > 0)
                           + "+ds" * (self.ds is not None))

    def with_attn_impl(self, impl):
        return dataclasses.replace(self, main=self.main.with_attn_impl(impl))

    @property
    def _ds_depth(self):
        return self.ds.depth if self.ds is not None else 0

    @property
    def tree_size(self):
        if self.ranked:
            return self.main.tree_size
        return self.main.tree_size + self.ngram.depth + self._ds_depth

    @property
    def max_depth(self):
        return max(self.main.max_depth, self.ngram.depth, self._ds_depth)

    @property
    def max_children(self):
        return self.main.max_children + (self.ngram.depth > 0) + (self.ds is not None)

    @property
    def aux_layers(self):
        return self.main.aux_layers

    def init_state(self, dparams, tparams, tcfg, batch, num_slots):
        return (self.main.init_state(dparams, tparams, tcfg, batch, num_slots),
                self.ngram.init_state((), tparams, tcfg, batch, num_slots))

    def after_prefill(self, dparams, tparams, tcfg, state, ctx: PrefillContext):
        return (self.main.after_prefill(dparams, tparams, tcfg, state[0], ctx),
                self.ngram.after_prefill((), tparams, tcfg, state[1], ctx))

    def after_verify(self, dparams, tparams, tcfg, state, ctx: VerifyContext):
        return (self.main.after_verify(dparams, tparams, tcfg, state[0], ctx),
                self.ngram.after_verify((), tparams, tcfg, state[1], ctx))

    def propose(self, dparams, tparams, tcfg, state, root, key):
        if self.ranked:
            return self._propose_ranked(dparams, tparams, tcfg, state, root), state
        tree, main_state = self.main.propose(dparams, tparams, tcfg, state[0], root, key)
        chains = [self.ngram.continuation(state[1])] if self.ngram.depth else []  # [B, N] each
        if self.ds is not None:
            chains.append(self.ds.continuation(dparams["datastore"], state[1]))
        for chain, valid in chains:
            tree = graft(tree, chain, valid, self.max_depth, self.max_children)
        return tree, (main_state, state[1])

    def _propose_ranked(self, dparams, tparams, tcfg, state, root) -> Tree:
        pool = self.main.propose_pool(dparams, tparams, tcfg, state[0], root)
        priors = dparams["datastore"]
        if self.ngram.depth:
            tok, valid, n = self.ngram.match(state[1])
            pool = merge_chain(pool, tok, valid, priors["ngram_prior"][n])
        if self.ds is not None:
            tok, valid, n = self.ds.match(priors, state[1])
            pool = merge_chain(pool, tok, valid, priors["ds_prior"][n])
        return best_nodes_tree(root, pool, self.tree_size - 1, self.max_depth, self.max_children)


def graft(tree: Tree, chain, valid, max_depth: int, max_children: int) -> Tree:
    """Merge chain [B, N] (valid [B, N], a prefix per row) into `tree` [B, T] below its root.

    Chain token i becomes node T + i unless it is already a child of the node the chain reached;
    returns a tree of T + N nodes."""
    b, t = tree.tokens.shape
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    on_tree = jnp.ones((b,), bool)
    parents, depths = [], []
    for i in range(chain.shape[1]):
        kids = tree.children[rows, jnp.minimum(cur, t - 1)]  # [B, K]
        same = (kids >= 0) & (tree.tokens[rows[:, None], jnp.maximum(kids, 0)] == chain[:, i:i + 1])
        hit = on_tree & valid[:, i] & jnp.any(same, axis=1)
        new = valid[:, i] & ~hit
        parents.append(jnp.where(new, cur, -1))
        depths.append(jnp.where(new, i + 1, 0))
        cur = jnp.where(hit, kids[rows, jnp.argmax(same, axis=1)], t + i)
        on_tree = hit
    parent = jnp.concatenate([tree.parent, jnp.stack(parents, 1)], 1).astype(jnp.int32)
    return Tree(tokens=jnp.concatenate([tree.tokens, chain], 1).astype(jnp.int32), parent=parent,
                depth=jnp.concatenate([tree.depth, jnp.stack(depths, 1)], 1).astype(jnp.int32),
                mask=ancestor_mask(parent, max_depth), children=children_table(parent, max_children))
