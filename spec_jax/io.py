"""Atomic output directories and Orbax save/restore of parameter pytrees."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.errors import SpecJaxError

STALE_SECONDS = 6 * 3600  # a temporary folder whose writer's process cannot be checked: this old


@contextlib.contextmanager
def atomic_dir(out_dir: Path, force: bool = False):
    """Yield a temporary sibling folder; rename it to out_dir only if the block succeeds.

    The temporary folder is `.NAME.tmp-PID-*` (PID: the writer's process); a replaced output is
    first renamed to `.NAME.old-PID-*/x`. A run for the same output first cleans what killed
    runs left (`_recover`): it restores an output that was moved aside when the new one never
    took its place, and removes temporary folders whose writer is gone (or, where that cannot be
    told, that are older than STALE_SECONDS). Two writers of one output never touch each other's
    live folders."""
    out_dir = Path(out_dir).absolute()
    _recover(out_dir)
    if out_dir.exists() and not force:
        raise SpecJaxError(f"{out_dir} already exists: choose another --out or pass --force to replace it")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    except OSError as e:
        raise SpecJaxError(f"cannot write {out_dir}: {e.strerror or e} ({out_dir.parent}); choose "
                           "another --out") from None
    try:
        yield tmp
        tmp.chmod(0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-{os.getpid()}-",
                                        dir=out_dir.parent))
            out_dir.rename(old / "x")
            # killed here, the output is missing: the next run's `_recover` renames old/x back
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _writer_gone(folder: Path) -> bool:
    """Whether the process that made a `.NAME.tmp-PID-*` / `.NAME.old-PID-*` folder is gone (a
    name without a PID, as older versions wrote: when it is older than STALE_SECONDS)."""
    import time

    pid = folder.name.rsplit(".", 1)[-1].split("-")[1:2]
    if pid and pid[0].isdigit():
        if int(pid[0]) == os.getpid():
            return False
        try:
            os.kill(int(pid[0]), 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, another user's
            return False
        return False
    try:
        return time.time() - folder.stat().st_mtime > STALE_SECONDS
    except OSError:
        return False


def _recover(out_dir: Path) -> None:
    """Clean what killed writers of `out_dir` left beside it (see `atomic_dir`)."""
    parent = out_dir.parent
    if not parent.is_dir():
        return
    for old in sorted(parent.glob(f".{out_dir.name}.old-*")):
        if not _writer_gone(old):
            continue
        try:
            if (old / "x").exists() and not out_dir.exists():
                (old / "x").rename(out_dir)  # killed between the two renames of a --force
            shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    for tmp in parent.glob(f".{out_dir.name}.tmp-*"):
        if _writer_gone(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


RERUN = {"target": "re-run `spec-jax convert` or `spec-jax fetch`",
         "draft": "re-run `spec-jax train` (or re-import the heads)",
         "datastore": "re-run `spec-jax datastore`"}
META_KEYS = {"target": ("config",), "draft": ("method", "hparams", "target"), "datastore": ()}


def damaged(path: Path, what: str, kind: str = "target") -> SpecJaxError:
    """The one error for a checkpoint folder that cannot be read as written."""
    what = " ".join(str(what).split())  # one line
    return SpecJaxError(f"checkpoint {path} is damaged: {what[:300]}; "
                        f"{RERUN.get(kind, RERUN['target'])}")


def read_meta(path: Path, kind: str, missing_hint: str) -> dict:
    """The `spec_jax.json` of a checkpoint directory, checked to be of `kind` (target or draft)."""
    import json

    meta_file = Path(path) / "spec_jax.json"
    if not meta_file.is_file():
        if Path(path).is_dir() and (Path(path) / "params").is_dir():
            raise damaged(path, "spec_jax.json is missing", kind)
        raise SpecJaxError(f"{path} is not a spec_jax {kind} checkpoint (no spec_jax.json): {missing_hint}")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise damaged(path, f"spec_jax.json is not valid JSON ({e})", kind) from None
    if not isinstance(meta, dict):
        raise damaged(path, f"spec_jax.json holds a {type(meta).__name__}, not an object", kind)
    if meta.get("kind") != kind:
        if "kind" not in meta:
            raise damaged(path, "spec_jax.json lacks its 'kind'", kind)
        raise SpecJaxError(f"{path} holds a {meta.get('kind')!r} checkpoint, not a {kind}")
    missing = [k for k in META_KEYS.get(kind, ()) if k not in meta]
    if missing:
        raise damaged(path, f"spec_jax.json lacks {', '.join(map(repr, missing))}", kind)
    return meta


def check_finite(params, where) -> None:
    """Refuse parameters holding NaN or infinity, naming the first bad array's path: one
    all-finite reduction per floating array, with NumPy where it lives on the CPU (no compile:
    0.08-0.2 s for SmolLM2's 135M weights; an array split over CPU devices shard by shard, never
    gathered), else on its devices (one transfer of the flags; on a mesh spanning processes the
    one answer every process gets, so that all of them refuse or none)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    named = [(jax.tree_util.keystr(k, simple=True, separator="/"), a) for k, a in leaves
             if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    flags = [_finite(a) for _, a in named]
    bad = [n for (n, _), ok in zip(named, map(bool, flags)) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise SpecJaxError(f"non-finite weights (NaN or inf) in tensor {bad[0]!r}{more} of {where}: "
                           "the checkpoint is corrupt or was trained into divergence; re-create it")


def _finite(a) -> bool:
    """Whether `a` (a NumPy array or a jax.Array) is all finite (see `check_finite`)."""
    if not isinstance(a, jax.Array):
        return _finite_in_blocks(np.asarray(a))
    if any(d.platform != "cpu" for d in a.devices()) or not a.is_fully_addressable:
        return bool(_all_finite(a))
    if len(a.devices()) == 1:
        return _finite_in_blocks(np.asarray(a))
    return all(_finite_in_blocks(np.asarray(s.data)) for s in a.addressable_shards
               if s.replica_id == 0)  # each element once, however many devices hold it


def _finite_in_blocks(a: np.ndarray, block_bytes: int = 16 << 20) -> bool:
    """Whether `a` is all finite, tested a block of rows at a time: the temporaries (the flags,
    a float32 copy of a bfloat16 block) stay small however large the array."""
    if a.ndim == 0 or a.nbytes <= block_bytes:
        return bool(np.isfinite(a).all())
    step = max(1, block_bytes // max(1, a[0].nbytes))
    return all(bool(np.isfinite(a[i:i + step]).all()) for i in range(0, a.shape[0], step))


@jax.jit
def _all_finite(a):
    return jnp.all(jnp.isfinite(a))


def save_params(path: Path, params, dtype: str | None = None) -> None:
    import orbax.checkpoint as ocp

    if dtype is not None:
        dt = jnp.dtype(dtype)
        params = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, dt)), params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), params)


def load_params(path: Path, skip=None, kind: str = "target", target=None):
    """The parameter tree saved at `path`, without the entries whose "/"-joined paths are in
    `skip` (those are not read from disk). A folder that cannot be read is reported as damaged
    (one line naming what failed), not with the reader's traceback.

    target: `jax.ShapeDtypeStruct`s of the whole tree with shardings (and dtypes) to restore
    into (`spec_jax.sharding.abstract_params`): each device's shard is read from disk on its own
    and cast to the target's dtype as it is read, so no host holds a full copy of a tensor, and
    in a multi-process run each process reads only the shards of its own devices."""
    path = _params_dir(path, kind)
    with _reading(path, kind):
        return _load_params(path, skip, target)


def param_shapes(path: Path, kind: str = "target"):
    """`jax.ShapeDtypeStruct`s (shapes and dtypes, no sharding) of the parameter tree saved at
    `path`, read from its metadata: no array is read."""
    import orbax.checkpoint as ocp

    path = _params_dir(path, kind)
    with _reading(path, kind), ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", meta)
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)


def _params_dir(path: Path, kind: str) -> Path:
    path = Path(path).absolute()
    if not path.exists():
        if (path.parent / "spec_jax.json").is_file():
            raise damaged(path.parent, "its params/ folder is missing", kind)
        raise SpecJaxError(f"no parameters at {path}: is this a spec_jax checkpoint directory?")
    return path


@contextlib.contextmanager
def _reading(path: Path, kind: str):
    """Reads of the Orbax folder `path`: what fails is reported as `damaged` (one line), and
    Orbax's warnings before such errors (which say the same) are silenced."""
    import logging

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    except SpecJaxError:
        raise
    except Exception as e:  # noqa: BLE001 — orbax/tensorstore raise many kinds for one cause
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise damaged(path.parent, f"its parameters in {path.name}/ cannot be read "
                      f"({type(e).__name__}: {msg})", kind) from None
    finally:
        absl.setLevel(level)


def _load_params(path: Path, skip=None, target=None):
    import orbax.checkpoint as ocp

    if target is not None:
        return _restore_sharded(path, target)
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", meta)
        # on this process's first device: a checkpoint saved on another backend (CPU-trained
        # heads served on a GPU) names devices that are not here
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here), tree)
        if not skip:
            restored = ckptr.restore(path, target)
    if skip:
        target = _without(target, set(skip))
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                                           dtype=s.dtype), target)
        with ocp.PyTreeCheckpointer() as ckptr:
            restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
                item=target, restore_args=args, partial_restore=True))
    return jax.tree.map(jnp.asarray, restored)  # device arrays, not host numpy


def _restore_sharded(path: Path, target: dict) -> dict:
    """`target` (nested dicts of ShapeDtypeStructs with shardings) restored from `path`, one
    tensor at a time: Orbax reads each device's shard where it goes (the shards of one tensor
    concurrently), through a host buffer of the shard's size that it copies onto the device.
    Restoring the whole tree in one call reads every tensor at once, so those buffers add up to
    a second copy of the model (measured: 1.8 GB above a 2.5 GB model on 8 CPU devices); one
    tensor at a time they add up to at most the largest tensor's shards on this host."""
    import orbax.checkpoint as ocp

    out: dict = {}
    with ocp.PyTreeCheckpointer() as ckptr:
        for keys, leaf in jax.tree_util.tree_leaves_with_path(target):
            names = [str(getattr(k, "key", k)) for k in keys]
            item = _nest(names, leaf)
            args = _nest(names, ocp.ArrayRestoreArgs(sharding=leaf.sharding,
                                                     global_shape=leaf.shape, dtype=leaf.dtype))
            got = ckptr.restore(path, args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
            node = out
            for name in names[:-1]:
                node, got = node.setdefault(name, {}), got[name]
            node[names[-1]] = got[names[-1]]
    return out


def _nest(names: list[str], value) -> dict:
    for name in reversed(names):
        value = {name: value}
    return value


def _without(tree: dict, skip: set, prefix: str = "") -> dict:
    return {k: _without(v, skip, f"{prefix}{k}/") if isinstance(v, dict) else v
            for k, v in tree.items() if f"{prefix}{k}" not in skip}
