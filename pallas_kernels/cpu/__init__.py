"""spec_jax's CPU kernels: XLA FFI calls compiled from the C++ sources beside these modules.

`build` compiles and registers them (g++, on first use); `gemm` is the packed-weight matrix
product, `attention` the tree attention, `argmax` the row-wise argmax. Each keeps XLA's ops where
the kernels are not built. Import the modules themselves (`from pallas_kernels.cpu import gemm`).
"""
