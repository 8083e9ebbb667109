"""Workspace isolation: environment hygiene always, filesystem confinement with bubblewrap."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from processes import all_gone, pids_with

from gyre.harness.sandbox import bwrap_available
from gyre.vocabulary import Outcome

needs_bwrap = pytest.mark.skipif(
    not bwrap_available(), reason="bubblewrap (bwrap) not installed: apt-get install bubblewrap"
)


def parse_env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_harness_sees_only_its_own_key_and_no_runner_secrets(make_runner, spec_for, monkeypatch):
    monkeypatch.setenv("GYRE_ADMIN_TOKEN", "admin-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "the-runners-own-key")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runner = make_runner(keep_env=["OMP_NUM_THREADS"])

    async def both():
        return await asyncio.gather(
            runner.run(spec_for("env > ../env.txt", execution_id="a")),
            runner.run(spec_for("env > ../env.txt", execution_id="b")),
        )

    ta, tb = asyncio.run(both())
    for term, key in ((ta, "key-a"), (tb, "key-b")):
        assert term.outcome is Outcome.COMPLETED
        env = parse_env((Path(term.workspace).parent / "env.txt").read_text())
        ws = Path(term.workspace)
        assert env["OPENAI_API_KEY"] == key and env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1"
        assert env["HOME"] == str(ws / ".gyre_home") and env["TMPDIR"].startswith(str(ws))
        assert env["GYRE_EXECUTION_ID"] == term.execution_id and env["OMP_NUM_THREADS"] == "1"
        text = (ws.parent / "env.txt").read_text()
        assert "admin-secret" not in text and "the-runners-own-key" not in text
        assert "ANTHROPIC_API_KEY" not in env  # only the adapter's own API
        other = "key-b" if key == "key-a" else "key-a"
        assert other not in text


@needs_bwrap
def test_bwrap_hides_other_workspaces_hidden_tests_and_the_rest_of_the_disk(
    make_runner, spec_for, suite, tmp_path
):
    runner = make_runner(sandbox="bwrap")
    hidden = suite["add"].scoring.tests
    outside = Path("/var/tmp") / f"gyre-probe-{tmp_path.name}"  # not under the sandbox's /tmp
    spy = f"""
    cat {runner.root}/a/workspace/secret.txt && echo READ-OTHER
    ls {runner.root} > seen.txt
    cat {hidden} | grep -q def && echo READ-HIDDEN
    echo x > {outside} && echo WROTE-OUTSIDE
    echo mine > mine.txt && echo WROTE-OWN
    """

    async def scenario():
        a = asyncio.create_task(
            runner.run(spec_for("echo topsecret > secret.txt; sleep 2", execution_id="a"))
        )
        await asyncio.sleep(0.5)
        b = await runner.run(spec_for(spy, execution_id="b"))
        return await a, b

    ta, tb = asyncio.run(scenario())
    assert runner.events[0].sandbox == "bwrap"
    out = Path(tb.stdout_path).read_text()
    assert "WROTE-OWN" in out
    assert "READ-OTHER" not in out and "READ-HIDDEN" not in out and "WROTE-OUTSIDE" not in out
    assert not outside.exists()  # the rest of the disk is read-only inside the sandbox
    assert (Path(tb.workspace) / "seen.txt").read_text().split() == ["b"]
    assert (Path(ta.workspace) / "secret.txt").read_text() == "topsecret\n"


@needs_bwrap
def test_bwrap_timeout_kills_everything_in_the_sandbox(make_runner, spec_for):
    runner = make_runner(sandbox="bwrap", harness_timeout_s=1.0)
    marker = f"{300 + random.random():.6f}"  # a sleep duration no other process carries
    script = f"(trap '' TERM; sleep {marker}) & sleep {marker}"

    async def run_and_watch():
        task = asyncio.ensure_future(runner.run(spec_for(script)))
        seen: set[int] = set()
        while not task.done():
            seen |= set(pids_with(marker))
            await asyncio.sleep(0.05)
        return await task, seen

    term, seen = asyncio.run(run_and_watch())
    assert term.outcome is Outcome.TIMED_OUT
    assert len(seen) >= 2, "both sleeps (one ignoring SIGTERM) ran inside the sandbox"
    assert all_gone(seen), f"still alive after the timeout: {sorted(seen)}"


def test_sandbox_auto_picks_what_is_installed(make_runner):
    runner = make_runner(sandbox="auto")
    assert runner.sandbox == ("bwrap" if bwrap_available() else "none")
