"""`spec-jax demo`'s summary: one line per method over all prompts, and a sentence on why a drafter
lost where it did (pure functions of the measured rows: no model runs here)."""
from spec_jax.demo import Method, Row, summary, why


def _row(kind, tokens, seconds, steps, runs=2):
    r = Row(kind)
    r.tokens, r.seconds, r.steps, r.runs = tokens, seconds, steps, runs
    return r


def _rows(speeds):  # {kind: (tok/s, tau)} for 2 runs of 96 tokens
    return {k: _row(k, 192, 192 / s, round(190 / tau)) for k, (s, tau) in speeds.items()}


PLAIN = _rows({"chat": (150, 1.0), "code": (150, 1.0), "rewrite/extract": (150, 1.0)})


def test_a_drafter_that_loses_is_told_why_with_its_acceptance_and_break_even():
    ngram = Method("n-gram", "ngram", "chain:4", break_even=1.3)
    rows = _rows({"chat": (120, 1.05), "code": (148, 1.25), "rewrite/extract": (260, 2.6)})
    (sentence,) = why(ngram, rows, PLAIN)
    assert sentence.startswith("n-gram lost on chat:")  # code is within the noise: not a loss
    assert "1.05 tokens a step on chat" in sentence and "must accept 1.30" in sentence


def test_a_drafter_that_never_loses_needs_no_sentence_and_plain_sizing_says_so():
    eagle = Method("EAGLE", object(), "dynamic:8,5,32", break_even=1.4)
    assert why(eagle, _rows({k: (200, 2.0) for k in PLAIN}), PLAIN) == []
    sized_plain = Method("n-gram", "ngram", sized_plain=True)
    (sentence,) = why(sized_plain, _rows({k: (130, 1.0) for k in PLAIN}), PLAIN)
    assert "no tree that beat plain decoding" in sentence


def test_summary_has_one_line_per_method_with_its_speed_against_plain():
    ms = [Method("plain", None), Method("EAGLE", object(), "x", break_even=1.4)]
    rows = {"plain": PLAIN, "EAGLE": _rows({k: (300, 2.5) for k in PLAIN})}
    text = summary(ms, rows)
    (line,) = [x for x in text.splitlines() if x.strip().startswith("EAGLE")]
    assert "2.00x plain" in line and "tau 2.5" in line and "chat 2.00x" in line
    assert "lost" not in text
