"""Draft head sets: make (random), save and load heads of any method, and build their drafter."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from spec_jax.errors import SpecJaxError
from spec_jax.tree import StaticTree, check_dynamic, parse_tree

METHODS = ("eagle", "eagle3", "medusa", "mtp")
DEFAULT_HPARAMS = {
    "eagle": {"top_k": 8, "depth": 5, "total_tokens": 32, "num_layers": 1, "features": "post"},
    "eagle3": {"top_k": 8, "depth": 6, "total_tokens": 32, "draft_vocab": 8192},
    "medusa": {"num_heads": 4},  # "own_lm_heads": True gives each head its own LM head
    "mtp": {"num_modules": 1, "depth": 3},
}


def target_identity(target) -> dict[str, Any]:
    c = target.cfg
    return {"family": c.family, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
            "num_layers": c.num_layers, "fingerprint": target.fingerprint()}


@dataclasses.dataclass(eq=False)
class DraftHeads:
    method: str
    params: Any
    hparams: dict
    target_info: dict
    tcfg: Any = None

    def check_target(self, target) -> None:
        mine = self.target_info
        theirs = target_identity(target)
        bad = [k for k in ("family", "hidden_size", "vocab_size", "num_layers", "fingerprint")
               if k in mine and mine[k] != theirs[k]]
        if bad:
            raise SpecJaxError(
                f"these {self.method} heads were trained for another target ({', '.join(bad)} differ: "
                f"heads {[mine[k] for k in bad]} vs target {[theirs[k] for k in bad]}); "
                "train heads for this target with `spec-jax train`")

    def fingerprint(self) -> str:
        """A short hash of the method, hyper-parameters and weights (keys the tree calibration)."""
        import hashlib

        import numpy as np

        hp = {k: v for k, v in self.hparams.items() if k != "training"}
        h = hashlib.sha256(json.dumps([self.method, hp], sort_keys=True, default=str).encode())
        for leaf in jax.tree.leaves(self.params):
            h.update(np.round(np.asarray(leaf.reshape(-1)[:256], np.float32), 4).tobytes())
        return h.hexdigest()[:16]

    def bind(self, target, pack: bool = True):
        """Params ready to run on `target` (adds what derives from it, see heads.vocab), made once
        per target and params object and kept in the target's cache of compiled things.

        On a packed target the matrices are packed too, as bfloat16 (`PACKED_DTYPE`; `pack=False`
        keeps them plain float32: training updates and saves plain matrices), except a draft
        vocabulary's slice of a target LM head that is exactly a GGUF dequantization (whether the
        target streams its own layers as codes or as float32), which is packed as its uint8 codes:
        the draft reads 1.125 bytes a weight instead of 2, and the exact float32 weights."""
        from spec_jax.heads.vocab import bind_target

        pack = pack and target.layout == "packed"
        key = ("bound", id(self), pack)
        hit = target.compiled.get(key)
        if hit is not None and hit[0] is self.params and hit[1] is target.params:
            return hit[2]
        params = bind_target(self.params, target.params, target.cfg)
        if pack:
            from pallas_kernels.cpu_gemm import pack_exact, pack_matrices

            exact = {}
            if "lm_sub" in params:  # a slice of the target's LM head: where its float32 weights
                w = pack_exact(params["lm_sub"])  # are a GGUF dequantization, their exact codes
                exact = {"lm_sub": w} if w.scales is not None else {}  # (fewer bytes than bf16)
            keys = tuple(k for k in PACKABLE if k not in exact)
            params = {**pack_matrices(params, keys, PACKED_DTYPE), **exact}
        target.compiled[key] = (self.params, target.params, params)
        return params

    def drafter(self, tree=None):
        """The Drafter for these heads; `tree` overrides the tree (see spec_jax.tree.parse_tree),
        with an n-gram chain grafted on for `TREE+ngram:N` (see spec_jax.heads.graft); a switch
        (dict or JSON, see spec_jax.heads.switch) picks its arm per row and step."""
        from spec_jax.heads.base import Drafter
        from spec_jax.heads.graft import split_graft, with_graft
        from spec_jax.heads.switch import as_switch, switch_drafter

        switch = as_switch(tree)
        if switch is not None:
            return switch_drafter(self._drafter, switch)
        tree, graft_n = split_graft(tree)
        d = Drafter() if tree == "plain" else self._drafter(tree)
        return with_graft(d, graft_n)

    def _drafter(self, tree):
        hp = dict(self.hparams)
        t = parse_tree(tree)
        if self.method == "medusa":
            from spec_jax.heads.medusa import MedusaDrafter

            kw = {"num_heads": hp["num_heads"]}
            if isinstance(t, StaticTree):
                kw["tree"] = t
            elif isinstance(t, dict):
                kw["dynamic"] = (t.get("top_k", 8), t.get("depth", hp["num_heads"]),
                                 t.get("total_tokens", 32))
            else:  # the default tree, cut to the number of heads
                from spec_jax.tree import MEDUSA_DEFAULT

                kw["tree"] = StaticTree.from_paths(
                    [p for p in MEDUSA_DEFAULT if len(p) <= hp["num_heads"]])
            return MedusaDrafter(**kw)
        dyn = {k: hp[k] for k in ("top_k", "depth", "total_tokens") if k in hp}
        if self.method == "mtp":
            dyn = {"top_k": 1, "depth": hp.get("depth", 3), "total_tokens": hp.get("depth", 3) + 1}
        static = None
        if isinstance(t, StaticTree):
            if t.paths == StaticTree.chain(t.max_depth).paths:  # a chain: the top-1 dynamic tree
                dyn = {"top_k": 1, "depth": t.max_depth, "total_tokens": t.max_depth + 1}
            else:
                static = t
        elif isinstance(t, dict):
            dyn.update(t)
        if dyn["total_tokens"] <= 1:  # calibration found that speculation does not pay here
            from spec_jax.heads.base import Drafter

            return Drafter()
        check_dynamic(dyn["top_k"], dyn["depth"], dyn["total_tokens"])
        if self.method == "eagle":
            from spec_jax.heads.eagle import EagleDrafter, features_of

            d = EagleDrafter(num_layers=hp.get("num_layers", 1), features=features_of(hp), **dyn)
        elif self.method == "eagle3":
            from spec_jax.heads.eagle3 import Eagle3Drafter

            d = Eagle3Drafter(fused_layers=tuple(hp["fused_layers"]), **dyn)
        else:
            from spec_jax.heads.mtp import MtpDrafter

            d = MtpDrafter(num_modules=hp.get("num_modules", 1), **dyn)
        return d if static is None else d.for_tree(static)


# Head matrices whose products go through `pallas_kernels.cpu_gemm.matmul` / `dot_f32`.
# Packed head matrices are stored as bfloat16: a draft step streams its weights (the head's layer and
# its LM-head slice, ~34 MB in float32 for SmolLM2's EAGLE head) twice per generation step, and
# half the bytes cut that from 2.6 to 1.7 ms of a ~21 ms step (scripts/profile_step.py). Products
# still accumulate in float32, and what a draft proposes never changes what verification accepts.
PACKED_DTYPE = "bfloat16"
PACKABLE = ("fc_w", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "lm_sub")


def init_draft(target, method: str, seed: int = 0, scale: float = 0.02, **hparams) -> DraftHeads:
    if method not in METHODS:
        raise SpecJaxError(f"unknown draft method {method!r}: choose one of {', '.join(METHODS)}")
    hp = {**DEFAULT_HPARAMS[method], **hparams}
    if method == "eagle":
        from spec_jax.heads.eagle import check_features

        check_features(hp["features"])
    d2t = hp.pop("d2t", None)  # draft vocabulary (target ids); kept in params, not hparams
    key = jax.random.PRNGKey(seed)
    cfg = target.cfg
    if method == "eagle":
        from spec_jax.heads.eagle import init_params

        params = init_params(cfg, key, scale, num_layers=hp["num_layers"])
    elif method == "eagle3":
        from spec_jax.heads.eagle3 import init_params

        hp["draft_vocab"] = min(hp["draft_vocab"], cfg.vocab_size)
        hp["fused_layers"] = list(cfg.eagle3_layers)
        params = init_params(cfg, key, scale, draft_vocab=hp["draft_vocab"], d2t=d2t)
    elif method == "medusa":
        from spec_jax.heads.medusa import init_params

        params = init_params(cfg, key, scale, num_heads=hp["num_heads"])
    else:
        from spec_jax.heads.mtp import init_params

        params = init_params(cfg, key, scale, num_modules=hp["num_modules"])
    if method != "eagle3" and d2t is not None:  # a draft vocabulary over the target's LM head
        from spec_jax.heads.vocab import vocab_maps

        hp["draft_vocab"] = len(d2t)
        params.update(vocab_maps(d2t, cfg.vocab_size))
    if method == "medusa" and hp.get("own_lm_heads"):
        from spec_jax.heads.medusa import add_lm_heads

        params = add_lm_heads(params, target.params, cfg)
    return DraftHeads(method=method, params=params, hparams=hp, target_info=target_identity(target),
                      tcfg=cfg)


def save_draft(heads: DraftHeads, out_dir, force: bool = False) -> Path:
    from spec_jax.heads.vocab import DERIVED
    from spec_jax.io import atomic_dir, save_params

    from pallas_kernels.cpu_gemm import unpack_all

    out_dir = Path(out_dir)
    params = unpack_all({k: v for k, v in heads.params.items() if k not in DERIVED})
    with atomic_dir(out_dir, force=force) as tmp:
        save_params(tmp / "params", params)
        (tmp / "spec_jax.json").write_text(json.dumps(
            {"kind": "draft", "method": heads.method, "hparams": heads.hparams,
             "target": heads.target_info}, indent=2))
    return out_dir


def load_draft(path) -> DraftHeads:
    from spec_jax.io import load_params, read_meta

    path = Path(path)
    meta = read_meta(path, "draft", "train heads with `spec-jax train` or pass 'ngram'")
    return DraftHeads(method=meta["method"], params=load_params(path / "params"),
                      hparams=meta["hparams"], target_info=meta["target"])
