"""The sizing cache file under concurrent and broken use, and the registry of draft methods."""
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
