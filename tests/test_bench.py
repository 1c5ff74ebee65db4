"""The bench's arithmetic: tau, tokens/s, speedup and time shares from known runs."""
import pytest

from spec_jax.bench import Run, markdown, method_histograms, summarize


def test_summary_arithmetic_on_known_runs():
    runs = [
        # plain: 1 token per step; 65 tokens in 2.0 s and 33 tokens in 1.0 s
        Run("plain", "mt", "writing", 65, 64, 2.0, 1.5, 1),
        Run("plain", "mt", "coding", 33, 32, 1.0, 0.0, 1),
        # eagle: acceptance sequence known: 65 tokens in 16 steps (tau 4), 33 tokens in 8 steps
        Run("eagle", "mt", "writing", 65, 16, 0.5, 9.0, 32),
        Run("eagle", "mt", "coding", 33, 8, 0.4, 0.0, 32),
    ]
    rows = {(r["method"], r["category"]): r for r in summarize(runs, verify_time=lambda t: 0.01 * t)}
    plain, eagle = rows[("plain", "all")], rows[("eagle", "all")]
    assert plain["tau"] == pytest.approx((98 - 2) / 96) == 1.0
    assert eagle["tau"] == pytest.approx((98 - 2) / 24) == 4.0
    assert plain["tokens_per_second"] == pytest.approx(98 / 3.0)
    assert eagle["tokens_per_second"] == pytest.approx(98 / 0.9)
    assert eagle["speedup"] == pytest.approx((98 / 0.9) / (98 / 3.0))
    assert rows[("eagle", "writing")]["speedup"] == pytest.approx((65 / 0.5) / (65 / 2.0))
    assert eagle["compile_seconds"] == 9.0
    # verify share: 24 steps x 0.32 s of verify at 32 tree tokens, over 0.9 s: capped at 100%
    assert eagle["verify_share"] == 1.0
    assert plain["verify_share"] == pytest.approx(96 * 0.01 / 3.0)
    assert "| mt | all | eagle | 32 | 4.00 |" in markdown(summarize(runs))


def test_method_histograms_sum_runs_and_skip_plain():
    runs = [Run("plain", "mt", "w", 5, 4, 1.0, 0.0, 1, (4,)),
            Run("eagle", "mt", "w", 9, 4, 1.0, 0.0, 8, (1, 2, 1)),
            Run("eagle", "mt", "c", 9, 3, 1.0, 0.0, 8, (0, 1, 1, 1))]
    assert method_histograms(runs) == {"eagle": [1, 3, 2, 1]}


def test_calibrated_tree_is_cached_per_heads(tiny_target, tmp_path, monkeypatch):
    """Calibration picks one of its candidates and caches it for these heads only: other heads of
    the same method (retrained, say) are not given a tree measured for different weights."""
    import spec_jax
    from spec_jax.bench import calibrate_tree
    from spec_jax.generate import calibrated_tree

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    heads = spec_jax.init_draft(tiny_target, "eagle", seed=1, scale=0.3)
    other = spec_jax.init_draft(tiny_target, "eagle", seed=2, scale=0.3)
    best, curve = calibrate_tree(tiny_target, heads, [[1, 2, 3, 4]], max_new_tokens=8,
                                 candidates=[(2, 2, 4)], progress=False)
    assert best in [(0, 0, 1), (2, 2, 4)] and len(curve) == 2
    assert calibrated_tree(tiny_target, heads) == dict(zip(("top_k", "depth", "total_tokens"), best))
    assert calibrated_tree(tiny_target, other) is None
