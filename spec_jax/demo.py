"""`spec-jax demo`: where speculation pays on this machine, by kind of prompt.

Decodes a few prompts of three kinds (chat, code, rewrite/extract) with plain decoding and each
drafter sized for this machine (`tree="auto"`: the sizing measures on first use and caches its
choice, so a second run is quick), after a warm-up, and prints per kind the tokens/s, the tokens a
target call produced (tau) and the speed against plain decoding; then one summary line per drafter
over all prompts and, where a drafter lost, why: the tokens it accepted per step against the
break-even a tree step must reach to beat a plain step (the break-even its sizing measured).

The kinds differ on purpose: an n-gram drafter only proposes what the context already holds (it
pays when the answer repeats the prompt: rewriting, extracting), trained heads predict the
model's own phrasing (they pay on chat and code), and any drafter loses where it accepts fewer
tokens per step than a tree step costs in plain steps.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

PROMPTS: dict[str, list[str]] = {
    "chat": [
        "What is the capital of France? Answer in one sentence.",
        "Give three tips for staying focused while studying.",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number.",
        "Write a Python function that checks whether a string is a palindrome.",
    ],
    "rewrite/extract": [
        "Correct the spelling in this paragraph and return it: Teh quick brown fox jumpd over "
        "the lazzy dog. It was a sunny day and the fox was verry happy to be outside in the "
        "feilds with its freinds.",
        "List every city named in this text, one per line: Last spring Maria flew from Lisbon to "
        "Berlin, took the train on to Prague and Vienna, and ended her trip in Budapest before "
        "returning home to Lisbon.",
    ],
}

NOISE = 0.05  # speed ratios within 5% of 1 are a tie on a shared host


@dataclasses.dataclass
class Method:
    """One way of decoding the demo runs: its label, generate's `draft`, and the break-even
    (tokens a tree step must accept to match a plain step) its sizing measured, or None."""
    label: str
    draft: object
    tree: str = "plain"  # the sized choice, by name
    break_even: float | None = None
    sized_plain: bool = False  # the sizing chose plain decoding on this machine


@dataclasses.dataclass
class Row:
    kind: str
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    runs: int = 0

    def add(self, stats: dict) -> None:
        self.runs += 1
        self.tokens += stats["new_tokens"]
        self.seconds += stats["wall_seconds"]
        self.steps += stats["target_calls"] - 1

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        # each run's first token comes from the prefill, not from a step
        return (self.tokens - self.runs) / self.steps if self.steps else 0.0


def methods(target, draft_dirs: list[Path], say=print) -> list[Method]:
    """Plain, n-gram and each head folder that exists, each sized for this machine now (cached)."""
    import spec_jax
    from spec_jax.sizing import choice_name, choice_of, size_ngram, size_tree
    from spec_jax.sizing.choice import break_even
    from spec_jax.sizing.names import PLAIN

    def method(label, draft, report):
        tree, fallback = choice_of(report)
        even = break_even(report.get("measured") or [])
        return Method(label, draft, choice_name(tree, fallback), even[0] if even else None,
                      sized_plain=tree == PLAIN)

    out = [Method("plain", None), method("n-gram", "ngram", size_ngram(target)[1])]
    for d in draft_dirs:
        if not Path(d).is_dir():
            say(f"(no trained heads at {d}: skipped)")
            continue
        heads = spec_jax.load_draft(d)
        out.append(method(heads.method.upper().replace("EAGLE3", "EAGLE-3"), heads,
                          size_tree(target, heads)[1]))
    return out


def run(target, draft_dirs: list[Path], max_new_tokens: int = 96, prompts=None, say=print):
    """Run the demo and print it; returns {method label: {kind: Row}} for callers and tests."""
    import spec_jax

    prompts = prompts or PROMPTS
    ms = methods(target, draft_dirs, say)
    say("\ntrees sized for this machine (cached; `tree=\"auto\"`):")
    for m in ms[1:]:
        say(f"  {m.label:<8} {m.tree}")
    first = next(iter(prompts.values()))[0]
    for m in ms:  # warm-up: compiles and first-call costs out of the timed runs
        spec_jax.generate(target, first, max_new_tokens=max_new_tokens, draft=m.draft, tree="auto")
    rows = {m.label: {k: Row(k) for k in prompts} for m in ms}
    for kind, ps in prompts.items():
        say(f"\n## {kind}")
        for p in ps:
            for m in ms:
                r = spec_jax.generate(target, p, max_new_tokens=max_new_tokens, draft=m.draft,
                                      tree="auto")
                rows[m.label][kind].add(r.stats)
                if m.draft is None:
                    text = " ".join(r.text.split())
                    say(f"  > {p[:60]}{'...' if len(p) > 60 else ''}\n    {text[:110]}"
                        f"{'...' if len(text) > 110 else ''}")
        plain = rows[ms[0].label][kind]
        for m in ms:
            row = rows[m.label][kind]
            say(f"  {m.label:<8} {row.tok_s:7.1f} tok/s  tau {row.tau:4.2f}  "
                f"{row.tok_s / plain.tok_s:5.2f}x plain")
    say(summary(ms, rows))
    return rows


def summary(ms: list[Method], rows: dict) -> str:
    """One line per method over all prompts, and one sentence per drafter that lost somewhere."""
    total = {m.label: _total(rows[m.label].values()) for m in ms}
    plain = total[ms[0].label]
    n = sum(1 for _ in rows[ms[0].label])
    lines = [f"\n## summary over {n} kinds of prompt (tokens/s after warm-up; tau = tokens a "
             "target call produced)"]
    for m in ms:
        t = total[m.label]
        kinds = ", ".join(f"{k} {r.tok_s / rows[ms[0].label][k].tok_s:.2f}x"
                          for k, r in rows[m.label].items())
        lines.append(f"  {m.label:<8} {t.tok_s:7.1f} tok/s  tau {t.tau:4.2f}  "
                     f"{t.tok_s / plain.tok_s:5.2f}x plain  ({kinds})")
    for m in ms[1:]:
        lines += why(m, rows[m.label], rows[ms[0].label])
    return "\n".join(lines)


def why(m: Method, rows: dict, plain: dict) -> list[str]:
    """A sentence on where `m` lost to plain decoding and why, or none where it did not."""
    lost = [k for k, r in rows.items() if r.tok_s < (1 - NOISE) * plain[k].tok_s]
    if not lost:
        return []
    if m.sized_plain:
        return [f"{m.label} lost on {', '.join(lost)}: its sizing found no tree that beat plain "
                "decoding on this machine, so it decodes plainly with a tree step now and then "
                "to find out whether the drafts have started to pay."]
    taus = ", ".join(f"{rows[k].tau:.2f} tokens a step on {k}" for k in lost)
    # what a tree step cost here in plain steps: tau x plain tok/s / its tok/s
    cost = max(rows[k].tau * plain[k].tok_s / rows[k].tok_s for k in lost if rows[k].tok_s > 0)
    even = f"{m.break_even:.2f}" if m.break_even else f"{cost:.2f}"
    return [f"{m.label} lost on {', '.join(lost)}: it accepted {taus}, and a tree step "
            f"must accept {even} to beat a plain step on this machine (the break-even its sizing "
            f"measured; here a step cost up to {cost:.2f} plain steps)."]


def _total(rows) -> Row:
    t = Row("all")
    for r in rows:
        t.tokens, t.seconds, t.steps = t.tokens + r.tokens, t.seconds + r.seconds, t.steps + r.steps
        t.runs += r.runs
    return t
