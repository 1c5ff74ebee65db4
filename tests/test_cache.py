import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.cache import commit, init_cache


def test_commit_appends_selected_rows_per_row_length():
    c = init_cache(2, 2, 8, 2, 2)  # [L, B, KVH, S, D]
    c = c.replace(length=jnp.array([1, 5]), valid=c.valid.at[0, 0].set(True).at[1, :5].set(True))
    k_new = jnp.arange(2 * 2 * 4 * 2 * 2, dtype=jnp.float32).reshape(2, 2, 4, 2, 2)  # [L,B,T,KVH,D]
    pos = jnp.array([[10, 11, 12, 13], [20, 21, 22, 23]])
    select = jnp.array([[2, 0, 3], [1, 3, 0]])
    c2 = commit(c, k_new, k_new, pos, select, jnp.array([2, 3]))
    assert c2.length.tolist() == [3, 8]
    np.testing.assert_array_equal(c2.k[:, 0, :, 1], k_new[:, 0, 2])
    np.testing.assert_array_equal(c2.k[:, 0, :, 2], k_new[:, 0, 0])
    np.testing.assert_array_equal(c2.k[:, 0, :, 3], 0)  # count 2: third entry dropped
    np.testing.assert_array_equal(c2.k[:, 1, :, 5:8], k_new[:, 1, jnp.array([1, 3, 0])].swapaxes(1, 2))
    assert c2.pos[0, :3].tolist() == [-1, 12, 10]
    assert c2.valid[0].tolist() == [True, True, True] + [False] * 5


def test_commit_never_wraps_past_the_end():
    c = init_cache(1, 1, 4, 1, 1).replace(length=jnp.array([3]))
    k_new = jnp.ones((1, 1, 3, 1, 1))
    c2 = commit(c, k_new, k_new, jnp.zeros((1, 3), jnp.int32), jnp.array([[0, 1, 2]]), jnp.array([3]))
    assert c2.length.tolist() == [4]
    assert c2.k[0, 0, 0, :, 0].tolist() == [0, 0, 0, 1]  # slot 0 untouched: nothing wrapped


def test_cache_is_donated_in_place():
    c = init_cache(1, 1, 16, 1, 4)
    f = jax.jit(lambda c, k: commit(c, k, k, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                                    jnp.array([1])), donate_argnums=0)
    k_ptr = c.k.unsafe_buffer_pointer()
    out = f(c, jnp.ones((1, 1, 1, 1, 4)))
    assert c.k.is_deleted()
    assert out.k.unsafe_buffer_pointer() == k_ptr


def test_per_layer_cache_commits_like_the_stacked_one():
    k_new = jnp.arange(3 * 2 * 4 * 2 * 2, dtype=jnp.float32).reshape(3, 2, 4, 2, 2)
    args = (k_new, -k_new, jnp.zeros((2, 4), jnp.int32), jnp.array([[1, 0], [3, 2]]), jnp.array([2, 1]))
    stacked = commit(init_cache(3, 2, 8, 2, 2), *args)
    per_layer = commit(init_cache(3, 2, 8, 2, 2, per_layer=True), *args)
    assert per_layer.per_layer and per_layer.num_slots == stacked.num_slots == 8
    np.testing.assert_array_equal(jnp.stack(per_layer.k), stacked.k)
    np.testing.assert_array_equal(jnp.stack(per_layer.v), stacked.v)
