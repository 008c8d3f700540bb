"""Power of two choices: sample two distinct candidates at random, send the request to the less loaded one.

Parameters: none (the ``random.Random`` passed in draws the pair). Stateless.

Load is what the workers report (``num_running + num_waiting`` from their load metrics), which includes requests other
routers sent; when either of the two has no fresh report, both are compared by this router's own count of requests in
flight instead: one worker's missing metric degrades the comparison for both, rather than making the silent one look
idle (sglang's power_of_two does the same). Ties go to the first drawn, itself random.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import RouteDecision, RouteRequest, WorkerSnapshot, lazy_reason


def reported_load(w: WorkerSnapshot, now_s: float) -> int | None:
    if not w.has_fresh_metrics(now_s) or w.num_running is None or w.num_waiting is None:
        return None
    return w.num_running + w.num_waiting


class PowerOfTwoPolicy:
    name = "power_of_two"
    uses_kv = False
    uses_inflight = True

    def __init__(self, config: RouterConfig | None = None) -> None:
        del config  # no parameters

    def initial_state(self) -> None:
        return None

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: None, rng: random.Random
    ) -> tuple[RouteDecision, None]:
        placed, cands, note = common.prelude(request, workers)
        if placed is not None:
            return placed, state
        if len(cands) == 1:
            return RouteDecision(cands[0].instance_id, f"power of two: only candidate{note}"), state
        i, j = rng.sample(range(len(cands)), 2)
        a, b = cands[i], cands[j]
        la, lb = reported_load(a, request.now_s), reported_load(b, request.now_s)
        if la is None or lb is None:
            la, lb, what = a.active_requests, b.active_requests, "requests routed (a report is missing or stale)"
        else:
            what = "running + waiting reported"
        w, lw, lo = (b, lb, la) if lb < la else (a, la, lb)
        return RouteDecision(w.instance_id, lazy_reason("power of two: {} vs {} {}{}", lw, lo, what, note)), state
