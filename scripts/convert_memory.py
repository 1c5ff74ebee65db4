"""Peak host memory of `spec-jax convert` (streaming) and of `load_target` on a synthetic
Llama-shaped checkpoint: random bfloat16 weights written shard by shard with safetensors' NumPy
API (model-0000K-of-0000N.safetensors + model.safetensors.index.json), as published checkpoints
are. Each step runs in its own process under `/usr/bin/time -v` ("Maximum resident set size").

    python scripts/convert_memory.py WORKDIR [--gb 2.2] [--dtype bfloat16] [--keep] [--reuse]
        [--mesh model=8 --mesh data=2,model=4] [--load-dtype float32] [--hosts 2]

Loads: on one device (layers='scan'), then with `mesh=` for each --mesh over 8 virtual CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=8). On CPU every device's shard lives
in the same host memory, so a mesh load holds the model once (its shards) plus replicated
tensors once per device: the figure to compare is the peak above the model's own bytes (what a
full host copy would add). Each load also reports the bytes its devices hold (`held`, summed
over devices) and the largest share one device holds. With --hosts N the mesh loads run as N
processes of 8/N devices joined by jax.distributed, as the hosts of a TPU slice: each process
reports its own peak and the shards it holds. WORKDIR/hf and WORKDIR/ck are removed at
the end unless --keep; --reuse skips writing and converting where WORKDIR/ck exists.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 8192, 16, 4, 64000


def sizes(layers: int) -> dict[str, tuple]:
    hd = HIDDEN // HEADS
    out = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
           "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (HIDDEN,),
                    p + "post_attention_layernorm.weight": (HIDDEN,),
                    p + "self_attn.q_proj.weight": (HEADS * hd, HIDDEN),
                    p + "self_attn.k_proj.weight": (KV_HEADS * hd, HIDDEN),
                    p + "self_attn.v_proj.weight": (KV_HEADS * hd, HIDDEN),
                    p + "self_attn.o_proj.weight": (HIDDEN, HEADS * hd),
                    p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                    p + "mlp.up_proj.weight": (INTER, HIDDEN),
                    p + "mlp.down_proj.weight": (HIDDEN, INTER)})
    return out


def make(hf: Path, gb: float, shard_bytes: int = 500 << 20) -> dict:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    per_layer = sum(int(np.prod(s)) for n, s in sizes(1).items() if ".layers." in n)
    fixed = sum(int(np.prod(s)) for n, s in sizes(0).items())
    layers = max(1, round((gb * 1e9 / 2 - fixed) / per_layer))
    shapes = sizes(layers)
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    groups, cur, size = [], [], 0
    for n, s in shapes.items():
        b = 2 * int(np.prod(s))
        if cur and size + b > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    groups.append(cur)
    rng = np.random.default_rng(0)
    weight_map = {}
    for k, names in enumerate(groups):
        f = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for n in names:
            a = rng.standard_normal(shapes[n], dtype=np.float32) * 0.02
            shard[n] = (a + 1 if n.endswith("norm.weight") else a).astype(ml_dtypes.bfloat16)
        save_file(shard, str(hf / f))  # one shard in memory at a time
        weight_map.update({n: f for n in names})
        del shard
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    largest = max(shapes, key=lambda n: int(np.prod(shapes[n])))
    return {"layers": layers, "shards": len(groups),
            "bytes": sum((hf / f).stat().st_size for f in set(weight_map.values())),
            "largest": (largest, shapes[largest], 2 * int(np.prod(shapes[largest])))}


def peak(code: str, devices: int = 1) -> tuple[float, float, str]:
    """(peak RSS in MB, seconds, last stdout line) of `python -c code` under /usr/bin/time -v,
    with `devices` virtual CPU devices."""
    return peaks(code, devices)[0]


def peaks(code: str, devices: int = 1, hosts: int = 1) -> list[tuple[float, float, str]]:
    """`peak` of each of `hosts` processes running `code` at once, joined by jax.distributed
    (a coordinator on this machine, `spec_jax.distributed`) where there are several: the
    processes of a multi-host run, on one machine."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for k in ("TPU_WORKER_HOSTNAMES", "SPEC_JAX_DISTRIBUTED"):
        env.pop(k, None)
    if devices > 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={devices}").strip()
    if hosts > 1:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{sock.getsockname()[1]}",
                       SPEC_JAX_NUM_PROCESSES=str(hosts))
    t = time.time()
    procs = [subprocess.Popen(["/usr/bin/time", "-v", sys.executable, "-c", code],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(env, SPEC_JAX_PROCESS_ID=str(i)))
             for i in range(hosts)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode:
            sys.exit(stderr[-3000:])
        kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))
        lines = stdout.strip().splitlines()
        out.append((kb / 1024, time.time() - t, lines[-1] if lines else ""))
    return out


# what a load holds: bytes summed over devices, and the most one device holds
HELD = ("import json, collections, jax; c = collections.Counter(); "
        "[c.update({s.device: s.data.nbytes}) for a in jax.tree.leaves(t.params) "
        "for s in a.addressable_shards]; "
        "print(json.dumps({'held': sum(c.values()), 'per_device': max(c.values())}))")


def mesh_code(ck: Path, mesh: str, dtype: str | None, hosts: int = 1) -> str:
    """A load of `ck` on a ("data", "model") mesh written as data=D,model=M (8 devices; over
    `hosts` processes: `spec_jax.distributed.global_mesh`)."""
    axes = dict(kv.split("=") for kv in mesh.split(","))
    d, m = int(axes.get("data", 1)), int(axes.get("model", 1))
    make = (f"from spec_jax import distributed; mesh = distributed.global_mesh({d}, {m}); "
            if hosts > 1 else "from jax.sharding import Mesh; "
            f"mesh = Mesh(np.array(jax.devices()[:{d * m}]).reshape({d}, {m}), ('data', 'model')); ")
    return ("import jax, numpy as np, spec_jax; " + make +
            f"t = spec_jax.load_target({str(ck)!r}, dtype={dtype!r}, mesh=mesh); " + HELD)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--gb", type=float, default=2.2, help="size of the checkpoint's files")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true",
                    help="keep WORKDIR/ck where it exists: measure the loads only")
    ap.add_argument("--mesh", action="append", default=None,
                    help="data=D,model=M over 8 virtual CPU devices (repeatable; default: "
                         "model=8 and data=2,model=4)")
    ap.add_argument("--load-dtype", default=None, help="load_target's dtype= on the meshes")
    ap.add_argument("--hosts", type=int, default=1,
                    help="load on the meshes as this many processes of 8/HOSTS devices each, "
                         "joined by jax.distributed (a multi-host run on one machine): each "
                         "reports what it holds")
    a = ap.parse_args()
    hf, ck = a.workdir / "hf", a.workdir / "ck"
    try:
        if not (a.reuse and (ck / "spec_jax.json").is_file()):
            t = time.time()
            info = make(hf, a.gb)
            print(f"checkpoint: {info['bytes'] / 1e9:.2f} GB in {info['shards']} shards, "
                  f"{info['layers']} layers, largest tensor {info['largest'][0]} "
                  f"{info['largest'][1]} = {info['largest'][2] / 1e6:.0f} MB "
                  f"({time.time() - t:.0f} s to write)", flush=True)
            rss, s, _ = peak(f"from spec_jax.cli import main; main(['convert', '--hf', "
                             f"{str(hf)!r}, '--out', {str(ck)!r}, '--dtype', {a.dtype!r}])")
            out = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
            print(f"convert --dtype {a.dtype}: peak RSS {rss:.0f} MB ({s:.0f} s), output "
                  f"{out / 1e9:.2f} GB", flush=True)
        base, _, _ = peak("import jax, orbax.checkpoint, tensorstore, spec_jax.convert.hf; "
                          "jax.numpy.zeros(1).block_until_ready()")
        print(f"baseline (imports only): {base:.0f} MB", flush=True)
        rss, s, held = peak(f"import spec_jax; t = spec_jax.load_target({str(ck)!r}, "
                            "layers='scan'); " + HELD)
        held = json.loads(held)
        print(f"load_target(layers='scan'): peak RSS {rss:.0f} MB ({s:.0f} s), holds "
              f"{held['held'] / 2**20:.0f} MB: {rss - base - held['held'] / 2**20:.0f} MB above "
              "baseline + what it holds", flush=True)
        base8, _, _ = peak("import jax, orbax.checkpoint, spec_jax; "
                           "jax.numpy.zeros(1).block_until_ready()", devices=8)
        print(f"baseline with 8 devices: {base8:.0f} MB", flush=True)
        for mesh in a.mesh or ["model=8", "data=2,model=4"]:
            runs = peaks(mesh_code(ck, mesh, a.load_dtype, a.hosts), 8 // a.hosts, a.hosts)
            for i, (rss, s, held) in enumerate(runs):
                held = json.loads(held)
                who = f", process {i} of {a.hosts}" if a.hosts > 1 else ""
                print(f"load_target(mesh {mesh}{', dtype=' + a.load_dtype if a.load_dtype else ''}"
                      f"{who}): peak RSS {rss:.0f} MB ({s:.0f} s); its devices hold "
                      f"{held['held'] / 2**20:.0f} MB ({held['per_device'] / 2**20:.0f} MB the most"
                      f" on one): {rss - base8 - held['held'] / 2**20:.0f} MB above baseline + "
                      "what the devices hold", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(hf, ignore_errors=True)
            shutil.rmtree(ck, ignore_errors=True)


if __name__ == "__main__":
    main()
