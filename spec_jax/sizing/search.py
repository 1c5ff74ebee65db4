"""The candidates a sizing weighs, found over an acceptance profile (spec_jax.sizing.profile): the
best static tree of each size (`best_trees`), the best switch between head trees and n-gram chains
(`switch_trees`, `switch_draft_seconds`), and which predictions are worth running end to end
(`contenders`)."""
from __future__ import annotations

from collections import Counter

import numpy as np

from spec_jax.sizing.choice import DS_MARGIN
from spec_jax.sizing.profile import _accepted, _prefixes, _replay, _roots, replay_tau

TREE_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


SWITCH_MIN_POSITIONS = 30  # a policy entry rests on at least this many profile positions


def best_trees(profile: list[np.ndarray], sizes=TREE_SIZES, max_depth: int | None = None) -> list[dict]:
    """For each tree size n (nodes incl. the root): the static tree of the n - 1 rank prefixes
    (at most `max_depth` deep) accepted most often in the profile, and its tau replayed over the
    profile. Returns [{"size", "paths", "tau"}] for the sizes the profile has enough prefixes for."""
    counts: Counter = Counter(p for ranks in profile for row in ranks for p in _prefixes(row)
                              if max_depth is None or len(p) <= max_depth)
    # a prefix is at least as frequent as its extensions; shorter first on ties keeps it a tree
    order = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    out = []
    for n in sizes:
        if n - 1 > len(order):
            break
        paths = [list(p) for p in order[:n - 1]]
        out.append({"size": n, "paths": paths, "tau": replay_tau(profile, paths)})
    return out


def switch_trees(profile, trees: list[dict], ngram, match, size: int) -> dict | None:
    """The best switch of `size` tree tokens (spec_jax.compose.switch) over the profile: arms are
    the best head tree of size - g nodes plus a g-token n-gram chain, for every g the trees allow
    (the root alone with size - 1); for each n-gram match length the arm that accepts most at
    the profile's positions of that length (neighbouring lengths pooled until there are
    SWITCH_MIN_POSITIONS). Returns {"switch", "policy", "tau", "depth", "top_k", "arm_share",
    "tau_ceiling"} or None; tau_ceiling is the tau if every step took whichever of the candidate
    arms accepts most there, the most any policy over these arms could reach: near `tau`, a
    better policy cannot help and only better drafts can."""
    by_size = {t["size"]: t["paths"] for t in trees}
    by_size[1] = []
    arms = [(by_size[size - g], g) for g in range(size) if size - g in by_size
            and (g == 0 or g == size - 1 or g % 2 == 0)]
    if len(arms) < 2:
        return None
    acc = [_accepted(profile, paths, ngram, g) for paths, g in arms]  # [arm][k][position]
    m_all = np.concatenate(match) if match else np.zeros((0,), np.int32)
    if len(m_all) == 0:
        return None
    a_all = np.stack([np.concatenate(a) for a in acc])  # [arms, positions]
    ceiling = _replay([np.max(np.stack([a[k] for a in acc]), axis=0) for k in range(len(match))])
    top = int(m_all.max())
    policy = []
    for m in range(top + 1):
        lo = hi = m
        while np.sum((m_all >= lo) & (m_all <= hi)) < SWITCH_MIN_POSITIONS and (lo > 0 or hi < top):
            lo, hi = max(lo - 1, 0), min(hi + 1, top)
        sel = (m_all >= lo) & (m_all <= hi)
        policy.append(int(np.argmax(a_all[:, sel].sum(axis=1))))
    used = sorted(set(policy))
    if len(used) < 2:
        return None  # one arm everywhere: that arm is a plain grafted tree, already on the curve
    policy = [used.index(p) for p in policy]
    arms = [arms[i] for i in used]
    acc = [acc[i] for i in used]
    chosen = [np.choose(np.asarray(policy)[mk], [a[k] for a in acc])
              for k, mk in enumerate(match)]
    roots = _roots(chosen)
    used_arm = np.concatenate([np.asarray(policy)[mk][r] for mk, r in zip(match, roots)])
    share = np.bincount(used_arm, minlength=len(arms)) / max(len(used_arm), 1)
    paths = [p for a, _ in arms for p in a]
    return {"switch": [{"base": a, "ngram": g} for a, g in arms], "policy": policy,
            "tau": _replay(chosen), "depth": max((len(p) for p in paths), default=0),
            "top_k": 1 + max((max(p) for p in paths), default=0),
            "arm_share": [float(x) for x in share], "tau_ceiling": ceiling}


def switch_draft_seconds(sw: dict, draft: dict, batch: int = 1) -> float:
    """A switch's draft seconds per step. Each arm is drafted only when a row chooses it: at
    batch 1 with the share of replayed steps that choose it, at batch B (rows taken as
    independent) with 1 - (1 - share)^B. `draft` maps drafted depth -> seconds of a draft step,
    bookkeeping included; an arm costs what its head tree's depth adds over the shallowest
    (the root-alone arm only the bookkeeping, which every step pays)."""
    shallowest = min(draft)
    cost = draft[shallowest]
    for arm, share in zip(sw["switch"], sw["arm_share"]):
        need = max([shallowest] + [len(p) for p in arm["base"]])
        drafted = min(d for d in draft if d >= need)  # arms stop at a drafted depth
        cost += (1.0 - (1.0 - share) ** batch) * (draft[drafted] - draft[shallowest])
    return cost


def contenders(curve: list[dict]) -> list[dict]:
    """The curve entries worth running end to end: the fastest prediction and, among those
    predicted within DS_MARGIN of it, the highest-tau one and the smallest tree. Predictions rest
    on a short profile and a noisy cost curve (verify at 4 tree tokens costs about what 8 do
    here), so a 1% predicted lead must not keep another size from being measured: in one
    calibration a 4-token tree led an 8-token one by 1% and was chosen untested against it, where
    the 8-token tree had measured 1.61x plain on MT-bench; in another (run 53b) a 12-token switch
    led the 8-token one by 0.7% and measured 17% under its prediction, with the 8-token switch
    never run."""
    best = max(curve, key=lambda c: c["predicted_tokens_per_second"])
    near = [c for c in curve
            if c["predicted_tokens_per_second"] * (1 + DS_MARGIN) >= best["predicted_tokens_per_second"]]
    deep = max(near, key=lambda c: (c["tau"], c["predicted_tokens_per_second"]))
    small = min(near, key=lambda c: (c["size"], -c["predicted_tokens_per_second"]))
    out = [best]
    for c in (deep, small):
        if all(c is not o for o in out):
            out.append(c)
    return out
