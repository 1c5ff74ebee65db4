"""The sizing cache: one JSON file under $SPEC_JAX_CACHE (`cache_file`) holding every sizing
report, keyed by device kind, target (weights and layout), heads, batch bucket (`batch_bucket`),
datastore and sampling setting (`calibration_key`, `ngram_key`), and the target's verify-latency
curves (`verify_key`).

Writers (sizings running side by side, in several processes) take a lock on a side file around
their read-modify-write and write a fresh temporary file of their own that replaces the cache
whole, so neither a reader nor another writer ever sees half a file. A damaged file reads as
empty, with one warning, and the next store rewrites it."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import jax

from spec_jax.paths import cache_dir
from spec_jax.sizing.choice import choice_of, choose

try:
    import fcntl
except ImportError:  # not a POSIX system: writes stay atomic, without the lock
    fcntl = None


def cache_file() -> Path:
    return cache_dir() / "trees-v8.json"  # v8: a switch is charged the draft depth of the arms it uses


def batch_bucket(batch: int) -> int:
    """The batch size a sizing is measured and cached at for a call of `batch` rows: the next
    power of two. A bigger batch makes a tree's verification costlier relative to its drafting,
    so each batch size has a sizing of its own; bucketing keeps them few (1, 2, 4, 8, 16, ...)
    and measures a call's batch at no fewer rows than it runs."""
    batch = int(batch)
    if batch < 1:
        raise ValueError(f"a batch has at least one row, not {batch}")
    return 1 << (batch - 1).bit_length()


def _target_parts(target, batch: int) -> tuple[str, str, str, str, str]:
    """What every cost measured here depends on besides the heads: device kind, target weights,
    layer layout (with the CPU kernels' build, whose speed it is), attention kernel, batch bucket
    (`batch_bucket`) (the parts of both cache keys, in key order)."""
    from pallas_kernels.cpu.build import build_id
    from pallas_kernels.dispatch import default_impl

    build = build_id()
    return (jax.devices()[0].device_kind, target.fingerprint(),
            target.layout + ("-u8" if target.weight_codes else "") + (f"@{build}" if build else ""),
            f"attn-{default_impl()}", str(batch_bucket(batch)))


def calibration_key(target, heads, batch: int, datastore=None, temperature: float = 0.0,
                    top_p: float = 1.0) -> str:
    device, weights, layout, attn, b = _target_parts(target, batch)
    return ("|".join((device, weights, f"{heads.method}:{heads.fingerprint()}", layout, attn, b))
            + (f"|ds-{datastore.fingerprint()}" if datastore is not None else "")
            + (f"|sampled-t{float(temperature):g}-p{float(top_p):g}" if temperature > 0 else ""))


def verify_key(target, batch: int) -> str:
    """Cache key of the target's verify-latency curve: it depends on the target, not the heads."""
    return "|".join(("verify",) + _target_parts(target, batch))


def ngram_key(target, batch: int, temperature: float = 0.0, top_p: float = 1.0) -> str:
    """Cache key of the n-gram drafter's sizing: the target's parts, no heads."""
    device, weights, layout, attn, b = _target_parts(target, batch)
    return ("|".join((device, weights, "ngram", layout, attn, b))
            + (f"|sampled-t{float(temperature):g}-p{float(top_p):g}" if temperature > 0 else ""))


def _entry(target, heads, batch: int, datastore=None, temperature: float = 0.0, top_p: float = 1.0):
    """The cached sizing report for these heads (and datastore) here, or None (`_decided`)."""
    return _decided(calibration_key(target, heads, batch, datastore, temperature, top_p), batch)


def _decided(key: str, batch: int):
    """The cached sizing report under `key` (sized at `batch`'s bucket), or None. Its choice is
    re-decided from its stored measurements (`choose` at that batch size, which the report then
    holds), so entries written before the current rules follow them too."""
    entry = _cache().get(key)
    if entry is not None:
        entry["batch"] = batch_bucket(batch)
    if entry is not None and entry.get("measured"):
        entry["tree"] = choose(entry["measured"], entry["batch"])["tree"]
    return entry


def cached_tree(target, heads, batch: int = 1, datastore=None, temperature: float = 0.0,
                top_p: float = 1.0):
    """The cached choice for these heads (and datastore) here: PLAIN, a list of paths, a
    dynamic-tree dict, a {"base", "ngram", "ds"} graft, or None when this device, target, heads,
    batch size (and datastore, and sampling setting) were never calibrated."""
    entry = _entry(target, heads, batch, datastore, temperature, top_p)
    return None if entry is None else entry["tree"]


def cached_choice(target, heads, batch: int = 1, datastore=None, temperature: float = 0.0,
                  top_p: float = 1.0) -> tuple | None:
    """`choice_of` the cached sizing for these heads ("ngram": the n-gram chain's) here, read
    from the cache once; None if never sized."""
    if heads == "ngram":
        entry = _decided(ngram_key(target, batch, temperature, top_p), batch)
        return choice_of(entry if entry and entry.get("measured") else None)
    return choice_of(_entry(target, heads, batch, datastore, temperature, top_p))


def cached_ngram(target, batch: int = 1, temperature: float = 0.0, top_p: float = 1.0):
    """The cached n-gram choice here (PLAIN or a chain's paths), or None if never sized."""
    chosen = cached_choice(target, "ngram", batch, temperature=temperature, top_p=top_p)
    return None if chosen is None else chosen[0]


def shared_verify_latency(target, batch: int, measured: dict) -> dict:
    """`measured` merged with the curve cached for this target and batch by the fastest reading
    per size, and stored back. Every calibration (one per drafter) re-measures the same target,
    so on a shared host the minimum over them is the steadiest estimate of its cost; a single
    slow reading must not make one drafter's choice smaller than another's."""
    merged = {}

    def merge(stored):
        stored = stored or {}
        merged.update({int(t): min(float(v), float(stored.get(str(t), v)))
                       for t, v in measured.items()})
        return {**stored, **{str(t): v for t, v in merged.items()}}

    _update(verify_key(target, batch), merge)
    return merged


_WARNED: set[str] = set()  # damaged cache files already warned about


def _cache() -> dict:
    """The whole sizing cache (choices and verify curves), {} before the first calibration or
    where the file is damaged (cut short, edited by hand: one warning, and the next store
    rewrites it)."""
    f = cache_file()
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
        why = f"a JSON {type(data).__name__}, not an object"
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        data, why = None, str(e)
    if isinstance(data, dict):
        return data
    if str(f) not in _WARNED:
        _WARNED.add(str(f))
        warnings.warn(f"the sizing cache {f} is damaged ({why}): read as empty; the next sizing "
                      "stored rewrites it", RuntimeWarning, stacklevel=3)
    return {}


def _store(key: str, entry: dict) -> None:
    _update(key, lambda stored: entry)


def _update(key: str, change) -> None:
    """Set the entry under `key` to `change(the stored entry or None)`, holding the cache's lock
    from the read to the write, so that sizings running side by side keep each other's entries."""
    f = cache_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    with _locked(f):
        data = _cache()
        data[key] = change(data.get(key))
        _write(f, json.dumps(data, indent=1))


@contextlib.contextmanager
def _locked(f: Path):
    """An exclusive lock on `f`'s side file `f.lock` (held until the block ends). Readers take
    none: a write replaces the file whole."""
    with open(f.with_name(f.name + ".lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _write(f: Path, text: str) -> None:
    """Write `f` atomically: a temporary file of this writer's own in the same folder, renamed
    over `f` (keeping its permissions)."""
    mode = f.stat().st_mode & 0o777 if f.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=f".{f.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, f)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
