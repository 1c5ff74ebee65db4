"""Datastore drafting (REST): the lookup tables on hand-built and random corpora, the tree syntax,
save/load, and greedy equality with plain decoding when its chain is grafted onto any drafter."""
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax
from spec_jax.errors import SpecJaxError
from spec_jax.heads.datastore import (
    Datastore,
    build_datastore,
    load_datastore,
    lookup,
    save_datastore,
)
from spec_jax.tree_spec import parse


def chains(ds: Datastore, contexts, depth=None):
    """The datastore's continuation of each context, as lists (in-graph lookup, batched)."""
    depth = depth or ds.depth
    s = max(len(c) for c in contexts)
    hist = np.zeros((len(contexts), s), np.int32)
    for i, c in enumerate(contexts):
        hist[i, :len(c)] = c
    tok, valid, _ = lookup(ds.tables(), jnp.asarray(hist), jnp.asarray([len(c) for c in contexts]),
                        ds.min_ngram, ds.max_ngram, depth)
    return [t[v].tolist() for t, v in zip(np.asarray(tok), np.asarray(valid))]


def corpus(*docs):
    return Datastore(tokens=np.concatenate([np.r_[d, -1] for d in docs]).astype(np.int32), info={},
                     min_ngram=2, max_ngram=3, depth=3)


def test_majority_continuation_and_longest_match_on_a_hand_built_corpus():
    ds = corpus([5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 9], [1, 6, 7, 3])
    assert chains(ds, [[0, 5, 6],  # (5, 6) three times: 7, then 8 in two of them, then the end
                       [1, 6, 7],  # (1, 6, 7) once beats (6, 7)'s majority 8
                       [0, 6, 7],  # (6, 7): 8 (twice) over 9 and 3
                       [2, 4],  # in no document
                       [6]]) == [[7, 8], [3], [8], [], []]  # [6]: shorter than min_ngram


def brute_force(docs, context, min_n, max_n, depth):
    """The datastore's definition, written plainly: the longest n with an occurrence, then per
    depth the most frequent next token (lowest id on ties) among occurrences agreeing so far."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        conts = [d[i + n:] for d in docs for i in range(len(d) - n)
                 if list(d[i:i + n]) == list(context[-n:])]
        if conts:
            out = []
            for k in range(depth):
                conts = [c for c in conts if len(c) > k]
                if not conts:
                    break
                tok = min(Counter(int(c[k]) for c in conts).items(), key=lambda kv: (-kv[1], kv[0]))[0]
                out.append(tok)
                conts = [c for c in conts if c[k] == tok]
            return out
    return []


def test_lookup_matches_a_brute_force_search_on_random_corpora():
    rng = np.random.RandomState(0)
    for trial in range(3):
        docs = [rng.randint(0, 4 + trial, rng.randint(1, 30)) for _ in range(20)]
        ds = Datastore(tokens=np.concatenate([np.r_[d, -1] for d in docs]).astype(np.int32), info={},
                       min_ngram=1 + trial % 2, max_ngram=4, depth=5)
        contexts = [list(rng.randint(0, 4 + trial, rng.randint(1, 8))) for _ in range(40)]
        want = [brute_force(docs, c, ds.min_ngram, ds.max_ngram, ds.depth) for c in contexts]
        assert chains(ds, contexts) == want
        assert sum(map(len, want)) > 40  # the corpora are small-vocabulary: most contexts match


@pytest.fixture(scope="module")
def own_output(tiny_target):
    """Prompts and the tiny target's greedy continuations of them: the datastore's corpus."""
    rng = np.random.RandomState(3)
    prompts = [list(np.tile(rng.randint(0, 64, 4), 3)) for _ in range(6)]
    outs = spec_jax.generate_batch(tiny_target, prompts, 40, stop_at_eos=False)
    return prompts, [p + r.token_ids for p, r in zip(prompts, outs)]


@pytest.fixture(scope="module")
def datastore(tiny_target, own_output):
    prompts, seqs = own_output
    return build_datastore(tiny_target, seqs, [len(p) for p in prompts], {"sources": ["test"]})


@pytest.mark.parametrize("method,tree", [("eagle", "dynamic:3,3,8+ngram:3+ds:4"),
                                         ("eagle", "chain:2+ds:6"), ("medusa", "chain:2+ds:3"),
                                         ("eagle", "plain+ds:8"), ("ngram", "+ds:5")])
def test_grafted_datastore_keeps_greedy_output_and_drafts_the_targets_own_words(
        tiny_target, own_output, datastore, method, tree):
    draft = "ngram" if method == "ngram" else spec_jax.init_draft(tiny_target, method, seed=7,
                                                                  scale=0.3)
    prompts, seqs = own_output
    rng = np.random.RandomState(1)
    fresh = [list(rng.randint(0, 64, 9))]  # not in the corpus
    for prompt in prompts[:2] + fresh:
        plain = spec_jax.generate(tiny_target, prompt, 30, stop_at_eos=False)
        spec = spec_jax.generate(tiny_target, prompt, 30, draft=draft, tree=tree,
                                 datastore=datastore, stop_at_eos=False)
        assert spec.token_ids == plain.token_ids, (method, tree, prompt)
    # on a prompt whose continuation is in the corpus, the datastore chain is accepted
    if tree.startswith(("plain", "chain:2+ds:6")):
        r = spec_jax.generate(tiny_target, prompts[0], 30, draft=draft, tree=tree,
                              datastore=datastore, stop_at_eos=False)
        assert r.stats["mean_accepted"] > 2.0, r.stats


def test_datastore_errors_name_the_fix(tiny_target, datastore, tmp_path):
    heads = spec_jax.init_draft(tiny_target, "eagle", seed=7, scale=0.3)
    with pytest.raises(SpecJaxError, match="pass datastore="):
        spec_jax.generate(tiny_target, [1, 2, 3], 4, draft=heads, tree="chain:2+ds:3")
    with pytest.raises(SpecJaxError, match="draft='ngram' or heads"):
        spec_jax.generate(tiny_target, [1, 2, 3], 4, datastore=datastore)
    with pytest.raises(SpecJaxError, match="at most 8 tokens"):
        spec_jax.generate(tiny_target, [1, 2, 3], 4, draft=heads, tree="chain:2+ds:9",
                          datastore=datastore)
    out = save_datastore(datastore, tmp_path / "ds")
    with pytest.raises(SpecJaxError, match="already exists"):
        save_datastore(datastore, out)
    back = load_datastore(out)
    np.testing.assert_array_equal(back.tokens, datastore.tokens)
    assert (back.depth, back.max_ngram, back.info["sources"]) == (8, 8, ["test"])
    for k, v in datastore.tables().items():
        np.testing.assert_array_equal(np.asarray(back.tables()[k]), np.asarray(v))
    other = spec_jax.random_target(tiny_target.cfg, seed=1, scale=0.3)
    with pytest.raises(SpecJaxError, match="another target"):
        spec_jax.generate(other, [1, 2, 3], 4, draft="ngram", datastore=back)
    with pytest.raises(SpecJaxError, match="spec-jax datastore"):
        load_datastore(tmp_path)


def test_replay_with_both_chains_accepts_the_longest():
    from spec_jax.sizing import replay_tau

    ranks = np.full((6, 2), -1)  # the tree accepts nothing
    ngram, ds = np.array([0, 3, 0, 0, 1, 0]), np.array([2, 0, 0, 1, 2, 0])
    # root 0: datastore 2 -> next root 3: datastore 1 -> root 5: nothing
    assert replay_tau([ranks], [[0]], [ngram], 3, [ds], 2) == pytest.approx((3 + 2 + 1) / 3)
    # n-gram alone: root 0 misses, root 1 takes 3 -> root 5
    assert replay_tau([ranks], [[0]], [ngram], 3) == pytest.approx((1 + 4 + 1) / 3)
    assert replay_tau([ranks], [[0]], [ngram], 0, [ds], 1) == pytest.approx((2 + 1 + 2 + 1) / 4)


def test_sizing_weighs_the_datastore_and_caches_per_datastore(tiny_target, datastore, own_output,
                                                              tmp_path, monkeypatch):
    from spec_jax.sizing import PLAIN, cached_tree, choose, size_tree, tree_tokens

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    heads = spec_jax.init_draft(tiny_target, "eagle", seed=1, scale=0.3)
    prompts, _ = own_output
    tree, report = size_tree(tiny_target, heads, prompts[:2], max_new_tokens=16, sizes=(2, 4, 8),
                             progress=False, datastore=datastore)
    with_ds = [c for c in report["curve"] if c["ds"]]
    assert with_ds and all(c["size"] in (2, 4, 8) for c in report["curve"])
    # the corpus holds these very continuations: the datastore chain is predicted to be accepted
    assert max(c["tau"] for c in with_ds) > max(c["tau"] for c in report["curve"] if not c["ds"])
    assert any(parse(m["tree"]).ds for m in report["measured"])  # and was run end to end
    assert tree == PLAIN or ("ds" in tree and tree_tokens(tree) <= 8)
    assert tree == choose(report["measured"])["tree"]
    assert cached_tree(tiny_target, heads, datastore=datastore) == tree
    assert cached_tree(tiny_target, heads) is None  # sized without a datastore: another entry
    for p in prompts[:2]:  # tree=None takes the cached choice, datastore chain included
        r = spec_jax.generate(tiny_target, p, 20, draft=heads, datastore=datastore, stop_at_eos=False)
        assert r.token_ids == spec_jax.generate(tiny_target, p, 20, stop_at_eos=False).token_ids


def test_cached_choice_follows_the_noise_rule(tiny_target, datastore, tmp_path, monkeypatch):
    """An entry cached before the noise rule (a datastore tree ahead by 2 %) reads back as the
    choice without the datastore."""
    from spec_jax.sizing import _store, cached_tree, calibration_key

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    heads = spec_jax.init_draft(tiny_target, "eagle", seed=1, scale=0.3)
    ds = {"base": [[0]], "ngram": 2, "ds": 4}
    ngram = {"base": [[0], [0, 0]], "ngram": 4, "ds": 0}
    measured = [{"tree": t, "tokens_per_second": v, "runs_tokens_per_second": [v, v]}
                for t, v in (("plain", 50.0), (ngram, 72.0), (ds, 73.4))]
    _store(calibration_key(tiny_target, heads, 1, datastore),
           {"tree": ds, "measured": measured})
    assert cached_tree(tiny_target, heads, datastore=datastore) == ngram


def test_shipped_distilled_sets_agree_with_the_shipped_datastore():
    """checkpoints/ ships the SmolLM2 self-distillation sets (the datastore's source among them):
    each loads, its manifest counts what it holds, and the rebuilt first set's responses are
    the datastore's documents."""
    from pathlib import Path

    from spec_jax.train.distill import load_distill

    root = Path(__file__).resolve().parent.parent / "checkpoints"
    sets = sorted((root / "smollm2-135m-instruct-distill").glob("*-*-*"))
    assert sets, "checkpoints/smollm2-135m-instruct-distill/ holds no sets"
    for d in sets:  # balanced-<start>-<end>: greedy, seed 0; sampled-<start>-<end>: temperature
        # > 0; self-<start>-<end>: greedy answers to prompts the target wrote (`--data self`)
        seqs, plens, m = load_distill(d)
        kind, lo, hi = d.name.split("-")
        mix = "self" if kind == "self" else "balanced"
        assert (m["start"], m["samples"], m["mix"]) == (int(lo), int(hi) - int(lo), mix)
        assert (m["temperature"] > 0) == (kind == "sampled"), d.name
        assert m["response_tokens"] == sum(len(s) - p for s, p in zip(seqs, plens))
    seqs, plens, _ = load_distill(root / "smollm2-135m-instruct-distill" / "balanced-0-3072")
    docs = np.load(root / "smollm2-135m-instruct-datastore" / "tokens.npz")["tokens"]
    np.testing.assert_array_equal(docs, np.concatenate([np.r_[s[p:], -1] for s, p in zip(seqs, plens)]))


def test_chain_priors_count_how_often_each_chain_is_right():
    """Documents say one of five phrases, three other tokens, and the phrase again. The n-gram
    chain at the second phrase continues the first (right but for its end); the datastore, built
    from the other documents, continues a phrase from its first two tokens."""
    from spec_jax.heads.datastore import chain_priors

    rng = np.random.RandomState(0)
    phrases = [rng.permutation(np.arange(10, 60))[:4] for _ in range(5)]
    docs = []
    for i in range(40):
        phrase = phrases[i % 5]
        docs.append(np.r_[phrase, rng.permutation(np.arange(60, 90))[:3], phrase, -1])
    ng, ds = chain_priors(np.concatenate(docs).astype(np.int32), ngram_depth=4, ngram_max=4,
                          ds_depth=3, min_ngram=2, max_ngram=4)
    assert ng.shape == (5, 4) and ds.shape == (5, 3)
    assert np.all(np.diff(ng, axis=1) <= 0) and np.all(np.diff(ds, axis=1) <= 0)
    # at the second phrase's first token (a 1-token match), 3 tokens right, then the document ends
    np.testing.assert_allclose(np.exp(ng[1]), [40.1 / 41] * 3 + [0.1 / 41], rtol=1e-5)
    assert np.exp(ng[2, 1]) > 0.95  # at its second token (a 2-token match), 2 right
    assert np.exp(ds[2, 0]) > 0.8 and np.exp(ds[2, 1]) > 0.8


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_ranked_grafts_keep_greedy_output_in_the_trees_own_tokens(tiny_target, own_output,
                                                                  datastore, method):
    from spec_jax.generate import resolve_drafter

    draft = spec_jax.init_draft(tiny_target, method, seed=7, scale=0.3)
    tree = "dynamic:3,3,8+ngram:6+ds:4+ranked"
    drafter = resolve_drafter(tiny_target, draft, tree, 1, datastore=datastore)[0]
    assert drafter.ranked and drafter.tree_size == 8 and drafter.max_depth == 6
    prompts, _ = own_output
    for prompt in prompts[:2]:
        plain = spec_jax.generate(tiny_target, prompt, 30, stop_at_eos=False)
        spec = spec_jax.generate(tiny_target, prompt, 30, draft=draft, tree=tree,
                                 datastore=datastore, stop_at_eos=False)
        assert spec.token_ids == plain.token_ids, (method, prompt)
        assert spec.stats["mean_accepted"] > 2.0, spec.stats  # the corpus' chains are taken
    for bad, msg in (("[[0], [1], [0, 0]]+ngram:3+ds:2+ranked", "dynamic tree"),
                     ("dynamic:3,3,8+ranked+ngram:2", "goes last")):
        with pytest.raises(SpecJaxError, match=msg):
            spec_jax.generate(tiny_target, [1, 2, 3], 4, draft=draft, tree=bad, datastore=datastore)
    with pytest.raises(SpecJaxError, match="datastore of the target"):
        spec_jax.generate(tiny_target, [1, 2, 3], 4, draft=draft, tree="dynamic:3,3,8+ranked")
