"""The simulated engine on a virtual clock, for fleet simulations that run faster than time (``kvmesh bench routing``).

``MockEngine`` (engines/mock/engine.py) runs its scheduler in an asyncio loop that sleeps for each step's modelled
time: right for a deployment, useless for sweeping a routing policy over an hour of trace at four loads. A
``VirtualEngine`` is the same ``Scheduler`` (same batching, chunked prefill, prefix cache, preemption, KV events and
step-time model) driven by a caller that owns the clock: ``add`` a request at ``now_s``, ``step`` at ``now_s`` when
the engine is idle, and the step's outputs become visible ``StepOutput.step_time_s`` (scaled as below) later. Nothing
here sleeps, reads a clock or does I/O.

For disaggregated fleets (``kvmesh bench disagg``) it also exposes the scheduler's remote-prefill primitives as a
decode engine uses them (``reserve_remote_prefill``, ``commit_remote_prefill``, ``cancel_remote_prefill``,
``cached_prefix_tokens``), ``abort`` (a prefill engine drops a request after its first token) and the modelled KV
transfer time (``kv_transfer_time_s``).

Time is the served engine's wall time: a step and a KV transfer last their modelled time divided by a finite
``speedup_ratio``, as ``MockEngine`` sleeps them, so that a graph served at ``speedup_ratio: 0.15`` and the same graph
simulated (``kvmesh simulate``) agree (they differed 6.7x before). An infinitely fast engine (``inf``, no sleep at
all: its wall time is the host's, which nothing here models) keeps the modelled times, as at ``speedup_ratio`` 1.

The public face of the private ``engines`` package for the command line (tests/unit/test_layering.py: only
``components.workers`` imports its engines).
"""

from __future__ import annotations

import dataclasses

from components.protocol.messages import GenerateRequest, KvEvent, LoadSnapshot, TokenChunk
from components.workers.engines.mock.config import MockEngineConfig
from components.workers.engines.mock.perf_model import transfer_time_s
from components.workers.engines.mock.scheduler import Scheduler, StepOutput

__all__ = ["MockEngineConfig", "StepOutput", "VirtualEngine", "step_time_of", "wall_time_scale"]


def step_time_of(config: MockEngineConfig) -> dict[str, float]:
    """The step-time model a worker running this engine announces (``WorkerMetadata.step_time``)."""
    return config.step_time_model.to_mapping()


def wall_time_scale(config: MockEngineConfig) -> float:
    """Seconds of the served engine's wall time per second of modelled time: 1 / a finite ``speedup_ratio``, 1 for
    an infinitely fast engine (module docstring)."""
    return 1.0 if config.is_infinitely_fast else 1.0 / config.speedup_ratio


class VirtualEngine:
    """One simulated engine whose time the caller advances (module docstring)."""

    def __init__(self, config: MockEngineConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.step_time = step_time_of(config)
        # Modelled time -> the served engine's wall time (module docstring); 1.0 for inf.
        self.time_scale = wall_time_scale(config)

    def add(self, request: GenerateRequest, now_s: float) -> None:
        """Queue a request (raises ``EngineRequestError`` for one it can never serve, as the real engine does)."""
        self.scheduler.add_request(request, now_s)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, now_s: float) -> StepOutput:
        """Run one step starting at ``now_s``; its tokens and finishes belong to ``now_s + step_time_s``."""
        out = self.scheduler.step(now_s)
        if self.time_scale != 1.0:
            out = dataclasses.replace(out, step_time_s=out.step_time_s * self.time_scale)
        return out

    def take_kv_events(self) -> list[KvEvent]:
        return self.scheduler.take_kv_events()

    def snapshot(self, now_s: float) -> LoadSnapshot:
        return self.scheduler.snapshot(now_s)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting, running or reserved request and free its blocks; False if it is unknown or finished."""
        return self.scheduler.abort(request_id)

    # --- remote prefill (disaggregated serving), thin wrappers over the scheduler's primitives --------------------

    @property
    def num_reserved(self) -> int:
        """Requests holding blocks while another engine prefills their prompt (not scheduled here)."""
        return len(self.scheduler.remote)

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Leading prompt tokens this engine's prefix cache holds (whole blocks); touches nothing."""
        return self.scheduler.cached_prefix_tokens(token_ids)

    def reserve_remote_prefill(self, request: GenerateRequest, now_s: float) -> bool:
        """Reserve blocks for ``request``'s whole prompt (sharing the cached prefix) while another engine prefills
        it; False, changing nothing, when the cache has no room now (prefill it here instead)."""
        return self.scheduler.reserve_remote_prefill(request, now_s) is not None

    def commit_remote_prefill(self, request_id: str, first_token: int) -> TokenChunk | None:
        """The prompt's KV arrived with its first token: the request decodes from the next step. The first token's
        chunk (with a finish reason when it is the last), or None if the request is no longer reserved."""
        return self.scheduler.commit_remote_prefill(request_id, first_token)

    def cancel_remote_prefill(self, request_id: str) -> bool:
        """Prefill a reserved request here after all (back of the waiting queue); False if it is not reserved."""
        return self.scheduler.cancel_remote_prefill(request_id)

    def kv_transfer_time_s(self, num_tokens: int) -> float:
        """Modelled time to send the KV of ``num_tokens`` prompt tokens (whole blocks) to another engine."""
        cfg = self.config
        modelled = transfer_time_s(
            -(-num_tokens // cfg.block_size),
            bytes_per_block=cfg.kv_bytes_per_block,
            bandwidth_gbps=cfg.kv_transfer_bandwidth_gbps,
            latency_ms=cfg.kv_transfer_latency_ms,
        )
        return modelled * self.time_scale
