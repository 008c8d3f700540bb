"""Start-up lead: how many workers to ask for now so that they are serving when the forecast needs them.

A worker asked for now serves only after it starts and registers, ``startup_s`` later (measured per engine: the
issue asks for the simulated and the vLLM worker's). With decisions every ``interval_s``, that is

    lead = ceil(startup_s / interval_s)   intervals

(1e-9 slack: a start-up of exactly 2 intervals is a lead of 2). ``needs[k]`` is the pool size the forecast needs
during interval ``k``, ``k = 0`` the interval that starts now (from a predictor's ``predict_ahead`` through the
replica formulas). A worker needed in interval ``k`` must be asked for in interval ``k - lead``; what is asked for now
is the most that any interval up to ``lead`` needs::

    ask = max(needs[0], ..., needs[lead])

Needs before ``lead`` cannot be met by a worker asked now; they are in the maximum so that a shortfall already
happening is not given up on (the worker still arrives as soon as it can). Needs after ``lead`` are for later
decisions. Scale-down follows from the same maximum: the pool shrinks only once no interval within the lead needs
the workers, since a worker removed now and wanted back within the lead would arrive late (removal is immediate,
return is not). A forecast shorter than ``lead + 1`` intervals is extended with its last value (what a constant
predictor would say), and the detail says so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

__all__ = ["Lead", "lead_intervals", "pool_to_request"]


@dataclasses.dataclass(frozen=True, slots=True)
class Lead:
    """The pool size to ask for now, and why."""

    workers: int
    lead: int  # intervals between asking and serving
    at_interval: int  # which interval's need decided it (0 = now)
    reason: str
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


def lead_intervals(startup_s: float, interval_s: float) -> int:
    """``ceil(startup_s / interval_s)``, with a 1e-9 slack; 0 for an instant start-up."""
    if interval_s <= 0 or not math.isfinite(interval_s):
        raise ValueError(f"interval_s must be a finite number > 0, got {interval_s}")
    if startup_s < 0 or not math.isfinite(startup_s):
        raise ValueError(f"startup_s must be a finite number >= 0, got {startup_s}")
    return max(0, math.ceil(startup_s / interval_s - 1e-9))


def pool_to_request(needs: Sequence[int], startup_s: float, interval_s: float) -> Lead:
    """The pool size to ask for now (module docstring): ``max(needs[0..lead])``."""
    if not needs:
        raise ValueError("needs must hold at least the current interval's pool size")
    lead = lead_intervals(startup_s, interval_s)
    horizon = [needs[min(k, len(needs) - 1)] for k in range(lead + 1)]
    workers = max(horizon)
    at = horizon.index(workers)
    short = len(needs) < lead + 1
    reason = (
        f"{workers} workers: start-up {startup_s:g} s = {lead} interval(s) of {interval_s:g} s, "
        f"the most needed over intervals 0..{lead} is {workers} (interval {at})"
    )
    if short:
        reason += f"; forecast of {len(needs)} interval(s) extended with its last value"
    metrics = {
        "workers": float(workers),
        "lead_intervals": float(lead),
        "need_now": float(needs[0]),
        "startup_s": startup_s,
        "interval_s": interval_s,
    }
    return Lead(workers, lead, at, reason, metrics)
