"""``Router``: the stateful side of routing. It keeps, per model, the live workers and what it has sent to each, builds
``WorkerSnapshot``s and asks a pure policy (``components.router.policies``, chosen by readable name) where to go.

The frontend tells it which workers serve a model (``set_workers``, from discovery) and reports each request's life
(``on_routed`` -> ``on_first_token`` -> ``on_finished``), so the router counts requests and prompt tokens in flight per
worker without any I/O of its own. The router issue adds load metrics and KV events from the event plane here; the
frontend's calls stay the same.

Single-threaded: every method is called from the event loop, none awaits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from components.router.errors import NoWorkersError, UnknownPolicyError
from components.router.policies import POLICIES
from components.router.types import RouteDecision, RouteRequest, RoutingPolicy, WorkerSnapshot

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Inflight:
    instance_id: int
    num_prompt_tokens: int
    first_token_seen: bool = False


@dataclasses.dataclass(slots=True)
class _ModelState:
    metadata: dict[int, Mapping[str, Any]]
    policy_state: Any
    # Rebuilt lazily, at the next select() after a change: a request changes the counts twice (routed, finished) but
    # is placed once, so this builds one list of snapshots per request rather than two.
    workers: list[WorkerSnapshot] = dataclasses.field(default_factory=list)
    stale: bool = True


def make_policy(name: str) -> RoutingPolicy[Any]:
    try:
        return POLICIES[name]()
    except KeyError:
        raise UnknownPolicyError(name, list(POLICIES)) from None


class Router:
    def __init__(self, policy: str = "round_robin") -> None:
        self.policy = make_policy(policy)
        self._models: dict[str, _ModelState] = {}
        self._inflight: dict[str, _Inflight] = {}
        self._active: dict[int, list[int]] = {}  # instance id -> [requests, prompt tokens] in flight

    # --- membership -------------------------------------------------------------------------------------------------

    def set_workers(self, model: str, workers: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        """Replace the set of workers that serve ``model`` ((instance id, metadata) pairs); empty removes the model.

        Counts of requests still in flight on a worker that left are kept until those requests finish, so a worker
        that re-registers under the same id is not seen as idle while it still serves them.
        """
        meta = dict(workers)
        if not meta:
            self._models.pop(model, None)
            return
        state = self._models.get(model)
        policy_state = state.policy_state if state is not None else self.policy.initial_state()
        self._models[model] = _ModelState(meta, policy_state)

    def models(self) -> list[str]:
        return sorted(self._models)

    def workers(self, model: str) -> list[WorkerSnapshot]:
        """The snapshots a policy would see for ``model`` right now."""
        state = self._models.get(model)
        return list(self._snapshots(state)) if state is not None else []

    def _snapshots(self, state: _ModelState) -> list[WorkerSnapshot]:
        if state.stale:
            zero = [0, 0]
            state.workers = [
                WorkerSnapshot(iid, md, *self._active.get(iid, zero)) for iid, md in sorted(state.metadata.items())
            ]
            state.stale = False
        return state.workers

    def _mark_stale(self, instance_id: int) -> None:
        for state in self._models.values():
            if instance_id in state.metadata:
                state.stale = True

    # --- placement --------------------------------------------------------------------------------------------------

    def select(self, request: RouteRequest) -> RouteDecision:
        """Ask the policy; raise ``NoWorkersError`` when it places the request nowhere."""
        state = self._models.get(request.model)
        if state is None:
            raise NoWorkersError(request.model, f"no workers serve model {request.model!r}")
        decision, state.policy_state = self.policy.select(request, self._snapshots(state), state.policy_state)
        if decision.instance_id is None:
            raise NoWorkersError(request.model, decision.reason)
        return decision

    # --- bookkeeping ------------------------------------------------------------------------------------------------

    def on_routed(self, request_id: str, decision: RouteDecision, request: RouteRequest) -> None:
        assert decision.instance_id is not None
        iid = decision.instance_id
        self._inflight[request_id] = _Inflight(iid, len(request.token_ids))
        counts = self._active.setdefault(iid, [0, 0])
        counts[0] += 1
        counts[1] += len(request.token_ids)
        self._mark_stale(iid)

    def on_first_token(self, request_id: str) -> None:
        inflight = self._inflight.get(request_id)
        if inflight is not None:
            inflight.first_token_seen = True

    def on_finished(self, request_id: str) -> None:
        """The request ended on its worker (finished, failed, or cancelled); unknown ids are ignored."""
        inflight = self._inflight.pop(request_id, None)
        if inflight is None:
            return
        iid = inflight.instance_id
        counts = self._active.get(iid)
        if counts is not None:
            counts[0] -= 1
            counts[1] -= inflight.num_prompt_tokens
            if counts[0] <= 0:
                del self._active[iid]
        self._mark_stale(iid)

    def active_requests(self, instance_id: int) -> int:
        return self._active.get(instance_id, [0, 0])[0]
