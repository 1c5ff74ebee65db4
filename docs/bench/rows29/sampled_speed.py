"""Sampled decoding speed of whichever spec_jax is imported (run it once per checkout with
PYTHONPATH=<checkout> to compare two versions). SmolLM2, 8 MT-bench prompts spread over the
categories, 128 new tokens, temperature 0.7; EAGLE with the tree sized for batch 1 (greedy sizing,
cached, or read from the JSON file given as the first argument: eagle_b1_tree.json beside this
script is the switch this run's cache held); batches of 1 and 8, top_p 1.0 and 0.9. Run from
the repository root after `bash scripts/main.sh`."""
import json
import sys

import numpy as np

import spec_jax
from spec_jax.data import read_prompts, spread
from spec_jax.sizing import cached_tree, tree_name

t = spec_jax.load_target("checkpoints/smollm2-135m-instruct")
eagle = spec_jax.load_draft("checkpoints/smollm2-135m-instruct-eagle")
tree = json.load(open(sys.argv[1])) if sys.argv[1:] else cached_tree(t, eagle, 1)
if tree is None:
    sys.exit("no sized tree for batch 1: run `spec-jax demo` (or generate with tree='auto') first")
prompts = [p.text for p in spread(read_prompts("../shared/data/eval/mt_bench"), 8)]
print(f"spec_jax from {spec_jax.__file__}; EAGLE tree: {tree_name(tree)}")
for b in (1, 8):
    for top_p in (1.0, 0.9):
        for name, draft in (("plain", None), ("EAGLE", eagle)):
            kw = dict(temperature=0.7, top_p=top_p, stop_at_eos=False, draft=draft,
                      tree=tree if draft else None)
            groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
            spec_jax.generate_batch(t, groups[0], 128, **kw)  # compile
            toks, wall, taus = 0, 0.0, []
            for i, g in enumerate(groups):
                rs = spec_jax.generate_batch(t, g, 128, seed=i, **kw)
                toks += sum(r.stats["new_tokens"] for r in rs)
                wall += rs[0].stats["wall_seconds"]
                taus += [r.stats["mean_accepted"] for r in rs]
            print(f"{name:5s} batch {b} top_p {top_p}: {toks / wall:6.1f} tok/s "
                  f"(tau {np.mean(taus):.2f})", flush=True)
