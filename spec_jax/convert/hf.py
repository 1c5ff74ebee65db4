"""Hugging Face directory (config.json + *.safetensors + tokenizer files) -> Orbax checkpoint.

No PyTorch needed: tensors are read with `safetensors.numpy`. The output directory holds
`params/` (Orbax), `spec_jax.json` (our config), the original `config.json` and the tokenizer files.
Writing is atomic: everything goes to a temporary sibling folder that is renamed at the end.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError
from spec_jax.io import atomic_dir, save_params

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


def read_safetensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise SpecJaxError(f"no *.safetensors files in {hf_dir}: save the model with "
                           "safe_serialization=True (PyTorch .bin files are not read)")
    state: dict[str, np.ndarray] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 — safetensors raises its own error types
            msg = " ".join(str(e).split())[:200] or type(e).__name__
            raise SpecJaxError(f"{f} cannot be read ({msg}): the file is truncated or damaged; "
                               "download it again") from None
    return state


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor name the config implies, with its shape and the config fields it shows."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    heads = "num_attention_heads/head_dim"
    kv = "num_key_value_heads/head_dim (head_dim defaults to hidden_size/num_attention_heads)"
    out = {"model.embed_tokens.weight": ((v, h), "vocab_size/hidden_size"),
           "model.norm.weight": ((h,), "hidden_size")}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": ((h,), "hidden_size"),
            p + "post_attention_layernorm.weight": ((h,), "hidden_size"),
            p + "self_attn.q_proj.weight": ((nq, h), heads),
            p + "self_attn.k_proj.weight": ((nkv, h), kv),
            p + "self_attn.v_proj.weight": ((nkv, h), kv),
            p + "self_attn.o_proj.weight": ((h, nq), heads),
            p + "mlp.gate_proj.weight": ((i, h), "intermediate_size"),
            p + "mlp.up_proj.weight": ((i, h), "intermediate_size"),
            p + "mlp.down_proj.weight": ((h, i), "intermediate_size")})
        if cfg.family == "qwen3":
            out.update({p + "self_attn.q_norm.weight": ((cfg.head_dim,), "head_dim"),
                        p + "self_attn.k_norm.weight": ((cfg.head_dim,), "head_dim")})
        if cfg.attention_bias:
            out.update({p + "self_attn.q_proj.bias": ((nq,), heads),
                        p + "self_attn.k_proj.bias": ((nkv,), kv),
                        p + "self_attn.v_proj.bias": ((nkv,), kv)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), "vocab_size/hidden_size (tie_word_embeddings=false)")
    return out


def check_tensors(state: dict[str, np.ndarray], cfg: ModelConfig, hf_dir: Path) -> None:
    """Refuse, before anything is written, a checkpoint whose tensors are not exactly the ones
    its config.json implies: each present, of the implied shape, no decoder layers beyond
    num_hidden_layers, and finite."""
    import re

    if "model.embed_tokens.weight" not in state or "model.norm.weight" not in state:
        raise SpecJaxError(f"{hf_dir} lacks model.embed_tokens.weight or model.norm.weight: is "
                           "this a Llama-family causal LM?")
    layers = {int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if layers and max(layers) + 1 != cfg.num_layers:
        raise SpecJaxError(f"{hf_dir}/config.json says num_hidden_layers={cfg.num_layers} but the "
                           f"tensors hold {max(layers) + 1} layers: fix config.json or the files")
    for name, (shape, fields) in expected_tensors(cfg).items():
        if name not in state:
            raise SpecJaxError(f"{hf_dir} lacks tensor {name} that config.json implies: the "
                               "download is incomplete or config.json belongs to another model")
        have = tuple(state[name].shape)
        if have != shape:
            raise SpecJaxError(f"{hf_dir}/config.json disagrees with the tensors: {name} should "
                               f"have shape {shape} (from {fields}), has {have}")
        if state[name].dtype.kind == "f" and not np.isfinite(state[name]).all():
            raise SpecJaxError(f"{hf_dir}: tensor {name} holds NaN or infinity: the checkpoint "
                               "is corrupt")


def params_from_hf(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Map HF Llama-family tensor names to our stacked layout (linear weights transposed to [in, out])."""
    dt = np.dtype("float32")
    get = lambda n: np.asarray(state[n], dtype=np.float32)
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in state]
    if missing:
        raise SpecJaxError(f"checkpoint lacks {missing}: is this a Llama-family causal LM?")

    def stack(fmt, transpose=True):
        arrs = []
        for i in range(cfg.num_layers):
            a = get(fmt.format(i))
            arrs.append(a.T if transpose else a)
        return np.stack(arrs).astype(dt)

    p = "model.layers.{}."
    layers = {
        "attn_norm": stack(p + "input_layernorm.weight", False),
        "wq": stack(p + "self_attn.q_proj.weight"),
        "wk": stack(p + "self_attn.k_proj.weight"),
        "wv": stack(p + "self_attn.v_proj.weight"),
        "wo": stack(p + "self_attn.o_proj.weight"),
        "mlp_norm": stack(p + "post_attention_layernorm.weight", False),
        "w_gate": stack(p + "mlp.gate_proj.weight"),
        "w_up": stack(p + "mlp.up_proj.weight"),
        "w_down": stack(p + "mlp.down_proj.weight"),
    }
    if cfg.attention_bias:
        layers.update(bq=stack(p + "self_attn.q_proj.bias", False),
                      bk=stack(p + "self_attn.k_proj.bias", False),
                      bv=stack(p + "self_attn.v_proj.bias", False))
    if cfg.family == "qwen3":
        layers.update(q_norm=stack(p + "self_attn.q_norm.weight", False),
                      k_norm=stack(p + "self_attn.k_norm.weight", False))
    params = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight"),
              "layers": layers}
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in state:
            raise SpecJaxError("config says tie_word_embeddings=false but lm_head.weight is missing")
        params["lm_head"] = get("lm_head.weight").T.copy()
    return params


def convert_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str = "float32",
               force: bool = False) -> Path:
    """Convert an HF checkpoint directory to a spec_jax (Orbax) checkpoint directory."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if dtype not in ("float32", "bfloat16"):
        raise SpecJaxError(f"unsupported dtype {dtype!r}: use float32 or bfloat16")
    if not (hf_dir / "config.json").is_file():
        raise SpecJaxError(f"{hf_dir} has no config.json: pass a Hugging Face model directory")
    try:
        cfg = ModelConfig.from_json(hf_dir / "config.json", dtype=dtype)
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecJaxError(f"{hf_dir}/config.json is not valid JSON ({e})") from None
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise SpecJaxError(f"{hf_dir}/config.json lacks or mistypes a field the model needs "
                           f"({type(e).__name__}: {e})") from None
    state = read_safetensors(hf_dir)
    check_tensors(state, cfg, hf_dir)
    params = params_from_hf(state, cfg)
    with atomic_dir(out_dir, force=force) as tmp:
        save_params(tmp / "params", params, dtype=dtype)
        (tmp / "spec_jax.json").write_text(json.dumps({"kind": "target", "config": cfg.to_dict()},
                                                      indent=2))
        shutil.copy(hf_dir / "config.json", tmp / "config.json")
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy(hf_dir / name, tmp / name)
    return out_dir
