"""A loaded target model: config, parameters and tokenizer, plus the helpers users call."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError
from spec_jax.io import check_finite, damaged, load_params, read_meta


@dataclasses.dataclass(eq=False)
class Target:
    cfg: ModelConfig
    params: Any
    tokenizer: Any = None
    path: Path | None = None
    # Compiled executables keyed by their static settings; owned by this target, not module state.
    compiled: dict = dataclasses.field(default_factory=dict, repr=False)
    mesh: Any = None  # a jax.sharding.Mesh the parameters are placed on (spec_jax.sharding), or None
    # drafters the checkpoint carries (its MTP layers: draft="mtp"), loaded on first use
    own_heads: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.cfg.eos_token_ids)
        tok = self.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        return tuple(sorted(ids))

    def encode(self, prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string (chat template applied when chat=True), a conversation
        (a list of {"role", "content"} messages, which always takes the chat template), or ids as
        given."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return self._encode_chat(list(prompt))
        if not isinstance(prompt, str):
            return self._check_ids(prompt)
        if self.tokenizer is None:
            raise SpecJaxError("this target has no tokenizer: pass token ids instead of a string")
        if chat and getattr(self.tokenizer, "chat_template", None):
            return self._encode_chat([{"role": "user", "content": prompt}])
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise SpecJaxError("the prompt encodes to no tokens: pass a non-empty prompt")
        return ids

    def _check_ids(self, prompt) -> list[int]:
        """A prompt given as token ids: a list or tuple of Python or NumPy integers, or a 1-D
        integer array, each in [0, vocab_size)."""
        kinds = "a string, a list of token ids or a list of chat messages"
        if hasattr(prompt, "dtype") and hasattr(prompt, "ndim"):  # a NumPy or JAX array
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise SpecJaxError(f"a prompt array must be 1-D of integer token ids, not "
                                   f"{prompt.ndim}-D {prompt.dtype}: pass {kinds}")
            prompt = np.asarray(prompt).tolist()
        if not isinstance(prompt, (list, tuple)):
            raise SpecJaxError(f"a prompt must be {kinds}, not a {type(prompt).__name__}")
        bad = next((t for t in prompt if isinstance(t, (bool, np.bool_))
                    or not isinstance(t, (int, np.integer))), False)
        if bad is not False:
            raise SpecJaxError(f"token ids must be integers, not {type(bad).__name__} ({bad!r}): "
                               f"pass {kinds}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise SpecJaxError("empty prompt: pass a non-empty string or list of token ids")
        out = next((t for t in ids if not 0 <= t < self.cfg.vocab_size), None)
        if out is not None:
            raise SpecJaxError(f"token id {out} is out of range: token ids must lie in "
                               f"[0, {self.cfg.vocab_size})")
        return ids

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        """Chat-template ids of `messages`, ready for the assistant's next answer."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise SpecJaxError("a conversation needs the target's tokenizer with a chat template: "
                               "pass a string or token ids instead")
        bad = [m for m in messages if not isinstance(m, dict) or m.get("role") not in
               ("system", "user", "assistant") or not isinstance(m.get("content"), str)]
        if bad:
            raise SpecJaxError(f"bad chat message {bad[0]!r}: write {{'role': 'user' | 'assistant' "
                               "| 'system', 'content': TEXT}")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]

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
        from pallas_kernels.cpu.gemm import PackedWeight

        return "packed" if any(isinstance(w, PackedWeight) for w in layers[0].values()) else "unrolled"

    @property
    def weight_codes(self) -> bool:
        """True when packed layers stream uint8 codes with scales (`gemm.pack_exact`)."""
        return _has_codes(self.params)

    def new_cache(self, batch: int, num_slots: int):
        """An empty KV cache laid out like the parameters: per-layer buffers for unrolled layers."""
        from spec_jax.cache import cache_for

        cache = cache_for(self.cfg, batch, num_slots,
                          per_layer=isinstance(self.params["layers"], (list, tuple)))
        if self.mesh is not None:  # split by row and KV head, as the parameters are by head
            from spec_jax.sharding import shard_cache

            cache = shard_cache(cache, self.cfg, self.mesh)
        return cache

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

    def identity(self) -> dict[str, Any]:
        """What draft heads and datastores record of the target they were made for, and check
        against the target they are used with (`same_target`): family, shapes and the weights'
        fingerprints ("fingerprint": of this dtype's values; "weights": the same for a float32
        and a bfloat16 load of one checkpoint)."""
        c = self.cfg
        return {"family": c.family, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                "num_layers": c.num_layers, "fingerprint": self.fingerprint(),
                "weights": self.fingerprint(any_dtype=True)}

    def fingerprint(self, any_dtype: bool = False) -> str:
        """A short hash of the architecture and a sample of the weights (draft heads check it and
        the sizing cache is keyed by it). any_dtype: of the sample rounded to bfloat16, so a
        float32 and a bfloat16 load of the same checkpoint agree (heads trained on one serve the
        other)."""
        h = hashlib.sha256(json.dumps(
            {k: v for k, v in self.cfg.to_dict().items() if k != "dtype"}, sort_keys=True).encode())
        emb = self.params["embed"]
        if isinstance(emb, jax.Array) and not emb.is_fully_addressable:  # hosts hold parts of it:
            from jax.sharding import NamedSharding, PartitionSpec  # each gets the corner whole

            emb = jax.jit(lambda e: e[:64, :64], out_shardings=NamedSharding(
                emb.sharding.mesh, PartitionSpec()))(emb).addressable_data(0)
        if any_dtype:
            h.update(b"bf16")
            h.update(np.asarray(jnp.asarray(emb[:64, :64]).astype(jnp.bfloat16), np.float32).tobytes())
        else:
            h.update(np.round(np.asarray(jnp.asarray(emb[:64, :64], jnp.float32)), 3).tobytes())
        return h.hexdigest()[:16]


def same_target(mine: dict, theirs: dict) -> list[str]:
    """The identity fields (`Target.identity`) on which a record `mine` (of heads or a datastore)
    and a target's `theirs` differ: the shapes, and the dtype-free weights fingerprint where both
    have one, else the fingerprint of the dtype (records written before "weights" existed)."""
    keys = ["family", "hidden_size", "vocab_size", "num_layers"]
    keys.append("weights" if "weights" in mine and "weights" in theirs else "fingerprint")
    return [k for k in keys if k in mine and mine[k] != theirs[k]]


def load_target(path: str | Path, dtype: str | None = None, layers: str = "auto",
                mesh=None) -> Target:
    """Load a spec_jax target checkpoint (written by `spec-jax convert` or `spec-jax fetch`).

    layers: "scan" (stacked, compile time independent of depth), "unrolled" (per-layer buffers,
    faster decoding on CPU), "packed" (unrolled, float32 matrices in the CPU kernel's panel layout:
    `pallas_kernels.cpu.gemm`; a matrix that is exactly GGUF-dequantized, as SmolLM2's is, as
    uint8 codes and scales that reproduce it bit for bit), "packed_f32" (every matrix as float32
    panels: the same results to float32 rounding, more bytes to read) or "auto" (packed on CPU
    when the kernel builds and the weights are float32, else unrolled on CPU; scan elsewhere). A
    packed layout with codes is cached for the next load (`packed_cached`).

    dtype: None loads float32 checkpoints in bfloat16 on GPUs and TPUs (`serving_dtype`) and as
    stored on CPUs; "float32" or "bfloat16" casts as it loads.

    mesh: a `jax.sharding.Mesh` with axes "data" and/or "model": the parameters are placed on it
    by `spec_jax.sharding.RULES` (stacked layers: "auto" is "scan" there) and `generate` runs the
    same compiled loop partitioned over it. Each device's shard is read from disk directly
    (`_load_sharded`): no host holds a full copy, and on a mesh spanning several hosts
    (`spec_jax.distributed`) each host reads only its own devices' shards."""
    path = Path(path)
    layers = _mesh_layers(mesh, layers)
    meta = read_meta(path, "target", "create one with `spec-jax fetch smollm2-135m-instruct` "
                     "or `spec-jax convert --hf DIR --out DIR`")
    cfg = config_from_meta(path, meta["config"])
    dtype = dtype or serving_dtype(cfg, mesh)
    convert = dtype is not None and dtype != cfg.dtype
    if convert:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if mesh is not None:
        params = _load_sharded(path, cfg, mesh, dtype if convert else None)
        return Target(cfg=cfg, params=params, tokenizer=load_tokenizer(path), path=path, mesh=mesh)
    layout = resolve_layers(cfg, layers)
    cached = _packed_cache_read(path) if layout == "packed" and not convert else None
    # on a packed-cache hit the float32 matrices it holds as codes are not read at all
    params = load_params(path / "params", skip=cached and _packed_cache_covers(cached))
    check_shapes(path, cfg, params)
    check_finite(params, f"the target at {path}")
    if convert:
        params = jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), params)
    if cached is not None:
        params = _from_arrays(params, cached)
    elif layout == "packed":
        params = packed_cached(path, params, cfg)
    else:
        params = arrange_layers(params, cfg, layers)
    return Target(cfg=cfg, params=params, tokenizer=load_tokenizer(path), path=path, mesh=mesh)


ACCELERATORS = ("gpu", "tpu")


def serving_dtype(cfg: ModelConfig, mesh=None) -> str | None:
    """The dtype a target loads in when `load_target` is given none: bfloat16 for a float32
    checkpoint on a GPU or TPU (what models are served in there: half the bytes a step reads,
    the matrix units' native type), else the checkpoint's own (None). float32 stays the CPU's
    default, where the packed kernels read it exactly and the tests compare bit for bit; pass
    dtype="float32" to keep it on an accelerator."""
    device = mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
    return "bfloat16" if cfg.dtype == "float32" and device.platform in ACCELERATORS else None


def _load_sharded(path: Path, cfg: ModelConfig, mesh, dtype: str | None):
    """The target's parameters placed on `mesh` by `spec_jax.sharding.RULES`, each device's shard
    restored from disk by Orbax (cast to `dtype`, where given, shard by shard as it is read) in
    the stacked layout the checkpoint holds ("scan"). The shapes are checked against the config
    from the checkpoint's metadata before any array is read; finiteness shard by shard."""
    from spec_jax.io import param_shapes
    from spec_jax.sharding import abstract_params

    shapes = param_shapes(path / "params")
    check_shapes(path, cfg, shapes)
    params = load_params(path / "params", target=abstract_params(shapes, cfg, mesh, dtype))
    check_finite(params, f"the target at {path}")
    return params


def _mesh_layers(mesh, layers: str) -> str:
    """The layer layout on `mesh`: stacked ("scan"); the packed CPU kernels run on one device."""
    if mesh is None:
        return layers
    from spec_jax.sharding import check_mesh

    check_mesh(mesh)
    if layers not in ("auto", "scan"):
        raise SpecJaxError(f"layers={layers!r} runs on one device: on a mesh, layers are stacked "
                           "(layers='scan' or 'auto')")
    return "scan"


def config_from_meta(path: Path, d) -> ModelConfig:
    """The ModelConfig that a target's spec_jax.json records, or a one-line "damaged" error
    naming the missing, unknown or ill-typed field."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    if not isinstance(d, dict):
        raise damaged(path, "spec_jax.json's 'config' is not an object")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in d]
    unknown = sorted(set(d) - set(fields))
    if missing or unknown:
        what = "; ".join(x for x in (missing and f"lacks {', '.join(missing)}",
                                     unknown and f"has unknown {', '.join(unknown)}") if x)
        raise damaged(path, f"spec_jax.json's config {what}")
    for n in required:
        v = d[n]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise damaged(path, f"spec_jax.json's config has {n}={v!r}, not a positive integer")
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise damaged(path, f"spec_jax.json's config cannot be read ({e})") from None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The shape of every stacked parameter that `cfg` implies ("/"-joined paths)."""
    from spec_jax.models.llama import init_params

    tree = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    return {jax.tree_util.keystr(k, simple=True, separator="/"): tuple(a.shape)
            for k, a in jax.tree_util.tree_leaves_with_path(tree)}


def check_shapes(path: Path, cfg: ModelConfig, params) -> None:
    """Refuse a checkpoint whose spec_jax.json disagrees with its weights' shapes, naming the
    field (before anything compiles). Arrays absent from `params` (read from the packed cache
    instead) are not checked."""
    have = {jax.tree_util.keystr(k, simple=True, separator="/"): tuple(a.shape)
            for k, a in jax.tree_util.tree_leaves_with_path(params)}
    want = expected_shapes(cfg)
    c = cfg
    # (field(s), the value spec_jax.json gives, tensor, axis): the first that disagrees is named
    named = [("vocab_size", c.vocab_size, "embed", 0), ("hidden_size", c.hidden_size, "embed", 1),
             ("num_layers", c.num_layers, "layers/wq", 0),
             ("intermediate_size", c.intermediate_size, "layers/w_gate", 2),
             ("num_heads*head_dim", c.num_heads * c.head_dim, "layers/wq", 2),
             ("num_kv_heads*head_dim", c.num_kv_heads * c.head_dim, "layers/wk", 2)]
    for field, value, name, axis in named:
        shape = have.get(name)
        if shape is not None and (len(shape) <= axis or shape[axis] != value):
            raise SpecJaxError(
                f"checkpoint {path}: spec_jax.json's {field}={value} disagrees with the weights: "
                f"{name} should have shape {want[name]}, has {shape}; re-run `spec-jax convert`")
    for name in sorted(set(have) | set(want)):
        if name in have and have[name] != want.get(name):
            what = ("is not a parameter of this config (tie_word_embeddings, attention_bias?)"
                    if name not in want else f"should have shape {want[name]}")
            raise SpecJaxError(f"checkpoint {path}: spec_jax.json disagrees with the weights: "
                               f"{name} {what}, has {have[name]}; re-run `spec-jax convert`")


def load_tokenizer(path: Path):
    """The checkpoint's Hugging Face tokenizer, or None where it has none. A tokenizer whose
    class is the generic fast one (SmolLM2's) is built as that class directly: AutoTokenizer
    builds the same object but first imports the model configurations, and with them PyTorch
    where it is installed (2.6 against 0.8 s here)."""
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls == "PreTrainedTokenizerFast" and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def resolve_layers(cfg: ModelConfig, layers: str = "auto") -> str:
    """The layout `layers` ("auto" included) stands for here: scan, unrolled, packed or
    packed_f32."""
    import pallas_kernels.cpu.gemm as cpu_gemm

    if layers not in ("auto", "scan", "unrolled", "packed", "packed_f32"):
        raise SpecJaxError(f"layers must be auto, scan, unrolled, packed or packed_f32, not "
                            f"{layers!r}")
    if layers != "auto":
        return layers
    if jax.default_backend() != "cpu":
        return "scan"
    return "packed" if cfg.dtype == "float32" and cpu_gemm.available() else "unrolled"


def arrange_layers(params, cfg: ModelConfig, layers: str = "auto"):
    """Lay the target's parameters out for execution (see `load_target`'s `layers`)."""
    import pallas_kernels.cpu.gemm as cpu_gemm
    from spec_jax.models.llama import pack_layers, unstack_layers

    layers = resolve_layers(cfg, layers)
    if layers == "scan":
        return params
    if layers in ("packed", "packed_f32"):
        if not cpu_gemm.available():
            raise SpecJaxError("layers='packed' needs the CPU packed-matmul kernel, which could not "
                               "be built here (it needs g++ and the CPU backend); use 'unrolled'")
        return pack_layers(params, exact=layers == "packed")
    return unstack_layers(params) if layers == "unrolled" else params


def _has_codes(params) -> bool:
    """True when `params`' layers are packed and the first holds code panels with scales."""
    layers = params["layers"]
    return (isinstance(layers, (list, tuple))
            and any(getattr(w, "scales", None) is not None for w in layers[0].values()))


PACKED_CACHE_VERSION = 1


def _packed_cache_key(path: Path) -> str:
    """What a target's packed layout depends on: its weight files (path, size, mtime), the packing
    code (the sources of cpu/gemm.py and llama.py) and the kernel's panel width."""
    import pallas_kernels.cpu.gemm as cpu_gemm
    import spec_jax.models.llama as llama

    files = sorted((str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in (path / "params").rglob("*") if f.is_file())
    h = hashlib.sha256(json.dumps([PACKED_CACHE_VERSION, str(path.resolve()), files,
                                   cpu_gemm.panel_width()]).encode())
    for mod in (cpu_gemm, llama):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def packed_cached(path: Path, params, cfg: ModelConfig):
    """`arrange_layers(params, cfg, "packed")`, written to a cache beside the other compiled things
    ($SPEC_JAX_CACHE/packed/, one file per checkpoint folder) that `load_target` reads back
    (`_packed_cache_read`, before it loads the parameters) while the checkpoint, the packing code
    and the kernel build are the ones it was written for. Only targets with exact weight codes
    are cached (finding the codes is most of a load: 3.7 of 7.4 s for SmolLM2; their file is 98 MB
    against 540 MB of float32 panels)."""
    from pallas_kernels.cpu.gemm import PackedWeight, available

    if not available():
        return arrange_layers(params, cfg, "packed")  # says why it cannot
    path = Path(path)
    key, file = _packed_cache_key(path), _packed_cache_file(path)
    packed = arrange_layers(params, cfg, "packed")
    if not _has_codes(packed):
        return packed
    arrays = {"key": np.asarray(key)}
    named = [(f"layers/{i}/{name}", w) for i, lp in enumerate(packed["layers"])
             for name, w in lp.items()] + [("lm_head", packed.get("lm_head"))]
    for prefix, w in named:
        if isinstance(w, PackedWeight):
            arrays[prefix + "/panels"] = np.asarray(w.panels)
            if w.scales is not None:
                arrays[prefix + "/scales"] = np.asarray(w.scales)
    tmp = file.with_suffix(f".tmp{os.getpid()}.npz")  # atomic: a reader never sees half a file
    _drop_orphans(file)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, **arrays)
        tmp.replace(file)
    except OSError:
        pass  # a full or read-only cache only costs the next load its packing time
    finally:
        tmp.unlink(missing_ok=True)
    return packed


def _drop_orphans(file: Path) -> None:
    """Remove the temporaries of writes of `file` whose process died midway (`NAME.tmpPID.npz`)."""
    for tmp in file.parent.glob(file.stem + ".tmp*.npz"):
        pid = tmp.name[len(file.stem) + 4:-4]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:  # alive, another user's
            pass


def _packed_cache_file(path: Path) -> Path:
    from spec_jax.paths import cache_dir

    return cache_dir() / "packed" / (hashlib.sha256(str(Path(path).resolve()).encode())
                                     .hexdigest()[:16] + ".npz")


def _packed_cache_read(path: Path) -> dict | None:
    """The arrays `packed_cached` stored for this checkpoint, where they are still its current
    packing (same files, packing code and kernel build), else None."""
    from pallas_kernels.cpu.gemm import available

    file = _packed_cache_file(path)
    if not (available() and file.is_file()):
        return None
    try:
        with np.load(file) as z:
            if str(z["key"]) == _packed_cache_key(Path(path)):
                return {k: z[k] for k in z.files if k != "key"}
    except Exception:  # noqa: BLE001 — unreadable (or from another layout): packed afresh
        pass
    return None


def _packed_cache_covers(arrays: dict) -> set:
    """Parameter paths ("layers/wq", "lm_head") that the cached arrays replace in every layer."""
    from spec_jax.models.llama import FUSED_KEYS

    per_layer: dict[str, set] = {}
    for k in arrays:
        if k.startswith("layers/") and k.endswith("/panels"):
            _, i, name, _ = k.split("/")
            per_layer.setdefault(i, set()).update(FUSED_KEYS.get(name, (name,)))
    covered = set.intersection(*per_layer.values()) if per_layer else set()
    return {f"layers/{k}" for k in covered} | ({"lm_head"} if "lm_head/panels" in arrays else set())


def _from_arrays(params, arrays: dict):
    """The packed params that `packed_cached` wrote as arrays, around the loaded (stacked)
    `params`: embedding and norms come from them, packed matrices from the arrays."""
    from pallas_kernels.cpu.gemm import PackedWeight
    from spec_jax.models.llama import FUSED_KEYS

    def weight(prefix):
        s = arrays.get(prefix + "/scales")
        return PackedWeight(jnp.asarray(arrays[prefix + "/panels"]),
                            None if s is None else jnp.asarray(s))

    stacked = params["layers"]
    names: dict[int, list[str]] = {}
    for k in arrays:
        if k.startswith("layers/") and k.endswith("/panels"):
            _, i, name, _ = k.split("/")
            names.setdefault(int(i), []).append(name)
    out_layers = []
    for i in range(next(iter(stacked.values())).shape[0]):
        covered = {c for name in names.get(i, ()) for c in FUSED_KEYS.get(name, (name,))}
        lp = {k: v[i] for k, v in stacked.items() if k not in covered}
        lp.update({name: weight(f"layers/{i}/{name}") for name in names.get(i, ())})
        out_layers.append(lp)
    out = {k: v for k, v in params.items() if k != "layers"}
    out["layers"] = out_layers
    if "lm_head/panels" in arrays:
        out["lm_head"] = weight("lm_head")
    return out


def random_target(cfg: ModelConfig, seed: int = 0, scale: float = 0.02, mesh=None) -> Target:
    """A target with random weights and no tokenizer (tests, tiny configs), placed on `mesh` by
    `spec_jax.sharding.RULES` when one is given."""
    from spec_jax.models.llama import init_params

    params = init_params(cfg, jax.random.PRNGKey(seed), scale=scale)
    if mesh is not None:
        from spec_jax.sharding import check_mesh, shard_params

        check_mesh(mesh)
        params = shard_params(params, cfg, mesh)
    return Target(cfg=cfg, params=params, mesh=mesh)
