"""Published draft heads in and out: EAGLE-1/2 (SafeAILab `cnets1.py`), EAGLE-3 (`cnets.py`),
Medusa-1 (`medusa_lm_head.*`) and MTP modules inside a target checkpoint (DeepSeek-V3's
`model.layers.{L+i}.*`, MiMo's `model.mtp_layers.{i}.*`) <-> spec_jax heads (heads/registry.py).

`import_heads` maps every published tensor onto our params (linear weights transposed to [in, out])
and checks each against the target's shapes first: a missing tensor, an unexpected one, or one
whose shape does not fit the target is a one-line SpecJaxError naming it and both shapes, and
nothing is written. Where the published head differs from a fresh spec_jax head, the difference is
carried by what the params hold (EAGLE's fc bias as zeros when the file has none, q/k/v biases as
`bq`/`bk`/`bv`, an MTP module's own output norm as `out_norm`, MiMo's [hidden; embedding] input
projection as its rows swapped, Medusa's ResBlocks after the first as `w_rest`/`b_rest`) or by an
hparam (EAGLE `features` "post", MTP `features` "post", Medusa `num_layers`). Medusa LM heads that
are exactly the target's are not kept: the heads read the target's, as fresh spec_jax heads do.

A draft vocabulary (spec_jax.heads.vocab) travels with EAGLE-1/2 and Medusa heads, whose published
layouts have none, as `draft_vocab.safetensors` beside the weights: `d2t` and `t2d` as EAGLE-3
stores them (target id = draft id + d2t[draft id]; t2d marks the target ids). Engines that do not
read it run the heads over the full vocabulary (still lossless; their drafts may differ).

Safetensors are read here without PyTorch (only the tensors asked for); `pytorch_model.bin` /
`*.pt` files only through `torch.load(..., weights_only=True)`, never unrestricted pickle.
`spec_jax.convert.heads_export` writes our heads in the published layout.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from spec_jax.errors import SpecJaxError

FORMATS = ("eagle", "eagle3", "medusa", "mtp")
DRAFT_VOCAB = "draft_vocab.safetensors"  # a draft vocabulary beside EAGLE-1/2 or Medusa weights
METHOD_OF = {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa", "mtp": "mtp"}


# ---------------------------------------------------------------- reading tensors

def _st_dtypes():
    import ml_dtypes

    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
            "BOOL": np.bool_}


class Tensors:
    """The tensors of a checkpoint directory (or one file), read only when asked for."""

    def __init__(self, path: Path, prefer: tuple[str, ...] = ()):
        path = Path(path)
        if not path.exists():
            raise SpecJaxError(f"{path} does not exist: pass the directory of the downloaded heads")
        self.path = path
        folder = path if path.is_dir() else path.parent
        cfg = folder / "config.json"
        self.config = json.loads(cfg.read_text()) if cfg.is_file() else {}
        self._index: dict[str, tuple] = {}  # name -> (file, offset, nbytes, dtype, shape)
        self._torch: dict[str, np.ndarray] = {}
        if path.is_file():
            files = [path]
        else:
            files = [path / p for p in prefer if (path / p).is_file()]
            if not files:
                files = sorted(p for p in path.glob("*.safetensors") if p.name != DRAFT_VOCAB)
            if not files:
                files = sorted(path.glob("pytorch_model*.bin")) or sorted(path.glob("*.pt")) \
                    or sorted(path.glob("*.bin"))
        if not files:
            raise SpecJaxError(f"no weights in {path}: expected *.safetensors, pytorch_model.bin "
                               "or *.pt files")
        for f in files:
            if f.suffix == ".safetensors":
                self._read_header(f)
            else:
                self._torch.update(_torch_state(f))
        self.files = files

    def _read_header(self, f: Path):
        dtypes = _st_dtypes()
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise SpecJaxError(f"{f} is not a safetensors file (too short)")
            n = struct.unpack("<Q", head)[0]
            try:
                header = json.loads(fh.read(n))
            except ValueError as e:
                raise SpecJaxError(f"{f} is not a safetensors file ({e})") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in dtypes:
                raise SpecJaxError(f"{f}: tensor {name} has dtype {info['dtype']}, which spec_jax "
                                   "does not read")
            a, b = info["data_offsets"]
            self._index[name] = (f, 8 + n + a, b - a, dtypes[info["dtype"]], tuple(info["shape"]))

    def names(self) -> list[str]:
        return sorted(set(self._index) | set(self._torch))

    def __contains__(self, name) -> bool:
        return name in self._index or name in self._torch

    def shape(self, name) -> tuple:
        if name in self._torch:
            return tuple(self._torch[name].shape)
        return self._index[name][4]

    def get(self, name) -> np.ndarray:
        if name in self._torch:
            return self._torch[name]
        f, off, nbytes, dt, shape = self._index[name]
        with open(f, "rb") as fh:
            fh.seek(off)
            buf = fh.read(nbytes)
        return np.frombuffer(buf, dtype=dt).reshape(shape).copy()

    def rows(self, name, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (along its first axis), reading only their bytes."""
        if name in self._torch:
            return self._torch[name][start:stop]
        f, off, nbytes, dt, shape = self._index[name]
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dt).itemsize
        buf = bytearray((stop - start) * row)  # read into, not copied: one buffer per block
        with open(f, "rb") as fh:
            fh.seek(off + start * row)
            if fh.readinto(buf) != len(buf):
                raise SpecJaxError(f"{f} ends inside tensor {name}: the file is truncated")
        return np.frombuffer(buf, dtype=dt).reshape((stop - start, *shape[1:]))

    def truncated(self) -> Path | None:
        """The first safetensors file whose header places data past its end, or None."""
        ends: dict[Path, int] = {}
        for f, off, nbytes, _, _ in self._index.values():
            ends[f] = max(ends.get(f, 0), off + nbytes)
        return next((f for f, end in ends.items() if f.stat().st_size < end), None)


def _torch_state(f: Path) -> dict[str, np.ndarray]:
    """A PyTorch state dict read with `weights_only=True` (tensors and plain containers only)."""
    try:
        import torch
    except ImportError:
        raise SpecJaxError(f"{f.name} is a PyTorch file: reading it needs PyTorch (install the "
                           "'torch' extra: pip install 'spec-jax[torch]'), or convert it to "
                           "safetensors") from None
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses anything but tensors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecJaxError(f"{f} could not be read as a PyTorch state dict with weights_only=True "
                           f"({first})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise SpecJaxError(f"{f} holds a {type(state).__name__}, not a state dict of tensors")
    out = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            continue
        v = v.detach().cpu()
        if v.dtype == torch.bfloat16:
            import ml_dtypes

            out[k] = v.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        else:
            out[k] = v.numpy().copy()
    return out


def _guess(names) -> str | None:
    """Which published format tensor names look like (for error messages)."""
    s = set(names)
    if any(n.startswith("midlayer.") for n in s) or "d2t" in s:
        return "eagle3"
    if any(re.match(r"(medusa_head\.)?\d+\.\d+\.linear\.weight$", n) for n in s):
        return "medusa"
    if any(".enorm." in n or ".mtp_layers." in n for n in s):
        return "mtp"
    if "fc.weight" in s and any(n.startswith("layers.") for n in s):
        return "eagle"
    return None


class _Reader:
    """Takes tensors from `Tensors` with the shapes the target needs, as float arrays of `dtype`
    (transposed to [in, out] where asked); remembers what it took."""

    def __init__(self, src: Tensors, fmt: str, dtype, rename=None):
        self.src, self.fmt, self.dtype = src, fmt, dtype
        self.rename = rename or (lambda n: n)
        self.used: set[str] = set()

    def has(self, name) -> bool:
        return self.rename(name) in self.src

    def raw(self, name, shape) -> np.ndarray:
        return self.src.get(self.check(name, shape))

    def check(self, name, shape) -> str:
        """The file's name of tensor `name`, checked to be there with `shape` (not read)."""
        real = self.rename(name)
        guess = _guess(self.src.names())
        hint = (f": the file looks like {guess!r} heads, pass --format {guess}"
                if guess and guess != self.fmt else "")
        if real not in self.src:
            raise SpecJaxError(f"{self.src.path} lacks tensor {real} ({self.fmt} heads need it, "
                               f"shape {list(shape)}){hint}")
        have = self.src.shape(real)
        if tuple(have) != tuple(shape):
            raise SpecJaxError(f"tensor {real} in {self.src.path} has shape {list(have)}, but "
                               f"{self.fmt} heads for this target need {list(shape)}"
                               + (hint or ": these heads were made for another target"))
        self.used.add(real)
        return real

    def take(self, name, shape, transpose=False) -> np.ndarray:
        a = np.asarray(self.raw(name, shape), np.float32).astype(self.dtype)
        return np.ascontiguousarray(a.T) if transpose else a

    def check_embed(self, cfg):
        """A copy of the target's embedding some files carry: it must at least have its shape."""
        for name in ("embed_tokens.weight", "model.embed_tokens.weight"):
            if name in self.src:
                self.raw(name, (cfg.vocab_size, cfg.hidden_size))

    def check_unused(self, allowed=()):
        left = [n for n in self.src.names() if n not in self.used
                and not any(re.fullmatch(p, n) for p in allowed)]
        if left:
            guess = _guess(left) if _guess(self.src.names()) != self.fmt else None
            hint = f" (pass --format {guess}?)" if guess and guess != self.fmt else ""
            more = f" and {len(left) - 1} more" if len(left) > 1 else ""
            raise SpecJaxError(f"{self.src.path} holds tensor {left[0]} (shape "
                               f"{list(self.src.shape(left[0]))}){more}, which {self.fmt} heads do "
                               f"not have{hint}")


def _check_config(conf: dict, cfg, fields: dict, fmt: str):
    """Config fields of the published heads that must equal the target's."""
    for key, want in fields.items():
        if key in conf and conf[key] is not None and conf[key] != want:
            raise SpecJaxError(f"the {fmt} heads' config.json has {key} {conf[key]}, but the target "
                               f"has {want}: these heads were made for another target")


def _layer(r: _Reader, pre: str, cfg, in_dim: int, inter: int, input_norm: str | None,
           qkv_bias: bool | None = None) -> dict:
    """One Llama decoder layer `pre`* as our unstacked layer dict (see heads.eagle.init_layer)."""
    h = cfg.hidden_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    a = pre + "self_attn."
    m = pre + "mlp."
    p = {"wq": r.take(a + "q_proj.weight", (nq, in_dim), True),
         "wk": r.take(a + "k_proj.weight", (nkv, in_dim), True),
         "wv": r.take(a + "v_proj.weight", (nkv, in_dim), True),
         "wo": r.take(a + "o_proj.weight", (h, nq), True),
         "mlp_norm": r.take(pre + "post_attention_layernorm.weight", (h,)),
         "w_gate": r.take(m + "gate_proj.weight", (inter, h), True),
         "w_up": r.take(m + "up_proj.weight", (inter, h), True),
         "w_down": r.take(m + "down_proj.weight", (h, inter), True)}
    if input_norm:
        p["attn_norm"] = r.take(pre + input_norm, (h,))
    if qkv_bias or (qkv_bias is None and r.has(a + "q_proj.bias")):
        p.update(bq=r.take(a + "q_proj.bias", (nq,)), bk=r.take(a + "k_proj.bias", (nkv,)),
                 bv=r.take(a + "v_proj.bias", (nkv,)))
    return p


def _inter(r: _Reader, name: str, conf: dict, cfg) -> int:
    if "intermediate_size" in conf:
        return int(conf["intermediate_size"])
    real = r.rename(name)
    return int(r.src.shape(real)[0]) if real in r.src else cfg.intermediate_size


def _d2t_ids(r: _Reader, vd: int, v: int) -> np.ndarray:
    """The target ids [vd] of a draft vocabulary stored as EAGLE-3 stores it (`d2t` offsets, and
    `t2d` marks where present), checked to be distinct ids of the target's vocabulary of `v`."""
    src = r.src
    off = r.raw("d2t", (vd,)) if "d2t" in src or vd != v else np.zeros(vd, np.int64)
    ids = np.arange(vd, dtype=np.int64) + np.asarray(off, np.int64)
    if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != vd:
        raise SpecJaxError(f"tensor d2t in {src.path} maps draft ids outside the target's "
                           f"vocabulary of {v} or onto one id twice: not EAGLE-3 offsets")
    if "t2d" in src:
        t2d = np.asarray(r.raw("t2d", (v,)), bool)
        if int(t2d.sum()) != vd or not t2d[ids].all():
            raise SpecJaxError(f"tensors d2t and t2d in {src.path} disagree: t2d marks "
                               f"{int(t2d.sum())} target ids, d2t maps {vd} others")
    return ids


def _draft_vocab(src: Tensors, fmt: str, v: int) -> np.ndarray | None:
    """The draft vocabulary (target ids) in `draft_vocab.safetensors` beside the heads, or None."""
    folder = src.path if src.path.is_dir() else src.path.parent
    if not (folder / DRAFT_VOCAB).is_file():
        return None
    r = _Reader(Tensors(folder / DRAFT_VOCAB), fmt, None)
    if "d2t" not in r.src:
        raise SpecJaxError(f"{folder / DRAFT_VOCAB} lacks tensor d2t (the draft vocabulary)")
    vd = int(r.src.shape("d2t")[0])
    want = src.config.get("draft_vocab_size")
    if want is not None and int(want) != vd:
        raise SpecJaxError(f"the {fmt} heads' config.json has draft_vocab_size {want}, but tensor "
                           f"d2t in {folder / DRAFT_VOCAB} maps {vd} ids")
    if vd > v:
        raise SpecJaxError(f"the {fmt} heads' draft vocabulary ({vd}) exceeds the target's "
                           f"vocabulary ({v}): these heads were made for another target")
    ids = _d2t_ids(r, vd, v)
    r.check_unused()
    return ids


def _target_rows(target) -> np.ndarray:
    """The target's LM head as rows [V, H] (its embedding where tied)."""
    from pallas_kernels.cpu.gemm import unpack_all

    p = target.params
    if "lm_head" not in p:
        return np.asarray(p["embed"])
    return np.asarray(unpack_all({"w": p["lm_head"]})["w"]).T


def _equals_rows(src: Tensors, name: str, rows: np.ndarray, dtype, ids=None) -> bool:
    """Whether tensor `name` [n, H] equals `rows` (or rows[ids]) once cast to `dtype`, compared a
    block of rows at a time: no copy of a whole LM head."""
    n, h = src.shape(name)
    step = max(1, (16 << 20) // (4 * h))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        mine = np.asarray(src.rows(name, r0, r1), np.float32).astype(dtype)
        theirs = rows[r0:r1] if ids is None else rows[ids[r0:r1]]
        if not np.array_equal(np.asarray(mine, np.float32), np.asarray(theirs, np.float32)):
            return False
    return True


# ---------------------------------------------------------------- per format

def _import_eagle(src: Tensors, target, dtype):
    from spec_jax.heads import eagle
    from spec_jax.heads.vocab import vocab_maps

    cfg, conf = target.cfg, src.config
    h = cfg.hidden_size
    _check_config(conf, cfg, {"hidden_size": h, "num_attention_heads": cfg.num_heads,
                              "num_key_value_heads": cfg.num_kv_heads,
                              "vocab_size": cfg.vocab_size}, "eagle")
    r = _Reader(src, "eagle", dtype)
    n = conf.get("num_hidden_layers")
    if n is None:
        n = 1 + max([int(m.group(1)) for m in (re.match(r"layers\.(\d+)\.", k) for k in src.names())
                     if m] or [0])
    bias = conf.get("bias", "fc.bias" in src)
    fc_w = r.take("fc.weight", (h, 2 * h), True)
    fc_b = r.take("fc.bias", (h,)) if bias else np.zeros((h,), dtype)
    qkv = conf.get("qkv_bias")
    params = {"fc_w": fc_w, "fc_b": fc_b}
    for i in range(int(n)):
        pre = f"layers.{i}."
        lp = _layer(r, pre, cfg, h, _inter(r, pre + "mlp.gate_proj.weight", conf, cfg),
                    "input_layernorm.weight" if i else None, qkv)
        params["layer" if i == 0 else f"layer_{i}"] = lp
    r.check_embed(cfg)
    r.check_unused(allowed=(ROTARY,))
    hp = {**eagle.METHOD.defaults, "num_layers": int(n), "features": "post", "fc_bias": bool(bias)}
    ids = _draft_vocab(src, "eagle", cfg.vocab_size)
    if ids is not None:  # drafts over the target's LM head restricted to these ids
        params.update({k: np.asarray(a) for k, a in vocab_maps(ids, cfg.vocab_size).items()})
        hp["draft_vocab"] = len(ids)
    return params, hp


def _import_eagle3(src: Tensors, target, dtype):
    from spec_jax.heads import eagle3
    from spec_jax.heads.vocab import vocab_maps

    cfg, conf = target.cfg, src.config
    h, v = cfg.hidden_size, cfg.vocab_size
    _check_config(conf, cfg, {"hidden_size": h, "target_hidden_size": h,
                              "num_attention_heads": cfg.num_heads,
                              "num_key_value_heads": cfg.num_kv_heads, "vocab_size": v}, "eagle3")
    mid = "midlayer." if any(k.startswith("midlayer.") for k in src.names()) or \
        not any(k.startswith("layers.0.") for k in src.names()) else "layers.0."
    r = _Reader(src, "eagle3", dtype)
    vd = conf.get("draft_vocab_size")
    if vd is None:
        vd = src.shape("lm_head.weight")[0] if "lm_head.weight" in src else v
    vd = int(vd)
    if vd > v:
        raise SpecJaxError(f"the eagle3 heads' draft vocabulary ({vd}) exceeds the target's "
                           f"vocabulary ({v}): these heads were made for another target")
    layer = _layer(r, mid, cfg, 2 * h, _inter(r, mid + "mlp.gate_proj.weight", conf, cfg), None,
                   None)
    layer["input_norm"] = r.take(mid + "input_layernorm.weight", (h,))
    layer["hidden_norm"] = r.take(mid + "hidden_norm.weight", (h,))
    params = {"fc_w": r.take("fc.weight", (h, 3 * h), True), "layer": layer,
              "norm": r.take("norm.weight", (h,)),
              "lm_head": r.take("lm_head.weight", (vd, h), True)}
    ids = _d2t_ids(r, vd, v) if "d2t" in src or "t2d" in src or vd != v else \
        np.arange(vd, dtype=np.int64)
    params.update({k: np.asarray(a) for k, a in vocab_maps(ids, v).items()})
    r.check_embed(cfg)
    r.check_unused(allowed=(ROTARY,))
    hp = {**eagle3.METHOD.defaults, "draft_vocab": vd, "fused_layers": list(cfg.eagle3_layers)}
    return params, hp


def _import_medusa(src: Tensors, target, dtype):
    """Medusa-1 heads: head i is `{i}.{j}.linear.*` for its ResBlocks j < medusa_num_layers, then
    its LM head `{i}.{layers}.weight` ([V, H], or [Vd, H] over a draft vocabulary). The published
    code repeats one ResBlock module `layers` times, so its files hold equal copies of block 0
    (torch.save) or block 0 alone (a deduplicating save): the latter imports as `layers` copies."""
    cfg, conf = target.cfg, src.config
    h, v = cfg.hidden_size, cfg.vocab_size
    _check_config(conf, cfg, {"hidden_size": h, "vocab_size": v}, "medusa")
    names = src.names()
    pre = "medusa_head." if any(k.startswith("medusa_head.") for k in names) else ""
    found = sorted({int(m.group(1)) for m in (re.match(re.escape(pre) + r"(\d+)\.", k)
                                               for k in names) if m})
    k = len(found) if found else int(conf.get("medusa_num_heads", 0))
    if k == 0:
        raise SpecJaxError(f"{src.path} lacks tensor 0.0.linear.weight: no Medusa heads in it"
                           + (f" (it looks like {_guess(names)!r} heads)" if _guess(names) else ""))
    layers = conf.get("medusa_num_layers")
    if layers is None:  # the LM head is head 0's one tensor `0.{n}.weight` outside a ResBlock
        lm = [int(m.group(1)) for m in (re.fullmatch(re.escape(pre) + r"0\.(\d+)\.weight", n)
                                        for n in names) if m]
        layers = lm[0] if len(lm) == 1 else 1
    if not isinstance(layers, int) or layers < 1:
        raise SpecJaxError(f"the Medusa heads' config.json has medusa_num_layers {layers!r}: "
                           "expected an integer >= 1")
    r = _Reader(src, "medusa", dtype, rename=lambda n: pre + n)
    shared = layers > 1 and not any(r.has(f"{i}.{j}.linear.weight") for i in range(k)
                                    for j in range(1, layers))

    def block(j):  # ResBlock j of every head: ([K, H, H], [K, H])
        j = 0 if shared else j
        return (np.stack([r.take(f"{i}.{j}.linear.weight", (h, h), True) for i in range(k)]),
                np.stack([r.take(f"{i}.{j}.linear.bias", (h,)) for i in range(k)]))

    params = dict(zip(("w", "b"), block(0)))
    if layers > 1:
        rest = [block(j) for j in range(1, layers)]
        params.update(w_rest=np.stack([w for w, _ in rest]), b_rest=np.stack([b for _, b in rest]))
    ids = _draft_vocab(src, "medusa", v)
    hp = {"num_heads": k, **({"num_layers": layers} if layers > 1 else {})}
    lm = [f"{i}.{layers}.weight" for i in range(k)]
    full = ids is None or r.has(lm[0]) and tuple(src.shape(r.rename(lm[0]))) == (v, h)
    for name in lm:
        r.check(name, (v, h) if full else (len(ids), h))
    rows = _target_rows(target)  # LM heads exactly the target's: read from it, as fresh heads do
    if not all(_equals_rows(src, r.rename(n), rows, dtype, None if full else ids) for n in lm):
        heads = [r.take(n, (v, h) if full else (len(ids), h)) for n in lm]
        if ids is not None and full:
            heads = [a[ids] for a in heads]
        params["lm_heads"] = np.stack([np.ascontiguousarray(a.T) for a in heads])
        hp["own_lm_heads"] = True
    if ids is not None:
        from spec_jax.heads.vocab import vocab_maps

        params.update({key: np.asarray(a) for key, a in vocab_maps(ids, v).items()})
        hp["draft_vocab"] = len(ids)
    # a Medusa-2 checkpoint also holds the whole base model: only its medusa_head.* are heads
    r.check_unused(allowed=(r"(?!medusa_head\.).*",) if pre else ())
    return params, hp


MLA = r"self_attn\.(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)\."
MOE = r"mlp\.(gate|experts|shared_experts)\."


def _check_llama_block(src: Tensors, pre: str) -> None:
    """spec_jax's MTP modules are Llama decoder layers: a module with multi-head latent attention
    or a mixture-of-experts MLP (DeepSeek-V3's own MTP layers) is refused, naming its first such
    tensor, before anything else is read."""
    for pattern, what, ours in ((MLA, "multi-head latent attention (DeepSeek-V3's MLA)",
                                 "q/k/v/o projections"),
                                (MOE, "a mixture-of-experts MLP", "a dense gate/up/down MLP")):
        hit = next((n for n in src.names() if n.startswith(pre)
                    and re.match(re.escape(pre) + pattern, n)), None)
        if hit is not None:
            raise SpecJaxError(f"tensor {hit} in {src.path}: this MTP module has {what}, but "
                               f"spec_jax's MTP modules are Llama decoder layers ({ours})")


def _import_mtp(src: Tensors, target, dtype):
    from spec_jax.heads import mtp

    cfg, conf = target.cfg, src.config
    h, v = cfg.hidden_size, cfg.vocab_size
    names = src.names()
    _check_config(conf, cfg, {"hidden_size": h, "vocab_size": v,
                              "num_attention_heads": cfg.num_heads,
                              "num_key_value_heads": cfg.num_kv_heads}, "mtp")
    mimo = any(k.startswith("model.mtp_layers.") for k in names)
    if mimo:
        n = len({k.split(".")[2] for k in names if k.startswith("model.mtp_layers.")})
        pres = [f"model.mtp_layers.{i}." for i in range(n)]
    else:
        n = conf.get("num_nextn_predict_layers")
        base = int(conf.get("num_hidden_layers", cfg.num_layers))
        if n is None:
            n = 0
            while f"model.layers.{base + n}.enorm.weight" in src:
                n += 1
        pres = [f"model.layers.{base + i}." for i in range(max(int(n), 1))]
    r = _Reader(src, "mtp", dtype)
    mods, out_norms = [], []
    for pre in pres:
        _check_llama_block(src, pre)
        if mimo:
            w = r.take(pre + "input_proj.weight", (h, 2 * h))  # [hidden; embedding] columns
            m = {"enorm": r.take(pre + "token_layernorm.weight", (h,)),
                 "hnorm": r.take(pre + "hidden_layernorm.weight", (h,)),
                 "eh_proj": np.ascontiguousarray(np.concatenate([w[:, h:].T, w[:, :h].T])),
                 }
            out = pre + "final_layernorm.weight"
        else:
            m = {"enorm": r.take(pre + "enorm.weight", (h,)),
                 "hnorm": r.take(pre + "hnorm.weight", (h,)),
                 "eh_proj": r.take(pre + "eh_proj.weight", (h, 2 * h), True)}
            out = pre + "shared_head.norm.weight"
            head = pre + "shared_head.head.weight"
            if head in src:  # compared a block of rows at a time: no copies of a whole head
                r.check(head, (v, h))
                if not _equals_rows(src, head, _target_rows(target), dtype):
                    raise SpecJaxError(f"tensor {head} in {src.path} is not the target's LM "
                                       "head: spec_jax's MTP modules share the target's")
        m["layer"] = _layer(r, pre, cfg, h, _inter(r, pre + "mlp.gate_proj.weight", conf, cfg),
                            "input_layernorm.weight")
        out_norms.append((out, r.take(out, (h,))))
        mods.append(m)
    for name, a in out_norms[1:]:
        if not np.array_equal(a, out_norms[0][1]):
            raise SpecJaxError(f"tensor {name} differs from {out_norms[0][0]}: spec_jax's MTP "
                               "modules share one output norm; import fewer modules")
    keys = set(mods[0]["layer"])
    if any(set(m["layer"]) != keys for m in mods):
        raise SpecJaxError("the MTP modules differ in their q/k/v biases")
    stack = lambda *a: np.stack(a)  # noqa: E731
    import jax

    params = {"modules": jax.tree.map(stack, *mods), "out_norm": out_norms[0][1]}
    hp = {**mtp.METHOD.defaults, "num_modules": len(mods), "features": "post"}
    return params, hp


ROTARY = r".*rotary_emb\.inv_freq"  # a buffer older transformers versions saved


IMPORTERS = {"eagle": _import_eagle, "eagle3": _import_eagle3, "medusa": _import_medusa,
             "mtp": _import_mtp}
PREFER = {"eagle": ("model.safetensors", "pytorch_model.bin"),
          "eagle3": ("model.safetensors", "pytorch_model.bin"),
          "medusa": ("medusa_lm_head.safetensors", "medusa_lm_head.pt"), "mtp": ()}


def _check_format(fmt: str, choices=FORMATS):
    if fmt not in choices:
        raise SpecJaxError(f"unknown heads format {fmt!r}: choose one of {', '.join(choices)}")


def _as_target(target):
    if isinstance(target, (str, Path)):
        from spec_jax.target import load_target

        return load_target(target, layers="scan")
    return target


def import_heads(fmt: str, src, target, out=None, force: bool = False):
    """Published heads of `fmt` (eagle, eagle3, medusa, mtp) in `src` (a directory or a file)
    for `target` (a Target or its checkpoint directory) -> DraftHeads; saved to `out` (atomically:
    nothing is written unless every tensor fits) when given."""
    import jax.numpy as jnp

    from spec_jax.heads.registry import DraftHeads, save_draft

    _check_format(fmt)
    target = _as_target(target)
    tensors = Tensors(Path(src), PREFER[fmt])
    params, hp = IMPORTERS[fmt](tensors, target, jnp.dtype(target.cfg.dtype))
    hp["published"] = {"format": fmt, "config": tensors.config}
    import jax

    params = jax.tree.map(jnp.asarray, params)
    heads = DraftHeads(method=METHOD_OF[fmt], params=params, hparams=hp,
                       target_info=target.identity(), tcfg=target.cfg)
    if out is not None:
        save_draft(heads, out, force=force)
    return heads
