#!/usr/bin/env bash
# Install one npm-packaged harness CLI into a project-local prefix and print the path of its
# binary. tools/install_claude.sh and tools/install_codex.sh call this with their package.
#
#   tools/install_npm_cli.sh PACKAGE VERSION BIN
#   GYRE_TOOLS_PREFIX=/opt/gyre tools/install_npm_cli.sh @openai/codex 0.171.0 codex
#
# Installs into <repo>/.tools (gitignored) unless GYRE_TOOLS_PREFIX is set; VERSION may be
# `latest`. Needs node >= 18 and npm with access to the npm registry. Idempotent: an
# existing install whose `BIN --version` names VERSION is kept.
set -euo pipefail

if (($# != 3)); then
  echo "usage: install_npm_cli.sh PACKAGE VERSION BIN (got $# arguments)" >&2
  exit 2
fi
package="$1" version="$2" name="$3"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${GYRE_TOOLS_PREFIX:-$repo/.tools}"
bin="$prefix/node_modules/.bin/$name"
# Both CLIs start offline with these (no auto-update, no telemetry); others ignore them.
export DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1

command -v npm >/dev/null || { echo "install_npm_cli.sh: npm not found; install nodejs + npm first" >&2; exit 1; }
mkdir -p "$prefix"

if [[ -x "$bin" && "$version" != "latest" ]] && "$bin" --version 2>/dev/null | grep -qwF -- "$version"; then
  echo "$bin"; exit 0
fi

# --prefix keeps everything under $prefix; no global install, no sudo.
npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "$package@$version" >&2

# The packages link a native binary on install; check it really runs offline.
"$bin" --version >&2
echo "$bin"
