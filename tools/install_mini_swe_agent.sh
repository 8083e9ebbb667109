#!/usr/bin/env bash
# Install mini-swe-agent (PyPI) into its own virtual environment under the project-local
# prefix, so its large dependency tree (litellm, datasets, ...) stays out of Gyre's
# environment; prints the path of the `mini` binary the `mini_swe_agent` adapter runs.
#
#   tools/install_mini_swe_agent.sh               # <repo>/.tools/mini-swe-agent (gitignored)
#   MINI_SWE_AGENT_VERSION=latest tools/install_mini_swe_agent.sh   # default: the tested one
#
# Needs python3 with venv and access to PyPI. Idempotent.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${GYRE_TOOLS_PREFIX:-$repo/.tools}"
version="${MINI_SWE_AGENT_VERSION:-2.4.6}"  # the version Gyre's tests were run with
venv="$prefix/mini-swe-agent"
bin="$venv/bin/mini"
spec="mini-swe-agent==$version"
[[ "$version" == "latest" ]] && spec="mini-swe-agent"

# the venv is kept if it holds the version and `mini` can start: its shebang names this
# venv's python (a venv copied or made in another checkout names that one's)
if [[ -x "$bin" && "$version" != "latest" ]] && [[ "$(head -1 "$bin")" == "#!$venv/bin/python"* ]] \
    && "$venv/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('mini-swe-agent') != '$version')" 2>/dev/null; then
  echo "$bin"; exit 0
fi

rm -rf "$venv"
python3 -m venv "$venv"
if [[ -n "${GYRE_UV:-}" ]]; then  # tools/setup.sh's uv
  "$GYRE_UV" pip install -q --python "$venv/bin/python" "$spec" >&2
else
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$spec" >&2
fi
MSWEA_CONFIGURED=true MSWEA_SILENT_STARTUP=1 "$bin" --help >/dev/null
echo "$bin"
