"""A run config's memory plan (`gyre.train.memory`) and the preflight check that enforces it.

What: `memory_plan(cfg)` reads the model's shape (its config.json, without weights: the
tiny family's own config, a model directory's file) and the run's training layout, longest
row, micro-step budget, engine and device memory, and returns the `MemoryPlan` every rank
of the core cell would meet. `check` is the preflight's `Check` of this domain: on GPUs
(`train.device` cuda or an SGLang engine) every rank and engine must fit
`topology.gpu_memory_gb`; on the CPU only where `topology.cpu_memory_gb` is set. A layout
that cannot fit is a `ConfigError` naming the rank, its numbers and what would fit.

Why: a 70B layout that does not fit fails minutes into the job, after the queue; the plan
says so before any process starts (`gyre run`, `gyre render --check`, `gyre submit`, the
job's first step) and `gyre plan --memory CONFIG` prints it.

    plan = memory_plan(load_run_config("templates/cluster/swe-24.yaml"))
    print("\\n".join(render(plan)))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gyre.errors import ConfigError
from gyre.runtime.shared.checks import Site, Where
from gyre.runtime.shared.checks import elsewhere as _elsewhere
from gyre.train.megatron.config import SUPPORTED_MODEL_TYPES
from gyre.train.memory import GB, MemoryPlan, ModelShape, TrainLayout, plan_engine

if TYPE_CHECKING:
    from gyre.runtime.shared.config import RunConfig

PLANNED = SUPPORTED_MODEL_TYPES
"""Model families the plan's shapes describe (the Megatron backend's)."""


def hf_config(model: str) -> dict[str, Any]:
    """The model's config.json as a dict (no weights read); ConfigError where it has none
    that this plan reads (smollm2-135m is known once converted: give its directory)."""
    from gyre.models import model_config

    config = model_config(model)
    if config is None:
        raise ConfigError(f"model: {model!r}: its shape is known only once converted; allowed "
                          "for the memory plan: tiny, tiny:HxL or a model directory")  # fmt: skip
    data: dict[str, Any] = config.get_text_config().to_dict()
    if data.get("model_type") not in PLANNED:
        raise ConfigError(f"model: {model!r}: model_type {data.get('model_type')!r} is not "
                          f"planned; allowed: {', '.join(PLANNED)}")  # fmt: skip
    return data


def train_layout(cfg: RunConfig, hf: dict[str, Any]) -> TrainLayout:
    """The core cell's training layout of `cfg`: backend, TP x PP x data, dtype, attention,
    the longest row (`proxy.max_context_tokens`, or the model's context if shorter: the
    proxy refuses longer calls), the micro-step budget and the window a pass runs through
    the stages (`schedule.window`, resolved for them as the scheduler does)."""
    from gyre.train.megatron.config import MegatronConfig

    dims = cfg.dims
    context = hf.get("max_position_embeddings")
    row = cfg.proxy.max_context_tokens
    if isinstance(context, int) and 2 <= context < row:
        row = context
    return TrainLayout(
        backend="megatron" if cfg.train.backend == "megatron" else "torch",
        tensor=dims.tensor, pipeline=dims.pipeline, data=dims.data,
        dtype=cfg.train.params_dtype, attention=MegatronConfig().attention,
        row_tokens=row, token_budget=cfg.train.token_budget, sequence=dims.sequence,
        window=cfg.schedule.window_for(dims.pipeline),
    )  # fmt: skip


def memory_plan(cfg: RunConfig) -> MemoryPlan:
    """The plan of `cfg`'s core cell on its devices."""
    hf = hf_config(cfg.model)
    shape = ModelShape.from_hf(hf)
    gpu = cfg.train.device.startswith("cuda")
    t = cfg.topology
    limit_gb = t.gpu_memory_gb if gpu else t.cpu_memory_gb
    engine = None
    if cfg.engine.backend == "sglang":
        engine = plan_engine(shape, tensor_parallel=cfg.engine.tensor_parallel,
                             mem_fraction_static=cfg.engine.mem_fraction_static,
                             gpu_bytes=int(t.gpu_memory_gb * GB))  # fmt: skip
    return MemoryPlan(shape=shape, layout=train_layout(cfg, hf), gpu=gpu,
                      limit=None if limit_gb is None else int(limit_gb * GB), engine=engine,
                      colocated=t.placement == "colocated",
                      window_for=cfg.schedule.window_for)  # fmt: skip


def check(cfg: RunConfig, site: Site) -> list[str]:
    """Preflight: every core rank and the engine fit their device (`MemoryPlan`), where a
    limit applies; a model not on this machine is checked where the job runs."""
    gpu_engine = cfg.engine.backend == "sglang"
    if not (cfg.train.device.startswith("cuda") or gpu_engine or cfg.topology.cpu_memory_gb):
        return []  # the CPU without a limit: printed by `gyre plan --memory`, not enforced
    if site.where not in (Where.HERE, Where.JOB) and (_elsewhere(cfg.model)
                                                      or cfg.model == "smollm2-135m"):  # fmt: skip
        return []  # the model check notes it; the job's first step checks both
    try:
        plan = memory_plan(cfg)
    except ConfigError as e:  # a family the plan does not describe: said, not refused
        return [f"not checked: memory ({e})"]
    problem = plan.rank_problem() or plan.engine_problem()
    if problem:
        raise ConfigError(f"memory: {problem}")
    return []
