"""The engine under `generate`: encoded prompts, a built drafter and its parameters -> results.

Runs the compiled prefill and the compiled draft-verify loop (spec_jax.step) for one batch, with
the shapes bucketed so that calls share compiled programs, and measures what it ran. It knows
nothing of how the drafter was chosen (spec_jax.drafting, spec_jax.sizing)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.errors import SpecJaxError
from spec_jax.fallback import Fallback
from spec_jax.heads.base import Drafter
from spec_jax.step import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_RUNNING,
    FINISH_STOP,
    LoopSettings,
    compiled_loop,
    compiled_prefill,
    loop_precision,
)
from spec_jax.target import Target

FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ERROR: "error"}
NONFINITE = ("the target's logits turned non-finite (NaN or inf): the row stopped without "
             "emitting the tokens chosen from them; check the weights and the prompt")
# Compiled loops kept per target, least recently used dropped first. Each XLA:CPU executable holds
# ~1 000 memory maps and a process may have 65 530 (vm.max_map_count): `spec-jax bench --calibrate`
# with four heads compiled ~60 loops in one process and aborted inside LLVM ("Cannot allocate
# memory", then a segfault).
MAX_LOOPS = 24
PROMPT_STEP = 64  # prompts are padded to a multiple of this: one prefill program per bucket
UNLIMITED = np.iinfo(np.int32).max  # the loop's step budget when it runs to the end in one call
SLOT_STEP = 512  # cache slots are a multiple of this: the compiled loop is shared across prompts


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A batch ready to run (`prepare`): its compiled prefill and loop and their inputs. It runs
    once (`run_prepared` or `run_chunks`): the prefill takes its cache's buffers."""

    target: Target
    ids: list[list[int]]
    drafter: Drafter
    dparams: Any
    prefill: Any  # compiled: args -> the loop's start state
    loop: Any  # compiled: (params, dparams, state, temperature, top_p, row_max, budget) -> state
    args: tuple  # the prefill's inputs; args[6:] the loop's per-row settings
    compile_seconds: float


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: dict[str, Any]
    # per token: True where it was a draft token the target accepted (False: a step's own token)
    drafted: list[bool] = dataclasses.field(default_factory=list, repr=False)
    # the target's decode (ids -> text) for `steps`: an attribute, not a field, so that asdict,
    # comparisons and pickles leave the target out (without it, ids are joined as text)
    _decode = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_decode"}

    def steps(self) -> list[tuple[str, str]]:
        """The text step by step: (accepted draft text, the step's own token's text) per target
        call (the prefill's first). The pieces joined are `text`; where a piece's characters
        straddle tokens (bytes of one character in several), they go to the later piece."""
        pieces = token_pieces(self._decode or (lambda ids: " ".join(map(str, ids))),
                              self.token_ids, self.text)
        drafted = self.drafted if len(self.drafted) == len(pieces) else [False] * len(pieces)
        steps, accepted = [], ""
        for piece, d in zip(pieces, drafted):
            if d:
                accepted += piece
            else:
                steps.append((accepted, piece))
                accepted = ""
        if accepted:  # the output ended inside a step (at EOS or the limit)
            steps.append((accepted, ""))
        return steps

    def _repr_html_(self) -> str:
        """The text with each step's accepted draft tokens highlighted (Jupyter shows this)."""
        import html

        parts = []
        for accepted, own in self.steps():
            if accepted:
                parts.append(f'<span style="background:#c8e6c9" title="accepted draft tokens">'
                             f'{html.escape(accepted)}</span>')
            parts.append(html.escape(own))
        s = self.stats
        summary = (f"{s.get('new_tokens', len(self.token_ids))} tokens, "
                   f"{s.get('mean_accepted', 0.0):.2f} per target call, "
                   f"{s.get('method', '')}, finish={s.get('finish_reason', '')}")
        return (f'<div style="white-space:pre-wrap;font-family:monospace">{"".join(parts)}</div>'
                f'<div style="color:#666;font-size:smaller">{html.escape(summary)}; '
                f'<span style="background:#c8e6c9">highlighted</span>: accepted draft tokens</div>')


def token_pieces(decode, ids: Sequence[int], text: str) -> list[str]:
    """`text` (decode(ids)) cut at its tokens: piece i is what token i adds to the decoded prefix
    (empty while the token's character is incomplete); one piece, the whole text, at the end
    where the prefixes do not add up to it (a tokenizer that rewrites earlier text)."""
    pieces, prev = [], ""
    for i in range(len(ids)):
        cur = decode(list(ids[:i + 1])) if i + 1 < len(ids) else text
        cur = cur.rstrip("\ufffd") if i + 1 < len(ids) else cur
        if len(cur) > len(prev) and cur.startswith(prev):
            pieces.append(cur[len(prev):])
            prev = cur
        else:
            pieces.append("")
    if "".join(pieces) != text:
        pieces = [""] * (len(ids) - 1) + [text] if ids else []
    return pieces


def bucket(n: int, step: int) -> int:
    """n rounded up to a multiple of step (at least step)."""
    return max(step, -(-n // step) * step)


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


def pads_freely(target: Target, attn_impl: str = "auto") -> bool:
    """Whether a prompt's results are the same bits however far its batch is padded: with the
    packed CPU kernels each row of a product and each query of the attention is computed alone,
    so a prefill compiled for a longer prompt bucket can serve a shorter prompt (XLA's dot blocks
    its sums by the matrix's shape, so elsewhere each bucket keeps its own program)."""
    from pallas_kernels.cpu import gemm as cpu_gemm
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


def mesh_attn(target: Target, attn_impl: str) -> str:
    """The attention a target on a mesh runs: the same as on one device, "auto" included (the
    platform's choice, `pallas_kernels.dispatch.resolve_impl`). A kernel ("cpu", "pallas",
    "pallas_interpret") runs per device under `jax.shard_map` on its rows and heads
    (`pallas_kernels.sharded`), with no communication; "xla" is partitioned by XLA."""
    return attn_impl


def check_settings(b: int, max_new_tokens, temperature, top_p):
    """Per-row (max_new [b] int32, temperature [b], top_p [b]) from values given once or per row."""
    if b == 0:
        raise SpecJaxError("no prompts: pass at least one")
    row_max = _per_prompt(max_new_tokens, "max_new_tokens", b, integer=True)
    if np.any(row_max < 1):
        raise SpecJaxError("max_new_tokens must be at least 1")
    temps, top_ps = _per_prompt(temperature, "temperature", b), _per_prompt(top_p, "top_p", b)
    if not (np.all(temps >= 0) and np.all((top_ps > 0) & (top_ps <= 1))):  # NaN fails too
        raise SpecJaxError("temperature must be >= 0 and top_p in (0, 1]")
    return row_max, temps, top_ps


def prepare(target: Target, ids: Sequence[Sequence[int]], drafter: Drafter, dparams: Any, row_max,
            temps, top_ps, seed=0, *, attn_impl: str = "auto", stop_at_eos: bool = True,
            accept_rule: str = "exact", precision: str | None = None,
            fallback: Fallback | None = None) -> Prepared:
    """The compiled prefill and loop for a batch of encoded prompts `ids` with `drafter` (its
    params `dparams`), row limits and sampling settings as `check_settings` gives them (compiled
    now where not yet), and their inputs; `fallback` takes plain steps where a row's trees do not
    pay. Nothing runs yet: `run` runs it in one call, `run_chunks` a few steps at a time."""
    b = len(ids)
    max_new = int(row_max.max())
    p_len = max(len(x) for x in ids)
    p_pad = bucket(p_len, PROMPT_STEP)
    # the loop stops each row at its own limit (an input); the static output length is bucketed,
    # so calls that differ only in max_new_tokens share a compiled loop
    out_len = bucket(max_new, 32)
    # the loop's shapes depend on the cache, not the prompt: slots in steps of 512, so prompts of
    # different lengths share one compiled loop (only the cheaper prefill compiles per 64 tokens)
    n_slots = bucket(max(p_pad, p_len + out_len + 2 * drafter.tree_size + drafter.max_depth + 1),
                     SLOT_STEP)
    longest = max(range(b), key=lambda i: len(ids[i]) + row_max[i])
    p_len_i, max_i = len(ids[longest]), int(row_max[longest])
    if p_len_i + max_i > target.cfg.max_position_embeddings:
        raise SpecJaxError(f"prompt ({p_len_i}) + max_new_tokens ({max_i}) exceeds the model's "
                           f"{target.cfg.max_position_embeddings} positions: shorten one of them")
    greedy = not np.any(temps > 0)
    settings = LoopSettings(out_len=out_len, greedy=greedy,
                            eos_ids=target.eos_ids if stop_at_eos else (), attn_impl=attn_impl,
                            accept_rule=accept_rule, fallback=fallback)
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
            target.params, dparams, run_prefill.out_info, *rest,
            jax.ShapeDtypeStruct((), jnp.int32))  # the step budget

    run_loop, c2 = _compiled(target, ("loop", drafter, settings, b, n_slots, dsig, precision),
                             precision, lower_loop)
    return Prepared(target=target, ids=[list(x) for x in ids], drafter=drafter, dparams=dparams,
                    prefill=run_prefill, loop=run_loop, args=args, compile_seconds=c1 + c2)


def run(target: Target, ids: Sequence[Sequence[int]], drafter: Drafter, dparams: Any, row_max,
        temps, top_ps, seed=0, **options) -> list[GenerationResult]:
    """Decode a batch of encoded prompts `ids` with `drafter` (its params `dparams`), row limits
    and sampling settings as `check_settings` gives them, `options` as `prepare` takes them.
    Returns one GenerationResult per row."""
    return run_prepared(prepare(target, ids, drafter, dparams, row_max, temps, top_ps, seed,
                                **options))


def run_prepared(p: Prepared) -> list[GenerationResult]:
    """Run `p` to the end in one call of its loop (no step budget)."""
    t0 = time.perf_counter()
    final = jax.block_until_ready(p.loop(p.target.params, p.dparams, p.prefill(*p.args),
                                         *p.args[6:], jnp.int32(UNLIMITED)))
    return results(p, final, time.perf_counter() - t0)


def run_chunks(p: Prepared, interval: float = 0.1):
    """Run `p` a few steps at a time: the same compiled loop with a step budget, its state
    donated back in for the next chunk. Yields after the prefill's first chunk and each one after:
    (tokens [B, N + D + 1], n_out [B]) as host arrays (the first n_out of each row are its tokens
    so far); returns the results (`StopIteration.value`), whose wall time is the chunks' own
    (the consumer's time between chunks is not counted).

    A chunk runs 1 step first and at most twice the last one's steps after, as many as take
    about `interval` seconds at the last chunk's pace: the first tokens come at once, and a long
    output costs a few chunks per second of generation (each call of the loop costs about
    8 ms more than a step inside it for SmolLM2 on 2 CPU cores: at 0.1 s a chunk, streaming ran
    ~5% slower than `generate`, at 0.05 s ~9%)."""
    params, budget, steps, wall = p.target.params, 0, 1, 0.0
    state = None
    while True:
        t0 = time.perf_counter()
        if state is None:
            state = p.prefill(*p.args)
        budget += steps
        state = jax.block_until_ready(p.loop(params, p.dparams, state, *p.args[6:],
                                             jnp.int32(budget)))
        seconds = time.perf_counter() - t0
        wall += seconds
        # copies: the state's buffers are donated to the next chunk
        out, n_out, finish = (np.array(x) for x in (state.out, state.n_out, state.finish))
        if not np.any(finish == FINISH_RUNNING):
            break
        yield out, n_out
        pace = seconds / steps
        steps = int(max(1, min(2 * steps, interval // pace if pace > 0 else 2 * steps)))
    yield out, n_out
    return results(p, state, wall)


def results(p: Prepared, final, wall: float) -> list[GenerationResult]:
    """One GenerationResult per row from the loop's final state; `wall` the seconds it ran."""
    ids, drafter, b = p.ids, p.drafter, len(p.ids)
    compile_s = p.compile_seconds
    out, n_out, finish, hist, drafted = map(np.asarray, (final.out, final.n_out, final.finish,
                                                         final.hist, final.drafted))
    calls = int(final.calls)
    plain = np.asarray(final.fb.plain) if final.fb is not None else np.zeros((b,), np.int64)
    rows = []
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
        if int(finish[i]) == FINISH_ERROR:
            stats["error"] = NONFINITE
        row = GenerationResult(token_ids=toks, text=p.target.decode(toks), stats=stats,
                               drafted=drafted[i, :n_out[i]].astype(bool).tolist())
        row._decode = p.target.decode
        rows.append(row)
    return rows
