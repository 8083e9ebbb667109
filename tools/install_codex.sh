#!/usr/bin/env bash
# Install Codex CLI (npm package @openai/codex) into a project-local prefix so the `codex`
# harness adapter can run it; prints the path of the `codex` binary.
#
#   tools/install_codex.sh             # installs into <repo>/.tools (gitignored)
#   GYRE_TOOLS_PREFIX=/opt/gyre tools/install_codex.sh
#   CODEX_VERSION=latest tools/install_codex.sh   # default: the tested version
#
# Needs node >= 18 and npm with access to the npm registry (a native binary, ~5 s).
# Idempotent: an existing install of the requested version is kept.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${GYRE_TOOLS_PREFIX:-$repo/.tools}"
version="${CODEX_VERSION:-0.171.0}"  # the version Gyre's tests were run with
bin="$prefix/node_modules/.bin/codex"

command -v npm >/dev/null || { echo "install_codex.sh: npm not found; install nodejs + npm first" >&2; exit 1; }
mkdir -p "$prefix"

if [[ -x "$bin" && "$version" != "latest" ]] && "$bin" --version 2>/dev/null | grep -q " $version\$"; then
  echo "$bin"; exit 0
fi

npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "@openai/codex@$version" >&2
"$bin" --version >&2  # the package links a native binary: check it runs
echo "$bin"
