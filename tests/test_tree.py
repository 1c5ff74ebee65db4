"""Tree compilation: property tests (hypothesis) and the JAX helpers against numpy."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_jax.errors import SpecJaxError
from spec_jax.tree import MC_SIM_7B_63, MEDUSA_DEFAULT, StaticTree, ancestor_mask, children_table


@st.composite
def path_trees(draw):
    """Random prefix-closed sets of rank paths."""
    paths = set()
    for _ in range(draw(st.integers(1, 30))):
        depth = draw(st.integers(1, 5))
        p = tuple(draw(st.integers(0, 3)) for _ in range(depth))
        for i in range(1, len(p) + 1):
            paths.add(p[:i])
    return [list(p) for p in paths]


@settings(max_examples=60, deadline=None)
@given(path_trees())
def test_static_tree_arrays_are_consistent(paths):
    tree = StaticTree.from_paths(paths)
    parent, depth, rank, mask, children, retrieve = tree.arrays()
    t = tree.size
    index = {(): 0, **{p: i + 1 for i, p in enumerate(tree.paths)}}
    for p, i in index.items():
        assert depth[i] == len(p)  # position offset = depth
        anc = {index[p[:j]] for j in range(len(p) + 1)}
        assert set(np.nonzero(mask[i])[0]) == anc  # mask is exactly ancestor-or-self
        if p:
            assert parent[i] < i  # parents precede children
    leaves = {i for i in range(t) if i not in set(parent)}
    covered = {int(r[np.count_nonzero(r >= 0) - 1]) for r in retrieve}
    assert covered == leaves  # retrieve paths end at every leaf
    for r in retrieve:
        nodes = [int(x) for x in r if x >= 0]
        assert nodes[0] == 0 and all(parent[b] == a for a, b in zip(nodes, nodes[1:]))
    for i in range(t):
        kids = [int(c) for c in children[i] if c >= 0]
        assert sorted(kids) == sorted(j for j in range(t) if parent[j] == i)
        assert [rank[c] for c in kids] == sorted(rank[c] for c in kids)


@settings(max_examples=40, deadline=None)
@given(path_trees())
def test_jax_ancestor_mask_and_children_match_numpy(paths):
    tree = StaticTree.from_paths(paths)
    parent, _, _, mask, _, _ = tree.arrays()
    pj = jnp.asarray(parent)[None]
    np.testing.assert_array_equal(np.asarray(ancestor_mask(pj, tree.max_depth))[0], mask)
    k = max(1, max(int((parent == i).sum()) for i in range(tree.size)))
    kids = np.asarray(children_table(pj, k))[0]
    for i in range(tree.size):
        assert [c for c in kids[i] if c >= 0] == [j for j in range(tree.size) if parent[j] == i]


def test_published_trees():
    eagle = StaticTree.from_paths(MC_SIM_7B_63)
    assert eagle.size == 26 and eagle.max_depth == 5
    assert len(eagle.arrays()[5]) == 15  # 15 leaves
    medusa = StaticTree.from_paths(MEDUSA_DEFAULT)
    assert medusa.max_depth == 4


def test_static_tree_errors():
    with pytest.raises(SpecJaxError, match="parent path"):
        StaticTree.from_paths([[0, 1]])
    with pytest.raises(SpecJaxError, match="list of rank lists"):  # not a traceback
        StaticTree.from_paths({"base": [[0]], "ngram": 4})


def test_graft_follows_the_tree_then_branches_off():
    """The n-gram chain reuses the nodes it matches, adds the rest under the last match, and
    leaves unneeded or invalid chain slots unreachable."""
    import jax.numpy as jnp

    from spec_jax.compose.graft import graft
    from spec_jax.tree import StaticTree, static_tree_batch

    base = StaticTree.from_paths([[0], [1], [0, 0]])  # root 0; 1 and 2 under root; 3 under 1
    tree = static_tree_batch(base, jnp.asarray([[9, 5, 6, 7], [9, 5, 6, 7]]), 2)
    chain = jnp.asarray([[5, 7, 8], [4, 1, 2]])
    valid = jnp.asarray([[True, True, True], [True, True, False]])
    g = graft(tree, chain, valid, max_depth=3, max_children=3)
    # row 0: 5 is node 1, 7 is node 3 (its child), 8 is new under 3; slots 4 and 5 are dead
    np.testing.assert_array_equal(g.parent[0], [-1, 0, 0, 1, -1, -1, 3])
    np.testing.assert_array_equal(g.depth[0], [0, 1, 1, 2, 0, 0, 3])
    # row 1: 4 is new under the root, 1 under it; the invalid third token is dead
    np.testing.assert_array_equal(g.parent[1], [-1, 0, 0, 1, 0, 4, -1])
    np.testing.assert_array_equal(g.children[1, 0], [1, 2, 4])
    np.testing.assert_array_equal(g.children[0, 3], [6, -1, -1])
    assert bool(g.mask[0, 6, 1]) and bool(g.mask[0, 6, 3]) and not bool(g.mask[0, 6, 2])
    assert np.asarray(g.mask[0, 4]).sum() == 1  # a dead node sees only itself


def test_greedy_walk_accepts_what_a_node_by_node_walk_does():
    """The vectorised greedy verification against the walk it replaces: from the root, take the
    first child (in try order) whose token is the target's argmax, until none is. Random trees of
    12 nodes (some unused, as a graft leaves them: parent -1) with distinct sibling tokens."""
    from spec_jax.tree import Tree
    from spec_jax.verify import greedy_walk

    rng = np.random.default_rng(0)
    b, t, k, vocab, max_depth = 256, 12, 4, 6, 5
    parent = np.full((b, t), -1, np.int32)
    depth = np.zeros((b, t), np.int32)
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    for r in range(b):
        kids = {0: []}
        for n in range(1, t):
            free = [p for p in kids if len(kids[p]) < k and depth[r, p] < max_depth]
            if rng.random() < 0.15 or not free:
                continue
            p = int(rng.choice(free))
            taken = {int(tokens[r, c]) for c in kids[p]}
            tokens[r, n] = rng.choice([x for x in range(vocab) if x not in taken])
            parent[r, n], depth[r, n] = p, depth[r, p] + 1
            kids[p].append(n)
            kids[n] = []
    best = rng.integers(0, vocab, (b, t)).astype(np.int32)
    for r in range(b):  # the argmax is often one of the children, so paths go deep
        for n in range(t):
            cs = np.nonzero(parent[r] == n)[0]
            if n > 0 and parent[r, n] < 0 or len(cs) == 0:
                continue
            if rng.random() < 0.7:
                best[r, n] = tokens[r, rng.choice(cs)]
    pj = jnp.asarray(parent)
    tree = Tree(tokens=jnp.asarray(tokens), parent=pj, depth=jnp.asarray(depth),
                mask=ancestor_mask(pj, max_depth), children=children_table(pj, k))
    got = greedy_walk(jnp.asarray(best), tree, max_depth)
    children = np.asarray(tree.children)
    deep = 0
    for r in range(b):
        cur, path = 0, [0]
        while True:
            nxt = [c for c in children[r, cur] if c >= 0 and tokens[r, c] == best[r, cur]]
            if not nxt:
                break
            cur = int(nxt[0])
            path.append(cur)
        deep = max(deep, len(path))
        np.testing.assert_array_equal(np.asarray(got.path[r]), path + [-1] * (max_depth + 1 - len(path)))
        assert int(got.n_accepted[r]) == len(path) and int(got.bonus[r]) == best[r, cur]
    assert deep >= 4  # the test reaches deep paths


def test_a_ranked_chain_merges_into_the_pool_and_competes_for_its_tokens():
    """merge_chain follows the pool's nodes, raises a followed node to the chain's score, appends
    the rest; best_nodes_tree then keeps the likeliest nodes, whichever drafter made them."""
    import jax.numpy as jnp

    from spec_jax.tree import Pool, best_nodes_tree, merge_chain

    lg = np.log
    # pool: 5 (0.6) and 6 (0.3) under the root; 7 under 5 (0.6*0.5), 8 under 6 (0.3*0.2)
    pool = Pool(tok=jnp.asarray([[5, 6, 7, 8]]), score=jnp.asarray([lg([0.6, 0.3, 0.3, 0.06])]),
                parent=jnp.asarray([[-1, -1, 0, 1]]), depth=jnp.asarray([[1, 1, 2, 2]]))
    chain = jnp.asarray([[6, 8, 9, 4]])
    valid = jnp.asarray([[True, True, True, False]])
    merged = merge_chain(pool, chain, valid, jnp.asarray([lg([0.9, 0.8, 0.7, 0.6])]))
    # 6 and 8 are the pool's nodes 1 and 3, now scored by the chain (their own slots 4 and 5 are
    # never picked); 9 is new under 8; 4 is invalid
    np.testing.assert_allclose(np.exp(merged.score[0, [0, 1, 2, 3, 6]]), [0.6, 0.9, 0.3, 0.8, 0.7],
                               rtol=1e-6)
    assert np.all(np.isneginf(merged.score[0, [4, 5, 7]]))
    np.testing.assert_array_equal(merged.parent[0, 6:], [3, 6])
    np.testing.assert_array_equal(merged.depth[0, 6:], [3, 4])
    # the four best: 6 (0.9), 8 (0.8), 9 (0.7), 5 (0.6); the head's 7 (0.3) is left out
    t = best_nodes_tree(jnp.asarray([1]), merged, 4, max_depth=4, k=3)
    np.testing.assert_array_equal(t.tokens[0], [1, 5, 6, 8, 9])
    np.testing.assert_array_equal(t.parent[0], [-1, 0, 0, 2, 3])
    np.testing.assert_array_equal(t.depth[0], [0, 1, 1, 2, 3])
