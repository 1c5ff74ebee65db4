"""Peak host memory of `spec-jax convert` (streaming) and of `load_target` on a synthetic
Llama-shaped checkpoint: random bfloat16 weights written shard by shard with safetensors' NumPy
API (model-0000K-of-0000N.safetensors + model.safetensors.index.json), as published checkpoints
are. Each step runs in its own process under `/usr/bin/time -v` ("Maximum resident set size").

    python scripts/convert_memory.py WORKDIR [--gb 2.2] [--dtype bfloat16] [--keep]

WORKDIR/hf and WORKDIR/ck are removed at the end unless --keep.
"""
import argparse
import json
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


def peak(code: str) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of `python -c code` under /usr/bin/time -v."""
    t = time.time()
    r = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", code], capture_output=True,
                       text=True)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return kb / 1024, time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--gb", type=float, default=2.2, help="size of the checkpoint's files")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    hf, ck = a.workdir / "hf", a.workdir / "ck"
    try:
        t = time.time()
        info = make(hf, a.gb)
        print(f"checkpoint: {info['bytes'] / 1e9:.2f} GB in {info['shards']} shards, "
              f"{info['layers']} layers, largest tensor {info['largest'][0]} "
              f"{info['largest'][1]} = {info['largest'][2] / 1e6:.0f} MB "
              f"({time.time() - t:.0f} s to write)", flush=True)
        base, _ = peak("import jax, orbax.checkpoint, tensorstore, spec_jax.convert.hf; "
                       "jax.numpy.zeros(1).block_until_ready()")
        print(f"baseline (imports only): {base:.0f} MB", flush=True)
        rss, s = peak(f"from spec_jax.cli import main; main(['convert', '--hf', {str(hf)!r}, "
                      f"'--out', {str(ck)!r}, '--dtype', {a.dtype!r}])")
        out = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
        print(f"convert --dtype {a.dtype}: peak RSS {rss:.0f} MB ({s:.0f} s), output "
              f"{out / 1e9:.2f} GB", flush=True)
        rss, s = peak(f"import spec_jax; spec_jax.load_target({str(ck)!r}, layers='scan')")
        print(f"load_target(layers='scan'): peak RSS {rss:.0f} MB ({s:.0f} s)", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(hf, ignore_errors=True)
            shutil.rmtree(ck, ignore_errors=True)


if __name__ == "__main__":
    main()
