#!/usr/bin/env bash
# Install Codex CLI (npm package @openai/codex) into a project-local prefix so the `codex`
# harness adapter can run it; prints the path of the `codex` binary.
#
#   tools/install_codex.sh             # installs into <repo>/.tools (gitignored)
#   GYRE_TOOLS_PREFIX=/opt/gyre tools/install_codex.sh
#   CODEX_VERSION=latest tools/install_codex.sh   # default: the tested version
#
# A native binary, ~5 s. See tools/install_npm_cli.sh.
set -euo pipefail
# the version Gyre's tests were run with
exec bash "$(dirname "${BASH_SOURCE[0]}")/install_npm_cli.sh" \
  @openai/codex "${CODEX_VERSION:-0.171.0}" codex
