#!/usr/bin/env bash
# The test command: set up a fresh machine, then lint, type-check and run the whole suite.
#
#   bash tools/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh --test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "== ruff"; python3 -m ruff check gyre tests tools
echo "== ruff format"; python3 -m ruff format --check gyre tests tools
echo "== mypy"; python3 -m mypy
echo "== pytest"; python3 -m pytest -q --durations=15 "$@"
