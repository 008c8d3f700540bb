"""Least loaded (Autellix's LEAST_USED, also registered as ``least_used``): the candidate with the fewest requests in
flight, or the fewest prompt tokens in flight.

Parameters (``RouterConfig``):
- ``least_loaded_metric``: ``requests`` (default) or ``tokens``.

Load is the router's own count of what it (and, with replica sync, its replicas) sent and has not seen finish: exact
between metric updates and available for every worker, so no worker's missing metrics can skew it. Ties are broken
by the ``random.Random`` passed in, so equally idle workers share the load instead of the lowest id taking it all.
Stateless.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import RouteDecision, RouteRequest, WorkerSnapshot


class LeastLoadedPolicy:
    name = "least_loaded"
    uses_kv = False
    uses_inflight = True

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.metric = (config or RouterConfig()).least_loaded_metric

    def initial_state(self) -> None:
        return None

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: None, rng: random.Random
    ) -> tuple[RouteDecision, None]:
        placed, cands, note = common.prelude(request, workers)
        if placed is not None:
            return placed, state
        w, why = common.least_used(cands, self.metric, rng)
        return RouteDecision(w.instance_id, common.with_note(why, note)), state
