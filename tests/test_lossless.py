"""Sampling is lossless: the empirical distribution of the first 3 generated tokens over 20 000
seeded runs (one batch row per run) matches the target's exact distribution, for every drafter;
a deliberately broken acceptance rule fails the same test."""
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import spec_jax
from spec_jax.verify import target_probs
from tests.conftest import tiny_config

V, N_RUNS, TEMP, TOP_P = 6, 20_000, 1.0, 1.0
PER_CALL = 2000  # rows per generate_batch call: one batch size, so tests share compiled loops
PROMPT = [1, 4, 2]


@pytest.fixture(scope="module")
def small_vocab_target():
    return spec_jax.random_target(tiny_config(vocab_size=V, num_layers=1), seed=3, scale=0.5)


@pytest.fixture(scope="module")
def exact(small_vocab_target):
    """exact(top_p, temp): `exact_distribution` of the module's target, computed once each."""
    memo = {}

    def get(top_p, temp=TEMP):
        if (top_p, temp) not in memo:
            memo[top_p, temp] = exact_distribution(small_vocab_target, top_p, temp)
        return memo[top_p, temp]

    return get


def exact_distribution(target, top_p, temp=TEMP):
    """P(x1, x2, x3 | prompt) by enumeration over all V^3 continuations: one forward pass over
    the V^2 sequences prompt + [a, b] gives every conditional."""
    ab = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)
    logits = target.logits(np.concatenate([np.tile(PROMPT, (V * V, 1)), ab], 1))[:, -3:]
    p = np.asarray(target_probs(jnp.asarray(logits), temp, top_p), np.float64).reshape(V, V, 3, V)
    p1, p2, p3 = p[0, 0, 0], p[:, 0, 1], p[:, :, 2]  # [V] p(a), [V, V] p(b | a), [V, V, V]
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def small_datastore(target):
    """A corpus over the V-token vocabulary: every context finds a continuation to graft."""
    from spec_jax.heads.datastore import build_datastore

    rng = np.random.RandomState(0)
    return build_datastore(target, [rng.randint(0, V, 12) for _ in range(30)], max_ngram=3, depth=3)


def empirical(target, draft, tree, accept_rule="exact", top_p=TOP_P):
    ds = small_datastore(target) if isinstance(tree, str) and "+ds" in tree else None
    counts = np.zeros(V ** 3)
    for i in range(N_RUNS // PER_CALL):
        rs = spec_jax.generate_batch(target, [PROMPT] * PER_CALL, 3, temperature=TEMP, top_p=top_p,
                                     seed=100 + i, draft=draft, tree=tree, stop_at_eos=False,
                                     accept_rule=accept_rule, datastore=ds)
        for r in rs:
            a, b, c = r.token_ids
            counts[(a * V + b) * V + c] += 1
    return counts


def chi2_pvalue(counts, probs):
    """Pearson chi-square over cells with expected count >= 5 (the rest pooled into one cell)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    stat = np.sum((obs[keep] - ex[keep]) ** 2 / ex[keep])
    return stats.chi2.sf(stat, keep.sum() - 1)


CASES = [("plain", None), ("ngram", None), ("eagle", "dynamic:3,3,8"),
         ("eagle", "dynamic:2,2,4+ngram:3"), ("eagle", "dynamic:2,2,4+ngram:2+ds:3"),
         ("eagle", "dynamic:2,3,6+ngram:4+ds:3+ranked"),
         ("eagle", "[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]"), ("eagle3", "dynamic:2,3,6"),
         ("medusa", "[[0],[1],[2],[0,0],[1,0],[0,0,0]]"), ("medusa", "dynamic:3,3,7"), ("mtp", None),
         ("eagle", {"switch": [{"base": [[0], [1], [0, 0]], "ngram": 0},
                               {"base": [], "ngram": 3}], "policy": [0, 0, 1]})]


def make_draft(target, method):
    if method in ("plain", "ngram"):
        return None if method == "plain" else "ngram"
    kw = {"eagle3": {"draft_vocab": V}, "mtp": {"depth": 3}}.get(method, {})
    return spec_jax.init_draft(target, method, seed=5, scale=0.5, **kw)


@pytest.mark.parametrize("method,tree", CASES)
def test_sampling_matches_target_distribution(small_vocab_target, exact, method, tree):
    probs = exact(TOP_P)
    counts = empirical(small_vocab_target, make_draft(small_vocab_target, method), tree)
    assert chi2_pvalue(counts, probs) > 1e-4
    # and the total variation distance stays within what 20 000 samples allow
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    assert tv < 0.5 * np.sqrt(probs.size / N_RUNS)


def test_top_p_sampling_is_lossless(small_vocab_target, exact):
    probs = exact(0.8)
    counts = empirical(small_vocab_target, make_draft(small_vocab_target, "eagle"), "dynamic:3,3,8",
                       top_p=0.8)
    assert chi2_pvalue(counts, probs) > 1e-4


def test_per_row_sampling_settings_are_each_lossless(small_vocab_target, exact):
    """One batch, three settings by row: greedy rows (every tenth) give plain greedy decoding's
    tokens, and each sampling setting's rows (8 100 each) match that setting's exact
    distribution."""
    target = small_vocab_target
    settings = [(0.0, 1.0), (TEMP, 1.0), (0.6, 0.8)]
    row_setting = [0 if j % 10 == 0 else 1 + j % 2 for j in range(PER_CALL)]
    greedy = spec_jax.generate(target, PROMPT, 3, stop_at_eos=False).token_ids
    counts = {s: np.zeros(V ** 3) for s in settings[1:]}
    temps, top_ps = ([settings[s][j] for s in row_setting] for j in (0, 1))
    for i in range(9):
        rs = spec_jax.generate_batch(target, [PROMPT] * PER_CALL, 3, temperature=temps,
                                     top_p=top_ps, seed=200 + i, draft=make_draft(target, "eagle"),
                                     tree="dynamic:3,3,8", stop_at_eos=False)
        for s, r in zip(row_setting, rs):
            if s == 0:
                assert r.token_ids == greedy
            else:
                a, b, c = r.token_ids
                counts[settings[s]][(a * V + b) * V + c] += 1
    for (temp, top_p), c in counts.items():
        assert chi2_pvalue(c, exact(top_p, temp)) > 1e-4, (temp, top_p)


def test_broken_acceptance_rule_is_detected(small_vocab_target, exact):
    """Accepting every draft token the target could emit biases the output: the test catches it."""
    probs = exact(TOP_P)
    counts = empirical(small_vocab_target, make_draft(small_vocab_target, "eagle"), "dynamic:3,3,8",
                       accept_rule="broken")
    assert chi2_pvalue(counts, probs) < 1e-6


def nucleus_by_sorting(logits, temperature, top_p):
    """The textbook definition: sort, keep the smallest prefix with mass >= top_p (ties at its
    edge included), renormalise; top_p = 1 keeps every token."""
    z = logits / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p >= 1:
        return p
    out = np.zeros_like(p)
    for i, row in enumerate(p.reshape(-1, p.shape[-1])):
        s = np.sort(row)[::-1]
        k = int(np.argmax(np.cumsum(s, dtype=np.float64) >= top_p))
        kept = np.where(row >= s[k], row, 0.0)
        out.reshape(-1, p.shape[-1])[i] = kept / kept.sum()
    return out


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99, 1.0])
def test_target_probs_matches_sorted_nucleus(top_p):
    rng = np.random.RandomState(0)
    logits = np.concatenate([rng.randn(2, 3, 2000) * s for s in (0.3, 3.0, 8.0)]).astype(np.float32)
    logits[0, 0, :4] = 5.0  # a tie at the top
    got = np.asarray(target_probs(jnp.asarray(logits), 0.7, top_p))
    want = nucleus_by_sorting(logits.astype(np.float64), 0.7, top_p)
    np.testing.assert_array_equal(got > 1e-20, want > 1e-20)  # the same tokens kept
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_nucleus_bisects_only_the_rows_that_need_it():
    """One flat row among peaked ones: its top-k mass falls short of top_p, so it alone is bisected."""
    rng = np.random.RandomState(1)
    logits = (rng.randn(16, 2000) * 8).astype(np.float32)
    logits[3] = rng.randn(2000) * 0.3
    got = np.asarray(target_probs(jnp.asarray(logits), 0.7, 0.9))
    want = nucleus_by_sorting(logits.astype(np.float64), 0.7, 0.9)
    np.testing.assert_array_equal(got > 1e-20, want > 1e-20)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_nucleus_keeps_its_edge_token_whatever_the_shape():
    """A row whose edge token's probability once rounded an ulp apart in the two evaluations of
    the softmax (finding the threshold, applying it), which dropped it from a [V] input's nucleus:
    the threshold is applied to logits, so [V], [1, V] and [1, 1, V] keep the same tokens."""
    logits = jnp.asarray([4.3132057, 0.03943333, -0.4324206, 1.6573179, 2.4282322, 1.8264829])
    want = nucleus_by_sorting(np.asarray(logits, np.float64)[None], 1.0, 0.8)[0]
    assert np.count_nonzero(want) == 2
    for x in (logits, logits[None], logits[None, None]):
        np.testing.assert_allclose(np.asarray(target_probs(x, 1.0, 0.8)).reshape(-1), want,
                                   atol=1e-6)


def test_sample_categorical_draws_the_given_distribution():
    """The two-level inverse-CDF sampler over several blocks: chi-square against the weights
    (unnormalised, a third of them zero, which are never drawn)."""
    import jax

    from spec_jax.verify import sample_categorical

    rng = np.random.RandomState(2)
    w = rng.gamma(0.5, size=300).astype(np.float32) * 7.0
    w[rng.rand(300) < 0.33] = 0.0
    keys = jax.random.split(jax.random.PRNGKey(0), N_RUNS)
    draws = np.asarray(sample_categorical(keys, jnp.tile(jnp.asarray(w), (N_RUNS, 1))))
    assert w[draws].min() > 0
    assert chi2_pvalue(np.bincount(draws, minlength=300).astype(float), w / w.sum()) > 1e-4
