"""Round robin: each request goes to the next worker in instance-id order, skipping workers already tried.

The state is the index of the next worker to try. When workers come and go the index is taken modulo the current count,
so a change shifts the rotation by at most one full turn; nothing depends on which workers existed before.

Pure: imports only the standard library and ``components.router.types``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from components.router.types import RouteDecision, RouteRequest, WorkerSnapshot


@dataclasses.dataclass(slots=True, frozen=True)
class RoundRobinState:
    next_index: int = 0


class RoundRobinPolicy:
    name = "round_robin"

    def initial_state(self) -> RoundRobinState:
        return RoundRobinState()

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: RoundRobinState
    ) -> tuple[RouteDecision, RoundRobinState]:
        return select(request, workers, state)


def select(
    request: RouteRequest, workers: Sequence[WorkerSnapshot], state: RoundRobinState
) -> tuple[RouteDecision, RoundRobinState]:
    if not workers:
        return RouteDecision(None, f"no workers serve model {request.model!r}"), state
    if request.pinned_instance_id is not None:
        if any(w.instance_id == request.pinned_instance_id for w in workers):
            return RouteDecision(request.pinned_instance_id, "pinned"), state
        # Pinning is a request, not a promise: the worker may have left. Falling through to the rotation keeps the
        # request alive; the reason tells the caller it did not land where it asked.
        pinned_gone = True
    else:
        pinned_gone = False
    n = len(workers)
    excluded = request.excluded_instance_ids
    for step in range(n):
        i = (state.next_index + step) % n
        worker = workers[i]
        if worker.instance_id not in excluded:
            reason = "round robin, pinned worker gone" if pinned_gone else "round robin"
            return RouteDecision(worker.instance_id, reason), RoundRobinState((i + 1) % n)
    return RouteDecision(None, f"all {n} workers of model {request.model!r} were already tried"), state
