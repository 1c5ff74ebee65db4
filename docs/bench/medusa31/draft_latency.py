"""Draft-step latency of the shipped Medusa heads: the shared LM head vs LM heads of their own
(copies of the target's, as `--own-lm-heads` starts them), per tree; median of 200 jitted calls.

    .venv/bin/python docs/bench/medusa31/draft_latency.py   # from the repository root, after scripts/main.sh
"""
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import spec_jax
from spec_jax.heads.medusa import add_lm_heads

t = spec_jax.load_target("checkpoints/smollm2-135m-instruct")
h = spec_jax.load_draft("checkpoints/smollm2-135m-instruct-medusa")
own = dataclasses.replace(h, params=add_lm_heads(h.params, t.params, t.cfg),
                          hparams={**h.hparams, "own_lm_heads": True})
key = jax.random.PRNGKey(0)
for tree in ["[[0],[1],[0,0]]", None, "dynamic:8,4,32", "dynamic:10,4,64"]:
    row = []
    for name, heads in (("shared", h), ("own", own)):
        d = heads.drafter(tree)
        p = heads.bind(t)
        st = d.init_state(p, t.params, t.cfg, 1, 0)
        st = dataclasses.replace(st, hidden=jax.random.normal(key, st.hidden.shape))
        f = jax.jit(lambda p, s, r: d.propose(p, t.params, t.cfg, s, r, key))
        root = jnp.zeros((1,), jnp.int32)
        jax.block_until_ready(f(p, st, root))
        ts = []
        for _ in range(200):
            a = time.perf_counter(); jax.block_until_ready(f(p, st, root)); ts.append(time.perf_counter() - a)
        row.append(f"{name} {np.median(ts)*1e3:.2f} ms")
    print(tree or "default", *row, flush=True)
