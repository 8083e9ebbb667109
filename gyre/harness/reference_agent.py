"""Gyre's reference agent: a real multi-turn tool-using agent, run as a black-box harness.

It talks to the proxy's OpenAI chat-completions route over plain HTTP (OPENAI_BASE_URL /
OPENAI_API_KEY; `ChatClient`, retrying as the `openai` SDK does), works in
its workspace through confined tools (shell, read_file, write_file — `gyre.harness.tools`),
and exercises the two behaviours that break append-only histories (paper §2.3):

* **compaction** — when a call's context nears the token budget (`--compact-at`), it asks
  the model to summarize the history (`x-gyre-role: compaction`) and continues from a fresh
  history [system, user(task + summary)];
* **delegation** — a `delegate` tool runs a sub-agent with a fresh context
  (`x-gyre-role: subagent`) and returns its report as the tool result. `--delegate force`
  forces the first main turn to call it (tests); `off` hides the tool;
* **evaluator feedback** — lines the runner appends to `--feedback-file` are shown to the
  model as a user message in the next main call, sent with `x-gyre-provenance: evaluator`
  so the proxy records that text with EVALUATOR provenance (never a training target).

Main-agent calls carry `x-gyre-role: main`, so the proxy's role labels are exact.
`--tool-choice required` makes every action turn a tool call (the proxy turns it into
constrained decoding, so even a random tiny model emits valid calls); nonsense arguments
come back to the model as tool errors, never a crash.

    python -m gyre.harness.reference_agent --model tiny --instruction-file task.md \
        --max-turns 8 --compact-at 4000 --delegate auto

Exit status: 0 after a final answer or the turn limit, 1 when the proxy keeps failing,
2 on bad arguments. A JSON summary line goes to stdout at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gyre.errors import ConfigError
from gyre.harness.tools import DELEGATE_SCHEMA, TOOL_SCHEMAS, Workspace
from gyre.tasks.latency import ToolLatency
from gyre.vocabulary import EVALUATOR_HEADERS

ROLE_HEADER = "x-gyre-role"
MAIN_SYSTEM = (
    "You are a software engineering agent working in a project directory. Use the tools to "
    "inspect files, run commands and edit code until the task is done; then reply with a short "
    "final answer and no tool call."
)
SUB_SYSTEM = (
    "You are a sub-agent. Complete the delegated sub-task with the tools, then reply with a "
    "concise report of what you found or changed, with no tool call."
)
COMPACT_PROMPT = (
    "Summarize the work so far for a fresh context: what the task is, what you changed, what "
    "you learned and what remains. Reply with the summary only."
)


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Reference agent settings (command-line flags of the same names)."""

    # model name sent to the proxy
    model: str
    # the task instruction
    instruction: str
    # turns of the main agent (one model call each, compaction calls not counted)
    max_turns: int = 12
    # max_tokens of each call
    max_tokens: int = 512
    # compact when a call's prompt + completion tokens reach this many
    compact_at: int = 6000
    # max_tokens of a compaction (summary) call
    summary_tokens: int = 256
    # off | auto (delegate tool offered) | force (first main turn must delegate)
    delegate: Literal["off", "auto", "force"] = "auto"
    # turns of each sub-agent
    subagent_turns: int = 4
    # auto | required (every action turn must call a tool)
    tool_choice: Literal["auto", "required"] = "auto"
    # sampling temperature
    temperature: float = 1.0
    # shell tool timeout, seconds
    shell_timeout_s: float = 30.0
    # proxy failures tolerated per call before giving up
    max_api_retries: int = 2

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "compact_at", "summary_tokens", "subagent_turns"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)!r} must be >= 1")
        if not self.instruction.strip():
            raise ConfigError("instruction: must not be empty")


@dataclass(slots=True)
class AgentReport:
    """What one run did (printed as JSON at the end)."""

    turns: int = 0
    calls: dict[str, int] = field(
        default_factory=lambda: {"main": 0, "subagent": 0, "compaction": 0}
    )
    compactions: int = 0
    delegations: int = 0
    tool_errors: int = 0
    stop: str = ""


class ProxyError(Exception):
    """The proxy refused a call, or kept failing it through every retry."""


class ChatClient:
    """POST /chat/completions to an OpenAI-compatible base URL; the reply as a dict.

    Retries what the `openai` SDK retries — connection errors and HTTP 408, 409, 429 and
    5xx — up to `max_retries` times with exponential backoff (or the server's
    `retry-after`). Standard library only: an agent launch is a process start, and
    importing the `openai` SDK and making a client costs 1.18 ± 0.08 CPU-s, against
    0.17 ± 0.01 for everything this module imports (tools/bench_process_start.py, 2 cores).
    """

    def __init__(self, base_url: str, api_key: str, *, max_retries: int = 2,
                 timeout: float = 600.0) -> None:  # fmt: skip
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.max_retries = max_retries
        self.timeout = timeout

    def create(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        head = {"content-type": "application/json", "authorization": f"Bearer {self.api_key}"}
        for attempt in range(self.max_retries + 1):
            request = urllib.request.Request(self.url, data, {**head, **headers}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    out: dict[str, Any] = json.loads(reply.read())
                    return out
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {_error_message(e.read())}"
                retry = e.code in (408, 409, 429) or e.code >= 500
                wait = _retry_after(e.headers.get("retry-after"))
            except (OSError, ValueError) as e:  # connection refused or reset, bad JSON
                error, retry, wait = f"{type(e).__name__}: {e}", True, None
            if not retry or attempt == self.max_retries:
                raise ProxyError(error)
            time.sleep(wait if wait is not None else min(0.5 * 2**attempt, 8.0))
        raise AssertionError("unreachable")


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        return str(body["error"]["message"] if isinstance(body.get("error"), dict) else body)
    except (ValueError, AttributeError, KeyError, TypeError):
        return raw[:300].decode(errors="replace")


def _retry_after(value: str | None) -> float | None:
    try:
        return min(max(float(value), 0.0), 60.0) if value else None
    except ValueError:
        return None


class ReferenceAgent:
    """The main loop, compaction and delegation over an OpenAI-compatible chat route."""

    def __init__(
        self,
        config: AgentConfig,
        client: ChatClient,
        workspace: Workspace,
        feedback_file: Path | None = None,
    ) -> None:
        self.cfg = config
        self.feedback_file = feedback_file
        self._feedback_offset = 0
        self.client = client
        self.ws = workspace
        self.report = AgentReport()
        self.tools = TOOL_SCHEMAS + ([DELEGATE_SCHEMA] if config.delegate != "off" else [])
        self._last_tokens = 0

    def run(self) -> AgentReport:
        history = self._fresh_history("")
        for turn in range(self.cfg.max_turns):
            if self._last_tokens >= self.cfg.compact_at and len(history) > 2:
                history = self._compact(history)
            force = self.cfg.delegate == "force" and turn == 0
            # feedback only extends a recorded history, so the proxy marks just that message
            notes = self._new_feedback() if len(history) > 2 else []
            history += [{"role": "user", "content": f"Evaluator feedback:\n{t}"} for t in notes]
            choice = self._call(
                history, "main", self.tools, self._tool_choice(force), evaluator=bool(notes)
            )
            message = choice["message"]
            self.report.turns += 1
            history.append(_assistant_dict(message))
            calls = message.get("tool_calls")
            delegated = bool(calls) and self._run_tool_calls(calls, history)
            if force and not delegated:  # disobeyed, or cut off by max_tokens: delegate anyway
                report = self._subagent(self.cfg.instruction)
                history.append({"role": "user", "content": f"A sub-agent reported:\n{report}"})
            if not calls:
                if choice.get("finish_reason") == "length":  # cut off, not an answer: go on
                    # one environment step all the same (the tool-latency knob), so a model
                    # that rarely finishes a call still has the workload's long tail
                    self.ws.step_latency()
                    continue
                self.report.stop = "final answer"
                return self.report
        self.report.stop = "turn limit"
        return self.report

    def _fresh_history(self, summary: str) -> list[dict[str, Any]]:
        task = self.cfg.instruction
        if summary:
            task = f"{task}\n\nSummary of the work so far:\n{summary}"
        return [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": task}]

    def _new_feedback(self) -> list[str]:
        """Complete feedback lines appended since the last look."""
        if self.feedback_file is None:
            return []
        try:
            data = self.feedback_file.read_bytes()[self._feedback_offset :]
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self._feedback_offset += end
        notes = []
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                text = json.loads(line).get("text")
            except (ValueError, AttributeError):
                continue
            if isinstance(text, str) and text.strip():
                notes.append(text)
        return notes

    def _tool_choice(self, force_delegate: bool) -> Any:
        if force_delegate:
            return {"type": "function", "function": {"name": "delegate"}}
        return self.cfg.tool_choice

    def _run_tool_calls(
        self, tool_calls: list[dict[str, Any]], history: list[dict[str, Any]]
    ) -> bool:
        delegated = False
        for tc in tool_calls:
            args, error = _parse_arguments(tc["function"].get("arguments"))
            name = tc["function"]["name"]
            if error:
                result = error
            elif name == "delegate" and self.cfg.delegate != "off":
                task = args.get("task")
                if not isinstance(task, str) or not task.strip():
                    task = self.cfg.instruction  # nonsense arguments: delegate the whole task
                result = self._subagent(task)
                delegated = True
            else:
                result = self.ws.call(name, args)
            if result.startswith("error:"):
                self.report.tool_errors += 1
            history.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
        return delegated

    def _subagent(self, task: str) -> str:
        """A fresh-context loop on `task`; returns its final text (its report)."""
        self.report.delegations += 1
        history: list[dict[str, Any]] = [
            {"role": "system", "content": SUB_SYSTEM},
            {"role": "user", "content": task},
        ]
        last_text = ""
        for _ in range(self.cfg.subagent_turns):
            message = self._call(history, "subagent", TOOL_SCHEMAS, self.cfg.tool_choice)["message"]
            history.append(_assistant_dict(message))
            last_text = message.get("content") or last_text
            if not message.get("tool_calls"):
                return last_text or "(the sub-agent returned an empty report)"
            for tc in message["tool_calls"]:
                args, error = _parse_arguments(tc["function"].get("arguments"))
                result = error or self.ws.call(tc["function"]["name"], args)
                history.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
        return (
            last_text
            or f"(the sub-agent stopped after {self.cfg.subagent_turns} turns without a report)"
        )

    def _compact(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Summarize `history` in a compaction call; continue from [system, task + summary]."""
        self.report.compactions += 1
        request = [*history, {"role": "user", "content": COMPACT_PROMPT}]
        message = self._call(
            request, "compaction", self.tools, None, max_tokens=self.cfg.summary_tokens
        )["message"]
        summary = (message.get("content") or "").strip() or "(empty summary)"
        self._last_tokens = 0
        return self._fresh_history(summary)

    def _call(
        self,
        messages: list[dict[str, Any]],
        role: str,
        tools: list[dict[str, Any]],
        tool_choice: Any,
        max_tokens: int | None = None,
        evaluator: bool = False,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.cfg.model,
            "messages": messages,
            "tools": tools,
            "max_tokens": max_tokens or self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        headers = {ROLE_HEADER: role, **(EVALUATOR_HEADERS if evaluator else {})}
        response = self.client.create(body, headers)
        self.report.calls[role] = self.report.calls.get(role, 0) + 1
        usage = response.get("usage") or {}
        if role == "main":
            if usage.get("total_tokens"):
                self._last_tokens = int(usage["total_tokens"])
            else:  # no usage reported: estimate ~4 characters per token
                self._last_tokens = len(json.dumps(messages)) // 4
        try:
            choice: dict[str, Any] = response["choices"][0]
            choice["message"].setdefault("content", None)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise ProxyError(f"reply without a choice message: {str(response)[:300]}") from e
        return choice


def _assistant_dict(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message to send back, with the tool calls exactly as received."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": tc["id"],
                "type": "function",
                "function": {
                    "name": tc["function"]["name"],
                    "arguments": tc["function"].get("arguments"),
                },
            }
            for tc in message["tool_calls"]
        ]
    return out


def _parse_arguments(raw: str | None) -> tuple[dict[str, Any], str]:
    try:
        args = json.loads(raw or "{}")
    except ValueError as e:
        return {}, f"error: tool arguments are not valid JSON ({e}); send a JSON object"
    if not isinstance(args, dict):
        return {}, f"error: tool arguments must be a JSON object, got {type(args).__name__}"
    return args, ""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m gyre.harness.reference_agent", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"))
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--model", default=os.environ.get("GYRE_MODEL", ""))
    ap.add_argument("--instruction-file", type=Path)
    ap.add_argument("--instruction", default="")
    ap.add_argument("--workspace", type=Path, default=Path.cwd())
    ap.add_argument("--feedback-file", type=Path, default=None)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--compact-at", type=int, default=6000)
    ap.add_argument("--summary-tokens", type=int, default=256)
    ap.add_argument("--delegate", choices=["off", "auto", "force"], default="auto")
    ap.add_argument("--subagent-turns", type=int, default=4)
    ap.add_argument("--tool-choice", choices=["auto", "required"], default="auto")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--shell-timeout", type=float, default=30.0)
    ap.add_argument(
        "--tool-latency", default=os.environ.get("GYRE_TOOL_LATENCY", ""), help="JSON ToolLatency"
    )
    ap.add_argument("--seed", type=int, default=int(os.environ.get("GYRE_TOOL_SEED", "0")))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        agent = _build(args)
    except (ConfigError, OSError, ValueError) as e:
        print(f"reference_agent: error: {e}", file=sys.stderr)
        return 2
    try:
        report = agent.run()
    except ProxyError as e:
        agent.report.stop = f"proxy error: {e}"
        print(json.dumps({"report": _report_dict(agent.report)}))
        print(f"reference_agent: {agent.report.stop}", file=sys.stderr)
        return 1
    print(json.dumps({"report": _report_dict(report)}))
    return 0


def _build(args: argparse.Namespace) -> ReferenceAgent:
    from gyre.config import load

    if not args.base_url or not args.api_key:
        raise ConfigError(
            "base URL and API key are required (--base-url/--api-key or OPENAI_BASE_URL/OPENAI_API_KEY)"
        )
    instruction = args.instruction_file.read_text() if args.instruction_file else args.instruction
    cfg = AgentConfig(
        model=args.model, instruction=instruction, max_turns=args.max_turns, max_tokens=args.max_tokens,
        compact_at=args.compact_at, summary_tokens=args.summary_tokens, delegate=args.delegate,
        subagent_turns=args.subagent_turns, tool_choice=args.tool_choice, temperature=args.temperature,
        shell_timeout_s=args.shell_timeout,
    )  # fmt: skip
    latency = (
        load(ToolLatency, json.loads(args.tool_latency), path="tool_latency")
        if args.tool_latency
        else None
    )
    ws = Workspace(
        args.workspace, shell_timeout_s=cfg.shell_timeout_s, latency=latency, seed=args.seed
    )
    client = ChatClient(args.base_url, args.api_key, max_retries=cfg.max_api_retries)
    return ReferenceAgent(cfg, client, ws, feedback_file=args.feedback_file)


def _report_dict(r: AgentReport) -> dict[str, Any]:
    return {
        "turns": r.turns, "calls": r.calls, "compactions": r.compactions,
        "delegations": r.delegations, "tool_errors": r.tool_errors, "stop": r.stop,
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
