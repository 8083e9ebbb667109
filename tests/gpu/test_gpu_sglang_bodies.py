"""Every request Gyre sends to SGLang, and the sglang launch flags, checked by SGLang itself.

Gyre's clients (`EngineClient`, the cell's blocking `engine_host`) drive a recording HTTP
server through every route they use against SGLang; `tools/sglang_check.py` then runs in the
SGLang check venv (`tools/install_sglang_check.sh`, made by `tools/setup.sh --test`: the
pinned release without its GPU stack) and judges the recorded traffic with SGLang's own
code: its route table, its request types (validated the way its FastAPI server does, plus
exact field names, since SGLang drops unknown fields silently), `SamplingParams.verify`,
`MultiprocessingSerializer.deserialize` on the weight payloads, and its argument parser on
the launch flags. Runs on CPU; needs no GPU.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from gyre.errors import ProtocolError
from gyre.rollout.buckets import FlatBucket
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import (
    PAUSE_MODES,
    SamplingParams,
    UpdateGroup,
    release_procedure,
    resume_procedure,
    tensor_specs,
)
from gyre.rollout.serving.config import SERVER_ENV, ServerConfig, hicache_shared_l3
from gyre.rollout.weights import decode_update
from gyre.runtime.cell.engine_host import EngineHost, push_weights
from gyre.runtime.shared.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".tools" / "sglang-check" / "bin" / "python"
PINNED = next(  # the `gpu` extra's pin
    d.split("==")[1]
    for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["gpu"]
    if d.startswith("sglang==")
)
NAMED = [
    ("model.norm.weight", torch.tensor([1.0, -2.0, 3.5])),
    ("lm_head.weight", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)),
    ("model.layers.0.mlp.up_proj.weight", torch.arange(12.0).reshape(3, 4)[:, 1:3]),  # a view
]


class _Recorder(BaseHTTPRequestHandler):
    """Records each request; answers just enough of SGLang's replies for the clients."""

    seen: list[dict[str, Any]]
    state: dict[str, str]

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def _handle(self, method: str) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw) if raw else None
        self.seen.append({"method": method, "route": self.path, "body": body})
        if self.path.startswith("/update_weights_from"):
            self.state["version"] = body["weight_version"]
        reply: Any = {}
        if self.path == "/model_info":
            reply = {"model_path": "/m", "weight_version": self.state["version"]}
        elif self.path == "/generate":
            meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": 1},
                    "prompt_tokens": 1, "completion_tokens": 1, "weight_version": "0",
                    "output_token_logprobs": [[-0.5, 7, None]]}  # fmt: skip
            reply = {"text": "x", "output_ids": [7], "meta_info": meta}
            if body["sampling_params"].get("max_new_tokens") == 0:  # a scoring prefill
                ids = body["input_ids"][body["logprob_start_len"] :]
                meta["input_token_logprobs"] = [[None if k == 0 else -0.5, t, None]
                                                for k, t in enumerate(ids)]  # fmt: skip
                meta["completion_tokens"] = 0
                reply = {"text": "", "output_ids": [], "meta_info": meta}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    handler = type("Recorder", (_Recorder,), {"seen": seen, "state": {"version": "0"}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        thread.join(10)


async def _async_clients(url: str) -> None:
    client = EngineClient(url, engine_id="rec")
    sampled = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20,
                             stop_token_ids=[2], sampling_seed=3)  # fmt: skip
    await client.generate([1, 2, 3], sampled, "g-1")
    await client.generate([1, 2, 3], sampled, "g-1r", routed_from=2)  # routing replay's ask
    await client.generate([1], SamplingParams(temperature=0.0, regex="a+"), "g-2")
    await client.generate([1], SamplingParams(json_schema='{"type": "object"}'), "g-3")
    await client.generate([1], SamplingParams(ebnf='start: "a"+', ignore_eos=True), "g-4")
    scored = await client.score([1, 2, 3, 4], 2, "g-4-score")  # a forced call's rescoring
    assert scored.logprobs == [-0.5, -0.5]
    await client.abort("g-1")
    await client.abort_all()
    for mode in PAUSE_MODES:
        await client.pause(mode)
    await client.resume()
    await client.flush_cache()
    assert await client.health()
    await client.model_info()
    await client.release_memory(["kv_cache"])
    await client.resume_memory(["kv_cache"])
    # a role switch each way, and a publication each way to an engine of TP 2
    await client.run(release_procedure())
    await client.run(resume_procedure(["weights", "kv_cache"]))
    await client.update_weights_from_tensor(NAMED, "5", tp_size=2)
    await client.confirm_version("5")
    group = UpdateGroup(master_address="10.0.0.1", master_port=29500, world_size=3)
    await client.init_update_group(group, 1)
    bucket = FlatBucket.pack(NAMED)  # what the core broadcasts: one flat buffer per bucket
    await client.update_session(lambda: client.update_weights_from_distributed(
        bucket.specs(), group, "6", load_format="flattened_bucket"))  # fmt: skip
    await client.confirm_version("6")
    await client.destroy_update_group(group)  # the core's one group per publication


def _blocking_clients(url: str, tmp: Path) -> None:
    """The cell's engine host of an SGLang engine with --tp-size 2: switches, a publication
    through the host, then the core's `push_weights` to the same engine."""
    config = EngineConfig(backend="sglang", tensor_parallel=2)
    host = EngineHost("/models/qwen", config, tmp / "engine.log", version=0)
    host.url = url
    host.release()
    host.resume()
    host.load_weights(NAMED, 7)
    push_weights(url, NAMED, 8, tp_size=config.tensor_parallel)


def _traffic(url: str, tmp: Path) -> None:
    asyncio.run(_async_clients(url))
    _blocking_clients(url, tmp)


RELEASE = ["pause_generation abort", "release_memory_occupation"]
RESUME = ["resume_memory_occupation", "continue_generation"]
PUBLISH = ["pause_generation retract", "begin_weight_update", "update_weights_from_tensor",
           "end_weight_update", "continue_generation"]  # fmt: skip


def test_role_switches_and_publications_follow_sglang_preconditions(recorder, tmp_path):
    """SGLang asserts it is idle before releasing memory (so: pause in mode "abort" first),
    takes weight updates only inside a weight-update session, and without a pause waits for
    every call in flight before an update: the clients' sequences, call by call."""
    url, seen = recorder
    _traffic(url, tmp_path)
    posts = [
        f"{r['route'][1:]} {r['body'].get('mode', '')}".strip()
        for r in seen
        if r["method"] == "POST" and r["route"] not in ("/generate", "/abort_request")
    ]
    singles = ["pause_generation abort", "pause_generation retract", "pause_generation in_place",
               "continue_generation", "flush_cache", "release_memory_occupation",
               "resume_memory_occupation"]  # fmt: skip
    distributed = [*PUBLISH[:2], "update_weights_from_distributed", *PUBLISH[3:]]
    switches = [*RELEASE, *RESUME, *PUBLISH, "init_weights_update_group", *distributed,
                "destroy_weights_update_group"]  # fmt: skip
    assert posts == singles + switches + RELEASE + RESUME + PUBLISH * 2  # then the cell's host


LAUNCH_EXPECT = {
    "model_path": "/models/qwen", "tp_size": 2, "ep_size": 1, "port": 31000, "mem_fraction_static": 0.6,
    "base_gpu_id": 2, "weight_version": "4", "enable_memory_saver": True,
    "enable_weights_cpu_backup": True, "skip_tokenizer_init": False,
    "grammar_backend": "llguidance", "enable_hierarchical_cache": True, "page_size": 64,
    "hicache_storage_backend": "mooncake", "hicache_write_policy": "write_through",
}  # fmt: skip

# Deliberate mistakes the checker must report (it would pass anything if it were broken).
PROBES = [
    {"method": "GET", "route": "/get_weight_version", "body": None},
    {"method": "POST", "route": "/pause_generation", "body": {"mod": "abort"}},
    {"method": "POST", "route": "/init_weights_update_group",
     "body": {"master_address": "h", "master_port": "x", "rank_offset": 1, "world_size": 2}},
    {"method": "POST", "route": "/destroy_weights_update_group", "body": {"group_name": 7}},
    {"method": "POST", "route": "/generate",
     "body": {"input_ids": [1], "sampling_params": {"max_tokens": 3}}},
    {"method": "POST", "route": "/update_weights_from_tensor",
     "body": {"serialized_named_tensors": ["gARdlC4="], "load_format": "torch_save"}},
    {"method": "POST", "route": "/update_weights_from_tensor",
     "body": {"serialized_named_tensors": ["UEsDBAo="]}},
]  # fmt: skip


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`tools/sglang_check.py --serve` in the SGLang check venv: one import of SGLang (~15
    CPU-s) for every check of this module on this worker (tests/conftest.py puts the tests
    that ask for it on one worker); `sglang(job)` is the report on `job`."""
    if not SGLANG_PYTHON.exists():
        pytest.fail(
            f"{SGLANG_PYTHON} is missing: run `bash tools/setup.sh --test` "
            "(tools/install_sglang_check.sh installs the pinned SGLang without its GPU stack)"
        )
    log = tmp_path_factory.mktemp("sglang") / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(REPO / "tools" / "sglang_check.py"), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def check(job: dict[str, Any]) -> dict[str, Any]:
        stdin.write(json.dumps(job) + "\n")
        stdin.flush()
        line = stdout.readline()
        assert line, f"sglang_check ended ({proc.poll()}): {log.read_text()[-3000:]}"
        return dict(json.loads(line))

    try:
        yield check
    finally:
        stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stdout.close()


@pytest.mark.slow
def test_every_request_and_launch_flag_is_valid_for_sglang(
    recorder, sglang, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gyre.rollout.protocol import ENGINE_KEY_ENV
    from gyre.runtime.cell.engine_host import EngineHost
    from gyre.runtime.shared.config import EngineConfig

    url, recorded = recorder
    _traffic(url, tmp_path)
    seen = list(recorded)  # what the clients sent: a late handler thread must not shift the probes
    hicache_args, _ = hicache_shared_l3(master="h:50051", metadata_server="http://h:8080/m")
    cfg = ServerConfig(model_path="/models/qwen", tensor_parallel=2, mem_fraction_static=0.6,
                       base_gpu_id=2, weight_version="4", extra_args=hicache_args)  # fmt: skip
    argv = cfg.command(31000)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    bad_launch = [*argv[3:], "--skip-tokenizer-init"]
    # what a cell of `gyre run` with engine.backend sglang launches, with the run's engine key
    monkeypatch.setenv(ENGINE_KEY_ENV, "k3y")
    engine = EngineHost("/models/qwen", EngineConfig(backend="sglang", tensor_parallel=2,
                        expert_parallel=2, mem_fraction_static=0.6), tmp_path / "e.log",
                        version=3, routed_experts=True)  # fmt: skip
    run_argv, run_url = engine.command()
    assert run_argv[1:3] == ["-m", "sglang.launch_server"]
    run_expect = {"model_path": "/models/qwen", "tp_size": 2, "ep_size": 2,
                  "mem_fraction_static": 0.6,
                  "weight_version": "3", "api_key": "k3y", "enable_memory_saver": True,
                  "port": int(run_url.rsplit(":", 1)[1]),  # and, the run's calls being seeded:
                  "enable_deterministic_inference": True,
                  "enable_return_routed_experts": True}  # routing replay of an MoE model  # fmt: skip
    report = sglang({
        "requests": seen + PROBES,
        "launch": [{"argv": argv[3:], "expect": LAUNCH_EXPECT},
                   {"argv": bad_launch, "expect": {"skip_tokenizer_init": False}},
                   {"argv": run_argv[3:], "expect": run_expect}],
        "env": sorted(SERVER_ENV),
    })  # fmt: skip

    assert report["sglang"] == PINNED
    checked, probes = report["requests"][: len(seen)], report["requests"][len(seen) :]
    assert [(r["route"], r["errors"]) for r in checked if r["errors"]] == []
    assert all(p["errors"] for p in probes), probes
    assert report["launch"][0] == [] and report["launch"][1], report["launch"]
    assert report["launch"][2] == [], report["launch"]
    assert all(report["env"][name] for name in SERVER_ENV), report["env"]
    routes = {r["route"] for r in checked}
    assert routes == {
        "/generate", "/abort_request", "/pause_generation", "/continue_generation",
        "/flush_cache", "/health", "/model_info", "/release_memory_occupation",
        "/resume_memory_occupation", "/begin_weight_update", "/update_weights_from_tensor",
        "/end_weight_update", "/init_weights_update_group", "/update_weights_from_distributed",
        "/destroy_weights_update_group",
    }  # fmt: skip
    # SGLang's deserializer reads Gyre's tensor payloads back exactly, on every TP rank
    # (EngineClient, the cell's EngineHost and the core's push_weights, all at TP 2)
    updates = [r["tensors"] for r in checked if r["route"] == "/update_weights_from_tensor"]
    assert [sorted({t[0] for t in u}) for u in updates] == [[0, 1]] * 3
    for u in updates:
        assert _by_rank(u) == {0: SENT, 1: SENT}


def test_a_multi_node_engine_launches_each_node_rank_with_sglangs_own_flags(
    sglang, tmp_path: Path
) -> None:
    """An engine on 2 nodes of 8 GPUs (`engine.nodes`): every node rank's argv parses in SGLang
    with its tp_size counting both nodes' GPUs, its own node_rank and node rank 0's rendezvous
    address; a single-node engine carries none of those flags (SGLang's defaults)."""
    config = EngineConfig(backend="sglang", tensor_parallel=8, nodes=2, expert_parallel=16)
    launch = []
    for rank in (0, 1):
        host = EngineHost("/models/moe", config, tmp_path / f"e{rank}.log", version=0,
                          node_rank=rank,
                          dist_init_addr="10.0.0.1:29500")  # fmt: skip
        argv, _ = host.command()
        launch.append({"argv": argv[3:], "expect": {
            "tp_size": 16, "ep_size": 16, "nnodes": 2, "node_rank": rank,
            "dist_init_addr": "10.0.0.1:29500"}})  # fmt: skip
    single, _ = EngineHost("/models/qwen", EngineConfig(backend="sglang", tensor_parallel=8),
                           tmp_path / "s.log", version=0).command()  # fmt: skip
    assert "--nnodes" not in single and "--dist-init-addr" not in single
    launch.append({"argv": single[3:], "expect": {"tp_size": 8, "nnodes": 1, "node_rank": 0,
                                                  "dist_init_addr": None}})  # fmt: skip
    report = sglang({"launch": launch})
    assert report["launch"] == [[], [], []], report["launch"]


SENT = [[n, str(t.dtype), list(t.shape), t.double().flatten().tolist()] for n, t in NAMED]


def _by_rank(tensors: list[list[Any]]) -> dict[int, list[list[Any]]]:
    """The checker's [rank, name, dtype, shape, values] rows, grouped by TP rank."""
    out: dict[int, list[list[Any]]] = {}
    for rank, *rest in tensors:
        out.setdefault(rank, []).append(rest)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_each_tp_rank_gets_a_payload_sglang_reads(
    recorder, sglang, tmp_path: Path, tp: int
) -> None:
    """SGLang's TP rank r deserializes `serialized_named_tensors[r]` only
    (`TpModelWorker.deserialize_own_rank`): a publication to an engine of `tp` ranks carries
    `tp` payloads, and SGLang's `MultiprocessingSerializer.deserialize` reads each one to the
    published tensors. With one payload, rank 1 of a TP 2 engine raised IndexError."""
    url, seen = recorder
    config = EngineConfig(backend="sglang", tensor_parallel=tp)
    host = EngineHost("/models/qwen", config, tmp_path / "engine.log", version=0)
    host.url = url
    host.load_weights(NAMED, 3)
    [update] = [r for r in seen if r["route"] == "/update_weights_from_tensor"]
    assert len(update["body"]["serialized_named_tensors"]) == tp
    [checked] = sglang({"requests": [update]})["requests"]
    assert checked["errors"] == []
    assert _by_rank(checked["tensors"]) == {rank: SENT for rank in range(tp)}
    if tp == 1:  # the embedded engine is one TP rank: it reads exactly this body
        assert [n for n, _ in decode_update(update["body"])[0]] == [n for n, _ in NAMED]
    else:  # ... and says why it refuses a TP engine's
        with pytest.raises(ProtocolError, match="2 payloads; allowed: exactly one"):
            decode_update(update["body"])


@pytest.mark.slow
def test_the_embedded_update_group_routes_take_sglangs_request_types(
    recorder, sglang, tmp_path
) -> None:
    """The embedded engine's /init_weights_update_group, /update_weights_from_distributed and
    /destroy_weights_update_group take exactly the fields of SGLang's request types, and
    read the bodies Gyre's clients send (the ones SGLang validates above)."""
    from gyre.rollout import update_group

    types = {"InitWeightsUpdateGroupReqInput": update_group._INIT,
             "UpdateWeightsFromDistributedReqInput": update_group._UPDATE,
             "DestroyWeightsUpdateGroupReqInput": {"group_name"}}  # fmt: skip
    fields = sglang({"fields": list(types)})["fields"]
    for name, ours in types.items():
        assert set(fields[name]) == ours | update_group._COMMON, name
    url, seen = recorder
    asyncio.run(_async_clients(url))
    body = {r["route"]: r["body"] for r in seen}
    group, offset = update_group.parse_init({**body["/init_weights_update_group"],
                                             "backend": "gloo"})  # fmt: skip
    assert (group.master_address, group.master_port, group.world_size, offset) == (
        "10.0.0.1", 29500, 3, 1)  # fmt: skip
    with pytest.raises(ProtocolError, match="allowed gloo"):  # the engine is a CPU rank
        update_group.parse_init(body["/init_weights_update_group"])
    update = update_group.parse_update(body["/update_weights_from_distributed"])
    assert update.specs == tensor_specs(NAMED) and update.version == "6" and update.bucketed
    assert update_group.parse_destroy(body["/destroy_weights_update_group"]) == group.group_name


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_moe_publication_reaches_sglang_by_checkpoint_names(recorder, tmp_path, family) -> None:
    """SGLang's `load_weights` maps a checkpoint's names, each routed expert's projections a
    tensor of their own (``mlp.experts.{j}.gate_proj.weight``); transformers 5 holds them
    stacked (``mlp.experts.gate_up_proj``). A publication to SGLang carries exactly what
    `save_pretrained` writes, name for name and value for value; the embedded engine gets the
    model's own names."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from gyre.runtime.cell.engine_host import engine_names

    config = AutoConfig.for_model(
        model_type=family, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=2, vocab_size=64, tie_word_embeddings=False,
        shared_expert_intermediate_size=24)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "m")
    written = load_file(str(tmp_path / "m" / "model.safetensors"))
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in named)
    url, seen = recorder
    host = EngineHost("/models/moe", EngineConfig(backend="sglang"), tmp_path / "e.log", version=0)
    host.url = url
    host.load_weights(named, 3)
    [update] = [r for r in seen if r["route"] == "/update_weights_from_tensor"]
    sent = dict(decode_update(update["body"])[0])
    assert sorted(sent) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(sent[name], tensor), name
    assert engine_names(EngineConfig(backend="embedded"), named) is named
