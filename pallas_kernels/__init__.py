"""Tree-attention kernels for speculative decoding, with a pure-JAX reference as the oracle.

`tree_attention(..., impl=...)`:
  "xla"              the pure-JAX reference (default on CPU),
  "pallas_interpret" the Pallas kernel run by the interpreter (CPU tests),
  "pallas"           the Pallas kernel compiled for the current backend (TPU Mosaic / GPU),
  "auto"             "pallas" on TPU and GPU, "xla" elsewhere.
"""
from pallas_kernels.dispatch import tree_attention
from pallas_kernels.reference import tree_attention_reference

__all__ = ["tree_attention", "tree_attention_reference"]
