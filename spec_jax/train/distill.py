"""Self-distillation data: the target writes its own responses to training prompts.

With `data_dir="self"` the target writes the prompts too (Magpie, Xu et al. 2024): sampled from
the chat template's text up to a user turn, so a target with a chat template needs no prompt set,
and the prompts are the kind of requests the target itself expects.

Stored as `tokens.npz` (compressed; one int32 array per sample: prompt + response, and the
prompt lengths) and `manifest.json` (prompt sources, target checkpoint and fingerprint, sampling
settings, start, counts), so a run can be reproduced and extended (an existing set is extended,
never overwritten).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np

from spec_jax.data import check_source, load_distill, load_sets, prompt_files, read_prompts  # noqa: F401 (re-exported)
from spec_jax.errors import SpecJaxError

MIXES = ("proportional", "balanced")
SELF = "self"  # data_dir for prompts the target writes itself
SELF_PROMPT_TOKENS = 96  # the longest prompt it may write; longer ones are drawn again
SELF_PROMPT_TRIES = 4


def order_prompts(data_dir, seed: int = 0, mix: str = "proportional") -> list:
    """The prompts of `data_dir` in the order a distillation run answers them.

    proportional: one seeded shuffle of all prompts (each file contributes in proportion to its
    size). balanced: each file shuffled with the seed, then taken in turn, one prompt per file,
    so small chat-like files are not drowned by the large math and code sets (a file that runs out
    drops out of the rotation). Either order is a pure function of (files, seed, mix), so a set
    can be extended by taking the next prompts."""
    if mix not in MIXES:
        raise SpecJaxError(f"unknown mix {mix!r}: choose one of {', '.join(MIXES)}")
    if mix == "proportional":
        prompts = read_prompts(data_dir)
        random.Random(seed).shuffle(prompts)
        return prompts
    groups = []
    for i, f in enumerate(prompt_files(data_dir)):
        g = read_prompts(f)
        random.Random(seed * 1000 + i).shuffle(g)
        groups.append(g)
    order = []
    for k in range(max(len(g) for g in groups)):
        order.extend(g[k] for g in groups if k < len(g))
    return order


def user_turn_prefix(target) -> list[int]:
    """Token ids of the chat template up to where a user's message begins (its system turn, if
    it has a default one, and the user turn's header)."""
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise SpecJaxError("--data self needs a target whose tokenizer has a chat template: "
                           "pass a prompt folder with --data instead")
    mark = "\x00MESSAGE\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if mark not in text:
        raise SpecJaxError("the chat template does not show the user's message as written: "
                           "pass a prompt folder with --data instead")
    return [int(t) for t in tok(text.split(mark)[0], add_special_tokens=False)["input_ids"]]


def self_prompts(target, first: int, n: int, seed: int = 0, batch_size: int = 16) -> list:
    """Prompts `first` .. `first + n - 1` of the target's own: each sampled (temperature 1) after
    `user_turn_prefix` until the target ends the turn. Prompt i depends only on (seed, i), not on
    the batch it was drawn in, so a set can be extended; one that does not end within
    SELF_PROMPT_TOKENS tokens or has under 8 characters is drawn again with the next key (the
    last try is kept whatever it is)."""
    from spec_jax.data import Prompt
    from spec_jax.generate import generate_batch

    prefix = user_turn_prefix(target)
    texts = [None] * n
    for attempt in range(SELF_PROMPT_TRIES):
        todo = [j for j in range(n) if texts[j] is None]
        for k in range(0, len(todo), batch_size):
            rows = todo[k:k + batch_size]
            seeds = [((seed * SELF_PROMPT_TRIES + attempt) * 1_000_003 + first + j) % (2**31 - 1)
                     for j in rows]
            pad = batch_size - len(rows)  # full batches: one compiled shape
            res = generate_batch(target, [prefix] * batch_size, SELF_PROMPT_TOKENS, chat=False,
                                 temperature=1.0, seed=seeds + seeds[-1:] * pad)
            for j, r in zip(rows, res):
                text = r.text.strip()
                ok = r.stats["finish_reason"] == "stop" and len(text) >= 8
                if ok or attempt == SELF_PROMPT_TRIES - 1:
                    texts[j] = text
    return [Prompt(SELF, str(first + j), SELF, t) for j, t in enumerate(texts)]


def distill(target, data_dir, out_dir, num_prompts=1000, max_new_tokens=160, batch_size=16,
            temperature=0.0, seed=0, mix="proportional", start=0, progress=True):
    """Generate (or extend) a self-distillation set of `num_prompts` samples: prompts `start`,
    `start + 1`, ... of the prompt order (see `order_prompts` for `mix`), so a fresh set can
    continue where an earlier one, perhaps no longer on disk, stopped. `data_dir="self"`: the
    target writes the prompts (`self_prompts`; `mix` is then "self")."""
    from spec_jax.engine import bucket
    from spec_jax.generate import generate_batch

    out_dir = Path(out_dir)
    own = str(data_dir) == SELF
    if own:
        mix = SELF
        if start < 0:
            raise SpecJaxError(f"--start {start} must be at least 0")
    else:
        root = Path(data_dir).resolve().parent
        if any("eval" in p.resolve().relative_to(root).parts for p in prompt_files(data_dir)):
            raise SpecJaxError("refusing to train on evaluation prompts: pass the train/ folder")
        prompts = order_prompts(data_dir, seed, mix)
        if not 0 <= start < len(prompts):
            raise SpecJaxError(f"--start {start} is outside the {len(prompts)} prompts of "
                               f"{data_dir}")
    seqs, plens, done = [], [], 0
    if (out_dir / "manifest.json").is_file():
        seqs, plens, manifest = load_distill(out_dir)
        done = len(seqs)
        was = (manifest.get("seed"), manifest.get("mix", "proportional"), manifest.get("start", 0),
               manifest.get("temperature", 0.0), manifest.get("max_new_tokens", max_new_tokens))
        if was != (seed, mix, start, temperature, max_new_tokens):
            raise SpecJaxError(f"{out_dir} was written with seed {was[0]}, mix {was[1]!r}, start "
                               f"{was[2]}, temperature {was[3]} and max_new_tokens {was[4]}: "
                               "extend it with the same settings, or write a new set to another "
                               "--out")
    todo = None if own else prompts[start + done:start + num_prompts]
    count = max(0, num_prompts - done) if own else len(todo)
    t0 = time.time()
    new_tokens = 0
    from tqdm import tqdm

    bar = tqdm(total=count, disable=not progress, desc="distill")
    # Each window of 8 batches is generated in order of prompt length, and a batch holds at most
    # `batch_size` x 128 prompt tokens once padded (long prompts go in smaller batches: one
    # 500-token prompt used to pad a whole batch's prefill to 512). Short batches are filled with
    # copies of their last prompt, so there are few shapes to compile. The window is stored in
    # prompt order: the set on disk is always a prefix of the prompt order.
    window, budget = 8 * batch_size, batch_size * 128
    for w in range(0, count, window):
        asked = (self_prompts(target, start + done + w, min(window, count - w), seed, batch_size)
                 if own else todo[w:w + window])
        texts = [p.text[:2000] for p in asked]
        ids = [target.encode(t) for t in texts]
        order = sorted(range(len(texts)), key=lambda j: len(ids[j]))
        answers = [None] * len(texts)
        padded = lambda k: bucket(len(ids[order[k]]), 64)  # the k-th shortest prompt, padded
        i = 0
        while i < len(order):
            rows = max(1, min(batch_size, budget // padded(i)))
            while rows > 1 and rows * padded(min(i + rows, len(order)) - 1) > budget:
                rows //= 2
            chunk = order[i:i + rows]
            batch = [ids[j] for j in chunk] + [ids[chunk[-1]]] * (rows - len(chunk))
            res = generate_batch(target, batch, max_new_tokens, chat=False,
                                 temperature=temperature, seed=seed + w + i)
            for j, r in zip(chunk, res):
                answers[j] = r.token_ids
                new_tokens += len(r.token_ids)
            i += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
        for x, a in zip(ids, answers):
            seqs.append(np.asarray(x + a, np.int32))
            plens.append(len(x))
        _write(out_dir, seqs, plens, target, data_dir, max_new_tokens, temperature, seed, mix,
               start)
    bar.close()
    return out_dir


def _write(out_dir, seqs, plens, target, data_dir, max_new_tokens, temperature, seed, mix, start):
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "tokens.tmp.npz"
    np.savez_compressed(tmp, prompt_len=np.asarray(plens, np.int32),
                        **{f"s{i}": s for i, s in enumerate(seqs)})
    tmp.replace(out_dir / "tokens.npz")
    manifest = {"samples": len(seqs), "tokens": int(sum(len(s) for s in seqs)),
                "response_tokens": int(sum(len(s) - p for s, p in zip(seqs, plens))),
                "prompt_source": str(data_dir), "target": str(target.path),
                "target_fingerprint": target.fingerprint(), "max_new_tokens": max_new_tokens,
                "temperature": temperature, "seed": seed, "mix": mix, "start": start,
                "chat_template": True}
    if mix == SELF:  # how the prompts were drawn (`self_prompts`)
        manifest.update(prompt_temperature=1.0, prompt_max_tokens=SELF_PROMPT_TOKENS,
                        prompt_tries=SELF_PROMPT_TRIES)
    (out_dir / "manifest.tmp.json").write_text(json.dumps(manifest, indent=2))
    (out_dir / "manifest.tmp.json").replace(out_dir / "manifest.json")
