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

__all__ = ["HorizonPoint", "Lead", "horizon_points", "lead_intervals", "pool_to_request"]


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


@dataclasses.dataclass(frozen=True, slots=True)
class HorizonPoint:
    """The forecast rate at ``t_s`` from now, read off the interval means; ``interval``: the interval holding it."""

    t_s: float
    rate: float
    interval: int


def horizon_points(observed: float, means: Sequence[float], interval_s: float, startup_s: float) -> list[HorizonPoint]:
    """The forecast over the span the workers asked for now must serve: ``[0, interval_s + startup_s]`` from now (a
    worker asked now serves from ``startup_s``; the next decision's, from ``interval_s + startup_s``; a worker
    removed now is gone from 0). The rate is the linear interpolation through the interval means at their midpoints
    (``means[k]`` at ``(k + 1/2) x interval_s``) and the last observed interval's before them (at ``-interval_s /
    2``): the predictors forecast means, and a load rising or falling through an interval is above its mean at one
    edge. A piecewise-linear curve peaks at a breakpoint or an end, so these are the points: 0, every midpoint
    inside the span, and its end. ``means`` must reach past the end (``lead_intervals + 2`` of them suffice)."""
    if interval_s <= 0 or not math.isfinite(interval_s):
        raise ValueError(f"interval_s must be a finite number > 0, got {interval_s}")
    end = interval_s + startup_s
    xs = [-interval_s / 2] + [(k + 0.5) * interval_s for k in range(len(means))]
    ys = [observed, *means]
    if xs[-1] < end - 1e-9:
        raise ValueError(f"{len(means)} interval means do not reach {end:g} s ahead")

    def at(t: float) -> float:
        for i in range(1, len(xs)):
            if t <= xs[i] + 1e-9:
                w = (t - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + w * (ys[i] - ys[i - 1])
        return ys[-1]

    ts = [0.0] + [x for x in xs[1:] if 0.0 < x < end - 1e-9] + [end]
    return [HorizonPoint(t, max(0.0, at(t)), min(int(t // interval_s), len(means) - 1)) for t in ts]
