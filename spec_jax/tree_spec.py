"""The tree option, typed: what `generate(tree=...)`, the CLI's `--tree` and the sizing cache say.

A `TreeSpec` is a base tree plus what is grafted onto it:

  base    Default()          the tree sized for this device if one was, else the method's default
          Auto()             sized now if it was not (a one-off measurement, `spec_jax.sizing`)
          Plain()            no tree: plain decoding (a sizing's verdict)
          Dynamic(K, D, T)   EAGLE-2's dynamic tree: top-K per depth, D deep, T tree tokens
          Static(paths)      a static tree (paths of top-k ranks; `mc_sim_7b_63`, `medusa`, `chain:N`)
          Switch(arms, policy)  per row and step, an arm of equal size chosen by the n-gram match
  ngram   N > 0 grafts the context's n-gram (prompt lookup) chain of N tokens on
  ds      N grafts the datastore's chain of N tokens; None: not said (8 where a datastore is given)
  ranked  the chains compete with a dynamic tree's candidates for its tokens instead of adding

Strings are its written form (`parse(str(spec)) == spec`):
  "dynamic:8,5,32+ngram:24+ds:8+ranked", "auto+ngram:4", "chain:3", "[[0],[1],[0,0]]",
  '{"switch": [{"base": [[0]], "ngram": 0}, {"base": [], "ngram": 1}], "policy": [0, 1]}'.
Dicts are the sizing cache's form: {"top_k", "depth", "total_tokens"} (a dynamic tree),
{"base": TREE, "ngram": N, "ds": M} (grafts) and {"switch": [...], "policy": [...]}; a list of
paths or a `StaticTree` is a static tree. This module is the only place a tree option is read.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Union

from spec_jax.errors import SpecJaxError
from spec_jax.tree import MC_SIM_7B_63, MEDUSA_DEFAULT, StaticTree, check_dynamic

MAX_NGRAM = 8  # longest context suffix an n-gram lookup matches (a switch's policy has MAX_NGRAM+1)
MAX_TREE_TOKENS = 512  # the most tree tokens a step may verify (each is a query of the target)
MAX_CHAIN = 256  # the longest chain (n-gram, datastore or `chain:N`) a tree may graft

_FORMS = ("auto, mc_sim_7b_63, medusa, chain:N, dynamic:TOP_K,DEPTH,TOTAL, a JSON list of paths "
          "such as [[0],[1],[0,0]], each optionally followed by +ngram:N, +ds:N and +ranked")


@dataclasses.dataclass(frozen=True)
class Default:
    """The sized tree where one was cached, else the method's default."""

    def __str__(self):
        return "default"


@dataclasses.dataclass(frozen=True)
class Auto:
    """The sized tree, sized now where none was cached."""

    def __str__(self):
        return "auto"


@dataclasses.dataclass(frozen=True)
class Plain:
    """No tree: plain decoding (what a sizing chooses where speculation does not pay)."""

    def __str__(self):
        return "plain"


@dataclasses.dataclass(frozen=True)
class Dynamic:
    """EAGLE-2's dynamic tree; no settings (`dynamic`) means the method's own."""

    top_k: int | None = None
    depth: int | None = None
    total_tokens: int | None = None

    def __post_init__(self):
        if self.top_k is not None and self.total_tokens > 1:  # 1: the root alone (plain steps)
            check_dynamic(self.top_k, self.depth, self.total_tokens)
            if self.total_tokens > MAX_TREE_TOKENS or self.depth > MAX_CHAIN:
                raise SpecJaxError(f"dynamic:{self.top_k},{self.depth},{self.total_tokens} is too "
                                   f"large: at most {MAX_TREE_TOKENS} tree tokens and depth "
                                   f"{MAX_CHAIN}")

    @property
    def settings(self) -> dict:
        """{"top_k", "depth", "total_tokens"} ({} for the method's own)."""
        if self.top_k is None:
            return {}
        return {"top_k": self.top_k, "depth": self.depth, "total_tokens": self.total_tokens}

    def __str__(self):
        return "dynamic" if self.top_k is None else \
            f"dynamic:{self.top_k},{self.depth},{self.total_tokens}"


@dataclasses.dataclass(frozen=True)
class Static:
    """A static tree; `name` is how it was written (not part of its identity)."""

    tree: StaticTree
    name: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.tree.size > MAX_TREE_TOKENS or self.tree.max_depth > MAX_CHAIN:
            raise SpecJaxError(f"a static tree of {self.tree.size} tokens and depth "
                               f"{self.tree.max_depth} is too large: at most {MAX_TREE_TOKENS} "
                               f"tree tokens and depth {MAX_CHAIN}")

    @property
    def is_chain(self) -> bool:
        return self.tree.paths == StaticTree.chain(self.tree.max_depth).paths

    def __str__(self):
        return self.name or json.dumps([list(p) for p in self.tree.paths], separators=(",", ":"))


@dataclasses.dataclass(frozen=True)
class Arm:
    """A switch arm: a static head tree (`paths`, () for the root alone) plus an n-gram chain."""

    paths: tuple[tuple[int, ...], ...]
    ngram: int = 0

    @property
    def tree_tokens(self) -> int:
        return len(self.paths) + 1 + self.ngram


@dataclasses.dataclass(frozen=True)
class Switch:
    """Per row and step, arm `policy[n-gram match length]` (spec_jax.compose.switch)."""

    arms: tuple[Arm, ...]
    policy: tuple[int, ...]

    def __post_init__(self):
        fix = ('write {"switch": [{"base": [[0], [1], [0, 0]], "ngram": 0}, {"base": [], "ngram": '
               '3}], "policy": [0, 0, 1]}: arms of equal tree tokens, an arm per n-gram match '
               'length 0..8')
        if not self.arms or not self.policy:
            raise SpecJaxError(f"a switch tree needs a list of arms and a policy: {fix}")
        sizes = sorted({a.tree_tokens for a in self.arms})
        if len(sizes) != 1:
            raise SpecJaxError(f"switch arms differ in tree tokens ({sizes}): {fix}")
        if sizes[0] > MAX_TREE_TOKENS:
            raise SpecJaxError(f"switch arms of {sizes[0]} tree tokens: at most {MAX_TREE_TOKENS}")
        if len(self.policy) > MAX_NGRAM + 1 or any(not 0 <= p < len(self.arms)
                                                    for p in self.policy):
            raise SpecJaxError(f"bad switch policy {list(self.policy)!r}: {fix}")

    def as_dict(self) -> dict:
        return {"switch": [{"base": [list(p) for p in a.paths], "ngram": a.ngram}
                           for a in self.arms], "policy": list(self.policy)}

    def __str__(self):
        return json.dumps(self.as_dict(), separators=(",", ":"))


Base = Union[Default, Auto, Plain, Dynamic, Static, Switch]
SIZED = (Default, Auto)  # bases the sizing decides


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A tree option: a base tree and its grafts (see the module docstring)."""

    base: Base = Default()
    ngram: int = 0
    ds: int | None = None
    ranked: bool = False

    def __post_init__(self):
        if self.ngram < 0 or self.ngram > MAX_CHAIN or (self.ds is not None and
                                                         not 0 <= self.ds <= MAX_CHAIN):
            raise SpecJaxError(f"graft chains of 0 to {MAX_CHAIN} tokens: not ngram {self.ngram}, "
                               f"ds {self.ds}")
        if isinstance(self.base, Switch) and (self.ngram or self.ds or self.ranked):
            raise SpecJaxError("a switch carries its own n-gram chains: graft nothing onto it")
        if self.ranked and not isinstance(self.base, (Default, Auto, Dynamic)):
            raise SpecJaxError(f"cannot read {self}: +ranked ranks grafted chains among a dynamic "
                               "tree's candidates, e.g. dynamic:8,5,32+ngram:24+ds:8+ranked")

    @property
    def sized(self) -> bool:
        """Whether the base is the sizing's to decide (`default` or `auto`)."""
        return isinstance(self.base, SIZED)

    def replace(self, **kw) -> "TreeSpec":
        return dataclasses.replace(self, **kw)

    def __str__(self):
        grafts = (f"+ngram:{self.ngram}" if self.ngram else "") + \
                 (f"+ds:{self.ds}" if self.ds is not None else "") + ("+ranked" * self.ranked)
        base = str(self.base)
        if isinstance(self.base, Default) and grafts:
            return grafts
        return base + grafts

    def as_json(self):
        """The sizing cache's form of a concrete spec (a list, dict or "plain"; a ranked spec,
        never a sizing's choice, as its string)."""
        if self.ranked:
            return str(self)
        base = self.base
        if isinstance(base, Switch):
            out = base.as_dict()
        elif isinstance(base, Static):
            out = [list(p) for p in base.tree.paths]
        elif isinstance(base, Dynamic) and base.top_k is not None:
            out = base.settings
        elif isinstance(base, Plain):
            out = "plain"
        else:
            out = str(base)
        if self.ngram or self.ds is not None:
            out = {"base": out, "ngram": self.ngram, **({} if self.ds is None else {"ds": self.ds})}
        return out


def parse(option) -> TreeSpec:
    """Any written tree option (None, str, dict, list of paths, StaticTree or TreeSpec) ->
    TreeSpec; SpecJaxError naming the form for anything else."""
    if isinstance(option, TreeSpec):
        return option
    if option is None:
        return TreeSpec()
    if isinstance(option, StaticTree):
        return TreeSpec(Static(option))
    if isinstance(option, str):
        return _parse_str(option)
    if isinstance(option, dict):
        return _parse_dict(option)
    if isinstance(option, (list, tuple)):
        return TreeSpec(_static_paths(option, option))
    raise SpecJaxError(f"cannot read tree {option!r} (a {type(option).__name__}): write {_FORMS}")


_GRAFT = re.compile(r"\+(ngram|ds|ranked)(?::([^+]*))?")


def _parse_str(text: str) -> TreeSpec:
    s = text.strip()
    if s.startswith("{"):
        try:
            return _parse_dict(json.loads(s))
        except json.JSONDecodeError:
            raise SpecJaxError(f"cannot read tree {text!r} as JSON: write e.g. "
                               '{"base": [[0], [1], [0, 0]], "ngram": 4}') from None
    cut = s.find("+")
    base_text, rest = (s, "") if cut < 0 else (s[:cut], s[cut:])
    grafts: dict = {}
    pos = 0
    for m in _GRAFT.finditer(rest):
        if m.start() != pos:
            break
        pos = m.end()
        kind, n = m.group(1), m.group(2)
        if kind in grafts or "ranked" in grafts:
            why = "+ranked goes last, after the grafts" if "ranked" in grafts else \
                f"+{kind} is given twice"
            raise SpecJaxError(f"cannot read {text!r}: {why}, e.g. "
                               "dynamic:8,5,32+ngram:24+ds:8+ranked")
        if kind == "ranked":
            if n is not None:
                raise SpecJaxError(f"cannot read {text!r}: +ranked takes no number")
            grafts[kind] = True
            continue
        n = {"ngram": "4", "ds": "8"}[kind] if n in (None, "") else n.strip()
        least = 1 if kind == "ngram" else 0
        if not n.isdigit() or int(n) < least:
            raise SpecJaxError(f"cannot read {text!r}: write TREE+{kind}:N with N >= {least} "
                               f"{'n-gram' if kind == 'ngram' else 'datastore'} tokens, e.g. "
                               "dynamic:8,5,24+ngram:8+ds:8")
        grafts[kind] = int(n)
    if pos != len(rest):
        raise SpecJaxError(f"cannot read {text!r}: after the tree come only +ngram:N, +ds:N and "
                           "+ranked")
    return TreeSpec(_parse_base(base_text.strip(), text), ngram=grafts.get("ngram", 0),
                    ds=grafts.get("ds"), ranked=grafts.get("ranked", False))


def _parse_base(s: str, text: str) -> Base:
    named = {"": Default(), "default": Default(), "auto": Auto(), "plain": Plain(),
             "dynamic": Dynamic()}
    if s in named:
        return named[s]
    if s == "mc_sim_7b_63":
        return Static(StaticTree.from_paths(MC_SIM_7B_63), name=s)
    if s == "medusa":
        return Static(StaticTree.from_paths(MEDUSA_DEFAULT), name=s)
    if s.startswith("dynamic:"):
        try:
            k, d, n = (int(x) for x in s.split(":", 1)[1].split(","))
        except ValueError:
            raise SpecJaxError(f"cannot read {text!r}: write dynamic:TOP_K,DEPTH,TOTAL_TOKENS, "
                               "e.g. dynamic:8,5,32") from None
        return Dynamic(k, d, n)
    if s.startswith("chain:"):
        n = s.split(":", 1)[1].strip()
        if not n.isdigit() or not 1 <= int(n) <= MAX_CHAIN:
            raise SpecJaxError(f"cannot read {text!r}: write chain:N with 1 <= N <= {MAX_CHAIN}")
        return Static(StaticTree.chain(int(n)), name=f"chain:{int(n)}")
    try:
        paths = json.loads(s)
    except json.JSONDecodeError:
        raise SpecJaxError(f"cannot read tree {text!r}: use {_FORMS}") from None
    return _static_paths(paths, text)


def _static_paths(paths, text) -> Static:
    if not isinstance(paths, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and all(type(r) is int for r in p) for p in paths):
        raise SpecJaxError(f"cannot read tree paths {text!r}: write a list of rank lists "
                           "(integers) such as [[0], [1], [0, 0]]")
    return Static(StaticTree.from_paths(paths))


def _parse_dict(d: dict) -> TreeSpec:
    if "switch" in d:
        return TreeSpec(_parse_switch(d))
    if set(d) <= {"top_k", "depth", "total_tokens"} and d:
        try:
            return TreeSpec(Dynamic(int(d["top_k"]), int(d["depth"]), int(d["total_tokens"])))
        except (KeyError, TypeError, ValueError):
            pass
    elif "base" in d and set(d) <= {"base", "ngram", "ds"}:
        base = parse(d["base"])
        if base != TreeSpec(base.base):
            raise SpecJaxError(f"cannot read tree {d!r}: its base carries grafts of its own")
        try:
            ngram = int(d.get("ngram", 0))
            ds = None if d.get("ds") is None else int(d["ds"])
        except (TypeError, ValueError):
            ngram, ds = -1, None
        return TreeSpec(base.base, ngram=ngram, ds=ds)
    raise SpecJaxError(f"cannot read tree {d!r}: a dict is a dynamic tree {{'top_k': 8, 'depth': "
                       "5, 'total_tokens': 32}, grafts {'base': TREE, 'ngram': N, 'ds': M} or a "
                       "switch {'switch': [...], 'policy': [...]}")


def _parse_switch(d: dict) -> Switch:
    arms, policy = d.get("switch"), d.get("policy")
    fix = 'e.g. {"switch": [{"base": [[0]], "ngram": 0}, {"base": [], "ngram": 1}], "policy": [0, 1]}'
    if not isinstance(arms, list) or not isinstance(policy, list) or set(d) != {"switch", "policy"}:
        raise SpecJaxError(f"a switch tree needs a list of arms and a policy: {fix}")
    out = []
    for a in arms:
        if not isinstance(a, dict) or "base" not in a or not isinstance(a.get("ngram", 0), int) \
                or a.get("ngram", 0) < 0 or not isinstance(a["base"], list):
            raise SpecJaxError(f"bad switch arm {a!r}: {fix}")
        paths = _static_paths(a["base"], a["base"]).tree.paths if a["base"] else ()
        out.append(Arm(paths=paths, ngram=int(a.get("ngram", 0))))
    if not all(type(p) is int for p in policy):
        raise SpecJaxError(f"bad switch policy {policy!r}: {fix}")
    return Switch(arms=tuple(out), policy=tuple(policy))


def tree_tokens(spec: TreeSpec) -> int | None:
    """Tree tokens a concrete spec verifies per step (None for a sized base)."""
    base = spec.base
    if isinstance(base, SIZED):
        return None
    if isinstance(base, Switch):
        return base.arms[0].tree_tokens
    if isinstance(base, Plain):
        n = 1
    elif isinstance(base, Static):
        n = base.tree.size
    else:
        n = base.total_tokens
    if n is None or spec.ranked:
        return n
    return n + spec.ngram + (spec.ds or 0)


def uses_datastore(option) -> bool:
    """Whether a tree option grafts a datastore chain (so generate needs `datastore=`)."""
    return bool(parse(option).ds)
