"""The run config: one YAML file describing a whole Gyre job (`gyre run CONFIG`).

Sections: `topology` (cells, ranks per cell, standalone engines), `schedule` (the scheduler's
batch shape and the placement policy), `harness` (adapter, tasks, budgets), `train` (the
trainer's own config, `gyre.train.config.TrainConfig`: objective, optimizer, admission,
packing, device, transport), `engine` (embedded engine knobs), `proxy` (the proxy's own
config, `gyre.proxy.config.Config`), `timeouts` (every blocking wait is bounded) and `slurm`
(kept as data here; `gyre.launch` validates it as its `SlurmConfig` when it renders or
submits), `checkpoint` (how often a resumable checkpoint is taken) and `tracking`
(experiment trackers), `pace` (paced devices: a modelled cluster's time on this machine). Loading is strict: an unknown key or a bad value is a `ConfigError` naming the key
path and what is allowed.

    cfg = load_run_config("templates/local.yaml", ["train.lr=3e-4"], steps=2, policy="async")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gyre.config import apply_overrides, load, read_mapping
from gyre.errors import ConfigError
from gyre.proxy.config import Config as ProxyConfig
from gyre.rollout.protocol import DEFAULT_BUCKET_MB
from gyre.runtime.shared.layout import TopologyConfig
from gyre.schedule.config import POLICIES, PolicyConfig, ScheduleConfig
from gyre.schedule.config import Config as SchedulerConfig
from gyre.schedule.devices import PaceConfig
from gyre.tasks.suite import ToolLatency
from gyre.tracking import TrackingConfig
from gyre.train.backends import TrainBackend, backend
from gyre.train.config import ParallelDims, TrainConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "templates" / "local.yaml"
"""The run config `gyre run` and `gyre eval` use when none is given (one local job)."""


@dataclass(kw_only=True, slots=True)
class RunSchedule(ScheduleConfig):
    """The run's `schedule:` section: the scheduler's `ScheduleConfig` (batch shape and
    dispatch, docs/scheduler.md) and the placement policy that runs it."""

    policy: Literal["elastic", "async", "colocate"] = "elastic"
    """Placement policy: elastic | async | colocate."""
    streaming: bool | None = None
    """Stream batches; None: the policy's default (on for elastic, off otherwise)."""
    train_cells: int = 1
    """Async only: cells fixed in training."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: {self.policy!r}; allowed: {', '.join(POLICIES)}")
        ScheduleConfig.__post_init__(self)  # slots dataclass: no zero-argument super()

    def scheduler(
        self, topology: TopologyConfig, engines_per_cell: int = 1, stages: int = 1
    ) -> tuple[SchedulerConfig, PolicyConfig]:
        """The pure scheduler's config and policy for this topology (validated there): this
        schedule on cells of one node each, serving from `engines_per_cell` engines each
        (`RunConfig.engines_per_cell`), training in `stages` pipeline stages (the window:
        `window_for`); the cost priors keep the scheduler's defaults. A run asks
        `RunConfig.scheduler`, which passes its own."""
        shape = self.shape() | {"window": self.window_for(stages)}
        sc = SchedulerConfig(
            nodes=topology.cells, cells=topology.cells, train_layout_nodes=1,
            standalone_nodes=topology.standalone_engines, engines_per_cell=engines_per_cell,
            **shape,
        )  # fmt: skip
        streaming = self.streaming if self.streaming is not None else self.policy == "elastic"
        pc = PolicyConfig(name=self.policy, streaming=streaming, train_cells=self.train_cells)
        return sc, pc


@dataclass(kw_only=True, slots=True)
class HarnessConfig:
    """The harness pool on the proxy node and the tasks it runs."""

    adapter: str = "reference"
    """Harness adapter name (gyre/harness/adapters.yaml)."""
    params: dict[str, str | int | float] = field(default_factory=dict)
    """Adapter parameter overrides (e.g. max_turns: 8), each checked against the type the
    adapter declares for it (`param_types`); handed to the adapter as text."""
    adapters: dict[str, Any] = field(default_factory=dict)
    """Extra adapters of this run (same keys as gyre/harness/adapters.yaml), by name."""
    suite: str | list[str] = "builtin"
    """Task suite: builtin | learn (shipped) | a suite directory, YAML file or .jsonl / .parquet
    data file (docs/tasks.md); a list of them is one suite of all their tasks."""
    tasks: list[str] = field(default_factory=list)
    """Task names to draw groups from (round robin); empty: every task of the suite."""
    harness_timeout_s: float = 60.0
    """Wall-clock budget of one harness."""
    overall_timeout_s: float = 90.0
    """Budget of harness + evaluation retries, from launch."""
    kill_grace_s: float = 1.0
    """Seconds between SIGTERM and SIGKILL of a harness's process group."""
    eval_attempts: int = 0
    """Evaluator attempts per execution: 0 (the paper's rule) retries a failed scoring with
    doubling pauses as long as the execution's overall budget lasts; N caps the attempts."""
    sandbox: Literal["auto", "bwrap", "apptainer", "none"] = "auto"
    """Confine every harness to an allow-list (gyre/harness/sandbox.py): the system, its
    interpreter and program read-only, its workspace read-write; no suite's hidden files, no
    run directory, HOME or checkout, no other process. auto and bwrap refuse to start without
    a working bubblewrap, apptainer without Apptainer and `apptainer_image`; none runs
    harnesses unconfined, where a harness can read and rewrite checkers (docs/harness.md)."""
    apptainer_image: str = ""
    """sandbox apptainer: the image (.sif file or sandbox directory) harnesses run in."""
    tool_latency: ToolLatency | None = None
    """Replaces every task's tool latency (benchmarks, what-if runs); None keeps the suite's."""

    def __post_init__(self) -> None:
        for name in ("harness_timeout_s", "overall_timeout_s", "kill_grace_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: {getattr(self, name)!r}; allowed: > 0 seconds")
        if self.overall_timeout_s < self.harness_timeout_s:
            raise ConfigError(
                f"overall_timeout_s: {self.overall_timeout_s}; allowed: >= harness_timeout_s"
            )
        if self.eval_attempts < 0:
            raise ConfigError(f"eval_attempts: {self.eval_attempts}; allowed: >= 0")
        if self.adapters:
            from gyre.harness.adapters import load_adapters

            load_adapters(self.adapters, path="adapters")

    def adapter_object(self) -> Any:
        """The `Adapter` named by `adapter`: one of this run's own, else a built-in one."""
        from gyre.harness.adapters import get_adapter, load_adapters

        if self.adapter in self.adapters:
            return load_adapters(self.adapters, path="adapters")[self.adapter]
        return get_adapter(self.adapter)

    @property
    def adapter_params(self) -> dict[str, str]:
        """`params` as the text an adapter's command and environment are filled with."""
        return {k: str(v) for k, v in self.params.items()}


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The rollout engine each cell's leader runs as a child process."""

    backend: Literal["embedded", "sglang"] = "embedded"
    """embedded: Gyre's CPU engine (`gyre.rollout.cli`); sglang: an SGLang server on the cell's
    GPUs (needs CUDA and the `gpu` extra; `model` is then a model directory). Both are
    launched from `gyre.rollout.serving.config` presets and driven over the same routes."""
    threads: int = 1
    """embedded: torch threads of one engine process."""
    zygote: bool = True
    """embedded on the CPU: fork engines from a process of the rank that already imported
    torch and transformers (`gyre.zygote`); false: each a new interpreter."""

    @property
    def embedded_on_cpu(self) -> bool:
        """Gyre's engine on the CPU: one a zygote may fork (CUDA does not survive a fork)."""
        return self.backend == "embedded" and self.device != "cuda"

    max_batch_size: int = 8
    """embedded: sequences decoded together."""
    prefix_cache_mb: int = 64
    """embedded: prefix KV cache size (0 disables)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """embedded: where the engine runs — cpu, or cuda: on the cell's GPU from the placement
    (`python -m gyre.gpu.engine`, in `dtype`; the run then places ranks on GPUs). SGLang
    always runs on its GPUs."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """embedded on cuda: the dtype the engine serves in (the published weights' is cast)."""
    tensor_parallel: int = 1
    """sglang: --tp-size, GPUs of one server."""
    nodes: int = 1
    """sglang: --nnodes, the nodes one server spans (tensor_parallel GPUs on each; node
    ranks rendezvous at --dist-init-addr, the engine's first rank). The embedded engine: 1."""
    per_cell: int | Literal["auto"] = "auto"
    """Rollout engines of one cell, each on tensor_parallel x nodes of the cell's ranks
    (engine j launched by the cell's rank j x tensor_parallel x nodes, on GPUs of its own:
    `gyre.runtime.shared.placement`); auto: engines on GPUs fill the cell, one per
    tensor_parallel x nodes of its ranks (one GPU each), an embedded engine on the CPU is 1
    (`RunConfig.engines_per_cell`)."""
    expert_parallel: int = 1
    """sglang: --ep-size, of one server's GPUs how many an MoE model's routed experts are
    split over (a divisor of tensor_parallel x nodes and of the model's expert count; 1: every GPU
    holds a TP slice of every expert). The embedded engine is one rank: 1."""
    mem_fraction_static: float = 0.8
    """sglang: --mem-fraction-static, share of GPU memory for weights + KV cache."""
    publication: Literal["http", "distributed", "auto"] = "auto"
    """How weights reach engines (every movement: publication, reload, respawn, resume), in
    buckets: auto (an engine on the sending rank's node by tensor handles: CUDA IPC, CPU
    shared memory; one on another node through an update group, or by value below
    distributed_above_mb), distributed (every engine through an update group: gloo on CPU,
    NCCL on GPU), http (every engine by value in the JSON bodies: small models only)."""
    distributed_above_mb: float = 64.0
    """auto: an engine on another node gets weights larger than this through an update
    group, smaller ones by value."""
    bucket_mb: int = DEFAULT_BUCKET_MB
    """Most MB of weights moved in one bucket (one call or broadcast)."""

    def __post_init__(self) -> None:
        if self.threads < 1 or self.max_batch_size < 1 or self.prefix_cache_mb < 0:
            raise ConfigError("threads / max_batch_size >= 1, prefix_cache_mb >= 0")
        if self.device not in ("cpu", "cuda") or self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"engine.device: {self.device!r}, engine.dtype: {self.dtype!r}; "
                              "allowed: device cpu | cuda, dtype bfloat16 | float32")  # fmt: skip
        if self.publication not in ("http", "distributed", "auto"):
            raise ConfigError(f"engine.publication: {self.publication!r}; allowed: http, "
                              "distributed, auto")  # fmt: skip
        if self.bucket_mb < 1:
            raise ConfigError(f"engine.bucket_mb: {self.bucket_mb}; allowed: >= 1")
        if not self.distributed_above_mb >= 0:
            raise ConfigError(f"engine.distributed_above_mb: {self.distributed_above_mb}; "
                              "allowed: >= 0")  # fmt: skip
        if self.tensor_parallel < 1 or not 0 < self.mem_fraction_static < 1:
            raise ConfigError(
                f"tensor_parallel: {self.tensor_parallel}, mem_fraction_static: "
                f"{self.mem_fraction_static}; allowed: tensor_parallel >= 1, "
                "mem_fraction_static in (0, 1)"
            )
        if self.per_cell != "auto" and (
            isinstance(self.per_cell, bool)
            or not isinstance(self.per_cell, int)
            or self.per_cell < 1
        ):
            raise ConfigError(f"engine.per_cell: {self.per_cell!r}; allowed: auto or an "
                              "integer >= 1")  # fmt: skip
        if self.nodes < 1 or (self.nodes > 1 and self.backend != "sglang"):
            raise ConfigError(f"engine.nodes: {self.nodes} with engine.backend {self.backend}; "
                              "allowed: 1, or more with engine.backend sglang (the embedded "
                              "engine runs on one machine)")  # fmt: skip
        if self.expert_parallel > 1 and self.backend != "sglang":
            raise ConfigError(f"engine.expert_parallel: {self.expert_parallel} with engine.backend "
                              f"{self.backend}: the embedded engine is one rank; allowed: 1, or "
                              "engine.backend sglang")  # fmt: skip
        gpus, nodes = self.tensor_parallel * self.nodes, (f" x engine.nodes {self.nodes}"
                                                          if self.nodes > 1 else "")  # fmt: skip
        if self.expert_parallel < 1 or gpus % self.expert_parallel:
            raise ConfigError(f"engine.expert_parallel: {self.expert_parallel}; allowed: a "
                              f"divisor of engine.tensor_parallel {self.tensor_parallel}{nodes}")  # fmt: skip

    def distributed(self, nbytes: int) -> bool:
        """Whether `nbytes` of tensors go to an engine on another node through an update
        group (`gyre.runtime.cell.engine_host.route`)."""
        if self.publication == "auto":
            return nbytes > self.distributed_above_mb * 1e6
        return self.publication == "distributed"

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20

    def server(
        self, model: str, version: int, host: str = "127.0.0.1", base_gpu_id: int = 0,
        routed_experts: bool = False, node_rank: int = 0, dist_init_addr: str = "",
    ) -> Any:  # fmt: skip
        """The `ServerConfig` that launches this engine for `model` at weight `version`, bound
        to and reached at `host` (the rank's address: `gyre.runtime.shared.address`), on the GPUs
        from `base_gpu_id` on (`gyre.runtime.shared.placement`; SGLang only), able to return
        each call's `routed_experts` (SGLang captures them only when launched so; the
        embedded engine always can). An engine of `nodes` > 1 runs tensor_parallel GPUs on
        each: this process is its `node_rank`, all meeting at node rank 0's `dist_init_addr`."""
        from gyre.rollout.serving.config import ServerConfig

        embedded = [  # the embedded engine's own knobs (SGLang sizes itself)
            "--threads", str(self.threads), "--max-batch-size", str(self.max_batch_size),
            "--prefix-cache-mb", str(self.prefix_cache_mb),
        ]  # fmt: skip
        # Every call of a run is seeded (`gyre.runtime.proxy_node.node.proxy_config`: the proxy's
        # sampling_seed, else train.seed), and SGLang drops `sampling_seed` unless launched
        # deterministic (sglang/srt/sampling/sampling_batch_info.py: no seed tensor without
        # it). The flag also pins SGLang's sampling (pytorch) and attention backends.
        sglang = ["--enable-deterministic-inference"]
        if routed_experts:  # sglang/srt/arg_groups/fields/exec_.py (0.5.21)
            sglang.append("--enable-return-routed-experts")
        on_gpu = self.backend == "embedded" and self.device == "cuda"
        return ServerConfig(
            model_path=model, launch="embedded-cuda" if on_gpu else self.backend,
            weight_version=str(version), host=host, dtype=self.dtype,
            base_gpu_id=base_gpu_id, tensor_parallel=self.tensor_parallel * self.nodes,
            nodes=self.nodes, node_rank=node_rank, dist_init_addr=dist_init_addr,
            expert_parallel=self.expert_parallel, mem_fraction_static=self.mem_fraction_static,
            extra_args=embedded if self.backend == "embedded" else sglang,
        )  # fmt: skip

    def check_machine(self, model: str) -> None:
        """Refuse a backend this machine cannot run, before any process starts."""
        if self.backend == "embedded" and self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("engine.device: cuda, but this machine has no CUDA GPU; "
                                  "allowed here: cpu")  # fmt: skip
        if self.backend != "sglang":
            return
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise ConfigError(
                "engine.backend: sglang, but the sglang package is not installed here "
                "(pip install '.[gpu]' on a CUDA machine, docs/gpu.md); allowed here: embedded"
            )
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "engine.backend: sglang needs CUDA GPUs and this machine has none; "
                "allowed here: embedded"
            )
        if not Path(model).is_dir():
            raise ConfigError(
                f"model: {model!r}; engine.backend sglang serves a model directory "
                "(a Hugging Face checkpoint), not a built-in spec"
            )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Periodic checkpoints (docs/runtime.md "Crashes and resume"); SIGUSR1 always makes one."""

    every_steps: int = 10
    """Checkpoint after every this many optimizer updates (0: not by count)."""
    every_minutes: float = 0.0
    """... and/or when this many minutes passed since the last one (0: not by time)."""
    keep: int = 2
    """Newest checkpoints kept (older ones are deleted once a newer one is complete)."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or not self.every_minutes >= 0:
            raise ConfigError("every_steps / every_minutes: allowed >= 0 (0 switches it off)")
        if self.keep < 1:
            raise ConfigError(f"keep: {self.keep}; allowed: an integer >= 1")


@dataclass(kw_only=True, slots=True)
class TimeoutsConfig:
    """Upper bounds of every blocking wait; past one the run aborts with a message."""

    startup_s: float = 180.0
    """Engines, replicas and the proxy must be up within this."""
    stall_s: float = 180.0
    """The run aborts when no message arrives for this long while work is outstanding."""
    drain_s: float = 60.0
    """At the end: cancelled harnesses must be closed and scored within this."""
    run_s: float = 3600.0
    """Whole-run wall-clock limit."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ConfigError(f"{f.name}: {getattr(self, f.name)!r}; allowed: > 0 seconds")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """What `gyre eval` scores a run's policies on (docs/tasks.md "Held-out evaluation")."""

    suite: str | list[str] | None = None
    """A held-out suite (same forms as harness.suite). None: held-out instances of the
    training suite's tasks, drawn from seeds training never uses; a task without variables
    has only its one instance, which training runs, so it needs an eval suite."""
    tasks: list[str] = field(default_factory=list)
    """Task names of the eval suite to score; empty: every task of it."""
    every_steps: int = 0
    """Validation while training: every this many steps (and at step 0, before any update)
    the held-out set runs on the policy the rollout engines serve, on rollout capacity,
    never blocking a training step (docs/runtime.md "Validation while training"); 0: off."""
    instances: int = 16
    """Held-out instances per task of each in-run evaluation (the same seeds every time)."""
    concurrency: int = 4
    """In-run evaluation executions running at once (beside the training executions)."""
    log_samples: int = 0
    """Transcripts written per in-run evaluation (trackers' text, the HTML report); at most
    `instances`."""

    def __post_init__(self) -> None:
        for key in ("every_steps", "log_samples"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: {getattr(self, key)}; allowed: an integer >= 0")
        for key in ("instances", "concurrency"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: {getattr(self, key)}; allowed: an integer >= 1")
        if self.log_samples > self.instances:
            raise ConfigError(f"log_samples: {self.log_samples}; allowed: at most "
                              f"eval.instances ({self.instances})")  # fmt: skip
        if self.log_samples and not self.every_steps:
            raise ConfigError(
                f"log_samples: {self.log_samples} with every_steps 0; allowed: "
                "0, or eval.every_steps >= 1 (samples come from in-run evaluations)"
            )


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A whole Gyre job."""

    name: str = "local"
    """Run name (prefix of the run directory)."""
    model: str = "tiny"
    """tiny | tiny:HIDDENxLAYERS (e.g. tiny:256x4) | smollm2-135m | a local HF model directory."""
    model_name: str = "gyre"
    """Model name harnesses send (the proxy serves this one)."""
    steps: int = 2
    """S: optimizer updates to run."""
    runs_dir: str = "runs"
    """Where run directories are created."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """Processes of the MPI world."""
    schedule: RunSchedule = field(default_factory=RunSchedule)
    """Scheduler and policy."""
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    """Harness pool and tasks."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The trainer: objective, optimizer, admission, packing, device (gyre.train.config)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Embedded engines."""
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    """The harness-facing proxy."""
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    """Bounds on blocking waits."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Periodic checkpoints a crashed or preempted run resumes from."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment trackers fed the per-step metrics: TensorBoard, W&B, MLflow (docs/tracking.md)."""
    pace: PaceConfig = field(default_factory=PaceConfig)
    """Paced devices: engines and cells take a modelled cluster's time (docs/pacing.md)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (`gyre eval`): its own suite, or the training suite's held-out
    instances."""
    slurm: dict[str, Any] = field(default_factory=dict)
    """Cluster launch: `gyre.launch.config.SlurmConfig`, validated by the launcher only."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps: {self.steps}; allowed: an integer >= 1")
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: {self.name!r}; allowed: a non-empty name without '/'")
        if self.model_name not in self.proxy.model_names:
            raise ConfigError(
                f"model_name: {self.model_name!r} is not served by the proxy; allowed: one of "
                f"proxy.model_names {self.proxy.model_names}"
            )
        if self.train.min_group_outcomes > self.schedule.group_size:
            raise ConfigError(
                f"train.min_group_outcomes: {self.train.min_group_outcomes}; allowed: at most "
                f"schedule.group_size ({self.schedule.group_size}), or every group is set aside"
            )
        from gyre.models import tiny_size
        from gyre.schedule.policy import make_policy
        from gyre.train.megatron.config import check_pipeline_split

        if self.pace.enabled and self.engine.backend != "embedded":
            raise ConfigError(
                f"pace.scale: {self.pace.scale} with engine.backend {self.engine.backend}; "
                "allowed: pacing the embedded engine only (pace.scale 0 on GPUs)"
            )
        tiny_size(self.model)  # a malformed tiny:HxL is refused here, before any process starts
        try:  # a known backend; the cell's sizes: tensor x pipeline x data = ranks_per_cell
            dims = self.dims
            check_pipeline_split(self.model, dims.pipeline)  # equal stages of layers
        except ConfigError as e:
            raise ConfigError(f"train.{e}") from None
        self._check_engines_per_cell()
        try:  # the scheduler validates both; its messages start with the field name
            make_policy(*self.scheduler())
        except ConfigError as e:
            raise ConfigError(f"schedule.{e}") from None

    def scheduler(self) -> tuple[SchedulerConfig, PolicyConfig]:
        """The scheduler's config and policy of this run: its schedule on its topology, its
        cells' engines and their training layout's pipeline stages (`schedule.window` auto)."""
        return self.schedule.scheduler(self.topology, self.engines_per_cell, self.dims.pipeline)

    def routing_top_k(self) -> int:
        """Experts per token of the model when the run records and replays its routing
        (`train.routing_replay`, auto resolved by the model's config.json), else 0."""
        from gyre.models import model_config

        config = model_config(self.model)
        hf = config.get_text_config().to_dict() if config is not None else {}
        return int(hf.get("num_experts_per_tok") or 0) if self.train.replays_routing(hf) else 0

    @property
    def engines_per_cell(self) -> int:
        """E: the rollout engines of one cell (`engine.per_cell`; auto: on GPUs one per
        `engine_ranks` of the cell's ranks, so they hold every GPU of a colocated cell; an
        embedded engine on the CPU, 1). Engine j of a cell is launched by its rank
        j x `engine_ranks` (`gyre.runtime.shared.placement.engine_hosts`)."""
        if self.engine.per_cell != "auto":
            return self.engine.per_cell
        on_gpu = self.engine.backend == "sglang" or self.engine.device == "cuda"
        return max(1, self.topology.ranks_per_cell // self.engine_ranks) if on_gpu else 1

    @property
    def engine_ranks(self) -> int:
        """The cell ranks (one GPU each) one engine spans: tensor_parallel x nodes."""
        return self.engine.tensor_parallel * self.engine.nodes

    def _check_engines_per_cell(self) -> None:
        e, r = self.engines_per_cell, self.topology.ranks_per_cell
        if e > 1 and e * self.engine_ranks > r:
            raise ConfigError(
                f"engine.per_cell: {e} engines x tensor_parallel {self.engine.tensor_parallel} "
                f"x nodes {self.engine.nodes} = {e * self.engine_ranks} ranks, but a cell has "
                f"topology.ranks_per_cell {r}; allowed: at most {max(1, r // self.engine_ranks)}"
            )

    @property
    def train_backend(self) -> TrainBackend:
        """The cells' training backend (`gyre.train.backends`), by `train.backend`."""
        return backend(self.train.backend)

    @property
    def dims(self) -> ParallelDims:
        """A cell's parallel sizes: the training backend's layout of its ranks."""
        return self.train_backend.dims(self.train.parallel, self.topology.ranks_per_cell)

    @property
    def uses_gpus(self) -> bool:
        """Does the run place anything on a GPU (an SGLang engine, a CUDA trainer)? Each rank's
        placement (`gyre.runtime.roles.place_rank`) and the preflight's read this one answer."""
        return (self.train.device.startswith("cuda") or self.engine.backend == "sglang"
                or self.engine.device == "cuda")  # fmt: skip

    def check_machine(self) -> None:
        """Refuse backends this machine cannot run, before any process starts."""
        self.engine.check_machine(self.model)
        self.train_backend.check_installed()

    def warnings(self) -> list[str]:
        """What loads but deserves the operator's attention (`gyre run` and `gyre render`
        print these)."""
        out = []
        if self.proxy.max_context_tokens > self.train.token_budget:
            out.append(
                f"proxy.max_context_tokens {self.proxy.max_context_tokens} > train.token_budget "
                f"{self.train.token_budget}: a path longer than the budget trains alone in a "
                f"micro-step of its own length (up to {self.proxy.max_context_tokens} tokens); "
                "one must fit in a cell's memory"
            )
        modelled, stages = self.pace.costs.pipeline_stages, self.dims.pipeline
        if self.pace.enabled and modelled != stages:
            out.append(
                f"pace.costs.pipeline_stages {modelled} != train.parallel.pipeline {stages}: "
                f"the cells claim windows of {self.schedule.window_for(stages)} micro-steps "
                f"for their {stages} stages, but a paced pass is charged through {modelled}"
            )
        return out


def parse_run_config(
    path: str | Path, overrides: Sequence[str] = (), *, steps: int | None = None,
    policy: str | None = None,
) -> tuple[RunConfig, dict[str, Any]]:  # fmt: skip
    """The one parse of a run config: read the YAML, apply `KEY.PATH=VALUE` overrides and
    `--steps` / `--policy`, validate. Returns the config and the merged mapping it was
    loaded from (what the launcher writes for the job's ranks to read).

    Overrides go through the same strict loader: an unknown key names the allowed ones.
    """
    data = apply_overrides(read_mapping(path), overrides)
    if steps is not None:
        data["steps"] = steps
    if policy is not None:
        data.setdefault("schedule", {})["policy"] = policy
    return load(RunConfig, data, path="run"), data


def load_run_config(
    path: str | Path, overrides: Sequence[str] = (), *, steps: int | None = None,
    policy: str | None = None,
) -> RunConfig:  # fmt: skip
    """`parse_run_config`'s config (`gyre run`, `gyre eval`, every rank of a job)."""
    return parse_run_config(path, overrides, steps=steps, policy=policy)[0]


def dump_run_config(cfg: RunConfig) -> str:
    """YAML text of a config (stored in the trace's run meta and the run directory)."""
    from gyre.config import to_dict

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
