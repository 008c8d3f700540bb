"""The round-robin policy as a pure function, and the Router adapter's bookkeeping around it."""

from __future__ import annotations

import pytest

from components.router import NoWorkersError, Router, RouteRequest, UnknownPolicyError, WorkerSnapshot
from components.router.policies.round_robin import RoundRobinState, select

pytestmark = pytest.mark.unit


def workers(*ids: int) -> list[WorkerSnapshot]:
    return [WorkerSnapshot(i, {"model": "m"}) for i in ids]


def request(excluded: set[int] | None = None, pinned: int | None = None, n_tokens: int = 3) -> RouteRequest:
    return RouteRequest(
        list(range(n_tokens)), "m", 0.0, pinned_instance_id=pinned, excluded_instance_ids=frozenset(excluded or ())
    )


def run(n: int, ws: list[WorkerSnapshot], req: RouteRequest | None = None) -> list[int | None]:
    state = RoundRobinState()
    out = []
    for _ in range(n):
        decision, state = select(req or request(), ws, state)
        out.append(decision.instance_id)
    return out


def test_rotates_through_workers_in_order():
    assert run(7, workers(10, 20, 30)) == [10, 20, 30, 10, 20, 30, 10]


def test_skips_excluded_workers_and_says_so_when_all_were_tried():
    assert run(4, workers(10, 20, 30), request(excluded={20})) == [10, 30, 10, 30]
    decision, state = select(request(excluded={10, 20}), workers(10, 20), RoundRobinState(1))
    assert decision.instance_id is None and "already tried" in decision.reason
    assert state == RoundRobinState(1)  # a non-decision does not advance the rotation


def test_no_workers_is_a_decision_with_a_reason():
    decision, state = select(request(), [], RoundRobinState(5))
    assert decision.instance_id is None and "no workers" in decision.reason
    assert state == RoundRobinState(5)


def test_pinned_worker_wins_while_present_and_falls_back_when_gone():
    decision, state = select(request(pinned=30), workers(10, 20, 30), RoundRobinState())
    assert (decision.instance_id, decision.reason, state) == (30, "pinned", RoundRobinState())
    decision, _ = select(request(pinned=99), workers(10, 20), RoundRobinState())
    assert decision.instance_id == 10 and "pinned worker gone" in decision.reason


def test_a_shrinking_worker_list_keeps_the_index_in_range():
    decision, state = select(request(), workers(10, 20, 30), RoundRobinState(2))
    assert decision.instance_id == 30 and state == RoundRobinState(0)
    decision, state = select(request(), workers(10), RoundRobinState(7))
    assert decision.instance_id == 10 and state == RoundRobinState(0)


def test_router_counts_requests_and_prompt_tokens_in_flight_per_worker():
    router = Router("round_robin")
    router.set_workers("m", [(2, {}), (1, {})])
    placed = []
    for i in range(3):
        req = request(n_tokens=10 * (i + 1))
        d = router.select(req)
        router.on_routed(f"r{i}", d, req)
        placed.append(d.instance_id)
    assert placed == [1, 2, 1]  # ascending instance id, whatever order discovery listed them in
    snaps = {w.instance_id: w for w in router.workers("m")}
    # r0 (10 tokens) and r2 (30) on worker 1, r1 (20) on worker 2.
    assert (snaps[1].active_requests, snaps[1].active_prompt_tokens) == (2, 40)
    assert (snaps[2].active_requests, snaps[2].active_prompt_tokens) == (1, 20)
    router.on_first_token("r0")
    router.on_finished("r0")
    router.on_finished("r0")  # idempotent
    router.on_finished("unknown")
    snaps = {w.instance_id: w for w in router.workers("m")}
    assert (snaps[1].active_requests, snaps[1].active_prompt_tokens) == (1, 30)
    assert router.active_requests(1) == 1 and router.active_requests(2) == 1


def test_router_raises_no_workers_for_unknown_or_emptied_models():
    router = Router()
    with pytest.raises(NoWorkersError):
        router.select(request())
    router.set_workers("m", [(1, {})])
    assert router.select(request()).instance_id == 1
    router.set_workers("m", [])
    with pytest.raises(NoWorkersError) as e:
        router.select(request())
    assert e.value.model == "m"


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(UnknownPolicyError, match="round_robin"):
        Router("fastest")
