"""The simulator library: one virtual-clock replay loop over simulated engines that runs the real router and the
disaggregation rule (``replay``), the workload types it replays and the trace readers it and the load generator
share, and the properties of a workload that no policy can beat (floors, cache oracles, capacity).

Rank: above the router, migration and workers (it drives their code), below deploy, the planner and the command
line, so that a planner can ask it "what if" and every benchmark is a thin driver over it. No I/O beyond reading a
trace file; no asyncio.
"""

from __future__ import annotations

from .analysis import (
    DRAIN_SLACK,
    GROWTH_SLACK,
    WORKING_SET_FRACTION,
    Probe,
    PromptBlocks,
    Simulator,
    backlog_growth,
    causal_ttft_floor_s,
    derive_programs,
    find_capacity,
    isolated_service_s,
    model_estimate,
    oracle_reuse,
    pooled_fleet,
    probe,
    ttft_floor_s,
    with_causal_cold_start,
    without_cached_prefixes,
)
from .replay import MODEL, NO_ROOM, FleetSpec, RunResult, Sample, Sink, Timed, account_chunk, replay, simulate
from .workload import SimRequest, Workload

__all__ = [
    "DRAIN_SLACK",
    "GROWTH_SLACK",
    "MODEL",
    "NO_ROOM",
    "WORKING_SET_FRACTION",
    "FleetSpec",
    "Probe",
    "PromptBlocks",
    "RunResult",
    "Sample",
    "SimRequest",
    "Simulator",
    "Sink",
    "Timed",
    "Workload",
    "account_chunk",
    "backlog_growth",
    "causal_ttft_floor_s",
    "derive_programs",
    "find_capacity",
    "isolated_service_s",
    "model_estimate",
    "oracle_reuse",
    "pooled_fleet",
    "probe",
    "replay",
    "simulate",
    "ttft_floor_s",
    "with_causal_cold_start",
    "without_cached_prefixes",
]
