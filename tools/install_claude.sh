#!/usr/bin/env bash
# Install Claude Code (npm package @anthropic-ai/claude-code) into a project-local prefix so
# the Claude Code harness adapter can run it; prints the path of the `claude` binary.
#
#   tools/install_claude.sh            # installs into <repo>/.tools (gitignored)
#   GYRE_TOOLS_PREFIX=/opt/gyre tools/install_claude.sh
#   CLAUDE_CODE_VERSION=latest tools/install_claude.sh   # default: the tested version
#
# Needs node >= 18 and npm with access to the npm registry (~235 MB download, once).
# Idempotent: an existing install of the requested version is kept.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${GYRE_TOOLS_PREFIX:-$repo/.tools}"
version="${CLAUDE_CODE_VERSION:-2.1.332}"  # the version Gyre's tests were run with
bin="$prefix/node_modules/.bin/claude"

command -v npm >/dev/null || { echo "install_claude.sh: npm not found; install nodejs + npm first" >&2; exit 1; }
mkdir -p "$prefix"

if [[ -x "$bin" && "$version" != "latest" ]] && DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 "$bin" --version 2>/dev/null | grep -q "^$version"; then
  echo "$bin"; exit 0
fi

# --prefix keeps everything under $prefix; no global install, no sudo.
npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error \
  "@anthropic-ai/claude-code@$version" >&2

# The package's postinstall links a native binary; check it really runs offline.
DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 "$bin" --version >&2
echo "$bin"
