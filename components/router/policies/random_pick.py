"""Random: a uniformly random candidate (``common.candidates``: not already tried, not stale while a fresh one
remains), drawn from the ``random.Random`` the caller passes in.

Parameters: none (the router's ``router_seed`` seeds the generator). Stateless.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import DecisionKind, RouteDecision, RouteRequest, WorkerSnapshot, lazy_reason


class RandomPolicy:
    name = "random"
    uses_kv = False
    uses_inflight = False

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
        w = cands[rng.randrange(len(cands))]
        why = lazy_reason("random among {}{}", len(cands), note)
        return RouteDecision(w.instance_id, why, kind=DecisionKind.ROTATION), state
