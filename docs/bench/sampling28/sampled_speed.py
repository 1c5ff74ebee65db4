"""Sampled decoding speed with the verification of run 27 (verify_before.py: a walk over the
tree's children with full-vocabulary updates, Gumbel sampling over V) and of run 28 (closed-form
picks over [B, T, K], two-level inverse-CDF sampling, nucleus from the top 64). SmolLM2, 8 MT-bench
prompts spread over the categories, 128 new tokens, temperature 0.7; EAGLE with the tree sized for
batch 1 (greedy sizing, cached). Run from the repository root after `bash scripts/main.sh`;
`python sampled_speed.py plain 1 1.0` runs one pair (drafter, batch, top_p) only.

Archival: written for the library as of commit f860519 (run it in a checkout of that commit);
since then the loop passes each row its own key, which verify_before.py does not take."""
import importlib.util
import sys
from pathlib import Path

import numpy as np

import spec_jax
import spec_jax.step as step
import spec_jax.verify as new
from spec_jax.data import read_prompts, spread
from spec_jax.sizing import cached_tree, tree_name

spec = importlib.util.spec_from_file_location("verify_before", Path(__file__).with_name("verify_before.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

t = spec_jax.load_target("checkpoints/smollm2-135m-instruct")
eagle = spec_jax.load_draft("checkpoints/smollm2-135m-instruct-eagle")
tree = cached_tree(t, eagle, 1)
if tree is None:
    sys.exit("no sized tree for batch 1: run `spec-jax demo` (or generate with tree='auto') first")
prompts = [p.text for p in spread(read_prompts("../shared/data/eval/mt_bench"), 8)]
print(f"EAGLE tree: {tree_name(tree)}")
only = sys.argv[1:4]
for b in (1, 8):
    for top_p in (1.0, 0.9):
        for name, draft in (("plain", None), ("EAGLE", eagle)):
            if only and [name.lower(), str(b), str(top_p)] != [x.lower() for x in only]:
                continue
            res = {}
            for label, mod in (("before", old), ("now", new)):
                step.verify, step.sample_token = mod.verify, mod.sample_token
                t.compiled.clear()
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
                res[label] = (toks / wall, float(np.mean(taus)))
            print(f"{name:5s} batch {b} top_p {top_p}: before {res['before'][0]:6.1f} tok/s "
                  f"(tau {res['before'][1]:.2f}), now {res['now'][0]:6.1f} tok/s "
                  f"(tau {res['now'][1]:.2f}): {res['now'][0] / res['before'][0]:.2f}x", flush=True)
