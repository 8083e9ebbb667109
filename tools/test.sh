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
# on its subprocesses); pytest runs on pytest-xdist workers (`--dist loadgroup`, tests/conftest.py).
# The whole suite (no arguments) runs the Slurm tests as a lane of their own beside the
# workers (GYRE_TEST_SLURM_LANE=0: on a worker, as with arguments): they mostly wait on the
# local cluster (a requeue, slurmctld's scheduling), ~200 s of one worker for a fraction of a
# core. Every skip except the CUDA-only ones fails the run (GYRE_NO_SKIP=1). The exit status is
# non-zero if any of them failed.
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

lane=""
if ((${#select[@]} == 0 && $# == 0)) && [[ "${GYRE_TEST_SLURM_LANE:-1}" == 1 ]]; then
  lane_log=$(mktemp)
  trap 'rm -f "$lint_log" "$lane_log"' EXIT
  (
    export GYRE_TEST_TIMINGS="${GYRE_TEST_TIMINGS:+$GYRE_TEST_TIMINGS.slurm}"
    # collecting tests/launch alone, where every Slurm test lives (tests/conftest.py checks):
    # the whole suite's collection costs the lane ~10 CPU-s for its 9 tests
    python3 -m pytest -q -m slurm --durations=10 tests/launch
  ) >"$lane_log" 2>&1 &
  lane=$!
  select=(-m "not slurm")
fi

echo "== $(date -u +%T) pytest ($workers workers${lane:+, and the Slurm tests beside them})"
status=0
python3 -m pytest -q -n "$workers" --dist loadgroup --durations=20 "${select[@]}" "$@" || status=$?

lane_status=0
if [[ -n "$lane" ]]; then
  wait "$lane" || lane_status=$?
  echo "== $(date -u +%T) the Slurm tests"
  cat "$lane_log"
fi
lint_status=0
wait "$lint" || lint_status=$?
cat "$lint_log"
if ((lint_status)); then echo "== lint / type-check FAILED (exit $lint_status)"; fi
if ((lane_status)); then echo "== pytest of the Slurm tests FAILED (exit $lane_status)"; fi
if ((status)); then echo "== pytest FAILED (exit $status)"; fi
exit $((status || lane_status || lint_status))
