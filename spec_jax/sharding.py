"""Sharding on a `jax.sharding.Mesh`: one table of partition rules for targets, heads and caches.

A mesh has the axes "data" (rows of a batch) and "model" (tensor parallelism); either may be
missing or of size 1. Parameters are placed by `RULES`, keyed by a parameter's name (the last key
of its path) and naming its trailing dimensions with logical axes, as MaxText's tables do:

  q/k/v and gate/up     split by output (attention heads, KV heads, MLP columns)
  o and down            split by input (the same heads or columns)
  embedding, LM head    split by vocabulary (vocabulary-parallel)
  norms, biases of norms, everything unnamed: replicated

A logical axis maps to the "model" mesh axis only where it divides: heads and KV heads split
whole (a dimension of N heads splits over M devices only when M divides N; SmolLM2's 9 heads and
3 KV heads on 2 devices stay replicated), other axes where M divides their size. A tensor that
does not divide is replicated — never padded, never an error. The KV cache [L, B, KVH, S, D] is
split by rows over "data" (in a run of one process: `batch_axis`) and by KV head over "model" by
the same test; stacked leading axes (layers, modules) are never split. XLA's SPMD partitioner
does the rest: the jitted loop runs on the mesh with the collectives it inserts, and nothing in
spec_jax communicates by hand. `abstract_params` gives the target an Orbax restore reads each
device's shard into (`spec_jax.target.load_target(mesh=)`); docs/sharding.md has the table.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spec_jax.errors import SpecJaxError

DATA, MODEL = "data", "model"

# parameter name -> logical axes of its trailing dimensions (leading stacked axes: replicated)
RULES: dict[str, tuple[str | None, ...]] = {
    "wq": (None, "heads"), "wk": (None, "kv_heads"), "wv": (None, "kv_heads"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "wo": ("heads", None),
    "w_gate": (None, "mlp"), "w_up": (None, "mlp"), "w_down": ("mlp", None),
    "embed": ("vocab", None), "lm_head": (None, "vocab"),
}


def check_mesh(mesh: Mesh | None) -> None:
    """Raise SpecJaxError unless `mesh` is None or a Mesh whose axes are among data and model."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise SpecJaxError(f"mesh must be a jax.sharding.Mesh, not {type(mesh).__name__}")
    extra = [a for a in mesh.axis_names if a not in (DATA, MODEL)]
    if extra:
        raise SpecJaxError(f"mesh axes {extra} are not spec_jax's: name them 'data' (rows of a "
                           "batch) and 'model' (tensor parallelism)")


def axis_size(mesh: Mesh, axis: str) -> int:
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def _unit(logical: str, cfg) -> int:
    """Elements of a logical axis that must stay on one device (a head's dimension)."""
    return cfg.head_dim if logical in ("heads", "kv_heads") else 1


def param_spec(name: str, shape: tuple[int, ...], cfg, mesh: Mesh) -> P:
    """The PartitionSpec `RULES` give a parameter called `name` of `shape` on `mesh`."""
    logical = RULES.get(name)
    m = axis_size(mesh, MODEL)
    if logical is None or m == 1 or len(shape) < len(logical):
        return P()
    lead = (None,) * (len(shape) - len(logical))
    axes = []
    for dim, la in zip(shape[len(lead):], logical):
        axes.append(MODEL if la is not None and dim % (m * _unit(la, cfg)) == 0 else None)
    return P(*lead, *axes)


def _name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", getattr(last, "idx", last))))


def param_shardings(params: Any, cfg, mesh: Mesh) -> Any:
    """NamedShardings for every leaf of a parameter pytree (a target's or heads')."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_name(path), tuple(x.shape), cfg, mesh)),
        params)


def abstract_params(shapes: Any, cfg, mesh: Mesh, dtype=None) -> Any:
    """`jax.ShapeDtypeStruct`s of a parameter pytree placed on `mesh` by `RULES` (in `dtype`
    where given, else each leaf's own): the target an Orbax restore reads each device's shard
    into (`spec_jax.io.load_params(target=)`), so no host holds a full copy."""
    shardings = param_shardings(shapes, cfg, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
                        shapes, shardings)


def shard_params(params: Any, cfg, mesh: Mesh) -> Any:
    """`params` placed on `mesh` by `RULES` (each device receives only its shard)."""
    return jax.device_put(params, param_shardings(params, cfg, mesh))


def batch_axis(mesh: Mesh, batch: int) -> str | None:
    """"data" where the batch splits over it evenly, else None (rows replicated). In a run of
    several processes (a multi-host slice, `spec_jax.distributed`) rows are replicated: each
    process reads every row's result back from its own devices, which a row held only on another
    host's devices would not allow (the hosts then each decode every row, split by "model")."""
    d = axis_size(mesh, DATA)
    return DATA if d > 1 and batch % d == 0 and jax.process_count() == 1 else None


def cache_shardings(cache, cfg, mesh: Mesh):
    """Shardings of a KVCache: K/V [L, B, KVH, S, D] (or per layer [B, KVH, S, D]) by row and KV
    head, valid/pos [B, S] and length [B] by row."""
    b = cache.valid.shape[0]
    rows = batch_axis(mesh, b)
    m = axis_size(mesh, MODEL)
    heads = MODEL if m > 1 and cfg.num_kv_heads % m == 0 else None
    kv = P(rows, heads, None, None)
    kv = kv if cache.per_layer else P(None, *kv)
    ns = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    kvs = tuple(ns(kv) for _ in cache.k) if cache.per_layer else ns(kv)
    return type(cache)(k=kvs, v=kvs, valid=ns(P(rows, None)), pos=ns(P(rows, None)),
                       length=ns(P(rows)))


def shard_cache(cache, cfg, mesh: Mesh):
    return jax.device_put(cache, cache_shardings(cache, cfg, mesh))


def shard_fraction(x: jax.Array, device) -> float:
    """The share of `x`'s elements held on `device` (1.0 when replicated there)."""
    held = sum(s.data.size for s in x.addressable_shards if s.device == device)
    return held / max(x.size, 1)
