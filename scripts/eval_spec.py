"""Greedy speculative decoding over the eval prompt sets: equality with plain decoding and tau.

For every prompt of the shipped evaluation sets (spec_jax/prompts: MT-bench's conversations of two turns, Vicuna-bench,
HumanEval), runs plain greedy decoding and speculative decoding (batched, greedy), then prints per
drafter and set:
prompts compared, prompts whose tokens differ from plain decoding, and tau (mean accepted tokens
per target call). With --rotate, each prompt is checked with one drafter in turn (all drafters
over all prompts would take hours on 2 CPU cores). With --temperature > 0 it samples (chunk j of
a set with seed --seed + j) and reports tau only: sampled output is not comparable token for token.
A multi-turn prompt's later turns are asked after the answers to the turns before it (plain
decoding's, or with --tau-only the drafter's own), as the EAGLE and Medusa evaluations play
MT-bench; --turns first asks first turns only (what runs before run 54 reported).

    python scripts/eval_spec.py --drafts ngram random:eagle random:eagle3 random:medusa random:mtp --rotate
    python scripts/eval_spec.py --drafts checkpoints/smollm2-135m-instruct-eagle --limit 20
    python scripts/eval_spec.py --drafts "checkpoints/smollm2-135m-instruct-eagle@dynamic:8,5,32" \
        --sets mt_bench --limit 16 --temperature 0.7
"""
import argparse
import json
import time
from collections import defaultdict

import spec_jax
from spec_jax.data import PROMPT_SETS, conversation, prompt_set, read_prompts, spread
from spec_jax.tree_spec import uses_datastore

SETS = {name: str(prompt_set(name)) for name in PROMPT_SETS}


def load_draft(target, spec):
    name, _, tree = spec.partition("@")
    if name == "ngram":
        return "ngram", tree or None
    if name.startswith("random:"):
        return spec_jax.init_draft(target, name.split(":", 1)[1], seed=0), tree or None
    return spec_jax.load_draft(name), tree or None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    ap.add_argument("--drafts", nargs="+", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None,
                    help="prompts per set, taken in turn from its categories (default: all)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rotate", action="store_true")
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--tau-only", action="store_true", help="skip plain decoding (no equality check)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled tau (implies --tau-only)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datastore", default=None, help="for drafts whose tree has +ds:N")
    ap.add_argument("--layers", default="scan", help="scan compiles much faster than unrolled")
    ap.add_argument("--turns", choices=("all", "first"), default="all",
                    help="multi-turn prompts: every turn (the default), or the first alone")
    a = ap.parse_args()
    a.tau_only = a.tau_only or a.temperature > 0
    sampling = {"temperature": a.temperature, "top_p": a.top_p}
    target = spec_jax.load_target(a.model, layers=a.layers)
    drafts = {d: load_draft(target, d) for d in a.drafts}
    ds = spec_jax.load_datastore(a.datastore) if a.datastore else None
    # mismatches is None with --tau-only: plain decoding is not run, nothing is compared
    stats = defaultdict(lambda: {"prompts": 0, "mismatches": None if a.tau_only else 0,
                                 "tokens": 0, "steps": 0})
    t0 = time.time()
    for set_name in a.sets:
        path = SETS[set_name]
        prompts = [p.turns if a.turns == "all" and p.turns else (p.text,)
                   for p in spread(read_prompts(path), a.limit)]
        prompts.sort(key=lambda turns: len(turns[0]))  # neighbours share a padded shape
        assign = defaultdict(list)
        for i, p in enumerate(prompts):
            names = [a.drafts[i % len(a.drafts)]] if a.rotate else a.drafts
            for n in names:
                assign[n].append(p)
        for name, ps in assign.items():
            draft, tree = drafts[name]
            for i in range(0, len(ps), a.batch):
                chunk = ps[i:i + a.batch]
                answers = [[] for _ in chunk]
                for t in range(max(len(c) for c in chunk)):
                    rows = [j for j, c in enumerate(chunk) if t < len(c)]
                    asked = [conversation(chunk[j], answers[j]) if t else chunk[j][0] for j in rows]
                    spec = spec_jax.generate_batch(
                        target, asked, a.max_new_tokens, draft=draft, tree=tree,
                        datastore=ds if uses_datastore(tree) else None,
                        seed=a.seed + i // a.batch, **sampling)
                    plain = None if a.tau_only else spec_jax.generate_batch(target, asked,
                                                                              a.max_new_tokens)
                    groups = [stats[(name, set_name)]]
                    if a.turns == "all" and any(len(c) > 1 for c in ps):
                        groups.append(stats[(name, f"{set_name} turn {t + 1}")])
                    for r, (j, s_) in enumerate(zip(rows, spec)):
                        for s in groups:
                            s["prompts"] += 1  # counts turns: a two-turn prompt is two prompts
                            if plain is not None:
                                s["mismatches"] += int(plain[r].token_ids != s_.token_ids)
                            s["tokens"] += len(s_.token_ids) - 1
                            s["steps"] += sum(s_.stats["acceptance_histogram"])
                        answers[j].append((plain[r] if plain is not None else s_).text)
            print(f"[{time.time() - t0:6.0f}s] {set_name} {name}: {stats[(name, set_name)]}", flush=True)
    print("\n| drafter | set | prompts (turns) | differ from plain | tau |\n|---|---|---|---|---|")
    if a.tau_only:
        print("(--tau-only: plain decoding not run, so 'differ from plain' is not checked)")
    for (name, set_name), s in stats.items():
        tau = s["tokens"] / s["steps"] if s["steps"] else float("nan")
        differ = "–" if s["mismatches"] is None else s["mismatches"]
        print(f"| {name} | {set_name} | {s['prompts']} | {differ} | {tau:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{k[0]}|{k[1]}": v for k, v in stats.items()}, f, indent=1)


if __name__ == "__main__":
    main()
