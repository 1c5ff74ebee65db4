"""Draft trees as fixed-size arrays.

A tree of T nodes (node 0 is the root: the last accepted token, not yet in the target cache) is
  tokens [B, T]  parent [B, T] (-1 for the root)  depth [B, T]  mask [B, T, T] (ancestor-or-self)
  children [B, T, K] (child node ids in try order, -1 padded).
Nodes are ordered so that every parent precedes its children. T and K are static; the tokens (and,
for dynamic trees, the shape) change every step without recompiling.

Static trees are given as lists of paths: each path lists the top-k rank chosen at each depth,
e.g. EAGLE-1's default `mc_sim_7b_63` or Medusa's trees.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.errors import SpecJaxError

# EAGLE-1's default static tree (25 nodes + root, depth 5).
MC_SIM_7B_63 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]

# A Medusa-style static tree for 4 heads (depth 4, 1 + 26 nodes): wide at depth 1, narrowing deeper.
MEDUSA_DEFAULT = [[0], [1], [2], [3], [4], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
                  [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 2], [2, 0, 0], [0, 2, 0],
                  [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0],
                  [0, 0, 0, 2], [0, 0, 2, 0]]


class Tree(NamedTuple):
    tokens: jax.Array  # [B, T] int32
    parent: jax.Array  # [B, T] int32
    depth: jax.Array  # [B, T] int32
    mask: jax.Array  # [B, T, T] bool
    children: jax.Array  # [B, T, K] int32


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A compiled static tree (numpy, hashable by its paths). Index 0 is the root."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "StaticTree":
        try:
            ps = [tuple(int(r) for r in p) for p in paths]
        except (TypeError, ValueError):
            raise SpecJaxError(f"cannot read tree paths {paths!r}: write a list of rank lists such "
                               "as [[0], [1], [0, 0]]") from None
        if not ps:
            raise SpecJaxError("a tree needs at least one path")
        if any(len(p) == 0 or min(p) < 0 for p in ps):
            raise SpecJaxError("tree paths must be non-empty lists of non-negative ranks")
        if len(set(ps)) != len(ps):
            raise SpecJaxError("tree paths must be unique")
        pset = set(ps)
        for p in ps:
            if len(p) > 1 and p[:-1] not in pset:
                raise SpecJaxError(f"tree path {list(p)} has no parent path {list(p[:-1])}: "
                                   "every prefix of a path must be in the tree")
        ps.sort(key=lambda p: (len(p), p))
        return cls(paths=tuple(ps))

    @classmethod
    def chain(cls, depth: int) -> "StaticTree":
        return cls.from_paths([[0] * d for d in range(1, depth + 1)])

    @property
    def size(self) -> int:
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    def arrays(self):
        """(parent [T], depth [T], rank [T], mask [T, T], children [T, K], retrieve [leaves, D+1])."""
        index = {(): 0}
        for i, p in enumerate(self.paths):
            index[p] = i + 1
        t = self.size
        parent = np.full(t, -1, np.int32)
        depth = np.zeros(t, np.int32)
        rank = np.zeros(t, np.int32)
        for p, i in index.items():
            if p:
                parent[i], depth[i], rank[i] = index[p[:-1]], len(p), p[-1]
        mask = ancestor_mask_np(parent)
        kids = [[j for j in range(t) if parent[j] == i] for i in range(t)]
        k = max(1, max(len(c) for c in kids))
        children = np.full((t, k), -1, np.int32)
        for i, c in enumerate(kids):
            c.sort(key=lambda j: rank[j])
            children[i, :len(c)] = c
        leaves = [i for i in range(t) if not kids[i]]
        retrieve = np.full((len(leaves), self.max_depth + 1), -1, np.int32)
        for r, leaf in enumerate(leaves):
            chain, n = [], leaf
            while n >= 0:
                chain.append(n)
                n = parent[n]
            retrieve[r, :len(chain)] = chain[::-1]
        return parent, depth, rank, mask, children, retrieve


def ancestor_mask_np(parent: np.ndarray) -> np.ndarray:
    t = len(parent)
    mask = np.eye(t, dtype=bool)
    for i in range(t):
        j = parent[i]
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def ancestor_mask(parent, max_depth: int):
    """[B, T] parents (parents precede children) -> [B, T, T] ancestor-or-self mask, in JAX."""
    b, t = parent.shape
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    # Pointer doubling would be O(log D); D is small, so walk up max_depth times.
    anc = parent
    mask = eye
    rows = jnp.arange(b)[:, None]
    for _ in range(max_depth):
        mask = mask | (jax.nn.one_hot(jnp.where(anc >= 0, anc, t), t + 1, dtype=bool)[..., :t])
        anc = jnp.where(anc >= 0, parent[rows, jnp.maximum(anc, 0)], -1)
    return mask


def children_table(parent, k: int):
    """[B, T] parents -> [B, T, k] children in node order (-1 padded)."""
    b, t = parent.shape
    is_child = parent[:, None, :] == jnp.arange(t)[None, :, None]  # [B, T(parent), T(child)]
    order = jnp.cumsum(is_child, axis=-1) - 1  # rank of each child among its siblings
    slot = jnp.where(is_child & (order < k), order, k)  # [B, T, T]
    kids = jnp.full((b, t, k + 1), -1, jnp.int32)
    bi = jnp.arange(b)[:, None, None]
    pi = jnp.arange(t)[None, :, None]
    ci = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, None, :], (b, t, t))
    kids = kids.at[bi, pi, slot].max(jnp.where(is_child, ci, -1))
    return kids[..., :k]


def dynamic_capacity(top_k: int, depth: int) -> int:
    """The most tokens a dynamic tree (EAGLE-2's: top_k candidates at the first depth, top_k**2
    scored below each later depth's frontier) can fill, root included."""
    return top_k + (depth - 1) * top_k ** 2 + 1


def check_dynamic(top_k: int, depth: int, total_tokens: int) -> None:
    """Refuse a dynamic tree that its top_k and depth cannot fill."""
    if min(top_k, depth) < 1 or not 2 <= total_tokens <= dynamic_capacity(top_k, depth):
        raise SpecJaxError(f"cannot draft a dynamic tree of {total_tokens} tokens with top_k {top_k} "
                           f"and depth {depth}: top_k and depth must be at least 1, total_tokens 2 "
                           "to top_k + (depth - 1) * top_k**2 + 1")


class Pool(NamedTuple):
    """Candidate nodes of a dynamic tree, each parent before its children: tok, score (cumulative
    log-probability of being accepted), parent (pool index, -1 for a child of the root), depth;
    all [B, P]."""

    tok: jax.Array
    score: jax.Array
    parent: jax.Array
    depth: jax.Array

    @classmethod
    def concat(cls, tok, score, parent, depth) -> "Pool":
        """A pool from lists of per-depth [B, n] pieces."""
        return cls(*(jnp.concatenate(x, 1) for x in (tok, score, parent, depth)))


def best_nodes_tree(root, pool: Pool, n_pick: int, max_depth: int, k: int) -> Tree:
    """A pool of candidate nodes -> the tree of the root and the pool's `n_pick` best-scored nodes
    (EAGLE-2's final selection). root [B].

    A child never scores above its parent, so the best nodes include their ancestors; ties go to
    the shallower node. k bounds the children kept per node."""
    tok, score, parent, depth = pool
    b, size = tok.shape
    rows = jnp.arange(b)[:, None]
    _, picked = jax.lax.top_k(score - 1e-4 * depth.astype(jnp.float32), n_pick)
    picked = jnp.sort(picked, axis=1)  # pool order: parents precede children
    inv = jnp.full((b, size), -1, jnp.int32)
    inv = inv.at[rows, picked].set(jnp.arange(1, n_pick + 1, dtype=jnp.int32))
    par_pool = parent[rows, picked]
    par = jnp.where(par_pool < 0, 0, inv[rows, jnp.maximum(par_pool, 0)])
    par = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par], 1)
    tokens = jnp.concatenate([root[:, None], tok[rows, picked]], 1).astype(jnp.int32)
    dep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depth[rows, picked]], 1)
    return Tree(tokens=tokens, parent=par, depth=dep, mask=ancestor_mask(par, max_depth),
                children=children_table(par, k))


def merge_chain(pool: Pool, chain, valid, logp) -> Pool:
    """Add a chain of tokens below the root (chain [B, N], valid [B, N] a prefix per row) to
    `pool` as candidates scored by logp [B, N] (the chain's own estimate, non-increasing along it).

    The chain follows the pool's nodes while its tokens match a child of the node it reached; such
    a node keeps the better of its two scores. Where the chain leaves the pool its tokens become
    new nodes (appended, so parents still precede children); invalid ones score -inf and are
    never picked. Returns a pool of P + N nodes."""
    b, p = pool.tok.shape
    rows = jnp.arange(b)
    score = pool.score
    cur = jnp.full((b,), -1, jnp.int32)
    on_pool = jnp.ones((b,), bool)
    parents, scores = [], []
    for i in range(chain.shape[1]):
        same = on_pool[:, None] & (pool.parent == cur[:, None]) & (pool.tok == chain[:, i:i + 1])
        hit = valid[:, i] & jnp.any(same, axis=1)
        at = jnp.argmax(same, axis=1)
        s_i = jnp.where(valid[:, i], logp[:, i], -jnp.inf)
        score = score.at[rows, at].max(jnp.where(hit, s_i, -jnp.inf))
        parents.append(cur)
        scores.append(jnp.where(hit, -jnp.inf, s_i))
        cur = jnp.where(hit, at, p + i).astype(jnp.int32)
        on_pool = hit
    n = chain.shape[1]
    return Pool(tok=jnp.concatenate([pool.tok, chain.astype(pool.tok.dtype)], 1),
                score=jnp.concatenate([score, jnp.stack(scores, 1).astype(score.dtype)], 1),
                parent=jnp.concatenate([pool.parent, jnp.stack(parents, 1)], 1).astype(jnp.int32),
                depth=jnp.concatenate([pool.depth, jnp.broadcast_to(
                    jnp.arange(1, n + 1, dtype=jnp.int32), (b, n))], 1))


def static_tree_batch(tree: StaticTree, tokens, batch: int) -> Tree:
    """Wrap per-step tokens [B, T] with a static tree's structure."""
    parent, depth, _, mask, children, _ = tree.arrays()
    bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (batch,) + a.shape)
    return Tree(tokens=tokens, parent=bc(parent), depth=bc(depth), mask=bc(mask),
                children=bc(children))
