"""The typed tree option: every written form round-trips, every malformed one is a clear error."""
import json

import pytest

from spec_jax.errors import SpecJaxError
from spec_jax.tree import MC_SIM_7B_63, StaticTree
from spec_jax.tree_spec import (
    Arm,
    Auto,
    Default,
    Dynamic,
    Plain,
    Static,
    Switch,
    TreeSpec,
    parse,
    tree_tokens,
    uses_datastore,
)

SWITCH = {"switch": [{"base": [[0], [1], [0, 0]], "ngram": 0}, {"base": [], "ngram": 3}],
          "policy": [0, 0, 1]}

# every form the README documents, as a user writes it, and what it means
FORMS = [
    (None, TreeSpec()),
    ("auto", TreeSpec(Auto())),
    ("plain", TreeSpec(Plain())),
    ("dynamic", TreeSpec(Dynamic())),
    ("dynamic:8,5,32", TreeSpec(Dynamic(8, 5, 32))),
    ("mc_sim_7b_63", TreeSpec(Static(StaticTree.from_paths(MC_SIM_7B_63)))),
    ("medusa", None),
    ("chain:4", TreeSpec(Static(StaticTree.chain(4)))),
    ("[[0],[1],[0,0]]", TreeSpec(Static(StaticTree.from_paths([[0], [1], [0, 0]])))),
    ([[0], [1], [0, 0]], TreeSpec(Static(StaticTree.from_paths([[0], [1], [0, 0]])))),
    ("dynamic:8,5,32+ngram:4", TreeSpec(Dynamic(8, 5, 32), ngram=4)),
    ("auto+ngram:4", TreeSpec(Auto(), ngram=4)),
    ("+ngram:3", TreeSpec(ngram=3)),
    ("+ngram", TreeSpec(ngram=4)),
    ("dynamic:8,5,24+ngram:8+ds:8", TreeSpec(Dynamic(8, 5, 24), ngram=8, ds=8)),
    ("auto+ds:4+ngram:2", TreeSpec(Auto(), ngram=2, ds=4)),
    ("+ds", TreeSpec(ds=8)),
    ("chain:3+ds:0", TreeSpec(Static(StaticTree.chain(3)), ds=0)),
    ("dynamic:8,5,32+ngram:24+ds:8+ranked", TreeSpec(Dynamic(8, 5, 32), ngram=24, ds=8, ranked=True)),
    ({"top_k": 4, "depth": 3, "total_tokens": 12}, TreeSpec(Dynamic(4, 3, 12))),
    ({"base": [[0]], "ngram": 4}, TreeSpec(Static(StaticTree.from_paths([[0]])), ngram=4)),
    ({"base": [[0]], "ngram": 4, "ds": 0}, TreeSpec(Static(StaticTree.from_paths([[0]])), 4, 0)),
    ({"base": "plain", "ngram": 0, "ds": 0}, TreeSpec(Plain(), ds=0)),
    ('{"base": [[0]], "ngram": 4}', TreeSpec(Static(StaticTree.from_paths([[0]])), ngram=4)),
    (SWITCH, TreeSpec(Switch(arms=(Arm(((0,), (1,), (0, 0)), 0), Arm((), 3)), policy=(0, 0, 1)))),
    (json.dumps(SWITCH), None),
    (StaticTree.chain(2), TreeSpec(Static(StaticTree.chain(2)))),
]


@pytest.mark.parametrize("option,want", FORMS, ids=[repr(f)[:40] for f, _ in FORMS])
def test_every_documented_form_round_trips(option, want):
    spec = parse(option)
    if want is not None:
        assert spec == want
    assert parse(str(spec)) == spec
    assert parse(spec) is spec
    if not spec.sized:  # a concrete spec also round-trips through the sizing cache's JSON form
        assert parse(json.loads(json.dumps(spec.as_json()))) == spec


def test_what_a_spec_says():
    assert str(parse("chain:3")) == "chain:3" and str(parse("mc_sim_7b_63")) == "mc_sim_7b_63"
    assert str(parse("auto+ds:4+ngram:2")) == "auto+ngram:2+ds:4"  # grafts in one order
    assert parse("chain:3") == parse("[[0],[0,0],[0,0,0]]")  # the same tree, however written
    assert parse(None).sized and parse("auto").sized and parse("+ngram:4").sized
    assert not parse("dynamic").sized and not parse("chain:2").sized
    assert tree_tokens(parse("dynamic:8,5,32+ngram:4+ds:8")) == 44
    assert tree_tokens(parse("dynamic:8,5,32+ngram:24+ds:8+ranked")) == 32
    assert tree_tokens(parse(SWITCH)) == 4 and tree_tokens(parse("auto")) is None
    assert uses_datastore("dynamic:8,5,16+ds:8") and not uses_datastore("chain:3+ds:0")
    assert parse(SWITCH).base.as_dict() == SWITCH


MALFORMED = [
    ("bogus", "cannot read tree"),
    ("dynamic:8,5", "dynamic:TOP_K,DEPTH,TOTAL"),
    ("dynamic:1,1,9", "cannot draft a dynamic tree"),
    ("dynamic:64,64,100000", "too large"),
    ("chain:x", "chain:N"),
    ("chain:0", "chain:N"),
    ("chain:100000", "chain:N"),
    ("[[0, 1]]", "parent path"),
    ("[[0.5]]", "list of rank lists"),
    ([[0.5]], "list of rank lists"),
    ("[]", "at least one path"),
    ("chain:3+ngram:x", r"\+ngram:N"),
    ("chain:3+ngram:0", r"\+ngram:N"),
    ("chain:3+ngram:100000", "graft chains"),
    ("chain:3+ds:x", r"\+ds:N"),
    ("+ds:2+ds:3", "given twice"),
    ("dynamic:3,3,8+ranked+ngram:2", "goes last"),
    ("dynamic:3,3,8+ranked:2", "no number"),
    ("[[0], [1], [0, 0]]+ngram:3+ds:2+ranked", "dynamic tree"),
    ("chain:3+foo", "only"),
    ('{"base": [[0]]', "as JSON"),
    ({}, "a dict is"),
    ({"top_k": 4}, "a dict is"),
    ({"base": "chain:2+ngram:3", "ngram": 1}, "grafts of its own"),
    ({"switch": [{"base": [[0]], "ngram": 0}], "policy": [3]}, "bad switch policy"),
    ({"switch": [{"base": [[0]], "ngram": 0}, {"base": [], "ngram": 3}], "policy": [0]}, "differ"),
    ({"switch": ["x"], "policy": [0]}, "bad switch arm"),
    ({"switch": [], "policy": []}, "list of arms"),
    ({"switch": SWITCH["switch"], "policy": [0], "extra": 1}, "list of arms"),
    (1.5, "cannot read tree"),
    (b"chain:3", "cannot read tree"),
]


@pytest.mark.parametrize("option,msg", MALFORMED, ids=[repr(f)[:40] for f, _ in MALFORMED])
def test_each_malformed_form_is_a_clear_error(option, msg):
    with pytest.raises(SpecJaxError, match=msg):
        parse(option)


def test_grafts_on_a_switch_are_refused():
    with pytest.raises(SpecJaxError, match="switch carries"):
        TreeSpec(parse(SWITCH).base, ngram=2)
    assert TreeSpec(Default(), ngram=2) == parse("+ngram:2")
