"""The worker's configuration: one pydantic model; ``kvmesh worker`` flags are derived from it."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, Field, model_validator

from components.migration.config import MigrationConfig
from components.protocol.metadata import WorkerRole
from components.router.policies.disagg import DEFAULT_MAX_LOCAL_PREFILL_LENGTH, DEFAULT_MAX_PREFILL_QUEUE_SIZE

# The conditional-disaggregation thresholds: only a decode worker decides where to prefill, so only it reads them.
DECODE_ONLY_FIELDS = ("max_local_prefill_length", "max_prefill_queue_size", "remote_prefill_timeout_s")


class EngineKind(enum.StrEnum):
    MOCK = "mock"
    VLLM = "vllm"


class WorkerConfig(MigrationConfig):
    """A worker process: which engine, where it registers, its role (aggregated or disaggregated), how often it
    reports, and how it moves requests (``MigrationConfig``'s fields, inherited)."""

    engine: EngineKind = Field(default=EngineKind.MOCK, description="Inference engine: mock (simulated) or vllm.")
    namespace: str = Field(default="kvmesh", description="Namespace to register in.")
    component: str = Field(default="backend", description="Component name the worker registers under.")
    model: str = Field(default="mock-model", description="Served model name, as clients will ask for it.")
    model_path: str = Field(
        default="", description="Local model directory (config and tokenizer); announced to frontends for tokenising."
    )
    role: WorkerRole = Field(
        default=WorkerRole.AGGREGATED,
        description="aggregated (prefills and decodes its own requests), prefill (prefills prompts from the prefill "
        "queue for decode workers; clients are never routed to it) or decode (takes client requests and prefills "
        "long prompts remotely: max_local_prefill_length, max_prefill_queue_size).",
    )
    # Dynamo's flag names and defaults (components/router/policies/disagg.py says where they come from, and why).
    max_local_prefill_length: int = Field(
        default=DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
        ge=0,
        description="Decode workers: prefill a prompt remotely only when its uncached part (prompt tokens less those "
        "this worker's prefix cache holds) is longer than this many tokens; shorter ones are prefilled here.",
    )
    max_prefill_queue_size: int = Field(
        default=DEFAULT_MAX_PREFILL_QUEUE_SIZE,
        ge=0,
        description="Decode workers: prefill remotely only while the prefill queue holds fewer than this many items "
        "(requests waiting); otherwise prefill here. 0: never remotely.",
    )
    remote_prefill_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Decode workers: how long a request waits for its remote prefill (queue wait, prefill, KV "
        "transfer) before this worker prefills it itself. Longer than the prefill queue's ack wait (5 s) plus a "
        "prefill, so that an item whose prefill worker died is redelivered to another in time.",
    )
    profile: str = Field(
        default="",
        description="A profile JSON written by 'kvmesh profile' for this engine: the worker announces its fitted "
        "step-time coefficients (metadata step_time, which the kv router predicts with) and its profile_id instead "
        "of the engine's own model. Empty: the engine's own (the mock engine's configured coefficients; none for "
        "vLLM, whose workers the router then predicts with the defaults).",
    )
    num_workers: int = Field(
        default=1, ge=1, le=4096, description="Independent workers in this process, each with its own id and lease."
    )
    metrics_interval_ms: int = Field(
        default=100, ge=10, description="How often each worker publishes its LoadSnapshot on the event plane."
    )
    engine_check_interval_ms: int = Field(
        default=500,
        ge=10,
        description="How often each worker asks its engine whether it died; a dead engine's worker leaves the fleet "
        "(deregisters) and, once every worker of the process has, the process exits with status 1.",
    )
    kv_events_batch_ms: int = Field(
        default=10, ge=0, description="KV events are gathered this long before one batch is published (0: at once)."
    )
    drain_timeout_s: float = Field(
        default=60.0, gt=0, description="On SIGTERM, how long in-flight requests may run before they are cancelled."
    )

    @model_validator(mode="after")
    def _check_role(self) -> WorkerConfig:
        # A threshold on a prefill or aggregated worker is a setting in the wrong place (most likely meant for the
        # decode workers): neither ever decides where to prefill. Refused, not ignored, as `kvmesh worker` refuses
        # another engine's flags. A value equal to the default passes: a config must survive its own model_dump()
        # (every field, at its default), and the default changes nothing anyway.
        if self.role == WorkerRole.DECODE:
            return self
        fields = type(self).model_fields
        misplaced = [n for n in DECODE_ONLY_FIELDS if getattr(self, n) != fields[n].default]
        if misplaced:
            given = ", ".join(f"{n} = {getattr(self, n)}" for n in misplaced)
            raise ValueError(
                f"{given}: only decode workers read {'it' if len(misplaced) == 1 else 'them'} (this worker's role is "
                f"{self.role}, which never decides where to prefill); set role to decode, or leave "
                f"{'it' if len(misplaced) == 1 else 'them'} out"
            )
        return self


def engine_config_model(kind: EngineKind) -> type[BaseModel]:
    """The config model of engine ``kind`` (its flags, its graph fields). The one way into an engine's options from
    outside ``components.workers`` (only this package imports its engines); imports nothing of vLLM itself."""
    if kind == EngineKind.MOCK:
        from components.workers.engines.mock.config import MockEngineConfig

        return MockEngineConfig
    from components.workers.engines.vllm.config import VllmEngineConfig

    return VllmEngineConfig


def vllm_engine(config: BaseModel, *, name: str, role: WorkerRole) -> Any:
    """A ``VllmEngine`` (not started) of ``config`` (a ``VllmEngineConfig``) for a worker of ``role``: how the
    command line's benchmarks drive engines without importing ``components.workers.engines`` (only this package
    does). Imports no vLLM: ``start()`` does."""
    from components.workers.engines.vllm.config import VllmEngineConfig
    from components.workers.engines.vllm.engine import VllmEngine

    if not isinstance(config, VllmEngineConfig):
        raise TypeError(f"expected a VllmEngineConfig, got {type(config).__name__}")
    return VllmEngine(config, name=name, role=role)


def build_engine(kind: EngineKind, config: BaseModel, name: str) -> Any:
    """An engine of ``kind`` (an ``Engine``) from its config (``engine_config_model(kind)``), for a ``Worker`` built
    outside ``components.workers`` (benchmarks); imports the engine only when called."""
    if kind == EngineKind.MOCK:
        from components.workers.engines.mock import MockEngine, MockEngineConfig

        assert isinstance(config, MockEngineConfig)
        return MockEngine(config, name=name)
    from components.workers.engines.vllm import VllmEngine, VllmEngineConfig

    assert isinstance(config, VllmEngineConfig)
    return VllmEngine(config, name=name)


def vllm_reference() -> tuple[type[BaseModel], dict[str, str], str]:
    """What running ``vllm serve`` with a kvmesh worker's settings needs (``kvmesh bench vs-vllm``): the vLLM engine
    config model, the environment the adapter starts vLLM in, and the topic of its KV-event publisher."""
    from components.workers.engines.vllm.config import DEFAULT_ENVIRONMENT, VllmEngineConfig
    from components.workers.engines.vllm.engine import KV_EVENTS_TOPIC

    return VllmEngineConfig, dict(DEFAULT_ENVIRONMENT), KV_EVENTS_TOPIC
