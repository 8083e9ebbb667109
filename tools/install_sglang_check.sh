#!/usr/bin/env bash
# Install the SGLang release Gyre pins (pyproject's `gpu` extra) without its GPU stack into a
# virtual environment of its own, for tools/sglang_check.py: the test that checks every
# request Gyre sends to SGLang, and the sglang launch flags, with SGLang's own code
# (tests/gpu/test_gpu_sglang_bodies.py). Prints the path of that environment's python.
#
#   tools/install_sglang_check.sh          # <repo>/.tools/sglang-check (gitignored)
#
# The environment sees the installing python's packages (torch, pydantic, transformers,
# numpy: Gyre's own dependencies) through a .pth file, and adds only what importing SGLang's
# request types and argument parser needs: sglang itself (--no-deps: no CUDA torch,
# flashinfer or kernels) and the few pure dependencies those modules import at load time.
# triton is one of them (sglang.srt.utils imports it; torch probes it, so it cannot be
# stubbed): 1 GB unpacked. ~20 s from PyPI. Idempotent.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${GYRE_TOOLS_PREFIX:-$repo/.tools}"
venv="$prefix/sglang-check"
version=$(sed -n 's/.*"sglang==\([^"]*\)".*/\1/p' "$repo/pyproject.toml")
[[ -n "$version" ]] || { echo "install_sglang_check: no sglang==X pin in pyproject.toml" >&2; exit 1; }
py="${PYTHON:-python3}"
pkgs=("sglang==$version" "triton==3.9.0" "msgspec==0.23.0" "pyzmq==27.3.0" "pybase64==1.5.1"
      "dill==0.4.1" "sentencepiece==0.2.3" "compressed-tensors==0.20.1" "loguru==0.7.3"
      "partial-json-parser==0.2.1.1.post7")

if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$version')" 2>/dev/null; then
  echo "$venv/bin/python"; exit 0
fi

rm -rf "$venv"
"$py" -m venv --without-pip "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
parent=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$parent')" > "$site/_gyre_parent.pth"
if [[ -n "${GYRE_UV:-}" ]]; then  # tools/setup.sh's uv
  "$GYRE_UV" pip install -q --python "$venv/bin/python" --no-deps "${pkgs[@]}" >&2
else
  "$py" -m pip --python "$venv/bin/python" install -q --disable-pip-version-check \
    --root-user-action=ignore --no-deps --no-compile "${pkgs[@]}" >&2
fi
echo "$venv/bin/python"
