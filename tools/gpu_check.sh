#!/usr/bin/env bash
# Gyre's GPU check: one prepared run on a single GPU (an H200: ≤ 8 minutes), results as JSON.
#
# On the development machine (has PyPI), once, in the repository root:
#     echo /.whl/ >> .git/info/exclude      # keep the wheels out of git
#     tools/gpu_check.sh --fetch-wheels     # WHEELS below, for Python 3.12, into .whl/
# Then with the device tool:
#     run(command="tools/gpu_check.sh", carry=[".whl"], timeout_s=560)
# The device machine has Python 3.12 with a CUDA torch, transformers, numpy, h5py, yaml and no
# network; the carried wheels are installed with --no-index under the prefix /tmp/gyre-site
# (a prefix, not --target: the mpich wheel's mpiexec and libmpi land in its bin/ and lib/,
# which --target drops), the repository is put on PYTHONPATH (no pip install of gyre). Results: $OUT/gpu_check.json (written after
# every section, so a late timeout keeps the finished ones), $OUT/gpu_check.log,
# $OUT/nvidia-smi.txt. Without $OUT they go to docs/results/.
# Arguments after the script name go to tools/gpu_check.py (e.g. --sections engine). With two
# GPUs the megatron_tp2 section runs last (budget 120 s): give it its own run
# (--sections megatron_tp2) if the others use the whole 470 s.
set -uo pipefail
cd "$(dirname "$0")/.."

# Every package tools/gpu_check.py's sections import, directly or through gyre (its `gyre
# run`'s ranks and engines too), beyond the image's torch / transformers / numpy / h5py / yaml
# (gpu_check.py's CARRIED and CARRIED_DEPENDENCIES; `meta.imports` in the JSON; the `run`
# section's CPU rehearsal fails on one missing here): megatron-core; mpi4py and mpich (the
# job's MPI world, mpiexec); tornado (proxy, engine server); orjson (EngineClient's bodies);
# aiohttp (EngineClient's transport) with its own dependencies, idna included (yarl's);
# psutil (rank memory); llguidance (constrained tool calls); prometheus-client (proxy metrics).
WHEELS=(megatron-core==0.16.1 mpi4py==4.1.2 mpich==5.0.2 tornado==6.6.1 orjson==3.13.0
        aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
        frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 idna==3.20
        psutil==7.2.2 llguidance==1.9.1 prometheus-client==0.23.1)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
fi

OUT="${OUT:-$PWD/docs/results}"
mkdir -p "$OUT"
PREFIX=/tmp/gyre-site
SITE="$PREFIX/lib/python$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --ignore-installed --prefix "$PREFIX" .whl/*.whl || { echo "wheel install failed" >&2; exit 1; }
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PREFIX/bin:$PATH" LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
timeout -s KILL 470 python3 tools/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 \
    | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
