"""The fleet's two rules, once: when a worker's report goes stale, and whether a worker takes new requests.

Pure functions with their constants (STYLE.md habits 1 and 2: time is an argument, nothing here reads a clock).
Router, planner, rescheduler, the frontend's ``/metrics``, ``kvmesh status`` and the decode workers' count of prefill
workers all decide "alive" and "schedulable" here, so they agree on which workers are.

Staleness
---------
A report stream (a worker's ``LoadSnapshot``s every ``metrics_interval_ms``, a prefill worker's
``PrefillQueueReport``s) goes stale at::

    stale_at = received + max(floor_s, intervals x interval)      interval: the sender's, as observed
    stale_at = received + first_report_s                          one report heard: no interval observed yet
    stale_at = inf                                                no report heard

and is fresh while ``now < stale_at``. The interval is learned from the arrivals (``next_interval``): an exponential
average whose samples are capped at twice the estimate, so one long pause (a GC, a reconnect) moves it by at most
``smoothing`` x 100% instead of making the sender look slow for good.

Two streams, one rule, each with its numbers (``StaleRule``):

- ``LOAD_REPORTS`` (5 intervals, floor 0.5 s, first report 10 s, smoothing 0.1): whether a worker is presumed dead by
  its load reports. At the workers' default 100 ms that is 0.5 s of silence, ~20 x faster than the lease (10 s): the
  router stops choosing a hung or dead worker within half a second. A slow publisher (1 s) gets 5 s. A worker heard
  once has shown no interval yet; it goes stale after 10 s (the default lease TTL, ``RuntimeConfig.lease_ttl_s``:
  by then a dead process would have left discovery anyway), so a worker configured to report every few seconds is
  not called dead between its first and second report, while one that reported once and hung does leave the
  planner's averages. This replaces two rules: ``protocol.metadata.stale_after`` (the router's; it never let a
  single report go stale) and the planner's ``STALE_AFTER_PULLS`` (3 pulls = 3 s at its 1 s pull, whatever the
  worker's interval: a worker reporting every 2 s would have flapped in and out of its averages).
- ``QUEUE_REPORTS`` (3 intervals, floor 1 s, first report 1 s, smoothing 0.3): whether a prefill worker counts as
  alive for its model's queue (decode workers decide on it whether to queue a prompt at all; frontends and
  ``kvmesh status`` show it). The numbers the decode workers used before, unchanged: a false "no prefill worker"
  makes every decode worker prefill locally, so this stream is given a longer floor than the router's.

Schedulability
--------------
A worker takes new requests unless it said it takes none (``WorkerStatus.schedulable`` False: its engine died, it
drains; it says so again every interval, and True when it takes requests again) or an owner saw its process gone
(``mark_down``: no responders, a stream cut). A mark is cleared by a load report *received* at least
``DOWN_HOLD_S`` (1 s) after it: a report already in flight when the process died arrives sooner, a live worker
reports every 0.1 s. Staleness is not part of it: a stale worker is still schedulable, and a policy that finds every
worker stale ignores the metrics, not the workers (components/router/policies/common.py).

Imports: the standard library only.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, slots=True)
class StaleRule:
    """The numbers of the staleness rule for one report stream (module docstring)."""

    intervals: float  # stale after this many of the sender's own intervals ...
    floor_s: float  # ... and never sooner than this after its last report
    first_report_s: float  # after a single report (no interval observed yet)
    smoothing: float  # how far one new gap moves the interval estimate (exponential average, 0..1]


# A worker's load reports: the router's numbers (RouterConfig.metrics_stale_intervals/_min_s default to these).
LOAD_REPORTS = StaleRule(intervals=5.0, floor_s=0.5, first_report_s=10.0, smoothing=0.1)
# A prefill worker's queue reports: the decode workers' numbers.
QUEUE_REPORTS = StaleRule(intervals=3.0, floor_s=1.0, first_report_s=1.0, smoothing=0.3)
# One gap counts for at most this many times the current estimate.
MAX_GAP_FACTOR = 2.0

# A worker marked down is schedulable again only through a load report received this long after the mark.
DOWN_HOLD_S = 1.0


def stale_at(received_s: float | None, interval_s: float | None, rule: StaleRule = LOAD_REPORTS) -> float:
    """The instant from which the last report (received at ``received_s``, the sender's interval ``interval_s`` as
    observed) counts as stale: ``received + max(floor, intervals x interval)``; ``first_report_s`` after a single
    report; ``inf`` with no report."""
    if received_s is None:
        return math.inf
    if interval_s is None:
        return received_s + rule.first_report_s
    return received_s + max(rule.floor_s, rule.intervals * interval_s)


def is_fresh(now_s: float, stale_at_s: float) -> bool:
    """Fresh strictly before ``stale_at_s``: at the instant itself the report is stale."""
    return now_s < stale_at_s


def next_interval(
    prev_received_s: float | None, prev_interval_s: float | None, now_s: float, rule: StaleRule = LOAD_REPORTS
) -> float | None:
    """The sender's interval estimate after a report arriving at ``now_s``; the previous one arrived at
    ``prev_received_s`` (None: this is the first, no estimate yet). The first gap is taken as it is; later gaps move
    the estimate by ``rule.smoothing`` towards themselves, each counted at most ``MAX_GAP_FACTOR`` x the estimate.
    A gap of 0 or less (two reports at one instant, a clock that did not move) leaves the estimate as it was."""
    if prev_received_s is None:
        return prev_interval_s
    gap = now_s - prev_received_s
    if gap <= 0:
        return prev_interval_s
    if prev_interval_s is None:
        return gap
    return prev_interval_s + rule.smoothing * (min(gap, MAX_GAP_FACTOR * prev_interval_s) - prev_interval_s)


def is_schedulable(status_schedulable: bool, down_since_s: float | None) -> bool:
    """Whether a worker takes new requests: its last ``WorkerStatus`` did not say no, and no owner marked it down."""
    return status_schedulable and down_since_s is None


def report_clears_down(down_since_s: float, received_s: float) -> bool:
    """Whether a load report received at ``received_s`` takes back a mark made at ``down_since_s``."""
    return received_s - down_since_s >= DOWN_HOLD_S
