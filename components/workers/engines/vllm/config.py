"""Configuration of the vLLM engine adapter (``VllmEngineConfig``) and the process environment vLLM must start with.

Field names and defaults follow vLLM's engine arguments (``vllm.AsyncEngineArgs``) wherever vLLM has the knob; where
kvmesh's default differs, the field's description says why (the CPU machines this project is tested on). ``None``
means "vLLM decides" (its per-platform default).

Several names are shared with ``MockEngineConfig`` (``block_size``, ``max_model_len``, ``max_num_seqs``,
``max_num_batched_tokens``, ``enable_prefix_caching``, ``enable_chunked_prefill``, ``seed``,
``max_pending_kv_event_batches``): ``kvmesh worker`` registers each flag once and hands it to whichever engine runs.

``apply_vllm_environment(config, os.environ)`` sets the environment vLLM needs. It must be in ``os.environ`` before
vLLM (and torch) are imported, because torch reads ``OMP_NUM_THREADS`` once at import, and before the engine is built,
because vLLM's spawned engine-core and worker processes inherit it. docs/vllm-cpu.md has the measurements behind
every value.

This module imports only the standard library and pydantic (never vllm: the mock path must not pay for it).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DEFAULT_ENVIRONMENT",
    "OWNER_PID_ENV",
    "RUNTIME_DIR_ENV",
    "SAMPLER_DRAWS_KEY",
    "VllmEngineConfig",
    "apply_vllm_environment",
    "engine_arguments",
]

# What the kvmesh process tells vLLM's processes (hooks.py): who owns them (their lifeline watches for its death),
# and the private directory of their ipc sockets (removed when the owner is gone).
OWNER_PID_ENV = "KVMESH_VLLM_OWNER_PID"
RUNTIME_DIR_ENV = "KVMESH_VLLM_RUNTIME_DIR"
# ``SamplingParams.extra_args`` key of a continued request: how many tokens its sampler already drew (hooks.py).
SAMPLER_DRAWS_KEY = "kvmesh_sampler_draws"
# Loaded by name in vLLM's engine-core and model-worker processes (hooks.py).
SCHEDULER_CLS = "components.workers.engines.vllm.hooks.OwnedScheduler"
# The engine core's method hooks.py adds to evict a prefix's free cached blocks (``VllmEngine.drop_prefix``).
DROP_UTILITY = "kvmesh_drop_blocks"
WORKER_EXTENSION_CLS = "components.workers.engines.vllm.hooks.KvmeshWorkerExtension"

MIB = 2**20


class VllmEngineConfig(BaseModel):
    """vLLM engine options (--engine vllm); --model-path and the flags shared with the mock engine apply too.

    Shared flags keep this model's defaults when not given: --block-size 32, --max-model-len / --max-num-seqs /
    --max-num-batched-tokens / --enable-chunked-prefill vLLM's own, --enable-prefix-caching on, --seed 0,
    --max-pending-kv-event-batches 4096.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- Model ------------------------------------------------------------------------------------------------------
    model_path: str = Field(
        description="Local Hugging Face model directory (config.json, weights, tokenizer). The engine gets token ids, "
        "never text (skip_tokenizer_init); the worker announces this path so frontends load the tokenizer from it.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Weight and activation dtype. kvmesh defaults to float32 (vLLM: auto) because the tiny test model "
        "is float32 and the CPU backend's bfloat16 path needs AVX512-BF16; GPU deployments pass auto or bfloat16.",
    )
    load_format: str = Field(
        default="auto",
        description="vLLM's load_format: auto reads the weights in model_path; dummy fills random weights without "
        "files (greedy output then falls into short cycles: docs/vllm-cpu.md).",
    )
    seed: int = Field(default=0, description="vLLM's random seed (sampling without a per-request seed).")

    # --- KV cache ---------------------------------------------------------------------------------------------------
    kv_cache_memory_bytes: int = Field(
        default=64 * MIB,
        ge=0,
        description="KV cache size in bytes, exact. 64 MiB is 1024 blocks of 32 tokens of the tiny test model "
        "(64 KiB per block: 2 layers x K,V x 2 heads x 64 dims x 32 tokens x 4 bytes). 0 lets vLLM size it from "
        "gpu_memory_utilization, which is what GPU deployments want; on a CPU that would claim most of the NUMA "
        "node's memory.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Fraction of device memory vLLM may use; only read when kv_cache_memory_bytes is 0.",
    )
    block_size: int = Field(
        default=32,
        ge=1,
        description="Tokens per KV block, also the block size of kvmesh's KV-event hashes. The CPU attention "
        "backend needs a multiple of 32 (16 fails at start-up); vLLM's CUDA default is 16.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse cached blocks across requests with the same prefix; KV events are only published with it.",
    )

    # --- Scheduler --------------------------------------------------------------------------------------------------
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens (prompt + output) of one sequence; None: the model's own limit. The KV cache must "
        "hold at least one such sequence or vLLM refuses to start.",
    )
    max_num_seqs: int | None = Field(default=None, ge=1, description="Most running sequences; None: vLLM's default.")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="Token budget of one engine step; None: vLLM's default for the platform."
    )
    enable_chunked_prefill: bool | None = Field(
        default=None, description="Split long prompts over several steps; None: vLLM's default (on)."
    )
    enforce_eager: bool = Field(
        default=True,
        description="Run the model eagerly: no torch.compile and no CUDA graphs. kvmesh defaults to True (vLLM: "
        "False) because compiling takes minutes on a CPU and start-up takes ~10 s without it; GPU deployments "
        "pass --no-enforce-eager for CUDA graphs.",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards the model over.")

    # --- CPU threads --------------------------------------------------------------------------------------------------
    num_omp_threads: int = Field(
        default=1,
        ge=1,
        description="OMP_NUM_THREADS of the model process. 1 is fastest for small models on a shared machine: two "
        "workers with 2 threads each on 2 cores ran 20-70x slower than with 1 (docs/vllm-cpu.md).",
    )
    cpu_omp_threads_bind: str = Field(
        default="nobind",
        description="VLLM_CPU_OMP_THREADS_BIND: nobind lets the kernel place threads; vLLM's auto pins every "
        "worker's threads to the same core on a 2-core machine (half speed for two workers). A core list such as "
        "'1' pins explicitly.",
    )

    # --- KV events ----------------------------------------------------------------------------------------------------
    max_pending_kv_event_batches: int = Field(
        default=4096,
        ge=1,
        description="Batches of converted KV events buffered for a slow or absent kv_events() consumer; beyond it "
        "the oldest batch is dropped, the consumer sees a gap in event ids and resynchronises from kv_state().",
    )
    kv_events_replay_steps: int = Field(
        default=10_000,
        ge=1,
        description="Event batches (one per engine step at most) vLLM's publisher keeps for replay; the adapter "
        "asks for a replay when it sees a gap in vLLM's sequence numbers (PUB/SUB drops, late subscription).",
    )

    # --- Moving KV between engines: disaggregation (prefill and decode workers) and migration ------------------
    remote_prefill_mode: Literal["auto", "kv_transfer", "recompute"] = Field(
        default="auto",
        description="How a decode worker's engine gets a remotely prefilled prompt, and whether a prefill worker's "
        "keeps the KV for it (components/workers/engines/vllm/nixl.py). auto: kv_transfer when NIXL is installed and "
        "the engine starts with its connector, else recompute (and the log says why); kv_transfer: NIXL or the "
        "engine does not start; recompute: the decode engine computes the prompt again. Aggregated workers "
        "never prefill remotely (their connector, if any, is migration_mode's).",
    )
    migration_mode: Literal["auto", "kv_transfer", "recompute"] = Field(
        default="auto",
        description="How this engine moves a running request to another worker (aggregated and decode workers; "
        "docs/migration.md). auto: kv_transfer when NIXL is installed and the engine starts with its connector "
        "(kv_both), else recompute (the log says why); kv_transfer: NIXL or the engine does not start; recompute: "
        "no connector for migration (an aggregated worker then loads none), the destination computes prompt + "
        "outputs again. The connector cost nothing measurable in start-up, idle CPU or per request on the CPU test "
        "machine (docs/migration.md).",
    )
    kv_transfer_lease_s: int = Field(
        default=10,
        ge=1,
        description="How long a prefill engine keeps a prompt's KV blocks that no decode engine pulls (its decode "
        "worker died or gave up): vLLM's kv_lease_duration. A waiting decode engine extends it every lease/6 s; the "
        "gap before its first heartbeat (result delivery over NATS, a few ms, up to ~1 s on a stalled machine) must "
        "fit well inside it. While it runs, a prefill engine with unpulled blocks steps without work (~1.2 cores "
        "measured on 2 cores), so shorter is cheaper; vLLM's default is 30.",
    )
    kv_transfer_host: str = Field(
        default="127.0.0.1",
        description="Address of this engine's NIXL handshake listener (one free port per engine), as other "
        "engines reach it. Loopback by default: KV never leaves the machine unless this and UCX_NET_DEVICES say so.",
    )

    @model_validator(mode="after")
    def _check(self) -> VllmEngineConfig:
        if not self.model_path:
            raise ValueError("model_path must name a local model directory")
        return self


# Defaults for a process that owns a vLLM engine; values already in the environment win (an operator's override).
DEFAULT_ENVIRONMENT: dict[str, str] = {
    # vLLM resolves "this node's IP" for torch.distributed's rendezvous and its TCP sockets: keep them on loopback.
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    # Model directories are local; never try the hub (these machines have no route to it).
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM logs to stdout by default; stdout of `kvmesh worker` carries its READY/STOPPED lines.
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def apply_vllm_environment(config: VllmEngineConfig, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Put the engine's environment into ``environ`` (``os.environ`` in a worker); returns what was set.

    The thread settings are overridden, not defaulted: the config is their one source, and a stray
    ``OMP_NUM_THREADS=2`` from a shell costs 3.5x (docs/vllm-cpu.md). Call before vLLM or torch is imported; in a
    process with several engines only the first call's threads reach torch.
    """
    changed: dict[str, str] = {}
    for key, value in DEFAULT_ENVIRONMENT.items():
        if key not in environ:
            environ[key] = changed[key] = value
    for key, value in (
        ("OMP_NUM_THREADS", str(config.num_omp_threads)),
        ("VLLM_CPU_OMP_THREADS_BIND", config.cpu_omp_threads_bind),
    ):
        if environ.get(key) != value:
            environ[key] = changed[key] = value
    return changed


def engine_arguments(config: VllmEngineConfig) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` (without ``kv_events_config``, which needs vLLM's class).

    Fixed choices: token ids in and out (``skip_tokenizer_init``: the frontend owns the tokenizer); vLLM's default
    stat loggers off (``disable_log_stats``: the adapter's own logger still gets every record) with per-step batch
    details on (``enable_logging_iteration_details``: the only source of the step's batch size); kvmesh's hooks in
    vLLM's processes (hooks.py: ``scheduler_cls``, vLLM's default scheduler plus a lifeline, and
    ``worker_extension_cls``). ``None`` fields are left out so vLLM applies its own per-platform defaults.
    """
    kwargs: dict[str, Any] = {
        "model": config.model_path,
        "skip_tokenizer_init": True,
        "dtype": config.dtype,
        "load_format": config.load_format,
        "seed": config.seed,
        "block_size": config.block_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enforce_eager": config.enforce_eager,
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "disable_log_stats": True,
        "enable_logging_iteration_details": True,
        "scheduler_cls": SCHEDULER_CLS,
        "worker_extension_cls": WORKER_EXTENSION_CLS,
    }
    if config.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    optional = {
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs
