"""GGUF (llama.cpp) Llama checkpoint -> Hugging Face directory (config, safetensors, tokenizer).

Dequantises every tensor to float32 and undoes llama.cpp's q/k row permutation, so the result
loads in transformers and in `spec_jax.convert.hf` alike.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spec_jax.errors import SpecJaxError


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert `permute` (interleaved -> rotate-half rows). w: [out, in]."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_json(tokens, merges, token_types):
    special = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (t, ty) in enumerate(zip(tokens, token_types)) if ty == 3
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a llama-architecture GGUF."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SpecJaxError(f"GGUF architecture {arch!r} is not supported: only 'llama' GGUF files")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)
    n_head, n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32",
    }
    hf_name = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    blk = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        if t.name.startswith("blk."):
            _, i, kind, suffix = t.name.split(".", 3)
            if kind == "attn_q":
                w = unpermute_qk(w, n_head)
            elif kind == "attn_k":
                w = unpermute_qk(w, n_kv)
            name = f"model.layers.{i}.{blk[kind]}.{suffix}"
        else:
            name = hf_name[t.name]
        state[name] = np.ascontiguousarray(w)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    merges = list(_field(reader, "tokenizer.ggml.merges"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(tokens, merges, types)))
    tid = lambda k: tokens[int(_field(reader, k))]
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tid("tokenizer.ggml.bos_token_id"),
        "eos_token": tid("tokenizer.ggml.eos_token_id"),
        "unk_token": tid("tokenizer.ggml.unknown_token_id"),
        "pad_token": tid("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))
    return out
