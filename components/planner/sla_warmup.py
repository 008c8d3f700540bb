"""Reading the SLA planner's ``--load-predictor-warmup-trace``: a request trace with timestamps and token lengths
(Mooncake or Azure) cut into adjustment intervals (``components.planner.sla.warmup.interval_series``), the file I/O
the pure controller does not do. The live planner (components/planner/main.py) and the simulator's planner
(components/planner/simulated.py) both warm-start through it, so ``kvmesh simulate`` replays what the live planner
would predict."""

from __future__ import annotations

from components.planner.sla.warmup import WarmupSeries, interval_series
from components.sim.traces import read_trace

__all__ = ["warmup_series"]


def warmup_series(path: str, interval_s: float) -> WarmupSeries:
    """``--load-predictor-warmup-trace``: the trace's rows with timestamps, cut into intervals (sla/warmup.py).
    Raises ValueError (with the path) on a trace without timestamps or lengths, or shorter than one interval."""
    rows = []
    for row in read_trace(path):
        if row.timestamp_s is None or row.input_length is None or row.output_length is None:
            raise ValueError(f"{path}: row {row.index} has no timestamp or no token lengths (Mooncake or Azure)")
        rows.append((row.timestamp_s, row.input_length, row.output_length))
    try:
        return interval_series(rows, interval_s)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
