"""Medusa heads: K residual blocks x + SiLU(W x + b) (W zero-initialised) on the target's
normalised last hidden state; head i proposes the token i+2 ahead. With `num_layers` R > 1 (the
published `medusa_num_layers`) each head runs R such blocks in turn, the first as `w`/`b`, the
others as `w_rest` [R-1, K, H, H] / `b_rest` [R-1, K, H] (a leading block axis: indexing it takes
one contiguous slice). Each block has weights of its own; the published Medusa code builds its R
blocks as one module repeated, so its checkpoints hold R equal copies (or, saved deduplicated,
only block 0), which import as R equal blocks. The candidates form a static
tree whose node at depth d with rank r takes the r-th best token of head d-1, or a dynamic one
(`dynamic`: top_k, depth, total_tokens): EAGLE-2's selection over the heads' log-probabilities,
with the heads' independent guesses standing in for a drafter's successive ones — a node at depth
d scores the sum of the log-probabilities of its path's tokens under heads 0..d-1, the top_k best
nodes of each depth take the top_k tokens of the next head as children, and the tree keeps the
total_tokens - 1 best nodes. The heads run once either way.

By default every head reads through the target's frozen LM head over the draft vocabulary
(spec_jax.heads.vocab): one [H, Vd] read serves all K heads. With `own_lm_heads` (the paper's
Medusa-1 design) each head has its own trainable LM head, `lm_heads` [K, H, Vd], initialised from
the target's (`add_lm_heads`): more capacity, and K reads a step instead of one."""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.cpu import gemm as cpu_gemm
from spec_jax.errors import SpecJaxError
from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext
from spec_jax.heads.method import Method
from spec_jax.heads.vocab import shared_head_weight, to_target_ids, topk_logp
from spec_jax.models.layers import dot_f32, rms_norm
from spec_jax.tree import (
    MEDUSA_DEFAULT,
    Pool,
    StaticTree,
    best_nodes_tree,
    check_dynamic,
    static_tree_batch,
)


def init_params(cfg, key, scale=0.0, num_heads: int = 4, num_layers: int = 1):
    h = cfg.hidden_size
    dt = jnp.dtype(cfg.dtype)
    params = {"w": (scale * jax.random.normal(key, (num_heads, h, h))).astype(dt),
              "b": jnp.zeros((num_heads, h), dt)}
    if num_layers > 1:  # the blocks after the first (one-block heads draw the same `w` as before)
        shape = (num_layers - 1, num_heads, h, h)
        params["w_rest"] = (scale * jax.random.normal(jax.random.fold_in(key, 1), shape)).astype(dt)
        params["b_rest"] = jnp.zeros(shape[:-1], dt)
    return params


def num_layers_of(params) -> int:
    """ResBlocks per head (1 + the blocks in `w_rest`)."""
    return 1 + (int(params["w_rest"].shape[0]) if "w_rest" in params else 0)


def _check(hparams: dict) -> None:
    r = hparams.get("num_layers", 1)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise SpecJaxError(f"Medusa num_layers {r!r}: the ResBlocks per head, an integer >= 1")


def add_lm_heads(params: dict, tparams, tcfg) -> dict:
    """`params` with an LM head of its own per Medusa head ([K, H, Vd], each a copy of the target's
    over the draft vocabulary, as Medusa-1 initialises them): the heads start where they were."""
    from pallas_kernels.cpu.gemm import unpack

    w = shared_head_weight({k: v for k, v in params.items() if k != "lm_sub"}, tparams, tcfg)
    if isinstance(w, cpu_gemm.PackedWeight):
        w = unpack(w)
    k = params["w"].shape[0]
    return {**params, "lm_heads": jnp.broadcast_to(w[None], (k,) + w.shape).astype(params["w"].dtype)}


@flax.struct.dataclass
class MedusaState:
    hidden: jax.Array  # [B, H] target hidden at the node that produced the root


def medusa_logits(dparams, tparams, tcfg, hidden):
    """hidden [B, H] -> per-head logits [B, K, Vd] (float32; Vd = V without a draft vocabulary)."""
    h = rms_norm(hidden, tparams["final_norm"], tcfg.rms_norm_eps)[:, None, :]  # [B, 1, H]
    z = h + jax.nn.silu(jnp.einsum("bxh,khd->bkd", h, dparams["w"]) + dparams["b"])
    for j in range(num_layers_of(dparams) - 1):  # further ResBlocks, each with its own weights
        z = z + jax.nn.silu(jnp.einsum("bkh,khd->bkd", z, dparams["w_rest"][j])
                            + dparams["b_rest"][j])
    if "lm_heads" in dparams:  # all K: slicing the weights first copies them (XLA:CPU, 10x slower)
        return jnp.einsum("bkh,khv->bkv", z, dparams["lm_heads"], preferred_element_type=jnp.float32)
    return dot_f32(z, shared_head_weight(dparams, tparams, tcfg))


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
    method: str = "medusa"
    tree: StaticTree = StaticTree.from_paths(MEDUSA_DEFAULT)
    num_heads: int = 4
    dynamic: tuple[int, int, int] | None = None  # (top_k, depth, total_tokens): used instead of tree

    def __post_init__(self):
        if self.max_depth > self.num_heads:
            raise SpecJaxError(f"tree depth {self.max_depth} exceeds the {self.num_heads} Medusa "
                               "heads: use a tree no deeper than the number of heads")
        if self.dynamic is not None:
            check_dynamic(*self.dynamic)

    @property
    def tree_size(self):
        return self.tree.size if self.dynamic is None else self.dynamic[2]

    @property
    def max_depth(self):
        return self.tree.max_depth if self.dynamic is None else self.dynamic[1]

    @property
    def max_children(self):
        return self.tree.arrays()[4].shape[1] if self.dynamic is None else self.dynamic[0]

    def proposing(self, tree: StaticTree):
        """This drafter proposing the static `tree` (its state does not depend on the tree)."""
        return dataclasses.replace(self, tree=tree, dynamic=None)

    def init_state(self, dparams, tparams, tcfg, batch, num_slots):
        return MedusaState(hidden=jnp.zeros((batch, tcfg.hidden_size), jnp.dtype(tcfg.dtype)))

    def after_prefill(self, dparams, tparams, tcfg, state, ctx: PrefillContext):
        rows = jnp.arange(ctx.tokens.shape[0])
        return MedusaState(hidden=ctx.hidden[rows, ctx.prompt_len - 1])

    def after_verify(self, dparams, tparams, tcfg, state, ctx: VerifyContext):
        rows = jnp.arange(ctx.path.shape[0])
        last = ctx.path[rows, ctx.n_accepted - 1]
        return MedusaState(hidden=jnp.where(ctx.active[:, None], ctx.hidden[rows, last], state.hidden))

    def propose(self, dparams, tparams, tcfg, state, root, key):
        if self.dynamic is not None:
            k, depth, total = self.dynamic
            pool = self.propose_pool(dparams, tparams, tcfg, state, root)
            return best_nodes_tree(root, pool, total - 1, depth, k), state
        parent, depth, rank, _, _, _ = self.tree.arrays()
        b = root.shape[0]
        logits = medusa_logits(dparams, tparams, tcfg, state.hidden)  # [B, K, V]
        r = int(rank.max()) + 1
        _, top = jax.lax.top_k(logits, r)  # [B, K, r]
        head = jnp.asarray(depth[1:] - 1)
        tok = to_target_ids(dparams, top[:, head, jnp.asarray(rank[1:])])  # [B, T-1]
        tokens = jnp.concatenate([root[:, None], tok.astype(jnp.int32)], axis=1)
        return static_tree_batch(self.tree, tokens, b), state

    def propose_pool(self, dparams, tparams, tcfg, state, root) -> Pool:
        """The dynamic tree's candidates before its final selection."""
        k, depth, _ = self.dynamic
        b = root.shape[0]
        logits = medusa_logits(dparams, tparams, tcfg, state.hidden)[:, :depth]  # [B, D, V]
        logp, tok = topk_logp(logits, dparams, k)  # [B, D, k]
        pool_tok, pool_score = [tok[:, 0]], [logp[:, 0]]
        pool_parent = [jnp.full((b, k), -1, jnp.int32)]
        f_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # frontier: pool ids
        f_score = logp[:, 0]
        base = k
        for d in range(1, depth):
            score = (f_score[:, :, None] + logp[:, d][:, None, :]).reshape(b, k * k)
            pool_tok.append(jnp.broadcast_to(tok[:, d][:, None, :], (b, k, k)).reshape(b, k * k))
            pool_score.append(score)
            pool_parent.append(jnp.repeat(f_idx, k, axis=1))
            f_score, top_i = jax.lax.top_k(score, k)
            f_idx = base + top_i
            base += k * k
        depths = [jnp.full((b, k if d == 0 else k * k), d + 1, jnp.int32) for d in range(depth)]
        return Pool.concat(pool_tok, pool_score, pool_parent, depths)


def _drafter(hparams: dict, tree) -> MedusaDrafter:
    """Medusa heads' drafter for a parsed tree: a static tree, a dynamic one (its depth at most
    the number of heads by default), or the default tree cut to the number of heads."""
    kw = {"num_heads": hparams["num_heads"]}
    if isinstance(tree, StaticTree):
        kw["tree"] = tree
    elif isinstance(tree, dict):
        kw["dynamic"] = (tree.get("top_k", 8), tree.get("depth", hparams["num_heads"]),
                         tree.get("total_tokens", 32))
    else:  # the default tree, cut to the number of heads
        kw["tree"] = StaticTree.from_paths(
            [p for p in MEDUSA_DEFAULT if len(p) <= hparams["num_heads"]])
    return MedusaDrafter(**kw)


def _grow(params, hparams: dict, target, wanted: dict, seed: int):
    """Heads given LM heads of their own where `wanted` asks for them (`add_lm_heads`)."""
    if wanted.get("own_lm_heads") and "lm_heads" not in params:
        params = add_lm_heads(params, target.params, target.cfg)
        if not hparams.get("own_lm_heads"):
            hparams = {**hparams, "own_lm_heads": True}
    return params, hparams


def head_logits(dparams, tparams, tcfg, feats):
    """feats [B, L, H] -> every head's logits [B, L, K, Vd] (`medusa_logits` per position)."""
    b, n, h = feats.shape
    lg = medusa_logits(dparams, tparams, tcfg, feats.reshape(b * n, h))
    return lg.reshape(b, n, *lg.shape[1:])


METHOD = Method(
    name="medusa", title="Medusa",
    # "own_lm_heads": True gives each head its own LM head; "num_layers": R > 1 R ResBlocks each
    defaults={"num_heads": 4},
    init_params=lambda tcfg, key, scale, hp, d2t: (
        init_params(tcfg, key, scale, num_heads=hp["num_heads"],
                    num_layers=hp.get("num_layers", 1)), hp),
    drafter=_drafter, grow=_grow, check=_check,
    profile_depth=lambda hp: int(hp["num_heads"]), head_logits=head_logits,
    flags=("--own-lm-heads",),
    flag_hparams=lambda layers, features, own_lm_heads: (
        (("own_lm_heads", True),) if own_lm_heads else ()))
