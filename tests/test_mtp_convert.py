"""`spec-jax convert` of a target that ships MTP layers (MiMo's `model.mtp_layers.{i}.*` on a
Qwen2-shaped target, DeepSeek-V3's `model.layers.{L+i}.*` on a Llama-shaped one): tiny random
checkpoints written here with safetensors under exactly the published tensor names, sharded with
an index as published targets are. The converted target runs `draft="mtp"` with no separate
import: greedy output equals plain decoding, and its heads are those `import_heads("mtp", ...)`
makes from the same files."""
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import spec_jax
from spec_jax.cli import main
from spec_jax.convert.hf import convert_hf
from spec_jax.errors import SpecJaxError

H, I_, V, L, NH, NKV, HD = 32, 64, 64, 2, 4, 2, 8
PROMPT = [3, 17, 5, 60, 22, 9]
SEQ = PROMPT + [41, 0, 33, 12, 7, 51]


def _layer(r, pre, bias):
    a, m = pre + "self_attn.", pre + "mlp."
    sd = {a + "q_proj.weight": r(NH * HD, H), a + "k_proj.weight": r(NKV * HD, H),
          a + "v_proj.weight": r(NKV * HD, H), a + "o_proj.weight": r(H, NH * HD),
          m + "gate_proj.weight": r(I_, H), m + "up_proj.weight": r(I_, H),
          m + "down_proj.weight": r(H, I_), pre + "input_layernorm.weight": 1 + r(H, s=0.1),
          pre + "post_attention_layernorm.weight": 1 + r(H, s=0.1)}
    if bias:
        sd.update({a + "q_proj.bias": r(NH * HD), a + "k_proj.bias": r(NKV * HD),
                   a + "v_proj.bias": r(NKV * HD)})
    return sd


def make_target(d, kind: str, seed=0):
    """kind: "mimo" (MiMoForCausalLM, Qwen2 layers with q/k/v biases, one MTP layer),
    "deepseek" (LlamaForCausalLM with DeepSeek-V3's MTP layer names) or "none" (no MTP)."""
    g = np.random.default_rng(seed)
    r = lambda *shape, s=0.3: (g.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    bias = kind == "mimo"
    sd = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + r(H, s=0.1),
          "lm_head.weight": r(V, H)}
    for i in range(L):
        sd.update(_layer(r, f"model.layers.{i}.", bias))
    conf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": I_, "num_attention_heads": NH, "num_key_value_heads": NKV,
            "num_hidden_layers": L, "vocab_size": V, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32"}
    if kind == "mimo":
        p = "model.mtp_layers.0."
        sd.update(_layer(r, p, bias=True))
        sd.update({p + "token_layernorm.weight": 1 + r(H, s=0.1),
                   p + "hidden_layernorm.weight": 1 + r(H, s=0.1),
                   p + "input_proj.weight": r(H, 2 * H, s=0.2),
                   p + "final_layernorm.weight": 1 + r(H, s=0.1)})
        conf.update(architectures=["MiMoForCausalLM"], model_type="mimo", attention_bias=True,
                    num_nextn_predict_layers=1)
    elif kind == "deepseek":
        p = f"model.layers.{L}."
        sd.update(_layer(r, p, bias=False))
        sd.update({p + "enorm.weight": 1 + r(H, s=0.1), p + "hnorm.weight": 1 + r(H, s=0.1),
                   p + "eh_proj.weight": r(H, 2 * H, s=0.2),
                   p + "shared_head.norm.weight": 1 + r(H, s=0.1),
                   p + "shared_head.head.weight": sd["lm_head.weight"].copy()})
        conf["num_nextn_predict_layers"] = 1
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(conf))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, ns in shards.items():
        save_file({n: sd[n] for n in ns}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    return d


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for kind in ("mimo", "deepseek", "none"):
        src = make_target(root / f"{kind}-hf", kind)
        out[kind] = (src, convert_hf(src, root / kind))
    return out


@pytest.mark.parametrize("kind", ["mimo", "deepseek"])
def test_converted_target_drafts_with_its_own_mtp_layers_losslessly(converted, kind):
    src, ck = converted[kind]
    assert (ck / "mtp" / "spec_jax.json").is_file()
    target = spec_jax.load_target(ck, layers="scan")
    plain = spec_jax.generate(target, PROMPT, 12, stop_at_eos=False).token_ids
    r = spec_jax.generate(target, PROMPT, 12, stop_at_eos=False, draft="mtp", fallback=False)
    assert r.stats["tree_tokens"] > 1 and r.stats["plain_steps"] == 0
    assert r.token_ids == plain


@pytest.mark.parametrize("kind", ["mimo", "deepseek"])
def test_own_mtp_heads_are_the_imported_ones(converted, kind):
    src, ck = converted[kind]
    target = spec_jax.load_target(ck, layers="scan")
    from spec_jax.drafting import own_heads

    own = own_heads(target, "mtp")
    assert own is own_heads(target, "mtp")  # loaded once per target
    imported = spec_jax.import_heads("mtp", src, target)
    assert own.hparams["num_modules"] == 1 and own.hparams["features"] == "post"
    got, want = (spec_jax.draft_logits(target, h, SEQ) for h in (own, imported))
    assert got.shape == (len(SEQ) - 1, V) and np.abs(want).max() > 0.1
    np.testing.assert_array_equal(got, want)


def test_mimo_is_a_qwen2_target_with_biases(converted):
    """MiMo's decoder is Qwen2's: q/k/v biases converted, logits of an independent forward."""
    from safetensors.numpy import load_file

    src, ck = converted["mimo"]
    target = spec_jax.load_target(ck, layers="scan")
    assert target.cfg.family == "qwen2" and target.cfg.attention_bias
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    np.testing.assert_array_equal(np.asarray(target.params["layers"]["bq"][1]),
                                  sd["model.layers.1.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(np.asarray(target.params["layers"]["wq"][1]),
                                  sd["model.layers.1.self_attn.q_proj.weight"].T)


def test_bfloat16_conversion_keeps_heads_that_fit_the_target(converted, tmp_path):
    src, _ = converted["mimo"]
    ck = convert_hf(src, tmp_path / "bf16", dtype="bfloat16")
    target = spec_jax.load_target(ck, layers="scan")
    from spec_jax.drafting import own_heads

    heads = own_heads(target, "mtp")
    heads.check_target(target)
    assert {str(a.dtype) for a in jax.tree.leaves(heads.params)} == {"bfloat16"}


def test_a_target_without_mtp_layers_says_so(converted, tmp_path):
    _, ck = converted["none"]
    assert not (ck / "mtp").exists()
    target = spec_jax.load_target(ck, layers="scan")
    with pytest.raises(SpecJaxError, match="has no MTP layers of its own") as e:
        spec_jax.generate(target, PROMPT, 4, draft="mtp")
    assert "\n" not in str(e.value)
    with pytest.raises(SpecJaxError, match="has no MTP layers"):
        spec_jax.generate(spec_jax.random_target(target.cfg), PROMPT, 4, draft="mtp")


def test_cli_convert_no_mtp_leaves_them_out(converted, tmp_path):
    src, _ = converted["deepseek"]
    assert main(["convert", "--hf", str(src), "--out", str(tmp_path / "o"), "--no-mtp"]) == 0
    assert (tmp_path / "o" / "params").is_dir() and not (tmp_path / "o" / "mtp").exists()


def test_mtp_layers_that_do_not_fit_are_refused_and_nothing_is_written(tmp_path):
    """A DeepSeek shared head that is not the target's LM head: one line, no output."""
    from safetensors.numpy import load_file

    src = make_target(tmp_path / "hf", "deepseek")
    f = next(f for f in sorted(src.glob("*.safetensors"))
             if f"model.layers.{L}.shared_head.head.weight" in load_file(str(f)))
    sd = load_file(str(f))
    sd[f"model.layers.{L}.shared_head.head.weight"] = sd[
        f"model.layers.{L}.shared_head.head.weight"] + 1
    save_file(sd, str(f))
    with pytest.raises(SpecJaxError, match="not the target's LM head.*--no-mtp") as e:
        convert_hf(src, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_mimo_logits_match_transformers_qwen2(converted):
    """MiMo's decoder is transformers' Qwen2: the converted target's logits equal Qwen2's forward
    of the same weights (the MTP layers are the only tensors Qwen2 does not have)."""
    torch = pytest.importorskip("torch")
    import transformers as tf
    from safetensors.numpy import load_file

    from tests._hf import TOL, reference_logits

    src, ck = converted["mimo"]
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    conf = json.loads((src / "config.json").read_text())
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{k: conf[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
        "max_position_embeddings", "tie_word_embeddings")})).eval()
    mine = {k: torch.tensor(v) for k, v in sd.items() if not k.startswith("model.mtp_layers.")}
    assert set(mine) == set(model.state_dict())
    model.load_state_dict(mine)
    target = spec_jax.load_target(ck, layers="scan")
    ref = reference_logits(model, [SEQ])[0]
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(target.logits(SEQ), ref, atol=TOL, rtol=0)


def _rewrite(src, edit):
    """The checkpoint at `src` with its tensors changed by `edit(dict)`, as one file."""
    from safetensors.numpy import load_file

    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
        f.unlink()
    (src / "model.safetensors.index.json").unlink()
    edit(sd)
    save_file(sd, str(src / "model.safetensors"))


def test_mla_attention_in_an_mtp_layer_is_named_in_one_line(converted, tmp_path):
    """DeepSeek-V3's own MTP layers use multi-head latent attention: refused, naming a tensor."""
    src = make_target(tmp_path / "hf", "deepseek")
    p = f"model.layers.{L}.self_attn."

    def mla(sd):
        for n in ("q_proj", "k_proj", "v_proj"):
            del sd[p + n + ".weight"]
        g = np.random.default_rng(1)
        sd.update({p + n: g.standard_normal(s).astype(np.float32) for n, s in (
            ("q_a_proj.weight", (16, H)), ("q_a_layernorm.weight", (16,)),
            ("q_b_proj.weight", (NH * HD, 16)), ("kv_a_proj_with_mqa.weight", (20, H)),
            ("kv_a_layernorm.weight", (16,)), ("kv_b_proj.weight", (NH * 2 * HD, 16)))})

    _rewrite(src, mla)
    target = spec_jax.load_target(converted["deepseek"][1], layers="scan")
    with pytest.raises(SpecJaxError, match=rf"tensor {p}kv_a_layernorm\.weight .*latent") as e:
        spec_jax.import_heads("mtp", src, target, out=tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    with pytest.raises(SpecJaxError, match="latent attention.*--no-mtp") as e:
        convert_hf(src, tmp_path / "t")
    assert "\n" not in str(e.value) and not (tmp_path / "t").exists()


def test_mixture_of_experts_in_an_mtp_layer_is_named_in_one_line(tmp_path):
    p = "model.mtp_layers.0.mlp."
    src = make_target(tmp_path / "hf", "mimo")

    def moe(sd):
        for n in ("gate_proj", "up_proj", "down_proj"):
            del sd[p + n + ".weight"]
        g = np.random.default_rng(2)
        sd[p + "gate.weight"] = g.standard_normal((2, H)).astype(np.float32)
        for e in ("experts.0.", "experts.1.", "shared_experts."):
            sd.update({p + e + "gate_proj.weight": g.standard_normal((I_, H)).astype(np.float32),
                       p + e + "up_proj.weight": g.standard_normal((I_, H)).astype(np.float32),
                       p + e + "down_proj.weight": g.standard_normal((H, I_)).astype(np.float32)})

    _rewrite(src, moe)
    with pytest.raises(SpecJaxError, match=rf"tensor {p}experts\.0\.down_proj\.weight .*mixture"
                                           r"-of-experts.*--no-mtp") as e:
        convert_hf(src, tmp_path / "t")
    assert "\n" not in str(e.value) and not (tmp_path / "t").exists()
    assert main(["convert", "--hf", str(src), "--out", str(tmp_path / "t"), "--no-mtp"]) == 0
