"""Self-distillation data: the target writes its own responses to training prompts.

Stored as `tokens.npz` (one int32 array per sample: prompt + response, and the prompt length) and
`manifest.json` (prompt sources, target checkpoint and fingerprint, sampling settings, counts), so
a run can be reproduced and extended (an existing set is extended, never overwritten).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np

from spec_jax.data import read_prompts
from spec_jax.errors import SpecJaxError


def load_distill(path) -> tuple[list[np.ndarray], list[int], dict]:
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise SpecJaxError(f"{path} has no manifest.json: create data with `spec-jax distill`")
    manifest = json.loads((path / "manifest.json").read_text())
    z = np.load(path / "tokens.npz")
    n = manifest["samples"]
    return [z[f"s{i}"] for i in range(n)], [int(x) for x in z["prompt_len"][:n]], manifest


def distill(target, data_dir, out_dir, num_prompts=1000, max_new_tokens=160, batch_size=16,
            temperature=0.0, seed=0, progress=True):
    """Generate (or extend) a self-distillation set of `num_prompts` samples."""
    from spec_jax.generate import generate_batch

    out_dir = Path(out_dir)
    prompts = read_prompts(data_dir)
    if any("eval" in Path(p.source).parts for p in prompts):
        raise SpecJaxError("refusing to train on evaluation prompts: pass the train/ folder")
    random.Random(seed).shuffle(prompts)
    seqs, plens, done = [], [], 0
    if (out_dir / "manifest.json").is_file():
        seqs, plens, manifest = load_distill(out_dir)
        done = len(seqs)
    todo = prompts[done:num_prompts]
    t0 = time.time()
    new_tokens = 0
    from tqdm import tqdm

    bar = tqdm(total=len(todo), disable=not progress, desc="distill")
    # group by prompt length so one batch shares a padded shape
    for i in range(0, len(todo), batch_size):
        chunk = todo[i:i + batch_size]
        texts = [p.text[:2000] for p in chunk]
        res = generate_batch(target, texts, max_new_tokens, temperature=temperature, seed=seed + i)
        for p, r in zip(texts, res):
            ids = target.encode(p)
            seqs.append(np.asarray(ids + r.token_ids, np.int32))
            plens.append(len(ids))
            new_tokens += len(r.token_ids)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
        if (i // batch_size) % 8 == 7 or i + batch_size >= len(todo):
            _write(out_dir, seqs, plens, target, data_dir, max_new_tokens, temperature, seed)
    bar.close()
    return out_dir


def _write(out_dir, seqs, plens, target, data_dir, max_new_tokens, temperature, seed):
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "tokens.tmp.npz"
    np.savez(tmp, prompt_len=np.asarray(plens, np.int32), **{f"s{i}": s for i, s in enumerate(seqs)})
    tmp.replace(out_dir / "tokens.npz")
    manifest = {"samples": len(seqs), "tokens": int(sum(len(s) for s in seqs)),
                "response_tokens": int(sum(len(s) - p for s, p in zip(seqs, plens))),
                "prompt_source": str(data_dir), "target": str(target.path),
                "target_fingerprint": target.fingerprint(), "max_new_tokens": max_new_tokens,
                "temperature": temperature, "seed": seed, "chat_template": True}
    (out_dir / "manifest.tmp.json").write_text(json.dumps(manifest, indent=2))
    (out_dir / "manifest.tmp.json").replace(out_dir / "manifest.json")
