"""The CPU argmax kernel (pallas_kernels/cpu/argmax.cc) gives jnp.argmax's answer: ties, NaN,
-inf rows, short rows, leading axes, vmap, and no gradient trouble."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu import build
from pallas_kernels.cpu.argmax import argmax

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="the CPU kernel is built with the system C++ compiler")


def test_matches_jnp_argmax():
    assert build.available()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 1000)).astype(np.float32)
    x[0, 0, [10, 700]] = 9.0  # a tie: the first index wins
    x[0, 1, [17, 400, 999]] = np.nan  # NaN wins, the first one
    x[0, 2] = -np.inf
    x[1, 3, 999] = 50.0  # the maximum in the scalar tail
    x[2, 4, [3, 5]] = [0.0, -0.0]
    x[2, 4, 6:] = -1.0
    x[2, 4, :3] = -1.0
    f = jax.jit(argmax)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jnp.argmax(x, -1)))
    short = rng.standard_normal((4, 7)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(f(short)), np.argmax(short, -1))
    np.testing.assert_array_equal(np.asarray(jax.vmap(argmax)(x)), np.asarray(jnp.argmax(x, -1)))
    g = jax.grad(lambda x: jnp.sum(x * argmax(x)[..., None]))(jnp.asarray(short))
    np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.argmax(short, -1)[:, None], (4, 7)))
