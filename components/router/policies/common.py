"""Pieces every policy shares: the pin, which workers are candidates, busy workers, and "least used".

Not a policy itself (nothing registers it). Pure: imports only the standard library and ``components.router``'s
``types``/``config``.

Rules, the same for every policy:

- **Pin.** ``RouteRequest.pinned_instance_id`` wins when that worker is known and not already tried for this request,
  whatever its load or metrics: a debugging client asked for it. Otherwise the policy places the request as usual and
  its reason says the pin was not honoured.
- **Candidates** are the workers not already tried (``excluded_instance_ids``). Among them, a worker whose load
  metrics went **stale** (``WorkerSnapshot.metrics_stale_after_s`` passed: no report for several of its own publishing
  intervals) is presumed dead and skipped, so a killed worker stops getting requests within ~0.5 s instead of the
  lease's 10 s. If every candidate is stale, the metrics are what is broken (the router lost NATS, say): all
  candidates stay, and the reason says so.
- **Unknown metrics** (no report yet) are not stale: a worker that just registered gets requests. Where a policy
  compares workers by reported load, one worker with unknown or stale metrics degrades the comparison for all of them
  to the router's own counts (sglang's power_of_two does the same), so a silent worker never looks idle.
- **Busy** (kv only): fresh metrics over ``active_decode_blocks_threshold`` (KV usage) or
  ``active_prefill_tokens_threshold`` (prompt tokens waiting). Unknown is not busy. If every candidate is busy, all
  stay (the request has to go somewhere; the engines queue it).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from components.router.config import LoadMetric, RouterConfig
from components.router.types import (
    DecisionKind,
    Reason,
    RouteDecision,
    RouteRequest,
    WorkerSnapshot,
    WorkerTable,
    lazy_reason,
)


def _instance_id(w: WorkerSnapshot) -> int:
    return w.instance_id


def find(workers: Sequence[WorkerSnapshot], instance_id: int) -> WorkerSnapshot | None:
    """The worker with ``instance_id`` in a list sorted by id (binary search: O(log n), not a 256-step scan)."""
    i = bisect.bisect_left(workers, instance_id, key=_instance_id)
    if i < len(workers) and workers[i].instance_id == instance_id:
        return workers[i]
    return None


def pin(request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> tuple[RouteDecision | None, str]:
    """The pinned worker's decision if it can be honoured, else None and a note for the fallback's reason."""
    iid = request.pinned_instance_id
    if iid is None:
        return None, ""
    if iid in request.excluded_instance_ids:
        return None, ", pinned worker already tried"
    w = find(workers, iid)
    if w is None:
        return None, ", pinned worker gone"
    return RouteDecision(iid, "pinned", request.overlap_of(iid), DecisionKind.PINNED, request.host_extra_of(iid)), ""


def candidates(request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> tuple[Sequence[WorkerSnapshot], str]:
    """Workers not yet tried, without the stale ones while a fresh one remains; and a note for the reason."""
    excluded = request.excluded_instance_ids
    now = request.now_s
    if not excluded and isinstance(workers, WorkerTable) and workers.none_stale(now):
        return workers, ""  # the usual case, without reading 256 snapshots
    cands = [w for w in workers if w.instance_id not in excluded] if excluded else workers
    fresh = [w for w in cands if w.metrics_stale_after_s > now]
    if len(fresh) == len(cands):
        return cands, ""
    if not fresh:
        return cands, f"; metrics of all {len(cands)} candidates stale, using them anyway"
    return fresh, f"; {len(cands) - len(fresh)} stale worker(s) skipped"


def nowhere(request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> RouteDecision:
    """The decision when there are no candidates: no workers at all, or every one already tried."""
    if not workers:
        return RouteDecision(None, f"no workers serve model {request.model!r}", kind=DecisionKind.NOWHERE)
    return RouteDecision(
        None, f"all {len(workers)} workers of model {request.model!r} were already tried", kind=DecisionKind.NOWHERE
    )


def prelude(
    request: RouteRequest, workers: Sequence[WorkerSnapshot]
) -> tuple[RouteDecision | None, Sequence[WorkerSnapshot], str]:
    """The steps every policy starts with: the pin (``pin``), then the candidates (``candidates``).

    Returns ``(decision, candidates, note)``: a decision when the request is already placed (pinned) or can be
    placed nowhere, otherwise None with the candidates and the note (pin fallback + skipped workers) for the
    policy's reason.
    """
    pinned, pin_note = pin(request, workers)
    if pinned is not None:
        return pinned, (), ""
    cands, note = candidates(request, workers)
    if not cands:
        return nowhere(request, workers), (), ""
    return None, cands, f"{pin_note}{note}"


def is_busy(w: WorkerSnapshot, now_s: float, kv_threshold: float | None, prefill_threshold: int | None) -> bool:
    if not w.has_fresh_metrics(now_s):
        return False
    if kv_threshold is not None and w.kv_usage is not None and w.kv_usage > kv_threshold:
        return True
    return (
        prefill_threshold is not None
        and w.num_waiting_prefill_tokens is not None
        and w.num_waiting_prefill_tokens > prefill_threshold
    )


def not_busy(
    cands: Sequence[WorkerSnapshot], now_s: float, config: RouterConfig
) -> tuple[Sequence[WorkerSnapshot], str]:
    kv_thr = config.active_decode_blocks_threshold
    pf_thr = config.active_prefill_tokens_threshold
    if kv_thr is None and pf_thr is None:
        return cands, ""
    free = [w for w in cands if not is_busy(w, now_s, kv_thr, pf_thr)]
    if len(free) == len(cands):
        return cands, ""
    if not free:
        return cands, f"; all {len(cands)} candidates busy"
    return free, f"; {len(cands) - len(free)} busy worker(s) skipped"


def pick_min(values: Sequence[float], rng: random.Random) -> tuple[int, int]:
    """Index of the smallest value, ties broken uniformly by ``rng``; and how many tied.

    ``min``/``count``/``index`` are C loops: a Python loop over 256 workers would cost ~15 us more.
    """
    lo = min(values)
    n = values.count(lo)
    if n == 1:
        return values.index(lo), 1
    k = rng.randrange(n)
    if n == len(values):  # all tied (an idle fleet): the k-th is k, no walk
        return k, n
    for i, v in enumerate(values):
        if v == lo:
            if k == 0:
                return i, n
            k -= 1
    raise AssertionError("unreachable: count() found the ties")  # pragma: no cover


def load_of(w: WorkerSnapshot, metric: LoadMetric) -> int:
    return w.active_prompt_tokens if metric == LoadMetric.TOKENS else w.active_requests


def least_used(
    cands: Sequence[WorkerSnapshot], metric: LoadMetric, rng: random.Random
) -> tuple[WorkerSnapshot, Reason]:
    """Autellix's LEAST_USED: the candidate with the fewest requests (or prompt tokens) in flight; ties at random."""
    if metric == LoadMetric.TOKENS:
        loads = [w.active_prompt_tokens for w in cands]
    else:
        loads = [w.active_requests for w in cands]
    i, ties = pick_min(loads, rng)
    if ties > 1:
        return cands[i], lazy_reason("least used: {} {} in flight, {} tied", loads[i], metric.value, ties)
    return cands[i], lazy_reason("least used: {} {} in flight", loads[i], metric.value)


def with_note(why: Reason, note: str) -> Reason:
    """``why`` followed by ``note`` (``prelude``'s note on the pin and skipped workers; usually empty)."""
    if not note:
        return why
    if isinstance(why, str):
        return why + note
    return lazy_reason("{}{}", why, note)
