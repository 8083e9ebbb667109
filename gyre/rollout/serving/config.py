"""Configuration of one managed rollout server and its launch command (torch-free).

The command comes from a template whose ``{placeholders}`` are filled from the config, so
the same manager starts real SGLang on GPU machines and Gyre's embedded engine on CPU:

    ServerConfig(model_path="/models/qwen", tensor_parallel=2, launch="sglang").command(port)
    # [python, -m, sglang.launch_server, --model-path, /models/qwen, --tp-size, 2, ...]
    ServerConfig(model_path="tiny", launch="embedded").command(port)
    # [python, -m, gyre.rollout.cli, --model, tiny, --host, 127.0.0.1, --port, ...]

Placeholders: python, model_path, host, port, tp, ep, mem_fraction, base_gpu_id, weight_version,
api_key (the run's engine key; the embedded engine reads it from its environment instead).

SGLang has no API to hand a running request's KV cache to another instance (its KV
transfer is PD disaggregation, fixed at launch), so Gyre's KV-cache migration
(`gyre.rollout.kvmigrate`) reports "unsupported" against it and the destination recomputes.
`hicache_shared_l3` gives the flags of SGLang's closest mechanism: every engine writes its
prefix KV through to one shared Mooncake store (HiCache L3) and a destination prefetches a
rerouted call's prefix from it instead of prefilling it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from gyre.errors import ConfigError
from gyre.rollout.protocol import engine_key

# The sglang preset, flag by flag (SGLang 0.5.21; tests/gpu/test_gpu_sglang_bodies.py parses
# it with SGLang's own argument parser):
# * --enable-memory-saver: /release_memory_occupation and /resume_memory_occupation work;
# * --enable-weights-cpu-backup: the released weights are kept in host memory and come back
#   on resume (without it the resumed memory has stale contents until the next publication);
# * --ep-size: the server's GPUs the routed experts of an MoE model are split over (1: each
#   GPU holds a TP slice of every expert; SGLang's `ep_size`, alias --expert-parallel-size);
# * --api-key: the run's engine key (`gyre.rollout.protocol.ensure_engine_key`; empty: none);
# * --grammar-backend llguidance: constrained calls (the proxy's forced tool calls) use the
#   grammar engine and the Lark syntax of Gyre's `ebnf` constraints. The tokenizer is loaded
#   (no --skip-tokenizer-init): SGLang builds no grammar backend without it, and aborts every
#   constrained call.
PRESETS: dict[str, list[str]] = {
    "sglang": [
        "{python}", "-m", "sglang.launch_server", "--model-path", "{model_path}",
        "--host", "{host}", "--port", "{port}", "--tp-size", "{tp}",
        "--ep-size", "{ep}", "--mem-fraction-static", "{mem_fraction}", "--base-gpu-id", "{base_gpu_id}",
        "--weight-version", "{weight_version}", "--enable-memory-saver",
        "--enable-weights-cpu-backup", "--grammar-backend", "llguidance",
        "--api-key", "{api_key}",
    ],
    "embedded": [
        "{python}", "-m", "gyre.rollout.cli", "--model", "{model_path}",
        "--host", "{host}", "--port", "{port}", "--weight-version", "{weight_version}",
    ],
    # the embedded engine on the cell's GPU (`gyre.gpu.engine`): the same CLI and routes
    "embedded-cuda": [
        "{python}", "-m", "gyre.gpu.engine", "--device", "cuda:{base_gpu_id}", "--dtype",
        "{dtype}", "--model", "{model_path}", "--host", "{host}", "--port", "{port}",
        "--weight-version", "{weight_version}",
    ],
}  # fmt: skip
# Environment of every launched server. SGLang reports the log-prob of each sampled token
# under logits / temperature unless SGLANG_RETURN_ORIGINAL_LOGPROB is set; Gyre's behaviour
# log-probs are the model's own (raw logits, T = 1: `gyre.rollout.sampling.policy_logprob`),
# the quantity the trainer recomputes. The embedded engine ignores it.
SERVER_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
WILDCARDS = ("", "0.0.0.0", "::")  # bind every interface: no address to put in a URL
PLACEHOLDERS = (
    "python", "model_path", "host", "port", "tp", "ep", "mem_fraction", "base_gpu_id",
    "weight_version", "api_key", "dtype",
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """One rollout server of a cell (SGLang on GPU, the embedded engine on CPU)."""

    model_path: str
    """Model directory (SGLang) or embedded model spec (tiny | smollm2-135m | directory)."""
    launch: str | list[str] = "sglang"
    """Preset name (sglang | embedded | embedded-cuda) or a command template (argv strings)."""
    host: str = "127.0.0.1"
    """Address the server binds and its URL names (one address, so the URL is reachable
    wherever the address is): a job gives its rank's (`gyre.runtime.shared.address`), never a
    wildcard such as 0.0.0.0."""
    port: int = 0
    """TCP port; 0 picks a free one at start."""
    tensor_parallel: int = 1
    """SGLang --tp-size: GPUs of this server (the cell's ranks), on all its nodes together."""
    nodes: int = 1
    """SGLang --nnodes: the nodes this server spans, tensor_parallel / nodes GPUs on each."""
    node_rank: int = 0
    """SGLang --node-rank: which of them this process runs (0 serves HTTP; the others run
    their schedulers and take their work from node rank 0)."""
    dist_init_addr: str = ""
    """SGLang --dist-init-addr, `host:port` of node rank 0 where every node rank
    rendezvouses (nodes > 1)."""
    expert_parallel: int = 1
    """SGLang --ep-size: of those GPUs, how many an MoE model's routed experts are split over
    (divides tensor_parallel)."""
    mem_fraction_static: float = 0.8
    """SGLang --mem-fraction-static: share of GPU memory for weights + KV cache."""
    base_gpu_id: int = 0
    """SGLang --base-gpu-id: first GPU of this server."""
    weight_version: str = "0"
    """Initial weight version the server reports."""
    dtype: str = "bfloat16"
    """The embedded engine on CUDA (`embedded-cuda`): the dtype it serves in."""
    extra_args: list[str] = field(default_factory=list)
    """Appended to the command verbatim."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the server process."""
    startup_timeout: float = 900.0
    """Seconds to wait for /health after start."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ConfigError("model_path: empty; allowed a model directory or spec")
        if isinstance(self.launch, str) and self.launch not in PRESETS:
            raise ConfigError(
                f"launch: {self.launch!r}; allowed {', '.join(PRESETS)} or a command template list"
            )
        if isinstance(self.launch, list):
            _check_template(self.launch)
        if self.host in WILDCARDS:
            raise ConfigError(
                f"host: {self.host!r}; allowed an address others reach the server at (the URL "
                "names it): 127.0.0.1 on one machine, the node's address across nodes"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: {self.port}; allowed 0..65535 (0 = pick a free port)")
        if self.tensor_parallel < 1:
            raise ConfigError(f"tensor_parallel: {self.tensor_parallel}; allowed >= 1")
        if (
            self.nodes < 1
            or self.tensor_parallel % self.nodes
            or not 0 <= self.node_rank < self.nodes
        ):
            raise ConfigError(f"nodes: {self.nodes}, node_rank: {self.node_rank}; allowed: nodes a "
                              f"divisor of tensor_parallel {self.tensor_parallel}, node_rank "
                              f"0..nodes-1")  # fmt: skip
        if self.nodes > 1 and ":" not in self.dist_init_addr:
            raise ConfigError(f"dist_init_addr: {self.dist_init_addr!r} with nodes {self.nodes}; "
                              "allowed: host:port of node rank 0")  # fmt: skip
        if self.expert_parallel < 1 or self.tensor_parallel % self.expert_parallel:
            raise ConfigError(f"expert_parallel: {self.expert_parallel}; allowed a divisor of "
                              f"tensor_parallel {self.tensor_parallel}")  # fmt: skip
        if not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"mem_fraction_static: {self.mem_fraction_static}; allowed (0, 1)")
        if self.startup_timeout <= 0:
            raise ConfigError(f"startup_timeout: {self.startup_timeout}; allowed > 0")
        for key, value in SERVER_ENV.items():
            if self.env.get(key, value) != value:
                raise ConfigError(
                    f"env.{key}: {self.env[key]!r}; allowed {value!r} (Gyre's behaviour "
                    "log-probs are the model's own, before temperature)"
                )

    def template(self) -> list[str]:
        return list(PRESETS[self.launch]) if isinstance(self.launch, str) else list(self.launch)

    def command(self, port: int) -> list[str]:
        """The argv that starts this server on `port`."""
        values = {
            "python": sys.executable, "model_path": self.model_path, "host": self.host,
            "port": str(port), "tp": str(self.tensor_parallel), "ep": str(self.expert_parallel),
            "mem_fraction": str(self.mem_fraction_static), "base_gpu_id": str(self.base_gpu_id),
            "weight_version": self.weight_version, "api_key": engine_key() or "",
            "dtype": self.dtype,
        }  # fmt: skip
        argv = [arg.format(**values) for arg in self.template()]
        return argv + self.multinode_args() + list(self.extra_args)

    def multinode_args(self) -> list[str]:
        """SGLang's flags of a server on several nodes (none on one): every node rank starts
        the same command but its --node-rank, and rendezvouses at node rank 0's
        --dist-init-addr (sglang/srt/arg_groups/fields/parallel.py, 0.5.21; its tp_size counts
        every node's GPUs, `entrypoints/engine.py` `_calculate_rank_ranges`)."""
        if self.nodes == 1:
            return []
        return ["--nnodes", str(self.nodes), "--node-rank", str(self.node_rank),
                "--dist-init-addr", self.dist_init_addr]  # fmt: skip


def _check_template(template: list[str]) -> None:
    import string

    if not template:
        raise ConfigError("launch: empty command template")
    for arg in template:
        for _, name, _, _ in string.Formatter().parse(arg):
            if name is not None and name not in PLACEHOLDERS:
                raise ConfigError(
                    f"launch: unknown placeholder {{{name}}} in {arg!r}; "
                    f"allowed {', '.join(PLACEHOLDERS)}"
                )


def hicache_shared_l3(
    *,
    master: str,
    metadata_server: str,
    protocol: str = "rdma",
    device: str = "",
    global_segment_bytes: int = 4 << 30,
    page_size: int = 64,
) -> tuple[list[str], dict[str, str]]:
    """(extra_args, env) of a `ServerConfig` whose engines share prefix KV through a
    Mooncake store (SGLang HiCache with L3 storage backend ``mooncake``).

    `master` / `metadata_server` are the Mooncake master (``host:50051``) and metadata service
    (``http://host:8080/metadata``) of the job; `device` names the RDMA NICs (``ibv_devices``)
    when `protocol` is "rdma". ``write_through`` stores every prefilled page in L3, and
    ``wait_complete`` makes a destination's prefix miss wait for the L3 prefetch. Not yet run
    on a GPU (docs/engine.md, *KV-cache migration*)."""
    if protocol not in ("rdma", "tcp"):
        raise ConfigError(f"protocol: {protocol!r}; allowed rdma, tcp")
    args = [
        "--enable-hierarchical-cache", "--page-size", str(page_size),
        "--hicache-mem-layout", "page_first", "--hicache-io-backend", "kernel",
        "--hicache-write-policy", "write_through", "--hicache-storage-backend", "mooncake",
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip
    env = {
        "MOONCAKE_MASTER": master, "MOONCAKE_TE_META_DATA_SERVER": metadata_server,
        "MOONCAKE_PROTOCOL": protocol, "MOONCAKE_DEVICE": device,
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(global_segment_bytes),
    }  # fmt: skip
    return args, env
