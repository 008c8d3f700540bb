"""The simulated engine on a virtual clock, for fleet simulations that run faster than time (``kvmesh bench routing``).

``MockEngine`` (engines/mock/engine.py) runs its scheduler in an asyncio loop that sleeps for each step's modelled
time: right for a deployment, useless for sweeping a routing policy over an hour of trace at four loads. A
``VirtualEngine`` is the same ``Scheduler`` (same batching, chunked prefill, prefix cache, preemption, KV events and
step-time model) driven by a caller that owns the clock: ``add`` a request at ``now_s``, ``step`` at ``now_s`` when
the engine is idle, and the step's outputs become visible ``StepOutput.step_time_s`` later. Nothing here sleeps,
reads a clock or does I/O.

The public face of the private ``engines`` package for the command line (tests/unit/test_layering.py: only
``components.workers`` imports its engines).
"""

from __future__ import annotations

from components.protocol.messages import GenerateRequest, KvEvent, LoadSnapshot
from components.workers.engines.mock.config import STEP_TIME_FIELDS, MockEngineConfig
from components.workers.engines.mock.scheduler import Scheduler, StepOutput

__all__ = ["MockEngineConfig", "StepOutput", "VirtualEngine", "step_time_of"]


def step_time_of(config: MockEngineConfig) -> dict[str, float]:
    """The step-time model a worker running this engine announces (``WorkerMetadata.step_time``)."""
    return {n: float(getattr(config, n)) for n in STEP_TIME_FIELDS}


class VirtualEngine:
    """One simulated engine whose time the caller advances (module docstring)."""

    def __init__(self, config: MockEngineConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.step_time = step_time_of(config)

    def add(self, request: GenerateRequest, now_s: float) -> None:
        """Queue a request (raises ``EngineRequestError`` for one it can never serve, as the real engine does)."""
        self.scheduler.add_request(request, now_s)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, now_s: float) -> StepOutput:
        """Run one step starting at ``now_s``; its tokens and finishes belong to ``now_s + step_time_s``."""
        return self.scheduler.step(now_s)

    def take_kv_events(self) -> list[KvEvent]:
        return self.scheduler.take_kv_events()

    def snapshot(self, now_s: float) -> LoadSnapshot:
        return self.scheduler.snapshot(now_s)
