"""The sizing's choice from its end-to-end measurements (`choose`, `pick_winner`), the plain-step
fallback it runs with (`fallback_point`, `chosen_fallback`, `break_even`), and what a cached
choice gives `generate` (`choice_of`, `sized_choice`). Pure functions of the measurements: a
stored sizing is re-decided by the current rules each time it is read (spec_jax.sizing.cache)."""
from __future__ import annotations

from spec_jax.sizing.names import PLAIN
from spec_jax.tree_spec import uses_datastore


def choice_of(report: dict | None) -> tuple | None:
    """(tree, fallback) of a sizing report: its chosen tree and the (break-even, prior) of the
    plain-step fallback it runs with (`chosen_fallback`, at the report's batch size), or None;
    None for no report."""
    if report is None:
        return None
    measured = report.get("measured")
    return report["tree"], chosen_fallback(measured, report.get("batch", 1)) if measured else None


def sized_choice(tree, temperature: float, top_p: float, cached, size):
    """What `tree` None or "auto" stands for: `cached(temperature, top_p)`, the choice sized for
    this sampling setting; without a tree, a sampled setting never sized takes the greedy choice
    (`cached(0.0, 1.0)`); with "auto", `size()` sizes it now if there is none. None otherwise.
    A choice is whatever `cached` and `size` return (`cached_choice`: a (tree, fallback) pair)."""
    chosen = cached(temperature, top_p)
    if chosen is None and tree is None and temperature > 0:
        chosen = cached(0.0, 1.0)
    if chosen is None and tree == "auto":
        chosen = size()
    return chosen


def break_even(measured: list[dict]) -> tuple[float, float] | None:
    """(tokens a tree step of the chosen candidate must accept to match a plain step, the tokens
    it accepted) from their end-to-end measurements: tau / tokens/s of the choice over
    1 / tokens/s of plain decoding, and tau. None when plain decoding was chosen or not measured.
    The fallback of sizings that measured none (`chosen_fallback`)."""
    plain = [m for m in measured if m["tree"] == PLAIN]
    chosen = pick_winner(measured)
    if not plain or chosen["tree"] == PLAIN or chosen["tokens_per_second"] <= 0:
        return None
    return (chosen["tau"] * plain[0]["tokens_per_second"] / chosen["tokens_per_second"],
            chosen["tau"])


PROBE_MARGIN = 0.03  # a fallback's prior at least this far above its break-even: it probes


def _best_speculative(measured: list[dict]) -> dict | None:
    """`pick_winner` among the speculative runs without the fallback; None if there are none."""
    spec = [m for m in measured if m["tree"] != PLAIN and not m.get("fallback")]
    return pick_winner(spec) if spec else None


def fallback_point(measured: list[dict]) -> tuple[float, float] | None:
    """(break-even, prior) of the plain-step fallback (`spec_jax.fallback`) for the best
    speculative candidate measured (`pick_winner` among them): the tokens its tree step must accept
    to match a plain step (tau x plain tok/s / its tok/s), and the mean of accepted tokens a row
    starts at and drifts back to while it takes plain steps: its tau, or just above the
    break-even where the tau is lower. A tree that lost to plain decoding on the calibration
    prompts may still win on a request that repeats its context, and only a tree step now and
    then finds that out. None without a speculative or a plain measurement."""
    plain = [m for m in measured if m["tree"] == PLAIN]
    best = _best_speculative(measured)
    if not plain or best is None or best["tokens_per_second"] <= 0:
        return None
    even = best["tau"] * plain[0]["tokens_per_second"] / best["tokens_per_second"]
    return even, max(best["tau"], even * (1 + PROBE_MARGIN))


FALLBACK_ACTED = 0.05  # the least share of plain steps at which a fallback changed anything


# A tie goes to the fallback only where its break-even is at least this share of the tree's tau
FALLBACK_TIE_SHARE = 0.75


def choose(measured: list[dict], batch: int = 1) -> dict:
    """The sizing's choice from its end-to-end measurements: `pick_winner` among the runs without
    the fallback, unless the best candidate's run with it (the entry with "fallback": [break-even,
    prior]) measured at least as fast as plain decoding that won, or as fast as the speculative
    winner, or within the noise margin of it where speculation's lead is thin (the break-even at
    least FALLBACK_TIE_SHARE of the tree's tau, as with coded weights, where a tree step costs
    ~2.3 plain steps): there, on a tie, the fallback is the safer bet, as it costs little where
    the drafts fail and keeps the tree where they do not. Where a tree step is cheap (float32
    weights: 1.2-1.35 plain steps) the break-even, measured end to end on a noisy host, came out
    at 1.55 against the 1.17 the bench then implied, and the fallback's plain steps cost 8% on
    MT-bench (run 51). A fallback that took under FALLBACK_ACTED plain steps on the calibration
    prompts is not kept: it changed nothing but cost its bookkeeping.

    At a batch of several rows (`batch` > 1) speculation, with the fallback or without, must beat
    plain decoding by more than the host's noise (`_batch_choice`)."""
    pick = _one_row_choice(measured)
    return _batch_choice(measured, pick) if batch > 1 else pick


def _one_row_choice(measured: list[dict]) -> dict:
    """`choose`'s rules for one row (see there)."""
    runs = [m for m in measured if not m.get("fallback")]
    winner = pick_winner(runs)
    fb = [m for m in measured if m.get("fallback")]
    if not fb:
        return winner
    fb = fb[-1]
    if winner["tree"] == PLAIN:
        return fb if fb["tokens_per_second"] >= winner["tokens_per_second"] else winner
    thin = fb["fallback"][0] >= FALLBACK_TIE_SHARE * winner.get("tau", 0.0)
    tie = thin and fb["tokens_per_second"] * (1 + _margin(measured)) >= winner["tokens_per_second"]
    ok = ((fb["tokens_per_second"] >= winner["tokens_per_second"] or tie)
          and fb.get("plain_step_share", 1.0) >= FALLBACK_ACTED)
    return fb if ok else winner


def _batch_choice(measured: list[dict], pick: dict) -> dict:
    """`pick` (the one-row rules' choice) at a batch of several rows, unless it is speculative and
    does not beat plain decoding by more than the host's noise (`_margin`): then plain decoding.

    The one-row rules lean to speculation on a tie (tau is measured exactly; fewer target passes
    are the better bet on a loaded machine), and to the fallback on a tie with plain decoding.
    Neither holds for a batch: the loop takes a tree step whenever any row wants one, so the
    fallback's plain steps come only where every row wants them at once, and a batched tree step
    verifies rows x tree tokens, where compute, not the weights' streaming, sets its cost. The
    calibration prompts overstate the fallback too: at 16 rows they are 8 prompts twice, whose
    twin rows want plain steps together. SmolLM2 on 2 CPU cores (MT-bench, 64 new tokens): tied
    choices ran 0.81-0.90x plain at batch 16 (n-gram chain with the fallback) and 0.86x at batch 4
    (EAGLE switch with the fallback)."""
    plain = [m for m in measured if m["tree"] == PLAIN]
    if (pick["tree"] == PLAIN or not plain
            or pick["tokens_per_second"] > plain[0]["tokens_per_second"] * (1 + _margin(measured))):
        return pick
    return plain[0]


def chosen_fallback(measured: list[dict], batch: int = 1) -> tuple[float, float] | None:
    """(break-even, prior) of the fallback the sizing's choice (`choose` at `batch` rows) runs
    with, None for none: the fallback run's if `choose` took it; for measurements without such a
    run (sizings from before it was measured), `break_even` of the chosen tree, as they were used
    then."""
    chosen = choose(measured, batch)
    if not any(m.get("fallback") for m in measured):
        return break_even(measured) if chosen["tree"] != PLAIN else None
    return tuple(chosen["fallback"]) if chosen.get("fallback") else None


DS_MARGIN = 0.03  # the least relative lead that counts as a win, not noise (see pick_winner)


def pick_winner(measured: list[dict]) -> dict:
    """The candidate to use, from end-to-end measurements (each with its tau, its best tokens/s
    and, where run twice, both runs' tokens/s).

    Leads smaller than this host's noise — max(DS_MARGIN, the median relative spread between each
    candidate's two runs) — do not decide: among the speculative candidates within that margin of
    the fastest, the one with the highest tau wins. Tau is measured exactly, so the choice no
    longer flips between calibrations on a 3% tie (one run's EAGLE-3 sizing dropped the n-gram
    graft on such a tie and lost 15% on MT-bench), and on a tie the candidate that needs fewer
    target passes is the better bet on a loaded or slower machine. Plain decoding wins only as the
    outright fastest. A datastore graft must beat the fastest choice without one by more than the
    margin: the head and the in-context n-gram chain accept about as well on any prompt, but the
    datastore pays only where the workload resembles its corpus, which a few calibration prompts
    cannot tell."""
    fastest = lambda ms: max(ms, key=lambda m: m["tokens_per_second"])  # noqa: E731
    margin = _margin(measured)
    best = fastest(measured)
    without = [m for m in measured if not uses_datastore(m["tree"])]
    if uses_datastore(best["tree"]) and without:
        rival = fastest(without)
        if best["tokens_per_second"] <= rival["tokens_per_second"] * (1 + margin):
            best = rival
    if best["tree"] == PLAIN:
        return best
    pool = [m for m in measured if m["tree"] != PLAIN
            and uses_datastore(m["tree"]) == uses_datastore(best["tree"])
            and m["tokens_per_second"] * (1 + margin) >= best["tokens_per_second"]]
    return max(pool, key=lambda m: (m.get("tau", 0.0), m["tokens_per_second"]))


def _margin(measured: list[dict]) -> float:
    """This host's noise as the measurements show it: max(DS_MARGIN, the median relative spread
    between each candidate's two runs)."""
    spreads = sorted(abs(r[0] - r[1]) / max(r) for r in
                     (m.get("runs_tokens_per_second", [1.0, 1.0]) for m in measured))
    return max(DS_MARGIN, spreads[len(spreads) // 2])
