"""A draft method as one object: what the rest of spec_jax needs to know about EAGLE, EAGLE-3,
Medusa or MTP heads, declared once in the method's own module (`METHOD` in spec_jax.heads.eagle,
...) and looked up by name in spec_jax.heads.methods.

Making heads (spec_jax.heads.registry): `defaults`, `check`, `init_params`, `own_vocab`, `grow`.
Drafting: `drafter(hparams, tree)` -> the Drafter for a base tree: None (the method's own tree),
a StaticTree, or a dict of dynamic-tree settings (a `spec_jax.tree_spec` Static or Dynamic base,
as `DraftHeads.drafter` hands it over). Training (spec_jax.train): `aux_layers`, `unroll` or
`head_logits`, `train_record`, `flags` and `flag_hparams`. Tree sizing's acceptance profile
(spec_jax.sizing): `profile_depth` and `profile_logits`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from spec_jax.heads.base import Drafter
from spec_jax.tree import StaticTree, check_dynamic


def _accept(hparams: dict) -> None:
    return None


def _as_is(params, hparams: dict, target, wanted: dict, seed: int):
    return params, hparams


def _no_aux(tcfg) -> tuple:
    return ()


def _six(hparams: dict) -> int:
    return 6


def _no_record(hparams: dict, cfg) -> dict:
    return {}


def _no_flags(layers: int, features: str | None, own_lm_heads: bool) -> tuple:
    return ()


@dataclasses.dataclass(frozen=True)
class Method:
    """A draft method (see the module docstring). Call signatures:

    init_params(tcfg, key, scale, hparams, d2t) -> (params, hparams): fresh random heads for a
        target of config `tcfg`; `hparams` are the defaults merged with the caller's (the draft
        vocabulary `d2t` taken out), returned with what the method derives from the target.
    drafter(hparams, tree) -> Drafter, `tree` None (the method's own), a StaticTree or a dict
        of dynamic-tree settings (top_k, depth, total_tokens).
    check(hparams): SpecJaxError for a setting the method cannot run.
    grow(params, hparams, target, wanted, seed) -> (params, hparams): the heads given what the
        hparams `wanted` ask that they can grow into (EAGLE's extra decoder layers, Medusa's own
        LM heads); SpecJaxError for what they cannot (EAGLE heads reading other features).
    aux_layers(tcfg) -> the target layers whose hidden states the heads read besides the last.
    profile_depth(hparams) -> draft depths the acceptance profile covers.
    unroll(hparams, TrainConfig) -> the settings of `spec_jax.train.losses.feature_unrolled`
        (steps, noise, feat_loss_weight, ce_weight, decay), for feature drafters; None for heads
        that read every depth off one feature (then `head_logits`).
    head_logits(dparams, tparams, tcfg, feats [B, L, H]) -> [B, L, K, V]: all K heads' logits.
    train_record(hparams, TrainConfig) -> the method's fields of a training run's record.
    flags: the `spec-jax train` options that apply; flag_hparams(layers, features, own_lm_heads)
        -> the hparams they give, as (key, value) pairs.
    """

    name: str
    title: str  # as prose writes it ("EAGLE-3")
    defaults: Mapping[str, Any]
    init_params: Callable
    drafter: Callable[[dict, Any], Drafter]
    check: Callable[[dict], None] = _accept
    grow: Callable = _as_is
    own_vocab: bool = False  # its own LM head, always over a draft vocabulary (EAGLE-3)
    aux_layers: Callable[[Any], tuple] = _no_aux
    profile_depth: Callable[[dict], int] = _six
    unroll: Callable[[dict, Any], dict] | None = None
    head_logits: Callable | None = None
    train_record: Callable[[dict, Any], dict] = _no_record
    flags: tuple[str, ...] = ()
    flag_hparams: Callable = _no_flags

    def __post_init__(self):
        assert (self.unroll is None) != (self.head_logits is None), \
            f"{self.name}: trained either unrolled (a feature drafter) or by its heads' logits"

    def profile_logits(self, drafter, dparams, tparams, tcfg, toks, feats, aux, depth: int) -> list:
        """The draft's logits for the tokens 2 .. depth + 1 ahead along the true tokens `toks`
        [B, L] from the target's features `feats` [B, L, H] (and `aux`): a list of `depth` arrays
        [B, L, V], entry d at position j for the token j + d + 2 (spec_jax.sizing's profile)."""
        if self.head_logits is not None:
            lg = self.head_logits(dparams, tparams, tcfg, feats)
            return [lg[:, :, i] for i in range(depth)]
        from spec_jax.features import unrolled_features

        t_feat = drafter.target_feature(dparams, tparams, tcfg, feats, aux)
        fs = unrolled_features(drafter, dparams, tparams, tcfg, toks, t_feat, depth)
        return [drafter.logits(dparams, tparams, tcfg, f) for f in fs]


def dynamic_settings(hparams: dict) -> dict:
    """The dynamic tree a feature drafter's hparams give (top_k, depth, total_tokens)."""
    return {k: hparams[k] for k in ("top_k", "depth", "total_tokens") if k in hparams}


def feature_drafter(make: Callable[..., Drafter], dyn: dict, tree) -> Drafter:
    """A feature drafter for a parsed `tree`: `make(top_k=, depth=, total_tokens=)` builds it;
    `dyn` is the method's own dynamic tree, which a dict of settings updates. A chain runs as the
    top-1 dynamic tree, another static tree through `for_tree`; a tree of one token (what a
    calibration that found speculation does not pay stores) is plain decoding."""
    static = None
    if isinstance(tree, StaticTree):
        if tree.paths == StaticTree.chain(tree.max_depth).paths:  # a chain: the top-1 dynamic tree
            dyn = {"top_k": 1, "depth": tree.max_depth, "total_tokens": tree.max_depth + 1}
        else:
            static = tree
    elif isinstance(tree, dict):
        dyn = {**dyn, **tree}
    if dyn["total_tokens"] <= 1:  # calibration found that speculation does not pay here
        return Drafter()
    check_dynamic(dyn["top_k"], dyn["depth"], dyn["total_tokens"])
    d = make(**dyn)
    return d if static is None else d.for_tree(static)
