"""Sharded loading and the multi-host path, in processes of their own (run by
tests/test_distributed.py: the device count and jax.distributed are fixed when JAX starts).

    run_distributed.py single CKPT        one process, 8 virtual CPU devices, nothing asks for
                                          jax.distributed: the single-host path
    run_distributed.py worker CKPT        one of several processes (4 virtual CPU devices each)
                                          joined by jax.distributed through the environment
                                          (JAX_COORDINATOR_ADDRESS, SPEC_JAX_NUM_PROCESSES,
                                          SPEC_JAX_PROCESS_ID): a multi-host run on one machine

Each prints one JSON line. CKPT is a tiny target checkpoint (`make_checkpoint`).
"""
import json
import os
import sys
from pathlib import Path

DEVICES = 8 if sys.argv[1:2] == ["single"] else 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import spec_jax  # noqa: E402
from spec_jax import distributed  # noqa: E402
from spec_jax.config import ModelConfig  # noqa: E402
from spec_jax.sharding import shard_fraction  # noqa: E402

# heads, KV heads, MLP and vocabulary divide by 8
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                  num_kv_heads=8, head_dim=8, max_position_embeddings=4096)
PROMPTS = [[5, 9, 3, 7, 1, 2, 5, 9, 3], [4, 4, 8, 1, 6, 2, 9, 11, 3, 5, 7, 12]]


def make_checkpoint(path: Path, seed: int = 0) -> None:
    """A target checkpoint of random weights in `CFG`'s shapes (as `spec-jax convert` lays out)."""
    from spec_jax.io import save_params

    t = spec_jax.random_target(CFG, seed=seed, scale=0.3)
    save_params(path / "params", t.params)
    (path / "spec_jax.json").write_text(json.dumps({"kind": "target", "config": CFG.to_dict()}))


def tokens(target, **kw):
    return [r.token_ids for r in spec_jax.generate_batch(target, PROMPTS, 10, stop_at_eos=False,
                                                         fallback=False, **kw)]


def shards_equal(sharded, whole) -> bool:
    """Whether every shard this process holds is its slice of the one-device arrays."""
    return all(np.array_equal(np.asarray(s.data), np.asarray(w)[s.index])
               for a, w in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole))
               for s in a.addressable_shards)


def single(ckpt: str) -> dict:
    joined = distributed.initialize()  # nothing asks for it here: a no-op
    auto, two = distributed.global_mesh(), distributed.global_mesh(data=2)
    one = spec_jax.load_target(ckpt, layers="scan")
    t = spec_jax.load_target(ckpt, mesh=two)
    half = spec_jax.load_target(ckpt, mesh=two, dtype="bfloat16")
    half_one = spec_jax.load_target(ckpt, layers="scan", dtype="bfloat16")
    heads = spec_jax.init_draft(one, "eagle", seed=7, scale=0.3)
    wq = t.params["layers"]["wq"]
    return {"initialized": joined, "processes": jax.process_count(),
            "auto_mesh": dict(auto.shape), "mesh": dict(two.shape),
            "mesh_rows": [[d.id for d in row] for row in two.devices],
            "params_equal": shards_equal(t.params, one.params),
            "bf16_equal": shards_equal(half.params, half_one.params),
            "bf16_dtype": str(half.params["embed"].dtype),
            "wq_spec": str(wq.sharding.spec),
            "wq_fraction_dev0": shard_fraction(wq, jax.devices()[0]),
            "fingerprint_equal": t.fingerprint() == one.fingerprint(),
            "plain_equal": tokens(t) == tokens(one),
            "eagle_equal": tokens(t, draft=heads, tree="dynamic:2,3,6")
            == tokens(one, draft=heads, tree="dynamic:2,3,6"),
            "parse": [distributed.parse_mesh(x) for x in ("data=2,model=4", "model=8", "auto")],
            "refused": refused(Path(ckpt), two)}


def refused(ckpt: Path, mesh) -> list[str]:
    """The one-line errors of sharded loads of broken copies of `ckpt`: a NaN in one shard, a
    config that disagrees with the weights, unreadable parameters."""
    import shutil

    from spec_jax.io import load_params, save_params

    out = []
    for damage in ("nan", "config", "unreadable"):
        bad = ckpt.parent / f"broken-{damage}"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(ckpt, bad)
        if damage == "nan":
            params = jax.tree.map(np.array, load_params(bad / "params"))
            params["layers"]["wq"][1, 3, -1] = np.nan  # in the last "model" shard only
            shutil.rmtree(bad / "params")
            save_params(bad / "params", params)
        elif damage == "config":
            meta = json.loads((bad / "spec_jax.json").read_text())
            meta["config"]["num_layers"] = 3
            (bad / "spec_jax.json").write_text(json.dumps(meta))
        else:
            for f in (bad / "params").rglob("*"):
                if f.is_file() and f.stat().st_size > 4096:
                    f.write_bytes(b"\0" * 64)
        try:
            spec_jax.load_target(bad, mesh=mesh)
            out.append("loaded")
        except spec_jax.SpecJaxError as e:
            out.append(str(e))
    return out


def worker(ckpt: str) -> dict:
    joined = distributed.initialize()
    mesh = distributed.global_mesh()  # model over this process's devices, data over processes
    one = spec_jax.load_target(ckpt, layers="scan")  # this process's first device, whole
    t = spec_jax.load_target(ckpt, mesh=mesh)
    wq = t.params["layers"]["wq"]
    me = jax.process_index()
    report = {"initialized": joined, "process": me, "processes": jax.process_count(),
              "devices": jax.device_count(), "local_devices": jax.local_device_count(),
              "mesh": dict(mesh.shape),
              "row_is_one_process": [len({d.process_index for d in row}) == 1
                                     for row in mesh.devices],
              "wq_spec": str(wq.sharding.spec),
              "wq_local_fraction": sum(s.data.size for s in wq.addressable_shards) / wq.size,
              "fully_addressable": wq.is_fully_addressable,
              "params_equal": shards_equal(t.params, one.params),
              "fingerprint_equal": t.fingerprint() == one.fingerprint()}
    heads = spec_jax.init_draft(one, "eagle", seed=7, scale=0.3)  # placed on the mesh by bind
    report["plain_equal"] = tokens(t) == tokens(one)
    report["eagle_equal"] = (tokens(t, draft=heads, tree="dynamic:2,3,6")
                             == tokens(one, draft=heads, tree="dynamic:2,3,6"))
    report["cache_k_spec"] = str(t.new_cache(2, 64).k.sharding.spec)
    return report


def main():
    mode, ckpt = sys.argv[1], sys.argv[2]
    if mode == "make":
        return make_checkpoint(Path(ckpt))
    print(json.dumps(single(ckpt) if mode == "single" else worker(ckpt)), flush=True)


if __name__ == "__main__":
    main()
