"""HF -> Orbax conversion and the CLI: round trip, sharded files, atomic/no-overwrite, clear errors."""
import json

import numpy as np
import pytest
import torch

import spec_jax
from spec_jax.cli import main
from spec_jax.convert.hf import convert_hf
from spec_jax.errors import SpecJaxError


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("hf")
    model.save_pretrained(d / "single", safe_serialization=True)
    model.save_pretrained(d / "sharded", safe_serialization=True, max_shard_size="20KB")
    return d, model


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_convert_round_trip_matches_transformers(hf_dir, tmp_path, layout):
    d, model = hf_dir
    if layout == "sharded":
        assert len(list((d / "sharded").glob("*.safetensors"))) > 1
    out = convert_hf(d / layout, tmp_path / "ck")
    target = spec_jax.load_target(out)
    ids = [1, 5, 9, 33, 70, 2]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(target.logits(ids), ref, atol=1e-4)


def test_convert_never_overwrites_without_force(hf_dir, tmp_path):
    d, _ = hf_dir
    out = tmp_path / "ck"
    convert_hf(d / "single", out)
    marker = (out / "spec_jax.json").read_text()
    with pytest.raises(SpecJaxError, match="already exists"):
        convert_hf(d / "single", out)
    convert_hf(d / "single", out, force=True)
    assert (out / "spec_jax.json").read_text() == marker
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary folders left behind


def test_unsupported_architecture_is_named(hf_dir, tmp_path):
    d, _ = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((d / "single" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecJaxError, match="LlamaForCausalLM"):
        convert_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["convert", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spec-jax: error:") and "config.json" in err[0]
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "spec-jax fetch" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--tree", "dynamic:8,5,32"]) == 2  # no --draft
    assert "--tree dynamic:8,5,32 needs a drafter: pass --draft" in capsys.readouterr().err
    assert main(["train", "--method", "eagle", "--own-lm-heads", "--data", str(tmp_path),
                 "--out", str(tmp_path / "h")]) == 2  # a medusa option, refused before any work
    err = capsys.readouterr().err
    assert "--own-lm-heads does not apply to --method eagle" in err and not (tmp_path / "h").exists()


def _tiny_checkpoint_with_smollm2_tokenizer(tmp_path, layers: int = 1):
    """A tiny random Llama with SmolLM2's tokenizer, converted: CLI runs in seconds."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import SMOLLM2

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      eos_token_id=2)
    hf = tmp_path / "hf"
    LlamaForCausalLM(cfg).save_pretrained(hf, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2 / name, hf / name)
    assert main(["convert", "--hf", str(hf), "--out", str(tmp_path / "ck")]) == 0
    return tmp_path / "ck"


def test_cli_generate_json(smollm2, tmp_path, capsys):
    """`generate --json` prints one JSON object."""
    ck = _tiny_checkpoint_with_smollm2_tokenizer(tmp_path)
    capsys.readouterr()
    assert main(["generate", "--model", str(ck), "--prompt", "hello",
                 "--max-new-tokens", "5", "--json", "--draft", "ngram"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"}
    assert 1 <= len(out["token_ids"]) <= 5 and out["stats"]["new_tokens"] == len(out["token_ids"])
    assert out["text"] == smollm2.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_params_saved_on_another_backend_load_here(tmp_path):
    """Heads trained on a CPU and served on a GPU: the checkpoint names a device not present here."""
    import jax
    import jax.numpy as jnp

    from spec_jax.io import load_params, save_params

    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    save_params(tmp_path / "p", jax.tree.map(jnp.asarray, params))  # jax arrays record a device
    sharding = tmp_path / "p" / "_sharding"
    sharding.write_text(sharding.read_text().replace("cpu:0", "cuda:0"))
    back = load_params(tmp_path / "p")
    np.testing.assert_array_equal(np.asarray(back["w"]), params["w"])
    np.testing.assert_array_equal(np.asarray(back["b"]), params["b"])


def test_cli_bench_writes_its_table_and_each_run_as_it_ends(smollm2, tmp_path, capsys):
    """`bench`: a Markdown table on stdout (with equality to plain decoding), results.json, the
    plots, and runs.jsonl, a line per (prompt, method) written as each run ends."""
    ck = _tiny_checkpoint_with_smollm2_tokenizer(tmp_path)
    prompts = tmp_path / "myset" / "question.jsonl"  # a file's set is named by its folder
    prompts.parent.mkdir()
    prompts.write_text("".join(json.dumps({"prompt": t, "category": c}) + "\n"
                               for t, c in [("hello", "a"), ("one two three", "b")]))
    out = tmp_path / "bench"
    capsys.readouterr()
    assert main(["bench", "--model", str(ck), "--drafts", "ngram", "--no-peers", "--prompts",
                 str(prompts), "--limit", "2", "--max-new-tokens", "6", "--out", str(out),
                 "--profile"]) == 0
    table = capsys.readouterr().out
    assert "| = plain |" in table and "transformers" not in table
    # --profile: each method's step on the first prompt, in draft / verify / bookkeeping shares
    assert "| method | ms per target call | τ | draft | verify | bookkeeping |" in table
    profiles = json.loads((out / "results.json").read_text())["profiles"]
    assert set(profiles) == {"plain", "ngram"}
    for name, p in profiles.items():
        assert sum(p["shares"].values()) == pytest.approx(1.0) and p["untraced_ms_per_call"] > 0
        assert f"| {name} | " in table
    assert profiles["plain"]["shares"]["draft"] == 0 < profiles["ngram"]["shares"]["draft"]
    assert "| myset | all | ngram |" in table and "| 2/2 |" in table  # greedy: lossless
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["method"], r["category"]) for r in runs] == [
        ("plain", "a"), ("ngram", "a"), ("plain", "b"), ("ngram", "b")]
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "runs.jsonl"}


def test_cli_bench_runs_transformers_peers_interleaved_with_its_own_methods(smollm2, tmp_path,
                                                                            capsys):
    """transformers' greedy, prompt-lookup and assisted generation (the target's first layers as
    the assistant) run on each prompt right after spec_jax's methods, so drift hits them alike;
    an assistant as deep as the target is refused before any run."""
    import shutil

    ck = _tiny_checkpoint_with_smollm2_tokenizer(tmp_path, layers=2)
    prompts = tmp_path / "myset" / "question.jsonl"
    prompts.parent.mkdir()
    prompts.write_text("".join(json.dumps({"prompt": t, "category": c}) + "\n"
                               for t, c in [("hello", "a"), ("one two three", "b")]))
    out = tmp_path / "bench"
    args = ["bench", "--model", str(ck), "--drafts", "ngram", "--prompts", str(prompts),
            "--limit", "2", "--max-new-tokens", "6", "--out", str(out)]
    assert main(args + ["--assistant-layers", "2"]) == 2
    assert "--assistant-layers must be 0 (no assisted generation) to 1" in capsys.readouterr().err
    assert not (out / "runs.jsonl").exists()
    shutil.copytree(tmp_path / "hf", ck / "hf")  # the peers read hf/, as `fetch` leaves it
    assert main(args + ["--assistant-layers", "1"]) == 0
    table = capsys.readouterr().out
    peers = ["transformers-greedy", "transformers-prompt_lookup", "transformers-assisted(1 layers)"]
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["method"], r["category"]) for r in runs] == [
        (m, c) for c in "ab" for m in ["plain", "ngram"] + peers]
    assert all(r["new_tokens"] >= 1 and r["wall"] > 0 for r in runs)
    assert all(f"| myset | all | {m} |" in table for m in peers)


def test_the_tokenizer_is_the_one_autotokenizer_builds(smollm2, tmp_path):
    """load_target builds a generic fast tokenizer directly (not through AutoTokenizer, which
    imports PyTorch first): the same ids, chat template, special tokens and decoding."""
    from transformers import AutoTokenizer

    ck = _tiny_checkpoint_with_smollm2_tokenizer(tmp_path)
    ours, auto = spec_jax.load_target(ck).tokenizer, AutoTokenizer.from_pretrained(str(ck))
    assert type(ours) is type(auto)
    for text in ["hello", "  two  spaces\nand a line", "émoji 🚀", "<|im_start|>user\nhi<|im_end|>", ""]:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        chat = [{"role": "user", "content": text}]
        assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
                == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
    ids = auto("hello world")["input_ids"] + [auto.eos_token_id, 1]
    assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)


def test_the_cli_keeps_compiled_programs_for_the_next_run(smollm2, tmp_path):
    """A command-line `generate` stores its compiled programs under $SPEC_JAX_CACHE/xla and the
    next run, which loads them, prints the same tokens; SPEC_JAX_XLA_CACHE=0 stores none."""
    import os
    import subprocess
    import sys

    ck = _tiny_checkpoint_with_smollm2_tokenizer(tmp_path)
    cmd = [sys.executable, "-m", "spec_jax.cli", "generate", "--model", str(ck), "--prompt",
           "hello", "--max-new-tokens", "6", "--json", "--draft", "ngram"]

    def run(cache, **env):
        env = {**os.environ, "SPEC_JAX_CACHE": str(cache), "SPEC_JAX_CPU_KERNELS": "0", **env}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout)["token_ids"]

    first = run(tmp_path / "cache")
    stored = list((tmp_path / "cache" / "xla").rglob("*"))
    assert any(p.is_file() for p in stored)
    assert run(tmp_path / "cache") == first
    assert run(tmp_path / "off", SPEC_JAX_XLA_CACHE="0") == first
    assert not (tmp_path / "off" / "xla").exists()


def test_enabling_the_compilation_cache_keeps_a_folder_already_set(tmp_path, monkeypatch):
    import jax

    from spec_jax import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert enable_compilation_cache() == str(tmp_path / "mine")
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("SPEC_JAX_XLA_CACHE", "0")
        assert enable_compilation_cache() is None and jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_distill_with_prompts_the_target_writes(smollm2, tmp_path):
    """`distill --data self`: the target writes each prompt after its chat template's user-turn
    header (Magpie), then answers it; prompt i depends only on (seed, i), so a set extended in
    two runs holds what one run writes, and its manifest says where the prompts came from."""
    from spec_jax.errors import SpecJaxError
    from spec_jax.train.distill import load_distill, self_prompts, user_turn_prefix

    ck = _tiny_checkpoint_with_smollm2_tokenizer(tmp_path)
    target = spec_jax.load_target(ck)
    prefix = user_turn_prefix(target)
    assert target.encode("hello")[:len(prefix)] == prefix
    assert target.decode(prefix).endswith("user\n")
    args = ["distill", "--model", str(ck), "--data", "self", "--max-new-tokens", "4",
            "--batch-size", "2"]
    assert main(args + ["--out", str(tmp_path / "a"), "--num-prompts", "2"]) == 0
    assert main(args + ["--out", str(tmp_path / "a"), "--num-prompts", "3"]) == 0
    seqs, plens, manifest = load_distill(tmp_path / "a")
    assert (manifest["samples"], manifest["mix"], manifest["prompt_source"]) == (3, "self", "self")
    assert (manifest["prompt_temperature"], manifest["prompt_max_tokens"]) == (1.0, 96)
    prompts = self_prompts(target, 0, 3, seed=0, batch_size=3)
    assert [p.text for p in prompts[1:]] == [p.text for p in self_prompts(target, 1, 2, 0, 2)]
    for p, s, n in zip(prompts, seqs, plens):
        assert p.text and s[:n].tolist() == target.encode(p.text)
    target.tokenizer.chat_template = None
    with pytest.raises(SpecJaxError, match="chat template"):
        user_turn_prefix(target)
