"""Drafting: `draft=` and a concrete `TreeSpec` -> the `Drafter` the loop runs and its parameters.

The one place drafters are composed: a method's head drafter for the base tree (its method in
`spec_jax.heads.methods` builds it), the n-gram drafter, a switch between arms
(spec_jax.compose.switch), chains grafted on (spec_jax.compose.graft) and ranked among a dynamic
tree's candidates. A spec whose base is still the sizing's to decide (`default`, `auto`) is
resolved first (spec_jax.sizing.resolve); `default` left unresolved builds the method's own tree.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from spec_jax.compose.graft import GraftDrafter, with_datastore, with_graft
from spec_jax.compose.switch import switch_drafter
from spec_jax.errors import SpecJaxError
from spec_jax.heads.base import Drafter
from spec_jax.heads.ngram import NgramDrafter
from spec_jax.heads.registry import DraftHeads
from spec_jax.tree_spec import Auto, Default, Dynamic, Plain, Static, Switch, TreeSpec, parse

DRAFTS = ("'ngram', 'mtp' (the target's own MTP layers), heads from spec_jax.init_draft / "
          "spec_jax.load_draft, or None for plain decoding")
OWN_HEADS = "mtp"  # the folder of a converted target holding its MTP layers (convert/hf.py)


def check_draft(draft) -> None:
    """Raise SpecJaxError unless `draft` is None, "none", "ngram", "mtp" or DraftHeads."""
    if draft is None or isinstance(draft, DraftHeads) or (isinstance(draft, str)
                                                          and draft in ("none", "ngram", "mtp")):
        return
    raise SpecJaxError(f"unknown draft {draft!r}: pass {DRAFTS}")


def own_heads(target, draft):
    """`draft`, except "mtp": the MTP heads that `spec-jax convert` wrote beside the target from
    the MTP layers its checkpoint ships (`OUT/mtp/`), loaded once per target."""
    if not (isinstance(draft, str) and draft == "mtp"):
        return draft
    heads = target.own_heads.get("mtp")
    if heads is None:
        from spec_jax.heads.registry import load_draft

        folder = None if target.path is None else target.path / OWN_HEADS
        if folder is None or not folder.is_dir():
            where = "this target" if target.path is None else f"the target at {target.path}"
            raise SpecJaxError(f"{where} has no MTP layers of its own (no {OWN_HEADS}/ folder "
                               "beside its params): draft='mtp' needs a target that `spec-jax "
                               "convert` made from a checkpoint shipping MTP layers (MiMo, "
                               "DeepSeek-V3 naming); pass heads or 'ngram' instead")
        heads = target.own_heads["mtp"] = load_draft(folder)
    return heads


def is_plain(draft) -> bool:
    return draft is None or (isinstance(draft, str) and draft == "none")


def head_drafter(heads: DraftHeads, base) -> Drafter:
    """The heads' own drafter for a base tree (Default: the method's default tree)."""
    return heads.drafter(TreeSpec(base))


def build(target, draft, spec: TreeSpec | str | None = None, datastore=None,
          attn_impl: str = "auto") -> tuple[Drafter, Any]:
    """(drafter, draft params) for `draft` drafting `spec`'s tree on `target`. `spec` must not
    need a sizing (`auto`); `default` is the method's own tree. With a `datastore` its chain is
    grafted on (`spec.ds` tokens, 8 if it does not say; 0: none)."""
    spec = parse(spec)
    check_draft(draft)
    draft = own_heads(target, draft)
    base = spec.base
    if isinstance(base, Auto):
        raise SpecJaxError("tree 'auto' is sized first: resolve it with spec_jax.sizing.resolve")
    if spec.ds and datastore is None:
        raise SpecJaxError(f"tree {str(spec)!r} drafts from a datastore: pass datastore="
                           "spec_jax.load_datastore(DIR) (CLI: --datastore DIR)")
    if is_plain(draft):
        if datastore is not None:
            raise SpecJaxError("a datastore drafts beside a drafter: pass draft='ngram' or heads "
                               "(draft=None is plain decoding)")
        return Drafter(), ()
    if datastore is not None:
        datastore.check_target(target)
    if isinstance(draft, str):  # "ngram": a chain; a static tree gives its depth
        if spec.ngram or isinstance(base, (Dynamic, Switch)):
            raise SpecJaxError(f"the n-gram drafter drafts a chain: give it chain:N, not "
                               f"{str(spec)!r}")
        if isinstance(base, Plain):
            drafter, dparams = Drafter(), ()
        else:
            drafter = NgramDrafter(depth=base.tree.max_depth) if isinstance(base, Static) \
                else NgramDrafter()
            dparams = ()
    else:
        draft.check_target(target)
        if isinstance(base, Switch):
            drafter = switch_drafter(lambda tree: head_drafter(draft, Static(tree)), base)
        else:
            drafter = with_graft(head_drafter(draft, base), spec.ngram)
        drafter = drafter.with_attn_impl(attn_impl)
        dparams = () if type(drafter) is Drafter else draft.bind(target)
    if datastore is not None:
        ds_n = min(8, datastore.depth) if spec.ds is None else spec.ds
        if ds_n:
            drafter = with_datastore(drafter, datastore.chain(ds_n))
            dparams = {**(dparams or {}), "datastore": datastore.tables()}
    if spec.ranked:
        drafter, priors = ranked(drafter, datastore)
        dparams = {**dparams, "datastore": {**dparams.get("datastore", {}), **priors}}
    return drafter, dparams


def ranked(drafter: Drafter, datastore) -> tuple[Drafter, dict]:
    """`drafter` (a dynamic tree with grafts) with its grafts ranked among the tree's candidates,
    and the chains' priors measured on `datastore` (draft params to merge under "datastore")."""
    fix = "write a dynamic tree with its grafts, e.g. dynamic:8,5,32+ngram:24+ds:8+ranked"
    if datastore is None:
        raise SpecJaxError("+ranked measures its chains on a datastore of the target's output: pass "
                           "datastore=spec_jax.load_datastore(DIR) (CLI: --datastore DIR)")
    if not isinstance(drafter, GraftDrafter) or not hasattr(drafter.main, "propose_pool"):
        raise SpecJaxError(f"+ranked ranks grafted chains among a dynamic tree's candidates: {fix}")
    if getattr(drafter.main, "static_tree", None) is not None or \
            getattr(drafter.main, "dynamic", True) is None:
        raise SpecJaxError(f"+ranked needs a dynamic tree, not a static one: {fix}")
    ds_depth = drafter.ds.depth if drafter.ds is not None else 1
    return (dataclasses.replace(drafter, ranked=True),
            datastore.priors(max(drafter.ngram.depth, 1), ds_depth, NgramDrafter.max_ngram))


def merge_sized(given: TreeSpec, chosen: TreeSpec | None) -> TreeSpec:
    """The caller's `given` spec (a sized base: default or auto) with the sizing's `chosen` spec
    (None: nothing sized; the method's default tree): the chosen base and grafts, except that the
    caller's n-gram chain wins where it gives one and the caller's datastore chain where it says."""
    if chosen is None:
        return given.replace(base=Default())
    ngram = given.ngram or chosen.ngram
    if isinstance(chosen.base, (Switch, Plain)) and given.ngram:
        raise SpecJaxError(f"the sized tree {str(chosen)!r} takes no +ngram:N: give a tree with it")
    ds = given.ds if given.ds is not None else (0 if isinstance(chosen.base, Plain) else chosen.ds)
    return TreeSpec(chosen.base, ngram=ngram, ds=ds, ranked=given.ranked)
