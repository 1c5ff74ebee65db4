"""Where a generation loop's time goes: per target call, by part of the step and by kind of op.

`profile_generation` runs one `generate` under `jax.profiler`, matches each executed thunk to the
compiled HLO instruction it runs and that instruction's named scope (`spec_jax/step.py` names
`draft`, `target`, `verify` and `draft_update`; the rest of the loop body is `other`, prefill and
setup `outside`), and sums milliseconds per target call per scope, per (scope, op kind) — the CPU
kernels by FFI name, XLA fusions by their root op — and per fusion of the target's forward.
Tracing adds a few microseconds per thunk, so the parts sum to more than the untraced step:
compare parts with each other, and times with the untraced figure. CPU only (XLA:CPU names its
thunks after the HLO instructions). Used by `scripts/profile_step.py` and `spec-jax bench
--profile`.
"""
from __future__ import annotations

import collections
import gzip
import json
import re
import tempfile
from pathlib import Path

import jax

SCOPES = ("draft", "target", "verify", "draft_update")


def hlo_index(hlo_text: str) -> dict:
    """HLO instruction name -> (named scope, op kind, op name) for every instruction with
    metadata; instructions outside the while loop are scope `outside`."""
    index = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*op_name=\"([^\"]*)\"", line)
        if not m:
            continue
        op_name = m.group(2)
        parts = op_name.split("/")
        scope = next((p for p in parts if p in SCOPES), "other")
        if not any(p.startswith("while") for p in parts):
            scope = "outside"
        ffi = re.search(r'custom_call_target="([^"]*)"', line)
        kind = ffi.group(1) if ffi else (re.search(r"= \S+ ([\w\-]+)\(", line) or [None, "?"])[1]
        index[m.group(1)] = (scope, kind, op_name)
    return index


def thunk_events(trace_dir: Path) -> list[dict]:
    """The complete ('X') events of the trace jax.profiler wrote under trace_dir."""
    path = next(Path(trace_dir).rglob("*.trace.json.gz"))
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("ph") == "X"]


def profile_generation(target, prompt, max_new_tokens: int = 256, **generate_kw) -> dict:
    """Profile `spec_jax.generate(target, prompt, max_new_tokens, stop_at_eos=False,
    **generate_kw)`. Returns {"untraced_ms_per_call", "traced_ms_per_call", "calls", "tau",
    "scopes": {scope: ms per target call}, "kinds": {(scope, kind): (ms, thunks) per call},
    "fusions": {target fusion op name: ms per call}}. The loop is compiled afresh for it (the
    target's other compiled programs are kept)."""
    import spec_jax

    if jax.default_backend() != "cpu":
        raise spec_jax.SpecJaxError("the step profile reads XLA:CPU's thunk names: run it on CPU")
    run = lambda: spec_jax.generate(target, prompt, max_new_tokens,  # noqa: E731
                                    stop_at_eos=False, **generate_kw)
    kept = dict(target.compiled)
    target.compiled.clear()  # so the one loop compiled next is this call's
    try:
        run()  # compile
        loops = [v for k, v in target.compiled.items() if k[0] == "loop"]
        r = run()
        index = hlo_index(loops[-1].as_text())
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                traced = run()
            events = thunk_events(Path(d))
    finally:
        target.compiled.clear()
        target.compiled.update(kept)
    calls = traced.stats["target_calls"]
    scopes, kinds, count, fusions = (collections.Counter() for _ in range(4))
    for e in events:
        hit = index.get(e.get("name", ""))
        if hit is None:
            continue
        scope, kind, op_name = hit
        scopes[scope] += e["dur"]
        kinds[(scope, kind)] += e["dur"]
        count[(scope, kind)] += 1
        if scope == "target" and kind == "fusion":
            fusions[re.sub(r"\d+", "#", op_name.split("/target/")[-1])] += e["dur"]
    ms = lambda us: us / 1e3 / calls  # noqa: E731
    return {"untraced_ms_per_call": r.stats["wall_seconds"] * 1e3 / r.stats["target_calls"],
            "traced_ms_per_call": traced.stats["wall_seconds"] * 1e3 / calls, "calls": calls,
            "tau": r.stats["mean_accepted"], "tree_tokens": r.stats["tree_tokens"],
            "scopes": {s: ms(us) for s, us in scopes.most_common()},
            "kinds": {k: (ms(us), count[k] / calls) for k, us in kinds.most_common()},
            "fusions": {f: ms(us) for f, us in fusions.most_common()}}


def step_shares(profile: dict) -> dict:
    """A profile's loop time (prefill and setup left out) as shares: draft (drafting and the
    drafter's update after each verification), verify (the target's forward and the acceptance
    rule) and bookkeeping (the rest of the loop body: the cache commit, emitting tokens)."""
    s = profile["scopes"]
    parts = {"draft": s.get("draft", 0.0) + s.get("draft_update", 0.0),
             "verify": s.get("target", 0.0) + s.get("verify", 0.0),
             "bookkeeping": s.get("other", 0.0)}
    total = sum(parts.values()) or 1.0
    return {k: v / total for k, v in parts.items()}
