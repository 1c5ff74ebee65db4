"""Atomic output directories and Orbax save/restore of parameter pytrees."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.errors import SpecJaxError


@contextlib.contextmanager
def atomic_dir(out_dir: Path, force: bool = False):
    """Yield a temporary sibling folder; rename it to out_dir only if the block succeeds."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not force:
        raise SpecJaxError(f"{out_dir} already exists: choose another --out or pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "x")
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_meta(path: Path, kind: str, missing_hint: str) -> dict:
    """The `spec_jax.json` of a checkpoint directory, checked to be of `kind` (target or draft)."""
    import json

    meta_file = Path(path) / "spec_jax.json"
    if not meta_file.is_file():
        raise SpecJaxError(f"{path} is not a spec_jax {kind} checkpoint (no spec_jax.json): {missing_hint}")
    meta = json.loads(meta_file.read_text())
    if meta.get("kind") != kind:
        raise SpecJaxError(f"{path} holds a {meta.get('kind')!r} checkpoint, not a {kind}")
    return meta


def save_params(path: Path, params, dtype: str | None = None) -> None:
    import orbax.checkpoint as ocp

    if dtype is not None:
        dt = jnp.dtype(dtype)
        params = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, dt)), params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), params)


def load_params(path: Path, skip=None):
    """The parameter tree saved at `path`, without the entries whose "/"-joined paths are in
    `skip` (those are not read from disk)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.exists():
        raise SpecJaxError(f"no parameters at {path}: is this a spec_jax checkpoint directory?")
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        tree = getattr(meta, "item_metadata", meta)
        # on this process's first device: a checkpoint saved on another backend (CPU-trained
        # heads served on a GPU) names devices that are not here
        here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
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


def _without(tree: dict, skip: set, prefix: str = "") -> dict:
    return {k: _without(v, skip, f"{prefix}{k}/") if isinstance(v, dict) else v
            for k, v in tree.items() if f"{prefix}{k}" not in skip}
