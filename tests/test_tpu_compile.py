"""The prefill and the draft-verify loop compiled for real TPU topologies on this CPU-only host
(libtpu's compiler, abstract devices and shapes: no TPU and no weights; spec_jax.plan), with the
Pallas (Mosaic) kernel as the attention, run per chip. A failure to compile is a failure, not a
skip. Programs are compiled once per module (`_compiled`) and shared by the tests that read them."""
import functools

import pytest

from spec_jax.config import ModelConfig
from spec_jax.plan import MOSAIC, abstract_heads, abstract_target, compile_plan, topology_mesh

# Llama-3-shaped (GQA, SwiGLU, llama3 RoPE), bfloat16, small enough to compile in seconds
CFG = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=4,
                  num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=8192,
                  dtype="bfloat16", rope_theta=500000.0,
                  rope_scaling=tuple(sorted({"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}.items())))
TREES = {"plain": None, "eagle": "dynamic:8,5,32", "eagle3": "dynamic:8,6,32", "mtp": None,
         "medusa": "medusa"}


def _weights_per_chip(model: int) -> float:
    c = CFG
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    split = c.num_layers * (attn + mlp) + 2 * c.vocab_size * c.hidden_size
    return 2 * split / model  # bfloat16; the norms are a rounding error


def _heads(mesh, method):
    if method == "plain":
        return None, ()
    return abstract_heads(CFG, method, abstract_target(CFG, mesh), mesh, TREES[method])


@functools.lru_cache(maxsize=None)
def _compiled(topology, data, model, method, batch=1, attn_impl="pallas"):
    """compile_plan's programs, compiled once for every test that asks for the same ones."""
    mesh = topology_mesh(topology, data=data, model=model)
    d, dp = _heads(mesh, method)
    return compile_plan(CFG, mesh, batch=batch, context=1024, drafter=d, dparams=dp,
                        attn_impl=attn_impl)


def _mosaic_line(hlo: str) -> str:
    return next(line for line in hlo.splitlines() if MOSAIC in line)


@pytest.mark.parametrize("method", list(TREES))
def test_every_drafter_compiles_for_v5e_2x2_with_the_pallas_kernel(method):
    r = _compiled("v5e:2x2", 1, 4, method)
    assert set(r) == {"prefill", "loop"}
    cache = 2 * CFG.num_layers * 1024 * CFG.num_kv_heads * CFG.head_dim * 2 / 4  # K+V, by KV head
    for c in r.values():
        assert c.flops > 0 and c.hlo  # compiled, with XLA's cost
        # each chip holds a quarter of the weights and of the cache (and its shards of the
        # heads): at least that, and well under one unsplit copy of the target
        assert _weights_per_chip(4) + cache <= c.argument_bytes < 0.5 * _weights_per_chip(1)
        # the attention is the Mosaic kernel, per chip (under shard_map): it reads the chip's
        # own KV head of the cache [B, KVH / 4, S, D], not a gathered copy
        assert c.mosaic_calls >= 1 and MOSAIC in c.hlo
        assert f"bf16[1,{CFG.num_kv_heads // 4},1024,{CFG.head_dim}]" in _mosaic_line(c.hlo)
        assert c.fusions > 0 and c.custom_calls >= c.mosaic_calls
    assert "all-reduce" in r["loop"].hlo  # XLA partitioned the model over the 4 chips


def test_xla_attention_stays_an_option():
    pallas, xla = _compiled("v5e:2x2", 1, 4, "plain"), _compiled("v5e:2x2", 1, 4, "plain",
                                                                  attn_impl="xla")
    for name, c in xla.items():
        assert c.mosaic_calls == 0 and MOSAIC not in c.hlo and c.fusions > 0
        # the same weights and cache either way
        assert c.argument_bytes == pallas[name].argument_bytes


# v5e and v6e slices of 4 and 8 chips (and a v5p cube) with a tree drafter or plain decoding
SLICES = [("v5e:2x4", 2, 4, "eagle3"), ("v6e:2x2", 1, 4, "eagle3"), ("v6e:2x4", 2, 4, "plain"),
          ("v6e:2x4", 2, 4, "eagle3"), ("v5p:2x2x2", 2, 4, "plain")]


@pytest.mark.parametrize("topology,data,model,method", SLICES)
def test_data_and_model_parallel_slices_compile(topology, data, model, method):
    r = _compiled(topology, data, model, method, batch=2 * data)
    for c in r.values():
        assert c.argument_bytes >= _weights_per_chip(model)
        # the Pallas kernel per chip: its 2 rows (of 2 x data) and its KV head (of 4)
        assert c.mosaic_calls >= 1
        assert f"bf16[2,{CFG.num_kv_heads // model},1024,{CFG.head_dim}]" in _mosaic_line(c.hlo)


def test_an_unknown_topology_is_a_clear_error():
    from spec_jax.errors import SpecJaxError

    with pytest.raises(SpecJaxError, match="v5e:2x2"):
        topology_mesh("v99:1x1")
    with pytest.raises(SpecJaxError, match="does not cover"):
        topology_mesh("v5e:2x2", data=3, model=1)


def _plan_cli(tmp_path, *args):
    import json
    import os
    import subprocess
    import sys

    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": CFG.vocab_size,
          "hidden_size": CFG.hidden_size, "intermediate_size": CFG.intermediate_size,
          "num_hidden_layers": CFG.num_layers, "num_attention_heads": CFG.num_heads,
          "num_key_value_heads": CFG.num_kv_heads, "head_dim": CFG.head_dim,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "spec_jax.cli", "plan", "--config", str(tmp_path),
                        *args, "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_plan_answers_fits_and_what_would_fit(tmp_path):
    r = _plan_cli(tmp_path, "--topology", "v5e:2x2", "--mesh", "data=1,model=4", "--context",
                  "1024", "--draft", "eagle3", "--tree", "dynamic:8,6,32")
    assert r["compiled"] and r["fits"] and r["per_chip_bytes"] < r["hbm_bytes"]
    assert 0 < r["plain_step_seconds"] <= r["tree_step_seconds"] and r["tree_tokens"] == 32
    assert r["attention"] == "pallas"  # compiled with the Mosaic kernel, counted per program
    for run in ("plain", "tree"):
        for program in ("prefill", "loop"):
            counts = r["hlo_counts"][run][program]
            assert counts["fusions"] > 0 and counts["custom_calls"] >= counts["mosaic_calls"] >= 1
    # a context whose cache cannot fit 16 GB chips: an answer, not a crash
    big = _plan_cli(tmp_path, "--topology", "v5e:2x2", "--batch", "64", "--context", "131072")
    assert big["fits"] is False and not big["compiled"] and big["would_fit"]
