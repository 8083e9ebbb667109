"""Every `gyre` subcommand, fed bad and random argument values: exit status 2 and one line
naming what was wrong, never a traceback, and nothing started.

In-process (`gyre.cli.main`, what `python -m gyre` runs), so hundreds of command lines take
seconds; a command that starts work on a bad value instead of refusing it trips the alarm.
The random part draws its options from the parser itself, so a new option is fuzzed too.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
LOCAL = str(ROOT / "templates" / "local.yaml")
SIM = str(ROOT / "templates" / "sim" / "nl2repo.yaml")
MISSING = "/nonexistent/gyre-fuzz"


class Started(Exception):
    """The command ran past the point where a bad value should have stopped it."""


@pytest.fixture(autouse=True)
def alarm() -> Iterator[None]:
    def fire(*_: object) -> None:
        raise Started("still running after 20 s: it started work on a bad value")

    old = signal.signal(signal.SIGALRM, fire)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _gyre(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    signal.alarm(20)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    finally:
        signal.alarm(0)
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, argv: list[str], *needles: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, (argv, rc, err[-1500:])
    assert len(lines) == 1 and lines[0].startswith("gyre"), (argv, err[-1500:])
    assert all(n in lines[0] for n in needles), (argv, lines[0])


def known_bad(tmp: Path) -> list[tuple[list[str], list[str]]]:
    """Command lines a user typed (valid but for one value), and what the line must name."""
    a_file = tmp / "a-file"
    a_file.write_text("x")
    empty = tmp / "empty.yaml"
    empty.write_text("")
    token = str(tmp / "admin.token")
    return [
        (["run", LOCAL, "--steps", "0"], ["--steps", "allowed: an integer >= 1"]),
        (["run", LOCAL, "--steps", "two"], ["--steps", "'two'"]),
        (["run", LOCAL, "--run-dir", str(a_file)], ["--run-dir", "is a file"]),
        (["run", LOCAL, "--run-dir", str(a_file / "sub")], ["--run-dir", "is a file"]),
        (["run", str(empty)], ["is empty", "allowed: a YAML mapping"]),
        (["eval", "tiny", "--concurrency", "-1"], ["--concurrency", ">= 1"]),
        (["eval", "tiny", "--instances", "0"], ["--instances", ">= 1"]),
        (["eval", "tiny", "--out", str(a_file)], ["--out", "is a file"]),
        (["sim", SIM, "--sweep", "cells=a,b"], ["cells='a'", "integers >= 1"]),
        (["sim", SIM, "--sweep", "cells=0"], ["cells=0", "integers >= 1"]),
        (["sim", SIM, "--sweep", "cells=4", "--plot", f"{MISSING}/x.png"], ["--plot", "does not exist"]),
        (["sim", SIM, "--timeline", f"{MISSING}/t.png"], ["--timeline", "does not exist"]),
        (["sim", SIM, "--timeline", str(tmp)], ["--timeline", "is a directory"]),
        (["sim", "--replay", str(tmp), "--seeds", "0"], ["--seeds", ">= 1"]),
        (["sim", SIM, "--sweep", "cells=4", "--jobs", "0"], ["--jobs", ">= 1"]),
        (["sim", SIM, "--ablation", "E0"], ["--ablation", "allowed without CONFIG"]),
        (["engine", "--port", "70000"], ["--port", "0..65535"]),
        (["engine", "--threads", "0"], ["--threads", ">= 1"]),
        (["proxy", "--engine", "http://127.0.0.1:9", "--admin-token-file", token],
         ["did not answer /model_info", "pass --model"]),
        (["proxy", "--port", "-5", "--engine", "http://127.0.0.1:9", "--admin-token-file", token],
         ["--port", "0..65535"]),
        (["plan", "--staleness", "-1"], ["--staleness", ">= 0"]),
        (["render", LOCAL, "-o", f"{MISSING}/job.sbatch"], ["--output", "does not exist"]),
        (["submit", LOCAL, "--steps", "0"], ["--steps", ">= 1"]),
        (["submit", LOCAL, "--timeout", "0"], ["--timeout", "> 0"]),
        (["trace", "export", str(tmp), "--out", str(a_file)], ["--out", "is a file"]),
        (["report", MISSING], []),
    ]  # fmt: skip


def test_known_bad_values_get_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, needles in known_bad(tmp_path):
        rc, err = _gyre(argv, capsys)
        _one_line(rc, err, argv, *needles)
    assert not (tmp_path / "a-file" / "sub").exists() and not Path(MISSING).exists()


def _options() -> dict[str, list[argparse.Action]]:
    """Every subcommand (trace's actions as `trace ACTION`) and its options that take a value."""
    top = build_parser()
    out: dict[str, list[argparse.Action]] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(f"{prefix} {name}".strip(), sub)
        if prefix:
            out[prefix] = [a for a in parser._actions if a.option_strings and a.nargs != 0
                           and not isinstance(a, argparse._HelpAction)]  # fmt: skip

    walk("", top)
    return {k: v for k, v in out.items() if k != "trace"}


OPTIONS = _options()
# every positional of every subcommand is a path that does not exist (so whatever the options
# say, the command must refuse); engine and proxy take no positional: a missing model instead
MUST = {"engine": ["--model", MISSING], "proxy": ["--model", MISSING, "--engine",
        "http://127.0.0.1:9", "--admin-token-file", f"{MISSING}-token"]}  # fmt: skip
VALUES = ["-1", "0", "1", "x", "", "1e400", "nan", "-inf", "a=b", "☃", "=", "all", "0.5",
          "70000", "http://", MISSING, f"{MISSING}/x.png"]  # fmt: skip


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(sorted(OPTIONS)))
    argv = command.split()
    parser_positionals = {"run": 1, "eval": 1, "report": 1, "render": 1, "submit": 1, "sim": 1,
                          "trace show": 1, "trace export": 1, "trace stats": 1}  # fmt: skip
    argv += [f"{MISSING}.yaml"] * parser_positionals.get(command, 0)
    argv += MUST.get(command, [])
    for action in draw(st.lists(st.sampled_from(OPTIONS[command] or [None]), max_size=4)):
        if action is None:
            continue
        value = draw(st.sampled_from(list(action.choices or []) + VALUES))
        argv += [draw(st.sampled_from(action.option_strings)), str(value)]
    return argv


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(command_lines())
def test_random_command_lines_never_end_in_a_traceback(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    rc, err = _gyre(argv, capsys)
    if argv[0] == "plan" and rc == 0:  # plan has no positional: a valid target is fine
        return
    _one_line(rc, err, argv)
