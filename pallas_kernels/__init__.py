"""Tree-attention kernels for speculative decoding, with a pure-JAX reference as the oracle.

`tree_attention(..., impl=...)`:
  "xla"              the pure-JAX path (cache part and block part merged),
  "cpu"              one FFI call per layer on CPU (`cpu/attention.cc`; XLA when not built),
  "pallas_interpret" the Pallas kernel run by the interpreter (CPU tests),
  "pallas"           the Pallas kernel compiled for the current backend (TPU Mosaic / GPU),
  "auto"             "cpu" on CPU, "xla" elsewhere (the default).

On a device mesh a kernel runs per device under `jax.shard_map` (`sharded`: rows over "data",
heads over "model" where they divide); "xla" is left to XLA's partitioner.

Layout: `reference` (pure JAX, the oracle), `dispatch` (the choice), `sharded` (kernels on a
mesh), `tpu` / `gpu` (the Pallas kernels), `cpu/` (the C++ FFI kernels and their builder: tree
attention, packed matmul, argmax).
"""
from pallas_kernels.dispatch import tree_attention
from pallas_kernels.reference import tree_attention_reference

__all__ = ["tree_attention", "tree_attention_reference"]
