"""Round robin: each request goes to the next worker in instance-id order, skipping workers already tried and, while
a fresh one remains, workers whose load metrics went stale (``common.candidates``).

Parameters: none. The state is the index of the next worker to try. When workers come and go the index is taken
modulo the current count, so a change shifts the rotation by at most one full turn; nothing depends on which workers
existed before.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import DecisionKind, RouteDecision, RouteRequest, WorkerSnapshot


@dataclasses.dataclass(slots=True, frozen=True)
class RoundRobinState:
    next_index: int = 0


class RoundRobinPolicy:
    name = "round_robin"
    uses_kv = False
    uses_inflight = False

    def __init__(self, config: RouterConfig | None = None) -> None:
        del config  # no parameters

    def initial_state(self) -> RoundRobinState:
        return RoundRobinState()

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: RoundRobinState, rng: random.Random
    ) -> tuple[RouteDecision, RoundRobinState]:
        return select(request, workers, state)


def select(
    request: RouteRequest, workers: Sequence[WorkerSnapshot], state: RoundRobinState
) -> tuple[RouteDecision, RoundRobinState]:
    placed, cands, note = common.prelude(request, workers)
    if placed is not None:
        return placed, state
    # Pinning is a request, not a promise: the worker may have left. Falling through to the rotation keeps the
    # request alive; the reason tells the caller it did not land where it asked.
    reason = f"round robin{note}"
    n = len(workers)
    if len(cands) == n:
        i = state.next_index % n
        return RouteDecision(workers[i].instance_id, reason, kind=DecisionKind.ROTATION), RoundRobinState((i + 1) % n)
    allowed = {w.instance_id for w in cands}
    for step in range(n):
        i = (state.next_index + step) % n
        if workers[i].instance_id in allowed:
            return RouteDecision(workers[i].instance_id, reason, kind=DecisionKind.ROTATION), RoundRobinState(
                (i + 1) % n
            )
    raise AssertionError("unreachable: candidates are a subset of workers")  # pragma: no cover
