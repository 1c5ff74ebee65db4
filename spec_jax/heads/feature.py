"""Feature drafters (EAGLE-1/2, EAGLE-3, MTP): a small decoder run autoregressively over features.

The draft model sees pairs (feature at position j, token at j+1) at position j and outputs the
predicted feature of position j+1, whose logits propose the token at j+2. It keeps its own static KV
cache over the accepted context (one cache layer per decoder layer of each module), always as long
as the target's:
after each verification it re-runs the accepted pairs with the target's fresh features. Tree
expansion (EAGLE-2) keeps the K/V of expanded nodes in a per-step buffer that is thrown away.

Dynamic tree (EAGLE-2): at depth 1 take the top_k tokens of the root; at each further depth run
the draft on the top_k frontier nodes, score their top_k children by cumulative log-probability,
and keep the top_k as the next frontier; finally keep the `total_tokens - 1` best nodes overall.
A chain (MTP) is the same with top_k = 1.

Static tree (EAGLE-1, or any list of paths): the same depth-by-depth expansion over a fixed set of
nodes; a node of rank r takes its parent's r-th best draft token.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.cache import KVCache, commit, init_cache
from spec_jax.heads.base import Drafter, PrefillContext, VerifyContext, accepted_chunk
from spec_jax.heads.vocab import shared_head_logits, topk_logp
from spec_jax.models.llama import causal_mask
from spec_jax.tree import Pool, StaticTree, Tree, best_nodes_tree, static_tree_batch


@flax.struct.dataclass
class FeatureState:
    cache: KVCache  # M * num_layers per-layer [B, KVH, S, D] buffers (module-major)
    root_feat: jax.Array  # [B, H] draft feature predicted for the root's position
    root_logp: jax.Array  # [B, k] top-k log-probs of the root's children
    root_tok: jax.Array  # [B, k] their target token ids


@dataclasses.dataclass(frozen=True)
class FeatureDrafter(Drafter):
    method: str = "eagle"
    top_k: int = 8
    depth: int = 5
    total_tokens: int = 32  # nodes including the root
    num_modules: int = 1
    num_layers: int = 1  # decoder layers per module (each has its own draft cache layer)
    attn_impl: str = "xla"
    static_tree: StaticTree | None = None  # set: draft this fixed tree instead of a dynamic one

    # ---- what each method defines ----
    def target_feature(self, dparams, tparams, tcfg, hidden, aux_hidden, rows=None):
        """Target outputs (final hidden states [B, T, H], pre-norm; fused ones [B, T, 3H]) -> draft
        input features [B, T, H], which are also what an EAGLE head's feature loss regresses.
        rows [B]: only each row's first rows[b] positions are needed (as in `cell`)."""
        return hidden

    def cell(self, dparams, tparams, tcfg, module, feat, tokens, positions, cache_k, cache_v,
             cache_valid, cache_len, extra_k, extra_v, extra_mask, own_mask, rows=None):
        """One draft step of `module`. cache_k/cache_v: its layers' committed caches, a tuple of
        num_layers [B, KVH, S, D]; extra_k/extra_v: a tuple of num_layers [B, E, KVH, D] (tree
        buffer). rows [B] (a padded prompt, an accepted chain): only each row's first rows[b]
        tokens need outputs (the packed CPU kernel skips the rest). Returns (out_feature
        [B,T,H], ks, vs), ks/vs a tuple of num_layers [B,T,KVH,D]."""
        raise NotImplementedError

    def logits(self, dparams, tparams, tcfg, feat):
        """Draft features [B, N, H] -> float32 logits over the draft vocabulary [B, N, Vd]."""
        return shared_head_logits(dparams, tparams, tcfg, feat)

    def logp_topk(self, dparams, tparams, tcfg, feat, k):
        """Top-k children of draft features [B, N, H]: (logp [B,N,k], target token ids [B,N,k])."""
        return topk_logp(self.logits(dparams, tparams, tcfg, feat), dparams, k)

    # ---- shared machinery ----
    def for_tree(self, tree: StaticTree):
        """This drafter drafting the static `tree` (top_k, depth and size follow from it)."""
        return dataclasses.replace(self, static_tree=tree, top_k=int(tree.arrays()[2].max()) + 1,
                                   depth=tree.max_depth, total_tokens=tree.size)

    def with_attn_impl(self, impl):
        return dataclasses.replace(self, attn_impl=impl)

    def proposing(self, tree: StaticTree):
        """This drafter proposing the static `tree` from the same state (spec_jax.compose.switch):
        top_k is kept, so the state's root candidates must cover every rank the tree uses."""
        if int(tree.arrays()[2].max()) + 1 > self.top_k:
            raise ValueError(f"tree ranks exceed top_k {self.top_k}")
        return dataclasses.replace(self, static_tree=tree, depth=tree.max_depth,
                                   total_tokens=tree.size)

    @property
    def tree_size(self) -> int:
        return self.total_tokens

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_children(self) -> int:
        if self.static_tree is not None:
            return self.static_tree.arrays()[4].shape[1]
        return self.top_k

    def _attend_cell(self, dparams, tparams, tcfg, module, feat, tokens, positions, cache: KVCache,
                     extra_k, extra_v, extra_mask, own_mask, rows=None):
        lo, hi = module * self.num_layers, (module + 1) * self.num_layers
        return self.cell(dparams, tparams, tcfg, module, feat, tokens, positions,
                         tuple(cache.k[lo:hi]), tuple(cache.v[lo:hi]), cache.valid, cache.length,
                         extra_k, extra_v, extra_mask, own_mask, rows=rows)

    def _empty_kv(self, tcfg, batch, n, dtype):
        """A tree buffer of n slots per layer: a tuple of num_layers [B, n, KVH, D] zeros."""
        return tuple(jnp.zeros((batch, n, tcfg.num_kv_heads, tcfg.head_dim), dtype)
                     for _ in range(self.num_layers))

    def init_state(self, dparams, tparams, tcfg, batch, num_slots):
        cache = init_cache(self.num_modules * self.num_layers, batch, num_slots,
                           tcfg.num_kv_heads, tcfg.head_dim, jnp.dtype(tcfg.dtype), per_layer=True)
        # an all-constant empty cache makes XLA constant-fold the prefill's masked attention over
        # it (seconds of compile time per drafter and prompt shape); the barrier stops the folding
        cache = jax.lax.optimization_barrier(cache)
        k = self.top_k
        return FeatureState(cache=cache, root_feat=jnp.zeros((batch, tcfg.hidden_size),
                                                             jnp.dtype(tcfg.dtype)),
                            root_logp=jnp.zeros((batch, k), jnp.float32),
                            root_tok=jnp.zeros((batch, k), jnp.int32))

    def _run_chunk(self, dparams, tparams, tcfg, state: FeatureState, feats, next_tok, positions,
                   valid):
        """Run all modules over committed pairs [B, A] and append them to the draft cache.
        valid [B, A] is a prefix of each row (a prefill's prompt, a verify's accepted tokens):
        only those pairs are computed, the padding's products skipped (`cell`'s rows)."""
        b, a = next_tok.shape
        count = jnp.sum(valid, axis=1).astype(jnp.int32)
        empty = self._empty_kv(tcfg, b, 0, state.cache.k[0].dtype)
        own = causal_mask(b, a)
        ks, vs, first_out = [], [], None
        for m in range(self.num_modules):
            out, k, v = self._attend_cell(dparams, tparams, tcfg, m, feats, next_tok, positions,
                                          state.cache, empty, empty,
                                          jnp.zeros((b, a, 0), bool), own, rows=count)
            ks.extend(k)
            vs.extend(v)
            if m == 0:
                first_out = out
        select = jnp.broadcast_to(jnp.arange(a, dtype=jnp.int32), (b, a))
        cache = commit(state.cache, jnp.stack(ks), jnp.stack(vs), positions, select, count)
        rows = jnp.arange(b)
        last = jnp.maximum(count - 1, 0)
        root_feat = jnp.where((count > 0)[:, None], first_out[rows, last], state.root_feat)
        logp, tok = self.logp_topk(dparams, tparams, tcfg, root_feat[:, None], self.top_k)
        keep = (count > 0)[:, None]
        return FeatureState(cache=cache, root_feat=root_feat,
                            root_logp=jnp.where(keep, logp[:, 0], state.root_logp),
                            root_tok=jnp.where(keep, tok[:, 0], state.root_tok))

    def after_prefill(self, dparams, tparams, tcfg, state, ctx: PrefillContext):
        b, p = ctx.tokens.shape
        feats = self.target_feature(dparams, tparams, tcfg, ctx.hidden, ctx.aux_hidden,
                                    rows=ctx.prompt_len)
        j = jnp.arange(p)[None, :]
        shifted = jnp.concatenate([ctx.tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        next_tok = jnp.where(j == ctx.prompt_len[:, None] - 1, ctx.first_token[:, None], shifted)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        return self._run_chunk(dparams, tparams, tcfg, state, feats, next_tok, positions,
                               j < ctx.prompt_len[:, None])

    def after_verify(self, dparams, tparams, tcfg, state, ctx: VerifyContext):
        node, next_tok, valid = accepted_chunk(ctx)
        bi = jnp.arange(node.shape[0])[:, None]
        count = jnp.sum(valid, axis=1).astype(jnp.int32)  # the accepted pairs come first
        aux = None if ctx.aux_hidden is None else ctx.aux_hidden[bi, node]
        feats = self.target_feature(dparams, tparams, tcfg, ctx.hidden[bi, node], aux, rows=count)
        positions = ctx.root_pos[:, None] + jnp.arange(node.shape[1])[None, :]
        return self._run_chunk(dparams, tparams, tcfg, state, feats, next_tok, positions, valid)

    def propose(self, dparams, tparams, tcfg, state: FeatureState, root, key):
        if self.static_tree is not None:
            return self._propose_static(dparams, tparams, tcfg, state, root), state
        pool = self.propose_pool(dparams, tparams, tcfg, state, root)
        return best_nodes_tree(root, pool, self.total_tokens - 1, self.depth, self.top_k), state

    def propose_pool(self, dparams, tparams, tcfg, state: FeatureState, root) -> Pool:
        """The dynamic tree's candidates before its final selection (spec_jax.compose.graft ranks
        grafted chains among them)."""
        b = root.shape[0]
        k, depth = self.top_k, self.depth
        n_buf = max(depth - 1, 1) * k
        root_pos = state.cache.length  # draft cache is as long as the target's
        # pool of candidates: tokens, cumulative scores, parent pool index (-1 = root), depth
        pool_tok = [state.root_tok]
        pool_score = [state.root_logp]
        pool_parent = [jnp.full((b, k), -1, jnp.int32)]
        pool_depth = [jnp.ones((b, k), jnp.int32)]
        # frontier: k nodes with their pool index, token, score, parent feature, ancestor mask
        f_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
        f_tok, f_score = state.root_tok, state.root_logp
        f_feat = jnp.broadcast_to(state.root_feat[:, None], (b, k, state.root_feat.shape[-1]))
        f_anc = jnp.zeros((b, k, n_buf), bool)
        buf_k = buf_v = self._empty_kv(tcfg, b, n_buf, state.cache.k[0].dtype)
        eye = jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))
        rows = jnp.arange(b)[:, None]
        base = k
        for d in range(2, depth + 1):
            module = (d - 1) % self.num_modules
            positions = root_pos[:, None] + (d - 2) + jnp.zeros((1, k), jnp.int32)
            out, kk, vv = self._attend_cell(dparams, tparams, tcfg, module, f_feat, f_tok,
                                            positions, state.cache, buf_k, buf_v, f_anc, eye)
            slot0 = (d - 2) * k
            buf_k, buf_v = _buffer(buf_k, kk, slot0), _buffer(buf_v, vv, slot0)
            logp, tok = self.logp_topk(dparams, tparams, tcfg, out, k)  # [B, k, k]
            score = f_score[:, :, None] + logp
            cand_parent = jnp.broadcast_to(f_idx[:, :, None], (b, k, k)).reshape(b, k * k)
            pool_tok.append(tok.reshape(b, k * k))
            pool_score.append(score.reshape(b, k * k))
            pool_parent.append(cand_parent)
            pool_depth.append(jnp.full((b, k * k), d, jnp.int32))
            if d < depth:
                top_s, top_i = jax.lax.top_k(score.reshape(b, k * k), k)
                par = top_i // k  # which frontier node
                f_idx = base + top_i
                f_tok = tok.reshape(b, k * k)[rows, top_i]
                f_score = top_s
                f_feat = out[rows, par]
                self_bit = jax.nn.one_hot(slot0 + par, n_buf, dtype=bool)
                f_anc = f_anc[rows, par] | self_bit
            base += k * k
        return Pool.concat(pool_tok, pool_score, pool_parent, pool_depth)

    def _propose_static(self, dparams, tparams, tcfg, state: FeatureState, root) -> Tree:
        """Expand the static tree depth by depth: one draft call per depth over the nodes of the
        previous depth that have children; their K/V go to a per-step buffer (slot per node)."""
        parent, depth, rank, mask, _, _ = self.static_tree.arrays()
        t, b = len(parent), root.shape[0]
        expand = [i for i in range(1, t) if np.any(parent == i)]  # node order: depth-contiguous
        slot = {n: j for j, n in enumerate(expand)}
        n_buf = max(len(expand), 1)
        buf_k = buf_v = self._empty_kv(tcfg, b, n_buf, state.cache.k[0].dtype)
        tokens = [root] + [None] * (t - 1)
        for i in range(1, t):
            if depth[i] == 1:
                tokens[i] = state.root_tok[:, rank[i]]
        out_of = {}  # node -> draft output feature [B, H] (predicts the node's children)
        root_pos = state.cache.length
        for d in range(2, self.depth + 1):
            run = [i for i in expand if depth[i] == d - 1]
            feat = jnp.stack([state.root_feat if parent[i] == 0 else out_of[parent[i]] for i in run], 1)
            tok = jnp.stack([tokens[i] for i in run], 1)
            anc = mask[np.ix_(run, expand)]  # ancestors-or-self among the buffered nodes
            anc[np.arange(len(run)), [slot[i] for i in run]] = False  # a node's own K/V is `own`
            positions = root_pos[:, None] + (d - 2) + jnp.zeros((1, len(run)), jnp.int32)
            out, kk, vv = self._attend_cell(
                dparams, tparams, tcfg, (d - 1) % self.num_modules, feat, tok, positions,
                state.cache, buf_k, buf_v, jnp.broadcast_to(jnp.asarray(anc), (b,) + anc.shape),
                jnp.broadcast_to(jnp.eye(len(run), dtype=bool), (b, len(run), len(run))))
            s0 = slot[run[0]]
            buf_k, buf_v = _buffer(buf_k, kk, s0), _buffer(buf_v, vv, s0)
            kids = [c for c in range(t) if depth[c] == d]
            _, top = self.logp_topk(dparams, tparams, tcfg, out, int(rank[kids].max()) + 1)
            col = {n: r for r, n in enumerate(run)}
            picked = top[:, np.array([col[parent[c]] for c in kids]), rank[kids]]  # [B, len(kids)]
            for j, c in enumerate(kids):
                tokens[c] = picked[:, j]
            for r, i in enumerate(run):
                out_of[i] = out[:, r]
        return static_tree_batch(self.static_tree, jnp.stack(tokens, 1).astype(jnp.int32), b)


def _buffer(buf, new, slot):
    """Write per-layer K or V `new` (tuple of [B, n, KVH, D]) at `slot` of the tree buffer."""
    return tuple(jax.lax.dynamic_update_slice_in_dim(b, x.astype(b.dtype), slot, 1)
                 for b, x in zip(buf, new))


def draft_attention(q, cache_k, cache_v, cache_valid, cache_len, extra_k, extra_v, extra_mask,
                    own_k, own_v, own_mask, impl):
    """Draft queries over: committed draft cache + tree buffer (extra) + the step's own keys."""
    from pallas_kernels import tree_attention

    blk_k = jnp.concatenate([extra_k.astype(own_k.dtype), own_k], axis=1)
    blk_v = jnp.concatenate([extra_v.astype(own_v.dtype), own_v], axis=1)
    mask = jnp.concatenate([extra_mask, own_mask], axis=2)
    return tree_attention(q, cache_k, cache_v, cache_valid, cache_len, blk_k, blk_v, mask, impl=impl)
