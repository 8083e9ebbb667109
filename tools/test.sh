#!/usr/bin/env bash
# The test command: set up a fresh machine, then lint, type-check and run the whole suite.
#
#   bash tools/test.sh [pytest args...]
#   bash tools/test.sh --fast [pytest args...]   # the developer's loop: the pure and
#                                                # single-process tests (no MPI world, no Slurm,
#                                                # no SmolLM2, nothing marked slow), 2-3.5 minutes
#
# CI runs everything (no --fast).
# ruff and mypy run beside pytest (they take a core for a minute while the suite mostly waits
# on its subprocesses); pytest runs on pytest-xdist workers (`--dist loadgroup`: the Slurm tests
# share one worker, tests/conftest.py). Every skip except the CUDA-only ones fails the run
# (GYRE_NO_SKIP=1). The exit status is non-zero if any of the three failed.
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
if [[ "${1:-}" == --fast ]]; then
  shift
  select=(-m "not mpi and not slurm and not smollm2 and not slow")
fi
bash tools/setup.sh --test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GYRE_NO_SKIP=1
# bytecode is cached (__pycache__/, git-ignored): the suite starts Python processes by the
# hundred, each compiling Gyre's modules without it, and pytest's collection rewrites every
# test module's asserts again (13 s of a worker's 21 s collection, once cached)
unset PYTHONDONTWRITEBYTECODE
# two workers, one per core of the CI machine: a third kept both cores busy all run where two
# left ~9 % idle, but finished no sooner (pytest 827 s with three, 810 s with two, 2026-12-07,
# warm VM) and timing-bound tests had failed with three on 2026-12-06
workers="${GYRE_TEST_WORKERS:-2}"

lint_log=$(mktemp)
trap 'rm -f "$lint_log"' EXIT
(
  set -e
  echo "== ruff"; python3 -m ruff check gyre tests tools
  echo "== ruff format"; python3 -m ruff format --check gyre tests tools
  echo "== mypy"; nice -n 5 python3 -m mypy
) >"$lint_log" 2>&1 &
lint=$!

echo "== $(date -u +%T) pytest ($workers workers)"
status=0
python3 -m pytest -q -n "$workers" --dist loadgroup --durations=20 "${select[@]}" "$@" || status=$?

lint_status=0
wait "$lint" || lint_status=$?
cat "$lint_log"
if ((lint_status)); then echo "== lint / type-check FAILED (exit $lint_status)"; fi
if ((status)); then echo "== pytest FAILED (exit $status)"; fi
exit $((status || lint_status))
