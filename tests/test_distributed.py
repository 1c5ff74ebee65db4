"""Sharded restore and the multi-host path (spec_jax.distributed), each in processes of their own
(tests/mesh/run_distributed.py): on one host with 8 virtual CPU devices, and as two processes of
4 devices joined by jax.distributed on this machine, the way the hosts of a TPU slice are."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spec_jax.distributed import parse_mesh, wanted
from spec_jax.errors import SpecJaxError

RUN = Path(__file__).parent / "mesh" / "run_distributed.py"
ROOT = RUN.parents[2]
CLEAN = ("SPEC_JAX_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS",
         "TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES", "SPEC_JAX_NUM_PROCESSES",
         "SPEC_JAX_PROCESS_ID", "XLA_FLAGS")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dist") / "target"
    path.mkdir()
    subprocess.run([sys.executable, str(RUN), "make", str(path)], env=_env(), check=True,
                   timeout=600)
    return str(path)


def _report(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_single_host_path_restores_shards_that_equal_one_device(ckpt):
    r = _report(subprocess.run([sys.executable, str(RUN), "single", ckpt], capture_output=True,
                               text=True, env=_env(), timeout=1200))
    assert r["initialized"] is False and r["processes"] == 1  # nothing asked for jax.distributed
    assert r["auto_mesh"] == {"data": 1, "model": 8}  # one host: model over its devices
    assert r["mesh"] == {"data": 2, "model": 4}
    assert r["mesh_rows"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert r["params_equal"] and r["bf16_equal"] and r["bf16_dtype"] == "bfloat16"
    assert r["wq_spec"] == "P(None, None, 'model')" and r["wq_fraction_dev0"] == pytest.approx(0.25)
    assert r["fingerprint_equal"] and r["plain_equal"] and r["eagle_equal"]
    assert r["parse"] == [[2, 4], [None, 8], [None, None]]
    nan, config, unreadable = r["refused"]
    assert "non-finite weights" in nan and "'layers/wq'" in nan
    assert "num_layers=3 disagrees with the weights" in config
    assert "is damaged" in unreadable and "\n" not in unreadable


def test_two_processes_joined_by_jax_distributed_each_hold_their_own_shards(ckpt):
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(RUN), "worker", ckpt], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                       SPEC_JAX_NUM_PROCESSES="2", SPEC_JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=1200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = [_report(subprocess.CompletedProcess(p.args, p.returncode, o, e))
               for p, (o, e) in zip(procs, outs)]
    for i, r in enumerate(reports):
        assert r["initialized"] and r["process"] == i and r["processes"] == 2
        assert r["devices"] == 8 and r["local_devices"] == 4
        assert r["mesh"] == {"data": 2, "model": 4} and all(r["row_is_one_process"])
        assert r["wq_spec"] == "P(None, None, 'model')" and not r["fully_addressable"]
        assert r["wq_local_fraction"] == pytest.approx(1.0)  # its replica, in 4 shards
        assert r["params_equal"] and r["fingerprint_equal"]
        assert r["plain_equal"] and r["eagle_equal"]
        # rows replicated over "data" (each host reads every row back), split by KV head
        assert r["cache_k_spec"] == "P(None, None, 'model', None, None)"


def test_the_environment_decides_and_bad_values_are_refused(monkeypatch):
    for k in CLEAN:
        monkeypatch.delenv(k, raising=False)
    assert not wanted()
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host TPU VM
    assert not wanted()
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w-0,w-1,w-2,w-3")  # a v5e-16 / v6e-16 slice
    assert wanted()
    monkeypatch.setenv("SPEC_JAX_DISTRIBUTED", "0")
    assert not wanted()
    monkeypatch.setenv("SPEC_JAX_DISTRIBUTED", "maybe")
    with pytest.raises(SpecJaxError, match="SPEC_JAX_DISTRIBUTED"):
        wanted()
    for bad in ("data=2,model=x", "rows=2", "model=0", "data=2,data=2"):
        with pytest.raises(SpecJaxError, match="--mesh"):
            parse_mesh(bad)


@pytest.mark.smollm2
def test_generate_cli_on_a_mesh_prints_what_one_device_does(smollm2):
    from tests.conftest import SMOLLM2

    def generate(*extra) -> dict:
        cmd = [sys.executable, "-m", "spec_jax.cli", "generate", "--model", str(SMOLLM2),
               "--prompt", "Name three colours.", "--max-new-tokens", "12", "--json", *extra]
        env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=8", SPEC_JAX_XLA_CACHE="0")
        return _report(subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200))

    one = generate()
    assert generate("--mesh", "data=2,model=4")["token_ids"] == one["token_ids"]
    p = subprocess.run([sys.executable, "-m", "spec_jax.cli", "generate", "--prompt", "x",
                        "--mesh", "data=3,model=4"], capture_output=True, text=True,
                       env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"), timeout=600)
    assert p.returncode == 2 and "does not cover the 8 devices" in p.stderr, p.stderr[-2000:]
