"""Plan for accelerators without one: compile the prefill and the draft-verify loop ahead of time
for an accelerator topology (a TPU slice) from abstract shapes, and read what XLA says of them.

With libtpu installed (`pip install "jax[tpu]"`), `jax.experimental.topologies` describes a TPU
slice on a CPU-only host, and `jax.jit(f).lower(ShapeDtypeStructs with shardings).compile()`
runs XLA's TPU pipeline for real: partitioning by `spec_jax.sharding.RULES`, fusion, memory
assignment. No weights are needed: parameters, heads and caches are `ShapeDtypeStruct`s placed on
the topology's mesh by the same rules `load_target(..., mesh=)` uses. The attention is the Pallas
(Mosaic) kernel by default, run per chip under `jax.shard_map` (`pallas_kernels.sharded`), as a
TPU would run it; `attn_impl="xla"` compiles XLA's attention instead. `compile_plan` returns per
chip the bytes of arguments (weights, heads, cache) and temporaries from `memory_analysis()`,
XLA's cost estimate of each program from `cost_analysis()`, and the fusions and custom calls in
the compiled module. XLA's cost analysis counts a `while` body once, not per trip, so the loop's
figures are one step's; so do the counts (instructions in the module's text).
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spec_jax.cache import cache_for
from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError
from spec_jax.heads.base import Drafter
from spec_jax.sharding import DATA, abstract_params, batch_axis, cache_shardings
from spec_jax.step import LoopSettings, compiled_loop, compiled_prefill


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What XLA reports of one compiled program, per chip."""

    seconds_to_compile: float
    argument_bytes: int  # weights, heads and cache the program reads (its inputs)
    temp_bytes: int  # XLA's temporaries
    flops: float  # one execution (the loop: one step, see the module docstring)
    bytes_accessed: float
    optimal_seconds: float | None  # XLA's estimate, None where it has none
    fusions: int = 0  # fusion instructions in the compiled module (a while body's once)
    custom_calls: int = 0  # custom calls in it (the Mosaic kernels among them)
    mosaic_calls: int = 0  # custom calls to a Mosaic kernel ("tpu_custom_call")
    hlo: str = dataclasses.field(repr=False, default="")


def topology_mesh(topology: str, data: int = 1, model: int | None = None) -> Mesh:
    """A ("data", "model") mesh over the chips of a TPU topology such as "v5e:2x2" (abstract
    devices: compile only)."""
    import os

    # compiling needs no TPU: no slice to look for, and no lock on libtpu against other processes
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # libtpu missing, or a name it does not know
        raise SpecJaxError(f"cannot describe TPU topology {topology!r} ({str(e).splitlines()[0]}): "
                           "install libtpu (pip install 'jax[tpu]') and name one such as "
                           "v5e:2x2, v6e:2x4 or v5p:2x2x2") from None
    devices = np.array(topo.devices)
    n = devices.size
    model = n // data if model is None else model
    if data * model != n:
        raise SpecJaxError(f"mesh data={data}, model={model} does not cover the {n} chips of "
                           f"{topology}")
    return Mesh(devices.reshape(data, model), (DATA, "model"))


def _abstract(tree, shardings):
    return jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n),
                        tree, shardings)


def abstract_target(cfg: ModelConfig, mesh: Mesh):
    """The target's parameters as ShapeDtypeStructs in cfg.dtype, placed by the rules."""
    from spec_jax.models.llama import init_params

    dt = jnp.dtype(cfg.dtype)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    return abstract_params(shapes, cfg, mesh, dt)


def abstract_heads(cfg: ModelConfig, method: str, tparams, mesh: Mesh, tree=None, **hparams):
    """(drafter, bound head params as ShapeDtypeStructs) of fresh `method` heads on the mesh."""
    from spec_jax.heads.methods import method_of
    from spec_jax.heads.registry import DraftHeads
    from spec_jax.heads.vocab import bind_target

    m = method_of(method)
    hp = {**m.defaults, **hparams}
    m.check(hp)
    dt = jnp.dtype(cfg.dtype)
    box = {}

    def init():
        params, hp2 = m.init_params(cfg, jax.random.PRNGKey(0), 0.02, dict(hp), None)
        box["hparams"] = hp2
        return params

    hshapes = jax.eval_shape(init)
    hshapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        s.shape, dt if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype), hshapes)
    heads = DraftHeads(method=method, params=None, hparams=box["hparams"], target_info={}, tcfg=cfg)
    drafter = heads.drafter(tree)
    bound = jax.eval_shape(lambda p, t: bind_target(p, t, cfg), hshapes, tparams)
    return drafter, abstract_params(bound, cfg, mesh)


FUSION = re.compile(r"\sfusion\(")  # an instruction's opcode: `%name = type fusion(operands...`
CUSTOM_CALL = re.compile(r"\scustom-call\(")
MOSAIC = 'custom_call_target="tpu_custom_call"'


def _report(compiled, seconds) -> Compiled:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    hlo = compiled.as_text()
    return Compiled(seconds_to_compile=seconds, argument_bytes=int(mem.argument_size_in_bytes),
                    temp_bytes=int(mem.temp_size_in_bytes), flops=float(cost.get("flops", 0.0)),
                    bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                    optimal_seconds=cost.get("optimal_seconds"), fusions=len(FUSION.findall(hlo)),
                    custom_calls=len(CUSTOM_CALL.findall(hlo)), mosaic_calls=hlo.count(MOSAIC),
                    hlo=hlo)


def compile_plan(cfg: ModelConfig, mesh: Mesh, batch: int = 1, context: int = 8192,
                 drafter: Drafter | None = None, dparams: Any = (), prompt: int = 64,
                 out_len: int = 128, attn_impl: str = "pallas") -> dict[str, Compiled]:
    """Compile the prefill and the loop of `drafter` (None: plain decoding) for a target of `cfg`
    on `mesh`, a `batch` of rows and a cache of `context` slots, the target's and the drafter's
    attention by `attn_impl` ("pallas": the Mosaic kernel per chip; "xla"); {"prefill": ...,
    "loop": ...}."""
    drafter = (drafter or Drafter()).with_attn_impl(attn_impl)
    tparams = abstract_target(cfg, mesh)
    cache = jax.eval_shape(lambda: cache_for(cfg, batch, context))
    cache = _abstract(cache, cache_shardings(cache, cfg, mesh))
    rows = NamedSharding(mesh, P(batch_axis(mesh, batch)))
    row2 = NamedSharding(mesh, P(batch_axis(mesh, batch), None))

    def a(shape, dt, sh):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    args = (tparams, dparams, a((batch, prompt), jnp.int32, row2), a((batch,), jnp.int32, rows),
            cache, a((batch, 2), jnp.uint32, row2), a((batch,), jnp.float32, rows),
            a((batch,), jnp.float32, rows), a((batch,), jnp.int32, rows))
    settings = LoopSettings(out_len=out_len, greedy=True, eos_ids=(0,), attn_impl=attn_impl)
    precision = "highest" if cfg.dtype == "float32" else "default"
    out = {}
    with jax.default_matmul_precision(precision):
        t0 = time.perf_counter()
        pre = compiled_prefill(cfg, drafter, settings).lower(*args).compile()
        out["prefill"] = _report(pre, time.perf_counter() - t0)
        t0 = time.perf_counter()
        loop = compiled_loop(cfg, drafter, settings).lower(
            tparams, dparams, pre.out_info, *args[6:],
            a((), jnp.int32, NamedSharding(mesh, P()))).compile()  # the step budget
        out["loop"] = _report(loop, time.perf_counter() - t0)
    return out


# per chip: HBM bytes, HBM bytes/s, bfloat16 flop/s (public figures of Cloud TPU generations)
CHIPS = {"v4": (32e9, 1.2e12, 275e12), "v5e": (16e9, 819e9, 197e12),
         "v5p": (95e9, 2.76e12, 459e12), "v6e": (32e9, 1.64e12, 918e12)}


def chip_of(topology: str) -> tuple[float, float, float]:
    gen = topology.split(":", 1)[0]
    if gen not in CHIPS:
        raise SpecJaxError(f"no chip figures for {gen!r}: topologies of {', '.join(CHIPS)}")
    return CHIPS[gen]


def roofline_seconds(weight_bytes: float, cache_bytes: float, flops: float, chip) -> float:
    """A step's time bound on one chip: its bytes read at HBM bandwidth or its flops at peak,
    whichever is longer (weights and the cache's filled part are read once a step)."""
    _, bandwidth, peak = chip
    return max((weight_bytes + cache_bytes) / bandwidth, flops / peak)


def plan(cfg: ModelConfig, topology: str, data: int = 1, model: int | None = None,
         batch: int = 1, context: int = 8192, method: str | None = None, tree=None,
         attn_impl: str = "pallas") -> dict:
    """Compile plain decoding (and `method` heads drafting `tree`) for `topology` with `attn_impl`
    attention ("pallas": the Mosaic kernel per chip; "xla"), and answer whether it fits each
    chip's HBM, with what would fit where it does not, each step's time bound (`roofline_seconds`,
    labelled as such; XLA's own estimate beside it where it has one) and each compiled program's
    fusions and custom calls (`hlo_counts`)."""
    chip = chip_of(topology)
    mesh = topology_mesh(topology, data, model)
    m = mesh.shape["model"]
    hbm = chip[0]
    itemsize = jnp.dtype(cfg.dtype).itemsize
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_target(cfg, mesh)))
    weights = n_params * itemsize / m  # the rules split nearly every matrix over "model"
    cache = (2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * itemsize
             / (m if cfg.num_kv_heads % m == 0 else 1) / (data if batch % data == 0 else 1))
    report = {"topology": topology, "mesh": {"data": data, "model": m}, "batch": batch,
              "context": context, "dtype": cfg.dtype, "attention": attn_impl, "hbm_bytes": hbm,
              "weight_bytes_per_chip": weights, "cache_bytes_per_chip": cache}
    if weights + cache > 0.9 * hbm:  # no compile needed to say so: what would fit instead
        report.update(compiled=False, fits=False, per_chip_bytes=weights + cache,
                      plain_step_seconds=None, tree_step_seconds=None,
                      would_fit=_what_fits(cfg, topology, data, m, batch, context, weights,
                                           cache, hbm))
        return report
    try:
        runs = {"plain": compile_plan(cfg, mesh, batch, context, attn_impl=attn_impl)}
        if method:
            d, dp = abstract_heads(cfg, method, abstract_target(cfg, mesh), mesh, tree)
            runs["tree"] = compile_plan(cfg, mesh, batch, context, drafter=d, dparams=dp,
                                        attn_impl=attn_impl)
    except jax.errors.JaxRuntimeError as e:  # XLA's memory assignment: does not fit after all
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        report.update(compiled=False, fits=False, per_chip_bytes=weights + cache,
                      plain_step_seconds=None, tree_step_seconds=None,
                      xla=str(e).splitlines()[0],
                      would_fit=_what_fits(cfg, topology, data, m, batch, context, weights,
                                           cache, hbm))
        return report
    per_chip = max(c.argument_bytes + c.temp_bytes for r in runs.values() for c in r.values())
    flops_token = 2 * n_params / m
    report.update(compiled=True, fits=per_chip <= hbm, per_chip_bytes=per_chip,
                  temp_bytes=max(c.temp_bytes for r in runs.values() for c in r.values()))
    filled = cache / 2  # half the context filled, on average over a generation
    report["plain_step_seconds"] = roofline_seconds(weights, filled, batch * flops_token, chip)
    report["tree_step_seconds"] = None
    if method:
        tokens = getattr(d, "tree_size", 1)
        report["tree_tokens"] = tokens
        report["tree_step_seconds"] = roofline_seconds(weights, filled,
                                                       batch * tokens * flops_token, chip)
    report["step_seconds_kind"] = "roofline (bytes at HBM bandwidth, flops at peak)"
    report["xla_optimal_seconds"] = {k: (r["loop"].optimal_seconds
                                         if (r["loop"].optimal_seconds or -1) > 0 else None)
                                     for k, r in runs.items()}
    report["compile_seconds"] = {k: sum(c.seconds_to_compile for c in r.values())
                                 for k, r in runs.items()}
    report["hlo_counts"] = {k: {name: {"fusions": c.fusions, "custom_calls": c.custom_calls,
                                       "mosaic_calls": c.mosaic_calls}
                                for name, c in r.items()} for k, r in runs.items()}
    if not report["fits"]:
        report["would_fit"] = _what_fits(cfg, topology, data, m, batch, context, weights, cache,
                                         hbm)
    return report


def _what_fits(cfg, topology, data, m, batch, context, weights, cache, hbm) -> list[str]:
    """Ways to fit: more chips for the model, a shorter context, a smaller batch."""
    out = []
    for more in (2, 4, 8, 16):
        if (weights + cache) / more <= 0.9 * hbm:
            out.append(f"model={m * more} (a slice of {data * m * more} chips of this kind)")
            break
    room = 0.9 * hbm - weights
    if room > 0 and cache > 0:
        ctx = int(context * room / cache) // 512 * 512
        if ctx >= 512:
            out.append(f"context <= {ctx}")
        b = int(batch * room / cache)
        if 1 <= b < batch:
            out.append(f"batch <= {b}")
    if not out:
        out.append("a chip with more HBM (weights alone exceed it at this model split)")
    return out
