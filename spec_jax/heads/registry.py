"""Draft head sets: make (random), save and load heads of any method, and build their drafter."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from spec_jax.errors import SpecJaxError
from spec_jax.heads.methods import METHODS, method_of
from spec_jax.target import same_target
from spec_jax.tree_spec import Dynamic, Plain, Static, Switch, parse


@dataclasses.dataclass(eq=False)
class DraftHeads:
    method: str
    params: Any
    hparams: dict
    target_info: dict
    tcfg: Any = None

    def check_target(self, target) -> None:
        mine = self.target_info
        theirs = target.identity()
        bad = same_target(mine, theirs)
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

        On a mesh they are placed by the target's partition rules (`spec_jax.sharding`). On a
        packed target the matrices are packed too, as bfloat16 (`PACKED_DTYPE`; `pack=False`
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
        params = self.params
        if target.mesh is not None:  # loaded heads live on one device: the mesh's first
            from spec_jax.sharding import shard_params

            params = shard_params(params, target.cfg, target.mesh)
        params = bind_target(params, target.params, target.cfg)
        if pack:
            from pallas_kernels.cpu.gemm import pack_exact, pack_matrices

            exact = {}
            if "lm_sub" in params:  # a slice of the target's LM head: where its float32 weights
                w = pack_exact(params["lm_sub"])  # are a GGUF dequantization, their exact codes
                exact = {"lm_sub": w} if w.scales is not None else {}  # (fewer bytes than bf16)
            keys = tuple(k for k in PACKABLE if k not in exact)
            params = {**pack_matrices(params, keys, PACKED_DTYPE), **exact}
        if target.mesh is not None:  # what derives from the target, placed by the same rules
            params = shard_params(params, target.cfg, target.mesh)
        target.compiled[key] = (self.params, target.params, params)
        return params

    def drafter(self, tree=None):
        """The method's own Drafter for a base tree (any tree option without grafts, see
        spec_jax.tree_spec: None or `default` for the method's own tree, a static or dynamic
        tree, `plain`); its method (spec_jax.heads.methods) builds it. Grafted chains and
        switches between arms are composed by `spec_jax.drafting.build`."""
        from spec_jax.heads.base import Drafter

        spec = parse(tree)
        if isinstance(spec.base, Switch) or spec.ngram or spec.ds is not None or spec.ranked:
            raise SpecJaxError(f"heads draft base trees: compose {str(spec)!r} with "
                               "spec_jax.drafting.build(target, heads, tree)")
        if isinstance(spec.base, Plain):
            return Drafter()
        return method_of(self.method).drafter(dict(self.hparams), _base_tree(spec.base))


def _base_tree(base):
    """A tree_spec base as a method's drafter factory takes it (`Method.drafter`): a StaticTree,
    a dict of dynamic-tree settings, or None for the method's own tree (`default`, `auto`,
    `dynamic` without settings)."""
    if isinstance(base, Static):
        return base.tree
    if isinstance(base, Dynamic):
        return base.settings or None
    return None


# Head matrices whose products go through `pallas_kernels.cpu_gemm.matmul` / `dot_f32`.
# Packed head matrices are stored as bfloat16: a draft step streams its weights (the head's layer and
# its LM-head slice, ~34 MB in float32 for SmolLM2's EAGLE head) twice per generation step, and
# half the bytes cut that from 2.6 to 1.7 ms of a ~21 ms step (scripts/profile_step.py). Products
# still accumulate in float32, and what a draft proposes never changes what verification accepts.
PACKED_DTYPE = "bfloat16"
PACKABLE = ("fc_w", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "lm_sub")


def init_draft(target, method: str, seed: int = 0, scale: float = 0.02, **hparams) -> DraftHeads:
    m = method_of(method)
    hp = {**m.defaults, **hparams}
    m.check(hp)
    d2t = hp.pop("d2t", None)  # draft vocabulary (target ids); kept in params, not hparams
    cfg = target.cfg
    params, hp = m.init_params(cfg, jax.random.PRNGKey(seed), scale, hp, d2t)
    if not m.own_vocab and d2t is not None:  # a draft vocabulary over the target's LM head
        from spec_jax.heads.vocab import vocab_maps

        hp["draft_vocab"] = len(d2t)
        params.update(vocab_maps(d2t, cfg.vocab_size))
    params, hp = m.grow(params, hp, target, hp, seed)  # what the hparams ask beyond fresh heads
    return DraftHeads(method=method, params=params, hparams=hp, target_info=target.identity(),
                      tcfg=cfg)


def save_draft(heads: DraftHeads, out_dir, force: bool = False) -> Path:
    from pallas_kernels.cpu.gemm import unpack_all
    from spec_jax.heads.vocab import DERIVED
    from spec_jax.io import atomic_dir, save_params

    out_dir = Path(out_dir)
    params = unpack_all({k: v for k, v in heads.params.items() if k not in DERIVED})
    with atomic_dir(out_dir, force=force) as tmp:
        save_params(tmp / "params", params)
        (tmp / "spec_jax.json").write_text(json.dumps(
            {"kind": "draft", "method": heads.method, "hparams": heads.hparams,
             "target": heads.target_info}, indent=2))
    return out_dir


def load_draft(path) -> DraftHeads:
    from spec_jax.io import check_finite, damaged, load_params, read_meta

    path = Path(path)
    meta = read_meta(path, "draft", "train heads with `spec-jax train` or pass 'ngram'")
    if meta["method"] not in METHODS:
        raise SpecJaxError(f"{path} holds heads of an unknown draft method {meta['method']!r}: "
                           f"spec_jax knows {', '.join(METHODS)}")
    if not isinstance(meta["hparams"], dict) or not isinstance(meta["target"], dict):
        raise damaged(path, "spec_jax.json's 'hparams' and 'target' must be objects", "draft")
    params = load_params(path / "params", kind="draft")
    check_head_shapes(path, meta, params)
    check_finite(params, f"the {meta['method']} heads at {path}")
    return DraftHeads(method=meta["method"], params=params,
                      hparams=meta["hparams"], target_info=meta["target"])


def check_head_shapes(path, meta: dict, params) -> None:
    """Refuse heads whose spec_jax.json disagrees with their weights where that is cheap to see:
    the target's vocabulary (t2d), the draft vocabulary (d2t) and the hidden size (the output
    axis of every attention output and MLP down projection)."""
    info, hp = meta["target"], meta["hparams"]
    leaves = {jax.tree_util.keystr(k, simple=True, separator="/"): tuple(a.shape)
              for k, a in jax.tree_util.tree_leaves_with_path(params)}
    checks = [("target.vocab_size", info.get("vocab_size"), "t2d", 0),
              ("hparams.draft_vocab", hp.get("draft_vocab"), "d2t", 0)]
    checks += [("target.hidden_size", info.get("hidden_size"), name, -1) for name in leaves
               if name.rsplit("/", 1)[-1] in ("wo", "w_down")]
    for field, value, name, axis in checks:
        shape = leaves.get(name)
        if value is None or shape is None:
            continue
        if not shape or shape[axis] != value:
            raise SpecJaxError(f"checkpoint {path}: spec_jax.json's {field}={value} disagrees with "
                               f"the weights: {name} has shape {shape}; re-train or re-import the "
                               "heads")
