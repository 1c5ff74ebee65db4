"""Prompt sets: read prompt files (jsonl with a prompt-like field, JSON lists, MT-bench/Vicuna-bench
`turns`, HumanEval .jsonl.gz) into (id, category, prompt) records — the evaluation sets ship in
`spec_jax/prompts/` (`prompt_set`); and
distilled sets (the target's own answers, written by spec_jax.train.distill) read back as token
sequences for training and datastores.

A multi-turn record (MT-bench's two turns) keeps every turn: `text` is its first, `turns` all of
them. The bench and `scripts/eval_spec.py` play such a record as a conversation, each later turn
asked after the target's own answer to the one before, as the EAGLE and Medusa evaluations do.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from spec_jax.errors import SpecJaxError

PROMPT_FIELDS = ("prompt", "question", "instruction", "text", "turns")
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
PROMPT_SETS = {"mt_bench": "mt_bench/question.jsonl", "vicuna_bench": "vicuna_bench/question.jsonl",
               "humaneval": "humaneval/HumanEval.jsonl.gz"}


def prompt_set(name: str) -> Path:
    """The file of a shipped evaluation set (mt_bench, vicuna_bench, humaneval)."""
    if name not in PROMPT_SETS:
        raise SpecJaxError(f"unknown prompt set {name!r}: choose one of {', '.join(PROMPT_SETS)}")
    return PROMPTS_DIR / PROMPT_SETS[name]


class Prompt(NamedTuple):
    source: str
    id: str
    category: str
    text: str  # the prompt, or a multi-turn record's first turn
    turns: tuple[str, ...] = ()  # a multi-turn record's turns, in order (empty: one turn)


def _text_of(rec) -> str | None:
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    if "turns" in rec and rec["turns"]:
        return rec["turns"][0]  # first turn: a single-turn benchmark
    for f in ("prompt", "question", "instruction", "text"):
        if rec.get(f):
            extra = rec.get("input") or ""
            return rec[f] + (("\n\n" + extra) if isinstance(extra, str) and extra.strip() else "")
    return None


def _records(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.suffix == ".json":
            data = json.load(f)
            yield from (data if isinstance(data, list) else [data])
            return
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)


def prompt_files(path: str | Path) -> list[Path]:
    """The prompt files of a folder (sorted), or [path] for a file."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and (p.suffix in (".json", ".jsonl") or p.name.endswith(".jsonl.gz")))
    if not files:
        raise SpecJaxError(f"no .json/.jsonl/.jsonl.gz prompt files under {path}")
    return files


def read_prompts(path: str | Path) -> list[Prompt]:
    """All prompts of one file, or of every data file under a folder."""
    path = Path(path)
    if path.is_dir():
        return [p for f in prompt_files(path) for p in read_prompts(f)]
    if not path.is_file():
        raise SpecJaxError(f"prompt file {path} does not exist")
    out = []
    for i, rec in enumerate(_records(path)):
        text = _text_of(rec)
        if not text:
            continue
        rid = str(rec.get("question_id", rec.get("task_id", rec.get("id", i)))) if isinstance(rec, dict) else str(i)
        cat = rec.get("category", "") if isinstance(rec, dict) else ""
        turns = rec.get("turns") if isinstance(rec, dict) else None
        turns = tuple(turns) if isinstance(turns, list) and len(turns) > 1 else ()
        out.append(Prompt(source=path.parent.name, id=rid, category=cat or path.parent.name,
                          text=text, turns=turns))
    if not out:
        raise SpecJaxError(f"{path} has no records with a prompt field ({', '.join(PROMPT_FIELDS)})")
    return out


def conversation(turns, answers) -> list[dict]:
    """Chat messages for the next turn: user turns[i] each followed by assistant answers[i], then
    the user's turns[len(answers)] (what `Target.encode` and `generate` take as a prompt)."""
    msgs = []
    for i, text in enumerate(turns[:len(answers) + 1]):
        msgs.append({"role": "user", "content": text})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i].strip()})
    return msgs


def spread(prompts: list[Prompt], n: int | None) -> list[Prompt]:
    """`n` prompts taken in turn from each category (in file order), so a limited run covers the
    whole set: MT-bench's file lists its 8 categories one after another, and its first 10 prompts
    are all `writing`, the category that accepts least. None: all prompts, in file order."""
    if n is None or n >= len(prompts):
        return list(prompts)
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out, i = [], 0
    while len(out) < n:
        out += [ps[i] for ps in by_cat.values() if i < len(ps)][:n - len(out)]
        i += 1
    return out


def iter_batches(items, size) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def load_distill(path) -> tuple[list[np.ndarray], list[int], dict]:
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise SpecJaxError(f"{path} has no manifest.json: create data with `spec-jax distill`")
    manifest = json.loads((path / "manifest.json").read_text())
    z = np.load(path / "tokens.npz")
    n = manifest["samples"]
    return [z[f"s{i}"] for i in range(n)], [int(x) for x in z["prompt_len"][:n]], manifest


def check_source(path, manifest: dict, target) -> None:
    """Refuse a set distilled from another target."""
    if manifest.get("target_fingerprint") not in (None, target.fingerprint()):
        raise SpecJaxError(f"{path} was distilled from another target: distill data for this one")


def load_sets(paths, target=None) -> tuple[list[np.ndarray], list[int], list[dict]]:
    """Several distilled sets concatenated in the given order (training holds out the end of the
    last one); with `target`, each must have been distilled from it."""
    seqs, plens, manifests = [], [], []
    for path in ([paths] if isinstance(paths, (str, Path)) else paths):
        s, p, m = load_distill(path)
        if target is not None:
            check_source(path, m, target)
        seqs += s
        plens += p
        manifests.append(m)
    return seqs, plens, manifests
