"""Plain decoding on a tiny random model: the jitted loop equals naive recomputation."""
import numpy as np
import pytest

import spec_jax
from spec_jax.errors import SpecJaxError
from tests.conftest import tiny_config


def naive_greedy(target, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(target.logits(ids)[-1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("plen", [1, 7, 64, 65])
def test_plain_greedy_matches_naive_recompute(tiny_target, plen):
    prompt = list(np.random.RandomState(plen).randint(0, 64, plen))
    r = spec_jax.generate(tiny_target, prompt, max_new_tokens=12, stop_at_eos=False)
    assert r.token_ids == naive_greedy(tiny_target, prompt, 12)
    assert r.stats["new_tokens"] == 12
    assert r.stats["target_calls"] == 12  # prefill + 11 single-token steps
    assert r.stats["finish_reason"] == "length"


def test_batch_rows_with_different_lengths_match_single_rows(tiny_target):
    prompts = [[1, 2, 3], list(range(5, 30)), [9]]
    batch = spec_jax.generate_batch(tiny_target, prompts, max_new_tokens=10, stop_at_eos=False)
    for p, r in zip(prompts, batch):
        assert r.token_ids == spec_jax.generate(tiny_target, p, 10, stop_at_eos=False).token_ids


def test_stops_at_eos_and_reports_stop():
    cfg = tiny_config(eos_token_ids=(0,))
    target = spec_jax.random_target(cfg, seed=0, scale=0.3)
    prompt = [3, 4, 5]
    free = spec_jax.generate(target, prompt, 40, stop_at_eos=False).token_ids
    target_eos = int(free[5])
    target2 = spec_jax.random_target(tiny_config(eos_token_ids=(target_eos,)), seed=0, scale=0.3)
    r = spec_jax.generate(target2, prompt, 40)
    cut = free.index(target_eos) + 1
    assert r.token_ids == free[:cut]
    assert r.stats["finish_reason"] == "stop"


def test_compiles_once_per_shape(tiny_target):
    spec_jax.generate(tiny_target, [1, 2, 3], 9)
    r = spec_jax.generate(tiny_target, [4, 5, 6, 7], 9)
    assert r.stats["compile_seconds"] == 0.0  # same prompt bucket and settings: no recompilation


def test_keeps_the_most_recently_used_compiled_loops(monkeypatch):
    """A long process (a calibrating bench) must not keep every loop it compiled: each holds ~1 000
    of the process's 65 530 memory maps."""
    import importlib

    monkeypatch.setattr(importlib.import_module("spec_jax.engine"), "MAX_LOOPS", 2)
    t = spec_jax.random_target(tiny_config(), seed=0)
    for n in (3, 40, 3, 70):  # the output length, rounded up to 32, is static: one loop each
        spec_jax.generate(t, [1, 2], n, stop_at_eos=False)
    kept = [k[2].out_len for k in t.compiled if k[0] == "loop"]
    assert kept == [32, 96]  # 64 was the least recently used when 96 came
    r = spec_jax.generate(t, [1, 2], 17, stop_at_eos=False)  # shares the loop of 3 tokens
    assert r.stats["compile_seconds"] == 0.0 and len(r.token_ids) == 17


def test_prompts_of_other_lengths_reuse_the_compiled_loop():
    """Only the prefill compiles per 64-token prompt bucket; the loop depends on the cache's
    slots (a multiple of 512), so a new prompt length does not compile every drafter again."""
    t = spec_jax.random_target(tiny_config(), seed=0)
    for n in (3, 70, 150):
        r = spec_jax.generate(t, [1 + i % 60 for i in range(n)], 8, draft="ngram", stop_at_eos=False)
        assert len(r.token_ids) == 8
    kinds = [k[0] for k in t.compiled if isinstance(k, tuple)]
    assert kinds.count("prefill") == 3 and kinds.count("loop") == 1


def test_sampling_is_seeded(tiny_target):
    a = spec_jax.generate(tiny_target, [1, 2], 16, temperature=1.0, seed=3).token_ids
    b = spec_jax.generate(tiny_target, [1, 2], 16, temperature=1.0, seed=3).token_ids
    c = spec_jax.generate(tiny_target, [1, 2], 16, temperature=1.0, seed=4).token_ids
    assert a == b and a != c


def test_bad_input_raises_clear_errors(tiny_target):
    with pytest.raises(SpecJaxError, match="max_new_tokens"):
        spec_jax.generate(tiny_target, [1], 0)
    with pytest.raises(SpecJaxError, match="token ids"):
        spec_jax.generate(tiny_target, [1, 999], 4)
    with pytest.raises(SpecJaxError, match="tokenizer"):
        spec_jax.generate(tiny_target, "hello", 4)
    with pytest.raises(SpecJaxError, match="unknown draft"):
        spec_jax.generate(tiny_target, [1], 4, draft="nonsense")
    with pytest.raises(SpecJaxError, match="temperature must be one number or one per prompt: got .* for 2 prompts"):
        spec_jax.generate_batch(tiny_target, [[1], [2]], 4, temperature=[0.5, 0.5, 0.5])
    with pytest.raises(SpecJaxError, match="top_p in"):
        spec_jax.generate_batch(tiny_target, [[1], [2]], 4, temperature=0.5, top_p=[0.9, 0.0])
    with pytest.raises(SpecJaxError, match="temperature must be >= 0"):
        spec_jax.generate_batch(tiny_target, [[1], [2]], 4, temperature=[0.5, float("nan")])


def test_a_row_with_its_own_seed_samples_as_it_does_alone(tiny_target, heads_eagle):
    """Per-prompt seeds: each row of a sampled batch (other rows, other settings beside it) gives
    what `generate` gives for its prompt and seed alone, with plain decoding and with a tree."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    for draft, tree in [(None, None), (heads_eagle, "dynamic:3,3,8")]:
        rows = spec_jax.generate_batch(tiny_target, prompts, 12, temperature=[0.9, 0.0, 1.2],
                                       top_p=[1.0, 1.0, 0.8], seed=[11, 12, 13], draft=draft,
                                       tree=tree, stop_at_eos=False)
        for p, t, tp, s, r in zip(prompts, [0.9, 0.0, 1.2], [1.0, 1.0, 0.8], [11, 12, 13], rows):
            alone = spec_jax.generate(tiny_target, p, 12, temperature=t, top_p=tp, seed=s,
                                      draft=draft, tree=tree, stop_at_eos=False)
            assert r.token_ids == alone.token_ids, (draft, p)
    with pytest.raises(SpecJaxError, match="seed must be one integer or one per prompt"):
        spec_jax.generate_batch(tiny_target, [[1], [2]], 4, temperature=0.5, seed=[1, 2, 3])


def test_each_row_stops_at_its_own_max_new_tokens(tiny_target, heads_eagle):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    for draft, tree in [(None, None), (heads_eagle, "dynamic:3,3,8")]:
        rows = spec_jax.generate_batch(tiny_target, prompts, [3, 17, 8], draft=draft, tree=tree,
                                       stop_at_eos=False)
        for p, n, r in zip(prompts, [3, 17, 8], rows):
            alone = spec_jax.generate(tiny_target, p, n, draft=draft, tree=tree, stop_at_eos=False)
            assert r.token_ids == alone.token_ids and len(r.token_ids) == n
            assert r.stats["finish_reason"] == "length"
    with pytest.raises(SpecJaxError, match="max_new_tokens must be one integer or one per prompt"):
        spec_jax.generate_batch(tiny_target, [[1], [2]], [4, 4, 4])
    with pytest.raises(SpecJaxError, match="at least 1"):
        spec_jax.generate_batch(tiny_target, [[1], [2]], [4, 0])


def test_a_batch_is_sized_for_its_commonest_sampling_setting():
    from spec_jax.generate import sizing_setting

    assert sizing_setting(np.zeros(3), np.ones(3)) == (0.0, 1.0)
    t = np.asarray([0.0, 0.7, 1.0, 1.0, 0.7, 0.7], np.float32)
    p = np.asarray([1.0, 0.9, 1.0, 1.0, 0.9, 0.9], np.float32)
    assert sizing_setting(t, p) == pytest.approx((0.7, 0.9))


@pytest.fixture(scope="module")
def heads_eagle(tiny_target):
    return spec_jax.init_draft(tiny_target, "eagle", seed=7, scale=0.3)


def test_matmul_precision_of_the_loop(tiny_target):
    """float32 targets compile their loop under "highest" (TF32 on GPUs broke plain/speculative
    equality); an explicit precision is its own compiled loop; bfloat16 keeps the default."""
    import dataclasses

    from spec_jax.step import loop_precision

    cfg = tiny_target.cfg
    assert loop_precision(cfg) == "highest"
    assert loop_precision(dataclasses.replace(cfg, dtype="bfloat16")) == "default"
    assert loop_precision(cfg, "default") == "default"
    with pytest.raises(SpecJaxError, match="unknown precision 'fast'"):
        spec_jax.generate(tiny_target, [1, 2, 3], 4, precision="fast")
    t = spec_jax.random_target(cfg, seed=0, scale=0.3)
    a = spec_jax.generate(t, [1, 2, 3], 6, stop_at_eos=False)
    b = spec_jax.generate(t, [1, 2, 3], 6, stop_at_eos=False, precision="default")
    assert a.token_ids == b.token_ids  # the same float32 arithmetic on CPU
    assert sorted(k[-1] for k in t.compiled if k[0] == "loop") == ["default", "highest"]
