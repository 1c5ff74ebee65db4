"""Throughput per batch size: `spec-jax bench --batch-sizes 1,4,16`.

A server decodes several requests at once, and a bigger batch makes verification costlier: the
target's forward over B rows of T tree tokens grows with B x T, while a plain step of B rows is
still one pass over the weights. So a tree that pays at batch 1 may not at batch 16, and the
sizing (`tree="auto"`, spec_jax.sizing) measures and caches a choice per batch size (bucketed to
powers of two, `batch_bucket`), which may be a smaller tree or plain decoding.

For each batch size B, `batch_bench` runs plain decoding and every drafter (with tree "auto"
unless the user named one: sized for B on first use, then cached) over the same prompts, B at a
time with `generate_batch`. Every batch size covers the same prompts (B=1: one call per prompt,
B=16: one call for 16), so acceptance compares across the rows. Calls are interleaved group by
group so that drift on a shared host hits every method alike, every other round in reverse order
(two methods running the same program once measured 9% apart at batch 16); a call that compiled
is run again (compile and sizing are never timed). Each method runs `rounds` times and keeps its
faster round; the spread between rounds is the host's noise, printed beside the speedups.
"""
from __future__ import annotations

from typing import Any

from spec_jax.errors import SpecJaxError

ROUNDS = 2  # timed rounds per method and batch size: the faster counts, the spread is the noise

NOT_FOR_BATCHES = ("calibrate", "calibrate_on", "datastore", "profile")  # per-prompt bench only


def parse_batch_sizes(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16]: distinct batch sizes >= 1, in the order given."""
    try:
        sizes = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SpecJaxError(f"--batch-sizes takes batch sizes >= 1 separated by commas (1,4,16), "
                           f"not {text!r}")
    return list(dict.fromkeys(sizes))


def groups_of(prompts: list, batch: int, n: int) -> list[list]:
    """`n` prompts (the list cycled where shorter) in calls of `batch` rows; the last call is
    filled up from the start, so that every call has `batch` rows."""
    if not prompts:
        raise SpecJaxError("the batch table needs at least one prompt")
    calls = -(-n // batch)
    return [[prompts[(c * batch + r) % len(prompts)] for r in range(batch)] for c in range(calls)]


def sized_name(target, draft, tree, batch: int, temperature: float, top_p: float) -> str:
    """The tree a drafter runs at this batch size: for a tree left to the sizing ("auto"), the
    sizing's choice for the batch (sized now if never sized: `sizing.resolve`, as generate_batch
    does), written "auto: CHOICE"; else the tree as given."""
    from spec_jax import sizing
    from spec_jax.tree_spec import parse

    spec = parse(tree)
    if not spec.sized:
        return str(spec)
    top_p = top_p if temperature > 0 else 1.0
    chosen = sizing.resolve(target, draft, spec, batch, None, temperature, top_p)
    if chosen is None:
        return f"{spec}: the method's default (never sized)"
    return f"{spec}: " + sizing.choice_name(chosen[0].as_json(), chosen[1])


def batch_bench(target, drafts: dict[str, tuple[Any, Any]], prompts: list, batch_sizes,
                max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                rounds: int = ROUNDS, n_prompts: int | None = None,
                progress: bool = True) -> list[dict]:
    """Rows of the batch table, one per (batch size, method), in that order. `drafts`: label ->
    (draft, tree) (None, None for plain decoding, which must come first); `prompts`: texts, token
    id lists or `Prompt`s (their first turn). Every batch size decodes the same `n_prompts`
    prompts (default: the largest batch size), `batch` rows per `generate_batch` call, call i
    seeded with seed + i. A drafter's tree is sized for each batch size before its runs
    (`sized_name`)."""
    import spec_jax

    if rounds < 1:
        raise SpecJaxError(f"rounds must be >= 1, not {rounds}")
    texts = [getattr(p, "text", p) for p in prompts]
    n = n_prompts or max(batch_sizes)
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    rows = []
    for b in batch_sizes:
        trees = {label: "plain" if draft is None else
                 sized_name(target, draft, tree, b, temperature, top_p)
                 for label, (draft, tree) in drafts.items()}
        groups = groups_of(texts, b, n)
        walls = {label: [0.0] * rounds for label in drafts}
        stats = {label: {"new_tokens": 0, "steps": 0, "rows": 0, "same": []} for label in drafts}
        for r in range(rounds):
            for i, group in enumerate(groups):
                plain_ids = None
                order = list(drafts.items())  # odd rounds run the methods in reverse order
                for label, (draft, tree) in (order[::-1] if r % 2 else order):
                    kw = dict(temperature=temperature, top_p=top_p, seed=[seed + i] * b,
                              draft=draft, tree=tree)
                    out = spec_jax.generate_batch(target, group, max_new_tokens, **kw)
                    if out[0].stats["compile_seconds"] > 0:  # first use of this shape: again
                        out = spec_jax.generate_batch(target, group, max_new_tokens, **kw)
                    walls[label][r] += out[0].stats["wall_seconds"]
                    if r:
                        continue
                    st = stats[label]
                    st["new_tokens"] += sum(o.stats["new_tokens"] for o in out)
                    st["steps"] += sum(sum(o.stats["acceptance_histogram"]) for o in out)
                    st["rows"] += len(out)
                    ids = [o.token_ids for o in out]
                    if temperature == 0 and draft is None:
                        plain_ids = ids
                    elif temperature == 0 and plain_ids is not None:
                        st["same"] += [a == p for a, p in zip(ids, plain_ids)]
        for label in drafts:
            st, w = stats[label], walls[label]
            row = {"batch": b, "method": label, "tree": trees[label], "calls": len(groups),
                   "rows": st["rows"], "new_tokens": st["new_tokens"],
                   "tokens_per_call": ((st["new_tokens"] - st["rows"]) / st["steps"]
                                       if st["steps"] else None),
                   "tokens_per_second": st["new_tokens"] / min(w) if min(w) > 0 else 0.0,
                   "rounds_tokens_per_second": [st["new_tokens"] / x if x > 0 else 0.0 for x in w],
                   "wall_seconds": min(w)}
            if st["same"]:
                row["equal_to_plain"] = f"{sum(st['same'])}/{len(st['same'])}"
            rows.append(row)
            say(f"batch {b} {label} ({trees[label]}): {row['tokens_per_second']:.1f} tok/s")
    plain = {r["batch"]: r["tokens_per_second"] for r in rows if r["method"] == "plain"}
    for r in rows:
        r["speedup"] = r["tokens_per_second"] / plain[r["batch"]] if plain.get(r["batch"]) else None
        runs = r["rounds_tokens_per_second"]
        r["spread"] = (max(runs) - min(runs)) / max(runs) if max(runs) > 0 else 0.0
    return rows


def batch_noise(rows: list[dict], batch: int) -> float:
    """The host's noise at one batch size, as the sizing reckons it (`spec_jax.sizing.DS_MARGIN`):
    the median spread between the rounds of its methods, and at least 3% (on 2 shared CPU cores,
    methods running the same program measured 1-3% apart where each one's rounds agreed within
    1%)."""
    from spec_jax.sizing import DS_MARGIN

    spreads = sorted(r["spread"] for r in rows if r["batch"] == batch)
    return max(DS_MARGIN, spreads[len(spreads) // 2] if spreads else 0.0)


def batch_markdown(rows: list[dict]) -> str:
    """The batch table: per batch size and method, the tree it ran, tokens per target call (per
    row), total new tokens per second over all rows, speedup over plain decoding at the same batch
    size, the spread between rounds and, greedy, how many rows equal plain decoding's."""
    lines = ["| batch | method | tree | tokens/call (per row) | tok/s (all rows) | speedup | "
             "rounds' spread | = plain |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r['tokens_per_call']:.2f}" if r["tokens_per_call"] is not None else "–"
        sp = f"{r['speedup']:.2f}×" if r.get("speedup") else "–"
        lines.append(f"| {r['batch']} | {r['method']} | {r['tree']} | {tau} | "
                     f"{r['tokens_per_second']:.1f} | {sp} | {r['spread']:.0%} | "
                     f"{r.get('equal_to_plain', '–')} |")
    noise = ", ".join(f"batch {b}: {batch_noise(rows, b):.0%}"
                      for b in dict.fromkeys(r["batch"] for r in rows))
    lines.append(f"\nhost noise (median spread between rounds, at least 3%): {noise}")
    return "\n".join(lines)


def batch_drafts(specs: list[str]) -> dict[str, tuple[Any, Any]]:
    """`--drafts` for the batch table: label -> (draft, tree), plain first. A drafter without
    @TREE runs with tree "auto" (sized per batch size); "ngram" and "mtp" are drafted by name,
    anything else is a heads folder."""
    import spec_jax

    drafts: dict[str, tuple[Any, Any]] = {"plain": (None, None)}
    for spec in specs:
        name, _, tree = spec.partition("@")
        draft = name if name in ("ngram", "mtp") else spec_jax.load_draft(name)
        label = getattr(draft, "method", name) + (f"@{tree}" if tree and tree != "auto" else "")
        drafts[label] = (draft, tree or "auto")
    return drafts


def batch_cli(a, target, out) -> tuple[list[dict], str]:
    """`spec-jax bench --batch-sizes`: the batch table on `--prompts` (default MT-bench, first
    turns), printed and written to OUT/results.json and OUT/results.md; returns (rows, table)."""
    import json

    import jax

    from spec_jax.data import prompt_set, read_prompts, spread

    given = [f"--{k.replace('_', '-')}" for k in NOT_FOR_BATCHES if getattr(a, k, None)]
    if given:
        raise SpecJaxError(f"{', '.join(given)}: the per-prompt bench's options; --batch-sizes "
                           "sizes each batch size with tree 'auto' (once, then cached)")
    sizes = parse_batch_sizes(a.batch_sizes)
    n = max(a.limit, max(sizes))
    prompts = [p for path in a.prompts or [prompt_set("mt_bench")]
               for p in spread(read_prompts(path), n)][:n]
    drafts = batch_drafts(a.drafts)
    print("sizing is measured per batch size on first use (minutes each), then cached; "
          "neither sizing nor compiling is timed", flush=True)
    rows = batch_bench(target, drafts, prompts, sizes, a.max_new_tokens,
                       temperature=a.temperature, top_p=a.top_p, seed=a.seed, n_prompts=n)
    table = batch_markdown(rows)
    head = (f"machine: {jax.default_backend()} ({jax.devices()[0].device_kind}), "
            f"{a.max_new_tokens} new tokens, {n} prompts at every batch size, "
            + (f"sampled at temperature {a.temperature:g}, top_p {a.top_p:g}"
               if a.temperature > 0 else "greedy")
            + f", best of {ROUNDS} rounds")
    print(f"\n{head}\n\n{table}")
    (out / "results.json").write_text(json.dumps({"batch_rows": rows, "setting": head}, indent=1))
    (out / "results.md").write_text(f"{head}\n\n{table}\n")
    return rows, table
