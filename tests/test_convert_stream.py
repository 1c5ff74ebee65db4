"""Streaming conversion: a sharded safetensors checkpoint is read block by block (rows of one
tensor at a time, never a whole tensor when blocks are small) and written into the stacked arrays
on disk; the parameters equal those of the in-memory conversion saved with `save_params`
(float32 and bfloat16, from float32, bfloat16 and float16 source tensors), and both on-disk
formats load."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import spec_jax
import spec_jax.convert.hf as hf
from spec_jax.convert.heads_io import Tensors
from spec_jax.io import load_params, save_params

H, I_, V, L, NH, NKV = 24, 40, 56, 3, 4, 2
HD = H // NH


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A Llama checkpoint in three shards with an index, its tensors in three dtypes."""
    g = np.random.default_rng(0)
    kinds = [np.float32, ml_dtypes.bfloat16, np.float16]
    sd = {}

    def put(name, *shape, one=False):
        a = g.standard_normal(shape).astype(np.float32) * 0.3 + (1 if one else 0)
        sd[name] = a.astype(kinds[len(sd) % 3])

    put("model.embed_tokens.weight", V, H)
    put("model.norm.weight", H, one=True)
    put("lm_head.weight", V, H)
    for i in range(L):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", H, one=True)
        put(p + "post_attention_layernorm.weight", H, one=True)
        put(p + "self_attn.q_proj.weight", NH * HD, H)
        put(p + "self_attn.k_proj.weight", NKV * HD, H)
        put(p + "self_attn.v_proj.weight", NKV * HD, H)
        put(p + "self_attn.o_proj.weight", H, NH * HD)
        put(p + "mlp.gate_proj.weight", I_, H)
        put(p + "mlp.up_proj.weight", I_, H)
        put(p + "mlp.down_proj.weight", H, I_)
    d = tmp_path_factory.mktemp("sharded") / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": I_,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": L,
        "vocab_size": V, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    names = list(sd)
    files = {f"model-0000{k + 1}-of-00003.safetensors": names[k::3] for k in range(3)}
    for f, ns in files.items():
        save_file({n: sd[n] for n in ns}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in files.items() for n in ns}}))
    return d, sd


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_conversion_gives_the_in_memory_params(sharded, tmp_path, monkeypatch, dtype):
    d, sd = sharded
    block = 3 * H * 4  # three rows of a [*, H] tensor: most tensors take several blocks
    monkeypatch.setattr(hf, "BLOCK_BYTES", block)
    read = []
    rows = Tensors.rows

    def spy(self, name, a, b):
        out = rows(self, name, a, b)
        read.append(out.size * max(out.dtype.itemsize, 4))
        return out

    monkeypatch.setattr(Tensors, "rows", spy)
    monkeypatch.setattr(Tensors, "get", lambda *a: pytest.fail("a whole tensor was read"))
    out = hf.convert_hf(d, tmp_path / "new", dtype=dtype)
    assert max(read) <= block and len(read) > len(sd)  # blocks, never more than BLOCK_BYTES

    cfg = spec_jax.load_target(out, layers="scan").cfg
    old = hf.params_from_hf(hf.read_safetensors(d), cfg)
    save_params(tmp_path / "old", old, dtype=dtype)  # the in-memory conversion, OCDBT on disk
    new, ref = load_params(out / "params"), load_params(tmp_path / "old")
    flat = lambda t: {jax.tree_util.keystr(k): v  # noqa: E731
                      for k, v in jax.tree_util.tree_leaves_with_path(t)}
    new, ref = flat(new), flat(ref)
    assert sorted(new) == sorted(ref)
    for k in ref:
        assert new[k].dtype == ref[k].dtype == np.dtype(dtype), k
        np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(ref[k]), err_msg=k)
    # against the files directly: a transposed stacked matrix and the LM head
    wq = np.asarray(new["['layers']['wq']"], np.float32)[2]
    want = sd["model.layers.2.self_attn.q_proj.weight"].astype(np.float32).T
    np.testing.assert_array_equal(wq, want.astype(dtype).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(new["['lm_head']"], np.float32),
                                  sd["lm_head.weight"].astype(np.float32).T.astype(dtype)
                                  .astype(np.float32))


def test_streamed_and_saved_checkpoints_give_the_same_target(sharded, tmp_path):
    """A streamed conversion and a checkpoint saved whole (the earlier format) load alike."""
    d, _ = sharded
    out = hf.convert_hf(d, tmp_path / "new")
    new = spec_jax.load_target(out, layers="scan")
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    save_params(old_dir / "params", hf.params_from_hf(hf.read_safetensors(d), new.cfg))
    for f in ("spec_jax.json", "config.json"):
        (old_dir / f).write_bytes((out / f).read_bytes())
    old = spec_jax.load_target(old_dir, layers="scan")
    ids = [1, 5, 9, 33, 50, 2]
    np.testing.assert_array_equal(new.logits(ids), old.logits(ids))
    assert new.fingerprint() == old.fingerprint()


def test_a_non_finite_block_is_refused_and_nothing_written(sharded, tmp_path):
    from safetensors.numpy import load_file

    from spec_jax.errors import SpecJaxError

    d, _ = sharded
    bad = tmp_path / "hf"
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    f = next(f for f in sorted(bad.glob("*.safetensors"))
             if "model.layers.1.mlp.up_proj.weight" in load_file(str(f)))
    t = load_file(str(f))
    t["model.layers.1.mlp.up_proj.weight"][7, 3] = np.nan
    save_file(t, str(f))
    with pytest.raises(SpecJaxError, match="model.layers.1.mlp.up_proj.weight holds NaN"):
        hf.convert_hf(bad, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# Orbax leaves a callback on its closed event loop when a read fails (as for any checkpoint)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_streamed_checkpoint_is_one_line(sharded, tmp_path, damage):
    from spec_jax.errors import SpecJaxError

    d, _ = sharded
    out = hf.convert_hf(d, tmp_path / "ck")
    files = [f for f in (out / "params" / "d").iterdir() if f.stat().st_size > 1000]
    assert files
    for f in files:
        if damage == "delete":
            f.unlink()
        else:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    with pytest.raises(SpecJaxError, match=f"checkpoint {out} is damaged: ") as e:
        spec_jax.load_target(out, layers="scan")
    assert "\n" not in str(e.value)


def test_load_checks_finiteness_a_block_of_rows_at_a_time():
    from spec_jax.io import _finite_in_blocks

    a = np.ones((50, 7), ml_dtypes.bfloat16)
    assert _finite_in_blocks(a, block_bytes=30)  # blocks of two rows
    a[49, 6] = np.inf  # in the last block only
    assert not _finite_in_blocks(a, block_bytes=30)
    a[49, 6], a[0, 0] = 1, np.nan
    assert not _finite_in_blocks(a, block_bytes=30)


def test_with_an_index_only_the_files_it_names_are_read(sharded, tmp_path):
    """A stray *.safetensors beside the indexed shards (a shard left from an older download)
    is not read: its tensors neither replace nor add to the indexed ones."""
    d, _ = sharded
    both = tmp_path / "hf"
    both.mkdir()
    for f in d.iterdir():
        (both / f.name).write_bytes(f.read_bytes())
    save_file({"model.norm.weight": np.zeros(H + 1, np.float32),
               f"model.layers.{L}.mlp.up_proj.weight": np.zeros((I_, H), np.float32)},
              str(both / "model-00004-of-00004.safetensors"))
    a = load_params(hf.convert_hf(both, tmp_path / "a") / "params")
    b = load_params(hf.convert_hf(d, tmp_path / "b") / "params")
    for (k, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a),
                              jax.tree_util.tree_leaves_with_path(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(k))
