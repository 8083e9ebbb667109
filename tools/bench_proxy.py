"""Benchmark the proxy: added latency under concurrency, and the cost of TITO recording.

    python tools/bench_proxy.py overhead [--clients 16 --requests 2000 --engine-ms 20 --words 40]
    python tools/bench_proxy.py recording [--calls 500 --tokens 1000000]
    python tools/bench_proxy.py constrain [--models tiny,smollm2-135m --walks 5]
    python tools/bench_proxy.py load [--executions 1000 --engine-ms 100 --words 40]
    python tools/bench_proxy.py all

Prints one JSON object.

overhead: a constant-latency engine (a stub speaking the /generate protocol, sleeping
`--engine-ms` and answering two tokens) runs in its own process; `gyre proxy` runs in
another in front of it. N concurrent clients (one asyncio process, httpx keep-alive
connections as the openai / anthropic SDKs hold) hold multi-turn chat-completions
conversations through the proxy; the same N clients then call the stub directly with as
many token ids as the proxy sent. Added latency = proxy percentile minus direct
percentile (p50 / p99). A real tiny engine would add its own batching noise on 2 shared
cores; the stub isolates what the proxy adds (HTTP hop, parse, match, render, record).

recording: one synthetic execution (default 500 calls, ~1M stored tokens, 3 compactions,
5 sub-agents) driven through the proxy's own `Execution.prepare` / `record` with
synthesized engine outputs (no HTTP). Times are process CPU seconds (`time.process_time`,
so a busy machine does not inflate them with waiting). Reported separately: encoding new content (chat
template + tokenizer + provenance: O(new tokens)), matching (payload restoration, chain-key
hashing, lookup) and recording (output parsing, tree insertion, context assembly), the HDF5
journal, the JSON decoding of the request bodies a harness would send (O(context), shown
for scale), memory, and stored vs. flat-expanded tokens.

constrain: the forced-call grammar of five Claude-Code-like tools (Bash, Read, Write, Edit,
Glob; tool_choice "required", `tool_string_max` 32) in the engine's constrained decoder
(llguidance): compile time (grammar validation + matcher + first mask) and mask time per
token along random walks (uniform over the allowed tokens until EOS), for each model's
vocabulary; the first walk of a fresh matcher and the later ones are reported apart.

load: N executions (default 1,000), each with one call open at the same moment, through one
`gyre proxy` process to the stub engine in another, which holds every call until all N are
in flight together, then answers after `--engine-ms`. The client (this process, one
keep-alive connection per execution, opened first with `HEAD /`) sends call i to API i % 3
(chat completions, messages, responses). Reports status counts, the engine's peak number of
calls in flight (N: every execution had its call open at once), latency quantiles from send
to answer (which include waiting for the last call to reach the engine: how long after the
first send that was is reported too) and from the engine's answer to the client's (the
return path through the proxy), and proxy CPU per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

# -- the constant-latency engine stub ------------------------------------------------------------


def serve_stub(port: int, latency_ms: float, release_at: int | None = None) -> None:
    """`gyre.proxy.testing.StubEngine` in this process: /generate answers two tokens after
    `latency_ms` (for `overhead` and `load`); `release_at` holds calls until that many are
    in flight at once."""
    from gyre.models import tiny_tokenizer
    from gyre.proxy.testing import StubEngine

    stub = StubEngine(
        tiny_tokenizer().eos_token_id, latency_s=latency_ms / 1000, release_at=release_at
    )

    async def main() -> None:
        bound = stub.listen(port)
        print(f"stub listening on http://127.0.0.1:{bound}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _start(cmd: list[str], marker: str) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode()
        if marker in line:
            return proc, line.strip().rsplit(" ", 1)[-1]
    raise RuntimeError(f"{cmd[:4]} did not start")


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _percentiles(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1000
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "n": len(xs),
    }


async def _post(client: Any, url: str, body: dict[str, Any], key: str | None) -> tuple[float, Any]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    t = time.perf_counter()
    r = await client.post(url, headers=headers, content=json.dumps(body), timeout=120)
    dt = time.perf_counter() - t
    r.raise_for_status()
    return dt, r.json()


def _http(clients: int) -> Any:
    """A keep-alive connection pool, as the openai / anthropic SDKs hold one (httpx)."""
    import httpx2

    limits = httpx2.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    return httpx2.AsyncClient(limits=limits)


async def _proxy_clients(
    url: str, token: str, clients: int, requests: int, turns: int, words: int, tag: str
) -> tuple[list[float], list[int]]:
    http = _http(clients)
    lat: list[float] = []
    sizes: list[int] = []
    per_client = requests // clients

    async def one(c: int) -> None:
        done = 0
        while done < per_client:
            _, reg = await _post(
                http, url + "/admin/executions", {"execution_id": f"{tag}{c}-{done}"}, token
            )
            msgs: list[dict[str, Any]] = [{"role": "system", "content": "Bench agent."}]
            for t in range(min(turns, per_client - done)):
                msgs.append({"role": "user", "content": f"step {t}: " + "word " * words})
                body = {"model": "gyre", "messages": msgs, "max_tokens": 1}
                dt, reply = await _post(http, url + "/v1/chat/completions", body, reg["key"])
                lat.append(dt)
                sizes.append(reply["usage"]["prompt_tokens"])
                msgs.append(reply["choices"][0]["message"])
                done += 1

    async with http:
        await asyncio.gather(*(one(c) for c in range(clients)))
    return lat, sizes


async def _direct_clients(url: str, bodies: list[dict[str, Any]], clients: int) -> list[float]:
    http = _http(clients)
    lat: list[float] = []
    queue = list(bodies)

    async def one() -> None:
        while queue:
            dt, _ = await _post(http, url + "/generate", queue.pop(), None)
            lat.append(dt)

    async with http:
        await asyncio.gather(*(one() for _ in range(clients)))
    return lat


def bench_overhead(
    clients: int, requests: int, engine_ms: float, turns: int, words: int
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp())
    stub, stub_url = _start(
        [sys.executable, __file__, "stub", "--engine-ms", str(engine_ms)], "stub listening on"
    )
    proxy = None
    try:
        proxy, url = _start(
            [
                sys.executable,
                "-m",
                "gyre.proxy.cli",
                "--engine",
                stub_url,
                "--port",
                "0",
                "--model",
                "tiny",
                "--admin-token-file",
                str(tmp / "token"),
            ],
            "proxy listening on",
        )
        token = (tmp / "token").read_text().strip()
        asyncio.run(
            _proxy_clients(url, token, clients, clients * 4, turns, words, "warm")
        )  # warm-up
        cpu0 = _cpu(proxy.pid)
        via_proxy, sizes = asyncio.run(
            _proxy_clients(url, token, clients, requests, turns, words, "run")
        )
        proxy_cpu = (_cpu(proxy.pid) - cpu0) / max(1, len(via_proxy))
        # the same calls sent straight to the engine: same number of input ids each
        bodies = [
            {
                "input_ids": [5] * n,
                "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True,
                "rid": f"d{i}",
            }
            for i, n in enumerate(sizes)
        ]
        direct = asyncio.run(_direct_clients(stub_url, bodies, clients))
    finally:
        for p in (proxy, stub):
            if p is not None:
                p.terminate()
                p.wait(10)
    pp, dp = _percentiles(via_proxy), _percentiles(direct)
    return {
        "clients": clients,
        "engine_latency_ms": engine_ms,
        "turns_per_conversation": turns,
        "words_per_user_message": words,
        "mean_prompt_tokens": round(float(np.mean(sizes)), 1),
        "via_proxy": pp,
        "direct": dp,
        "proxy_cpu_ms_per_call": round(proxy_cpu * 1000, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "added_p50_ms": round(pp["p50_ms"] - dp["p50_ms"], 3),
        "added_p99_ms": round(pp["p99_ms"] - dp["p99_ms"], 3),
        "target": {"added_p50_ms": 2.0, "added_p99_ms": 10.0},
    }


# -- load: many executions, each with one open call -----------------------------------------------


def bench_load(executions: int, engine_ms: float, words: int) -> dict[str, Any]:
    """N executions, each with one call open at once through one `gyre proxy` (processes:
    stub engine, proxy, this client): latency quantiles and status counts."""
    from collections import Counter

    from gyre.proxy.testing import open_calls

    tmp = Path(tempfile.mkdtemp())
    stub_cmd = [sys.executable, __file__, "stub", "--engine-ms", str(engine_ms),
                "--release-at", str(executions)]  # fmt: skip
    stub, stub_url = _start(stub_cmd, "stub listening on")
    proxy = None
    try:
        proxy, url = _start(
            [sys.executable, "-m", "gyre.proxy.cli", "--engine", stub_url, "--port", "0",
             "--model", "tiny", "--admin-token-file", str(tmp / "token")],
            "proxy listening on",
        )  # fmt: skip
        token = (tmp / "token").read_text().strip()
        keys = asyncio.run(_register(url, token, [f"load-{i}" for i in range(executions)]))
        cpu0, t0 = _cpu(proxy.pid), time.perf_counter()
        answers = asyncio.run(open_calls(url, keys, model="gyre", words=words))
        wall = time.perf_counter() - t0
        proxy_cpu = _cpu(proxy.pid) - cpu0
        engine = asyncio.run(_get_json(stub_url + "/stub/stats"))
    finally:
        for p in (proxy, stub):
            if p is not None:
                p.terminate()
                p.wait(10)
    answered_from = (engine["released_at"] or 0.0) + engine_ms / 1000  # the engine answers
    return {
        "executions": executions,
        "engine_latency_ms": engine_ms,
        "words_per_user_message": words,
        "statuses": dict(Counter(a.status for a in answers)),
        "by_api": dict(Counter(f"{a.api} {a.status}" for a in answers)),
        "engine_peak_in_flight": engine["peak"],
        "all_calls_at_engine_after_s": round(
            (engine["released_at"] or 0.0) - min(a.sent_at for a in answers), 3
        ),
        "latency_ms": _quantiles([a.latency_s for a in answers]),
        "after_engine_answer_ms": _quantiles([a.done_at - answered_from for a in answers]),
        "wall_s": round(wall, 3),
        "proxy_cpu_ms_per_call": round(proxy_cpu * 1000 / executions, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def _quantiles(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1000
    q = {f"p{p}": round(float(np.percentile(a, p)), 1) for p in (50, 90, 99)}
    return {**q, "max": round(float(a.max()), 1)}


async def _register(url: str, token: str, ids: list[str]) -> list[str]:
    """Register executions over the admin route (64 at a time); their keys in order."""
    import aiohttp

    headers = {"authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:

        async def one(eid: str) -> str:
            async with http.post(url + "/admin/executions", json={"execution_id": eid},
                                 headers=headers) as r:  # fmt: skip
                r.raise_for_status()
                return str((await r.json())["key"])

        keys: list[str] = []
        for i in range(0, len(ids), 64):
            keys += await asyncio.gather(*(one(e) for e in ids[i : i + 64]))
        return keys


async def _get_json(url: str) -> Any:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return await r.json()


# -- constrained decoding ------------------------------------------------------------------------

FIVE_TOOLS = {
    "Bash": {"command": "string", "timeout": "integer", "description": "string"},
    "Read": {"file_path": "string", "offset": "integer", "limit": "integer"},
    "Write": {"file_path": "string", "content": "string"},
    "Edit": {
        "file_path": "string",
        "old_string": "string",
        "new_string": "string",
        "replace_all": "boolean",
    },
    "Glob": {"pattern": "string", "path": "string"},
}


def _five_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": t} for k, t in props.items()},
                    "required": list(props)[:1],
                },
            },
        }
        for name, props in FIVE_TOOLS.items()
    ]


def bench_constrain(models: list[str], walks: int) -> list[dict[str, Any]]:
    import torch

    from gyre.models import load_tokenizer
    from gyre.proxy.toolcalls import HERMES, forced_call_grammar
    from gyre.rollout.constrain import GrammarCompiler
    from gyre.rollout.protocol import SamplingParams

    out = []
    for spec in models:
        tok = load_tokenizer(spec)
        vocab = len(tok)
        t0 = time.perf_counter()
        compiler = GrammarCompiler(tok, vocab)
        compiler.tokenizer()
        t_vocab = time.perf_counter() - t0
        grammar = forced_call_grammar(HERMES, _five_tools(), None, 32)
        terminators = torch.zeros(vocab, dtype=torch.bool)
        terminators[tok.eos_token_id] = True
        gen = torch.Generator().manual_seed(0)
        compiles = []
        for _ in range(4):  # the first one includes llguidance's one-time set-up
            compiler._compiled.clear()  # compile afresh, as for a new request's tools
            t0 = time.perf_counter()
            state = compiler.constraint(SamplingParams(ebnf=grammar), terminators)
            assert state is not None
            state.allowed()
            compiles.append(time.perf_counter() - t0)
        per_walk = []
        for w in range(walks):
            if w:
                state = compiler.constraint(SamplingParams(ebnf=grammar), terminators)
                assert state is not None
            times = []
            for _ in range(600):
                a = time.perf_counter()
                mask = state.allowed()
                times.append(time.perf_counter() - a)
                ids = mask.nonzero().flatten().tolist()
                token = ids[int(torch.randint(len(ids), (1,), generator=gen))]
                if token == tok.eos_token_id:
                    break
                state.advance(token)
            per_walk.append(times)
        first, rest = per_walk[0], [x for w in per_walk[1:] for x in w]
        out.append(
            {
                "model": spec,
                "vocab": vocab,
                "grammar_chars": len(grammar),
                "vocabulary_index_s": round(t_vocab, 3),
                "first_compile_in_process_ms": round(compiles[0] * 1e3, 2),
                "compile_plus_first_mask_ms": round(float(np.median(compiles[1:])) * 1e3, 2),
                "first_walk_tokens": len(first),
                "mask_ms_per_token_first_walk": round(float(np.mean(first)) * 1e3, 4),
                "mask_ms_per_token_p99": round(float(np.percentile(first + rest, 99)) * 1e3, 4),
                "mask_ms_per_token_later_walks": round(float(np.mean(rest or first)) * 1e3, 4),
            }
        )
    return out


# -- recording cost ----------------------------------------------------------------------------

WORDS = [
    "def",
    "return",
    "self",
    "import",
    "value",
    "error",
    "test",
    "file",
    "path",
    "line",
    "open",
    "close",
    "read",
    "write",
    "for",
    "while",
    "if",
    "else",
    "try",
    "except",
    "class",
    "yield",
    "assert",
    "print",
    "list",
    "dict",
    "tuple",
    "set",
]


class Timer:
    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.samples: list[tuple[int, float, int]] = []  # (context tokens, match s, new tokens)

    def add(self, name: str, t0: float) -> float:
        now = time.process_time()
        self.total[name] = self.total.get(name, 0.0) + now - t0
        return now


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def bench_recording(
    calls: int, tokens: int, compactions: int, subagents: int, sub_calls: int
) -> dict[str, Any]:
    from gyre.models import tiny_tokenizer
    from gyre.proxy.conversation import Conversation, Message
    from gyre.proxy.session import Execution
    from gyre.proxy.tito import ChatRenderer
    from gyre.trajectory.store import TraceWriter

    rng = random.Random(0)
    tok = tiny_tokenizer()
    renderer = ChatRenderer(tok)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
            },
        }
    ]
    words_per_call = max(8, int(tokens / calls / 1.05))  # ~1 token per word here
    tmp = Path(tempfile.mkdtemp())
    writer = TraceWriter(tmp / "bench.h5", run_meta={"bench": "proxy"})
    writer.open_execution("x", {})
    ex = Execution(execution_id="x", role="main", key="k")
    timer = Timer()
    flat_per_call = 0
    json_s = 0.0
    rss0 = psutil.Process().memory_info().rss

    def one_call(conv: Conversation, role: str, reply_words: int) -> Any:
        nonlocal flat_per_call, json_s
        body = json.dumps(
            {"messages": [{"role": m.role, "content": m.content} for m in conv.messages]}
        )
        t0 = time.process_time()
        json.loads(body)
        json_s += time.process_time() - t0
        t0 = time.process_time()
        prep = _prepare(ex, conv, renderer, timer)
        # the engine's part (not timed): sample a reply with one tool call
        reply = (
            _text(rng, reply_words)
            + '\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
        )
        out_ids = [
            *tok.backend_tokenizer.encode(reply, add_special_tokens=False).ids,
            renderer.eos_id,
        ]
        t0 = time.process_time()
        out = ex.parse(
            renderer.decode(out_ids[:-1]), "stop", conv, id_prefix="call_", parse_tools=True
        )
        node = ex.record(
            prep,
            out,
            output_ids=out_ids,
            output_logprobs=np.full(len(out_ids), -1.0),
            role=role,
            policy_version=0,
            engine_id="e0",
            t_start=0.0,
            t_end=1.0,
            attempts=1,
        )
        t0 = timer.add("record", t0)
        writer.record_node("x", node)
        timer.add("store_journal", t0)
        flat_per_call += len(prep.context_ids) + len(out_ids)
        conv.messages.append(
            Message(role="assistant", content=out.content, tool_calls=out.tool_calls)
        )
        return out

    main_calls = calls - compactions - subagents * sub_calls
    segment = main_calls // (compactions + 1)
    sub_at = {int(main_calls * (i + 1) / (subagents + 1)) for i in range(subagents)}
    conv = Conversation(
        system="You are the main agent. " + _text(rng, 200),
        tools=tools,
        messages=[Message(role="user", content="Task: " + _text(rng, 100))],
    )
    wall = time.perf_counter()
    for i in range(main_calls):
        done_main = i + 1
        out = one_call(conv, "main", 60)
        conv.messages.append(
            Message(
                role="tool", content=_text(rng, words_per_call), tool_call_id=out.tool_calls[0].id
            )
        )
        if i in sub_at:  # a sub-agent: fresh context, several turns
            sub = Conversation(
                system="You are a sub-agent.",
                tools=tools,
                messages=[Message(role="user", content=_text(rng, 50))],
            )
            for _ in range(sub_calls):
                sout = one_call(sub, "subagent", 60)
                sub.messages.append(
                    Message(
                        role="tool",
                        content=_text(rng, words_per_call),
                        tool_call_id=sout.tool_calls[0].id,
                    )
                )
        if done_main % segment == 0 and done_main // segment <= compactions:
            summary_req = Conversation(
                system=conv.system,
                tools=tools,
                messages=[
                    *conv.messages,
                    Message(role="user", content="Summarize the conversation."),
                ],
            )
            sout = one_call(summary_req, "compaction", 200)
            conv = Conversation(
                system=conv.system,
                tools=tools,
                messages=[Message(role="user", content="Summary: " + sout.content)],
            )
    wall = time.perf_counter() - wall
    rss = psutil.Process().memory_info().rss - rss0
    t0 = time.process_time()
    writer.close_execution("x", ex.tree, status="completed")
    writer.close()
    close_s = time.process_time() - t0
    stats = ex.tree.stats()
    stored_bytes = sum(
        n.input_ids.nbytes
        + n.input_provenance.nbytes
        + n.output_ids.nbytes
        + n.output_logprobs.nbytes
        for n in ex.tree.nodes
    )
    total = timer.total
    ctx, secs, _new = (np.asarray(x, float) for x in zip(*timer.samples))
    slope, intercept = np.polyfit(ctx / 1000, secs * 1e6, 1)
    match_record = total.get("match", 0) + total.get("record", 0)
    return {
        "calls": len(ex.tree),
        "roots": len(ex.tree.children(0)),
        "leaves": stats.num_leaves,
        "stored_tokens": stats.unique_tokens,
        "flat_tokens_per_leaf": stats.flat_tokens,
        "flat_tokens_per_call": flat_per_call,
        "stored_over_flat_per_call": round(stats.unique_tokens / flat_per_call, 4),
        "stored_over_flat_per_leaf": round(stats.unique_tokens / stats.flat_tokens, 4),
        "encode_new_content_s": round(total.get("encode", 0), 3),
        "matching_s": round(total.get("match", 0), 3),
        "recording_s": round(total.get("record", 0), 3),
        "matching_plus_recording_s": round(match_record, 3),
        "matching_us_per_call_fit": {
            "intercept_us": round(float(intercept), 1),
            "us_per_1k_context_tokens": round(float(slope), 2),
        },
        "store_journal_s": round(total.get("store_journal", 0), 3),
        "store_close_s": round(close_s, 3),
        "request_json_decode_s": round(json_s, 3),
        "wall_s": round(wall, 3),
        "tree_array_bytes": stored_bytes,
        "process_rss_growth_bytes": rss,
        "target": {"matching_plus_recording_s": 1.0, "stored_over_flat": 0.2},
    }


def _prepare(ex: Any, conv: Any, renderer: Any, timer: Timer) -> Any:
    """`Execution.prepare`, its three steps timed apart: match / render (encode) / assemble."""
    from gyre.proxy.session import render

    t0 = time.process_time()
    found = ex.match(conv, renderer, family="gyre")
    t1 = timer.add("match", t0)
    rendered = render(found, conv, renderer)
    t2 = timer.add("encode", t1)
    prep = ex.assemble(found, rendered)
    t3 = timer.add("match", t2)
    timer.samples.append((len(prep.context_ids), (t1 - t0) + (t3 - t2), len(rendered.ids)))
    return prep


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what", choices=["overhead", "recording", "constrain", "load", "all", "stub"]
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=40, help="words per user message")
    parser.add_argument(
        "--engine-ms", type=float, default=None, help="engine latency (overhead 20, load 100)"
    )
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--compactions", type=int, default=3)
    parser.add_argument("--subagents", type=int, default=5)
    parser.add_argument("--sub-calls", type=int, default=10)
    parser.add_argument("--models", default="tiny,smollm2-135m", help="constrain: vocabularies")
    parser.add_argument("--walks", type=int, default=5, help="constrain: random walks")
    parser.add_argument("--executions", type=int, default=1000, help="load: open calls")
    parser.add_argument("--release-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.what == "stub":
        serve_stub(0, _or(args.engine_ms, 0.0), args.release_at)
        return
    out: dict[str, Any] = {}
    if args.what in ("overhead", "all"):
        out["overhead"] = bench_overhead(
            args.clients, args.requests, _or(args.engine_ms, 20.0), args.turns, args.words
        )
    if args.what in ("recording", "all"):
        out["recording"] = bench_recording(
            args.calls, args.tokens, args.compactions, args.subagents, args.sub_calls
        )
    if args.what in ("constrain", "all"):
        out["constrain"] = bench_constrain(args.models.split(","), args.walks)
    if args.what in ("load", "all"):
        out["load"] = bench_load(args.executions, _or(args.engine_ms, 100.0), args.words)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
