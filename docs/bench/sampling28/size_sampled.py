"""Size the shipped EAGLE head's tree for sampling at temperature 0.7 (batch 1), then compare it
with the greedy-sized tree at that temperature on 8 MT-bench prompts (128 tokens)."""
import numpy as np, spec_jax
from spec_jax.data import read_prompts, spread
from spec_jax.sizing import cached_tree, size_tree, tree_name
t = spec_jax.load_target("checkpoints/smollm2-135m-instruct")
eagle = spec_jax.load_draft("checkpoints/smollm2-135m-instruct-eagle")
greedy_tree = cached_tree(t, eagle, 1)
tree, rep = size_tree(t, eagle, temperature=0.7, top_p=1.0)
print("greedy-sized:", tree_name(greedy_tree), " sampled-sized:", tree_name(tree), f"({rep['seconds']:.0f} s)", flush=True)
for c in sorted(rep["curve"], key=lambda c: -c["predicted_tokens_per_second"])[:8]:
    print(f"  predicted size {c['size']} depth {c['depth']} ngram {c['ngram']} tau {c['tau']:.2f} {c['predicted_tokens_per_second']:.1f} tok/s", flush=True)
ps = [p.text for p in spread(read_prompts("../shared/data/eval/mt_bench"), 8)]
for rnd in range(2):
    for name, d, tr in (("plain", None, None), ("greedy-sized", eagle, greedy_tree), ("sampled-sized", eagle, tree)):
        kw = dict(temperature=0.7, stop_at_eos=False, draft=d, tree=tr)
        spec_jax.generate_batch(t, ps[:1], 128, **kw)
        toks = wall = 0; taus = []
        for i, p in enumerate(ps):
            r = spec_jax.generate_batch(t, [p], 128, **{**kw, "seed": 100 + i})[0]
            toks += r.stats["new_tokens"]; wall += r.stats["wall_seconds"]; taus.append(r.stats["mean_accepted"])
        print(f"round {rnd} {name:14s} tau={np.mean(taus):.2f} tok/s={toks/wall:.1f}", flush=True)
