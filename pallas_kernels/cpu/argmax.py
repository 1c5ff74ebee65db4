"""Row-wise argmax of float32 logits on CPU (`argmax.cc`); jnp.argmax elsewhere.

Greedy verification takes the argmax of every tree node's logits; XLA:CPU's index-carrying
reduction is several times slower than a vector max and a scan for its first index. Same result as
jnp.argmax (first index on ties, first NaN wins); no gradient flows through an argmax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import build

TARGET = "spec_jax_argmax"


def argmax(x):
    """x [..., V] -> int32 [...]: the index of each row's maximum."""
    v = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    def xla(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    if x.dtype != jnp.float32 or rows == 0 or v == 0 or not build.available():
        return xla(x)

    def kernel(x):
        y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows,), jnp.int32),
                             vmap_method="sequential")(jax.lax.stop_gradient(x).reshape(rows, v))
        return y.reshape(x.shape[:-1])

    # the platform a program is lowered for picks: a CPU process compiling for TPU or GPU (ahead
    # of time, spec_jax.plan) gets XLA's argmax there
    return jax.lax.platform_dependent(x, cpu=kernel, default=xla)
