"""Hugging Face directory (config.json + *.safetensors + tokenizer files) -> Orbax checkpoint.

No PyTorch needed. The output directory holds `params/` (Orbax), `spec_jax.json` (our config),
the original `config.json`, the tokenizer files and, for a target that ships MTP layers (MiMo's
`model.mtp_layers.*`, DeepSeek-V3's `model.layers.{L+i}.*`), `mtp/`: those layers as heads
(`spec_jax.convert.heads_io`), what `draft="mtp"` runs. Writing is atomic: everything goes to a
temporary sibling folder that is renamed at the end.

The conversion streams: tensors are read from the safetensors files block by block (rows of one
tensor, at most BLOCK_BYTES, read with plain file reads: no memory map) and written straight into
their place in the stacked arrays on disk (`write_params`), so the memory it needs does not grow
with the model. The result is an Orbax checkpoint (OCDBT) as `spec_jax.io.save_params` writes,
read by `spec_jax.io.load_params` as before.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from spec_jax.config import ModelConfig
from spec_jax.errors import SpecJaxError
from spec_jax.io import atomic_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")
BLOCK_BYTES = 16 << 20  # the most bytes of one tensor in memory at a time (and a zarr chunk)
# stacked layer parameter -> (HF name after "model.layers.{i}.", transposed to [in, out])
LAYER_SOURCES = {
    "attn_norm": ("input_layernorm.weight", False), "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True), "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True), "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True)}
BIAS_SOURCES = {"bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
                "bv": ("self_attn.v_proj.bias", False)}
QK_NORM_SOURCES = {"q_norm": ("self_attn.q_norm.weight", False),
                   "k_norm": ("self_attn.k_norm.weight", False)}


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


def mtp_layers(conf: dict, names, num_layers: int) -> tuple[str, int]:
    """The MTP layers a target checkpoint ships beside its decoder: ("mimo", n) for
    `model.mtp_layers.{i}.*`, ("deepseek", n) for `model.layers.{L+i}.*` (up to
    num_nextn_predict_layers, each with an eh_proj), else ("", 0)."""
    mimo = {k.split(".")[2] for k in names if k.startswith("model.mtp_layers.")}
    if mimo:
        return "mimo", len(mimo)
    n = 0
    while n < int(conf.get("num_nextn_predict_layers") or 0) and \
            f"model.layers.{num_layers + n}.eh_proj.weight" in names:
        n += 1
    return ("deepseek", n) if n else ("", 0)


def check_tensors(shapes: dict[str, tuple], cfg: ModelConfig, hf_dir: Path,
                  extra_layers: int = 0) -> None:
    """Refuse, before anything is written, a checkpoint whose tensors (name -> shape) are not
    exactly the ones its config.json implies: each present, of the implied shape, and no decoder
    layers beyond num_hidden_layers (but `extra_layers` MTP layers). Finiteness is checked as the
    tensors are read (`write_params`)."""
    import re

    if "model.embed_tokens.weight" not in shapes or "model.norm.weight" not in shapes:
        raise SpecJaxError(f"{hf_dir} lacks model.embed_tokens.weight or model.norm.weight: is "
                           "this a Llama-family causal LM?")
    layers = {int(m.group(1)) for k in shapes if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if layers and max(layers) + 1 != cfg.num_layers + extra_layers:
        raise SpecJaxError(f"{hf_dir}/config.json says num_hidden_layers={cfg.num_layers} but the "
                           f"tensors hold {max(layers) + 1} layers: fix config.json or the files")
    for name, (shape, fields) in expected_tensors(cfg).items():
        if name not in shapes:
            raise SpecJaxError(f"{hf_dir} lacks tensor {name} that config.json implies: the "
                               "download is incomplete or config.json belongs to another model")
        have = tuple(shapes[name])
        if have != shape:
            raise SpecJaxError(f"{hf_dir}/config.json disagrees with the tensors: {name} should "
                               f"have shape {shape} (from {fields}), has {have}")


def param_sources(cfg: ModelConfig) -> dict[tuple, tuple[list[str], bool]]:
    """Each parameter of our stacked layout (its key path) -> (the HF tensors it is made of, one
    per layer for stacked ones; whether each is transposed to [in, out])."""
    layer = dict(LAYER_SOURCES)
    if cfg.attention_bias:
        layer.update(BIAS_SOURCES)
    if cfg.family == "qwen3":
        layer.update(QK_NORM_SOURCES)
    out = {("embed",): (["model.embed_tokens.weight"], False),
           ("final_norm",): (["model.norm.weight"], False)}
    for key, (name, transpose) in layer.items():
        out[("layers", key)] = ([f"model.layers.{i}.{name}" for i in range(cfg.num_layers)],
                                transpose)
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = (["lm_head.weight"], True)
    return out


def params_from_hf(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Map HF Llama-family tensor names to our stacked layout (linear weights transposed to
    [in, out]), in memory: what `write_params` writes to disk block by block."""
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in state]
    if missing:
        raise SpecJaxError(f"checkpoint lacks {missing}: is this a Llama-family causal LM?")
    if not cfg.tie_word_embeddings and "lm_head.weight" not in state:
        raise SpecJaxError("config says tie_word_embeddings=false but lm_head.weight is missing")
    params: dict = {"layers": {}}
    for path, (names, transpose) in param_sources(cfg).items():
        arrs = [np.asarray(state[n], np.float32) for n in names]
        arrs = [a.T.copy() if transpose else a for a in arrs]
        a = np.stack(arrs) if path[0] == "layers" else arrs[0]
        (params["layers"] if path[0] == "layers" else params)[path[-1]] = a
    return params


def open_checkpoint(hf_dir: Path):
    """The safetensors tensors of `hf_dir` (headers read, data not; with an index, of the files
    it names), or a one-line error."""
    from spec_jax.convert.heads_io import Tensors

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise SpecJaxError(f"no *.safetensors files in {hf_dir}: save the model with "
                           "safe_serialization=True (PyTorch .bin files are not read)")
    try:
        index = hf_dir / "model.safetensors.index.json"  # where present, only the files it names
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
            if index.is_file() else []
        src = Tensors(hf_dir, prefer=tuple(files))
        bad = src.truncated()
    except (SpecJaxError, OSError, ValueError, KeyError, TypeError) as e:
        raise SpecJaxError(f"{hf_dir} holds a safetensors file that cannot be read "
                           f"({' '.join(str(e).split())[:200]}): download it again") from None
    if bad is not None:
        raise SpecJaxError(f"{bad} cannot be read (its data ends early): the file is truncated or "
                           "damaged; download it again")
    return src


def write_params(path: Path, src, cfg: ModelConfig, dtype: str,
                 block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """Write the target's parameters from `src` (heads_io.Tensors) to `path` as an Orbax
    checkpoint, a block of rows of one tensor at a time: each block is read, checked finite,
    cast (via float32, as `save_params` casts), transposed where the layout says and written
    into its place in the (stacked) array on disk. Orbax first saves the tree with one-element
    stand-ins (its metadata, an OCDBT database, as `save_params` writes); each array is then
    replaced in that database by the full one, written through tensorstore one block (one zarr
    chunk) per commit. Returns the embedding's first 64x64 entries (as written: what
    `Target.fingerprint` reads)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import tensorstore as ts

    dt = np.dtype(jnp.dtype(dtype))
    zdtype = "bfloat16" if dt.name == "bfloat16" else dt.str  # zarr v2's names
    path = Path(path).absolute()
    sources = param_sources(cfg)
    shapes = {}
    for key, (names, transpose) in sources.items():
        shape = tuple(src.shape(names[0]))
        shape = shape[::-1] if transpose else shape
        shapes[key] = (len(names), *shape) if key[0] == "layers" else shape
    tree: dict = {"layers": {}}
    for key, shape in shapes.items():
        (tree["layers"] if key[0] == "layers" else tree)[key[-1]] = np.zeros((1,) * len(shape), dt)
    with ocp.StandardCheckpointer() as ckptr:  # as `save_params` saves
        ckptr.save(path, tree)
    ctx = ts.Context()
    corner = None
    for key, (names, transpose) in sources.items():
        shape, stacked = shapes[key], key[0] == "layers"
        inner = shape[1:] if stacked else shape
        row_bytes = int(np.prod(inner[1:] if not transpose else inner[:1], dtype=np.int64)) \
            * max(dt.itemsize, 4)
        rows = inner[-1] if transpose else inner[0]  # of each source tensor
        step = rows if len(inner) == 1 else max(1, min(rows, block_bytes // row_bytes))
        chunk = (inner[0], step) if transpose else (step, *inner[1:])
        arr = ts.open({"driver": "zarr", "kvstore": _kvstore(path, ".".join(key)),
                       "metadata": {"shape": list(shape), "dtype": zdtype, "chunks":
                                    ([1] if stacked else []) + list(chunk),
                                    "compressor": {"id": "zstd", "level": 1}}},  # as Orbax's
                      create=True, delete_existing=True, context=ctx).result()
        for i, name in enumerate(names):
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                blk = np.asarray(src.rows(name, r0, r1), np.float32)
                if not np.isfinite(blk).all():
                    raise SpecJaxError(f"{src.path}: tensor {name} holds NaN or infinity: the "
                                       "checkpoint is corrupt")
                blk = blk.astype(dt)
                where = (slice(None), slice(r0, r1)) if transpose else (slice(r0, r1),)
                arr[(i, *where) if stacked else where].write(blk.T if transpose else blk).result()
                if key == ("embed",) and r0 == 0:
                    corner = blk[:64, :64].copy()
    return corner


def _kvstore(params_dir: Path, name: str) -> dict:
    """Where Orbax keeps the array `name` ("layers.wq") of the OCDBT checkpoint at `params_dir`."""
    return {"driver": "ocdbt", "base": {"driver": "file", "path": f"{params_dir}/"},
            "path": name}


def write_mtp(out: Path, hf_dir: Path, src, cfg: ModelConfig, params_dir: Path,
              corner: np.ndarray) -> None:
    """The MTP layers of the checkpoint as heads for the converted target, saved to `out`
    (`heads_io.import_heads("mtp", ...)`, which checks every tensor first)."""
    import tensorstore as ts

    from spec_jax.convert.heads_io import import_heads
    from spec_jax.heads.registry import save_draft
    from spec_jax.target import Target

    params = {"embed": corner}  # all that the target's fingerprint reads
    if any(n.endswith(".shared_head.head.weight") for n in src.names()):  # compared to our head
        name = "embed" if cfg.tie_word_embeddings else "lm_head"
        w = ts.open({"driver": "zarr", "kvstore": _kvstore(params_dir, name)}).result()
        params[name] = w.read().result()
    try:
        heads = import_heads("mtp", hf_dir, Target(cfg=cfg, params=params))
    except SpecJaxError as e:
        raise SpecJaxError(f"{e}; convert with --no-mtp to leave the MTP layers out") from None
    save_draft(heads, out)


def convert_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str = "float32",
               force: bool = False, mtp: bool = True) -> Path:
    """Convert an HF checkpoint directory to a spec_jax (Orbax) checkpoint directory, streaming
    (see the module's doc). MTP layers the checkpoint ships are written as heads to `OUT/mtp/`
    (`draft="mtp"`), unless `mtp` is False."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if dtype not in ("float32", "bfloat16"):
        raise SpecJaxError(f"unsupported dtype {dtype!r}: use float32 or bfloat16")
    if not (hf_dir / "config.json").is_file():
        raise SpecJaxError(f"{hf_dir} has no config.json: pass a Hugging Face model directory")
    try:
        conf = json.loads((hf_dir / "config.json").read_text())
        cfg = ModelConfig.from_hf_dict(conf, dtype=dtype)
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecJaxError(f"{hf_dir}/config.json is not valid JSON ({e})") from None
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise SpecJaxError(f"{hf_dir}/config.json lacks or mistypes a field the model needs "
                           f"({type(e).__name__}: {e})") from None
    src = open_checkpoint(hf_dir)
    names = src.names()
    kind, n_mtp = mtp_layers(conf, names, cfg.num_layers)
    check_tensors({n: src.shape(n) for n in names}, cfg, hf_dir,
                  n_mtp if kind == "deepseek" else 0)
    with atomic_dir(out_dir, force=force) as tmp:
        corner = write_params(tmp / "params", src, cfg, dtype, BLOCK_BYTES)
        if mtp and n_mtp:
            write_mtp(tmp / "mtp", hf_dir, src, cfg, tmp / "params", corner)
        (tmp / "spec_jax.json").write_text(json.dumps({"kind": "target", "config": cfg.to_dict()},
                                                      indent=2))
        shutil.copy(hf_dir / "config.json", tmp / "config.json")
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy(hf_dir / name, tmp / name)
    return out_dir
