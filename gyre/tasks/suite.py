"""Tasks and task suites: an initial workspace, an instruction and a scoring rule.

A *task* is what one rollout group runs N times: every execution starts from a fresh copy
of the task's initial workspace, the harness receives the instruction, and after the
execution terminates the evaluator scores the preserved workspace under the task's scoring
rule (`gyre.tasks.scoring`). Hidden tests live next to the workspace, never inside it.

A *suite* is a YAML file listing tasks, a directory whose sub-directories each hold a
`task.yaml` (optionally with a `suite.yaml` carrying suite-level defaults), or a data file
(`.jsonl` / `.parquet`, `gyre.tasks.rows`) whose rows are tasks:

    name: my-suite                  # suite.yaml (or the top of a YAML suite file)
    defaults:
      tool_latency: {dist: lognormal, mu: -2.0, sigma: 1.0}
    tasks:                          # YAML suite file only; paths relative to the file
      - name: add
        instruction: Implement add(a, b) in calc.py.
        workspace: add/workspace
        scoring: {rule: hidden_tests, tests: add/hidden/test_add.py}

    suite = load_suite("gyre/tasks/builtin")        # or builtin_suite()
    task = suite["fizzbuzz"]

A task's initial state may instead be a git repository at a commit (`repository: {path,
commit, setup}`, SWE-bench style; `gyre.tasks.repository`), checked out once into a cache
directory that then serves as its workspace; the `tests` scoring rule scores it by the
fraction of its FAIL_TO_PASS and PASS_TO_PASS pytest tests that pass.

A data row's task keys (those of `TaskConfig`; `id` stands in for a missing `name`) make the
task, its other keys its `data`, which only the scoring rule sees. Rows without their own
workspace or scoring take those of the optional sidecar `<stem>.suite.yaml`
(`DataSuiteConfig`). Every row becomes a `TaskConfig` and is resolved like a YAML task.

    {"id": "q1", "instruction": "What is 17 * 23? Write it to answer.txt.", "answer": "391"}

Every path is checked when the suite loads; a bad entry is a `ConfigError` naming the task
(a data row by file and line or index), the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import random
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gyre.config import load
from gyre.errors import ConfigError
from gyre.tasks.latency import ToolLatency
from gyre.tasks.repository import RepositoryConfig, materialize, source_path
from gyre.tasks.rows import DATA_SUFFIXES, is_data_source, is_dataset_dir, read_rows

BUILTIN_DIR = Path(__file__).parent / "builtin"
LEARN_DIR = Path(__file__).parent / "learn"
SHIPPED = {"builtin": BUILTIN_DIR, "learn": LEARN_DIR}
"""The suites that ship with Gyre, by name: coding tasks with hidden tests, and learnable ones."""
DIFFICULTIES = ("easy", "medium", "hard")


RULE_NAMES = ("hidden_tests", "command", "python", "tests", "judge")
"""The scoring rules a task may name; `gyre.tasks.scoring.RULES` implements each one."""


@dataclass(kw_only=True, slots=True)
class JudgeConfig:
    """Where the `judge` rule's model is served and how it is asked (`gyre.tasks.judge`)."""

    # an OpenAI-compatible base URL ("https://host/v1"); "" asks the evaluator's judge
    # engines (`gyre.tasks.judge.Judge(engines)`)
    endpoint: str = ""
    # the model name the endpoint serves (required with endpoint)
    model: str = ""
    # a file holding the endpoint's API key, read at each call (never in the config or a log);
    # relative to the task's directory; "" sends none
    key_file: str = ""
    # most tokens of one verdict (a verdict cut short is an evaluator failure)
    max_tokens: int = 512
    # the judge's sampling temperature (0: greedy)
    temperature: float = 0.0
    # most characters of the work shown to the judge (files, then the transcript), the rest cut
    max_input_chars: int = 60000
    # agentic: the harness adapter that runs as the judge (gyre/harness/adapters.yaml)
    adapter: str = "reference"
    # agentic: the adapter's parameter overrides (e.g. {max_turns: "6"})
    params: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"judge.endpoint: {self.endpoint!r}; allowed: an http:// or https:// base URL "
                "of an OpenAI-compatible API, or '' for the evaluator's judge engines"
            )
        if self.endpoint and not self.model:
            raise ConfigError("judge.model: required with judge.endpoint")
        if self.key_file and not self.endpoint:
            raise ConfigError(
                "judge.key_file: only with judge.endpoint (judge engines take the run's engine key)"
            )
        for name in ("max_tokens", "max_input_chars"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"judge.{name}: {getattr(self, name)!r}; allowed: > 0")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"judge.temperature: {self.temperature!r}; allowed: >= 0")


@dataclass(kw_only=True, slots=True)
class ScoringConfig:
    """How the preserved workspace of an execution is scored."""

    # rule name, one of RULE_NAMES (hidden_tests, command, python, tests, judge)
    rule: str = "hidden_tests"
    # hidden_tests: test file or directory of test_*.py; tests: file or directory copied
    # into the scratch copy before pytest runs; relative to the task's directory
    tests: str = ""
    # tests: pytest node ids ("path/test_x.py::test_y") that fail at the start and must pass
    fail_to_pass: list[str] = field(default_factory=list)
    # tests: pytest node ids that pass at the start and must keep passing (may be empty)
    pass_to_pass: list[str] = field(default_factory=list)
    # command: argv run in a scratch copy of the workspace; last stdout line = score in [0, 1]
    command: list[str] = field(default_factory=list)
    # python: "file.py:function" (file relative to the task's directory); fn(workspace, data)
    function: str = ""
    # python: also pass the execution's transcript (messages, final answer; built from its
    # trajectory tree by gyre.trajectory.transcript): fn(workspace, data, transcript);
    # judge: show the transcript to the judge beside the workspace
    transcript: bool = False
    # judge: the rubric the judge scores against (a file outside the workspace, hidden from
    # the harness; relative to the task's directory)
    rubric: str = ""
    # judge: where its model is served and how it is asked (default: the evaluator's judge engines)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # judge: run a harness as the judge, in its own sandbox, on a copy of the work and the
    # hidden `tests` (if any); its verdict.json is the verdict
    agentic: bool = False
    # wall-clock limit of one scoring attempt, seconds
    timeout_s: float = 60.0
    # hidden_tests: limit for one test function; tests: for each phase of one test; seconds
    per_test_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.rule not in RULE_NAMES:
            raise ConfigError(
                f"rule: {self.rule!r} is not a scoring rule; allowed: "
                f"{', '.join(sorted(RULE_NAMES))}"
            )
        if self.rule in ("hidden_tests", "tests") and not self.tests:
            raise ConfigError(f"tests: required for rule {self.rule!r}")
        self._check_judge()
        if self.rule == "tests":
            _check_node_ids(self.fail_to_pass, self.pass_to_pass)
        elif self.fail_to_pass or self.pass_to_pass:
            key = "fail_to_pass" if self.fail_to_pass else "pass_to_pass"
            raise ConfigError(f"{key}: only for rule 'tests', not {self.rule!r}")
        if self.rule == "command" and not self.command:
            raise ConfigError("command: required for rule 'command'")
        file, _, function = self.function.rpartition(":")
        if self.rule == "python" and not (file.endswith(".py") and function.isidentifier()):
            raise ConfigError(
                f"function: {self.function!r} for rule 'python'; allowed: 'file.py:function'"
            )
        if self.transcript and self.rule not in ("python", "judge"):
            raise ConfigError(f"transcript: only for rules 'python' and 'judge', not {self.rule!r}")
        for name in ("timeout_s", "per_test_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: {getattr(self, name)!r} must be > 0")

    def _check_judge(self) -> None:
        """Rule `judge` has a rubric; its keys belong to it alone."""
        if self.rule != "judge":
            key = next((k for k in ("rubric", "agentic") if getattr(self, k)), None)
            if key is None and self.judge != JudgeConfig():
                key = "judge"
            if key is not None:
                raise ConfigError(f"{key}: only for rule 'judge', not {self.rule!r}")
            return
        if not self.rubric:
            raise ConfigError("rubric: required for rule 'judge'; allowed: a file of the task")
        if self.tests and not self.agentic:
            raise ConfigError(
                "tests: for rule 'judge' only with agentic: true (the judge agent runs them)"
            )
        if self.agentic and self.judge.endpoint and not self.judge.endpoint.endswith("/v1"):
            raise ConfigError(
                f"judge.endpoint: {self.judge.endpoint!r} for an agentic judge; allowed: a base "
                "URL ending in /v1 (the harness is given the root above it)"
            )


def _check_node_ids(fail_to_pass: list[str], pass_to_pass: list[str]) -> None:
    """Rule `tests`: fail_to_pass is not empty; each id is a test of a `.py` file inside the
    workspace ("path/test_x.py::test_y", parameters and classes allowed), listed once."""
    if not fail_to_pass:
        raise ConfigError("fail_to_pass: required for rule 'tests'; allowed: pytest node ids")
    seen: set[str] = set()
    for key, ids in (("fail_to_pass", fail_to_pass), ("pass_to_pass", pass_to_pass)):
        for i, node in enumerate(ids):
            file, sep, name = node.partition("::")
            outside = file.startswith("/") or ".." in file.split("/")
            if not (file.endswith(".py") and sep and name) or outside:
                raise ConfigError(
                    f"{key}[{i}]: {node!r}; allowed: a pytest node id "
                    "'dir/test_file.py::test_name' relative to the workspace"
                )
            if node in seen:
                raise ConfigError(f"{key}[{i}]: {node!r} is listed twice; allowed: each test once")
            seen.add(node)


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """One task as written in YAML (paths relative to the file that declares it)."""

    # unique name within the suite (defaults to the directory name in a directory suite)
    name: str = ""
    # what the harness is asked to do
    instruction: str
    # directory holding the initial workspace state (default: workspace; not with repository)
    workspace: str = ""
    # the initial state as a git repository at a commit, instead of a workspace directory
    repository: RepositoryConfig | None = None
    # scoring rule of the preserved workspace
    scoring: ScoringConfig
    # easy | medium | hard (informational; used to build spreads)
    difficulty: Literal["easy", "medium", "hard"] = "medium"
    # per-tool-call latency knob; None inherits the suite default
    tool_latency: ToolLatency | None = None
    # task instances: each draws one value per variable from its seed; `{name}` in the
    # instruction and in the scoring command is replaced by it (empty: one fixed instance)
    variables: dict[str, list[str]] = field(default_factory=dict)
    # JSON values given to the scoring rule, never to the harness (a data row's extra keys)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.instruction.strip():
            raise ConfigError("instruction: must not be empty")
        if self.workspace and self.repository is not None:
            raise ConfigError(
                f"workspace: {self.workspace!r} and repository: are both set; allowed: "
                "exactly one of them (the initial state is a directory or a repository)"
            )
        for name, values in self.variables.items():
            if not name.isidentifier() or not values:
                raise ConfigError(
                    f"variables.{name}: {values!r}; allowed: an identifier with a non-empty "
                    "list of values"
                )
        if self.variables:
            unknown = _placeholders(self.instruction) - set(self.variables)
            if unknown:
                raise ConfigError(
                    f"instruction: placeholder {sorted(unknown)[0]!r} is not a variable; "
                    f"allowed: {', '.join(sorted(self.variables))}"
                )


@dataclass(kw_only=True, slots=True)
class SuiteDefaults:
    """Suite-level defaults applied to every task that does not set its own."""

    # tool latency for tasks without their own tool_latency
    tool_latency: ToolLatency = field(default_factory=ToolLatency)


@dataclass(kw_only=True, slots=True)
class SuiteConfig:
    """A YAML suite file (or a directory's suite.yaml)."""

    # suite name
    name: str = ""
    # defaults for every task
    defaults: SuiteDefaults = field(default_factory=SuiteDefaults)
    # task entries (YAML-file suites); directory suites list sub-directories instead
    tasks: list[TaskConfig] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class RowDefaults:
    """Defaults of a data-file suite for every row that does not set its own."""

    # initial workspace directory, relative to the data file
    workspace: str = "workspace"
    # scoring rule of rows without a `scoring` key (a row's own replaces it whole)
    scoring: ScoringConfig | None = None
    # tool latency of rows without their own tool_latency
    tool_latency: ToolLatency = field(default_factory=ToolLatency)


@dataclass(kw_only=True, slots=True)
class DataSuiteConfig:
    """The optional sidecar `<stem>.suite.yaml` beside a data file (`answers.suite.yaml`)."""

    # suite name (default: the data file's stem)
    name: str = ""
    # defaults for every row
    defaults: RowDefaults = field(default_factory=RowDefaults)
    # the split of a saved dataset holding several (DatasetDict); "" for one split or a file
    split: str = ""


TASK_KEYS = frozenset(f.name for f in dataclasses.fields(TaskConfig)) - {"data"}
"""The keys of a data row that configure its task; every other key is the row's data."""


@dataclass(frozen=True, slots=True)
class Task:
    """A loaded task with absolute, checked paths; with variables, a family of instances."""

    name: str
    instruction: str
    workspace: Path  # initial state, copied into each execution's workspace
    scoring: ScoringConfig  # `tests` resolved to an absolute path
    difficulty: str
    tool_latency: ToolLatency
    suite: str = ""
    directory: Path | None = None  # the task's own directory (`{task_dir}` in commands)
    variables: tuple[tuple[str, tuple[str, ...]], ...] = ()
    instance: int | None = None  # the seed of this instance; None: not instantiated
    data: tuple[tuple[str, Any], ...] = ()  # (key, JSON value) for the scoring rule only
    source: Path | None = None  # the data file of a data-suite row (it holds every row's data)
    repository: Path | None = None  # a repository task's git repository (later commits: fixes)
    suite_hidden: tuple[Path, ...] = ()  # every other task's hidden paths (set by the suite)

    @property
    def own_hidden_paths(self) -> tuple[Path, ...]:
        """The task's own secrets: its `hidden/` directory, hidden tests, the reward
        function's file, a judge's rubric and key file, a data row's data file and every data file beside it (another
        format of the same rows would hold the same answers), a repository task's source
        repository (its later commits may hold the fix)."""
        folder = self.directory / "hidden" if self.directory is not None else None
        out = [folder] if folder is not None and folder.is_dir() else []
        files = [
            self.scoring.tests, self.scoring.function.rpartition(":")[0], self.source,
            self.repository, self.scoring.rubric, self.scoring.judge.key_file,
        ]  # fmt: skip
        if self.source is not None:
            files += sorted(f for f in self.source.parent.iterdir() if is_data_source(f))
        for f in (Path(f) for f in files if f):
            if not any(f.is_relative_to(d) for d in out):
                out.append(f)
        return tuple(out)

    @property
    def hidden_paths(self) -> tuple[Path, ...]:
        """Files the harness must not see: its own secrets and those of every task of its
        suite (a harness on one task must not read another's tests or answers)."""
        own = self.own_hidden_paths
        return own + tuple(p for p in self.suite_hidden if p not in own)

    @property
    def instance_id(self) -> str:
        """`name@seed` of an instance (the trace's task id), the name otherwise."""
        return self.name if self.instance is None else f"{self.name}@{self.instance}"

    def instantiate(self, seed: int) -> Task:
        """The instance drawn by `seed`: variables chosen, placeholders filled.

        The draw depends only on the task's name, its variables and the seed, so the same
        instance comes back on every process, in every run.
        """
        rng = random.Random(f"{self.name}:{seed}")
        values = {name: rng.choice(choices) for name, choices in self.variables}
        fill = {"task_dir": str(self.directory or ""), **values}
        scoring = dataclasses.replace(
            self.scoring, command=[_fill(arg, fill) for arg in self.scoring.command]
        )
        instruction = self.instruction.format(**values) if self.variables else self.instruction
        return dataclasses.replace(self, instruction=instruction, scoring=scoring, instance=seed)


HELDOUT_BASE = 1 << 31
"""Seeds of training instances lie below this, held-out (evaluation) seeds from it up."""


def instance_seed(seed: int, group: int) -> int:
    """The training instance of a run's group number `group`: a seed < HELDOUT_BASE."""
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_BASE


def heldout_seed(k: int) -> int:
    """The k-th held-out instance seed (never drawn for training)."""
    if k < 0:
        raise ConfigError(f"held-out instance {k}; allowed: >= 0")
    return HELDOUT_BASE + k


def _placeholders(text: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


def _fill(arg: str, values: dict[str, str]) -> str:
    """`{name}` replaced in a command argument (other braces left alone)."""
    for name, value in values.items():
        arg = arg.replace("{" + name + "}", value)
    return arg


@dataclass(frozen=True, slots=True)
class TaskSuite:
    """An ordered, name-indexed collection of tasks."""

    name: str
    tasks: tuple[Task, ...]

    def __getitem__(self, name: str) -> Task:
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(f"task {name!r} not in suite {self.name!r}; tasks: {self.names()}")

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.tasks)

    def names(self) -> list[str]:
        return [t.name for t in self.tasks]


def load_suite(path: str | Path) -> TaskSuite:
    """Load a suite from a YAML file, a directory or a data file (see the module docstring)."""
    p = Path(path)
    if is_data_source(p):
        return _load_data_file(p)
    if p.is_file():
        cfg = load(SuiteConfig, _read_yaml(p), path=p.name)
        wheres = [f"{p.name}.tasks[{i}]" for i in range(len(cfg.tasks))]
        tasks = [(w, _resolve(t, p.parent, cfg.defaults, w)) for w, t in zip(wheres, cfg.tasks)]
        return _make_suite(cfg.name or p.stem, tasks)
    if p.is_dir():
        return _load_directory(p)
    raise ConfigError(
        f"task suite {str(p)!r} does not exist (expected a YAML file, a directory, "
        f"a {' / '.join(DATA_SUFFIXES)} file or a saved Hugging Face dataset)"
    )


def builtin_suite() -> TaskSuite:
    """Gyre's shipped suite of small Python tasks scored by hidden tests."""
    return load_suite(BUILTIN_DIR)


def named_suite(name: str | Sequence[str]) -> TaskSuite:
    """A shipped suite by name (builtin | learn), else a suite directory, YAML or data file;
    a list of those is one suite of all their tasks (names unique across them)."""
    if isinstance(name, str):
        return load_suite(SHIPPED.get(name, name))
    if not name:
        raise ConfigError("suite: []; allowed: a suite, or a non-empty list of suites")
    parts = [named_suite(n) for n in name]
    entries = [(f"suite {p.name!r}", t) for p in parts for t in p.tasks]
    return _make_suite("+".join(p.name for p in parts), entries)


def _load_directory(root: Path) -> TaskSuite:
    suite_file = root / "suite.yaml"
    cfg = (
        load(SuiteConfig, _read_yaml(suite_file), path="suite.yaml")
        if suite_file.exists()
        else SuiteConfig()
    )
    tasks = []
    for i, t in enumerate(cfg.tasks):
        where = f"suite.yaml.tasks[{i}]"
        tasks.append((where, _resolve(t, root, cfg.defaults, where)))
    for sub in sorted(d for d in root.iterdir() if (d / "task.yaml").is_file()):
        data = _read_yaml(sub / "task.yaml")
        if isinstance(data, dict):
            data.setdefault("name", sub.name)
        where = f"{sub.name}/task.yaml"
        tasks.append(
            (where, _resolve(load(TaskConfig, data, path=where), sub, cfg.defaults, where))
        )
    if not tasks:
        raise ConfigError(
            f"task suite directory {str(root)!r} holds no */task.yaml and no suite.yaml tasks"
        )
    return _make_suite(cfg.name or root.name, tasks)


def _load_data_file(path: Path) -> TaskSuite:
    """A suite whose tasks are the rows of a data file or saved dataset, with its sidecar's
    defaults (`answers.suite.yaml` beside `answers.jsonl`, `answers-ds.suite.yaml` beside the
    dataset directory `answers-ds`)."""
    stem = path.name if is_dataset_dir(path) else path.stem
    sidecar = path.with_name(f"{stem}.suite.yaml")
    cfg = (
        load(DataSuiteConfig, _read_yaml(sidecar), path=sidecar.name)
        if sidecar.is_file()
        else DataSuiteConfig()
    )
    defaults = SuiteDefaults(tool_latency=cfg.defaults.tool_latency)
    source = path.resolve()
    tasks = []
    for index, (where, row) in enumerate(read_rows(path, cfg.split)):
        tcfg = load(TaskConfig, _row_config(row, cfg.defaults, f"{stem}-{index}"), where)
        task = _resolve(tcfg, path.parent, defaults, where)
        tasks.append((where, dataclasses.replace(task, source=source)))
    if not tasks:
        raise ConfigError(f"data suite {str(path)!r} holds no rows; allowed: one task per row")
    return _make_suite(cfg.name or stem, tasks)


def _row_config(row: dict[str, Any], defaults: RowDefaults, fallback_name: str) -> dict[str, Any]:
    """A data row as a TaskConfig mapping: task keys, defaults, the rest data.

    A null is an absent key (a Parquet column has a value in every row: null where a row
    has none), so JSONL and Parquet rows of the same tasks load alike."""
    row = {k: v for k, v in row.items() if v is not None}
    task = {k: _without_nulls(v) for k, v in row.items() if k in TASK_KEYS}
    data = {k: v for k, v in row.items() if k not in TASK_KEYS}
    if "name" not in task:
        ident = data.pop("id", fallback_name)
        task["name"] = (
            str(ident) if isinstance(ident, int) and not isinstance(ident, bool) else ident
        )
    if "repository" not in task:
        task.setdefault("workspace", defaults.workspace)
    if defaults.scoring is not None:
        task.setdefault("scoring", defaults.scoring)
    return {**task, "data": data}


def _without_nulls(value: Any) -> Any:
    """A mapping without its null entries, at every depth (a Parquet struct's absent keys)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _resolve(cfg: TaskConfig, base: Path, defaults: SuiteDefaults, where: str) -> Task:
    if not cfg.name:
        raise ConfigError(f"{where}.name: required key is missing")
    repository = cfg.repository
    if repository is not None:
        workspace = materialize(repository, base, where=where, task=cfg.name)
    else:
        workspace = (base / (cfg.workspace or "workspace")).resolve()
    if not workspace.is_dir():
        raise ConfigError(
            f"{where}.workspace: initial state {str(workspace)!r} does not exist or is not a directory"
        )
    for key, value in cfg.data.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}.data.{key}: {value!r:.80} is not a JSON value; allowed: strings, "
                "numbers, booleans, null, lists and mappings of those"
            ) from None
    return Task(
        name=cfg.name,
        instruction=cfg.instruction.strip(),
        workspace=workspace,
        scoring=_resolve_scoring(cfg.scoring, base, workspace, f"{where}.scoring"),
        difficulty=cfg.difficulty,
        tool_latency=cfg.tool_latency or defaults.tool_latency,
        directory=base.resolve(),
        variables=tuple((k, tuple(v)) for k, v in sorted(cfg.variables.items())),
        data=tuple(cfg.data.items()),
        repository=source_path(repository, base) if repository is not None else None,
    )


def _resolve_scoring(
    scoring: ScoringConfig, base: Path, workspace: Path, where: str
) -> ScoringConfig:
    """`tests` and `function` as absolute paths that exist and lie outside the workspace."""
    if scoring.tests:
        tests = _hidden_file(base / scoring.tests, workspace, f"{where}.tests")
        scoring = dataclasses.replace(scoring, tests=str(tests))
    if scoring.rule == "tests" and importlib.util.find_spec("pytest") is None:
        raise ConfigError(
            f"{where}.rule: 'tests' runs pytest, which {sys.executable} cannot import; "
            "allowed: install pytest beside Gyre, or another rule"
        )
    if scoring.function:
        file, _, name = scoring.function.rpartition(":")
        reward = _hidden_file(base / file, workspace, f"{where}.function")
        if not reward.is_file():
            raise ConfigError(f"{where}.function: {str(reward)!r} is not a file")
        scoring = dataclasses.replace(scoring, function=f"{reward}:{name}")
    if scoring.rubric:
        rubric = _hidden_file(base / scoring.rubric, workspace, f"{where}.rubric")
        if not rubric.is_file():
            raise ConfigError(f"{where}.rubric: {str(rubric)!r} is not a file")
        scoring = dataclasses.replace(scoring, rubric=str(rubric))
    if scoring.judge.key_file:
        key_file = base / Path(scoring.judge.key_file).expanduser()
        key = _hidden_file(key_file, workspace, f"{where}.judge.key_file")
        if not key.is_file():  # checked, never read here: the key is read at each call
            raise ConfigError(f"{where}.judge.key_file: {str(key)!r} is not a file")
        judge = dataclasses.replace(scoring.judge, key_file=str(key))
        scoring = dataclasses.replace(scoring, judge=judge)
    return scoring


def _hidden_file(path: Path, workspace: Path, where: str) -> Path:
    path = path.resolve()
    if not path.exists():
        raise ConfigError(f"{where}: {str(path)!r} does not exist")
    if path.is_relative_to(workspace):
        raise ConfigError(
            f"{where}: {str(path)!r} lies inside the workspace; the harness would see it"
        )
    return path


def _make_suite(name: str, entries: list[tuple[str, Task]]) -> TaskSuite:
    """The suite of `(where, task)` entries; task names must be unique."""
    first: dict[str, str] = {}
    for where, t in entries:
        if t.name in first:
            raise ConfigError(
                f"{where}.name: task name {t.name!r} appears twice (first in {first[t.name]}); "
                "names must be unique"
            )
        first[t.name] = where
    secrets = tuple(dict.fromkeys(p for _, t in entries for p in t.own_hidden_paths))
    tasks = tuple(dataclasses.replace(t, suite=name, suite_hidden=secrets) for _, t in entries)
    return TaskSuite(name=name, tasks=tasks)


def _read_yaml(p: Path) -> Any:
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{str(p)!r} is not valid YAML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {str(p)!r}: {e.strerror}") from None
