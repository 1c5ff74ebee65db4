"""Model configuration: one frozen dataclass built from a Hugging Face `config.json`."""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

from spec_jax.errors import SpecJaxError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # Qwen2's layout + a per-head RMSNorm of q and k (q_norm, k_norm)
    "MiMoForCausalLM": "qwen2",  # Qwen2's decoder; its MTP layers (model.mtp_layers.*) as heads
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Hashable, so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # rope_scaling as a sorted tuple of (key, value) pairs so the config stays hashable.
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    family: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def eagle3_layers(self) -> tuple[int, int, int]:
        """Layers whose *input* hidden states EAGLE-3 fuses (low, mid, high)."""
        n = self.num_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecJaxError(
                f"unsupported architecture {arch!r}: spec_jax supports "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}; convert a checkpoint of one of these"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        moe = [k for k in MOE_FIELDS if d.get(k)]
        if moe:
            raise SpecJaxError(f"unsupported config field {moe[0]}={d[moe[0]]!r} (a mixture of "
                               "experts): spec_jax's targets have dense MLPs")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older ones `rope_scaling`.
        rp = dict(d.get("rope_parameters") or {})
        rope_theta = rp.pop("rope_theta", d.get("rope_theta", 10000.0))
        rs = d.get("rope_scaling") or rp or None
        if rs and rs.get("rope_type", rs.get("type")) == "default":
            rs = None
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise SpecJaxError(
                    f"unsupported rope_scaling type {kind!r}: supported are llama3, linear, default")
            rs = tuple(sorted((k, v) for k, v in rs.items() if not isinstance(v, (list, dict))))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if family in ("qwen2", "qwen3") else 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rs or None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", family == "qwen2")),
            max_position_embeddings=_positions(d, family),
            family=family,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
        )

    @classmethod
    def from_json(cls, path: str | Path, dtype: str = "float32") -> "ModelConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()), dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = self.rope_scaling_dict
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        rs = d.get("rope_scaling")
        d["rope_scaling"] = tuple(sorted(rs.items())) if rs else None
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)


MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def _positions(d: dict[str, Any], family: str) -> int:
    """The positions a converted target takes: the config's, or, where a sliding window applies
    (Mistral's `sliding_window`, Qwen's with `use_sliding_window`), the window if it is shorter.
    spec_jax attends to every earlier position, which equals windowed attention only up to the
    window; past it the outputs would differ, so the target stops there (with a warning)."""
    positions = d.get("max_position_embeddings", 2048)
    window = d.get("sliding_window")
    if family in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    if window and window < positions:
        warnings.warn(f"the config's sliding_window={window} is shorter than its "
                      f"max_position_embeddings={positions}: spec_jax attends to every position, "
                      f"which equals windowed attention only within the window, so the converted "
                      f"target takes at most {window} positions", stacklevel=3)
        return int(window)
    return positions
