"""Benchmark harness.

`bench` runs plain decoding and every drafter on the same prompts in one process, interleaved
prompt by prompt so that machine drift hits all methods alike; compile and warm-up are excluded
(compile time is reported separately). It reports per method and prompt set/category: tau (mean
accepted tokens per target call), tokens/s, speedup over plain decoding from the same run, and the
share of time spent verifying (the target's tree forward, timed on its own at the same tree size)
versus drafting and bookkeeping (the rest of each step).

`--calibrate` (and any `HEADS@auto`) sizes the tree with `spec_jax.sizing` and plots its curve;
`--calibrate-on FILE` sizes it on prompts of the user's own workload instead of the built-in ones.
`--batch-sizes 1,4,16` measures total throughput per batch size instead (`spec_jax.bench_batch`).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from spec_jax.errors import SpecJaxError
from spec_jax.sizing import (
    PLAIN,
    choice_name,
    choice_of,
    measured_name,
    size_ngram,
    size_tree,
    tree_name,
    tree_tokens,
    verify_latency,
)
from spec_jax.tree_spec import Auto, Switch, parse, uses_datastore


@dataclasses.dataclass
class Run:
    method: str
    prompt_set: str
    category: str
    new_tokens: int
    steps: int
    wall: float
    compile_s: float
    tree_tokens: int
    hist: tuple[int, ...] = ()  # acceptance histogram: steps that accepted 0, 1, 2, ... drafts
    same_as_plain: bool | None = None  # greedy: token for token equal to plain decoding's output
    plain_steps: int = 0  # steps of one token, where the drafter fell back (spec_jax.fallback)
    turn: int = 1  # which turn of a multi-turn prompt (spec_jax.data.conversation)


def summarize(runs: list[Run], verify_time: Callable[[int], float] | None = None,
              baseline: str = "plain") -> list[dict[str, Any]]:
    """Aggregate runs per (method, prompt set), per (method, category) and, where prompts had
    several turns, per (method, "turn N").

    tau = sum(new_tokens - 1) / sum(steps) (the prefill's token is not a speculative step);
    tokens/s = sum(new_tokens) / sum(wall); speedup = tokens/s over the baseline's on the same
    group; verify share = (tree steps * verify_time(tree_tokens) + plain steps * verify_time(1))
    / wall; plain-step share = plain steps / steps (`spec_jax.fallback`)."""
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault((r.method, r.prompt_set, "all"), []).append(r)
        if r.category and r.category != r.prompt_set:
            groups.setdefault((r.method, r.prompt_set, r.category), []).append(r)
    if any(r.turn > 1 for r in runs):
        for r in runs:
            groups.setdefault((r.method, r.prompt_set, f"turn {r.turn}"), []).append(r)
    rows = []
    for (method, pset, cat), rs in groups.items():
        tok = sum(r.new_tokens for r in rs)
        wall = sum(r.wall for r in rs)
        steps = sum(r.steps for r in rs)
        row = {"method": method, "prompt_set": pset, "category": cat, "prompts": len(rs),
               "new_tokens": tok, "tau": (tok - len(rs)) / steps if steps else None,
               "tokens_per_second": tok / wall if wall else 0.0, "wall_seconds": wall,
               "compile_seconds": sum(r.compile_s for r in rs), "tree_tokens": rs[0].tree_tokens,
               "plain_step_share": sum(r.plain_steps for r in rs) / steps if steps else 0.0}
        checked = [r.same_as_plain for r in rs if r.same_as_plain is not None]
        if checked:
            row["equal_to_plain"] = f"{sum(checked)}/{len(checked)}"
        if verify_time is not None and wall > 0:
            v = sum((r.steps - r.plain_steps) * verify_time(r.tree_tokens)
                    + r.plain_steps * verify_time(1) for r in rs)
            row["verify_share"] = min(v / wall, 1.0)
            row["draft_and_bookkeeping_share"] = max(1.0 - v / wall, 0.0)
        rows.append(row)
    base = {(r["prompt_set"], r["category"]): r["tokens_per_second"] for r in rows
            if r["method"] == baseline}
    for r in rows:
        b = base.get((r["prompt_set"], r["category"]))
        r["speedup"] = r["tokens_per_second"] / b if b else None
    return sorted(rows, key=lambda r: (r["prompt_set"], r["category"] != "all", r["category"],
                                       r["method"]))


def markdown(rows) -> str:
    head = ("| set | category | method | tree | τ | tok/s | speedup | verify share | plain steps "
            "| = plain |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        sp = f"{r['speedup']:.2f}×" if r.get("speedup") else "–"
        vs = f"{r['verify_share']:.0%}" if "verify_share" in r else "–"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "–"
        lines.append(f"| {r['prompt_set']} | {r['category']} | {r['method']} | {r['tree_tokens']} | "
                     f"{tau} | {r['tokens_per_second']:.1f} | {sp} | {vs} | "
                     f"{r.get('plain_step_share', 0.0):.0%} | {r.get('equal_to_plain', '–')} |")
    return "\n".join(lines)


def run_bench(target, drafts: dict[str, tuple[Any, Any]], prompt_sets: dict[str, list],
              max_new_tokens: int, progress=True, datastore=None, temperature: float = 0.0,
              top_p: float = 1.0, seed: int = 0,
              on_run: Callable[[Run], None] | None = None,
              peers: dict[str, Callable] | None = None, turns: str = "all") -> list[Run]:
    """drafts: name -> (draft, tree) or (draft, tree, fallback) (`generate`'s fallback, else its
    default); prompt_sets: name -> [Prompt]. Interleaved by prompt, and within a prompt by turn.
    `datastore` serves the drafts whose tree has +ds:N. Greedy, or sampled at (temperature,
    top_p) with seed `seed + i` for the i-th prompt, the same for every method. Greedy runs
    record whether each output equals plain decoding's ("plain" must come first in `drafts`).
    `on_run` sees each run as it finishes (the CLI appends it to runs.jsonl: a run cut short by a
    time limit keeps what it measured). `peers` (`transformers_peers`) run after the drafts on
    each prompt, in the same interleaving. turns="all" plays a multi-turn prompt (MT-bench) as
    its conversation, as the EAGLE and Medusa evaluations do: turn N is asked after the first
    method's (plain decoding's) answers to the turns before it, so every method gets the same
    prompt; "first" asks its first turn alone."""
    from tqdm import tqdm

    import spec_jax
    from spec_jax.data import conversation
    from spec_jax.generate import resolve_drafter

    if turns not in ("all", "first"):
        raise SpecJaxError(f"turns must be 'all' or 'first', not {turns!r}")
    for draft, tree, *_ in drafts.values():  # a tree that cannot be drafted fails now, not later
        resolve_drafter(target, draft, tree, datastore=datastore if uses_datastore(tree) else None,
                        temperature=temperature, top_p=top_p)
    runs = []
    items = [(s, p) for s, ps in prompt_sets.items() for p in ps]
    for i, (pset, p) in enumerate(tqdm(items, disable=not progress, desc="bench")):
        asked = p.turns if turns == "all" and getattr(p, "turns", ()) else (p.text,)
        answers: list[str] = []
        for t in range(len(asked)):
            prompt = conversation(asked, answers) if t else p.text
            plain_ids = answer = None
            for name, (draft, tree, *fb) in drafts.items():
                kw = {"draft": draft, "tree": tree,
                      "datastore": datastore if uses_datastore(tree) else None,
                      "temperature": temperature, "top_p": top_p, "seed": seed + i,
                      **({"fallback": fb[0]} if fb else {})}
                r = spec_jax.generate(target, prompt, max_new_tokens, **kw)
                if r.stats["compile_seconds"] > 0:  # first use of this shape: run again, compiled
                    c = r.stats["compile_seconds"]
                    r = spec_jax.generate(target, prompt, max_new_tokens, **kw)
                    r.stats["compile_seconds"] = c
                s = r.stats
                same = None
                if temperature == 0 and draft is None and tree is None:
                    plain_ids = r.token_ids
                elif temperature == 0 and plain_ids is not None:
                    same = r.token_ids == plain_ids
                answer = r.text if answer is None else answer
                runs.append(Run(method=name, prompt_set=pset, category=p.category,
                                new_tokens=s["new_tokens"], steps=sum(s["acceptance_histogram"]),
                                wall=s["wall_seconds"], compile_s=s["compile_seconds"],
                                tree_tokens=s["tree_tokens"],
                                hist=tuple(s["acceptance_histogram"]), same_as_plain=same,
                                plain_steps=s.get("plain_steps", 0), turn=t + 1))
                if on_run is not None:
                    on_run(runs[-1])
            for run in (peers or {}).values():
                runs.append(dataclasses.replace(
                    run(pset, p._replace(text=prompt), max_new_tokens, temperature, top_p, seed + i),
                    turn=t + 1))
                if on_run is not None:
                    on_run(runs[-1])
            answers.append(answer or "")
    return runs


def method_histograms(runs: list[Run]) -> dict[str, list[int]]:
    """Acceptance histograms summed over each method's runs (methods that speculate only)."""
    out: dict[str, list[int]] = {}
    for r in runs:
        if len(r.hist) < 2:
            continue
        h = out.setdefault(r.method, [])
        h.extend([0] * (len(r.hist) - len(h)))
        for i, c in enumerate(r.hist):
            h[i] += c
    return out


PEER_MODES = ("greedy", "prompt_lookup", "assisted")


def transformers_peers(target, modes=PEER_MODES, assistant_layers: int = 4) -> dict[str, Callable]:
    """transformers' `generate` on the same weights, loaded once: name -> run(prompt_set, prompt,
    max_new_tokens, temperature, top_p, seed) -> Run, for `run_bench(peers=...)`. Modes: greedy
    (sampling with the same temperature and top_p where temperature > 0), prompt-lookup decoding,
    and assisted generation with the target's first `assistant_layers` layers (through its final
    norm and LM head) as the assistant: no smaller model with SmolLM2's tokenizer is reachable
    here, so the assistant is this untrained early exit. Raises SpecJaxError without the
    checkpoint's hf/ folder; ImportError without torch or transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    if target.path is None or not (Path(target.path) / "hf").is_dir():
        raise SpecJaxError("the transformers peer needs the checkpoint's hf/ folder")
    hf = str(Path(target.path) / "hf")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assistant = None
    if "assisted" in modes:
        if not 0 < assistant_layers < model.config.num_hidden_layers:
            raise SpecJaxError(f"assistant_layers {assistant_layers}: the assistant needs 1 to "
                               f"{model.config.num_hidden_layers - 1} of the target's layers")
        assistant = AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float32, num_hidden_layers=assistant_layers).eval()

    def peer(mode):
        kw = {"prompt_lookup_num_tokens": 10} if mode == "prompt_lookup" else {}
        if mode == "assisted":
            kw["assistant_model"] = assistant

        def run(pset, p, max_new_tokens, temperature, top_p, seed):
            sample = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
                      if temperature > 0 else {"do_sample": False})
            with torch.no_grad():
                ids = torch.tensor([target.encode(p.text)])
                model.generate(ids, max_new_tokens=4, pad_token_id=2, **kw, **sample)  # warm-up
                torch.manual_seed(seed)
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=max_new_tokens, pad_token_id=2, **kw,
                                     **sample)
                wall = time.perf_counter() - t0
            label = "sample" if mode == "greedy" and temperature > 0 else mode
            if mode == "assisted":
                label += f"({assistant_layers} layers)"
            return Run(method=f"transformers-{label}", prompt_set=pset, category=p.category,
                       new_tokens=out.shape[1] - ids.shape[1], steps=0, wall=wall,
                       compile_s=0.0, tree_tokens=1)  # tau not observable
        return run

    return {m: peer(m) for m in modes}


def plot(rows, runs_hist: dict[str, list[int]], out_dir: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    cats = sorted({(r["prompt_set"], r["category"]) for r in rows})
    methods = sorted({r["method"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, len(cats) * 1.2), 4))
    w = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        ys = [next((r["speedup"] or 0 for r in rows if r["method"] == m and (r["prompt_set"], r["category"]) == c), 0)
              for c in cats]
        ax.bar(np.arange(len(cats)) + i * w, ys, w, label=m)
    ax.set_xticks(np.arange(len(cats)) + 0.4 - w / 2, [f"{s}\n{c}" for s, c in cats], fontsize=7)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("speedup over plain spec_jax")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, h in runs_hist.items():
        h = np.asarray(h, float)
        if h.sum():
            ax.plot(np.arange(len(h)), h / h.sum(), marker="o", label=m)
    ax.set_xlabel("draft tokens accepted per target call")
    ax.set_ylabel("fraction of steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "tau_hist.png", dpi=120)
    plt.close(fig)


CALIBRATION_PROMPTS = 8


def calibration_prompts(prompts: list, measured: list, n: int = CALIBRATION_PROMPTS) -> list:
    """`n` prompts of a user's own set to size trees on, spread over its categories and never one
    the bench measures (a tree sized on the prompts it is scored on would flatter itself)."""
    from spec_jax.data import spread

    seen = {p.text for p in measured}
    rest = [p for p in prompts if p.text not in seen]
    if not rest:
        raise SpecJaxError("--calibrate-on has no prompt that the bench does not measure: give it "
                           "another file, or a smaller --limit")
    return spread(rest, n)


def add_auto_rows(drafts: dict, label: str, draft, tree, report: dict, mode: str = "on") -> None:
    """The rows of a sized choice: as the sizing chose it ("on": with the plain-step fallback,
    labelled "+plain<B", where the sizing measured that it pays), without the fallback ("off"),
    or both ("both": with the fallback at the break-even the sizing measured, and without)."""
    from spec_jax.sizing import chosen_fallback

    chosen = chosen_fallback(report["measured"])
    point = chosen if mode == "on" else next(
        (tuple(m["fallback"]) for m in report["measured"] if m.get("fallback")), chosen)
    if mode in ("on", "both") and point:
        drafts[f"{label}+plain<{point[0]:.2f}"] = (draft, tree, point)
    if mode != "on" or not point:
        drafts[label] = (draft, tree, False)


def bench_cli(a):
    """`spec-jax bench`: one interleaved run of plain decoding, drafters and transformers peers."""
    import jax

    import spec_jax
    from spec_jax.data import prompt_set, read_prompts, spread

    if a.temperature < 0 or not 0 < a.top_p <= 1:
        raise SpecJaxError("--temperature must be >= 0 and --top-p in (0, 1]")
    target = spec_jax.load_target(a.model, layers=getattr(a, "layers", "auto"))
    if a.profile and jax.default_backend() != "cpu":  # said before the runs, not after them
        raise SpecJaxError("--profile reads XLA:CPU's thunk names: run it on CPU, or leave it out")
    n = target.cfg.num_layers
    if a.peers and not 0 <= a.assistant_layers < n:
        raise SpecJaxError(f"--assistant-layers must be 0 (no assisted generation) to {n - 1} for "
                           f"this model's {n} layers, not {a.assistant_layers}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if getattr(a, "batch_sizes", None):  # throughput per batch size instead (spec_jax.bench_batch)
        from spec_jax.bench_batch import batch_cli

        batch_cli(a, target, out)
        return
    sets = {}
    for path in a.prompts or [prompt_set("mt_bench")]:
        ps = spread(read_prompts(path), a.limit)
        sets[Path(path).parent.name if Path(path).is_file() else Path(path).name] = ps
    ds = spec_jax.load_datastore(a.datastore) if a.datastore else None
    calib = None
    if a.calibrate_on:
        calib = calibration_prompts(read_prompts(a.calibrate_on), [p for ps in sets.values() for p in ps])
    sampling = dict(temperature=a.temperature, top_p=a.top_p)  # temperature 0: greedy
    drafts: dict[str, tuple] = {"plain": (None, None)}
    sized = set()  # heads sized in this run (--calibrate sizes each once)
    for spec in a.drafts:
        name, _, tree = spec.partition("@")
        if name == "ngram":
            if tree == "auto":  # sized before the runs, as heads are
                fresh = bool(a.calibrate or a.calibrate_on)
                chosen, report = size_ngram(target, calib, use_cache=not fresh, **sampling)
                (out / "sizing_ngram.json").write_text(json.dumps(report, indent=1))
                if chosen == PLAIN:
                    drafts[f"ngram@auto({tree_name(chosen)})"] = (None, None)
                else:
                    add_auto_rows(drafts, f"ngram@auto({tree_name(chosen)})", "ngram", chosen,
                                  report, a.fallback)
            else:
                drafts[spec] = ("ngram", tree or None)
            continue
        heads = spec_jax.load_draft(name)
        spec = parse(tree or None)
        switch = spec.base.as_dict() if isinstance(spec.base, Switch) else None
        label = f"{heads.method}" + (f"@{tree_name(switch) if switch else tree}" if tree else "")
        fresh = bool(a.calibrate or a.calibrate_on) and name not in sized
        auto, ds_n = isinstance(spec.base, Auto), spec.ds
        if auto or fresh:
            chosen, report = size_tree(target, heads, calib, use_cache=not fresh, datastore=ds,
                                       **sampling)
            sized.add(name)
            (out / f"sizing_{heads.method}.json").write_text(json.dumps(report, indent=1))
            _plot_curve(report, out / f"sizing_{heads.method}.png")
            print(f"{name}: {_curve_table(report)}")
            if auto:  # with +ds:N, generate grafts it onto the tree just sized
                label = f"{heads.method}@auto({tree_name(chosen)})" + (f"+ds:{ds_n}" if ds_n else "")
                if not ds_n:
                    tree = chosen if chosen != PLAIN else "plain"
                    if tree != "plain":
                        add_auto_rows(drafts, label, heads, tree, report, a.fallback)
                        continue
        drafts[label] = (None, None) if tree == "plain" else (heads, tree or None)
    log = out / "runs.jsonl"
    log.write_text("")

    def record(r: Run):
        with log.open("a") as f:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")

    peers = None
    if a.peers:
        modes = PEER_MODES if a.assistant_layers else PEER_MODES[:2]
        try:
            peers = transformers_peers(target, modes, a.assistant_layers)
        except Exception as e:  # a missing peer is reported, never fatal
            print(f"(transformers peers skipped: {e})")
    runs = run_bench(target, drafts, sets, a.max_new_tokens, datastore=ds, seed=a.seed,
                     on_run=record, peers=peers, turns=a.turns, **sampling)
    sizes = sorted({r.tree_tokens for r in runs})
    vt = verify_latency(target, sizes)
    rows = summarize(runs, verify_time=lambda t: vt.get(t, 0.0))
    table = markdown(rows)
    print(f"\nmachine: {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"{a.max_new_tokens} new tokens, "
          + (f"sampled at temperature {a.temperature:g}, top_p {a.top_p:g}" if a.temperature > 0
             else "greedy")
          + ", batch 1" + (", every turn of multi-turn prompts" if any(r.turn > 1 for r in runs)
                           else "") + "\n")
    print(table)
    profiles = {}
    if a.profile:
        first = next(p for ps in sets.values() for p in ps)
        profiles = profile_drafts(target, drafts, first, a.max_new_tokens, datastore=ds, **sampling)
        shares = profile_markdown(profiles, first)
        table += "\n\n" + shares
        print("\n" + shares)
    (out / "results.json").write_text(json.dumps({"rows": rows, "verify_latency": vt,
                                                  "runs": [dataclasses.asdict(r) for r in runs],
                                                  "profiles": profiles}, indent=1))
    (out / "results.md").write_text(table + "\n")
    plot(rows, method_histograms(runs), out)


def profile_drafts(target, drafts: dict, prompt, max_new_tokens: int, datastore=None,
                   temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Each of `run_bench`'s drafts on one prompt under the profiler (spec_jax.profile): method ->
    {"untraced_ms_per_call", "traced_ms_per_call", "tau", "scopes", "shares"}, the shares of the
    loop's traced time in draft, verify and bookkeeping."""
    from spec_jax.profile import profile_generation, step_shares

    out = {}
    for name, (draft, tree, *fb) in drafts.items():
        p = profile_generation(target, prompt.text, max_new_tokens, draft=draft, tree=tree,
                               datastore=datastore if uses_datastore(tree) else None,
                               temperature=temperature, top_p=top_p,
                               **({"fallback": fb[0]} if fb else {}))
        out[name] = {k: p[k] for k in ("untraced_ms_per_call", "traced_ms_per_call", "tau",
                                       "scopes")} | {"shares": step_shares(p)}
    return out


def profile_markdown(profiles: dict, prompt) -> str:
    lines = [f"Where a step's time goes (traced, one prompt: {prompt.category or prompt.id}; "
             "shares of the loop's traced time):", "",
             "| method | ms per target call | τ | draft | verify | bookkeeping |",
             "|---|---|---|---|---|---|"]
    for name, p in profiles.items():
        sh = p["shares"]
        lines.append(f"| {name} | {p['untraced_ms_per_call']:.2f} | {p['tau']:.2f} | "
                     f"{sh['draft']:.0%} | {sh['verify']:.0%} | {sh['bookkeeping']:.0%} |")
    return "\n".join(lines)


def _curve_table(report) -> str:
    """The sizing curve as Markdown: predicted per tree size, then what was measured end to end."""
    lines = ["", "| tree tokens | of them n-gram | of them datastore | depth | expected τ | "
             "step ms (verify + draft) | predicted tok/s |", "|---|---|---|---|---|---|---|",
             f"| 1 (plain) | 0 | 0 | 0 | 1.00 | {1e3 * report['verify_seconds']['1']:.1f} | "
             f"{report['plain_predicted_tokens_per_second']:.1f} |"]
    for c in report["curve"]:
        lines.append(f"| {c['size']} | {c['ngram']} | {c.get('ds', 0)} | {c['depth']} | "
                     f"{c['tau']:.2f} | {1e3 * c['step_seconds']:.1f} | "
                     f"{c['predicted_tokens_per_second']:.1f} |")
    # per size, the switch predicted fastest (caches written before the ceiling was recorded lack it)
    switches = [c for c in report["curve"] if "tau_ceiling" in c]
    for size in sorted({c["size"] for c in switches}):
        c = max((c for c in switches if c["size"] == size),
                key=lambda c: c["predicted_tokens_per_second"])
        lines.append(f"\n{tree_name(c['switch'])}: τ {c['tau']:.2f} by its policy, "
                     f"{c['tau_ceiling']:.2f} if every step took the arm of that size that "
                     f"accepts most there (no policy over these arms does better)")
    lines += ["", "| measured end to end | τ | tok/s |", "|---|---|---|"]
    for m in report["measured"]:
        lines.append(f"| {measured_name(m)} | {m['tau']:.2f} | {m['tokens_per_second']:.1f} |")
    lines.append(f"\nchosen: {choice_name(*choice_of(report))} (profile over "
                 f"{report['profile_positions']} positions, {report['seconds']:.0f} s)")
    return "\n".join(lines)


def _plot_curve(report, path):
    """Predicted tokens/s per tree size, with the end-to-end measurements marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for g, n in sorted({(c["ngram"], c.get("ds", 0)) for c in report["curve"]}):
        curve = [c for c in report["curve"] if (c["ngram"], c.get("ds", 0)) == (g, n)]
        plain = not g and not n
        xs = [1] * plain + [c["size"] for c in curve]
        ys = [report["plain_predicted_tokens_per_second"]] * plain + [
            c["predicted_tokens_per_second"] for c in curve]
        ax.plot(xs, ys, marker="o", label="predicted (measured costs × profile τ)" if plain
                else f"predicted, {g} n-gram + {n} datastore tokens")
    for m in report["measured"]:
        t = m["tree"]
        x = tree_tokens(t)
        ax.scatter([x], [m["tokens_per_second"]], marker="x", color="k")
        ax.annotate(measured_name(m), (x, m["tokens_per_second"]), fontsize=6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree tokens")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
