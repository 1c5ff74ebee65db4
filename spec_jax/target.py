"""A loaded target model: config, parameters and tokenizer, plus the helpers users call."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError


@dataclasses.dataclass(eq=False)
class Target:
    cfg: ModelConfig
    params: Any
    tokenizer: Any = None
    path: Path | None = None
    # Compiled executables keyed by their static settings; owned by this target, not module state.
    compiled: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.cfg.eos_token_ids)
        tok = self.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        return tuple(sorted(ids))

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string (chat template applied when chat=True) or ids as given."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            if not ids:
                raise SpecJaxError("empty prompt: pass a non-empty string or list of token ids")
            if min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
                raise SpecJaxError(f"token ids must lie in [0, {self.cfg.vocab_size})")
            return ids
        if self.tokenizer is None:
            raise SpecJaxError("this target has no tokenizer: pass token ids instead of a string")
        if chat and getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(t) for t in ids]
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise SpecJaxError("the prompt encodes to no tokens: pass a non-empty prompt")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def layout(self) -> str:
        """How the layers are laid out for execution: "scan", "unrolled" or "packed"."""
        layers = self.params["layers"]
        if not isinstance(layers, (list, tuple)):
            return "scan"
        from pallas_kernels.cpu_gemm import PackedWeight

        return "packed" if any(isinstance(w, PackedWeight) for w in layers[0].values()) else "unrolled"

    @property
    def weight_codes(self) -> bool:
        """True when packed layers stream uint8 codes with scales (`cpu_gemm.pack_exact`)."""
        layers = self.params["layers"]
        return (isinstance(layers, (list, tuple))
                and any(getattr(w, "scales", None) is not None for w in layers[0].values()))

    def new_cache(self, batch: int, num_slots: int):
        """An empty KV cache laid out like the parameters: per-layer buffers for unrolled layers."""
        from spec_jax.cache import cache_for

        return cache_for(self.cfg, batch, num_slots,
                         per_layer=isinstance(self.params["layers"], (list, tuple)))

    def logits(self, token_ids) -> np.ndarray:
        """Full-sequence logits (float32): [T, V] for one sequence of ids [T], [B, T, V] for a batch
        of equal-length ones [B, T]. Used by parity checks and exact references. Sequences are
        right-padded to a multiple of 16 (causal attention leaves the real positions unchanged),
        so a reference loop that grows a sequence compiles once per 16 tokens, not per token."""
        from spec_jax.models.llama import causal_mask, forward

        ids = np.asarray(token_ids, np.int32)
        one = ids.ndim == 1
        ids = ids[None] if one else ids
        b, t = ids.shape
        padded = np.zeros((b, -(-t // 16) * 16), np.int32)
        padded[:, :t] = ids
        if "logits" not in self.compiled:
            cfg = self.cfg

            def run(params, ids):
                b, t = ids.shape
                pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
                cache = self.new_cache(b, 8)
                return forward(params, cfg, ids, pos, cache, causal_mask(b, t)).logits

            self.compiled["logits"] = jax.jit(run)
        out = np.asarray(self.compiled["logits"](self.params, jnp.asarray(padded)), np.float32)
        return out[0, :t] if one else out[:, :t]

    def fingerprint(self) -> str:
        """A short hash of the architecture and a sample of the weights (draft heads check it)."""
        h = hashlib.sha256(json.dumps(
            {k: v for k, v in self.cfg.to_dict().items() if k != "dtype"}, sort_keys=True).encode())
        emb = np.asarray(jnp.asarray(self.params["embed"][:64, :64], jnp.float32))
        h.update(np.round(emb, 3).tobytes())
        return h.hexdigest()[:16]


def load_target(path: str | Path, dtype: str | None = None, layers: str = "auto") -> Target:
    """Load a spec_jax target checkpoint (written by `spec-jax convert` or `spec-jax fetch`).

    layers: "scan" (stacked, compile time independent of depth), "unrolled" (per-layer buffers,
    faster decoding on CPU), "packed" (unrolled, float32 matrices in the CPU kernel's panel layout:
    `pallas_kernels.cpu_gemm`; a matrix that is exactly GGUF-dequantized, as SmolLM2's is, as
    uint8 codes and scales that reproduce it bit for bit), "packed_f32" (every matrix as float32
    panels: the same results, more bytes to read) or "auto" (packed on CPU when the kernel builds
    and the weights are float32, else unrolled on CPU; scan elsewhere)."""
    from spec_jax.io import load_params, read_meta

    path = Path(path)
    meta = read_meta(path, "target", "create one with `spec-jax fetch smollm2-135m-instruct` "
                     "or `spec-jax convert --hf DIR --out DIR`")
    cfg = ModelConfig.from_dict(meta["config"])
    params = load_params(path / "params")
    if dtype is not None and dtype != cfg.dtype:
        params = jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), params)
        cfg = dataclasses.replace(cfg, dtype=dtype)
    params = arrange_layers(params, cfg, layers)
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Target(cfg=cfg, params=params, tokenizer=tokenizer, path=path)


def arrange_layers(params, cfg: ModelConfig, layers: str = "auto"):
    """Lay the target's parameters out for execution (see `load_target`'s `layers`)."""
    from pallas_kernels import cpu_gemm
    from spec_jax.models.llama import pack_layers, unstack_layers

    if layers not in ("auto", "scan", "unrolled", "packed", "packed_f32"):
        raise SpecJaxError(f"layers must be auto, scan, unrolled, packed or packed_f32, not "
                            f"{layers!r}")
    if layers == "auto":
        if jax.default_backend() != "cpu":
            return params
        layers = "packed" if cfg.dtype == "float32" and cpu_gemm.available() else "unrolled"
    if layers in ("packed", "packed_f32"):
        if not cpu_gemm.available():
            raise SpecJaxError("layers='packed' needs the CPU packed-matmul kernel, which could not "
                               "be built here (it needs g++ and the CPU backend); use 'unrolled'")
        return pack_layers(params, exact=layers == "packed")
    return unstack_layers(params) if layers == "unrolled" else params


def random_target(cfg: ModelConfig, seed: int = 0, scale: float = 0.02) -> Target:
    """A target with random weights and no tokenizer (tests, tiny configs)."""
    from spec_jax.models.llama import init_params

    return Target(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(seed), scale=scale))
