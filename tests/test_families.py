"""The target families people serve, each as a tiny random transformers model saved to disk
(`save_pretrained`, the config.json transformers writes) and converted with `spec-jax convert`:
Llama-3.1 (llama3 rope scaling), Qwen2/2.5 (q/k/v biases, tied embeddings) and Mistral. The
converted target's logits equal transformers' within 1e-4 (float32), and greedy speculative
decoding with random heads on it equals plain greedy decoding. Qwen3 is tested the same way in
test_qwen3.py, MiMo (Qwen2 + MTP layers) in test_mtp_convert.py.

Each family is built, converted and loaded once (a module fixture); its programs compile once."""
import json

import numpy as np
import pytest

import spec_jax
from tests._hf import TOL, perturb_norms, reference_logits

torch = pytest.importorskip("torch")

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {  # name -> (transformers class, its config's own fields, the heads drafting on it)
    "llama-3.1": ("Llama", dict(rope_scaling=LLAMA31_ROPE, rope_theta=500000.0,
                                tie_word_embeddings=False), "eagle3"),
    "qwen2.5": ("Qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0), "eagle"),
    "mistral": ("Mistral", dict(sliding_window=None, tie_word_embeddings=False), "medusa"),
}
IDS = np.random.RandomState(5).randint(0, COMMON["vocab_size"], 40).tolist()  # past 16 positions
PROMPT = IDS[:6]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """name -> (the transformers model, our converted target), built on first use."""
    import transformers as tf

    from spec_jax.convert.hf import convert_hf

    built = {}

    def get(name):
        if name not in built:
            cls, own, _ = FAMILIES[name]
            cfg = getattr(tf, f"{cls}Config")(**COMMON, **own)
            torch.manual_seed(0)
            model = perturb_norms(getattr(tf, f"{cls}ForCausalLM")(cfg).eval(), 0.1)
            with torch.no_grad():  # sharper attention: positions (rope) then move the logits
                for n, prm in model.named_parameters():
                    if n.endswith(("q_proj.weight", "k_proj.weight")):
                        prm.mul_(4.0)
            root = tmp_path_factory.mktemp(name)
            model.save_pretrained(root / "hf", safe_serialization=True)
            convert_hf(root / "hf", root / "target")
            built[name] = (model, spec_jax.load_target(root / "target", layers="scan"))
        return built[name]

    yield get
    for _, target in built.values():  # compiled programs go with the module
        target.compiled.clear()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_logits_match_transformers(family, name):
    model, target = family(name)
    conf = json.loads((target.path / "config.json").read_text())
    assert conf["architectures"] == [f"{FAMILIES[name][0]}ForCausalLM"]
    cfg = target.cfg
    assert cfg.tie_word_embeddings == (name == "qwen2.5")
    assert cfg.attention_bias == (name == "qwen2.5")
    assert (cfg.rope_scaling is not None) == (name == "llama-3.1")
    ref = reference_logits(model, [IDS])[0]
    assert np.abs(ref).max() > 0.1
    if cfg.rope_scaling is not None:  # the scaling matters here: unscaled logits differ
        import transformers as tf

        assert cfg.rope_scaling_dict["rope_type"] == "llama3"
        plain = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, rope_theta=500000.0)).eval()
        plain.load_state_dict(model.state_dict())
        assert np.abs(reference_logits(plain, [IDS])[0] - ref).max() > 30 * TOL
    np.testing.assert_allclose(target.logits(IDS), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_speculative_decoding_with_random_heads_is_plain_decoding(family, name):
    _, target = family(name)
    heads = spec_jax.init_draft(target, FAMILIES[name][2], scale=0.3)
    plain = spec_jax.generate(target, PROMPT, 10, stop_at_eos=False).token_ids
    r = spec_jax.generate(target, PROMPT, 10, stop_at_eos=False, draft=heads, fallback=False)
    assert r.stats["tree_tokens"] > 1 and r.stats["plain_steps"] == 0
    assert r.token_ids == plain


def test_a_sliding_window_caps_positions_and_experts_are_refused():
    from spec_jax.config import ModelConfig
    from spec_jax.errors import SpecJaxError

    base = dict(architectures=["MistralForCausalLM"], vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32768)
    with pytest.warns(UserWarning, match="sliding_window=4096"):
        assert ModelConfig.from_hf_dict({**base, "sliding_window": 4096}).max_position_embeddings == 4096
    assert ModelConfig.from_hf_dict({**base, "sliding_window": None}).max_position_embeddings == 32768
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_hf_dict(qwen).max_position_embeddings == 32768  # use_sliding_window off
    with pytest.raises(SpecJaxError, match="num_local_experts=8"):
        ModelConfig.from_hf_dict({**base, "num_local_experts": 8})
