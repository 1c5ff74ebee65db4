"""Our heads out in a published layout: EAGLE-1/2, EAGLE-3 and Medusa-1 as safetensors and the
config.json the official code writes, so vLLM, SGLang or the EAGLE repository can serve them;
`spec_jax.convert.heads_io.import_heads` reads them back bit for bit. A draft vocabulary of
EAGLE-1/2 or Medusa heads goes beside the weights as `draft_vocab.safetensors` (heads_io.DRAFT_VOCAB;
`draft_vocab_size` in config.json): the weights file keeps exactly the published names and shapes.
Medusa heads with several ResBlocks write each block as `{i}.{j}.linear.*`, as the published code
names them (that code runs one block's weights for all of them; engines that load each block by
name, as text-generation-inference does, run them as they are)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from spec_jax.convert.heads_io import (
    DRAFT_VOCAB,
    METHOD_OF,
    _as_target,
    _check_format,
    _st_dtypes,
)
from spec_jax.errors import SpecJaxError


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata=None) -> None:
    """A safetensors file written without PyTorch (names sorted, 8-byte aligned header), each
    tensor written from its array: no second copy of the whole file in memory."""
    names = {np.dtype(v).name: k for k, v in _st_dtypes().items()}
    header, off = {}, 0
    for name in sorted(tensors):
        a = tensors[name]
        key = names.get(np.dtype(a.dtype).name)
        if key is None:
            raise SpecJaxError(f"tensor {name} has dtype {a.dtype}, which safetensors cannot hold")
        n = int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        header[name] = {"dtype": key, "shape": list(a.shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name in sorted(tensors):
            fh.write(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8).data)


def _np(a):
    from pallas_kernels.cpu.gemm import unpack_all

    return np.asarray(unpack_all({"x": a})["x"]) if not isinstance(a, np.ndarray) else a


def _llama_config(heads, target, fmt: str) -> dict:
    """The published config.json: the imported one where the heads came from a published file,
    else a Llama config built from the target's."""
    pub = heads.hparams.get("published") or {}
    if pub.get("format") == fmt and pub.get("config"):
        return dict(pub["config"])
    if target is None:
        raise SpecJaxError(f"these {heads.method} heads were not imported from a published "
                           "checkpoint: pass --target (the target they run on) to build the "
                           "published config.json")
    c = target.cfg
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling_dict,
            "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
            "torch_dtype": c.dtype, "num_hidden_layers": 1}


def _with_vocab(files: dict, conf: dict, p: dict) -> tuple[dict, dict]:
    """(files, conf) with the heads' draft vocabulary, where they have one, in its own file beside
    the published weights (DRAFT_VOCAB) and its size in the config."""
    if "d2t" in p:
        files[DRAFT_VOCAB] = _vocab_out(p)
        conf["draft_vocab_size"] = len(files[DRAFT_VOCAB]["d2t"])
    return files, conf


def _vocab_out(p: dict) -> dict:
    """A draft vocabulary as EAGLE-3 stores it: `d2t` offsets (target id = draft id + offset) and
    `t2d`, the target ids it holds marked."""
    d2t = np.asarray(p["d2t"], np.int64)
    t2d = np.zeros(np.asarray(p["t2d"]).shape, bool)
    t2d[d2t] = True
    return {"d2t": d2t - np.arange(len(d2t), dtype=np.int64), "t2d": t2d}


def _layer_out(lp: dict, pre: str, input_norm: str | None) -> dict:
    t = lambda k: np.ascontiguousarray(_np(lp[k]).T)  # noqa: E731
    a, m = pre + "self_attn.", pre + "mlp."
    out = {a + "q_proj.weight": t("wq"), a + "k_proj.weight": t("wk"), a + "v_proj.weight": t("wv"),
           a + "o_proj.weight": t("wo"), pre + "post_attention_layernorm.weight": _np(lp["mlp_norm"]),
           m + "gate_proj.weight": t("w_gate"), m + "up_proj.weight": t("w_up"),
           m + "down_proj.weight": t("w_down")}
    if input_norm:
        out[pre + input_norm] = _np(lp["attn_norm"])
    if "bq" in lp:
        out.update({a + "q_proj.bias": _np(lp["bq"]), a + "k_proj.bias": _np(lp["bk"]),
                    a + "v_proj.bias": _np(lp["bv"])})
    return out


def _export_eagle(heads, target):
    from spec_jax.heads.eagle import features_of, num_layers_of

    p, hp = heads.params, heads.hparams
    if features_of(hp) != "post":
        raise SpecJaxError("these EAGLE heads read the target's features before its final norm; "
                           "published EAGLE heads read them after it (train with "
                           "--eagle-features post)")
    n = num_layers_of(p)
    bias = bool(hp.get("fc_bias", True))
    if not bias and np.any(_np(p["fc_b"]) != 0):
        raise SpecJaxError("these EAGLE heads have fc_bias false but a non-zero fc bias")
    out = {"fc.weight": np.ascontiguousarray(_np(p["fc_w"]).T)}
    if bias:
        out["fc.bias"] = _np(p["fc_b"])
    for i in range(n):
        out.update(_layer_out(p["layer" if i == 0 else f"layer_{i}"], f"layers.{i}.",
                              "input_layernorm.weight" if i else None))
    conf = _llama_config(heads, target, "eagle")
    conf.update(num_hidden_layers=n, bias=bias)
    if "bq" in p["layer"]:
        conf["qkv_bias"] = True
    files = {"model.safetensors": out}
    return _with_vocab(files, conf, p)


def _export_eagle3(heads, target):
    p = heads.params
    lp = p["layer"]
    out = {"fc.weight": np.ascontiguousarray(_np(p["fc_w"]).T), "norm.weight": _np(p["norm"]),
           "lm_head.weight": np.ascontiguousarray(_np(p["lm_head"]).T)}
    out.update(_layer_out(lp, "midlayer.", None))
    out["midlayer.input_layernorm.weight"] = _np(lp["input_norm"])
    out["midlayer.hidden_norm.weight"] = _np(lp["hidden_norm"])
    out.update(_vocab_out(p))
    conf = _llama_config(heads, target, "eagle3")
    if not (heads.hparams.get("published") or {}).get("config"):
        conf["architectures"] = ["LlamaForCausalLMEagle3"]
    conf.update(draft_vocab_size=len(out["d2t"]),
                target_hidden_size=int(out["fc.weight"].shape[1] // 3), num_hidden_layers=1)
    return {"model.safetensors": out}, conf


def _export_medusa(heads, target):
    """Head i: its ResBlocks `{i}.{j}.linear.*`, then its LM head `{i}.{layers}.weight`: its own
    ([V, H], or [Vd, H] over a draft vocabulary), else a copy of the target's [V, H] (every head
    the same array: one copy in memory), which `import_heads` reads back as the target's."""
    from spec_jax.convert.heads_io import _target_rows
    from spec_jax.heads.medusa import num_layers_of

    p, hp = heads.params, heads.hparams
    k, layers = int(p["w"].shape[0]), num_layers_of(p)
    if "lm_heads" in p:
        lms = [np.ascontiguousarray(a.T) for a in _np(p["lm_heads"])]
    elif target is not None:
        lms = [np.ascontiguousarray(_target_rows(target), _np(p["w"]).dtype)] * k
    else:
        raise SpecJaxError("these Medusa heads share the target's LM head; published Medusa heads "
                           "have one each: pass --target to copy the target's into every head")
    ws = [_np(p["w"])] + list(_np(p["w_rest"]) if layers > 1 else [])
    bs = [_np(p["b"])] + list(_np(p["b_rest"]) if layers > 1 else [])
    out = {}
    for i in range(k):
        for j in range(layers):
            out[f"{i}.{j}.linear.weight"] = np.ascontiguousarray(ws[j][i].T)
            out[f"{i}.{j}.linear.bias"] = bs[j][i]
        out[f"{i}.{layers}.weight"] = lms[i]
    pub = hp.get("published") or {}
    conf = dict(pub["config"]) if pub.get("format") == "medusa" and pub.get("config") else {}
    conf.update(medusa_num_heads=k, medusa_num_layers=layers)
    conf.setdefault("base_model_name_or_path",
                    str(target.path) if target is not None and target.path else "")
    files = {"medusa_lm_head.safetensors": out}
    return _with_vocab(files, conf, p)


EXPORTERS = {"eagle": _export_eagle, "eagle3": _export_eagle3, "medusa": _export_medusa}


def export_heads(fmt: str, src, out, target=None, force: bool = False) -> Path:
    """Our heads (a DraftHeads or its directory) written to `out` in the published layout of
    `fmt` (eagle, eagle3, medusa): safetensors + config.json, as the official code writes them."""
    from spec_jax.heads.registry import DraftHeads, load_draft
    from spec_jax.io import atomic_dir

    _check_format(fmt, tuple(EXPORTERS))
    heads = src if isinstance(src, DraftHeads) else load_draft(src)
    if heads.method != METHOD_OF[fmt]:
        raise SpecJaxError(f"{src if not isinstance(src, DraftHeads) else 'these heads'} hold "
                           f"{heads.method} heads, not {fmt}: pass --format {heads.method}"
                           if heads.method in EXPORTERS else
                           f"{heads.method} heads cannot be exported to a published format")
    target = _as_target(target) if target is not None else None
    if target is not None:
        heads.check_target(target)
    files, conf = EXPORTERS[fmt](heads, target)
    with atomic_dir(Path(out), force=force) as tmp:
        for name, tensors in files.items():
            write_safetensors(tmp / name, tensors, {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(conf, indent=2))
    return Path(out)
