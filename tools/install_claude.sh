#!/usr/bin/env bash
# Install Claude Code (npm package @anthropic-ai/claude-code) into a project-local prefix so
# the Claude Code harness adapter can run it; prints the path of the `claude` binary.
#
#   tools/install_claude.sh            # installs into <repo>/.tools (gitignored)
#   GYRE_TOOLS_PREFIX=/opt/gyre tools/install_claude.sh
#   CLAUDE_CODE_VERSION=latest tools/install_claude.sh   # default: the tested version
#
# ~235 MB download, once. See tools/install_npm_cli.sh.
set -euo pipefail
# the version Gyre's tests were run with
exec bash "$(dirname "${BASH_SOURCE[0]}")/install_npm_cli.sh" \
  @anthropic-ai/claude-code "${CLAUDE_CODE_VERSION:-2.1.332}" claude
