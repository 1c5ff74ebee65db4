"""Qwen3 targets (Qwen2's layout with a per-head RMSNorm of q and k): logits parity with
transformers on a tiny random config, in every layer layout, converted from disk, and lossless
speculative decoding on them."""
import json

import numpy as np
import pytest

import spec_jax
from spec_jax.target import arrange_layers
from tests._hf import TOL, assert_logits_match, ours, perturb_norms, reference_logits

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model():
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=24, tie_word_embeddings=True, max_position_embeddings=256,
                         rms_norm_eps=1e-6)
    torch.manual_seed(0)
    return perturb_norms(tf.Qwen3ForCausalLM(cfg).eval(), 0.3)  # q_norm, k_norm included


@pytest.mark.parametrize("layers", ["scan", "unrolled", "packed_f32"])
def test_qwen3_logits_match_transformers(model, layers):
    cfg, params = ours(model)
    assert cfg.family == "qwen3" and cfg.head_dim == 24 and not cfg.attention_bias
    assert params["layers"]["q_norm"].shape == (3, 24)
    assert_logits_match(model, cfg, arrange_layers(params, cfg, layers))


def test_qwen3_converts_and_decodes_losslessly(model, tmp_path):
    from spec_jax.convert.hf import convert_hf

    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3ForCausalLM"]
    convert_hf(tmp_path / "hf", tmp_path / "t")
    target = spec_jax.load_target(tmp_path / "t", layers="scan")
    ids = [5, 17, 3, 88, 41, 9]
    np.testing.assert_allclose(target.logits(ids), reference_logits(model, [ids])[0], atol=TOL,
                               rtol=0)
    plain = spec_jax.generate(target, ids, 8, stop_at_eos=False).token_ids
    heads = spec_jax.init_draft(target, "eagle", scale=0.3)
    r = spec_jax.generate(target, ids, 8, stop_at_eos=False, draft=heads, fallback=False)
    assert r.token_ids == plain


def test_a_qwen3_checkpoint_without_q_norm_is_refused(model, tmp_path):
    from safetensors.numpy import load_file, save_file

    from spec_jax.convert.hf import convert_hf
    from spec_jax.errors import SpecJaxError

    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    f = next((tmp_path / "hf").glob("*.safetensors"))
    state = load_file(str(f))
    del state["model.layers.1.self_attn.q_norm.weight"]
    save_file(state, str(f))
    with pytest.raises(SpecJaxError, match="q_norm"):
        convert_hf(tmp_path / "hf", tmp_path / "t")
    assert not (tmp_path / "t").exists()
