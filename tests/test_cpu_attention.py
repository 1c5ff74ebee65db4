"""The CPU tree-attention kernel (pallas_kernels/cpu/attention.cc): equal to the reference, each
query independent of the others to the bit (so verification agrees with plain decoding), and
differentiable through the pure-JAX path."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tree_attention
from pallas_kernels.cpu import attention
from pallas_kernels.reference import tree_attention_reference
from tests.test_kernels import CASES, make_inputs

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="the CPU kernel is built with the system C++ compiler")
attend = jax.jit(tree_attention, static_argnames=("impl", "scale", "block_size"))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_equals_reference(case):
    args = make_inputs(*CASES[case], jnp.float32, seed=case)
    assert attention.supported(args[0], args[1], args[5])
    np.testing.assert_allclose(np.asarray(attend(*args, impl="cpu")),
                               np.asarray(tree_attention_reference(*args)), atol=2e-6, rtol=0)


def test_draft_buffer_wider_than_block_and_nothing_visible():
    """Draft steps see N > T block keys; a padding query that sees nothing gets zeros."""
    q, kc, vc, valid, length, kn, vn, _ = make_inputs(2, 12, 2, 3, 32, 200, [150, 0], jnp.float32, 3)
    q = q[:, :5]
    rng = np.random.default_rng(0)
    mask = rng.random((2, 5, 12)) < 0.4
    mask[1, 2] = False  # row 1 has an empty cache: query 2 sees nothing at all
    args = (q, kc, vc, valid, length, kn, vn, jnp.asarray(mask))
    out = np.asarray(attend(*args, impl="cpu"))
    ref = np.asarray(tree_attention_reference(*args))
    np.testing.assert_array_equal(out[1, 2], 0.0)
    seen = np.ones(out.shape[:2], bool)
    seen[1] = mask[1].any(-1)  # row 1's queries see only block keys
    np.testing.assert_array_equal(out[~seen], 0.0)
    np.testing.assert_allclose(out[seen], ref[seen], atol=2e-6, rtol=0)


@pytest.mark.parametrize("t,start,s", [(6, 20, 64), (40, 20, 64), (6, 253, 300), (40, 230, 300)])
def test_cache_and_block_keys_give_identical_bits(t, start, s):
    """Verifying a chain over the block equals decoding it token by token from the cache; so does
    a long causal block (a prefill's), whose value rows the kernel sums for several queries at
    once instead of query by query. Past 256 keys a query's keys are split into windows of 256
    by rank (decoding: each window a work item of its own; a long block: windows in turn), here
    with the window boundary inside the block."""
    b, kvh, g, d = 1, 3, 3, 64
    q, kc, vc, _, _, kn, vn, _ = make_inputs(b, t, kvh, g, d, s, [start], jnp.float32, 7)
    valid = jnp.ones((b, s), bool)
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    tree = np.asarray(attend(q, kc, vc, valid, jnp.asarray([start]), kn, vn, causal, impl="cpu"))
    ref = tree_attention_reference(q, kc, vc, valid, jnp.asarray([start]), kn, vn, causal)
    np.testing.assert_allclose(tree, np.asarray(ref), atol=2e-6, rtol=0)
    for i in range(t):  # token i decoded alone: tokens < i already committed to slots start..
        kc_i = kc.at[:, :, start:start + i].set(kn[:, :i].transpose(0, 2, 1, 3))
        vc_i = vc.at[:, :, start:start + i].set(vn[:, :i].transpose(0, 2, 1, 3))
        one = attend(q[:, i:i + 1], kc_i, vc_i, valid, jnp.asarray([start + i]), kn[:, i:i + 1],
                     vn[:, i:i + 1], jnp.ones((b, 1, 1), bool), impl="cpu")
        np.testing.assert_array_equal(np.asarray(one)[:, 0], tree[:, i])


def test_a_row_gets_the_same_bits_alone_or_in_a_batch_past_one_window():
    """Alone, a long row's windows run as separate work items and merge afterwards; in a batch
    (work enough) each item merges its own windows in turn: the same bits, with holes in the
    cache (slots not valid, counted out of the ranks) or without."""
    b, t, kvh, g, d, s = 4, 4, 3, 3, 64, 900
    q, kc, vc, valid, length, kn, vn, _ = make_inputs(b, t, kvh, g, d, s, [700, 300, 257, 40],
                                                      jnp.float32, 11)
    valid = valid.at[2].set(True)  # rows 0, 1 and 3 have holes; row 2 is dense
    mask = jnp.asarray(np.tril(np.random.default_rng(1).random((b, t, t)) < 0.7) | np.eye(t, dtype=bool))
    batch = np.asarray(attend(q, kc, vc, valid, length, kn, vn, mask, impl="cpu"))
    ref = np.asarray(tree_attention_reference(q, kc, vc, valid, length, kn, vn, mask))
    np.testing.assert_allclose(batch, ref, atol=2e-6, rtol=0)
    for r in range(b):
        alone = attend(q[r:r + 1], kc[r:r + 1], vc[r:r + 1], valid[r:r + 1], length[r:r + 1],
                       kn[r:r + 1], vn[r:r + 1], mask[r:r + 1], impl="cpu")
        np.testing.assert_array_equal(np.asarray(alone)[0], batch[r])


@pytest.mark.parametrize("g,d", [(3, 64), (4, 32), (2, 128), (5, 16), (1, 48)])
def test_a_query_gets_the_same_bits_whichever_queries_share_its_pass(g, d):
    """Queries are scored, normalised and summed several to a pass (one per vector lane, several
    lanes per value row); each one's result must not depend on its neighbours or its lane."""
    b, t, kvh, s = 2, 8, 2, 300
    q, kc, vc, valid, length, kn, vn, _ = make_inputs(b, t, kvh, g, d, s, [250, 90], jnp.float32, g)
    mask = jnp.asarray(np.random.default_rng(d).random((b, t, t)) < 0.5)
    together = np.asarray(attend(q, kc, vc, valid, length, kn, vn, mask, impl="cpu"))
    for i in range(t):
        alone = attend(q[:, i:i + 1], kc, vc, valid, length, kn, vn, mask[:, i:i + 1], impl="cpu")
        np.testing.assert_array_equal(np.asarray(alone)[:, 0], together[:, i])


def test_gradients_and_vmap():
    args = make_inputs(2, 4, 2, 2, 16, 40, [30, 12], jnp.float32, 5)
    diff = lambda impl: jax.grad(
        lambda q, kc, kn: jnp.sum(jnp.sin(tree_attention(q, kc, args[2], args[3], args[4], kn,
                                                          args[6], args[7], impl=impl))),
        argnums=(0, 1, 2))(args[0], args[1], args[5])
    for got, want in zip(diff("cpu"), diff("xla")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-4)
    stacked = [jnp.stack([a, a]) for a in args]
    out = jax.vmap(lambda *a: tree_attention(*a, impl="cpu"))(*stacked)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(attend(*args, impl="cpu")))


def test_auto_is_the_kernel_on_cpu_and_bfloat16_falls_back():
    from pallas_kernels.dispatch import resolve_impl

    assert resolve_impl("auto") == "cpu"
    args = make_inputs(*CASES[0], jnp.bfloat16, seed=0)
    assert not attention.supported(args[0], args[1], args[5])
    out = attend(*args, impl="cpu")
    assert out.dtype == jnp.bfloat16
    ref = tree_attention_reference(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                     for a in args])
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2, rtol=0)
