"""Every inter-process message is a type whose one handler does what the message asks.

Each message is delivered to its real receiver, and the test asserts the effect the handler
exists to make (a state change, a reply, a message sent on), so an emptied handler fails:

* coordinator — a real `Coordinator` on socket pairs (`CoordinatorWorld`); the test plays the
  proxy node and the cells, answering every message as they would (`play`), up to the point
  where the message under test is due, then delivers it through `MESSAGES`;
* cell — a real `CellProcess` (the tiny model's replica, a real engine process) on a socket
  pair; messages go through its `handlers`, `Stop` through `serve`; training messages come
  from a real `TrainingPlane`, so the cell answers the coordinator's own protocol;
* proxy node — a real `ProxyNode.serve` on its own event-loop thread (`ProxyNodeRig`), its
  harnesses calling the same engine.

`test_every_message_has_an_effect_test` keeps the list complete, and the docs' message table
is checked against the types.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from gyre import fsafe
from gyre.harness.workspace import prepare
from gyre.rollout.client import EngineClient, blocking
from gyre.runtime.cell.engine_host import EngineHost
from gyre.runtime.cell.leader import CellProcess
from gyre.runtime.coordinator.coordinator import MESSAGES, Coordinator
from gyre.runtime.coordinator.ledger import ExecutionState
from gyre.runtime.coordinator.training import TrainingPlane
from gyre.runtime.proxy_node.node import ProxyNode
from gyre.runtime.shared import checkpoint, policies, wire
from gyre.runtime.shared import messages as msg
from gyre.runtime.shared.config import DEFAULT_CONFIG, RunConfig, load_run_config
from gyre.runtime.shared.layout import COORDINATOR_RANK, PROXY_RANK, Ranks
from gyre.schedule import events as ev
from gyre.train.backends import Replica
from gyre.train.comm import Communicators
from gyre.train.rewards import ExecutionOutcome, Status
from gyre.trajectory.tree import Node, Provenance, TrajectoryTree
from gyre.vocabulary import CloseStatus, Outcome, Role, VerdictStatus

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"
COVERED: set[type[msg.Message]] = set()
F = TypeVar("F", bound=Callable[..., None])


TASKS = ("add", "notes")  # the proxy node's, as its ProxyReady names them


def delivers(*kinds: type[msg.Message]) -> Callable[[F], F]:
    """Marks a test as the effect test of these message types (see the last test)."""
    COVERED.update(kinds)
    return lambda test: test


def _config(policy: str | None = None) -> RunConfig:
    return load_run_config(DEFAULT_CONFIG, policy=policy)


def _tree(eid: str, outputs: list[list[int]]) -> TrajectoryTree:
    """A chain of model calls: each takes five user tokens after its parent, samples `outputs[i]`."""
    tree = TrajectoryTree(eid)
    for i, output in enumerate(outputs):
        tree.add_node(
            parent_id=i, input_ids=np.arange(10, 15), input_provenance=np.full(5, Provenance.USER),
            output_ids=np.array(output), output_logprobs=np.full(len(output), -1.5, np.float32),
            role="main", policy_version=0, engine_id="e0", t_start=1.0, t_end=2.0,
            finish_reason="stop", input_key=b"in%d" % i, output_key=b"out%d" % i,
        )  # fmt: skip
    return tree


def _node(eid: str, output: list[int]) -> Node:
    """One recorded model call (an execution's first)."""
    return _tree(eid, [output]).node(1)


def _verdict(reward: float) -> msg.VerdictRecord:
    return msg.VerdictRecord(status=VerdictStatus.SCORED, reward=reward, t=2.0)


def _wait(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s")
        time.sleep(0.02)


def _expect(link: wire.Link, kind: type[msg.Message], timeout: float = 60.0) -> Any:
    """The next message on `link` (skipping none): it must be a `kind`."""
    m = link.recv(timeout=timeout)
    assert isinstance(m, kind), f"expected {kind.__name__}, got {m!r:.300}"
    return m


# ------------------------------------------------------------------ the wire and the docs


def test_docs_message_table_is_generated_from_the_types() -> None:
    text = DOCS.read_text()
    block = re.search(r"<!-- messages:begin -->\n(.*?)\n<!-- messages:end -->", text, re.S)
    assert block is not None, "docs/runtime.md lost its messages markers"
    assert block.group(1) == msg.table(), "regenerate with gyre.runtime.shared.messages.table()"
    documented = set(re.findall(r"^\| `(\w+)` \|", block.group(1), re.M))
    assert documented == {cls.__name__ for cls in msg.ALL}


@pytest.mark.parametrize("cls", msg.ALL, ids=lambda c: c.__name__)
def test_every_message_survives_the_wire_unchanged(cls: type[msg.Message]) -> None:
    kinds = {"int": 1, "str": "e1", "float": 0.5, "bool": True}
    m = cls(**{f.name: kinds.get(str(f.type).split(" ")[0]) for f in dataclasses.fields(cls)})
    assert pickle.loads(pickle.dumps(m)) == m
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(m, "x", 1)  # noqa: B010 (frozen: nobody edits a message in flight)


# ------------------------------------------------------------------ coordinator


class CoordinatorWorld:
    """A started coordinator (proxy node rank 1, cells on ranks 2..4); the test plays the rest."""

    def __init__(self, run_dir: Path, policy: str | None = None, judges: int = 0) -> None:
        cfg = _config(policy)
        self.ranks = [2, 3, 4]
        self.judges = [5 + j for j in range(judges)]  # judge engines' ranks, after the cells
        socks = {r: socket.socketpair() for r in [PROXY_RANK, *self.ranks, *self.judges]}
        link = wire.Link(COORDINATOR_RANK, {r: s[0] for r, s in socks.items()})
        self.peers = {r: wire.Link(r, {COORDINATOR_RANK: s[1]}) for r, s in socks.items()}
        ranks = Ranks(tuple(self.ranks), tuple((r,) for r in self.ranks), tuple(self.judges))
        self.c = Coordinator(cfg, link, run_dir, ranks, {"name": "messages"})
        self.backlog: list[tuple[int, msg.Message]] = []
        self.urls = [f"http://engine{i}" for i in range(len(self.ranks))]
        # as the ranks do: their start-up phases, then their readiness
        self.peers[PROXY_RANK].send(msg.StartupTimes(PROXY_RANK, "proxy", {"imports": 1.0}),
                                    COORDINATOR_RANK)  # fmt: skip
        self.peers[PROXY_RANK].send(msg.ProxyReady("http://proxy", TASKS), COORDINATOR_RANK)
        for i, r in enumerate(self.ranks):
            self.peers[r].send(msg.StartupTimes(r, f"cell{i}", {"imports": 1.0, "model build": 2.0}),
                               COORDINATOR_RANK)  # fmt: skip
            self.peers[r].send(msg.EngineReady(i, self.urls[i], 0), COORDINATOR_RANK)
        for j, r in enumerate(self.judges):
            self.peers[r].send(msg.JudgeReady(j, f"http://judge{j}"), COORDINATOR_RANK)
        self.c.startup()
        self.c.feed(ev.Start(carried=()))

    def handle(self, m: msg.Message) -> None:
        MESSAGES[type(m)](self.c, m)

    def _collect(self) -> None:
        for r, peer in self.peers.items():
            while (m := peer.recv(timeout=0.0)) is not None:
                self.backlog.append((r, m))

    def take(self, kind: type[msg.Message], rank: int | None = None) -> list[Any]:
        """The `kind` messages the coordinator sent (to `rank`) and nobody answered yet."""
        self._collect()
        hit, keep = [], []
        for r, m in self.backlog:
            (hit if isinstance(m, kind) and rank in (None, r) else keep).append((r, m))
        self.backlog = keep
        return [m for _, m in hit]

    def one(self, kind: type[msg.Message], rank: int) -> Any:
        """The one `kind` message the coordinator sent to `rank` (an assertion if not one)."""
        sent = self.take(kind, rank)
        assert len(sent) == 1, f"expected one {kind.__name__} to rank {rank}, got {sent!r:.300}"
        return sent[0]

    def play(self, kind: type[msg.Message], when: Callable[[Any], bool] = bool) -> tuple[int, Any]:
        """Answer as the peers would until the coordinator sends a `kind`; return it unanswered."""
        for _ in range(10_000):
            self._collect()
            if not self.backlog:
                raise AssertionError(f"the run stalled before a {kind.__name__} was sent")
            r, m = self.backlog.pop(0)
            if isinstance(m, kind) and when(m):
                return r, m
            for answer in self.answer(r, m):
                self.handle(answer)
        raise AssertionError(f"no {kind.__name__} after 10000 messages")

    def answer(self, rank: int, m: msg.Message) -> list[msg.Message]:
        """What the proxy node or a cell replies to `m` (no reply: an empty list)."""
        cell = rank - self.ranks[0]
        if isinstance(m, msg.StartExecution):
            x, eid = m.execution, m.execution_id
            return [msg.JournalNode(eid, _node(eid, [7, 8, 9])),
                    msg.HarnessEnded(x, Outcome.COMPLETED, 1.0, 2.0, ""),
                    msg.Assessed(x, _verdict(float(x % 2)), 0)]  # fmt: skip
        if isinstance(m, msg.Drain):
            return [msg.Drained(m.engine)] if m.ack else []
        if isinstance(m, msg.ToTrain | msg.ToRollout):
            return [
                msg.Switched(cell, Role.TRAIN if isinstance(m, msg.ToTrain) else Role.ROLLOUT, 0.1)
            ]
        if isinstance(m, msg.Prepass):
            sums = tuple({r.execution_id: 0.0 for r in s.rows} for s in m.steps)
            return [msg.Prepassed(cell, m.batch, tuple(s.index for s in m.steps), sums, 0.1)]
        if isinstance(m, msg.Accumulate):
            return [
                msg.Accumulated(
                    cell,
                    m.batch,
                    tuple(s.index for s in m.steps),
                    1.0,
                    sum(s.num_targets for s in m.steps),
                    0.1,
                )
            ]
        if isinstance(m, msg.Reduce):
            return [msg.Updated(cell, m.batch, 1.0 if cell == 0 else None, 0.1)]
        if isinstance(m, msg.Publish):
            return [msg.Published(m.version, 0.1, [])]
        return []


@pytest.fixture
def world(tmp_path: Path) -> CoordinatorWorld:
    return CoordinatorWorld(tmp_path)


@delivers(msg.ProxyReady, msg.EngineReady)
def test_startup_reports_give_the_proxy_every_engine(world: CoordinatorWorld) -> None:
    assert world.c.proxy_url == "http://proxy"
    assert {g.task for g in world.c.ledger.groups} == set(TASKS)  # groups draw the proxy's tasks
    urls = {f"e{i}": u for i, u in enumerate(world.urls)}
    assert world.take(msg.SetEngines, PROXY_RANK) == [msg.SetEngines(urls)]
    started = world.take(msg.StartExecution, PROXY_RANK)  # the first groups launched
    assert {m.engine for m in started} == set(urls)


@delivers(msg.JudgeReady)
def test_judge_engines_reach_the_proxy_and_never_the_fleet(tmp_path: Path) -> None:
    world = CoordinatorWorld(tmp_path, judges=2)
    assert world.take(msg.SetJudges, PROXY_RANK) == [
        msg.SetJudges(["http://judge0", "http://judge1"])
    ]
    assert "http://judge0" not in world.c.fleet.urls().values()  # never a publication target
    assert world.c.summary()["judge_engines"] == ["http://judge0", "http://judge1"]
    # judge 1's engine died and serves again at a new URL: the proxy node's judge asks it
    world.handle(msg.JudgeReady(1, "http://judge1-again"))
    assert world.take(msg.SetJudges, PROXY_RANK) == [
        msg.SetJudges(["http://judge0", "http://judge1-again"])
    ]
    assert "http://judge1-again" not in world.c.fleet.urls().values()


@delivers(msg.HarnessEnded)
def test_harness_ended_terminates_the_execution(world: CoordinatorWorld) -> None:
    closed = world.c.sched.f
    world.handle(msg.HarnessEnded(0, Outcome.TIMED_OUT, 1.0, 9.0, "tool too slow"))
    x = world.c.ledger.executions[0]
    assert (x.state, x.outcome, x.reason) == (
        ExecutionState.TERMINATED, CloseStatus.TIMED_OUT, "tool too slow")  # fmt: skip
    assert world.c.sched.f == closed + 1  # the scheduler counts it terminated


@delivers(msg.JournalNode)
def test_journal_node_lands_in_the_executions_journal(world: CoordinatorWorld) -> None:
    world.handle(msg.JournalNode("g0-e1", _node("g0-e1", [4, 5, 6])))
    tree = world.c.rec.journaled_tree("g0-e1")
    assert len(tree) == 1 and tree.node(1).output_ids.tolist() == [4, 5, 6]


@delivers(msg.Assessed)
def test_assessed_records_the_verdict_and_a_complete_group_is_ready(
    world: CoordinatorWorld,
) -> None:
    n = world.c.n
    for x in range(n):
        eid = world.c.ledger.executions[x].id
        world.handle(msg.JournalNode(eid, _node(eid, [7, 8])))
        world.handle(msg.HarnessEnded(x, Outcome.COMPLETED, 1.0, 2.0, ""))
    world.handle(msg.Assessed(0, _verdict(1.0), errors=1))
    first = world.c.ledger.executions[0]
    assert first.state is ExecutionState.RECORDED and first.verdict == _verdict(1.0)
    assert first.tree is not None and len(first.tree) == 1  # the journaled calls
    assert world.c.stats["harness_errors"] == 1 and world.c.ledger.groups[0].assessed == 1
    assert world.c.sched.ready == []
    for x in range(1, n):
        world.handle(msg.Assessed(x, _verdict(float(x % 2)), errors=0))
    assert world.c.sched.ready == [(0, 0)]  # group 0, dispatched at v0, waits for a batch


@delivers(msg.Drained)
def test_drained_sends_the_cell_to_train_with_its_kv_routes(world: CoordinatorWorld) -> None:
    _, drain = world.play(msg.Drain, lambda m: m.ack)
    cell = int(drain.engine[1:])
    world.handle(msg.Drained(drain.engine))
    assert drain.routes, "the switching engine had executions to move"
    to_train = world.one(msg.ToTrain, world.ranks[cell])
    # each moved execution's KV goes to its new engine's URL
    assert to_train.routes == {eid: world.urls[int(e[1:])] for eid, e in drain.routes.items()}


@delivers(msg.Switched)
def test_switched_to_train_makes_the_cell_claim_training_work(world: CoordinatorWorld) -> None:
    rank, _ = world.play(msg.ToTrain)
    cell = rank - world.ranks[0]
    world.handle(msg.Switched(cell, Role.TRAIN, 0.25))
    assert world.c.sched.roles[cell] is Role.TRAIN
    assert len(world.c.progress.switch_seconds) == 1
    assert world.take(msg.Prepass, rank), "the cell in training got no pass"


def test_switched_to_rollout_lets_the_proxy_route_to_the_engine_again(tmp_path: Path) -> None:
    world = CoordinatorWorld(tmp_path, policy="colocate")  # every cell returns after a step
    rank, _ = world.play(msg.ToRollout)
    cell = rank - world.ranks[0]
    world.handle(msg.Switched(cell, Role.ROLLOUT, 0.25))
    assert world.c.sched.roles[cell] is Role.ROLLOUT
    assert world.take(msg.Undrain, PROXY_RANK) == [msg.Undrain(f"e{cell}")]


@delivers(msg.Prepassed)
def test_prepassed_makes_its_gradient_pass_ready(world: CoordinatorWorld) -> None:
    rank, prepass = world.play(msg.Prepass)
    (step,) = prepass.steps
    executions = {r.execution_id for r in step.rows}
    sums = {e: -0.5 for e in executions}
    world.handle(msg.Prepassed(rank - 2, prepass.batch, (step.index,), (sums,), 0.3))
    assert world.c.train.stats.prepass_s == 0.3
    accumulate = world.one(msg.Accumulate, rank)
    assert [s.index for s in accumulate.steps] == [step.index]
    assert set(accumulate.scalars) == executions
    assert all(s.log_ratio != 0.0 for s in accumulate.scalars.values())  # the sums went in


@delivers(msg.Accumulated)
def test_accumulated_counts_the_pass_and_the_last_one_starts_the_update(
    world: CoordinatorWorld,
) -> None:
    rank, acc = world.play(msg.Accumulate)
    world.handle(msg.Accumulated(rank - 2, acc.batch, (acc.steps[0].index,), 2.5, 7, 0.4))
    assert world.c.train.stats.objective == 2.5 and world.c.train.stats.targets == 7
    assert world.c.train.stats.gradient_s == 0.4
    _, reduce = world.play(msg.Reduce)  # the remaining passes, answered as the cells would
    assert reduce.batch == acc.batch


@delivers(msg.Updated)
def test_updated_counts_the_step_and_publishes_the_new_policy(world: CoordinatorWorld) -> None:
    rank, reduce = world.play(msg.Reduce)
    reduces = [(rank, reduce)] + [(r, m) for r in world.ranks for m in world.take(msg.Reduce, r)]
    for r, m in reduces:
        world.handle(msg.Updated(r - 2, m.batch, 3.0 if r == 2 else None, 0.5))
    row = world.c.progress.step_rows[0]
    assert world.c.updates == 1 and row.grad_norm == 3.0
    assert 0 <= row.update_s <= row.train_wall_s  # the update alone: reduce to updated
    publish = world.one(msg.Publish, world.ranks[0])
    assert publish.version == 1 == world.c.sched.version


@delivers(msg.StartupTimes)
def test_startup_times_are_the_summarys_startup_table(world: CoordinatorWorld) -> None:
    """Every rank's start-up phases (sent before its readiness, or later: a cell's other
    ranks) go into the summary's `startup`, with the coordinator's own up to the first step."""
    world.handle(msg.StartupTimes(5, "cell0.1", {"imports": 1.5}))  # a follower, after start-up
    startup = world.c.summary()["startup"]
    ranks = {r["rank"]: r for r in startup["ranks"]}
    assert sorted(ranks) == [0, PROXY_RANK, *world.ranks, 5]
    assert ranks[5] == {"rank": 5, "component": "cell0.1", "phases": {"imports": 1.5}}
    assert ranks[2]["phases"] == {"imports": 1.0, "model build": 2.0}
    assert "proxy start" in ranks[PROXY_RANK]["phases"]  # timed by its ProxyReady's arrival
    assert "ranks ready" in ranks[0]["phases"] and startup["first_step_s"] is None
    rank, reduce = world.play(msg.Reduce)
    reduces = [(rank, reduce)] + [(r, m) for r in world.ranks for m in world.take(msg.Reduce, r)]
    for r, m in reduces:
        world.handle(msg.Updated(r - 2, m.batch, 3.0 if r == 2 else None, 0.5))
    startup = world.c.summary()["startup"]
    own = startup["ranks"][0]["phases"]
    assert list(own)[-2:] == ["first group", "first batch"]
    assert sum(own.values()) == pytest.approx(startup["first_step_s"])


@delivers(msg.Published)
def test_published_moves_the_served_version_and_reloads_missed_engines(
    world: CoordinatorWorld,
) -> None:
    _, publish = world.play(msg.Publish)
    world.handle(msg.Published(publish.version, 0.2, missed=[1]))
    assert world.c.sched.published == publish.version
    assert world.c.stats["publications"] == 1
    assert world.take(msg.Reload, world.ranks[1]) == [msg.Reload()]


@delivers(msg.Evaluated)
def test_a_due_publication_starts_an_evaluation_and_its_point_is_recorded(
    world: CoordinatorWorld,
) -> None:
    from gyre.runtime.coordinator.progress import Validation

    world.c.validation = Validation(every=1, next_due=1)  # eval.every_steps: 1, step 0's done
    _, publish = world.play(msg.Publish)
    world.handle(msg.Published(publish.version, 0.2, missed=[]))
    assert world.take(msg.Evaluate, PROXY_RANK) == [msg.Evaluate(publish.version, None)]
    said = {"messages": [{"role": "user", "content": "hi"}], "final_answer": "x", "calls": 1}
    world.handle(msg.Evaluated(publish.version, {"eval-s1-notes-0": 0.5, "eval-s1-notes-1": None},
                               (1, 2), ("e1",), 10.0, 13.0, {"eval-s1-notes-0": said}))  # fmt: skip
    (point,) = world.c.summary()["evals"]
    assert point["step"] == publish.version and point["reward_mean"] == 0.5
    assert (point["scored"], point["excluded"], point["versions"]) == (1, 1, [1, 2])
    assert point["seconds"] == 3.0 and world.c.validation.in_flight is None
    assert world.take(msg.Evaluate, PROXY_RANK) == []  # the next is due at the next step


@delivers(msg.PolicySaved)
def test_policy_saved_is_listed_in_the_summary(world: CoordinatorWorld) -> None:
    world.handle(msg.PolicySaved(3, "/runs/x/policies/final"))
    assert world.c.summary()["policies"] == ["/runs/x/policies/final"]


@delivers(msg.EngineLost)
def test_engine_lost_moves_its_executions_and_restarts_it(world: CoordinatorWorld) -> None:
    launched = world.take(msg.StartExecution, PROXY_RANK)
    for x in [m.execution for m in launched if m.engine == "e2"][:2]:  # room at engine 2
        world.handle(msg.HarnessEnded(x, Outcome.COMPLETED, 1.0, 2.0, ""))
    world.handle(msg.EngineLost(1, -9))
    assert world.c.stats["engine_losses"] == 1 and world.c.fleet.respawning == {1}
    assert world.take(msg.Respawn, world.ranks[1]) == [msg.Respawn(Role.ROLLOUT)]
    drain = world.one(msg.Drain, PROXY_RANK)
    assert drain.engine == "e1" and not drain.ack
    on_e1 = [m.execution_id for m in launched if m.engine == "e1"]
    assert drain.routes == dict.fromkeys(on_e1[:2], "e2")  # two of its executions fit there


def test_engine_ready_after_a_restart_gives_the_proxy_its_new_url(
    world: CoordinatorWorld,
) -> None:
    world.handle(msg.EngineLost(1, -9))
    world.take(msg.SetEngines)
    world.handle(msg.EngineReady(1, "http://engine1-again", 0))
    assert world.c.fleet.respawning == set() and world.c.fleet[1].url == "http://engine1-again"
    assert world.take(msg.SetEngines, PROXY_RANK) == [
        msg.SetEngines({"e1": "http://engine1-again"})
    ]


def test_an_engine_back_while_the_run_closes_is_not_waited_for_again(
    world: CoordinatorWorld,
) -> None:
    """An engine lost before the last update reports back while the run's executions close:
    the end of the run takes that report, saves the policy and stops (it does not wait out
    timeouts.startup_s for a report that already came)."""
    world.handle(msg.EngineLost(1, -9))
    world.c.cfg.timeouts.startup_s = 5.0  # how long a missed report would be waited for
    live = [i for i, x in enumerate(world.c.ledger.executions) if x.live]
    assert len(live) >= 2  # the close takes several rounds of messages
    summaries: list[dict[str, Any]] = []
    closing = threading.Thread(target=lambda: summaries.append(world.c.finish()), daemon=True)

    def sent(kind: type[msg.Message], rank: int) -> Any:
        got: list[Any] = []
        _wait(lambda: bool(got.extend(world.take(kind, rank)) or got), kind.__name__)
        return got[0]

    def reply(rank: int, m: msg.Message) -> None:
        world.peers[rank].send(m, COORDINATOR_RANK)

    closing.start()
    save = sent(msg.SaveCheckpoint, world.ranks[0])
    reply(world.ranks[0], msg.Checkpointed(0, save.folder, 1, 0.1))
    sent(msg.Cancel, PROXY_RANK)
    reply(world.ranks[1], msg.EngineReady(1, "http://engine1-again", 0))  # during the close
    for x in live:
        reply(PROXY_RANK, msg.HarnessEnded(x, Outcome.CANCELLED, 1.0, 2.0, ""))
        reply(PROXY_RANK, msg.Assessed(x, _verdict(0.0), 0))
    sent(msg.SavePolicy, world.ranks[0])
    reply(world.ranks[0], msg.PolicySaved(0, "/runs/x/policies/final"))
    closing.join(timeout=20)
    assert summaries and summaries[0]["policies"] == ["/runs/x/policies/final"]
    assert world.c.fleet.respawning == set() and world.c.fleet[1].url == "http://engine1-again"


@delivers(msg.Checkpointed)
def test_checkpointed_commits_the_checkpoint(world: CoordinatorWorld) -> None:
    world.c.start_checkpoint()
    save = world.one(msg.SaveCheckpoint, world.ranks[0])
    assert checkpoint.latest(world.c.run_dir) is None
    world.handle(msg.Checkpointed(0, save.folder, 123, 0.1))
    found = checkpoint.latest(world.c.run_dir)
    assert found is not None and found[1]["version"] == 0
    assert world.c.checkpoints.writing is None


# ------------------------------------------------------------------ cell


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    cfg = _config()
    engine = EngineHost(cfg.model, cfg.engine, tmp_path_factory.mktemp("engine") / "e.log", 0)
    engine.spawn()
    engine.wait_ready(cfg.timeouts.startup_s)
    yield engine
    engine.stop()


@pytest.fixture
def engine(engine_process: EngineHost) -> EngineHost:
    """The module's engine, serving (restarted if a test stopped it, resumed if released)."""
    if engine_process.dead() is not None:
        engine_process.spawn()
        engine_process.wait_ready(_config().timeouts.startup_s)
    if engine_process.released:
        engine_process.resume()
    return engine_process


@pytest.fixture(scope="module")
def replica() -> Replica:
    cfg = _config()
    return cfg.train_backend.build(cfg.model, cfg.train, cfg.dims, core=True,
                                   device=cfg.train.device)  # fmt: skip


class CellRig:
    """A core cell on a socket pair; `coordinator` is the other end."""

    def __init__(self, run_dir: Path, engine: EngineHost, replica: Replica) -> None:
        a, b = socket.socketpair()
        self.coordinator = wire.Link(COORDINATOR_RANK, {2: a})
        # one cell of one rank trains: its reduce and broadcast involve no other rank
        comms = Communicators.alone(cell_id=0)
        self.cell = CellProcess(_config(), engine_index=0, comms=comms, run_dir=run_dir,
                                engine=engine, replica=replica)  # fmt: skip
        self.cell.link = wire.Link(2, {COORDINATOR_RANK: b})

    def deliver(self, m: msg.Message) -> None:
        self.cell.handlers[type(m)](m)

    def reply(self, kind: type[msg.Message]) -> Any:
        return _expect(self.coordinator, kind, timeout=5.0)


@pytest.fixture
def rig(tmp_path: Path, engine: EngineHost, replica: Replica) -> CellRig:
    return CellRig(tmp_path, engine, replica)


def _health(engine: EngineHost) -> dict[str, Any]:
    return dict(blocking(engine.url, lambda c: c.request("GET", "/health", None), timeout=10))


def _served_version(engine: EngineHost) -> int:
    return int(blocking(engine.url, EngineClient.weight_version, timeout=10))


@delivers(msg.ToTrain)
def test_to_train_releases_the_engine(rig: CellRig) -> None:
    rig.deliver(msg.ToTrain())
    assert _health(rig.cell.engine)["released"] is True
    switched = rig.reply(msg.Switched)
    assert (switched.cell, switched.role) == (0, Role.TRAIN) and switched.seconds > 0


@delivers(msg.ToRollout)
def test_to_rollout_resumes_the_engine_with_the_published_weights(rig: CellRig) -> None:
    engine = rig.cell.engine
    engine.release()
    rig.cell.trainer.version = engine.version + 1  # the core trained and published since
    rig.deliver(msg.ToRollout(published=rig.cell.version))
    assert _health(engine)["released"] is False
    assert _served_version(engine) == rig.cell.version
    switched = rig.reply(msg.Switched)
    assert switched.role is Role.ROLLOUT and switched.detail == {"engine_version": rig.cell.version}


def test_a_colocated_trainer_leaves_the_gpu_for_rollout_and_returns_for_training(
    tmp_path: Path, engine: EngineHost, replica: Replica
) -> None:
    """Placement `colocated` (a trainer sharing its GPU with the engine,
    gyre.runtime.shared.placement): the cell starts in rollout with its trainer state off the
    device, gets it back on each switch to train only once the engine has released the GPU,
    and moves it off again on each switch to rollout before the engine resumes (CPU: a fake
    device map records the moves)."""
    from gyre.runtime.cell.residency import TrainerResidency

    moves: list[tuple[str, str, bool]] = []  # (tensor, to device, engine released then)

    def move(what: str, t: Any, device: str) -> Any:
        moves.append((what, device, bool(_health(engine)["released"])))
        return t

    rig = CellRig(tmp_path, engine, replica)
    residency = TrainerResidency(device="cuda:1", move=move)
    rig.cell.trainer = type(rig.cell.trainer)(  # type: ignore[misc]
        _config(), replica, Communicators.alone(cell_id=0), None, version=0, run_dir=tmp_path,
        residency=residency)  # fmt: skip
    params = [(d, released) for w, d, released in moves if w == "flat_params"]
    assert params == [("cpu", False)]  # at start: the engine serves, the trainer is off it
    for _ in range(2):
        rig.deliver(msg.ToTrain())
        rig.reply(msg.Switched)
        rig.deliver(msg.ToRollout(published=0))
        rig.reply(msg.Switched)
    params = [(d, released) for w, d, released in moves if w == "flat_params"]
    assert params == [("cpu", False), ("cuda:1", True), ("cpu", True), ("cuda:1", True),
                      ("cpu", True)]  # fmt: skip
    assert {w for w, _, _ in moves} >= {"flat_params", "flat_grads"}
    assert _health(engine)["released"] is False and residency.released is True


def _training_plane(rig: CellRig) -> tuple[TrainingPlane, list[msg.Message]]:
    """The coordinator's side of one batch of one group (2 executions), admitted."""
    sent: list[msg.Message] = []
    plane = TrainingPlane(_config().train, groups_per_batch=1, group_size=2,
                          send=lambda _, m: sent.append(m))  # fmt: skip
    plane.begin(0, rig.cell.version)
    trees = {eid: _tree(eid, [[30, 31, 32], [40, 41]]) for eid in ("g0-e0", "g0-e1")}
    outcomes = [ExecutionOutcome(execution_id=e, status=Status.VALID, reward=r)
                for e, r in (("g0-e0", 1.0), ("g0-e1", 0.0))]  # fmt: skip
    assert plane.admit("g0", rig.cell.version, 0, outcomes, trees) == 1
    return plane, sent


@delivers(msg.Prepass, msg.Accumulate, msg.Reduce)
def test_training_messages_prepass_accumulate_and_update_the_replica(rig: CellRig) -> None:
    from gyre.schedule.events import Work

    plane, sent = _training_plane(rig)
    replica = rig.cell.replica
    assert replica is not None
    replica.cell.zero_grad()
    plane.claim(0, Work.PREPASS)
    prepass = sent.pop()
    rig.deliver(prepass)
    prepassed = rig.reply(msg.Prepassed)
    (step,) = prepass.steps
    assert prepassed.sums[0] == pytest.approx(replica.cell.prepass(step))
    assert set(prepassed.sums[0]) == {"g0-e0", "g0-e1"}
    assert plane.prepassed(prepassed) == 1

    plane.claim(0, Work.GRADIENT)
    rig.deliver(sent.pop())
    accumulated = rig.reply(msg.Accumulated)
    assert accumulated.targets == step.num_targets == 10
    assert float(replica.cell.flat_grads.norm()) > 0  # the gradient went into the buffer

    before, version = replica.cell.flat_params.clone(), rig.cell.version
    plane.accumulated(accumulated)
    plane.update((0,))
    rig.deliver(sent.pop())
    updated = rig.reply(msg.Updated)
    assert updated.grad_norm is not None and updated.grad_norm > 0
    assert not replica.cell.flat_params.equal(before)  # the optimizer stepped
    assert rig.cell.version == version + 1 and float(replica.cell.flat_grads.norm()) == 0


@delivers(msg.Publish)
def test_publish_keeps_the_policy_and_pushes_it_reporting_missed_engines(rig: CellRig) -> None:
    version = rig.cell.engine.version + 1
    rig.cell.trainer.version = version
    dead = "http://127.0.0.1:9"  # nothing listens: that engine misses the publication
    rig.deliver(msg.Publish(version, targets=[(0, rig.cell.engine.url), (1, dead)]))
    published = rig.reply(msg.Published)
    assert (published.version, published.missed) == (version, [1])
    assert _served_version(rig.cell.engine) == version
    kept = policies.latest(rig.cell.run_dir)
    assert kept is not None and kept[0] == version


@delivers(msg.SavePolicy)
def test_save_policy_writes_a_loadable_policy_directory(rig: CellRig) -> None:
    rig.deliver(msg.SavePolicy("final"))
    saved = rig.reply(msg.PolicySaved)
    assert Path(saved.path) == policies.policy_dir(rig.cell.run_dir, "final")
    assert policies.policy_version(Path(saved.path)) == rig.cell.version
    assert policies.load_weights(Path(saved.path))
    # portable: readable as the umask allows, a tokenizer class transformers 4.57 knows, a card
    folder, mask = Path(saved.path), fsafe.umask()
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~mask for f in folder.iterdir())
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok.get("tokenizer_class") != "TokenizersBackend", tok.get("tokenizer_class")
    card = (folder / "README.md").read_text()
    assert f"after {rig.cell.version} optimizer updates" in card and "Gyre commit: `" in card


@delivers(msg.Reload)
def test_reload_brings_an_engine_that_missed_a_publication_up_to_date(rig: CellRig) -> None:
    newer = rig.cell.engine.version + 1
    rig.cell.trainer.version = newer
    replica = rig.cell.replica
    assert replica is not None  # a publication this engine missed:
    policies.save_policy(rig.cell.run_dir, policies.version_name(newer), replica.cell.model,
                         replica.tokenizer, version=newer, keep=None)  # fmt: skip
    rig.deliver(msg.Reload())
    assert _served_version(rig.cell.engine) == newer == rig.cell.engine.version


@delivers(msg.SaveCheckpoint)
def test_save_checkpoint_writes_weights_and_optimizer(rig: CellRig) -> None:
    folder = checkpoint.begin(rig.cell.run_dir, 0)
    rig.deliver(msg.SaveCheckpoint(str(folder)))
    done = rig.reply(msg.Checkpointed)
    assert done.folder == str(folder) and done.bytes > 0
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) >= done.bytes


@delivers(msg.Respawn)
def test_respawn_restarts_the_engine_in_the_cells_role(rig: CellRig) -> None:
    engine = rig.cell.engine
    assert engine.proc is not None
    old = engine.proc.pid
    rig.cell.lost_reported = True
    rig.deliver(msg.Respawn(Role.TRAIN))
    ready = rig.reply(msg.EngineReady)
    assert engine.proc.pid != old and engine.dead() is None
    assert ready.url == engine.url and _health(engine)["released"] is True  # it trains
    assert rig.cell.lost_reported is False  # a next loss is reported again


# ------------------------------------------------------------------ proxy node


class ProxyNodeRig:
    """A real proxy node serving on its own thread; `coordinator` is the other end."""

    def __init__(self, run_dir: Path, cfg: RunConfig | None = None) -> None:
        a, b = socket.socketpair()
        self.coordinator = wire.Link(COORDINATOR_RANK, {PROXY_RANK: a})
        link = wire.Link(PROXY_RANK, {COORDINATOR_RANK: b})
        self.node = ProxyNode(cfg or _config(), link, run_dir)
        self.status: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        ready = _expect(self.coordinator, msg.ProxyReady)
        assert ready.tasks == ("notes",)  # the suite's tasks of harness.tasks (local.yaml)

    def _serve(self) -> None:
        self.status.append(asyncio.run(self.node.serve()))

    def send(self, m: msg.Message) -> None:
        self.coordinator.send(m, PROXY_RANK)

    def routes(self) -> dict[str, Any]:
        return self.node.host.proxy.routes()

    def stop(self, status: int = 0) -> None:
        if self.thread.is_alive():
            self.send(msg.Stop(status))
            self.thread.join(timeout=30)


@pytest.fixture
def proxy_node(tmp_path: Path) -> Iterator[ProxyNodeRig]:
    rig = ProxyNodeRig(tmp_path)
    yield rig
    rig.stop()


@delivers(msg.SetJudges)
def test_set_judges_gives_the_judge_rule_its_engines(proxy_node: ProxyNodeRig) -> None:
    proxy_node.send(msg.SetJudges(["http://127.0.0.1:9/", "http://127.0.0.1:10"]))
    judge = proxy_node.node.host.judge
    _wait(lambda: judge.engines == ["http://127.0.0.1:9", "http://127.0.0.1:10"], "judges set")


@delivers(msg.SetEngines, msg.Undrain)
def test_set_engines_and_undrain_change_the_proxys_engine_table(proxy_node: ProxyNodeRig) -> None:
    proxy_node.send(msg.SetEngines({"e0": "http://127.0.0.1:9", "e1": "http://127.0.0.1:10"}))
    _wait(lambda: proxy_node.routes()["engines"] == ["e0", "e1"], "engines in the table")
    proxy_node.send(msg.Drain("e1", {}, ack=False))
    _wait(lambda: proxy_node.routes()["draining"] == ["e1"], "drain mark")
    proxy_node.send(msg.Undrain("e1"))
    _wait(lambda: proxy_node.routes()["draining"] == [], "undrain")


@delivers(msg.Drain)
def test_drain_marks_the_engine_sets_the_routes_and_acks(proxy_node: ProxyNodeRig) -> None:
    proxy_node.send(msg.SetEngines({"e0": "http://127.0.0.1:9", "e1": "http://127.0.0.1:10"}))
    proxy_node.send(msg.Drain("e0", {"g3-e1": "e1"}, ack=True))
    assert _expect(proxy_node.coordinator, msg.Drained) == msg.Drained("e0")
    table = proxy_node.routes()
    assert table["draining"] == ["e0"] and table["routes"] == {"g3-e1": "e1"}


@delivers(msg.StartExecution)
def test_start_execution_runs_the_harness_and_reports_it_in_order(
    proxy_node: ProxyNodeRig, engine: EngineHost
) -> None:
    proxy_node.send(msg.SetEngines({"e0": engine.url}))
    proxy_node.send(msg.StartExecution(4, "g1-e0", "notes", instance=1, engine="e0"))
    kinds, reports = [], []
    while not kinds or kinds[-1] != "Assessed":
        m = proxy_node.coordinator.recv(timeout=90)
        assert m is not None, f"no Assessed; got {kinds}"
        kinds.append(type(m).__name__)
        reports.append(m)
    assert kinds[0] == "JournalNode" and kinds[-2:] == ["HarnessEnded", "Assessed"]
    calls = [m.node for m in reports if isinstance(m, msg.JournalNode)]
    assert all(m.execution_id == "g1-e0" for m in reports if isinstance(m, msg.JournalNode))
    assert all(n.engine_id == "e0" and len(n.output_ids) for n in calls)
    ended, assessed = reports[-2], reports[-1]
    assert ended.execution == assessed.execution == 4 and ended.outcome is Outcome.COMPLETED
    assert assessed.verdict.status is VerdictStatus.SCORED
    assert assessed.verdict.reward is not None and 0.0 <= assessed.verdict.reward <= 1.0


@delivers(msg.Evaluate)
def test_evaluate_runs_the_held_out_set_unjournaled_and_answers_evaluated(
    tmp_path: Path, engine: EngineHost
) -> None:
    cfg = load_run_config(DEFAULT_CONFIG, ["eval.every_steps=2", "eval.instances=2",
                                           "eval.concurrency=2", "eval.log_samples=1"])  # fmt: skip
    rig = ProxyNodeRig(tmp_path, cfg)
    try:
        rig.send(msg.SetEngines({"e0": engine.url}))
        rig.send(msg.Evaluate(2, None))  # no route: the router picks the live engine
        m = rig.coordinator.recv(timeout=120)
    finally:
        rig.stop()
    assert isinstance(m, msg.Evaluated), m  # first and only: no JournalNode of its calls
    assert m.step == 2 and set(m.rewards) == {"eval-s2-notes-0", "eval-s2-notes-1"}
    assert all(r is not None and 0.0 <= r <= 1.0 for r in m.rewards.values())
    # the version the module's engine serves (an earlier test may have published to it)
    assert m.engines == ("e0",) and m.versions == (_served_version(engine),)
    assert m.t_end > m.t_start
    assert list(m.samples) == ["eval-s2-notes-0"] and m.samples["eval-s2-notes-0"]["calls"] >= 1


@delivers(msg.Cancel)
def test_cancel_ends_a_running_harness_as_cancelled(proxy_node: ProxyNodeRig) -> None:
    with socket.create_server(("127.0.0.1", 0)) as hang:  # accepts, never answers
        url = f"http://127.0.0.1:{hang.getsockname()[1]}"
        proxy_node.send(msg.SetEngines({"hang": url}))
        proxy_node.send(msg.StartExecution(2, "g0-e2", "notes", instance=1, engine="hang"))
        hang.settimeout(60)
        call, _ = hang.accept()  # the harness is inside its first model call
        with call:
            proxy_node.send(msg.Cancel(["g0-e2"]))
            ended = _expect(proxy_node.coordinator, msg.HarnessEnded)
    assert (ended.execution, ended.outcome) == (2, Outcome.CANCELLED)
    assert _expect(proxy_node.coordinator, msg.Assessed).execution == 2


@delivers(msg.Rescore)
def test_rescore_scores_the_preserved_workspace(proxy_node: ProxyNodeRig) -> None:
    task = proxy_node.node.host.suite["notes"].instantiate(3)
    prepare(Path(proxy_node.node.host.runner.config.workspace_root), "g5-e1", task)
    proxy_node.send(msg.Rescore(9, "g5-e1", "notes", instance=3))
    assessed = _expect(proxy_node.coordinator, msg.Assessed)
    assert assessed.execution == 9 and assessed.verdict.status is VerdictStatus.SCORED
    assert assessed.verdict.reward is not None and math.isfinite(assessed.verdict.reward)


# ------------------------------------------------------------------ Stop (last: it ends the engine)


@delivers(msg.Stop)
def test_stop_ends_the_cell_loop_and_its_engine(rig: CellRig) -> None:
    assert rig.cell.link is not None
    result: list[int] = []
    loop = threading.Thread(target=lambda: result.append(rig.cell.serve(rig.cell.link)))
    loop.start()
    assert rig.reply(msg.EngineReady).url == rig.cell.engine.url
    rig.coordinator.send(msg.Stop(5), 2)
    loop.join(timeout=30)
    assert result == [5] and rig.cell.engine.dead() is not None


def test_stop_ends_the_proxy_node_with_its_status(proxy_node: ProxyNodeRig) -> None:
    proxy_node.stop(status=3)
    assert not proxy_node.thread.is_alive() and proxy_node.status == [3]


def test_every_message_has_an_effect_test() -> None:
    missing = sorted(cls.__name__ for cls in set(msg.ALL) - COVERED)
    assert not missing, f"messages without a test of their handler's effect: {missing}"
