"""`spec_jax.stream`: the text as the loop accepts it, joined equal to `generate`'s; and the
accepted draft tokens a result marks (`GenerationResult.steps`, its HTML, `--show-accepted`)."""
import time

import pytest

import spec_jax
from spec_jax.cli import _coloured_steps, main
from spec_jax.engine import GenerationResult, token_pieces
from spec_jax.generate import settled

PROMPT = [5, 9, 3, 5, 9, 3, 5, 9, 3, 7]  # repeats: the n-gram drafter finds continuations
EAGLE_TREE = "dynamic:4,3,8"


@pytest.fixture(scope="module")
def eagle(tiny_target):
    return spec_jax.init_draft(tiny_target, "eagle", seed=7, scale=0.3)


def drafter(name, eagle):
    """(draft, tree): EAGLE heads with a small dynamic tree (quick to compile)."""
    return {"plain": (None, None), "ngram": ("ngram", None), "eagle": (eagle, EAGLE_TREE)}[name]


@pytest.mark.parametrize("name", ["plain", "ngram", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_stream_joins_to_the_text_generate_returns(tiny_target, eagle, name, temperature):
    draft, tree = drafter(name, eagle)
    kw = dict(draft=draft, tree=tree, temperature=temperature, seed=11, stop_at_eos=False)
    want = spec_jax.generate(tiny_target, PROMPT, 96, **kw)
    pieces = spec_jax.stream(tiny_target, PROMPT, 96, **kw)
    got = list(pieces)
    assert len(got) >= 4 and all(got)
    assert "".join(got) == want.text
    assert pieces.result.token_ids == want.token_ids
    assert pieces.result.drafted == want.drafted
    assert pieces.result.stats["acceptance_histogram"] == want.stats["acceptance_histogram"]


def test_stream_keeps_the_fallbacks_plain_steps(tiny_target):
    """A row that takes plain steps carries its running mean and buffered steps across chunks."""
    kw = dict(draft="ngram", fallback=(3.0, 3.5), temperature=0.9, seed=2, stop_at_eos=False)
    want = spec_jax.generate(tiny_target, PROMPT, 96, **kw)
    assert want.stats["plain_steps"] > 0
    pieces = spec_jax.stream(tiny_target, PROMPT, 96, **kw)
    assert "".join(pieces) == want.text
    assert pieces.result.stats["plain_steps"] == want.stats["plain_steps"]


def test_first_piece_comes_well_before_the_last(tiny_target, eagle):
    kw = dict(draft=eagle, tree=EAGLE_TREE, stop_at_eos=False)
    spec_jax.generate(tiny_target, PROMPT, 96, **kw)  # compiled: only the run is timed
    t0 = time.perf_counter()
    times, pieces = [], []
    for piece in spec_jax.stream(tiny_target, PROMPT, 96, **kw):
        times.append(time.perf_counter() - t0)
        pieces.append(piece)
    assert len(pieces) >= 4
    assert times[0] < 0.5 * times[-1]
    assert len(pieces[0]) < len("".join(pieces)) / 4  # the first piece: a few tokens, not most


def test_stream_holds_back_a_character_whose_bytes_are_not_all_out(tiny_target, monkeypatch):
    """A decode that maps ids to bytes, so tokens carry halves of two-byte characters: pieces
    never end in a replacement character that a later token completes."""
    def decode(ids):
        table = {0: b"\xc3", 1: b"\xa9"}  # "é" is C3 A9
        return b"".join(table.get(i % 3, bytes([97 + i % 26])) for i in ids).decode(
            "utf-8", errors="replace")

    monkeypatch.setattr(tiny_target, "decode", decode)
    kw = dict(temperature=1.0, seed=3, stop_at_eos=False)
    want = spec_jax.generate(tiny_target, PROMPT, 96, **kw)
    assert "é" in want.text
    got = list(spec_jax.stream(tiny_target, PROMPT, 96, **kw))
    assert "".join(got) == want.text


def test_settled_keeps_back_what_later_tokens_can_change():
    assert settled("ab\ufffd") == "ab"
    assert settled("ab\ufffd\ufffd") == "ab"
    assert settled("a\ufffdb") == "a\ufffdb"  # an invalid byte inside stays what it is
    assert settled("I do n") == "I do n"
    assert settled("I do n", cleans_spaces=True) == "I do"  # " n" + "'t" becomes "n't"
    assert settled("I do not", cleans_spaces=True) == "I do not"


def test_stream_refuses_a_list_of_prompts(tiny_target):
    with pytest.raises(spec_jax.SpecJaxError, match="one prompt"):
        spec_jax.stream(tiny_target, [[1, 2], [3, 4]], 4)


def test_result_marks_each_steps_accepted_draft_tokens(tiny_target):
    r = spec_jax.generate(tiny_target, PROMPT, 96, draft="ngram", stop_at_eos=False)
    steps = sum(r.stats["acceptance_histogram"])
    accepted = sum(k * n for k, n in enumerate(r.stats["acceptance_histogram"]))
    assert len(r.drafted) == len(r.token_ids)
    assert sum(r.drafted) > 0  # the repeating prompt: the n-gram drafter's guesses land
    # the prefill's token and each step's bonus are the target's own (the last may be cut)
    assert steps <= r.drafted.count(False) <= steps + 1
    assert accepted - r.stats["tree_tokens"] <= sum(r.drafted) <= accepted
    assert "".join(a + own for a, own in r.steps()) == r.text
    assert "<span" in r._repr_html_()
    plain = spec_jax.generate(tiny_target, PROMPT, 96, stop_at_eos=False)
    assert not any(plain.drafted) and all(a == "" for a, _ in plain.steps())
    assert "<span" not in plain._repr_html_().split("</div>")[0]


def test_steps_html_and_colours_mark_the_accepted_text():
    r = GenerationResult(token_ids=[1, 2, 3, 4, 5], text="1 2 3 4 5",
                         stats={"new_tokens": 5, "mean_accepted": 2.0, "method": "ngram",
                                "finish_reason": "length"},
                         drafted=[False, True, True, False, True])
    assert r.steps() == [("", "1"), (" 2 3", " 4"), (" 5", "")]
    assert 'title="accepted draft tokens"> 2 3</span> 4' in r._repr_html_()
    assert _coloured_steps(r, colour=False) == "1[ 2 3] 4[ 5]"
    assert _coloured_steps(r) == "1\033[32m 2 3\033[0m 4\033[32m 5\033[0m"


def test_cli_refuses_stream_with_an_output_printed_at_the_end(capsys):
    for flag in ("--json", "--show-accepted"):
        assert main(["generate", "--prompt", "hi", "--stream", flag]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"drop {flag}" in err


def test_token_pieces_add_up_to_the_text():
    # a decode that rewrites the earlier text: the whole text in one piece
    assert token_pieces(lambda ids: "y", [7, 8], "x") == ["", "x"]
    assert token_pieces(lambda ids: "x", [7, 8], "x") == ["x", ""]
    assert token_pieces(lambda ids: " ".join(map(str, ids)), [1, 22], "1 22") == ["1", " 22"]
