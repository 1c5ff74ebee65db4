"""Logits parity with transformers' PyTorch models on tiny random configs (float32, 1e-4)."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from spec_jax.cache import cache_for
from spec_jax.models.llama import causal_mask, forward
from tests._hf import assert_logits_match, ours, perturb_norms

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def hf_model(arch, tied):
    import transformers as tf

    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                  max_position_embeddings=256)
    if arch == "llama":
        cfg = tf.LlamaConfig(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, **common)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(sliding_window=None, **common)
        cls = tf.MistralForCausalLM
    else:
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    torch.manual_seed(0)
    return perturb_norms(cls(cfg).eval(), 0.1)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(arch, tied):
    model = hf_model(arch, tied)
    cfg, params = ours(model)
    assert cfg.tie_word_embeddings == tied
    assert (cfg.rope_scaling is not None) == (arch == "llama")
    assert cfg.attention_bias == (arch == "qwen2")
    assert_logits_match(model, cfg, params)


def test_incremental_decode_matches_full_forward():
    """Prefill + cached single-token steps give the same logits as one full forward."""
    from spec_jax.cache import commit

    model = hf_model("llama", False)
    cfg, params = ours(model)
    toks = jnp.asarray(np.random.RandomState(2).randint(0, 101, (1, 12)))
    full = forward(params, cfg, toks, jnp.arange(12)[None], cache_for(cfg, 1, 8), causal_mask(1, 12))
    cache = cache_for(cfg, 1, 32)
    out = forward(params, cfg, toks[:, :8], jnp.arange(8)[None], cache, causal_mask(1, 8))
    cache = commit(cache, out.k_new, out.v_new, jnp.arange(8)[None], jnp.arange(8)[None],
                   jnp.array([8]))
    for t in range(8, 12):
        step = forward(params, cfg, toks[:, t:t + 1], jnp.array([[t]]), cache, causal_mask(1, 1))
        np.testing.assert_allclose(np.asarray(step.logits[0, 0]), np.asarray(full.logits[0, t]),
                                   atol=1e-4)
        cache = commit(cache, step.k_new, step.v_new, jnp.array([[t]]), jnp.array([[0]]),
                       jnp.array([1]))
    assert int(cache.length[0]) == 12


def test_unrolled_layers_equal_scanned_layers():
    from spec_jax.models.llama import stack_layers, unstack_layers

    model = hf_model("qwen2", False)
    cfg, params = ours(model)
    toks = jnp.asarray(np.random.RandomState(3).randint(0, 101, (1, 9)))
    args = (toks, jnp.arange(9)[None], cache_for(cfg, 1, 8), causal_mask(1, 9))
    a = forward(params, cfg, *args, aux_layers=(0, 2))
    unrolled = unstack_layers(params)
    assert isinstance(unrolled["layers"], list) and len(unrolled["layers"]) == 3
    b = forward(unrolled, cfg, *args, aux_layers=(0, 2))
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.aux_hidden), np.asarray(b.aux_hidden), atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.k_new), np.asarray(b.k_new), atol=1e-5)
    restacked = stack_layers(unrolled)
    np.testing.assert_array_equal(np.asarray(restacked["layers"]["wq"]), np.asarray(params["layers"]["wq"]))


def test_rope_table_equals_rotation_computed_in_graph(monkeypatch):
    """Positions are rotated from a constant table; models with more positions than
    ROPE_TABLE_MAX compute cos/sin in-graph instead: both give the same rotation."""
    from spec_jax.models import llama

    cfg, _ = ours(hf_model("llama", False))  # Llama-3 scaled frequencies
    pos = jnp.asarray(np.random.RandomState(4).randint(0, cfg.max_position_embeddings, (2, 7)))
    table = llama.rope_table(pos, cfg)
    monkeypatch.setattr(llama, "ROPE_TABLE_MAX", 0)
    direct = llama.rope_table(pos, cfg)
    for a, b in zip(table[:2], direct[:2]):
        assert a.shape == (2, 7, 1, cfg.head_dim // 2)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    for r in (table, direct):  # the kernel's cos-then-sin rows
        both = np.concatenate([r.cos[:, :, 0], r.sin[:, :, 0]], -1)
        np.testing.assert_array_equal(np.asarray(r.cs), both)
