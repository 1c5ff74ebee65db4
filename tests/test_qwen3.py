"""Qwen3 targets (Qwen2's layout with a per-head RMSNorm of q and k): logits parity with
transformers on a tiny random config, in every layer layout, converted from disk, and lossless
speculative decoding on them."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax
from spec_jax.cache import cache_for
from spec_jax.config import ModelConfig
from spec_jax.convert.hf import params_from_hf
from spec_jax.models.llama import causal_mask, forward
from spec_jax.target import arrange_layers

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model():
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=24, tie_word_embeddings=True, max_position_embeddings=256,
                         rms_norm_eps=1e-6)
    torch.manual_seed(0)
    m = tf.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random, non-trivial norms (q_norm, k_norm included)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return m


def _ours(model):
    d = model.config.to_dict()
    d["architectures"] = ["Qwen3ForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return cfg, params_from_hf(state, cfg)


@pytest.mark.parametrize("layers", ["scan", "unrolled", "packed_f32"])
def test_qwen3_logits_match_transformers(model, layers):
    cfg, params = _ours(model)
    assert cfg.family == "qwen3" and cfg.head_dim == 24 and not cfg.attention_bias
    assert params["layers"]["q_norm"].shape == (3, 24)
    params = arrange_layers(params, cfg, layers)
    toks = np.random.RandomState(1).randint(0, 101, (2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(toks)).logits.numpy()
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    out = forward(params, cfg, jnp.asarray(toks), pos, cache_for(cfg, 2, 8), causal_mask(2, 40))
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=0)


def test_qwen3_converts_and_decodes_losslessly(model, tmp_path):
    from spec_jax.convert.hf import convert_hf

    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3ForCausalLM"]
    convert_hf(tmp_path / "hf", tmp_path / "t")
    target = spec_jax.load_target(tmp_path / "t", layers="scan")
    ids = [5, 17, 3, 88, 41, 9]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()[0]
    np.testing.assert_allclose(target.logits(ids), ref, atol=1e-4, rtol=0)
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
