#!/usr/bin/env bash
# The main job: install, fetch + convert SmolLM2-135M-Instruct, then decode sample prompts and
# print tokens/s for plain, n-gram and (when checkpoints/ holds them) EAGLE speculative decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/spec-jax demo "$@"
