"""What a replay means to an operator: SLO attainment against stated targets, percentiles, throughput and
worker-seconds, as one JSON-ready summary (``summarize``). Shared by ``kvmesh simulate`` and the planner benchmark.

Imports only the standard library and the simulator's own types.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from .dynamics import worker_seconds
from .replay import FleetSpec, RunResult
from .workload import Workload


@dataclasses.dataclass(frozen=True, slots=True)
class Slo:
    """A request meets its SLO when its time to first token is at most ``ttft_s`` and its mean inter-token latency
    (time from its first to its last token over its gaps) is at most ``itl_s``."""

    ttft_s: float
    itl_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class RequestTimes:
    """What the SLO is judged on, per finished request."""

    arrival_s: float
    ttft_s: float
    mean_itl_s: float | None  # None: one output token, no gap
    worker_id: int = 0  # the worker that served it


def attainment(requests: Sequence[RequestTimes], slo: Slo) -> dict[str, float | None]:
    """Fractions of ``requests`` that met the TTFT bound, the ITL bound (a request without a gap meets it), both."""
    if not requests:
        return {"ttft": None, "itl": None, "both": None}
    ttft = [r.ttft_s <= slo.ttft_s for r in requests]
    itl = [r.mean_itl_s is None or r.mean_itl_s <= slo.itl_s for r in requests]
    n = len(requests)
    return {
        "ttft": sum(ttft) / n,
        "itl": sum(itl) / n,
        "both": sum(a and b for a, b in zip(ttft, itl, strict=True)) / n,
    }


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The smallest value with at least ``q`` of ``xs`` at or below it (routing.py's rule)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def request_times(res: RunResult, workload: Workload) -> list[RequestTimes]:
    """Each request of ``workload`` as the SLO judges it, in workload order."""
    return [
        RequestTimes(r.arrival_s, ttft, itl)
        for r, ttft, itl in zip(workload.requests, res.ttft_by_request_s, res.mean_itl_by_request_s, strict=True)
    ]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000.0 * x, 3)


def quantiles_ms(xs: Sequence[float]) -> dict[str, float | None]:
    return {f"p{int(q * 100)}": _ms(percentile(xs, q)) for q in (0.5, 0.9, 0.99)}


def summarize(res: RunResult, workload: Workload, fleet: FleetSpec, slo: Slo) -> dict[str, Any]:
    """The replay's figures: TTFT and inter-token percentiles (ms; ITL over every gap between two tokens of a
    request), SLO attainment (fractions of requests meeting the TTFT target, the mean-ITL target, both), output
    tokens/s over the makespan, requests/s offered, and worker-seconds (every engine, prefill ones included, over
    its span within first arrival to last finish: asked for until exited, the whole makespan in a static fleet)."""
    times = request_times(res, workload)
    makespan = res.makespan_s
    n = len(workload.requests)
    t0, t1 = res.first_arrival_s, res.last_finish_s
    spans = [span for pool in res.spans.values() for span in pool]
    held = worker_seconds(spans, t0, t1) if spans else (fleet.workers + fleet.prefill) * makespan
    return {
        "requests": n,
        "offered_rps": round(workload.rate, 4) if math.isfinite(workload.rate) else None,
        "ttft_ms": quantiles_ms(res.ttft_s),
        "itl_ms": quantiles_ms(res.itl_s),
        "e2e_ms": quantiles_ms(res.e2e_s),
        "slo": {"ttft_ms": round(slo.ttft_s * 1000, 3), "itl_ms": round(slo.itl_s * 1000, 3)},
        "slo_attainment": attainment(times, slo),
        "output_tokens_per_s": round(res.output_tokens / makespan, 1) if makespan > 0 else None,
        "makespan_s": round(makespan, 3),
        "drain_s": round(res.drain_s, 3),
        "workers": {"routed": fleet.workers, "prefill": fleet.prefill},
        "worker_seconds": round(held, 1),
        "prefix_hit_rate": round(res.hit_rate, 4),
        "preemptions": res.preemptions,
        "prefill_remote": res.remote,
    }
