#!/usr/bin/env bash
# The whole test suite: unit tests on tiny configs and SmolLM2 integration tests (marked smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
