"""Warm-starting the SLA planner's predictors from a request trace (``--load-predictor-warmup-trace``): the trace's
arrivals cut into adjustment intervals give one history per predicted series, request rate (requests/s), mean prompt
length and mean output length (tokens), which the predictors observe, oldest first, before the first live interval.
So a seasonal or trending predictor starts from yesterday's load instead of from nothing (its first intervals would
otherwise predict the last value seen, the constant predictor's answer).

Pure: rows in, series out; reading the file is the caller's (components/planner/main.py, with the simulator's trace
readers).

Interval ``k`` covers ``[t0 + k x interval, t0 + (k + 1) x interval)`` with ``t0`` the first arrival; the last,
partial interval is left out (a third of an interval's arrivals would read as a third of the rate). An interval
with no arrival has rate 0 and no length (the length predictors skip it, as they skip a live interval with none).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

__all__ = ["WarmupSeries", "interval_series"]


@dataclasses.dataclass(frozen=True, slots=True)
class WarmupSeries:
    """One value per whole interval (``rates``), and the mean lengths of the intervals that had arrivals."""

    interval_s: float
    rates: tuple[float, ...]
    isls: tuple[float, ...]
    osls: tuple[float, ...]


def interval_series(rows: Iterable[tuple[float, int, int]], interval_s: float) -> WarmupSeries:
    """``rows``: (arrival in seconds, prompt tokens, output tokens), any order. Raises ValueError on an empty
    trace or one shorter than one interval."""
    if not interval_s > 0:
        raise ValueError(f"interval must be positive, got {interval_s}")
    ordered: Sequence[tuple[float, int, int]] = sorted(rows)
    if not ordered:
        raise ValueError("the warm-up trace has no request")
    t0 = ordered[0][0]
    whole = math.floor((ordered[-1][0] - t0) / interval_s)  # intervals that end before the last arrival
    if whole < 1:
        raise ValueError(
            f"the warm-up trace spans {ordered[-1][0] - t0:.1f} s: less than one adjustment interval ({interval_s:g} s)"
        )
    counts = [0] * whole
    isl = [0] * whole
    osl = [0] * whole
    for t, p, o in ordered:
        k = int((t - t0) // interval_s)
        if k >= whole:
            break
        counts[k] += 1
        isl[k] += p
        osl[k] += o
    return WarmupSeries(
        interval_s=interval_s,
        rates=tuple(c / interval_s for c in counts),
        isls=tuple(isl[k] / counts[k] for k in range(whole) if counts[k]),
        osls=tuple(osl[k] / counts[k] for k in range(whole) if counts[k]),
    )
