"""Plain steps where a sized tree does not pay: the sizing's break-even and the fallback
generate runs with it (spec_jax.fallback, spec_jax.sizing.choice)."""
import pytest


def test_a_sized_tree_falls_back_to_plain_steps_below_its_measured_break_even(
        tiny_target, tmp_path, monkeypatch):
    """The break-even is the chosen tree's measured step time in plain steps (tau x plain tok/s
    over its tok/s); a sized choice (tree None or "auto") carries it, a tree the caller names or
    fallback=False does not, a number sets it for any tree."""
    import spec_jax
    from spec_jax.errors import SpecJaxError
    from spec_jax.generate import resolve_drafter
    from spec_jax.sizing import PLAIN, _store, break_even, calibration_key, ngram_key

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    measured = [{"tree": PLAIN, "tau": 1.0, "tokens_per_second": 100.0},
                {"tree": [[0], [1]], "tau": 2.4, "tokens_per_second": 120.0}]
    assert break_even(measured) == pytest.approx((2.0, 2.4))  # a 3-token step: 2 plain steps
    assert break_even(measured[:1]) is None and break_even(measured[1:]) is None
    heads = spec_jax.init_draft(tiny_target, "eagle", seed=1, scale=0.3)
    _store(calibration_key(tiny_target, heads, 1), {"tree": [[0], [1]], "measured": measured})
    for tree in (None, "auto"):
        d, _, fb = resolve_drafter(tiny_target, heads, tree)
        assert fb is not None and fb.plain_below == pytest.approx(2.0)
        assert fb.prior == pytest.approx(2.4)
        assert d.tree_size == 3 and d.method == "eagle"
    assert resolve_drafter(tiny_target, heads, None, fallback=False).fallback is None
    assert resolve_drafter(tiny_target, heads, "chain:2").fallback is None
    # the sized tree with a graft the caller adds is not the tree the break-even was measured for
    assert resolve_drafter(tiny_target, heads, "+ngram:4").fallback is None
    assert resolve_drafter(tiny_target, heads, "chain:2", fallback=1.5).fallback.plain_below == 1.5
    assert resolve_drafter(tiny_target, heads, "chain:2", fallback=(1.5, 2.5)).fallback.prior == 2.5
    for bad in ("often", -1.0, (2.0, 1.0), (1.0,)):
        with pytest.raises(SpecJaxError, match="fallback must be"):
            resolve_drafter(tiny_target, heads, "chain:2", fallback=bad)
    _store(ngram_key(tiny_target, 1), {"tree": [[0]], "measured": [
        {"tree": PLAIN, "tau": 1.0, "tokens_per_second": 100.0},
        {"tree": [[0]], "tau": 1.5, "tokens_per_second": 125.0}]})
    assert resolve_drafter(tiny_target, "ngram", None).fallback.plain_below == pytest.approx(1.2)
    r = spec_jax.generate(tiny_target, [1, 2, 3], 30, chat=False, draft=heads)
    assert r.token_ids == spec_jax.generate(tiny_target, [1, 2, 3], 30, chat=False).token_ids


def test_the_sizing_keeps_the_fallback_where_its_run_measured_that_it_pays(
        tiny_target, tmp_path, monkeypatch):
    """`choose` takes the best tree's run with the fallback over plain decoding that won unless
    plain ran faster, and over the same tree without it unless that ran faster by more than the
    noise margin — or ran faster at all, where the tree's lead is wide (its break-even under 3/4
    of its tau); generate then runs the chosen tree with that fallback, or without any. A tree
    that lost to plain gets a prior just above its break-even, so rows probe it now and then."""
    import spec_jax
    from spec_jax.generate import resolve_drafter
    from spec_jax.sizing import (
        PLAIN,
        PROBE_MARGIN,
        _store,
        calibration_key,
        choose,
        chosen_fallback,
        fallback_point,
    )

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    tree = [[0], [1]]
    m = lambda t, tau, *tps, fb=None, share=0.5: {  # noqa: E731
        "tree": t, "tau": tau, "tokens_per_second": max(tps), "runs_tokens_per_second": list(tps),
        **({"fallback": list(fb), "plain_step_share": share} if fb else {})}
    slow = [m(PLAIN, 1.0, 100.0, 100.0), m(tree, 1.8, 90.0, 90.0)]  # the tree loses to plain
    point = fallback_point(slow)
    assert point == pytest.approx((2.0, 2.0 * (1 + PROBE_MARGIN)))  # probes from just above
    assert fallback_point(slow[:1]) is None and fallback_point(slow[1:]) is None
    assert choose(slow)["tree"] == PLAIN and chosen_fallback(slow) is None
    won = slow + [m(tree, 1.3, 101.0, 100.5, fb=point)]
    assert choose(won)["tree"] == tree and chosen_fallback(won) == pytest.approx(point)
    lost = slow + [m(tree, 1.1, 98.0, 97.5, fb=point)]
    assert choose(lost)["tree"] == PLAIN and chosen_fallback(lost) is None

    fast = [m(PLAIN, 1.0, 100.0, 100.0), m(tree, 2.4, 120.0, 120.0)]
    point = fallback_point(fast)
    assert point == pytest.approx((2.0, 2.4))  # tau above the break-even: the prior is tau
    tie = fast + [m(tree, 2.2, 118.0, 117.0, fb=point)]  # inside the 3% margin: the safer bet
    assert choose(tie).get("fallback") and chosen_fallback(tie) == pytest.approx(point)
    worse = fast + [m(tree, 2.0, 110.0, 109.0, fb=point)]
    assert choose(worse)["tree"] == tree and chosen_fallback(worse) is None
    idle = fast + [m(tree, 2.4, 120.5, 120.0, fb=point, share=0.01)]  # it hardly acted: not kept
    assert choose(idle)["tree"] == tree and chosen_fallback(idle) is None
    # a cheap tree step (break-even 2.0 against tau 3.0): only a faster fallback run is kept
    cheap = [m(PLAIN, 1.0, 100.0, 100.0), m(tree, 3.0, 150.0, 150.0)]
    point = fallback_point(cheap)
    assert point == pytest.approx((2.0, 3.0))
    assert chosen_fallback(cheap + [m(tree, 2.9, 148.0, 147.0, fb=point)]) is None  # a tie
    assert chosen_fallback(cheap + [m(tree, 2.9, 151.0, 149.0, fb=point)]) == pytest.approx(point)

    heads = spec_jax.init_draft(tiny_target, "eagle", seed=1, scale=0.3)
    key = calibration_key(tiny_target, heads, 1)
    _store(key, {"tree": tree, "fallback": None, "measured": worse})
    assert resolve_drafter(tiny_target, heads, None).fallback is None
    _store(key, {"tree": tree, "measured": won})
    fb = resolve_drafter(tiny_target, heads, None).fallback
    assert fb is not None and fb.plain_below == pytest.approx(2.0)
    assert fb.prior == pytest.approx(2.0 * (1 + PROBE_MARGIN))
