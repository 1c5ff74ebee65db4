"""Llama-family decoder as pure functions over a parameter pytree (nanoGPT-style, one file).

Parameters (L layers stacked on axis 0, so the layer loop is a `lax.scan` and compile time does not
grow with depth; `unstack_layers` turns them into a list for unrolled execution, faster on CPU):
  embed [V, H]; final_norm [H]; lm_head [H, V] (absent when embeddings are tied);
  layers: attn_norm [L, H], wq [L, H, NH*D], wk/wv [L, H, KVH*D], wo [L, NH*D, H],
          (bq [L, NH*D], bk/bv [L, KVH*D] when attention_bias), (q_norm, k_norm [L, D]: Qwen3's
          per-head RMSNorm of q and k before RoPE, family "qwen3"), mlp_norm [L, H],
          w_gate/w_up [L, H, I], w_down [L, I, H].
`pack_layers` (CPU) makes them a list of per-layer dicts of packed matrices, with wqkv [H, (NH +
2 KVH) * D] and w_gate_up [H, 2I] in place of the matrices they join.

One `forward` serves prefill, single-token decode and tree verification: the T block tokens attend
to the committed cache plus each other under `block_mask`, and their K/V come back separately so the
caller commits only what it keeps (see `spec_jax.cache.commit`).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tree_attention
from pallas_kernels.cpu import gemm
from spec_jax.cache import KVCache
from spec_jax.config import ModelConfig
from spec_jax.models.layers import PackedWeight, dot_f32, matmul, rms_norm, rotate_half


class ForwardOut(NamedTuple):
    logits: jax.Array | None  # [B, T, V] float32 (None when not requested)
    hidden: jax.Array  # [B, T, H] final hidden state, before the final norm
    aux_hidden: jax.Array | None  # [B, T, n_aux * H] inputs of the requested layers, concatenated
    k_new: jax.Array  # [L, B, T, KVH, D]
    v_new: jax.Array  # [L, B, T, KVH, D]


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse RoPE frequencies [D/2], with Llama-3 or linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling_dict
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_l = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(is_medium, smoothed, inv_l)
    return inv


ROPE_TABLE_MAX = 32768  # positions up to this are rotated from a constant table


def _inv_freq_np(cfg: ModelConfig) -> np.ndarray:
    """`rope_inv_freq` as a host constant [D/2], also when called while tracing."""
    with jax.ensure_compile_time_eval():
        return np.asarray(rope_inv_freq(cfg), np.float32)


@functools.lru_cache(maxsize=8)
def _rope_np_table(cfg: ModelConfig) -> np.ndarray:
    """[max_position_embeddings, D] float32: cos then sin of every position x frequency. Built once
    per config, and the same array every call, so a graph that rotates at several places (every
    draft depth) holds one constant instead of a copy per call."""
    ang = np.arange(cfg.max_position_embeddings, dtype=np.float32)[:, None] * _inv_freq_np(cfg)
    table = np.concatenate([np.cos(ang), np.sin(ang)], axis=-1)
    table.setflags(write=False)
    return table


class Rope(NamedTuple):
    """A forward's RoPE angles: cos, sin [B, T, 1, D/2] (`apply_rope`) and cs [B, T, D], the two
    side by side (what the packed CPU kernel's epilogue reads, `layers.matmul`'s rope)."""
    cos: jax.Array
    sin: jax.Array
    cs: jax.Array


def rope_table(positions, cfg: ModelConfig) -> Rope:
    """positions [B, T] -> `Rope` (cos, sin [B, T, 1, D/2] float32; cs), made once per forward.

    Read from a constant table of every position the model has: computed in-graph, cos and sin
    were fused into each layer's rotation and evaluated once per rotated element (heads x both
    halves x layers) by XLA:CPU, 1.5 ms of a 26 ms 8-token verification of SmolLM2. Models with
    more than ROPE_TABLE_MAX positions compute them in-graph."""
    half = cfg.head_dim // 2
    if cfg.max_position_embeddings > ROPE_TABLE_MAX:
        ang = positions.astype(jnp.float32)[..., None] * _inv_freq_np(cfg)  # [B, T, D/2]
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        return Rope(cos[:, :, None, :], sin[:, :, None, :], jnp.concatenate([cos, sin], -1))
    cs = jnp.take(_rope_np_table(cfg), positions, axis=0, mode="clip")  # [B, T, D]
    return Rope(cs[:, :, None, :half], cs[:, :, None, half:], cs)


def apply_rope(x, rope):
    """x [B, T, N, D] rotated by `rope_table`'s (cos, sin) (Hugging Face's rotate-half layout)."""
    return rotate_half(x, rope[0], rope[1])


def init_params(cfg: ModelConfig, key, scale: float = 0.02):
    """Random parameters (tests and tiny configs)."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dt = jnp.dtype(cfg.dtype)
    ks = iter(jax.random.split(key, 16))
    nrm = lambda shape: (scale * jax.random.normal(next(ks), shape)).astype(dt)
    layers = {
        "attn_norm": (1.0 + 0.1 * jax.random.normal(next(ks), (L, H))).astype(dt),
        "wq": nrm((L, H, nq)), "wk": nrm((L, H, nkv)), "wv": nrm((L, H, nkv)), "wo": nrm((L, nq, H)),
        "mlp_norm": (1.0 + 0.1 * jax.random.normal(next(ks), (L, H))).astype(dt),
        "w_gate": nrm((L, H, I)), "w_up": nrm((L, H, I)), "w_down": nrm((L, I, H)),
    }
    if cfg.attention_bias:
        layers.update(bq=nrm((L, nq)), bk=nrm((L, nkv)), bv=nrm((L, nkv)))
    if cfg.family == "qwen3":  # its own key: other families' random weights stay as they were
        kq, kk = jax.random.split(jax.random.fold_in(key, 3))
        layers.update(q_norm=(1.0 + 0.1 * jax.random.normal(kq, (L, cfg.head_dim))).astype(dt),
                      k_norm=(1.0 + 0.1 * jax.random.normal(kk, (L, cfg.head_dim))).astype(dt))
    params = {"embed": nrm((V, H)), "final_norm": jnp.ones((H,), dt), "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = nrm((H, V))
    return params


def lm_head_weight(params):
    """The LM head [H, V]: `lm_head` (separate, or a packed copy of a tied one), else embed.T."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def lm_head(params, cfg: ModelConfig, hidden):
    """Final norm + LM head: hidden [..., H] -> float32 logits [..., V]."""
    w = lm_head_weight(params)
    if isinstance(w, PackedWeight):  # the norm inside the kernel call
        return matmul(hidden.astype(jnp.float32), w, norm=(params["final_norm"], cfg.rms_norm_eps))
    return dot_f32(rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps), w)


def embed(params, tokens):
    return jnp.take(params["embed"], tokens, axis=0)


def decoder_layer(lp, cfg: ModelConfig, x, rope, attend, input_norm=True, rows=None):
    """One pre-norm Llama block. `rope` is `rope_table(positions, ...)`; `attend(q, k, v)` does the
    attention over [cache +] block.

    Returns (x_out, k, v) with k, v [B, T, KVH, D] after RoPE (what a cache stores).
    `input_norm=False` skips the attention-input RMSNorm (EAGLE's draft layer 0). `rows` [B]:
    only each row's first rows[b] tokens are real (a padded prompt); the packed CPU kernel's
    products skip the others (see `layers.matmul`)."""
    b, t, _ = x.shape
    d = cfg.head_dim
    eps = cfg.rms_norm_eps
    mm = functools.partial(matmul, rows=rows)
    # The norms, the SwiGLU, RoPE and the residual adds go into the products (`matmul`'s norm,
    # glu, rope, residual): the packed CPU kernel applies them to each row itself; elsewhere they
    # are the same JAX ops as ever.
    norm = (lp["attn_norm"], eps) if input_norm else None
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    packed = isinstance(lp.get("wqkv", lp.get("wq")), PackedWeight)
    in_kernel = (packed and "bq" not in lp and "q_norm" not in lp  # q, k rotated in the call
                 and isinstance(rope, Rope))
    rot = (lambda cols: (rope.cs, cols)) if in_kernel else (lambda cols: None)  # noqa: E731
    if "wqkv" in lp:  # side by side (`pack_layers`): one kernel call
        qkv = mm(x, lp["wqkv"], norm=norm, rope=rot(nq + nkv))
        q, k, v = jnp.split(qkv, [nq, nq + nkv], axis=-1)
    else:
        q = mm(x, lp["wq"], norm=norm, rope=rot(nq))
        k = mm(x, lp["wk"], norm=norm, rope=rot(nkv))
        v = mm(x, lp["wv"], norm=norm)
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k, v = (a.reshape(b, t, -1, d) for a in (q, k, v))
    if "q_norm" in lp:  # Qwen3: each head's q and k RMS-normalised before RoPE
        q, k = rms_norm(q, lp["q_norm"], eps), rms_norm(k, lp["k_norm"], eps)
    if not in_kernel:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    a = attend(q, k, v).reshape(b, t, nq)
    x = mm(a, lp["wo"], residual=x)
    norm = (lp["mlp_norm"], eps)
    if "w_gate_up" in lp:
        gate_up = mm(x, lp["w_gate_up"], norm=norm)
    else:
        gate_up = jnp.concatenate([mm(x, lp["w_gate"], norm=norm), mm(x, lp["w_up"], norm=norm)],
                                  axis=-1)
    return mm(gate_up, lp["w_down"], glu=True, residual=x), k, v


def forward(params, cfg: ModelConfig, tokens, positions, cache: KVCache, block_mask, *,
            aux_layers: tuple[int, ...] = (), return_logits: bool = True, attn_impl: str = "xla",
            input_embeds=None, rows=None) -> ForwardOut:
    """Run T block tokens per row against the committed cache.

    tokens [B, T] int32; positions [B, T] int32 (RoPE positions; tree nodes use length + depth);
    block_mask [B, T, T] bool (query i may see block key j); cache: committed context (read only).
    aux_layers: layers whose *input* hidden state is returned (EAGLE-3 uses 2, L//2, L-3).
    rows [B] (a right-padded prompt's lengths): outputs past them are not needed, and the packed
    CPU kernel skips their products (they come out as other values than without `rows`).
    """
    x = embed(params, tokens) if input_embeds is None else input_embeds
    rope = rope_table(positions, cfg)
    scale = cfg.head_dim ** -0.5

    def run_layer(x, lp, kc, vc):
        def attend(q, k, v):
            return tree_attention(q, kc, vc, cache.valid, cache.length, k, v, block_mask,
                                  scale=scale, impl=attn_impl)

        return decoder_layer(lp, cfg, x, rope, attend, rows=rows)

    layers = params["layers"]
    if isinstance(layers, (list, tuple)):  # unrolled: per-layer buffers, no slicing (CPU default)
        ks, vs, xs_in = [], [], []
        for i, lp in enumerate(layers):
            xs_in.append(x)
            x, k, v = run_layer(x, lp, cache.k[i], cache.v[i])
            ks.append(k)
            vs.append(v)
        k_new, v_new = jnp.stack(ks), jnp.stack(vs)
    else:  # stacked and scanned: compile time independent of depth
        def body(x, layer):
            lp, kc, vc = layer
            x_out, k, v = run_layer(x, lp, kc, vc)
            return x_out, (k, v, x if aux_layers else None)

        ck, cv = cache.k, cache.v
        if cache.per_layer:
            ck, cv = jnp.stack(ck), jnp.stack(cv)
        x, (k_new, v_new, xs_in) = jax.lax.scan(body, x, (layers, ck, cv))
    aux = None
    if aux_layers:
        aux = jnp.concatenate([xs_in[i] for i in aux_layers], axis=-1)
    logits = lm_head(params, cfg, x) if return_logits else None
    return ForwardOut(logits=logits, hidden=x, aux_hidden=aux, k_new=k_new, v_new=v_new)


def unstack_layers(params):
    """Stacked layers [L, ...] -> a list of per-layer dicts (unrolled execution).

    XLA:CPU copies each layer's weights out of a stacked array before its matmuls (a dynamic
    slice in `scan`, a static slice when unrolled), doubling the memory traffic of decoding;
    separate per-layer buffers avoid the copy (SmolLM2 plain decode measured ~1.5x faster)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = next(iter(layers.values())).shape[0]
    return {**params, "layers": [{k: v[i] for k, v in layers.items()} for i in range(n)]}


PACKED_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
FUSED_KEYS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def _fuse(lp):
    """A packed layer with q/k/v and gate/up side by side (`FUSED_KEYS`), where each group shares
    its storage: one kernel call each instead of three and two (each call costs a few
    microseconds of hand-off to the thread pool; SmolLM2 has 210 a token without fusing)."""
    for name, keys in FUSED_KEYS.items():
        w = gemm.concat([lp.get(k) for k in keys])
        if w is not None:
            lp = {**{k: v for k, v in lp.items() if k not in keys}, name: w}
    return lp


def pack_layers(params, exact: bool = True):
    """Unrolled layers with float32 matrices (and the LM head) in the CPU kernel's panel layout.

    Decoding and verification then read each weight once, contiguously, for 1-64 rows, and a
    prefill runs through the same kernel in row blocks (see `pallas_kernels.cpu.gemm`). A tied
    LM head gets a packed copy of embed.T (+V*H floats). With `exact`, a matrix that is exactly
    d * q + m in blocks of 32 (a target converted from a GGUF Q4_1/Q8_0 file) is packed as uint8
    codes and scales: the same float32 weights, a fraction of the bytes to read (`pack_exact`).
    Matrices that read the same input are then joined (`_fuse`)."""
    params = unstack_layers(params)
    how = "exact" if exact else None
    out = {**params, "layers": [_fuse(gemm.pack_matrices(lp, PACKED_KEYS, how))
                                for lp in params["layers"]]}
    lm = lm_head_weight(params)
    if gemm.packable(lm):
        out["lm_head"] = gemm.pack_exact(lm) if exact else gemm.pack(lm)
    return out


def stack_layers(params):
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def causal_mask(batch: int, t: int):
    """[B, T, T] lower-triangular block mask (prompt chunks and chains)."""
    m = jnp.tril(jnp.ones((t, t), bool))
    return jnp.broadcast_to(m, (batch, t, t))
