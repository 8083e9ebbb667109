"""Slow, obvious references of the cost-aware join rule, the wasted-switch count and
oversampling's group membership (tests only).

It keeps its own ledger of everything the scheduler was told and did — every measurement as
a list, every cell's role, each batch's passes, the ready and soon-ready groups — and
recomputes the estimates and the join condition of docs/scheduler.md from scratch whenever
it is asked. `tests/schedule/driver.py` feeds it every event and action and asserts that

* every satellite `SwitchCell(TRAIN)` is a join the reference approves, at that moment;
* after every event no paying join is left undone (the work only shrinks until the next
  event, so a join the scheduler skipped must still be refused);
* the scheduler's `wasted_switches` equals the reference's count.

`GroupsReference` keeps every group's whole settle log and re-reads it on every question:
when a group of N + k executions is complete (N settled valid, or all settled), which N
train (the first N valid, filled up with the first excluded), which executions must be
cancelled or withdrawn, and which groups count as soon ready. The driver checks every
`Cancel`, `Withdraw` and `AdmitGroup` against it, and after every event that the scheduler
left no surplus execution running uncancelled or queued.
"""

from __future__ import annotations

from gyre.schedule import events as ev
from gyre.schedule.config import Config
from gyre.schedule.policy import Policy
from gyre.vocabulary import Role

ROLLOUT, TO_TRAIN, TRAIN, TO_ROLLOUT = (Role.ROLLOUT, Role.TO_TRAIN, Role.TRAIN,
                                        Role.TO_ROLLOUT)  # fmt: skip


def running_estimate(prior: float, measured: list[float], weight: float) -> float:
    """The prior, replaced by the first measurement, then moved by `weight` per measurement."""
    value = prior
    for i, x in enumerate(measured):
        value = x if i == 0 else value + weight * (x - value)
    return value


class GroupsReference:
    def __init__(self, config: Config) -> None:
        self.n, self.size = config.group_size, config.executions_per_group
        self.log: dict[int, list[tuple[int, bool]]] = {}  # group -> (execution, valid), in order
        self.carried: set[int] = set()
        self.open: set[int] = set()  # dispatched groups not complete yet
        self.launched: set[int] = set()
        self.terminated: set[int] = set()
        self.cancelled: set[int] = set()
        self.withdrawn: set[int] = set()
        self.admitted: set[int] = set()
        self.groups = 0

    def on_event(self, e: ev.Event) -> None:
        if isinstance(e, ev.Start):
            self.carried = set(range(len(e.carried)))
            self.groups = len(e.carried)
        elif isinstance(e, ev.Terminated):
            self.terminated.add(e.execution)
        elif isinstance(e, ev.Assessed):
            self._settle(e.execution, e.valid)
        elif isinstance(e, ev.GroupReady):
            for x in range(e.group * self.size, (e.group + 1) * self.size):
                if x in self.terminated and x not in {y for y, _ in self.log.get(e.group, [])}:
                    self._settle(x, True)

    def _settle(self, x: int, valid: bool) -> None:
        g = x // self.size
        self.log.setdefault(g, []).append((x, valid))
        if self.complete(g):
            self.open.discard(g)

    def on_action(self, a: ev.Action) -> str | None:
        if isinstance(a, ev.Dispatch):
            assert a.executions == tuple(range(a.group * self.size, (a.group + 1) * self.size))
            self.open.add(a.group)
            self.groups += 1
        elif isinstance(a, ev.Launch):
            self.launched.add(a.execution)
        elif isinstance(a, ev.Cancel | ev.Withdraw):
            x, g = a.execution, a.execution // self.size
            done = self.withdrawn | self.cancelled
            if not self.complete(g) or x in done or x in self.terminated:
                return f"{a!r}: its group is not complete, or it was stopped or ended already"
            if isinstance(a, ev.Cancel) != (x in self.launched):
                return f"{a!r}: a running execution is cancelled, a queued one withdrawn"
            (self.cancelled if isinstance(a, ev.Cancel) else self.withdrawn).add(x)
        elif isinstance(a, ev.AdmitGroup):
            g = a.group
            if g in self.admitted or not self.complete(g):
                return f"{a!r}: admitted twice, or before its group was complete"
            self.admitted.add(g)
            expected = () if g in self.carried else self.members(g)
            if a.members != expected:
                return f"{a!r}: members should be {expected}"
        return None

    def _deciding(self, g: int) -> list[tuple[int, bool]] | None:
        """The settle log up to the outcome that completed the group (None: not complete)."""
        valid = 0
        for i, (_, ok) in enumerate(self.log.get(g, [])):
            valid += ok
            if valid == self.n or i + 1 == self.size:
                return self.log[g][: i + 1]
        return None

    def complete(self, g: int) -> bool:
        return g in self.carried or self._deciding(g) is not None

    def members(self, g: int) -> tuple[int, ...]:
        log = self._deciding(g)
        assert log is not None
        chosen = [x for x, ok in log if ok][: self.n]
        chosen += [x for x, ok in log if not ok][: self.n - len(chosen)]
        return tuple(sorted(chosen))

    def soon(self) -> int:
        """Groups not complete with N closed executions not known excluded, or all closed."""
        count = 0
        for g in self.open:
            xs = range(g * self.size, (g + 1) * self.size)
            closed = sum(1 for x in xs if x in self.terminated)
            excluded = sum(1 for _, ok in self.log.get(g, []) if not ok)
            count += closed - excluded >= self.n or closed == self.size
        return count

    def ready(self) -> int:
        """Groups complete and not admitted yet."""
        return self.groups - len(self.open) - len(self.admitted)

    def check(self, queue: set[int], running: set[int]) -> str | None:
        """After an event: no execution of a complete group is queued, none runs uncancelled."""
        for x in queue:
            if self.complete(x // self.size):
                return f"execution {x} of a complete group is still queued"
        for x in running - self.cancelled:
            if self.complete(x // self.size):
                return f"execution {x} of a complete group runs and was not cancelled"
        return None


class JoinReference:
    def __init__(self, config: Config, policy: Policy) -> None:
        self.cfg = config
        self.policy = policy
        self.roles = [ROLLOUT] * config.cells
        for c in policy.fixed_train:
            self.roles[c] = TRAIN
        self.satellites = [c for unit in policy.units[1:] for c in unit]
        self.switches: list[tuple[int, Role, float]] = []  # (cell, to, seconds)
        self.passes: list[tuple[ev.Work, float]] = []
        self.pending_switch: dict[int, Role] = {}
        self.claims: dict[int, tuple[ev.Work, int]] = {}  # cell -> (work, window)
        self.dispatched = self.terminated = 0
        self.groups = GroupsReference(config)
        self.batch: dict[str, int] | None = None
        self.window_open = False
        self.packed_groups = self.packed_steps = 0
        self.worked: dict[int, bool] = {}
        self.wasted = 0
        self.down: set[int] = set()  # engines lost and not restored

    # ------------------------------------------------------------------ the ledger

    def on_event(self, e: ev.Event) -> None:
        self.groups.on_event(e)
        if isinstance(e, ev.Start):
            self.dispatched += len(e.carried) * self.cfg.executions_per_group
            self.terminated += len(e.carried) * self.cfg.executions_per_group
        elif isinstance(e, ev.Terminated):
            self.terminated += 1
        elif isinstance(e, ev.MicroStepsQueued):
            assert self.batch is not None
            self.batch["packed"] += 1
            self.batch["queued"] += e.count
            self.packed_groups += 1
            self.packed_steps += e.count
        elif isinstance(e, ev.GradientsReady):
            assert self.batch is not None
            self.batch["ready"] += e.count
        elif isinstance(e, ev.MicroStepDone):
            work, count = self.claims.pop(e.cell)
            if e.seconds is not None:
                self.passes.append((work, e.seconds / count))  # a window's, per micro-step
        elif isinstance(e, ev.SwitchDone):
            to = self.pending_switch.pop(e.cell)
            self.roles[e.cell] = to
            if e.seconds is not None:
                self.switches.append((e.cell, to, e.seconds))
        elif isinstance(e, ev.BatchDone):
            self.batch = None
        elif isinstance(e, ev.EngineLost):
            self.down.add(e.engine)
        elif isinstance(e, ev.EngineRestored):
            self.down.discard(e.engine)

    def on_action(self, a: ev.Action) -> str | None:
        """Record an action; returns a complaint if it contradicts the reference."""
        complaint = self.groups.on_action(a)
        if isinstance(a, ev.Dispatch):
            self.dispatched += len(a.executions)
        elif isinstance(a, ev.Withdraw):
            self.terminated += 1  # it leaves the waterlevel as if it had launched and ended
        elif isinstance(a, ev.SwitchCell):
            if a.role is TRAIN and a.cell in self.satellites:
                if not self.join_approved(a.cell):
                    complaint = f"satellite {a.cell} joined against the rule"
                self.worked[a.cell] = False
            if (
                a.role is ROLLOUT
                and a.cell in self.satellites
                and not self.worked.get(a.cell, True)
            ):
                self.wasted += 1
            self.roles[a.cell] = TO_TRAIN if a.role is TRAIN else TO_ROLLOUT
            self.pending_switch[a.cell] = a.role
        elif isinstance(a, ev.OpenJoinWindow):
            self.batch = dict(admitted=0, packed=0, queued=0, claimed=0, ready=0, grad_claimed=0)
            self.window_open = True
        elif isinstance(a, ev.CloseJoinWindow):
            self.window_open = False
        elif isinstance(a, ev.AdmitGroup):
            assert self.batch is not None
            self.batch["admitted"] += 1
        elif isinstance(a, ev.ClaimMicroStep):
            assert self.batch is not None
            self.claims[a.cell] = (a.work, a.count)
            self.batch["claimed" if a.work is ev.Work.PREPASS else "grad_claimed"] += a.count
            self.worked[a.cell] = True
        return complaint

    # ------------------------------------------------------------------ the rule, from scratch

    def switch_s(self, cell: int, to: Role) -> float:
        prior = (self.cfg.switch_to_train_prior_s if to is TRAIN
                 else self.cfg.switch_to_rollout_prior_s)  # fmt: skip
        own = [s for c, r, s in self.switches if c == cell and r is to]
        pooled = [s for _, r, s in self.switches if r is to]
        return running_estimate(prior, own if own else pooled, self.cfg.cost_smoothing)

    def pass_s(self, work: ev.Work) -> float:
        prior = self.cfg.prepass_prior_s if work is ev.Work.PREPASS else self.cfg.gradient_prior_s
        measured = [s for w, s in self.passes if w is work]
        return running_estimate(prior, measured, self.cfg.cost_smoothing)

    def next_satellite(self) -> int | None:
        """The first satellite not training yet, if every cell before it is."""
        for c in self.satellites:
            if self.roles[c] in (TRAIN, TO_TRAIN):
                continue
            return c if self.roles[c] is ROLLOUT else None
        return None

    def join_approved(self, cell: int) -> bool:
        cfg, b = self.cfg, self.batch
        if b is None or not self.window_open or self.roles[cell] is not ROLLOUT:
            return False
        k, cap = cfg.cells, cfg.concurrency_per_cell
        standalone = cap * sum(1 for j in range(cfg.standalone_engines) if k + j not in self.down)
        open_cells = sum(1 for c, r in enumerate(self.roles) if r is ROLLOUT and c not in self.down)
        # C_R counts live engines only; C_u is the leaving cell's nominal concurrency
        staying = standalone + cap * open_cells - cap * (self.roles[cell] is ROLLOUT)
        if staying < self.dispatched - self.terminated:  # Eq. 6
            return False
        if b["packed"] < b["admitted"] or not self.packed_groups:
            return False  # no micro-step counted yet: nothing to decide on
        per_group = self.packed_steps / self.packed_groups
        to_admit = min(cfg.batch_groups - b["admitted"], self.groups.ready() + self.groups.soon())
        future = per_group * (to_admit + b["admitted"] - b["packed"])
        prepasses = b["queued"] - b["claimed"] + future
        gradients = b["queued"] - b["grad_claimed"] + future
        if prepasses + gradients < cfg.join_min_microsteps:
            return False
        if cfg.join_payback == 0:
            return True
        t_pre, t_grad = self.pass_s(ev.Work.PREPASS), self.pass_s(ev.Work.GRADIENT)
        work = prepasses * t_pre + gradients * t_grad
        trainers = sum(1 for r in self.roles if r in (TRAIN, TO_TRAIN))
        s_in, s_out = self.switch_s(cell, TRAIN), self.switch_s(cell, ROLLOUT)
        # by its arrival the trainers started one micro-step each, and one more per chain
        chain = t_pre + t_grad
        unstarted = prepasses - trainers * (1 + s_in / chain) if chain > 0 else -1.0
        left = work - trainers * s_in  # ... and did trainers * s_in seconds of the work
        if unstarted < 1 or left <= 0:
            return False
        return left >= cfg.join_payback * (trainers + 1) * (s_in + s_out)

    def missed_join(self, bursting: bool) -> str | None:
        """After an event: a join that pays and was not made."""
        c = self.next_satellite()
        if bursting and c is not None and self.join_approved(c):
            return f"satellite {c} should have joined (reference approves)"
        return None
