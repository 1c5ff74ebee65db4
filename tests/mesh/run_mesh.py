"""Decoding on meshes of 8 virtual CPU devices against one device (run by tests/test_mesh.py in a
process of its own: the device count is fixed when JAX starts)."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import spec_jax  # noqa: E402
from spec_jax.config import ModelConfig  # noqa: E402
from spec_jax.sharding import shard_fraction  # noqa: E402

# a tiny target whose heads, KV heads, MLP and vocabulary divide by 8; head_dim 16: the CPU
# attention kernel's smallest (with 8, "auto" and "cpu" would run XLA's attention)
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                  num_kv_heads=8, head_dim=16, max_position_embeddings=4096)
DRAFTS = {"plain": (None, None), "ngram": ("ngram", "chain:3"),
          "eagle": ("eagle", "dynamic:2,3,6"), "eagle3": ("eagle3", "dynamic:2,3,6"),
          "mtp": ("mtp", None), "medusa": ("medusa", "[[0],[1],[0,0]]")}
PROMPTS = [[5, 9, 3, 7, 1, 2, 5, 9, 3], [4, 4, 8, 1, 6, 2, 9, 11, 3, 5, 7, 12, 40, 2, 4, 4, 8]]


SAMPLED = ("plain", "eagle", "mtp")  # sampled with the same seeds: every row draws as alone


def decode(target, heads, sampled: bool):
    out = {}
    for name, (method, tree) in DRAFTS.items():
        if sampled and name not in SAMPLED:
            continue
        draft = heads[method] if method in heads else method
        kw = dict(temperature=0.8, top_p=0.9, seed=[3, 4]) if sampled else {}
        rows = spec_jax.generate_batch(target, PROMPTS, 12, draft=draft, tree=tree,
                                       stop_at_eos=False, fallback=False, **kw)
        out[name] = [r.token_ids for r in rows]
    return out


def kernels_on_mesh(heads, want: dict) -> dict:
    """Greedy EAGLE-3 decoding on a 2x4 mesh (rows over "data", heads over "model") with each
    attention kernel run per shard, against one device's tokens; and whether the loop compiled
    for "cpu" holds the kernel's FFI call (not XLA's attention in its place)."""
    from pallas_kernels.cpu import build

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    t = spec_jax.random_target(CFG, seed=0, scale=0.3, mesh=mesh)
    method, tree = DRAFTS["eagle3"]
    out = {}
    for impl in ("cpu", "pallas_interpret") if build.available() else ("pallas_interpret",):
        rows = spec_jax.generate_batch(t, PROMPTS, 12, draft=heads[method], tree=tree,
                                       stop_at_eos=False, fallback=False, attn_impl=impl)
        out[impl] = [r.token_ids for r in rows] == want["eagle3"]
    loops = [fn.as_text() for k, fn in t.compiled.items() if k[0] == "loop"]
    return {"equal": out, "cpu_built": build.available(),
            "ffi_in_loop": any("spec_jax_tree_attention" in text for text in loops)}


def smollm2(path: str):
    """SmolLM2 (9 heads, 3 KV heads) with its shipped EAGLE heads on a 2x3 mesh against plain
    decoding on one device."""
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "model"))
    one = spec_jax.load_target(path, layers="scan")
    t = spec_jax.load_target(path, mesh=mesh)
    heads = spec_jax.load_draft(path + "-eagle")
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    plain = [r.token_ids for r in spec_jax.generate_batch(one, prompts, 32)]
    spec = spec_jax.generate_batch(t, prompts, 32, draft=heads, tree="dynamic:4,3,8",
                                   fallback=False)
    wq = t.params["layers"]["wq"]
    print(json.dumps({"equal": [r.token_ids for r in spec] == plain,
                      "tau": [r.stats["mean_accepted"] for r in spec],
                      "wq_spec": str(wq.sharding.spec),
                      "wq_fraction_dev0": shard_fraction(wq, jax.devices()[0]),
                      "cache_k_spec": str(t.new_cache(2, 512).k.sharding.spec)}))


def main():
    if sys.argv[1:2] == ["smollm2"]:
        return smollm2(sys.argv[2])
    meshes = [tuple(int(x) for x in m.split("x")) for m in sys.argv[1:]] or [(1, 8), (2, 4), (8, 1)]
    one = spec_jax.random_target(CFG, seed=0, scale=0.3)
    kw = {"eagle3": {"draft_vocab": 64}, "mtp": {"num_modules": 1, "depth": 3}}
    heads = {m: spec_jax.init_draft(one, m, seed=7, scale=0.3, **kw.get(m, {}))
             for m in ("eagle", "eagle3", "mtp", "medusa")}
    want = {s: decode(one, heads, s) for s in (False, True)}
    report = {"devices": len(jax.devices()), "meshes": {}}
    for d, m in meshes:
        mesh = Mesh(np.array(jax.devices()[:d * m]).reshape(d, m), ("data", "model"))
        t = spec_jax.random_target(CFG, seed=0, scale=0.3, mesh=mesh)
        got = {s: decode(t, heads, s) for s in (False, True)}
        wq = t.params["layers"]["wq"]
        cache = t.new_cache(2, 512)
        bound = heads["eagle"].bind(t)
        report["meshes"][f"{d}x{m}"] = {
            "greedy_equal": {k: got[False][k] == want[False][k] for k in DRAFTS},
            "sampled_equal": {k: got[True][k] == want[True][k] for k in SAMPLED},
            "wq_spec": str(wq.sharding.spec),
            "wq_fraction_dev0": shard_fraction(wq, jax.devices()[0]),
            "embed_fraction_dev0": shard_fraction(t.params["embed"], jax.devices()[0]),
            "cache_k_spec": str(cache.k.sharding.spec),
            "cache_fraction_dev0": shard_fraction(cache.k, jax.devices()[0]),
            "head_wq_spec": str(bound["layer"]["wq"].sharding.spec),
        }
    report["kernels_2x4"] = kernels_on_mesh(heads, want[False])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
