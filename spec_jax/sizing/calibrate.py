"""Sizing runs: profile, cost, predict, run the contenders end to end, decide and store
(`size_tree` for draft heads, `size_ngram` for the n-gram drafter)."""
from __future__ import annotations

import sys
import time

import jax
import numpy as np

from spec_jax.sizing.cache import (
    _decided,
    _entry,
    _store,
    batch_bucket,
    cache_file,
    cached_choice,
    calibration_key,
    ngram_key,
    shared_verify_latency,
)
from spec_jax.sizing.choice import (
    _best_speculative,
    choice_of,
    choose,
    fallback_point,
    sized_choice,
)
from spec_jax.sizing.latency import _interp, draft_latency, verify_latency
from spec_jax.sizing.names import PLAIN, measured_name, tree_tokens
from spec_jax.sizing.profile import (
    _replay,
    chain_profile,
    match_profile,
    profile_depth,
    rank_profile,
    replay_tau,
)
from spec_jax.sizing.search import (
    TREE_SIZES,
    best_trees,
    contenders,
    switch_draft_seconds,
    switch_trees,
)

# Calibration prompts for `auto` on first use, one per kind of request a chat server sees. Three
# of them hand the model text to work on (extract, rewrite, summarise): there the answer repeats
# its context and an n-gram graft pays, which a set of open questions alone never shows.
DEFAULT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Give three tips for staying healthy and explain each in two sentences.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Explain step by step.",
    "You are the captain of a merchant ship in 1750. Greet your new crew and tell them the rules "
    "on board.",
    "List every person in the text below with their city and job, one per line as "
    "'name, city, job'.\n\nAnna Berg is a nurse in Oslo. Her brother Tomas moved to Lisbon last "
    "year, where he teaches history. Their friend Mei Lin works as an architect in Singapore, and "
    "her cousin David Osei runs a bakery in Accra.",
    "Rewrite this email so that it is polite and formal:\n\nhey, the report you sent is late "
    "again and half the numbers are wrong. fix it by friday or i'm telling the boss.",
    "Summarize this paragraph in two sentences:\n\nThe city council met on Tuesday to discuss "
    "the new bike lanes on Main Street. Supporters said the lanes would make cycling safer and "
    "reduce traffic, while some shop owners worried that removing parking spaces would hurt their "
    "business. After a long debate, the council voted to build the lanes for a one-year trial and "
    "to review their effect on traffic and local shops next summer.",
]


# New tokens per calibration prompt: chat answers run to a few hundred tokens, and the later ones
# repeat more of the context, where the n-gram arms pay. At 160 the profile rated the same 8-token
# switch at tau 2.26 where 256 gave 2.66 (2.61 measured on MT-bench); sizing took ~400 s either way.
CALIBRATION_TOKENS = 256


GRAFT_DEPTHS = (2, 4, 8, 16)  # n-gram chains tried on top of each tree (spec_jax.compose.graft)


DS_DEPTHS = (4, 8)  # datastore chains tried too, when sizing with a datastore


SWITCH_SIZES = (4, 8, 12, 16)  # tree tokens of the switches weighed (spec_jax.compose.switch)


NGRAM_CHAINS = (1, 2, 3, 4, 6, 8)  # chain lengths `size_ngram` weighs


def resolve(target, draft, spec, batch: int = 1, datastore=None, temperature: float = 0.0,
            top_p: float = 1.0):
    """What a tree option left to the sizing (`spec.base` `default` or `auto`) stands for, for
    `draft` (heads, "mtp": the target's own heads, or "ngram" without a datastore) here: (the
    chosen TreeSpec, the (break-even, prior) of the plain-step fallback the sizing chose with
    it, or None), or None where nothing was sized (then the method's own tree). The choice is
    the one cached for this sampling setting and the bucket of `batch` (`batch_bucket`: a call's
    rows, sized per bucket as a bigger batch makes verification costlier); without one, `default`
    takes the greedy sizing's and `auto` sizes now (`sized_choice`)."""
    from spec_jax.drafting import own_heads
    from spec_jax.tree_spec import Auto, parse

    tree = "auto" if isinstance(spec.base, Auto) else None
    draft = own_heads(target, draft)  # "mtp": the target's own MTP heads
    if isinstance(draft, str):  # the n-gram drafter
        def cached(t, p):
            return cached_choice(target, "ngram", batch, temperature=t, top_p=p)

        def size():
            return choice_of(size_ngram(target, batch=batch, temperature=temperature,
                                        top_p=top_p)[1])
    else:
        def cached(t, p):
            return cached_choice(target, draft, batch, datastore, t, p)

        def size():
            return choice_of(size_tree(target, draft, batch=batch, datastore=datastore,
                                       temperature=temperature, top_p=top_p)[1])
    chosen = sized_choice(tree, temperature, top_p, cached, size)
    return None if chosen is None else (parse(chosen[0]), chosen[1])


def size_tree(target, heads, prompts=None, batch: int = 1,
              max_new_tokens: int = CALIBRATION_TOKENS, sizes=TREE_SIZES, use_cache: bool = True,
              progress: bool = True, datastore=None, temperature: float = 0.0, top_p: float = 1.0):
    """Choose (and cache) the tree for these heads (and datastore) on this device and batch size,
    for greedy decoding or, with temperature > 0, for sampling at (temperature, top_p).

    Returns (tree, report): tree is PLAIN, a list of paths, a dynamic-tree dict or one of these
    with grafts (anything `generate(tree=...)` takes); report holds the profile size, the costs,
    the predicted curve and the end-to-end measurements the choice was made from. With a
    `datastore`, datastore chains of DS_DEPTHS tokens are weighed too (and the choice says how
    many, 0 included). A batch is sized at its bucket (`batch_bucket`: 3 rows as 4)."""
    from spec_jax.tree import StaticTree, dynamic_capacity

    batch = batch_bucket(batch)
    key = calibration_key(target, heads, batch, datastore, temperature, top_p)
    entry = _entry(target, heads, batch, datastore, temperature, top_p) if use_cache else None
    if entry is not None:
        return entry["tree"], entry
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if progress else (lambda *a: None)
    t_start = time.perf_counter()
    texts = [getattr(p, "text", p) for p in (prompts or DEFAULT_PROMPTS)]
    top_p = top_p if temperature > 0 else 1.0  # greedy decoding has no nucleus
    say(f"sizing the draft tree for {heads.method} heads on {jax.devices()[0].device_kind}, "
        f"batch {batch}" + (f", sampling at temperature {temperature:g}, top_p {top_p:g}"
                            if temperature > 0 else "") + f" (once; cached in {cache_file()}) ...")
    groups = [(texts[i:] + texts * batch)[:batch] for i in range(0, len(texts), batch)]
    measure = lambda tree, fallback=False: _measure(  # noqa: E731
        target, groups, max_new_tokens, tree, heads, datastore, temperature, top_p, fallback)
    measured = [measure(PLAIN)]
    # plain decoding's outputs are the continuations (greedy or sampled) the profile runs along
    seqs, plens = _continuations(target, groups, measured[0].pop("outputs"))
    ranks = rank_profile(target, heads, seqs, plens, profile_depth(heads))
    trees = best_trees(ranks, sizes)
    verify = _verify_curve(target, {1, 2, 4, 8, 12, 16, 32, 64} & set(range(1, max(sizes) + 1))
                           | {max(sizes)}, batch)
    depths = sorted({max(len(p) for p in t["paths"]) for t in trees})
    draft = {d: draft_latency(target, heads, StaticTree.chain(d), batch) for d in depths}
    # grafting adds the n-gram search and a deeper bookkeeping pass: measured once, at the most
    graft_cost = ds_cost = 0.0
    ds_depths = (0,) + tuple(n for n in DS_DEPTHS if datastore is not None and n <= datastore.depth)
    if trees:
        g, base = max(GRAFT_DEPTHS), StaticTree.chain(depths[0])
        graft_cost = max(draft_latency(target, heads, {"base": base, "ngram": g}, batch)
                         - draft[depths[0]], 0.0)
        ngram = chain_profile(seqs, plens, ranks, g)
        if len(ds_depths) > 1:  # the lookup's own cost, on top of the n-gram graft's
            n = ds_depths[-1]
            ds_cost = max(draft_latency(target, heads, {"base": base, "ngram": g, "ds": n}, batch,
                                        datastore=datastore) - draft[depths[0]] - graft_cost, 0.0)
            chain = datastore.chain(n)
            dsp = chain_profile(seqs, plens, ranks, n,
                                lambda st: chain.continuation(datastore.tables(), st))
    curve = []
    for t in trees:
        d = max(len(p) for p in t["paths"])
        for g in (0,) + GRAFT_DEPTHS:
            for n in ds_depths:
                size = t["size"] + g + n
                if (g or n) and size not in verify:  # verify cost steps with the kernel's row blocks
                    continue
                tau = replay_tau(ranks, t["paths"], ngram, g, dsp if n else None, n) if g or n \
                    else t["tau"]
                step = (_interp(verify, size) + draft[d] + (graft_cost if g or n else 0.0)
                        + (ds_cost if n else 0.0))
                curve.append({"size": size, "depth": d, "top_k": 1 + max(max(p) for p in t["paths"]),
                              "ngram": g, "ds": n, "tau": tau, "step_seconds": step,
                              "predicted_tokens_per_second": batch * tau / step, "paths": t["paths"]})
    if trees and datastore is None:
        match = match_profile(seqs, plens, ranks)
        # arms of every head-tree depth drafted: a shallower head tree accepts less than the
        # best one of its size but spares the draft steps below it (0.3-0.8 ms each here)
        capped = [best_trees(ranks, sizes, max_depth=d) for d in sorted(draft)]
        switches = [switch_trees(ranks, ts, ngram, match, size)
                    for size in SWITCH_SIZES if size in verify for ts in capped]
        for sw in switches:
            if sw is None or any(c.get("switch", {}).get("switch") == sw["switch"] for c in curve):
                continue
            size = tree_tokens(sw)
            step = _interp(verify, size) + switch_draft_seconds(sw, draft, batch) + graft_cost
            arms = sw["switch"]
            curve.append({"size": size, "depth": sw["depth"], "top_k": sw["top_k"],
                          "ngram": max(a["ngram"] for a in arms), "ds": 0, "tau": sw["tau"],
                          "step_seconds": step, "predicted_tokens_per_second": batch * sw["tau"] / step,
                          "paths": sorted({tuple(p) for a in arms for p in a["base"]},
                                          key=lambda p: (len(p), p)),
                          "switch": {"switch": arms, "policy": sw["policy"]},
                          "arm_share": sw["arm_share"], "tau_ceiling": sw["tau_ceiling"]})
    fastest = lambda cs: max(cs, key=lambda c: c["predicted_tokens_per_second"])  # noqa: E731
    best = fastest(curve) if curve else None
    if best is not None:
        plain_pred = batch / verify[1]
        # the best with a datastore chain, the best with only the n-gram chain and the best
        # ungrafted prediction all run end to end, each with its near-tie of higher tau: a few
        # percent of predicted speed is within this host's noise, so the measurement decides
        # (the group's fastest also with its dynamic twin)
        picks = [(c, i == 0) for cs in ([c for c in curve if c["ds"]],
                                        [c for c in curve if "switch" in c],
                                        [c for c in curve if c["ngram"] and not c["ds"]
                                         and "switch" not in c],
                                        [c for c in curve if not c["ngram"] and not c["ds"]]) if cs
                 for i, c in enumerate(contenders(cs))]
        picks.sort(key=lambda ct: ct[0] is not best)
        for c, twin in picks:
            measured.append(measure(_choice(c["paths"], c, datastore)))
            size = c["size"] - c["ngram"] - c["ds"]
            if (twin and "switch" not in c and c["depth"] + 1 < size
                    <= dynamic_capacity(c["top_k"], c["depth"])
                    and c["predicted_tokens_per_second"] > plain_pred):
                dyn = {"top_k": c["top_k"], "depth": c["depth"], "total_tokens": size}
                measured.append(measure(_choice(dyn, c, datastore)))
    return _decide(key, measured, measure, say, t_start, "", batch=batch, temperature=temperature,
                   top_p=top_p, profile_positions=int(sum(len(r) for r in ranks)),
                   verify_seconds={str(k): v for k, v in verify.items()},
                   draft_seconds={str(k): v for k, v in draft.items()},
                   plain_predicted_tokens_per_second=batch / verify[1], curve=curve)


def size_ngram(target, prompts=None, batch: int = 1, max_new_tokens: int = CALIBRATION_TOKENS,
               use_cache: bool = True, progress: bool = True, temperature: float = 0.0,
               top_p: float = 1.0):
    """Choose (and cache) the n-gram (prompt lookup) drafter's chain length on this device and
    batch size, or PLAIN where no chain pays: `size_tree` for a drafter without weights.

    Plain decoding writes the calibration continuations; replaying the n-gram drafter along them
    gives each chain length's tau (`chain_profile`), and tau / verify(length + 1) predicts its
    speed. The best prediction (and its near-ties of higher tau or smaller size, `contenders`)
    runs end to end beside plain decoding, twice, and `pick_winner` decides. Why it is needed: a 6-token chain
    ran 1.49x plain where the target streamed float32 weights and 0.95x where it streamed 1-byte
    codes (verify at 7 tokens 1.1x one token there, 2x here). A batch is sized at its bucket
    (`batch_bucket`). Returns (tree, report)."""
    from spec_jax.tree import StaticTree

    batch = batch_bucket(batch)
    key = ngram_key(target, batch, temperature, top_p)
    entry = _decided(key, batch) if use_cache else None
    if entry is not None and entry.get("measured"):
        return entry["tree"], entry
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if progress else (lambda *a: None)
    t_start = time.perf_counter()
    texts = [getattr(p, "text", p) for p in (prompts or DEFAULT_PROMPTS)]
    top_p = top_p if temperature > 0 else 1.0
    say(f"sizing the n-gram chain on {jax.devices()[0].device_kind}, batch {batch} (once; cached "
        f"in {cache_file()}) ...")
    groups = [(texts[i:] + texts * batch)[:batch] for i in range(0, len(texts), batch)]
    measure = lambda tree, fallback=False: _measure(  # noqa: E731
        target, groups, max_new_tokens, tree, "ngram", None, temperature, top_p, fallback)
    measured = [measure(PLAIN)]
    seqs, plens = _continuations(target, groups, measured[0].pop("outputs"))
    roots = [np.zeros((max(len(q) - p - 1, 0),)) for q, p in zip(seqs, plens)]
    chain = chain_profile(seqs, plens, roots, max(NGRAM_CHAINS))
    verify = _verify_curve(target, {1} | {g + 1 for g in NGRAM_CHAINS}, batch)
    curve = []
    for g in NGRAM_CHAINS:
        tau = _replay([np.minimum(a, g) for a in chain])
        curve.append({"size": g + 1, "ngram": g, "depth": g, "tau": tau,
                      "step_seconds": verify[g + 1],
                      "predicted_tokens_per_second": batch * tau / verify[g + 1],
                      "paths": [list(p) for p in StaticTree.chain(g).paths]})
    for c in contenders(curve):
        measured.append(measure(c["paths"]))
    return _decide(key, measured, measure, say, t_start, " for n-gram drafting", batch=batch,
                   temperature=temperature, top_p=top_p,
                   profile_positions=int(sum(len(r) for r in roots)),
                   verify_seconds={str(k): v for k, v in verify.items()},
                   plain_predicted_tokens_per_second=batch / verify[1], curve=curve)


def _continuations(target, groups, outputs):
    """(seqs, plens): each calibration prompt's ids followed by plain decoding's output for it."""
    seqs, plens = [], []
    for rows, outs in zip(groups, outputs):
        for p, r in zip(rows, outs):
            ids = target.encode(p) if isinstance(p, str) else list(p)
            seqs.append(np.asarray(list(ids) + r.token_ids, np.int32))
            plens.append(len(ids))
    return seqs, plens


def _verify_curve(target, sizes, batch: int) -> dict:
    """Verify seconds per tree size, merged with the cached curve (`shared_verify_latency`) and made
    non-decreasing: a bigger tree never costs less, and a noisy small-T reading must not make it
    look cheaper."""
    verify = shared_verify_latency(target, batch, verify_latency(target, sorted(sizes), batch))
    return dict(zip(sorted(verify), np.maximum.accumulate([verify[t] for t in sorted(verify)])))


def _decide(key: str, measured: list[dict], measure, say, t_start: float, what: str, **report):
    """After the first round: the best speculative candidate once more, with the plain-step
    fallback at its measured break-even (`fallback_point`); then every run a second time
    (`_second_round`); `choose`, and store and return (the chosen tree, the sizing report:
    `report`'s fields with the tree, its fallback (break-even, prior) or None, the measurements
    and the seconds the sizing took)."""
    point = fallback_point(measured)
    if point is not None:
        run = measure(_best_speculative(measured)["tree"], point)
        run.pop("outputs", None)
        measured.append({**run, "fallback": list(point)})
    _second_round(measured, measure, say)
    winner = choose(measured, report.get("batch", 1))
    report = {"tree": winner["tree"], "fallback": winner.get("fallback"), **report,
              "measured": measured, "seconds": time.perf_counter() - t_start}
    _store(key, report)
    say(f"chose {measured_name(winner)}{what} ({report['seconds']:.0f} s)")
    return winner["tree"], report


def _second_round(measured: list[dict], measure, say) -> None:
    """Run every candidate again, right after the first round and in the same order; each keeps
    its faster run, so a burst of load on a shared machine during one run does not decide the
    choice."""
    for m in measured:
        again = measure(m["tree"], m.get("fallback") or False)
        m["runs_tokens_per_second"] = [m["tokens_per_second"], again["tokens_per_second"]]
        m["tokens_per_second"] = max(m["runs_tokens_per_second"])
    for m in measured:
        m.pop("outputs", None)
        share = f", {m['plain_step_share']:.0%} plain steps" if m.get("fallback") else ""
        say(f"  {measured_name(m)}: tau {m['tau']:.2f}{share}, {m['tokens_per_second']:.1f} tok/s "
            f"(best of {', '.join(f'{x:.1f}' for x in m['runs_tokens_per_second'])})")


def _choice(tree, entry, datastore=None) -> object:
    """A sizing choice as `generate(tree=...)` takes it: the tree, or the tree with its grafts
    (sized with a datastore, the choice always says how many datastore tokens, 0 included)."""
    if "switch" in entry:
        return entry["switch"]
    if datastore is not None:
        return {"base": tree, "ngram": entry["ngram"], "ds": entry["ds"]}
    return {"base": tree, "ngram": entry["ngram"]} if entry["ngram"] else tree


def _measure(target, groups, max_new_tokens, tree, heads, datastore=None, temperature: float = 0.0,
             top_p: float = 1.0, fallback=False) -> dict:
    """End-to-end tokens/s, tau and share of plain steps over the prompt groups (generate's wall
    time excludes compilation), greedy or sampled (group i with seed i); `fallback` is
    generate's (a (break-even, prior) pair, or False)."""
    tok, wall, steps, plain, outs = 0, 0.0, 0, 0, []
    for i, rows in enumerate(groups):
        rs = _generate(target, rows, max_new_tokens, tree, heads, datastore, temperature, top_p,
                       seed=i, fallback=fallback)
        outs.append(rs)
        tok += sum(r.stats["new_tokens"] for r in rs)
        wall += rs[0].stats["wall_seconds"]
        steps += sum(sum(r.stats["acceptance_histogram"]) for r in rs)
        plain += sum(r.stats.get("plain_steps", 0) for r in rs)
    n_rows = sum(len(g) for g in groups)
    return {"tree": tree, "tokens_per_second": tok / wall,
            "tau": (tok - n_rows) / max(steps, 1), "plain_step_share": plain / max(steps, 1),
            "outputs": outs}


def _generate(target, rows, max_new_tokens, tree, draft, datastore, temperature, top_p, seed,
              fallback):
    """What `generate_batch(target, rows, max_new_tokens, temperature=, top_p=, seed=,
    draft=draft, tree=tree, datastore=, fallback=)` returns for a candidate the sizing measures
    (PLAIN, or a concrete tree: nothing left to a sizing), run from below `generate`: the
    drafter built by spec_jax.drafting and decoded by spec_jax.engine, as generate does."""
    from spec_jax.drafting import build
    from spec_jax.engine import check_settings, run
    from spec_jax.fallback import Fallback
    from spec_jax.heads.base import Drafter

    row_max, temps, top_ps = check_settings(len(rows), max_new_tokens, temperature, top_p)
    ids = [target.encode(p) for p in rows]
    drafter, dparams = (Drafter(), ()) if tree == PLAIN else build(target, draft, tree, datastore)
    fb = None
    if fallback and type(drafter) is not Drafter and float(fallback[0]) > 0:
        fb = Fallback(plain_below=float(fallback[0]), prior=max(float(x) for x in fallback))
    return run(target, ids, drafter, dparams, row_max, temps, top_ps, seed, fallback=fb)
