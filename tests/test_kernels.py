"""Pallas tree-attention kernels: interpret mode equals the reference on randomized shapes, and both
lowerings (TPU Mosaic, GPU Triton) lower for real hardware from this CPU-only machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tree_attention
from pallas_kernels.dispatch import tree_attention_pallas
from pallas_kernels.reference import tree_attention_reference
from spec_jax.tree import ancestor_mask_np

CASES = [  # (B, T, KVH, G, D, S, lengths)
    (1, 1, 3, 3, 64, 384, [200]),  # SmolLM2 layout, plain decode
    (2, 8, 1, 1, 32, 300, [37, 290]),  # MHA, cache not a multiple of the block
    (3, 13, 2, 8, 64, 520, [0, 129, 520]),  # GQA 8, an empty row, a full row
    (2, 32, 4, 3, 128, 256, [256, 5]),  # Llama-3 head dim, long tree
]


def make_inputs(b, t, kvh, g, d, s, lengths, dtype, seed):
    rng = np.random.default_rng(seed)
    h = kvh * g
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    valid = rng.random((b, s)) < 0.7
    valid[:, 130:260] = False  # a fully masked block
    parent = np.asarray([-1] + [int(rng.integers(0, i)) for i in range(1, t)])
    mask = ancestor_mask_np(parent)  # a random tree
    return (f(b, t, h, d), f(b, kvh, s, d), f(b, kvh, s, d), jnp.asarray(valid),
            jnp.asarray(lengths, jnp.int32), f(b, t, kvh, d), f(b, t, kvh, d),
            jnp.asarray(np.broadcast_to(mask, (b, t, t))))


@pytest.mark.parametrize("platform,block", [("tpu", 128), ("gpu", 64)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_interpret_equals_reference_float32(platform, block, case):
    args = make_inputs(*CASES[case], jnp.float32, seed=case)
    ref = tree_attention_reference(*args)
    out = tree_attention_pallas(*args, interpret=True, platform=platform, block_size=block)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_xla_path_equals_reference(case):
    """The default XLA path (cache part and block part merged) equals one softmax over both."""
    args = make_inputs(*CASES[case], jnp.float32, seed=case)
    np.testing.assert_allclose(np.asarray(tree_attention(*args, impl="xla")),
                               np.asarray(tree_attention_reference(*args)), atol=1e-5, rtol=0)


def test_interpret_equals_reference_bfloat16():
    args = make_inputs(2, 8, 2, 3, 64, 300, [100, 300], jnp.bfloat16, seed=9)
    ref = tree_attention_reference(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                     for a in args])
    out = tree_attention_pallas(*args, interpret=True, platform="tpu", block_size=128)
    # bf16 inputs, f32 accumulation: the output is rounded once to bf16 (8 bits of mantissa)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=0)


def test_dispatch_pallas_interpret_matches_xla():
    args = make_inputs(1, 4, 3, 3, 64, 256, [77], jnp.float32, seed=3)
    np.testing.assert_allclose(np.asarray(tree_attention(*args, impl="pallas_interpret")),
                               np.asarray(tree_attention(*args, impl="xla")), atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention impl"):
        tree_attention(*args, impl="cuda")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_lowers_for_tpu(case):
    args = make_inputs(*CASES[case], jnp.float32, seed=case)
    f = lambda *a: tree_attention_pallas(*a, platform="tpu", block_size=128)
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_lowers_for_cuda(case):
    args = make_inputs(*CASES[case], jnp.float32, seed=case)
    f = lambda *a: tree_attention_pallas(*a, platform="gpu", block_size=64)
    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xla.gpu.triton" in exported.mlir_module()


def test_bfloat16_lowers_for_both():
    args = make_inputs(1, 8, 3, 3, 64, 512, [300], jnp.bfloat16, seed=1)
    jax.export.export(jax.jit(lambda *a: tree_attention_pallas(*a, platform="tpu")),
                      platforms=["tpu"])(*args)
    jax.export.export(jax.jit(lambda *a: tree_attention_pallas(*a, platform="gpu")),
                      platforms=["cuda"], disabled_checks=[
                          jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


def test_triton_split_k_equals_reference():
    """Many cache chunks per row (flash-decoding split), empty and fully masked chunks included."""
    from pallas_kernels.gpu import cache_attention_triton
    from pallas_kernels.reference import cache_attention

    args = make_inputs(3, 5, 2, 3, 32, 700, [700, 0, 263], jnp.float32, seed=11)
    q, kc, vc, valid, length = args[:5]
    o, lse = cache_attention_triton(q, kc, vc, valid, length, 32 ** -0.5, block=64, chunk=128,
                                    interpret=True)
    o_ref, lse_ref = cache_attention(q, kc, vc, valid, length, 32 ** -0.5)
    live = np.asarray(lse_ref) > -1e29
    np.testing.assert_allclose(np.asarray(o)[live], np.asarray(o_ref)[live], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=1e-4, rtol=1e-6)


def _shard_maps(mesh, impl, case=(2, 3, 4, 2, 16, 128, [5, 100])):
    """The shard_map equations of tree attention traced for `mesh` (abstract: no devices)."""
    args = make_inputs(*case, jnp.float32, 0)
    jaxpr = jax.make_jaxpr(lambda *a: tree_attention(*a, impl=impl, mesh=mesh))(*args)
    return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"]


def test_split_axes_split_what_divides_and_replicate_the_rest():
    from jax.sharding import AbstractMesh

    from pallas_kernels.sharded import split_axes

    m24 = AbstractMesh((2, 4), ("data", "model"))
    assert split_axes(m24, 2, 8, 4) == ("data", "model")
    assert split_axes(m24, 3, 8, 4) == (None, "model")  # 3 rows on 2 devices: replicated
    assert split_axes(m24, 2, 8, 2) == ("data", None)  # 2 KV heads on 4 devices: replicated
    assert split_axes(AbstractMesh((2, 3), ("data", "model")), 4, 9, 3) == ("data", "model")
    assert split_axes(AbstractMesh((8,), ("data",)), 8, 8, 8) == ("data", None)
    assert split_axes(AbstractMesh((4,), ("x",)), 8, 8, 8) == (None, None)  # other axes


@pytest.mark.parametrize("impl", ["pallas_interpret", "cpu"])
def test_a_kernel_on_a_mesh_runs_per_shard(impl):
    from jax.sharding import AbstractMesh

    from pallas_kernels.cpu import build

    if impl == "cpu" and not build.available():
        pytest.skip("the CPU kernel is not built here")
    (eq,) = _shard_maps(AbstractMesh((2, 4), ("data", "model")), impl)
    q, k_cache = (v.aval.shape for v in eq.params["jaxpr"].invars[:2])
    assert q == (1, 3, 2, 16) and k_cache == (1, 1, 128, 16)  # a row, 2 of 8 heads, 1 of 4 KV
    # 3 rows do not split over 2 devices: replicated, each device computes all of them
    (eq,) = _shard_maps(AbstractMesh((2, 4), ("data", "model")), impl,
                        (3, 3, 4, 2, 16, 128, [5, 100, 0]))
    assert eq.params["jaxpr"].invars[0].aval.shape == (3, 3, 2, 16)


def test_xla_attention_and_one_device_need_no_shard_map():
    from jax.sharding import AbstractMesh

    assert _shard_maps(AbstractMesh((2, 4), ("data", "model")), "xla") == []  # XLA partitions it
    assert _shard_maps(None, "pallas_interpret") == []  # operands on no mesh
