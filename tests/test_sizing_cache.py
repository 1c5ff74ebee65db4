"""The sizing cache file under concurrent and broken use, its entries per batch size, and the
registry of draft methods."""
import json
import threading
import warnings

import pytest

from spec_jax.errors import SpecJaxError


def test_writers_side_by_side_keep_every_entry(tmp_path, monkeypatch):
    """Each store is a locked read-modify-write through a temporary file of its own: sizings
    storing at the same time lose none of each other's entries and leave no temporary files."""
    from spec_jax.sizing import _cache, _store, cache_file

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))

    def writer(w):
        for i in range(10):
            _store(f"w{w}-{i}", {"tree": [[0]] * i})

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(_cache()) == sorted(f"w{w}-{i}" for w in range(6) for i in range(10))
    assert [p.name for p in tmp_path.iterdir() if p.name != cache_file().name] == \
        [cache_file().name + ".lock"]


def test_two_processes_hammering_the_cache_keep_every_entry(tmp_path):
    """Two processes storing 300 entries each at once: valid JSON holding all 600."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom spec_jax.sizing import _store\n"
            "for i in range(300):\n    _store(f'{sys.argv[1]}-{i}', {'tree': [[0]], 'i': i})\n")
    env = {**os.environ, "SPEC_JAX_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, name], env=env) for name in "ab"]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    entries = json.loads((tmp_path / "trees-v8.json").read_text())
    assert sorted(entries) == sorted(f"{n}-{i}" for n in "ab" for i in range(300))


def test_a_damaged_cache_reads_as_empty_once_warned_and_is_rewritten(tmp_path, monkeypatch):
    from spec_jax.sizing import _cache, _store, cache_file

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    cache_file().write_text('{"a": {"tree": [[0]]}, "b": ')  # a writer cut short
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert _cache() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cache() == {}  # warned once
    _store("c", {"tree": "plain"})
    assert json.loads(cache_file().read_text()) == {"c": {"tree": "plain"}}
    cache_file().write_text("[1, 2]")  # valid JSON, not an object
    assert _cache() == {}


def test_methods_are_looked_up_and_an_unknown_one_is_named(tiny_target, tmp_path):
    import spec_jax
    from spec_jax.heads.methods import METHODS, method_of
    from spec_jax.heads.registry import save_draft

    assert list(METHODS) == ["eagle", "eagle3", "medusa", "mtp"]
    assert all(method_of(name).name == name for name in METHODS)
    with pytest.raises(SpecJaxError, match="unknown draft method 'hydra': choose one of eagle"):
        spec_jax.init_draft(tiny_target, "hydra")
    save_draft(spec_jax.init_draft(tiny_target, "mtp"), tmp_path / "h")
    meta = json.loads((tmp_path / "h" / "spec_jax.json").read_text())
    (tmp_path / "h" / "spec_jax.json").write_text(json.dumps({**meta, "method": "hydra"}))
    with pytest.raises(SpecJaxError, match="unknown draft method 'hydra'.*eagle, eagle3, medusa"):
        spec_jax.load_draft(tmp_path / "h")


def test_a_batch_is_sized_at_its_power_of_two_bucket(tiny_target, tmp_path, monkeypatch):
    """Sizings are measured and cached per batch bucket (the next power of two): a call of 3 rows
    is sized at 4 rows, under the key of batch 4, and never takes batch 1's choice."""
    from spec_jax import sizing

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    assert [sizing.batch_bucket(b) for b in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]
    heads = object.__new__(type("H", (), {"method": "eagle", "fingerprint": lambda self: "f"}))
    key = lambda b: sizing.calibration_key(tiny_target, heads, b)  # noqa: E731
    assert key(3) == key(4) != key(1) and key(16) != key(1) and key(1).endswith("|1")
    batches = []

    def verify(target, sizes, batch=1):
        batches.append(batch)
        return {t: 0.01 for t in sizes}

    monkeypatch.setattr(sizing.calibrate, "verify_latency", verify)
    rows = []
    real = sizing.calibrate._measure
    monkeypatch.setattr(sizing.calibrate, "_measure", lambda target, groups, *a, **k: (
        rows.append({len(g) for g in groups}) or real(target, groups, *a, **k)))
    tree, _ = sizing.size_ngram(tiny_target, [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5]], batch=3,
                                max_new_tokens=6, progress=False)
    assert set(batches) == {4} and all(r == {4} for r in rows)
    assert sizing.cached_ngram(tiny_target, batch=3) == sizing.cached_ngram(tiny_target, batch=4)
    assert sizing.cached_ngram(tiny_target, batch=4) == tree
    assert sizing.cached_ngram(tiny_target, batch=1) is None



def test_at_a_batch_speculation_must_beat_plain_decoding_by_more_than_the_noise(
        tiny_target, tmp_path, monkeypatch):
    """One row: a tree within the noise of plain decoding, or its fallback tying with it, is
    chosen (the one-row rules). Several rows: the loop takes a tree step whenever any row wants
    one, so a tie goes to plain decoding; a clear lead still speculates. A cached sizing is
    re-decided at the batch size it was stored for."""
    from spec_jax import sizing

    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    tree, point = [[0], [1]], [1.9, 2.0]

    def m(t, tps, runs=None, **kw):
        return {"tree": t, "tokens_per_second": tps, "tau": 1.0 if t == sizing.PLAIN else 2.0,
                "runs_tokens_per_second": runs or [tps, tps], **kw}

    tie = [m(sizing.PLAIN, 100.0), m(tree, 101.0)]
    fb_tie = [m(sizing.PLAIN, 100.0), m(tree, 90.0), m(tree, 100.5, fallback=point,
                                                        plain_step_share=0.5)]
    lead = [m(sizing.PLAIN, 100.0), m(tree, 120.0)]
    for measured, one_row in ((tie, tree), (fb_tie, tree), (lead, tree)):
        assert sizing.choose(measured)["tree"] == one_row
    assert sizing.choose(fb_tie).get("fallback") == point
    assert sizing.chosen_fallback(fb_tie) == tuple(point)
    assert sizing.choose(tie, 4)["tree"] == sizing.choose(fb_tie, 16)["tree"] == sizing.PLAIN
    assert sizing.chosen_fallback(tie, 4) is sizing.chosen_fallback(fb_tie, 16) is None
    assert sizing.choose(lead, 16)["tree"] == tree
    # the noise is the rounds' own spread where it is above 3%: a 6% lead within 8% is a tie
    noisy = [m(sizing.PLAIN, 100.0, [92.0, 100.0]), m(tree, 106.0, [97.5, 106.0])]
    assert sizing.choose(noisy)["tree"] == tree and sizing.choose(noisy, 4)["tree"] == sizing.PLAIN
    heads = object.__new__(type("H", (), {"method": "eagle", "fingerprint": lambda self: "f"}))
    for b in (1, 4):
        sizing._store(sizing.calibration_key(tiny_target, heads, b), {"tree": tree, "measured": tie})
    assert sizing.cached_tree(tiny_target, heads, 1) == tree
    assert sizing.cached_tree(tiny_target, heads, 3) == sizing.PLAIN  # sized at 4
    assert sizing.cached_choice(tiny_target, heads, 4) == (sizing.PLAIN, None)
