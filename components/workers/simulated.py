"""The simulated engine on a virtual clock, for fleet simulations that run faster than time (``kvmesh bench routing``).

``MockEngine`` (engines/mock/engine.py) runs its scheduler in an asyncio loop that sleeps for each step's modelled
time: right for a deployment, useless for sweeping a routing policy over an hour of trace at four loads. A
``VirtualEngine`` is the same ``Scheduler`` (same batching, chunked prefill, prefix cache, preemption, KV events and
step-time model) driven by a caller that owns the clock: ``add`` a request at ``now_s``, ``step`` at ``now_s`` when
the engine is idle, and the step's outputs become visible ``StepOutput.step_time_s`` later. Nothing here sleeps,
reads a clock or does I/O.

For disaggregated fleets (``kvmesh bench disagg``) it also exposes the scheduler's remote-prefill primitives as a
decode engine uses them (``reserve_remote_prefill``, ``commit_remote_prefill``, ``cancel_remote_prefill``,
``cached_prefix_tokens``), ``abort`` (a prefill engine drops a request after its first token) and the modelled KV
transfer time (``kv_transfer_time_s``).

Time is the deployment's: a step modelled at ``t`` takes ``t / speedup_ratio`` (and a KV transfer likewise), as
``MockEngine`` sleeps it, so a graph whose workers run at 0.2x is simulated at 0.2x. At the default ratio of 1 nothing
is divided. A ratio of ``inf`` (``MockEngine`` never sleeps, so its time is the host's CPU, not a model) has no
modelled time: ``VirtualEngine`` refuses it.

The public face of the private ``engines`` package for the command line (tests/unit/test_layering.py: only
``components.workers`` imports its engines).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from components.protocol.messages import GenerateRequest, KvEvent, LoadSnapshot, TokenChunk
from components.workers.engines.mock.block_pool import NoFreeBlocksError
from components.workers.engines.mock.config import MockEngineConfig
from components.workers.engines.mock.perf_model import transfer_time_s
from components.workers.engines.mock.scheduler import Scheduler, StepOutput

__all__ = ["MockEngineConfig", "StepOutput", "VirtualEngine", "step_time_of"]


def step_time_of(config: MockEngineConfig) -> dict[str, float]:
    """The step-time model a worker running this engine announces (``WorkerMetadata.step_time``)."""
    return config.step_time_model.to_mapping()


class VirtualEngine:
    """One simulated engine whose time the caller advances (module docstring)."""

    def __init__(self, config: MockEngineConfig) -> None:
        if config.is_infinitely_fast:
            raise ValueError(
                "speedup_ratio inf has no modelled time (the engine then runs as fast as the host's CPU): simulate "
                "it with a finite speedup_ratio"
            )
        self.config = config
        self._ratio = config.speedup_ratio
        scheduler = self.scheduler = Scheduler(config)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.step_time = step_time_of(config)
        # The calls a replay makes at every step (``step``, ``take_kv_events``) and load report (``snapshot``),
        # bound to the scheduler's own methods: a wrapper is one more Python call each, millions in an hour's
        # replay. ``step(now_s)`` runs one step starting at ``now_s``; its tokens and finishes belong to
        # ``now_s + step_time_s`` (the modelled time divided by ``speedup_ratio``: a wrapper only when it is not 1).
        self.step: Callable[[float], StepOutput] = scheduler.step if self._ratio == 1.0 else self._slowed_step
        self.take_kv_events: Callable[[], list[KvEvent]] = scheduler.pool.take_events
        self.snapshot: Callable[[float], LoadSnapshot] = scheduler.snapshot

    def add(self, request: GenerateRequest, now_s: float) -> None:
        """Queue a request (raises ``EngineRequestError`` for one it can never serve, as the real engine does)."""
        self.scheduler.add_request(request, now_s)

    def add_by_arrival(self, request: GenerateRequest, now_s: float, arrival_s: float) -> None:
        """Queue a request another engine handed over before admitting it, in arrival order
        (``Scheduler.add_request_by_arrival``)."""
        self.scheduler.add_request_by_arrival(request, now_s, arrival_s)

    def is_waiting(self, request_id: str) -> bool:
        """True when the request is queued here without KV (never admitted, or preempted)."""
        return self.scheduler.is_waiting(request_id)

    @property
    def has_work(self) -> bool:
        """Requests waiting or running (``Scheduler.has_unfinished_requests``, read here: asked after every step)."""
        s = self.scheduler
        return bool(s.waiting or s.running)

    def _slowed_step(self, now_s: float) -> StepOutput:
        """A step of an engine at ``speedup_ratio`` r != 1: the modelled time divided by r, as ``MockEngine`` sleeps."""
        out = self.scheduler.step(now_s)
        out.step_time_s = out.step_time_s / self._ratio
        return out

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
        """Modelled time to send the KV of ``num_tokens`` prompt tokens (whole blocks) to another engine, divided by
        ``speedup_ratio`` as ``MockEngine`` charges it."""
        cfg = self.config
        s = transfer_time_s(
            -(-num_tokens // cfg.block_size),
            bytes_per_block=cfg.kv_bytes_per_block,
            bandwidth_gbps=cfg.kv_transfer_bandwidth_gbps,
            latency_ms=cfg.kv_transfer_latency_ms,
        )
        return s if self._ratio == 1.0 else s / self._ratio

    def import_prefix(self, block_hashes: Sequence[int]) -> int | None:
        """Cache a prefix's blocks whose KV another engine sent, with no request (hot-prefix replication's copy,
        ``BlockPool.import_prefix``; its ``BLOCK_STORED`` comes out of ``take_kv_events``): the blocks imported, or
        None, changing nothing, when the cache has no room for them."""
        try:
            return self.scheduler.pool.import_prefix(block_hashes)
        except NoFreeBlocksError:
            return None

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks, cached free ones included (what an import may take)."""
        return self.scheduler.pool.num_free_blocks
