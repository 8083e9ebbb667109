"""Codex CLI as a harness: point it at the proxy, then run `codex exec` unmodified.

Codex reads its model provider from `$CODEX_HOME/config.toml` (default `$HOME/.codex`), not
from the environment, so the `codex` adapter starts this launcher instead of the binary:

    python -m gyre.harness.codex --model gyre --sandbox danger-full-access -- "<task>"

It writes a config whose provider `gyre` has `base_url = $OPENAI_BASE_URL` (the proxy's
`/v1`, set by the runner), `env_key = "OPENAI_API_KEY"` (the execution's key) and
`wire_api = "responses"`, and then replaces itself with
`codex exec --skip-git-repo-check --sandbox S "<task>"` in the workspace. The binary is
looked up on PATH, then `$GYRE_CODEX_BIN`, then `<repo>/.tools/node_modules/.bin`
(`tools/install_codex.sh`); when it is missing the launcher exits 127 saying how to install it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from gyre.harness.adapters import REPO_ROOT

INSTALL = "tools/install_codex.sh (npm package @openai/codex)"
SANDBOXES = ("read-only", "workspace-write", "danger-full-access")


def config_toml(model: str, base_url: str) -> str:
    """Codex's config.toml for the proxy as its only model provider."""
    q = json.dumps  # a JSON string is a valid TOML basic string
    return "\n".join(
        [
            f"model = {q(model)}",
            'model_provider = "gyre"',
            "check_for_update_on_startup = false",
            "",
            "[model_providers.gyre]",
            'name = "gyre"',
            f"base_url = {q(base_url)}",
            'env_key = "OPENAI_API_KEY"',
            'wire_api = "responses"',
            "",
        ]
    )


def find_codex() -> str | None:
    """The codex binary: PATH, $GYRE_CODEX_BIN, the project-local npm install."""
    explicit = os.environ.get("GYRE_CODEX_BIN")
    if explicit and os.access(explicit, os.X_OK):
        return explicit
    local = REPO_ROOT / ".tools" / "node_modules" / ".bin"
    return shutil.which("codex", path=os.pathsep.join([os.environ.get("PATH", ""), str(local)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model name the proxy serves")
    parser.add_argument("--sandbox", default="danger-full-access", choices=SANDBOXES)
    parser.add_argument("instruction", help="the task")
    args = parser.parse_args(argv)
    base_url = os.environ.get("OPENAI_BASE_URL")
    if not base_url or not os.environ.get("OPENAI_API_KEY"):
        print("gyre.harness.codex: OPENAI_BASE_URL and OPENAI_API_KEY must be set", file=sys.stderr)
        return 2
    codex = find_codex()
    if codex is None:
        print(f"gyre.harness.codex: `codex` not found; install it with {INSTALL}", file=sys.stderr)
        return 127
    home = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(config_toml(args.model, base_url))
    argv_codex = [codex, "exec", "--skip-git-repo-check", "--sandbox", args.sandbox]
    sys.stdout.flush()
    os.execv(codex, [*argv_codex, args.instruction])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
