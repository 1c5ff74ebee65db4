"""`generate`: plain or speculative decoding of one prompt (or a batch), with measured stats."""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.errors import SpecJaxError
from spec_jax.heads.base import Drafter
from spec_jax.step import (FINISH_LENGTH, FINISH_STOP, LoopSettings, compiled_loop, compiled_prefill,
                           loop_precision)
from spec_jax.target import Target
from spec_jax.tree import tree_object

FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}
# Compiled loops kept per target, least recently used dropped first. Each XLA:CPU executable holds
# ~1 000 memory maps and a process may have 65 530 (vm.max_map_count): `spec-jax bench --calibrate`
# with four heads compiled ~60 loops in one process and aborted inside LLVM ("Cannot allocate
# memory", then a segfault).
MAX_LOOPS = 24
PROMPT_STEP = 64  # prompts are padded to a multiple of this: one prefill program per bucket
SLOT_STEP = 512  # cache slots are a multiple of this: the compiled loop is shared across prompts


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: dict[str, Any]


def _bucket(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def resolve_drafter(target: Target, draft, tree, batch: int = 1, attn_impl: str = "auto",
                    datastore=None, temperature: float = 0.0, top_p: float = 1.0,
                    fallback: bool | float | tuple = True) -> tuple[Drafter, Any]:
    """(drafter, draft params) from the `draft=` argument of generate; `attn_impl` is the draft
    model's attention (feature drafters).

    For heads and "ngram", `tree=None` takes the tree (the chain) sized for this device, model,
    heads, batch (and datastore) if one was (see `spec_jax.sizing`), else the method's default;
    `tree="auto"` sizes it now if it was not. Sampling (temperature > 0) has trees sized for its (temperature, top_p):
    `None` falls back to the greedy sizing, `"auto"` sizes for the setting. With a `datastore`
    (spec_jax.heads.datastore), its chain is grafted on: `+ds:N` tokens where the tree says, as
    sized for `auto`, else 8. `fallback` (see `generate`) may wrap the result in a
    `spec_jax.heads.fallback.FallbackDrafter`."""
    point = _fallback_point(fallback)
    drafter, dparams, sized = _resolve(target, draft, tree, batch, attn_impl, datastore,
                                       temperature, top_p)
    if type(drafter) is Drafter or fallback is False:
        return drafter, dparams
    from spec_jax.heads.fallback import FallbackDrafter

    if fallback is True:  # the sizing's, for exactly its choice; a tree the caller chose: as given
        point = sized
    if point is None or point[0] <= 0:
        return drafter, dparams
    return FallbackDrafter(inner=drafter, plain_below=point[0], prior=max(point)), dparams


def _fallback_point(fallback) -> tuple[float, float] | None:
    """`generate`'s fallback as (break-even, prior), None for True or False (the sizing's, none).
    A break-even given alone gets a prior a quarter above it."""
    if isinstance(fallback, bool):
        return None
    try:
        below, prior = (fallback if isinstance(fallback, (tuple, list))
                        else (fallback, 1.25 * fallback))
        point = (float(below), float(prior))
    except (TypeError, ValueError):
        point = (float("nan"),) * 2
    if not (0 < point[0] <= point[1] < float("inf")):
        raise SpecJaxError(f"fallback must be True, False, a break-even > 0 (tokens per tree step) "
                           f"or a pair (break-even, expected tokens per tree step >= it), not "
                           f"{fallback!r}")
    return point


def _resolve(target, draft, tree, batch, attn_impl, datastore, temperature, top_p):
    """`resolve_drafter` without the fallback: (drafter, dparams, the (break-even, prior) of the
    fallback the sizing chose with it where the drafter is exactly a cached sizing's choice, else
    None)."""
    from spec_jax.heads.graft import (ranked, split_datastore, split_graft, split_ranked,
                                      with_datastore, with_graft)
    from spec_jax.heads.ngram import NgramDrafter
    from spec_jax.heads.registry import DraftHeads

    given = tree = tree_object(tree)
    tree, rank = split_ranked(tree)
    tree, ds_n = split_datastore(tree)
    given_ds = ds_n
    if ds_n and datastore is None:
        raise SpecJaxError(f"tree {given!r} drafts from a datastore: pass datastore="
                           "spec_jax.load_datastore(DIR) (CLI: --datastore DIR)")
    if draft is None or draft == "none":
        if datastore is not None:
            raise SpecJaxError("a datastore drafts beside a drafter: pass draft='ngram' or heads "
                               "(draft=None is plain decoding)")
        return Drafter(), (), None
    if datastore is not None:
        datastore.check_target(target)
    sized = None
    if isinstance(draft, str) and draft.startswith("ngram"):
        if tree in (None, "auto") and datastore is None:  # sized for this device, as heads are
            from spec_jax import sizing

            chosen = sizing.sized_choice(
                tree, temperature, top_p,
                lambda t, p: sizing.cached_choice(target, "ngram", batch, temperature=t, top_p=p),
                lambda: sizing.choice_of(sizing.size_ngram(target, batch=batch,
                                                           temperature=temperature,
                                                           top_p=top_p)[1]))
            if chosen is not None:
                if chosen[0] == sizing.PLAIN:
                    return Drafter(), (), None
                tree, sized = chosen
        drafter, dparams = NgramDrafter.from_tree(None if tree == "auto" else tree), ()
    elif isinstance(draft, DraftHeads):
        from spec_jax import sizing

        draft.check_target(target)
        base, graft_n = split_graft(tree)
        if base in (None, "auto"):
            chosen = sizing.sized_choice(
                base, temperature, top_p,
                lambda t, p: sizing.cached_choice(target, draft, batch, datastore, t, p),
                lambda: sizing.choice_of(sizing.size_tree(target, draft, batch=batch,
                                                          datastore=datastore,
                                                          temperature=temperature,
                                                          top_p=top_p)[1]))
            chosen, point = (None, None) if chosen is None else chosen
            chosen, sized_ds = split_datastore(chosen)
            if ds_n is None and chosen is not None:  # the sizing weighed the datastore: its call
                ds_n = 0 if chosen == sizing.PLAIN else sized_ds
            # the chosen tree may carry a graft of its own; the caller's +ngram:N wins
            drafter = with_graft(draft.drafter(chosen), graft_n)
            if chosen is not None and not graft_n and (datastore is None or given_ds is None):
                sized = point
        else:
            drafter = draft.drafter(tree)
        drafter = drafter.with_attn_impl(attn_impl)
        dparams = () if type(drafter) is Drafter else draft.bind(target)
    else:
        raise SpecJaxError(f"unknown draft {draft!r}: pass 'ngram', heads from spec_jax.init_draft / "
                           "spec_jax.load_draft, or None for plain decoding")
    if datastore is not None:
        if ds_n is None:
            ds_n = min(8, datastore.depth)
        if ds_n:
            drafter = with_datastore(drafter, datastore.chain(ds_n))
            dparams = {**(dparams or {}), "datastore": datastore.tables()}
    if rank:
        drafter, priors = ranked(drafter, datastore)
        dparams = {**dparams, "datastore": {**dparams.get("datastore", {}), **priors}}
    return drafter, dparams, sized


def generate(target: Target, prompt: str | Sequence[int] | Sequence[dict],
             max_new_tokens: int = 128, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chat: bool = True,
             draft=None, tree=None, attn_impl: str = "auto", stop_at_eos: bool = True,
             accept_rule: str = "exact", precision: str | None = None,
             datastore=None, fallback: bool | float | tuple = True) -> GenerationResult:
    """Generate up to max_new_tokens after `prompt`: a string, a list of token ids, or a
    conversation (chat messages [{"role": "user", "content": ...}, {"role": "assistant", ...},
    ...], ending with the user's turn).

    draft: None (plain decoding), "ngram", or heads from `init_draft`/`load_draft`.
    tree: for heads, None (the tree sized for this device if one was, else the method's default),
    "auto" (size it now if it was not: a one-off measurement, see `spec_jax.sizing`; with
    temperature > 0, for that temperature and top_p),
    "dynamic:TOP_K,DEPTH,TOTAL", "mc_sim_7b_63", "medusa", "chain:N", or a list of paths;
    "TREE+ngram:N" grafts the n-gram chain of the context on, "TREE+ds:N" the datastore's, and
    "dynamic:K,D,T+ngram:N+ds:M+ranked" ranks both chains' tokens among the dynamic tree's
    candidates, so the tree keeps T tokens (spec_jax.heads.graft); a
    switch ({"switch": [...], "policy": [...]}, spec_jax.heads.switch) picks per row and step
    between head trees and n-gram chains of the same size.
    datastore: a corpus of the target's own output to draft from (`load_datastore`), grafted on
    with `+ds:N` tokens (8 if the tree does not say).
    Greedy speculative output equals plain greedy output; at temperature > 0 the output
    distribution equals the target's.
    precision: matmul precision of the compiled loop; None is "highest" for float32 targets (on
    GPUs the default TF32 made speculative output drift from plain decoding) and the backend's
    default otherwise; "default" trades that exactness for TF32 speed.
    fallback: with a sized tree (tree None or "auto"), True runs it as the sizing chose: where
    its calibration measured that plain steps pay, a row takes them while its recent tree steps
    accept fewer tokens than the measured break-even (and probes with a tree step now and then),
    so speculation does not run much slower than plain decoding where the drafter guesses badly
    (`spec_jax.heads.fallback`); False never does; a number is the break-even (tokens per tree
    step) for any tree, a pair (break-even, expected tokens per tree step) both.
    """
    batch = generate_batch(target, [prompt], max_new_tokens, temperature=temperature, top_p=top_p,
                           seed=[seed], chat=chat, draft=draft, tree=tree, attn_impl=attn_impl,
                           stop_at_eos=stop_at_eos, accept_rule=accept_rule, precision=precision,
                           datastore=datastore, fallback=fallback)
    return batch[0]


def _per_prompt(value, name: str, b: int, integer: bool = False) -> np.ndarray:
    """A setting given once or once per prompt -> [b] (int32 if `integer`, else float32)."""
    v = np.asarray(value)
    kind = "integer" if integer else "number"
    if v.shape not in ((), (b,)) or (integer and not np.issubdtype(v.dtype, np.integer)):
        raise SpecJaxError(f"{name} must be one {kind} or one per prompt: got {value!r} for {b} "
                           "prompts")
    return np.broadcast_to(v, (b,)).astype(np.int32 if integer else np.float32)


def row_keys(seed, b: int):
    """Each row's random key [b, 2]: PRNGKey(seed[i]) for a seed per prompt (so a row samples as
    `generate` does alone with that seed and the same tree), fold_in(PRNGKey(seed), i) for one."""
    seeds = _per_prompt(seed, "seed", b, integer=True)
    if np.ndim(seed) == 0:
        return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(int(seeds[0])), i))(
            jnp.arange(b))
    return jnp.stack([jax.random.PRNGKey(int(x)) for x in seeds])


def sizing_setting(temperature: np.ndarray, top_p: np.ndarray) -> tuple[float, float]:
    """The (temperature, top_p) a batch's tree is sized for: greedy if every row is greedy, else
    the commonest setting of its sampling rows (a batch with any sampling row verifies by
    sampling), the first row's among equals."""
    sampled = collections.Counter((float(t), float(p)) for t, p in zip(temperature, top_p) if t > 0)
    return sampled.most_common(1)[0][0] if sampled else (0.0, 1.0)  # ties: first seen first


def pads_freely(target: Target, attn_impl: str = "auto") -> bool:
    """Whether a prompt's results are the same bits however far its batch is padded: with the
    packed CPU kernels each row of a product and each query of the attention is computed alone,
    so a prefill compiled for a longer prompt bucket can serve a shorter prompt (XLA's dot blocks
    its sums by the matrix's shape, so elsewhere each bucket keeps its own program)."""
    from pallas_kernels import cpu_gemm
    from pallas_kernels.dispatch import resolve_impl

    return target.layout == "packed" and cpu_gemm.available() and resolve_impl(attn_impl) == "cpu"


def _prefill_bucket(target: Target, key, p_pad: int, n_slots: int) -> int:
    """The prompt bucket to prefill in: the shortest of `p_pad` and the longer ones up to 2x
    whose program `key(bucket)` is already compiled, else `p_pad`: no new compile (2-3 s for
    SmolLM2 here) for a little more work (the matrix products skip the padding, see
    `step.prefill`; attention and element-wise work do not)."""
    wider = range(p_pad, min(2 * p_pad, n_slots) + 1, PROMPT_STEP)
    return next((p for p in wider if key(p) in target.compiled), p_pad)


def _compiled(target: Target, key: tuple, precision: str, lower):
    """The compiled program under `key` (its kind first), compiled from `lower()` under
    `precision` if absent; returns it and the seconds its compile took. Each kind keeps its
    MAX_LOOPS most recently used programs (the dict's order is the order of use)."""
    fn = target.compiled.pop(key, None)
    seconds = 0.0
    if fn is None:
        t0 = time.perf_counter()
        with jax.default_matmul_precision(precision):
            fn = lower().compile()
        seconds = time.perf_counter() - t0
        same_kind = [k for k in target.compiled if k[0] == key[0]]
        for k in same_kind[:max(len(same_kind) - MAX_LOOPS + 1, 0)]:  # least recently used first
            del target.compiled[k]
    target.compiled[key] = fn
    return fn, seconds


def generate_batch(target: Target, prompts: Sequence, max_new_tokens: int | Sequence[int] = 128, *,
                   temperature: float | Sequence[float] = 0.0, top_p: float | Sequence[float] = 1.0,
                   seed: int | Sequence[int] = 0, chat: bool = True, draft=None, tree=None,
                   attn_impl: str = "auto", stop_at_eos: bool = True, accept_rule: str = "exact",
                   precision: str | None = None, datastore=None,
                   fallback: bool | float | tuple = True) -> list[GenerationResult]:
    """Like `generate` for several prompts at once (one batch, per-row lengths and acceptance).

    max_new_tokens, temperature, top_p and seed: one value for every prompt, or one per prompt
    (requests with their own limits and sampling settings in one batch; a row with temperature 0
    decodes greedily, exactly as alone). Each row draws from its own key (`row_keys`). The tree
    is sized for `sizing_setting` of them."""
    b = len(prompts)
    row_max = _per_prompt(max_new_tokens, "max_new_tokens", b, integer=True)
    if np.any(row_max < 1):
        raise SpecJaxError("max_new_tokens must be at least 1")
    max_new = int(row_max.max())
    temps, top_ps = _per_prompt(temperature, "temperature", b), _per_prompt(top_p, "top_p", b)
    if not (np.all(temps >= 0) and np.all((top_ps > 0) & (top_ps <= 1))):  # NaN fails too
        raise SpecJaxError("temperature must be >= 0 and top_p in (0, 1]")
    ids = [target.encode(p, chat=chat) for p in prompts]
    p_len = max(len(x) for x in ids)
    p_pad = _bucket(p_len, PROMPT_STEP)
    size_t, size_p = sizing_setting(temps, top_ps)
    drafter, dparams = resolve_drafter(target, draft, tree, b, attn_impl, datastore,
                                       temperature=size_t, top_p=size_p, fallback=fallback)
    # the loop stops each row at its own limit (an input); the static output length is bucketed,
    # so calls that differ only in max_new_tokens share a compiled loop
    out_len = _bucket(max_new, 32)
    # the loop's shapes depend on the cache, not the prompt: slots in steps of 512, so prompts of
    # different lengths share one compiled loop (only the cheaper prefill compiles per 64 tokens)
    n_slots = _bucket(max(p_pad, p_len + out_len + 2 * drafter.tree_size + drafter.max_depth + 1),
                      SLOT_STEP)
    longest = max(range(b), key=lambda i: len(ids[i]) + row_max[i])
    p_len_i, max_i = len(ids[longest]), int(row_max[longest])
    if p_len_i + max_i > target.cfg.max_position_embeddings:
        raise SpecJaxError(f"prompt ({p_len_i}) + max_new_tokens ({max_i}) exceeds the model's "
                           f"{target.cfg.max_position_embeddings} positions: shorten one of them")
    greedy = not np.any(temps > 0)
    settings = LoopSettings(out_len=out_len, greedy=greedy,
                            eos_ids=target.eos_ids if stop_at_eos else (), attn_impl=attn_impl,
                            accept_rule=accept_rule)
    dsig = (jax.tree.structure(dparams),
            tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(dparams)))
    precision = loop_precision(target.cfg, precision)

    def prefill_key(p_bucket: int) -> tuple:  # one compiled prefill per prompt bucket
        return ("prefill", drafter, settings, b, p_bucket, n_slots, dsig, precision)

    if pads_freely(target, attn_impl):
        p_pad = _prefill_bucket(target, prefill_key, p_pad, n_slots)
    tokens = np.zeros((b, p_pad), np.int32)
    for i, x in enumerate(ids):
        tokens[i, :len(x)] = x
    cache = target.new_cache(b, n_slots)
    args = (target.params, dparams, jnp.asarray(tokens), jnp.asarray([len(x) for x in ids], jnp.int32),
            cache, row_keys(seed, b), jnp.asarray(temps), jnp.asarray(top_ps), jnp.asarray(row_max))
    run_prefill, c1 = _compiled(target, prefill_key(p_pad), precision, lambda: compiled_prefill(
        target.cfg, drafter, settings).lower(*args))
    rest = args[6:]  # temperature, top_p, row_max_new

    def lower_loop():  # against the state's shapes (the compiled prefill's outputs, so it is
        # not traced again): they do not depend on the prompt's length
        return compiled_loop(target.cfg, drafter, settings).lower(
            target.params, dparams, run_prefill.out_info, *rest)

    run_loop, c2 = _compiled(target, ("loop", drafter, settings, b, n_slots, dsig, precision),
                             precision, lower_loop)
    compile_s = c1 + c2
    t0 = time.perf_counter()
    final = jax.block_until_ready(run_loop(target.params, dparams, run_prefill(*args), *rest))
    wall = time.perf_counter() - t0
    out, n_out, finish, hist = map(np.asarray, (final.out, final.n_out, final.finish, final.hist))
    calls = int(final.calls)
    plain = np.asarray(final.fb.plain) if final.fb is not None else np.zeros((b,), np.int64)
    results = []
    for i in range(b):
        toks = out[i, :n_out[i]].tolist()
        steps = int(hist[i].sum())
        stats = {
            "new_tokens": len(toks),
            "prompt_tokens": len(ids[i]),
            "target_calls": steps + 1,  # verify passes + the prefill
            "mean_accepted": (len(toks) - 1) / steps if steps else 0.0,
            "acceptance_histogram": hist[i].tolist(),
            "tokens_per_second": len(toks) / wall if wall > 0 else 0.0,
            "wall_seconds": wall,
            "compile_seconds": compile_s,
            "finish_reason": FINISH_NAMES.get(int(finish[i]), "length"),
            "method": drafter.method,
            "tree_tokens": drafter.tree_size,
            "batch_steps": calls,
            "plain_steps": int(plain[i]),  # target calls of one token where trees did not pay
        }
        results.append(GenerationResult(token_ids=toks, text=target.decode(toks), stats=stats))
    return results
