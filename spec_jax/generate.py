"""`generate`: plain or speculative decoding of one prompt (or a batch), with measured stats.

The user's entry point: it checks the prompts and settings, resolves `draft=` and `tree=` to a
drafter (a sized tree where the tree is left to the sizing: spec_jax.sizing, spec_jax.drafting)
and runs the engine (spec_jax.engine)."""
from __future__ import annotations

import collections
from typing import Any, NamedTuple, Sequence

import numpy as np

import spec_jax.drafting as drafting
import spec_jax.engine as engine
import spec_jax.sizing as sizing
from spec_jax.engine import GenerationResult
from spec_jax.errors import SpecJaxError
from spec_jax.fallback import Fallback
from spec_jax.heads.base import Drafter
from spec_jax.target import Target
from spec_jax.tree_spec import Auto, TreeSpec, parse

__all__ = ["GenerationResult", "Resolved", "TextStream", "generate", "generate_batch",
           "resolve_drafter", "stream"]


class Resolved(NamedTuple):
    drafter: Drafter
    dparams: Any
    fallback: Fallback | None  # plain steps where a row's trees do not pay, or None


def resolve_drafter(target: Target, draft, tree, batch: int = 1, attn_impl: str = "auto",
                    datastore=None, temperature: float = 0.0, top_p: float = 1.0,
                    fallback: bool | float | tuple = True) -> Resolved:
    """(drafter, draft params, fallback) from the `draft=`, `tree=` and `fallback=` arguments of
    generate; `attn_impl` is the draft model's attention (feature drafters).

    For heads and "ngram", a tree left to the sizing (None, or grafts only such as "+ngram:4")
    takes the tree (the chain) sized for this device, model, heads, batch (and datastore) if one
    was (see `spec_jax.sizing`), else the method's default; "auto" sizes it now if it was not.
    Sampling (temperature > 0) has trees sized for its (temperature, top_p): a tree left to the
    sizing falls back to the greedy sizing, "auto" sizes for the setting. With a `datastore`
    (spec_jax.heads.datastore), its chain is grafted on: `+ds:N` tokens where the tree says, as
    sized, else 8. `fallback` (see `generate`) adds plain steps where a row's trees do not pay
    (spec_jax.fallback)."""
    point = _fallback_point(fallback)
    spec = parse(tree)
    drafting.check_draft(draft)
    sized = None
    if spec.sized and not drafting.is_plain(draft) and (datastore is None or draft != "ngram"):
        chosen = sizing.resolve(target, draft, spec, batch, datastore, temperature, top_p)
        if chosen is not None:
            chosen, sized = chosen
            if spec.ngram or (datastore is not None and spec.ds is not None):
                sized = None  # the fallback was measured for exactly the sized choice
        spec = drafting.merge_sized(spec, chosen)
    elif isinstance(spec.base, Auto):
        spec = spec.replace(base=parse(None).base)
    drafter, dparams = drafting.build(target, draft, spec, datastore, attn_impl)
    if type(drafter) is Drafter or fallback is False:
        return Resolved(drafter, dparams, None)
    if fallback is True:  # the sizing's, for exactly its choice; a tree the caller chose: as given
        point = sized
    if point is None or point[0] <= 0:
        return Resolved(drafter, dparams, None)
    return Resolved(drafter, dparams, Fallback(plain_below=point[0], prior=max(point)))


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


def check_rule_and_impl(accept_rule, attn_impl) -> None:
    """Refuse an unknown `accept_rule` or `attn_impl` (one line listing the choices)."""
    from pallas_kernels.dispatch import IMPLS
    from spec_jax.verify import ACCEPT_RULES

    if not isinstance(accept_rule, str) or accept_rule not in ACCEPT_RULES:
        raise SpecJaxError(f"unknown accept_rule {accept_rule!r}: choose one of "
                           f"{', '.join(ACCEPT_RULES)}")
    if not isinstance(attn_impl, str) or attn_impl not in IMPLS:
        raise SpecJaxError(f"unknown attn_impl {attn_impl!r}: choose one of {', '.join(IMPLS)}")


def sizing_setting(temperature: np.ndarray, top_p: np.ndarray) -> tuple[float, float]:
    """The (temperature, top_p) a batch's tree is sized for: greedy if every row is greedy, else
    the commonest setting of its sampling rows (a batch with any sampling row verifies by
    sampling), the first row's among equals."""
    sampled = collections.Counter((float(t), float(p)) for t, p in zip(temperature, top_p) if t > 0)
    return sampled.most_common(1)[0][0] if sampled else (0.0, 1.0)  # ties: first seen first

def generate(target: Target, prompt: str | Sequence[int] | Sequence[dict],
             max_new_tokens: int = 128, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chat: bool = True,
             draft=None, tree=None, attn_impl: str = "auto", stop_at_eos: bool = True,
             accept_rule: str = "exact", precision: str | None = None,
             datastore=None, fallback: bool | float | tuple = True) -> GenerationResult:
    """Generate up to max_new_tokens after `prompt`: a string, a list of token ids, or a
    conversation (chat messages [{"role": "user", "content": ...}, {"role": "assistant", ...},
    ...], ending with the user's turn).

    draft: None (plain decoding), "ngram", "mtp" (the MTP layers a converted target ships), or
    heads from `init_draft`/`load_draft`.
    tree: for heads, None (the tree sized for this device if one was, else the method's default),
    "auto" (size it now if it was not: a one-off measurement, see `spec_jax.sizing`; with
    temperature > 0, for that temperature and top_p),
    "dynamic:TOP_K,DEPTH,TOTAL", "mc_sim_7b_63", "medusa", "chain:N", or a list of paths;
    "TREE+ngram:N" grafts the n-gram chain of the context on, "TREE+ds:N" the datastore's, and
    "dynamic:K,D,T+ngram:N+ds:M+ranked" ranks both chains' tokens among the dynamic tree's
    candidates, so the tree keeps T tokens (spec_jax.compose.graft); a
    switch ({"switch": [...], "policy": [...]}, spec_jax.compose.switch) picks per row and step
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
    (`spec_jax.fallback`); False never does; a number is the break-even (tokens per tree
    step) for any tree, a pair (break-even, expected tokens per tree step) both.
    """
    batch = generate_batch(target, [prompt], max_new_tokens, temperature=temperature, top_p=top_p,
                           seed=[seed], chat=chat, draft=draft, tree=tree, attn_impl=attn_impl,
                           stop_at_eos=stop_at_eos, accept_rule=accept_rule, precision=precision,
                           datastore=datastore, fallback=fallback)
    return batch[0]


def generate_batch(target: Target, prompts: Sequence, max_new_tokens: int | Sequence[int] = 128, *,
                   temperature: float | Sequence[float] = 0.0, top_p: float | Sequence[float] = 1.0,
                   seed: int | Sequence[int] = 0, chat: bool = True, draft=None,
                   tree: TreeSpec | str | dict | None = None, attn_impl: str = "auto",
                   stop_at_eos: bool = True, accept_rule: str = "exact",
                   precision: str | None = None, datastore=None,
                   fallback: bool | float | tuple = True) -> list[GenerationResult]:
    """Like `generate` for several prompts at once (one batch, per-row lengths and acceptance).

    max_new_tokens, temperature, top_p and seed: one value for every prompt, or one per prompt
    (requests with their own limits and sampling settings in one batch; a row with temperature 0
    decodes greedily, exactly as alone). Each row draws from its own key (`engine.row_keys`). The
    tree is sized for `sizing_setting` of them."""
    if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Sequence):
        raise SpecJaxError(f"generate_batch takes a list of prompts, not a {type(prompts).__name__}: "
                           "wrap one prompt in a list, or call generate")
    return engine.run_prepared(_prepare(
        target, prompts, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        chat=chat, draft=draft, tree=tree, attn_impl=attn_impl, stop_at_eos=stop_at_eos,
        accept_rule=accept_rule, precision=precision, datastore=datastore, fallback=fallback))


def _prepare(target: Target, prompts: Sequence, max_new_tokens, *, temperature, top_p, seed, chat,
             draft, tree, attn_impl, stop_at_eos, accept_rule, precision, datastore,
             fallback) -> engine.Prepared:
    """`generate_batch`'s checks, drafter and compiled programs, ready to run."""
    b = len(prompts)
    check_rule_and_impl(accept_rule, attn_impl)
    attn_impl = engine.mesh_attn(target, attn_impl)
    row_max, temps, top_ps = engine.check_settings(b, max_new_tokens, temperature, top_p)
    ids = [target.encode(p, chat=chat) for p in prompts]
    size_t, size_p = sizing_setting(temps, top_ps)
    drafter, dparams, fb = resolve_drafter(target, draft, tree, b, attn_impl, datastore,
                                           temperature=size_t, top_p=size_p, fallback=fallback)
    return engine.prepare(target, ids, drafter, dparams, row_max, temps, top_ps, seed,
                          attn_impl=attn_impl, stop_at_eos=stop_at_eos, accept_rule=accept_rule,
                          precision=precision, fallback=fb)


def stream(target: Target, prompt: str | Sequence[int] | Sequence[dict],
           max_new_tokens: int = 128, *, interval: float = 0.1, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0, chat: bool = True, draft=None, tree=None,
           attn_impl: str = "auto", stop_at_eos: bool = True, accept_rule: str = "exact",
           precision: str | None = None, datastore=None,
           fallback: bool | float | tuple = True) -> TextStream:
    """`generate`, yielding the new text as the loop accepts it: the pieces joined are the text
    `generate` returns for the same arguments (the same tokens: the loop runs a few steps at a
    time, `engine.run_chunks`). The prompt's checks, the drafter and the compiles happen here;
    the decoding as the stream is read. Every `interval` seconds or so the loop hands back its
    tokens (the first after one step); text that later tokens may still change (a character
    whose bytes are not all out yet) waits for them. The returned `TextStream`'s `result` is the
    GenerationResult once the stream is read to its end (its wall time the loop's own).

        for piece in spec_jax.stream(target, "Tell me a story", 200):
            print(piece, end="", flush=True)
    """
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple, str)):
        raise SpecJaxError("stream takes one prompt (a string, token ids or a conversation), not "
                           "a list of prompts")
    if not interval >= 0:
        raise SpecJaxError(f"interval must be a number of seconds >= 0, not {interval!r}")
    prepared = _prepare(target, [prompt], max_new_tokens, temperature=temperature, top_p=top_p,
                        seed=[seed], chat=chat, draft=draft, tree=tree, attn_impl=attn_impl,
                        stop_at_eos=stop_at_eos, accept_rule=accept_rule, precision=precision,
                        datastore=datastore, fallback=fallback)
    return TextStream(prepared, interval)


class TextStream:
    """An iterator over the new text of one prompt (see `stream`); `result`, the
    GenerationResult, is set when it is exhausted."""

    def __init__(self, prepared: engine.Prepared, interval: float):
        self._target = prepared.target
        self._pieces = self._run(engine.run_chunks(prepared, interval))
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def _run(self, chunks):
        sent = ""
        while True:
            try:
                out, n_out = next(chunks)
            except StopIteration as done:
                self.result = done.value[0]
                break
            text = settled(self._target.decode(out[0, :n_out[0]].tolist()),
                           _cleans_spaces(self._target))
            if len(text) > len(sent) and text.startswith(sent):
                yield text[len(sent):]
                sent = text
        if len(self.result.text) > len(sent) and self.result.text.startswith(sent):
            yield self.result.text[len(sent):]


def _cleans_spaces(target: Target) -> bool:
    """Whether the target's tokenizer removes spaces before punctuation when it decodes
    (Hugging Face's clean_up_tokenization_spaces: "do n't" -> "don't")."""
    return bool(getattr(target.tokenizer, "clean_up_tokenization_spaces", False))


def settled(text: str, cleans_spaces: bool = False) -> str:
    """The part of `text` (the decoded tokens so far) that more tokens will not change: without
    trailing replacement characters (a character whose bytes are not all decoded yet) and, for a
    tokenizer that cleans spaces up, without a short tail after the last space (" n" may become
    "n't")."""
    text = text.rstrip("\ufffd")
    if cleans_spaces:
        cut = text.rfind(" ")
        if cut >= 0 and len(text) - cut <= 3:
            text = text[:cut]
    return text
