"""Sharding on a mesh of 8 virtual CPU devices: the same tokens as one device (with the attention
kernels run per shard too), and the parameters and caches really split (tests/mesh/run_mesh.py, in
a process of its own)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMOLLM2

RUN = Path(__file__).parent / "mesh" / "run_mesh.py"


def _run(*args) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(RUN.parents[2])}
    p = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, env=env,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_meshes_decode_as_one_device_and_split_what_they_hold():
    report = _run("1x8", "2x4", "8x1")
    assert report["devices"] == 8
    for name, m in report["meshes"].items():
        assert all(m["greedy_equal"].values()), (name, m["greedy_equal"])
        assert all(m["sampled_equal"].values()), (name, m["sampled_equal"])
        model = int(name.split("x")[1])
        if model > 1:  # q split by heads, the embedding by vocabulary, the cache by KV head
            assert m["wq_spec"] == "P(None, None, 'model')" and m["head_wq_spec"] == "P(None, 'model')"
            assert m["wq_fraction_dev0"] == pytest.approx(1 / model)
            assert m["embed_fraction_dev0"] == pytest.approx(1 / model)
            assert "'model'" in m["cache_k_spec"]
        else:
            assert m["wq_fraction_dev0"] == 1.0  # nothing to split tensors over
    # rows split over "data" where the batch (2 rows) divides: the 2x4 mesh
    assert report["meshes"]["2x4"]["cache_k_spec"] == "P(None, 'data', 'model', None, None)"
    assert report["meshes"]["2x4"]["cache_fraction_dev0"] == pytest.approx(1 / 8)
    # the attention kernels per shard (rows over "data", heads over "model"): one device's tokens
    kernels = report["kernels_2x4"]
    assert all(kernels["equal"].values()) and "pallas_interpret" in kernels["equal"], kernels
    assert kernels["ffi_in_loop"] == kernels["cpu_built"]  # "cpu" ran the FFI kernel, not XLA's


@pytest.mark.smollm2
def test_smollm2_with_its_eagle_heads_on_a_2x3_mesh_equals_plain_decoding(smollm2):
    report = _run("smollm2", str(SMOLLM2))
    assert report["equal"], report
    # 9 heads and 3 KV heads split over 3 devices: a third each
    assert report["wq_spec"] == "P(None, None, 'model')"
    assert report["wq_fraction_dev0"] == pytest.approx(1 / 3)
    assert report["cache_k_spec"] == "P(None, 'data', 'model', None, None)"
