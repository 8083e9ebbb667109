"""Engine servers (`gyre.rollout.serving`) driven against Gyre's embedded engine (same HTTP
protocol, same CLI contract): launch from config, health, then `EngineClient`'s role
switches, abort, weight publication with version confirmation, stop. Plus the launch
environment and the core's side of the NCCL weight-update group (run here with gloo between
two real processes). The request bodies and launch flags are checked against SGLang itself
in test_gpu_sglang_bodies.py.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch

from gyre.errors import ConfigError, EngineError
from gyre.rollout.client import EngineClient
from gyre.rollout.protocol import (
    SamplingParams,
    UpdateGroup,
    distributed_update_body,
    release_procedure,
    resume_procedure,
    tensor_specs,
)
from gyre.rollout.serving.config import ServerConfig
from gyre.rollout.serving.nccl import rank_offsets
from gyre.rollout.serving.process import EngineProcess


def test_launch_commands_from_config():
    sg = ServerConfig(model_path="/m/qwen", tensor_parallel=2, mem_fraction_static=0.6)
    cmd = sg.command(31000)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    pairs = dict(itertools.pairwise(cmd))
    assert pairs["--model-path"] == "/m/qwen" and pairs["--tp-size"] == "2"
    assert pairs["--port"] == "31000" and pairs["--mem-fraction-static"] == "0.6"
    assert pairs["--ep-size"] == "1"  # experts TP-sliced on every GPU unless split
    ep = dict(itertools.pairwise(ServerConfig(model_path="/m/moe", tensor_parallel=4,
                                              expert_parallel=2).command(1)))  # fmt: skip
    assert (ep["--tp-size"], ep["--ep-size"]) == ("4", "2")
    assert "--enable-memory-saver" in cmd  # needed for release/resume of memory occupation
    assert "--enable-weights-cpu-backup" in cmd  # resume brings the weights back, not garbage
    assert pairs["--grammar-backend"] == "llguidance"  # the proxy's forced tool calls
    assert "--skip-tokenizer-init" not in cmd  # it would switch the grammar backend off
    emb = ServerConfig(model_path="tiny", launch="embedded", extra_args=["--threads", "1"])
    assert emb.command(5)[1:5] == ["-m", "gyre.rollout.cli", "--model", "tiny"]
    assert emb.command(5)[-2:] == ["--threads", "1"]
    custom = ServerConfig(model_path="x", launch=["run", "{model_path}:{port}"])
    assert custom.command(7) == ["run", "x:7"]


def test_bad_server_config_is_named():
    with pytest.raises(ConfigError, match="launch: 'vllm'; allowed sglang, embedded"):
        ServerConfig(model_path="m", launch="vllm")
    with pytest.raises(ConfigError, match=r"unknown placeholder \{gpu\}"):
        ServerConfig(model_path="m", launch=["x", "{gpu}"])
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        ServerConfig(model_path="m", mem_fraction_static=1.5)
    with pytest.raises(ConfigError, match="tensor_parallel"):
        ServerConfig(model_path="m", tensor_parallel=0)
    with pytest.raises(
        ConfigError, match="expert_parallel: 3; allowed a divisor of tensor_parallel 4"
    ):
        ServerConfig(model_path="m", tensor_parallel=4, expert_parallel=3)


def test_distributed_update_describes_the_broadcast():
    named = [("model.norm.weight", torch.zeros(4, dtype=torch.bfloat16)),
             ("lm_head.weight", torch.zeros(8, 4))]  # fmt: skip
    upd = distributed_update_body(tensor_specs(named), "gyre_weights", "12")
    assert upd["dtypes"] == ["bfloat16", "float32"] and upd["shapes"] == [[4], [8, 4]]
    assert upd["weight_version"] == "12" and upd["names"][0] == "model.norm.weight"
    assert rank_offsets([1, 2, 4]) == ([1, 2, 4], 8)


ENV_SERVER = (
    "import http.server, os, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        v = os.environ.get('SGLANG_RETURN_ORIGINAL_LOGPROB', '').encode()\n"
    "        self.send_response(200); self.send_header('Content-Length', str(len(v)))\n"
    "        self.end_headers(); self.wfile.write(v)\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def test_servers_start_with_original_logprobs_and_refuse_an_override():
    """SGLang returns log-probs of logits / T unless SGLANG_RETURN_ORIGINAL_LOGPROB=1; Gyre's
    behaviour log-probs are the model's own, so every launched server gets it."""
    proc = EngineProcess(ServerConfig(model_path="x", launch=["{python}", "-c", ENV_SERVER,
                                                              "{port}"]))  # fmt: skip
    url = proc.start()
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.read() == b"1"
    finally:
        proc.stop()
    with pytest.raises(ConfigError, match=r"env\.SGLANG_RETURN_ORIGINAL_LOGPROB: '0'"):
        ServerConfig(model_path="m", env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"})


@pytest.fixture(scope="module")
def server():
    cfg = ServerConfig(model_path="tiny", launch="embedded", weight_version="3",
                       extra_args=["--threads", "1"], startup_timeout=120)  # fmt: skip
    proc = EngineProcess(cfg)
    url = proc.start()
    try:
        yield proc, url
    finally:
        proc.stop()


def _gen(engine: EngineClient, rid: str, n: int = 4):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0)
    return engine.generate([1, 5, 9, 13], sp, rid)


def test_client_switches_roles_aborts_and_publishes(server):
    proc, url = server
    assert proc.alive() and proc.startup_seconds is not None

    async def scenario():
        eng = EngineClient(url, engine_id="cell1")
        assert await eng.weight_version() == "3"
        first = await _gen(eng, "a")
        assert first.finish_type in ("stop", "length") and first.weight_version == "3"
        inflight = asyncio.ensure_future(_gen(eng, "a2", n=4000))
        await asyncio.sleep(0.5)
        await eng.run(release_procedure())  # rollout -> training: pause ("abort") first,
        assert (await inflight).finish_type == "abort"  # SGLang's precondition
        assert (await eng.request("GET", "/health", None))["released"]
        with pytest.raises(EngineError, match="HTTP 503"):
            await _gen(eng, "b")
        await eng.run(resume_procedure())  # training -> rollout: the same weights come back
        again = await _gen(eng, "c")
        assert (
            again.output_ids == first.output_ids and again.output_logprobs == first.output_logprobs
        )
        # reroute: a long call in flight ends with "abort" and keeps its partial output
        long = asyncio.ensure_future(_gen(eng, "d", n=4000))
        await asyncio.sleep(0.5)
        await eng.abort_all()
        assert (await long).finish_type == "abort"
        # burst-end publication on the tensor path: new weights, version tracked
        from gyre.models import load_model

        model, _ = load_model("tiny")
        named = [(k, v * 1.5) for k, v in model.state_dict().items() if k != "lm_head.weight"]
        await eng.update_weights_from_tensor(named, "4")
        await eng.confirm_version("4")
        with pytest.raises(EngineError, match="serves weight_version '4' after publishing '5'"):
            await eng.confirm_version("5")
        after = await _gen(eng, "e")
        assert after.weight_version == "4" and after.output_logprobs != first.output_logprobs
        # the embedded engine serves the update-group routes on CPU: an NCCL group is refused
        # with what it allows (tests/rollout/test_update_group.py runs the gloo path)
        with pytest.raises(EngineError, match="init_weights_update_group: HTTP 400: backend: "
                           "'nccl'; the embedded engine runs on CPU: allowed gloo"):  # fmt: skip
            await eng.init_update_group(UpdateGroup(master_address="127.0.0.1",
                                                    master_port=1, world_size=2), 1)  # fmt: skip

    asyncio.run(scenario())


def test_stop_ends_the_server_and_bad_launch_reports_log():
    cfg = ServerConfig(model_path="tiny", launch="embedded", startup_timeout=120)
    proc = EngineProcess(cfg)
    url = proc.start()
    assert proc.stop() is not None and not proc.alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=2)
    bad = EngineProcess(ServerConfig(model_path="no-such-model", launch="embedded",
                                     startup_timeout=60))  # fmt: skip
    with pytest.raises(EngineError, match="no-such-model"):
        bad.start()
    assert not bad.alive()


RECEIVER = textwrap.dedent(
    """
    import os, sys, torch
    from gyre.rollout.protocol import UpdateGroup
    from gyre.rollout.serving.nccl import open_update_group
    import torch.distributed as dist
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    g = UpdateGroup(master_address="127.0.0.1", master_port=port, world_size=3,
                    group_name="gyre_test", backend="gloo")
    pg = open_update_group(g, rank=rank, timeout=60)
    a, b = torch.empty(3, 2), torch.empty(5, dtype=torch.float64)
    dist.broadcast(a, src=0, group=pg); dist.broadcast(b, src=0, group=pg)
    dist.barrier(group=pg)
    print(float(a.sum()), float(b.sum()), flush=True)
    os._exit(0)  # see EXIT
    """
)
EXIT = """Every member of the gloo group ends with a barrier and os._exit: torch's gloo threads
intermittently abort the interpreter's teardown ("terminate called without an active
exception", SIGABRT) after a successful broadcast — measured 1-3 of 25 three-process runs
with or without destroy_process_group, 0 of 30 with os._exit — which failed a CI run."""


def test_core_side_update_group_broadcasts_in_order():
    """The core listens (`listen`: the port its bind picked, as a publication does) and opens
    its side on that store while two 'engine ranks' join at the port; tensors arrive in order."""
    code = textwrap.dedent(
        """
        import os, sys, torch
        from gyre.rollout.protocol import UpdateGroup
        from gyre.rollout.serving.nccl import broadcast_tensors, listen, open_update_group
        store = listen("127.0.0.1", 3, 60)
        print(store.port, flush=True)
        g = UpdateGroup(master_address="127.0.0.1", master_port=store.port, world_size=3,
                        group_name="gyre_test", backend="gloo")
        pg = open_update_group(g, timeout=60, store=store)
        broadcast_tensors(pg, [torch.ones(3, 2), torch.arange(5, dtype=torch.float64)])
        import torch.distributed as dist
        dist.barrier(group=pg)
        os._exit(0)  # see EXIT
        """
    )
    core = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen[str]] = []
    try:
        assert core.stdout is not None
        port = core.stdout.readline().strip()
        assert port.isdigit(), f"the core printed no port (exit {core.wait(timeout=60)})"
        procs = [subprocess.Popen([sys.executable, "-c", RECEIVER, port, str(r)],
                                  stdout=subprocess.PIPE, text=True) for r in (1, 2)]  # fmt: skip
        outs = [p.communicate(timeout=60)[0].split() for p in procs]
        assert core.wait(timeout=60) == 0
    finally:
        for p in [core, *procs]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert outs == [["6.0", "10.0"], ["6.0", "10.0"]]
