"""The CPU packed-matmul kernel (pallas_kernels/cpu/gemm.cc): exact enough, row-independent to the
bit, differentiable through its fallback, and a packed target decodes exactly like an unrolled one."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax
from pallas_kernels.cpu import gemm
from spec_jax.models import layers
from spec_jax.models.llama import causal_mask, forward, pack_layers, unstack_layers
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="the CPU kernel is built with the system C++ compiler")


def test_kernel_builds_here():
    assert gemm.available(), "g++ is installed, so the kernel must build and register"


def test_the_build_is_keyed_by_what_it_compiles_not_where_it_lies(tmp_path):
    """Two checkouts of the same sources share one library (and the sizing measured with it);
    a changed source is a new build."""
    from pallas_kernels.cpu import build

    keys = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        for f in build.SOURCES + build.HEADERS:
            shutil.copy(f, d / f.name)
        keys.append(build._build_key(build._command("g++", d), d))
    assert keys[0] == keys[1] == build._build_key(build._command("g++"))
    src = tmp_path / "b" / build.SOURCES[0].name
    src.write_text(src.read_text() + "\n// an edit\n")
    assert build._build_key(build._command("g++", tmp_path / "b"), tmp_path / "b") != keys[0]


@pytest.mark.parametrize("k,n", [(64, 32), (576, 192), (200, 96)])
def test_packed_matmul_is_exact_and_row_independent(k, n):
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n), dtype=np.float32)
    pw = gemm.pack(w)
    p = gemm.panel_width()
    assert p in (16, 32) and pw.shape == (k, n) and pw.panels.shape == (n // p, k, p)
    np.testing.assert_array_equal(np.asarray(gemm.unpack(pw)), w)
    mm = jax.jit(layers.matmul)
    # every tile; 300 rows of K = 576 span three row blocks (a prefill's)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 17, 64, 65, 300):
        x = rng.standard_normal((rows, k), dtype=np.float32)
        y = np.asarray(mm(x, pw))
        ref = x.astype(np.float64) @ w.astype(np.float64)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
        one_by_one = np.concatenate([np.asarray(mm(x[i:i + 1], pw)) for i in range(rows)])
        np.testing.assert_array_equal(y, one_by_one)  # bit-identical whatever the row count


def test_bfloat16_panels_give_the_float32_product_of_the_rounded_weights():
    """Draft heads stream bfloat16 panels: each weight converts exactly in registers, so the
    product is the float32 kernel's over the rounded weights, to the bit, for every tile."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((576, 96), dtype=np.float32)
    half = gemm.pack(w, jnp.bfloat16)
    assert half.dtype == jnp.bfloat16 and half.shape == (576, 96)
    rounded = gemm.pack(np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)))
    mm = jax.jit(layers.matmul)
    for rows in (1, 3, 4, 8, 9, 13):
        x = rng.standard_normal((rows, 576), dtype=np.float32)
        y = np.asarray(mm(x, half))
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, np.asarray(mm(x, rounded)))
    np.testing.assert_array_equal(np.asarray(gemm.unpack(half)).astype(np.float32),
                                  np.asarray(gemm.unpack(rounded)))


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "codes"])
def test_the_kernels_prologues_and_epilogues_match_their_ops_row_by_row(storage):
    """`matmul(x, w, norm=...)` / `glu=True` apply RMSNorm / SwiGLU to x and `rope=` /
    `residual=` RoPE / a residual add to the product inside the kernel: the ops' results to
    float32 rounding, each row bit-identical whatever the row count and in the rows (prefill)
    kernel, and differentiable as the ops are."""
    rng = np.random.default_rng(3)
    k, n = 96, 64
    w = rng.standard_normal((k, n)).astype(np.float32)
    if storage == "codes":  # a GGUF Q8_0 dequantization
        from gguf import GGMLQuantizationType

        pw = gemm.pack_exact(_gguf_blocks(w, GGMLQuantizationType.Q8_0))
        assert pw.scales is not None
    else:
        pw = gemm.pack(w, None if storage == "float32" else jnp.bfloat16)
    wf = np.asarray(gemm.unpack(pw)).astype(np.float32)
    g = jnp.asarray(rng.uniform(0.5, 2.0, k).astype(np.float32))
    for rows in (1, 3, 8, 12, 70):  # 70 rows: the prologue runs over the thread pool
        x = jnp.asarray(3 * rng.standard_normal((rows, 2 * k)).astype(np.float32))
        for kw, xin in (({"norm": (g, 1e-5)}, x[:, :k]), ({"glu": True}, x)):
            mm = jax.jit(lambda x, r=None, kw=kw: layers.matmul(x, pw, r, **kw))
            y = np.asarray(mm(xin))
            ref = np.asarray(gemm.prologue_reference(xin, **kw)) @ wf
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
            one = np.concatenate([np.asarray(mm(xin[i:i + 1])) for i in range(rows)])
            np.testing.assert_array_equal(y, one)
            counts = jnp.asarray([rows], jnp.int32)
            np.testing.assert_array_equal(np.asarray(mm(xin[None], counts))[0], y)
        ang = rng.uniform(0, 6, (rows, 16)).astype(np.float32)  # heads of D = 32
        cs = jnp.asarray(np.concatenate([np.cos(ang), np.sin(ang)], -1))
        res = jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32))
        for kw in ({"rope": (cs, 32)}, {"rope": (cs, 64), "norm": (g, 1e-5)},
                   {"residual": res, "glu": True}):
            xin = x if kw.get("glu") else x[:, :k]
            y = np.asarray(layers.matmul(xin, pw, **kw))
            pre = {a: b for a, b in kw.items() if a in ("norm", "glu")}
            ref = np.asarray(gemm.epilogue_reference(
                jnp.asarray(np.asarray(gemm.prologue_reference(xin, **pre)) @ wf),
                kw.get("rope"), kw.get("residual")))
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
            counts = jnp.asarray([rows], jnp.int32)
            batched = {a: ((b[0][None], b[1]) if a == "rope" else
                           b[None] if a == "residual" else b) for a, b in kw.items()}
            np.testing.assert_array_equal(
                np.asarray(layers.matmul(xin[None], pw, counts, **batched))[0], y)
            one = np.concatenate([np.asarray(layers.matmul(
                xin[i:i + 1], pw, **{a: ((b[0][i:i + 1], b[1]) if a == "rope" else
                                          b[i:i + 1] if a == "residual" else b)
                                     for a, b in kw.items()})) for i in range(rows)])
            np.testing.assert_array_equal(y, one)
    x = jnp.asarray(rng.standard_normal((4, k)).astype(np.float32))
    loss = lambda f: lambda x, g: jnp.sum(jnp.sin(f(x, g)))  # noqa: E731
    got = jax.grad(loss(lambda x, g: layers.matmul(x, pw, norm=(g, 1e-5))), (0, 1))(x, g)
    want = jax.grad(loss(lambda x, g: gemm.prologue_reference(x, (g, 1e-5)) @ wf), (0, 1))(x, g)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    r = jnp.asarray(rng.standard_normal((4, n)).astype(np.float32))
    got = jax.grad(lambda x, r: jnp.sum(jnp.sin(layers.matmul(x, pw, residual=r))), (0, 1))(x, r)
    want = jax.grad(lambda x, r: jnp.sum(jnp.sin(r + x @ wf)), (0, 1))(x, r)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_leading_axes_and_gradients():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((48, 64), dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((2, 3, 48), dtype=np.float32))
    pw = gemm.pack(w)
    np.testing.assert_allclose(np.asarray(layers.matmul(x, pw)), np.asarray(x @ w), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(jax.vmap(layers.matmul, (0, None))(x, pw)),
                                  np.asarray(layers.matmul(x, pw)))
    gx, gp = jax.grad(lambda x, p: jnp.sum(jnp.sin(layers.matmul(x, p))), argnums=(0, 1))(x, pw)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gemm.unpack(gp)), np.asarray(rw), rtol=1e-4, atol=1e-5)


def test_packed_target_matches_unrolled_and_stays_lossless():
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    base = spec_jax.random_target(cfg, seed=1, scale=0.3)
    unrolled = unstack_layers(base.params)
    packed = pack_layers(base.params)
    assert set(packed["layers"][0]) == {"attn_norm", "mlp_norm", "wqkv", "wo", "w_gate_up",
                                        "w_down"}  # q/k/v and gate/up joined: fewer kernel calls
    assert packed["layers"][0]["wqkv"].shape == (64, 128)
    assert packed["layers"][0]["w_gate_up"].shape == (64, 256)
    assert isinstance(packed["lm_head"], gemm.PackedWeight)
    toks = jnp.asarray(np.random.default_rng(2).integers(0, 96, (2, 7)), jnp.int32)
    args = (toks, jnp.broadcast_to(jnp.arange(7), (2, 7)), base.new_cache(2, 16), causal_mask(2, 7))
    a = forward(unrolled, cfg, *args)
    b = forward(packed, cfg, *args)
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=2e-5)
    from spec_jax.models.llama import PACKED_KEYS
    unfused = {**packed, "layers": [gemm.pack_matrices(lp, PACKED_KEYS)
                                    for lp in unrolled["layers"]]}
    np.testing.assert_array_equal(np.asarray(forward(unfused, cfg, *args).logits),
                                  np.asarray(b.logits))

    target = spec_jax.target.Target(cfg=cfg, params=packed)
    assert target.layout == "packed" and base.layout == "scan"
    prompt = [3, 17, 5, 3, 17, 5, 9]
    plain = spec_jax.generate(target, prompt, 40, stop_at_eos=False).token_ids
    heads = spec_jax.init_draft(target, "eagle", seed=0)
    bound = heads.bind(target)
    assert isinstance(bound["layer"]["wq"], gemm.PackedWeight)
    packed_leaves = [x for x in jax.tree.leaves(bound, is_leaf=lambda x: isinstance(
        x, gemm.PackedWeight)) if isinstance(x, gemm.PackedWeight)]
    assert packed_leaves and all(x.dtype == jnp.bfloat16 for x in packed_leaves)  # draft only
    assert target.params["layers"][0]["wqkv"].dtype == jnp.float32
    assert heads.bind(target) is bound  # made once per target
    for draft, tree in (("ngram", None), (heads, "dynamic:4,3,8")):
        r = spec_jax.generate(target, prompt, 40, draft=draft, tree=tree, stop_at_eos=False)
        assert r.token_ids == plain


def _gguf_blocks(w, kind):
    """w [..., K, N] as GGUF stores and dequantizes it: blocks of 32 along K for each column."""
    from gguf import quants

    t = np.ascontiguousarray(np.swapaxes(np.asarray(w, np.float32), -1, -2))
    return np.swapaxes(quants.dequantize(quants.quantize(t, kind), kind).reshape(t.shape), -1, -2)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_dequantized_matrices_pack_as_exact_uint8_codes(kind):
    """A matrix that is a GGUF Q4_1 or Q8_0 dequantization packs as uint8 codes (Q4_1's two to a
    byte) and float16 scales that give back its float32 weights to the bit; the kernel's products
    (d * sum x q + m * sum x per block) match the float32 kernel's to float32 rounding and are
    row-independent to the bit, for every tile; any other matrix keeps float32 panels."""
    from gguf import GGMLQuantizationType

    p = gemm.panel_width()
    rng = np.random.default_rng(0)
    w = _gguf_blocks(rng.standard_normal((96, 3 * p)) * 0.05, GGMLQuantizationType[kind])
    w[:32, :p] = 0.25  # a constant block (d = 0)
    codes = gemm.pack_exact(w)
    assert codes.dtype == jnp.uint8 and codes.scales.shape == (3, 3, 2, p)
    assert codes.scales.dtype == jnp.float16 and codes.shape == (96, 3 * p)
    assert codes.nibbles == (kind == "Q4_1")
    assert codes.panels.shape == (3, 96, p // 2 if kind == "Q4_1" else p)
    np.testing.assert_array_equal(np.asarray(gemm.unpack(codes)), w)
    plain = gemm.pack(w)
    mm = jax.jit(layers.matmul)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 70):
        x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
        y, ref = np.asarray(mm(x, codes)), np.asarray(mm(x, plain))
        assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()
        one_by_one = np.concatenate([np.asarray(mm(x[i:i + 1], codes)) for i in range(rows)])
        np.testing.assert_array_equal(y, one_by_one)  # decode and verify agree
    np.testing.assert_allclose(np.asarray(mm(x, codes)), np.asarray(x) @ w, rtol=1e-4, atol=1e-4)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(layers.matmul(x, codes))))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(
        lambda x: jnp.sum(jnp.sin(x @ jnp.asarray(w))))(x)), rtol=1e-4, atol=1e-4)
    w[5, 7] += 1e-3  # no longer of that form: float32 panels
    assert gemm.pack_exact(w).scales is None and gemm.pack_exact(w).dtype == jnp.float32


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "Q4_1", "Q8_0"])
def test_row_counts_skip_a_padded_prompts_rows_with_the_same_bits(kind):
    """matmul(x, w, rows) for x [B, T, K] computes each batch row's first rows[b] tokens (a
    prefill's real tokens) to the same bits as the whole product, and zeros past them, for every
    row tile; counts outside [0, T] are clipped."""
    from gguf import GGMLQuantizationType

    p = gemm.panel_width()
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 2 * p)) * 0.05
    w = (gemm.pack(np.asarray(w, np.float32), dtype=kind) if "float" in kind else
         gemm.pack_exact(_gguf_blocks(w, GGMLQuantizationType[kind])))
    assert (w.scales is None) == ("float" in kind)
    x = jnp.asarray(rng.standard_normal((3, 21, 96)), jnp.float32)
    full = np.asarray(jax.jit(layers.matmul)(x, w))
    part = jax.jit(lambda x, r: layers.matmul(x, w, rows=r))
    for counts in ([21, 13, 0], [1, 9, 21], [-4, 40, 12]):
        y = np.asarray(part(x, jnp.asarray(counts, jnp.int32)))
        for b, c in enumerate(np.clip(counts, 0, 21)):
            np.testing.assert_array_equal(y[b, :c], full[b, :c])
            assert not y[b, c:].any()


def _gguf_target_params(seed=1):
    """A tiny config and stacked params whose matrices are GGUF dequantizations (layers Q4_1,
    embedding and LM head Q8_0), as SmolLM2's are."""
    from gguf import GGMLQuantizationType as Q

    from spec_jax.models.llama import PACKED_KEYS

    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    base = spec_jax.random_target(cfg, seed=seed, scale=0.3).params
    params = {**base, "embed": jnp.asarray(_gguf_blocks(np.asarray(base["embed"]).T, Q.Q8_0).T),
              "layers": {k: jnp.asarray(_gguf_blocks(v, Q.Q4_1)) if k in PACKED_KEYS else v
                         for k, v in base["layers"].items()}}
    if "lm_head" in base:  # untied: [H, V], blocks along H as for the embedding
        params["lm_head"] = jnp.asarray(_gguf_blocks(base["lm_head"], Q.Q8_0))
    return cfg, params


def test_packed_codes_are_cached_per_checkpoint_and_repacked_when_it_changes(tmp_path, monkeypatch):
    """Finding a GGUF target's codes is most of its load time, so `load_target` keeps the packed
    layout in $SPEC_JAX_CACHE and reads it back while the checkpoint files are unchanged."""
    import json

    from spec_jax import target as target_mod
    from spec_jax.io import save_params

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"

    def write(seed):
        cfg, params = _gguf_target_params(seed)
        ckpt.mkdir(exist_ok=True)
        save_params(ckpt / "params", params)
        (ckpt / "spec_jax.json").write_text(json.dumps({"kind": "target", "config": cfg.to_dict()}))
        return cfg, params

    cfg, params = write(1)
    ids = np.arange(3, 40) % 96
    fresh = spec_jax.load_target(ckpt)
    assert fresh.weight_codes and len(list((tmp_path / "cache" / "packed").glob("*.npz"))) == 1
    real, real_load = target_mod.arrange_layers, target_mod.load_params
    monkeypatch.setattr(target_mod, "arrange_layers", lambda *a, **k: pytest.fail("not cached"))
    read = []
    monkeypatch.setattr(target_mod, "load_params",
                        lambda *a, **k: read.append(real_load(*a, **k)) or read[-1])
    cached = spec_jax.load_target(ckpt)
    # the matrices the cache holds as codes are not read from the checkpoint again
    assert set(read[0]["layers"]) == {"attn_norm", "mlp_norm"} and "embed" in read[0]
    assert jax.tree.structure(cached.params) == jax.tree.structure(fresh.params)
    for a, b in zip(jax.tree.leaves(cached.params), jax.tree.leaves(fresh.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(cached.logits(ids), fresh.logits(ids))
    monkeypatch.setattr(target_mod, "arrange_layers", real)

    shutil.rmtree(ckpt / "params")
    write(2)  # other weights in the same folder: packed afresh, never the stale layout
    other = spec_jax.load_target(ckpt)
    expect = target_mod.Target(cfg=cfg, params=real(_gguf_target_params(2)[1], cfg, "packed"))
    np.testing.assert_array_equal(other.logits(ids), expect.logits(ids))
    (cached_file,) = (tmp_path / "cache" / "packed").glob("*.npz")  # one file, rewritten
    cached_file.write_bytes(b"not a zip file")  # a damaged cache is repacked, not an error
    np.testing.assert_array_equal(spec_jax.load_target(ckpt).logits(ids), expect.logits(ids))
    assert [f.name for f in cached_file.parent.iterdir()] == [cached_file.name]
    assert cached_file.stat().st_size > 1000


def test_a_gguf_quantized_target_matches_float32_from_codes_and_decodes_losslessly():
    """SmolLM2 ships as a GGUF file; a target whose matrices are GGUF dequantizations packs them as
    codes (`layers="packed"`): the same logits as with float32 panels (`"packed_f32"`) to float32
    rounding, and speculative decoding on codes gives exactly plain decoding's tokens on codes."""
    from spec_jax.target import Target, arrange_layers

    cfg, params = _gguf_target_params()
    codes = Target(cfg=cfg, params=arrange_layers(params, cfg, "packed"))
    f32 = Target(cfg=cfg, params=arrange_layers(params, cfg, "packed_f32"))
    assert codes.weight_codes and not f32.weight_codes
    assert codes.params["lm_head"].dtype == jnp.uint8
    ids = np.arange(3, 40) % 96
    np.testing.assert_allclose(codes.logits(ids), f32.logits(ids), rtol=1e-4, atol=2e-4)
    prompt = [3, 17, 5, 3, 17, 5, 9]
    plain = spec_jax.generate(codes, prompt, 40, stop_at_eos=False).token_ids
    heads = spec_jax.init_draft(codes, "eagle", seed=0, d2t=np.arange(0, 96, 3))
    assert heads.bind(codes)["lm_sub"].dtype == jnp.uint8  # the LM head's slice keeps its codes
    assert heads.bind(f32)["lm_sub"].dtype == jnp.uint8  # also where the layers stream float32
    assert heads.bind(codes)["layer"]["wq"].dtype == jnp.bfloat16
    for draft, tree in (("ngram", None), (heads, "dynamic:4,3,8")):
        r = spec_jax.generate(codes, prompt, 40, draft=draft, tree=tree, stop_at_eos=False)
        assert r.token_ids == plain


def test_a_prompt_runs_in_a_compiled_longer_prefill_with_the_same_bits():
    """With the packed kernels a prompt's results do not depend on its padding, so a prompt whose
    64-token bucket has no program yet runs in a compiled one up to twice as long: the tokens it
    gets in its own bucket, and nothing compiles."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    base = spec_jax.random_target(cfg, seed=1, scale=0.3)
    packed = lambda: spec_jax.target.Target(cfg=cfg, params=pack_layers(base.params))  # noqa: E731
    short, long = [3 + i % 50 for i in range(40)], [5 + i % 40 for i in range(100)]
    heads = spec_jax.init_draft(packed(), "eagle", seed=0)
    for draft, tree in ((None, None), ("ngram", None), (heads, "dynamic:4,3,8")):
        alone = packed()
        want = spec_jax.generate(alone, short, 12, draft=draft, tree=tree, stop_at_eos=False)
        assert [k[4] for k in alone.compiled if k[0] == "prefill"] == [64]
        t = packed()
        spec_jax.generate(t, long, 12, draft=draft, tree=tree, stop_at_eos=False)
        r = spec_jax.generate(t, short, 12, draft=draft, tree=tree, stop_at_eos=False)
        assert r.token_ids == want.token_ids and r.stats["compile_seconds"] == 0.0
        assert [k[4] for k in t.compiled if k[0] == "prefill"] == [128]
    t = packed()
    spec_jax.generate(t, [7] * 150, 12, stop_at_eos=False)
    r = spec_jax.generate(t, short, 12, stop_at_eos=False)  # 192 tokens would pad 64 more than 2x
    assert r.stats["compile_seconds"] > 0
    assert [k[4] for k in t.compiled if k[0] == "prefill"] == [192, 64]
    t = packed()  # a prompt whose own bucket is compiled runs there, not in a longer one
    for n in (120, 150, 100):
        spec_jax.generate(t, [7] * n, 12, stop_at_eos=False)
    assert [k[4] for k in t.compiled if k[0] == "prefill"] == [192, 128]  # last used last


def test_layers_argument_is_checked(tmp_path):
    from spec_jax.target import arrange_layers

    with pytest.raises(spec_jax.SpecJaxError, match="scan, unrolled, packed or packed_f32"):
        arrange_layers({}, tiny_config(), "fast")


def test_heads_trained_on_a_packed_target_are_saved_plain(tmp_path):
    """Training binds plain matrices, and checkpoints never hold the panel layout (a head saved
    from a packed target once stored {'panels': ...} dicts that no loader could use)."""
    from spec_jax.train.loop import TrainConfig, feature_cache, train

    cfg = tiny_config(vocab_size=64, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    base = spec_jax.random_target(cfg, seed=1, scale=0.3)
    target = spec_jax.target.Target(cfg=cfg, params=pack_layers(base.params))
    assert target.layout == "packed"
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 64, 24).astype(np.int32) for _ in range(8)]
    toks, mask, feats, _ = feature_cache(target, seqs, [4] * 8, 24)
    data = {"tokens": toks, "mask": mask, "feats": feats, "aux": None}
    train(target, data, TrainConfig(method="eagle", steps=2, batch_size=4, seq_len=24),
          out_dir=tmp_path / "h", progress=False)
    loaded = spec_jax.load_draft(tmp_path / "h")
    assert loaded.params["layer"]["wq"].shape == (64, 64)
    assert loaded.params["fc_w"].shape == (128, 64)
    r = spec_jax.generate(target, [3, 5, 7], 8, draft=loaded, stop_at_eos=False)
    assert r.token_ids == spec_jax.generate(target, [3, 5, 7], 8, stop_at_eos=False).token_ids
