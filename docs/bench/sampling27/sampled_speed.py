"""Sampled decoding speed, nucleus by sort (before) vs by bisection (after).

Archival: written for the library as of commit 1a6a690 (run it in a checkout of that commit);
verification has changed since."""
import sys, time
import jax, jax.numpy as jnp
import spec_jax, spec_jax.verify as V

def old(logits, temperature, top_p):
    logits = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    probs = jax.nn.softmax(logits, axis=-1)
    sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
    cum = jnp.cumsum(sorted_p, axis=-1)
    keep_sorted = (cum - sorted_p) < top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_p, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)

new = V.target_probs
t = spec_jax.load_target("checkpoints/smollm2-135m-instruct")
prompts = ["Write a short poem about the sea.", "Explain how a bicycle works."]
for draft in (None, spec_jax.load_draft("checkpoints/smollm2-135m-instruct-eagle")):
    for b in (1, 8):
        for top_p in (1.0, 0.9):
            res = {}
            for name, fn in (("sort", old), ("bisect", new)):
                V.target_probs = fn
                t.compiled.clear()
                kw = dict(temperature=0.7, top_p=top_p, seed=0, stop_at_eos=False, draft=draft,
                          tree="dynamic:8,5,32" if draft else None)
                spec_jax.generate_batch(t, (prompts * 8)[:b], 128, **kw)
                r = spec_jax.generate_batch(t, (prompts * 8)[:b], 128, **kw)
                res[name] = b * 128 / r[0].stats["wall_seconds"]
            print(f"draft={'eagle' if draft else 'plain'} batch={b} top_p={top_p}: "
                  f"sort {res['sort']:.1f} tok/s, bisect {res['bisect']:.1f} tok/s "
                  f"({res['bisect'] / res['sort']:.2f}x)", flush=True)
