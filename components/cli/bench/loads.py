"""The loads of ``kvmesh bench planner --load`` (issue 25, "Benchmark"), each a shape of the offered rate as a
fraction of the peak fleet's *measured* capacity (``sim.find_capacity`` on the peak fleet with the load's own request
mix), never a rate tuned to one trace. Pure: numbers in, numbers out; the trace load takes timestamps, not a file.

* ``sinusoid``: Dynamo's planner benchmark (``scaling.Sinusoid``: period 150 s over 600 s, 25-100% of capacity).
* ``slow``: the same shape with a period of at least 20 worker start-ups (``slow_sinusoid``: 600 s, 20 x the 30 s
  start-up, the longer of the two the bench runs with), over two periods.
* ``trace``: a shared trace's own arrival times (Azure conversations by default; read from ../shared/traces, never
  copied), its first ``rows`` rows, with the time axis scaled so that the replayed rows' **mean** rate is
  ``mean_fraction`` of capacity (``TraceLoad.from_timestamps``). Scaling time keeps the trace's burstiness (the
  ratio of its windows' rates to its mean) and changes only how fast the same pattern plays. The mean, not the peak:
  a peak depends on the window it is measured over; the peak of ``window_s`` windows is reported beside it.
* ``step``: ai-dynamo/dynamo issue 10528's shape (``Step``): 1 request/s, then 24, then 1 again, long prompts
  (10528's ISL 8000 / OSL 1000). 10528's 24 requests/s was the load its planner had to grow the fleet to and
  failed to; here the step's high level is the peak fleet's measured capacity at that request mix (``high`` 1.0)
  and its low level 1/24 of it, so 24 rps is, relative to the fleet, the full budget's worth of work and 1 rps a
  24th of it. The step up comes at a quarter of the run and the step down at three quarters (150 s and 450 s of
  600 s): a long enough low phase that the planners settle small before the step.

Time compression by K (``scaled``): every time (period, step times, duration, the trace's arrivals) is divided by K
and the rate is kept, as ``scaling.Sinusoid.scaled`` does; the trace keeps each arrival with probability 1/K
(seeded), so its rate and the shape of its bursts on the compressed clock stay the same.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from collections.abc import Sequence

from components.cli.bench.scaling import LoadShape, Sinusoid

__all__ = [
    "LOAD_NAMES",
    "LoadShape",
    "Step",
    "TraceLoad",
    "dynamo_sinusoid",
    "slow_sinusoid",
]

LOAD_NAMES = ("sinusoid", "slow", "trace", "step")
# A slow sinusoid's period is at least this many worker start-ups (issue 25).
SLOW_PERIOD_STARTUPS = 20
# issue 10528's levels: 1 and 24 requests/s.
STEP_RATIO = 24.0
STEP_LOW_RPS, STEP_HIGH_RPS = 1.0, 24.0
# issue 10528's request mix: ISL 8000, OSL 1000.
STEP_LENGTHS = (8000, 1000)


def dynamo_sinusoid(duration_s: float = 600.0) -> Sinusoid:
    """Dynamo's planner benchmark: period 150 s, 25% to 100% of capacity."""
    return Sinusoid(period_s=150.0, duration_s=duration_s, low=0.25, high=1.0)


def slow_sinusoid(startup_s: float, period_s: float | None = None, periods: float = 2.0) -> Sinusoid:
    """The slow sinusoid: 25-100% of capacity with a period of ``period_s`` (default ``SLOW_PERIOD_STARTUPS`` x
    ``startup_s``), over ``periods`` periods; refuses a period shorter than 20 start-ups."""
    least = SLOW_PERIOD_STARTUPS * startup_s
    period = least if period_s is None else period_s
    if period < least - 1e-9:
        raise ValueError(f"a slow sinusoid's period ({period:g} s) must be at least 20 start-ups ({least:g} s)")
    return Sinusoid(period_s=period, duration_s=periods * period, low=0.25, high=1.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """``low`` until ``up_s``, ``high`` from ``up_s`` until ``down_s``, ``low`` again until ``duration_s``."""

    duration_s: float = 600.0
    low: float = 1.0 / STEP_RATIO
    high: float = 1.0
    up_s: float = 150.0
    down_s: float = 450.0

    def __post_init__(self) -> None:
        if not (0 < self.low <= self.high and 0 <= self.up_s <= self.down_s <= self.duration_s):
            raise ValueError(f"bad step: {self}")

    @classmethod
    def issue_10528(cls, duration_s: float = 600.0, high: float = 1.0) -> Step:
        """10528's levels (1 and 24 rps) as ``high / 24`` and ``high`` of capacity, up at a quarter of the run and
        down at three quarters (module docstring)."""
        return cls(duration_s, high * STEP_LOW_RPS / STEP_HIGH_RPS, high, duration_s / 4, 3 * duration_s / 4)

    @property
    def start(self) -> float:
        return self.fraction(0.0)

    @property
    def mean(self) -> float:
        span = self.down_s - self.up_s
        return (self.high * span + self.low * (self.duration_s - span)) / self.duration_s

    def fraction(self, t: float) -> float:
        return self.high if self.up_s <= t < self.down_s else self.low

    def constant_spans(self) -> tuple[tuple[float, float], ...]:
        """The stretches of constant offered load, [start, end) each: before the step, on it, after it."""
        return tuple(
            (a, b) for a, b in ((0.0, self.up_s), (self.up_s, self.down_s), (self.down_s, self.duration_s)) if b > a
        )

    def scaled(self, factor: float) -> Step:
        return Step(self.duration_s / factor, self.low, self.high, self.up_s / factor, self.down_s / factor)


@dataclasses.dataclass(frozen=True)
class TraceLoad:
    """A trace's arrivals on the load's clock (``arrivals_s``, sorted, in [0, ``duration_s``)), and ``rows``: the
    trace row (its index in the replayed rows) each arrival takes its request from. ``fraction`` is the rate in the
    ``window_s`` window holding t over ``capacity_rps``: what a clairvoyant schedule sizes for."""

    arrivals_s: tuple[float, ...]
    rows: tuple[int, ...]
    duration_s: float
    capacity_rps: float
    window_s: float
    time_scale: float  # load seconds per trace second (< 1: the trace plays faster than recorded)

    def __post_init__(self) -> None:
        if len(self.arrivals_s) != len(self.rows) or not self.arrivals_s:
            raise ValueError("a trace load needs one row per arrival, and at least one arrival")
        if not (self.duration_s > 0 and self.capacity_rps > 0 and self.window_s > 0):
            raise ValueError(f"bad trace load: duration {self.duration_s}, capacity {self.capacity_rps}")

    @classmethod
    def from_timestamps(
        cls,
        timestamps_s: Sequence[float],
        capacity_rps: float,
        mean_fraction: float,
        window_s: float = 10.0,
    ) -> TraceLoad:
        """The rows at ``timestamps_s`` (trace seconds, sorted) replayed from the first at t = 0, every gap
        multiplied by one factor so that the mean rate, ``n`` arrivals over the span from the first to one mean gap
        past the last (``n / (span x n / (n - 1))``: the span of n arrivals holds n - 1 gaps), is ``mean_fraction x
        capacity_rps``."""
        n = len(timestamps_s)
        if n < 2:
            raise ValueError("a trace load needs at least two timestamps")
        t0 = timestamps_s[0]
        span = timestamps_s[-1] - t0
        if span <= 0 or not 0 < mean_fraction:
            raise ValueError(f"bad trace load: span {span} s, mean fraction {mean_fraction}")
        trace_duration = span * n / (n - 1)
        scale = n / (mean_fraction * capacity_rps) / trace_duration
        arrivals = tuple((t - t0) * scale for t in timestamps_s)
        return cls(arrivals, tuple(range(n)), trace_duration * scale, capacity_rps, window_s, scale)

    def _count(self, t0: float, t1: float) -> int:
        return bisect.bisect_left(self.arrivals_s, t1) - bisect.bisect_left(self.arrivals_s, t0)

    def fraction(self, t: float) -> float:
        """The rate in the window holding ``t`` over capacity; the last window is cut at ``duration_s`` (a window
        running past the load's end would read its arrivals as a lower rate); 0 outside the load."""
        if not 0 <= t < self.duration_s:
            return 0.0
        w = math.floor(t / self.window_s)
        lo, hi = w * self.window_s, min((w + 1) * self.window_s, self.duration_s)
        return self._count(lo, hi) / (hi - lo) / self.capacity_rps

    @property
    def start(self) -> float:
        return self.fraction(0.0)

    @property
    def mean(self) -> float:
        return len(self.arrivals_s) / self.duration_s / self.capacity_rps

    @property
    def high(self) -> float:
        """The largest window's fraction (windows of ``window_s`` from t = 0)."""
        windows = math.ceil(self.duration_s / self.window_s)
        return max(self.fraction((i + 0.5) * self.window_s) for i in range(windows))

    def scaled(self, factor: float, seed: int) -> TraceLoad:
        """Time divided by ``factor``, each arrival kept with probability ``1 / factor`` (seeded): the same rate and
        burst shape on a clock ``factor`` times shorter (module docstring). The window shrinks with the clock."""
        if factor == 1:
            return self
        rng = random.Random(f"{seed}:trace-load-compression")
        kept = [(t / factor, r) for t, r in zip(self.arrivals_s, self.rows, strict=True) if rng.random() * factor < 1]
        if not kept:
            raise ValueError(f"compressing the trace by {factor:g} keeps no arrival")
        return TraceLoad(
            tuple(t for t, _ in kept),
            tuple(r for _, r in kept),
            self.duration_s / factor,
            self.capacity_rps,
            self.window_s / factor,
            self.time_scale / factor,
        )
