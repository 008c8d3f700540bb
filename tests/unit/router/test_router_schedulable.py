"""The router's schedulability (components/router/adapter.py): workers that said they take no new requests, workers
the frontend saw dead, and a request's load following it when the workers move it."""

from __future__ import annotations

from typing import Any

import pytest

from components.protocol.messages import LoadSnapshot
from components.router import NoWorkersError, Router, RouterConfig, RouteRequest
from components.router.adapter import DOWN_HOLD_S

pytestmark = pytest.mark.unit


def meta() -> dict[str, Any]:
    return {"model": "m", "block_size": 16}


def load() -> LoadSnapshot:
    return LoadSnapshot(0.0, 0.1, 1000, 100, 0, 0, 0, 0, 0, 0)


def router(*iids: int) -> Router:
    r = Router(RouterConfig(router_policy="round_robin", router_seed=0))
    r.set_workers("m", [(i, meta()) for i in iids])
    return r


def chosen(r: Router, n: int, now: float = 0.0) -> set[int]:
    return {r.select(RouteRequest([1, 2, 3], "m", now)).instance_id for _ in range(n)}  # type: ignore[misc]


def test_an_unschedulable_worker_is_never_chosen_until_it_says_otherwise():
    r = router(1, 2, 3)
    r.set_schedulable(2, False, "draining")
    assert chosen(r, 12) == {1, 3}
    assert r.unschedulable() == {2: "draining"} and not r.is_schedulable(2)
    assert 2 not in r.routable("m", 0.0)
    r.set_schedulable(2, True)
    assert chosen(r, 12) == {1, 2, 3}


def test_every_worker_unschedulable_is_no_worker():
    r = router(1)
    r.set_schedulable(1, False, "its engine died")
    with pytest.raises(NoWorkersError):
        r.select(RouteRequest([1], "m", 0.0))


def test_a_worker_marked_down_comes_back_only_with_a_report_received_after_the_hold():
    r = router(1, 2)
    assert r.mark_down(2, now_s=10.0, reason="no responders")
    assert not r.mark_down(2, now_s=10.1)  # once
    assert r.down_since(2) == 10.0
    r.apply_load(2, load(), 10.5)  # published before it died, delivered late: still down
    assert chosen(r, 6, 10.5) == {1}
    r.apply_load(2, load(), 10.0 + DOWN_HOLD_S)  # a live worker reports every 0.1 s: it was not dead after all
    assert r.down_since(2) is None and chosen(r, 6, 11.1) == {1, 2}


def test_a_worker_that_leaves_is_forgotten_with_its_marks():
    r = router(1, 2)
    r.mark_down(2, 0.0)
    r.set_schedulable(1, False, "draining")
    r.set_workers("m", [(1, meta())])  # 2 deregistered
    assert r.down_since(2) is None and r.unschedulable() == {1: "draining"}


def test_a_worker_that_said_no_and_was_marked_down_and_left_is_not_schedulable():
    # Regression: the router's own bookkeeping forgot only one of the two marks when such a worker left (an ``or``
    # that stopped at the first), so is_schedulable said False by accident; now the fleet forgets both and says
    # False because the worker left (test_migration_frontend's dead-engine test asks exactly this).
    r = router(1, 2)
    r.set_schedulable(2, False, "its engine died")
    r.mark_down(2, 0.0, "no responders")
    r.set_workers("m", [(1, meta())])
    assert r.unschedulable() == {} and r.down_since(2) is None
    assert not r.is_schedulable(2) and r.is_schedulable(1)
    r.set_workers("m", [(1, meta()), (2, meta())])  # registered again: schedulable, nothing of its past
    assert r.is_schedulable(2)


def test_a_moved_request_takes_its_load_to_the_new_worker():
    r = router(1, 2)
    req = RouteRequest(list(range(64)), "m", 0.0)
    d = r.select(req)
    r.on_routed("a", d, req)
    r.on_first_token("a")
    src = d.instance_id
    dst = 2 if src == 1 else 1
    r.on_migrated("a", dst)
    assert (r.active_requests(src), r.active_requests(dst)) == (0, 1)
    r.on_migrated("unknown", dst)  # ignored
    r.on_finished("a")
    assert (r.active_requests(src), r.active_requests(dst)) == (0, 0)
