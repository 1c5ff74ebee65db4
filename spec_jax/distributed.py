"""Runs spanning several hosts (a multi-host TPU slice): `jax.distributed` where the environment
asks for it, and the ("data", "model") mesh over every host's devices.

The same program runs on every host (`gcloud compute tpus tpu-vm ssh NAME --worker=all
--command=...`, docs/sharding.md). `initialize()` connects the processes before JAX starts its
backend; `jax.devices()` then lists every chip of the slice, a jitted program runs on all of them
at once (each process driving its own chips), and `load_target(path, mesh=global_mesh())` has
each host read only its own devices' shards. On one host, where nothing asks for it, both are the
single-process path: `initialize()` does nothing and `global_mesh()` spans the local devices.

`initialize()` connects when SPEC_JAX_DISTRIBUTED is 1 (JAX then finds the coordinator, the
number of processes and this one's id itself, as it does on Cloud TPU, GKE, Slurm and Open MPI),
never when it is 0, and otherwise where the environment names several processes: a coordinator
(JAX_COORDINATOR_ADDRESS, with SPEC_JAX_NUM_PROCESSES and SPEC_JAX_PROCESS_ID where JAX cannot find
them: a plain set of machines, or several processes on one for tests), a TPU slice whose worker
list (TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES) has more than one host, or a multislice
coordinator (MEGASCALE_COORDINATOR_ADDRESS). A TPU VM of a multi-host slice created with gcloud
need not export its worker list, so the recipe sets SPEC_JAX_DISTRIBUTED=1.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from spec_jax.errors import SpecJaxError
from spec_jax.sharding import DATA, MODEL

ENV = "SPEC_JAX_DISTRIBUTED"
YES, NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def wanted() -> bool:
    """Whether the environment asks for a multi-process run (see the module's doc)."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in YES:
        return True
    if v in NO:
        return False
    if v:
        raise SpecJaxError(f"{ENV}={os.environ[ENV]!r}: set it to 1 (connect the hosts with "
                           "jax.distributed) or 0 (never), or leave it unset (where the "
                           "environment names several processes)")
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES") or ""
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize() -> bool:
    """Connect this process to the others with `jax.distributed.initialize()` where the
    environment asks for it (`wanted`); True when the run spans several processes. Call it before
    anything else uses JAX. Idempotent; on one host, where nothing asks for it, a no-op."""
    if jax.distributed.is_initialized():
        return True
    if not wanted():
        return False
    kw = {}
    for key, env in (("num_processes", "SPEC_JAX_NUM_PROCESSES"),
                     ("process_id", "SPEC_JAX_PROCESS_ID")):
        if os.environ.get(env, "").strip():
            try:
                kw[key] = int(os.environ[env])
            except ValueError:
                raise SpecJaxError(f"{env}={os.environ[env]!r} is not an integer") from None
    try:
        jax.distributed.initialize(**kw)
    except RuntimeError as e:
        if "before" in str(e):
            raise SpecJaxError("jax.distributed must start before JAX does: call "
                               "spec_jax.distributed.initialize() (or global_mesh()) before "
                               "anything else uses JAX") from None
        raise SpecJaxError(_one_line("cannot connect the hosts with jax.distributed", e)) from None
    except (ValueError, TypeError) as e:
        raise SpecJaxError(_one_line(
            "jax.distributed cannot tell the coordinator, the number of processes or this "
            "process's id here (set JAX_COORDINATOR_ADDRESS=HOST:PORT, SPEC_JAX_NUM_PROCESSES and "
            "SPEC_JAX_PROCESS_ID)", e)) from None
    return True


def _one_line(what: str, e: Exception) -> str:
    return f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def is_primary() -> bool:
    """Whether this is the process that reports (the first): every process runs the same
    generation, one prints it."""
    return jax.process_index() == 0


def parse_mesh(text: str) -> tuple[int | None, int | None]:
    """(data, model) of a mesh written "data=D,model=M" (either may be left out) or "auto"
    (both None: `global_mesh`'s default)."""
    text = text.strip()
    if text == "auto":
        return None, None
    sizes: dict[str, int] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in (DATA, MODEL) or key in sizes or not value.strip().isdigit() \
                or int(value) < 1:
            raise SpecJaxError(f"--mesh {text!r}: write data=D,model=M (D*M devices; either may be "
                               "left out) or auto (model over each host's devices, data over "
                               "the hosts)")
        sizes[key] = int(value)
    return sizes.get(DATA), sizes.get(MODEL)


def global_mesh(data: int | None = None, model: int | None = None) -> Mesh:
    """A ("data", "model") mesh over every process's devices (`initialize()` first). By default
    "model" spans each host's devices and "data" the hosts: tensor parallelism where the chips
    are closest, a replica of the model per host. Given one size, the other takes the rest of the
    devices; given both, data*model must be the number of devices."""
    initialize()
    n, local, hosts = jax.device_count(), jax.local_device_count(), jax.process_count()
    if data is None and model is None:
        data, model = hosts, local
    elif model is None:
        model = n // data if data and n % data == 0 else 0
    elif data is None:
        data = n // model if model and n % model == 0 else 0
    if not data or not model or data * model != n:
        raise SpecJaxError(f"a mesh of data={data or '?'}, model={model or '?'} does not cover the "
                           f"{n} devices here ({hosts} host(s) of {local}): choose sizes whose "
                           f"product is {n}")
    return Mesh(_devices(data, model, local, hosts), (DATA, MODEL))


def _devices(data: int, model: int, local: int, hosts: int) -> np.ndarray:
    """The devices laid out [data, model]: where "model" covers whole hosts, each host's devices
    form one block of a row (`create_hybrid_device_mesh` with a process per granule), so a
    row's tensor-parallel traffic stays within its hosts; otherwise the order JAX's
    topology-aware `create_device_mesh` gives (a row of CPU devices: jax.devices() in order)."""
    from jax.experimental import mesh_utils

    if hosts > 1 and model % local == 0:
        return mesh_utils.create_hybrid_device_mesh(
            (1, local), (data, model // local), process_is_granule=True)
    try:
        return mesh_utils.create_device_mesh((data, model))
    except (ValueError, NotImplementedError, AssertionError):  # a shape the topology cannot lay
        return np.array(jax.devices()).reshape(data, model)
