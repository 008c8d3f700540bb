"""Migration-assisted scale-down in the pure policies: a worker that drains because it was told to leave (its
``WorkerStatus`` reason is ``DRAINING_REASON``) is emptied by its role's failover policy like a failing worker, but
fences only itself: its node and unit are healthy (policies/common.py). A worker unschedulable for any other reason
keeps the failure semantics (its whole domain fenced).

Builders: the views and fleet metadata of test_rescheduler_policies.py (decode workers, 100 KV blocks each)."""

from __future__ import annotations

import pytest

from components.fleet.state import FleetState
from components.protocol.messages import LoadSnapshot
from components.protocol.metadata import WorkerRole
from components.protocol.migration import DRAINING_REASON, WorkerStatus
from components.rescheduler.policies import plan_cycle
from components.rescheduler.policies.common import failing_reason, fence
from components.rescheduler.views import instance_views
from tests.unit.test_rescheduler_policies import _meta, cfg, pairs_of, view

pytestmark = pytest.mark.unit


def test_a_leaving_worker_on_a_one_node_deployment_is_emptied_onto_its_node_even_with_domain_node():
    # One node "n1": 1 leaves (0.6), 2 (0.1) and 3 (0.5) stay. With failover_domain node a FAILED 1 would fence the
    # whole node and its requests would have nowhere to go; a leaving 1 fences only itself, so its requests go to
    # the least loaded stayer, 2. Everything moves (num_requests -1, longest running first).
    views = [
        view(1, 0.6, node="n1", schedulable=False, leaving=True),
        view(2, 0.1, node="n1"),
        view(3, 0.5, node="n1"),
    ]
    config = cfg("decode_failover", failover_domain="node")
    assert fence(views, config) == {1}
    plan = plan_cycle(views, config)
    assert pairs_of(plan) == [(1, 2)]
    pair = plan.pairs[0]
    assert (pair.select_rule, pair.select_order, pair.select_value) == ("num_requests", "longest_running", -1)
    assert pair.reason.startswith("unschedulable (leaving: draining);")
    assert failing_reason(views[0], config) == "unschedulable (leaving: draining)"


def test_a_failed_worker_on_the_same_node_still_fences_the_node():
    # The same fleet with 1 unschedulable for another reason (its engine died): the node is fenced, no destination.
    views = [view(1, 0.6, node="n1", schedulable=False), view(2, 0.1, node="n1"), view(3, 0.5, node="n1")]
    plan = plan_cycle(views, cfg("decode_failover", failover_domain="node"))
    assert plan.pairs == ()
    [why] = plan.rejected
    assert why.reason.startswith("unschedulable; no healthy decode worker")
    assert "(3 workers fenced)" in why.reason


def test_a_leaving_worker_next_to_a_failed_one_does_not_unfence_the_failed_ones_node():
    # 1 failed on n1, 2 leaves on n2, 3 (0.1) on n1 and 4 (0.4) on n2, domain node: n1 is fenced (1 and 3), 2 fences
    # itself only. Destinations: 4 alone; round robin over one destination: 1 -> 4, 2 -> 4.
    views = [
        view(1, 0.6, node="n1", schedulable=False),
        view(2, 0.6, node="n2", schedulable=False, leaving=True),
        view(3, 0.1, node="n1"),
        view(4, 0.4, node="n2"),
    ]
    config = cfg("decode_failover", failover_domain="node")
    assert fence(views, config) == {1, 2, 3}
    assert pairs_of(plan_cycle(views, config)) == [(1, 4), (2, 4)]


def test_a_leaving_worker_is_neither_a_load_source_nor_a_destination():
    # 1 leaves with 0.9 of its KV, 2 at 0.8 and 3 at 0.1 stay; at threshold 0.7 the failover takes 1 -> 3 (the least
    # loaded) and decode_load pairs 2 -> 3 only: 1, at the highest load, is not its source (it is failing), and 1 is
    # not a destination of anything.
    views = [view(1, 0.9, schedulable=False, leaving=True), view(2, 0.8), view(3, 0.1)]
    plan = plan_cycle(views, cfg("decode_failover", "decode_load", rescheduling_decode_load_threshold=0.7))
    assert [(p.source_id, p.destination_id, str(p.policy)) for p in plan.pairs] == [
        (1, 3, "decode_failover"),
        (2, 3, "decode_load"),
    ]


def test_views_mark_a_draining_worker_as_leaving_and_a_dead_one_as_not():
    fleet = FleetState()
    for iid in (1, 2, 3):
        fleet.add_instance(iid, _meta(WorkerRole.DECODE, "n1"))
        fleet.apply_load(iid, LoadSnapshot(0.0, 0.1, 100, 10, 1, 0, 0, 0, 1, 100), now_s=1.0)
    fleet.apply_status(1, WorkerStatus(schedulable=False, reason=DRAINING_REASON), now_s=1.0)
    fleet.apply_status(2, WorkerStatus(schedulable=False, reason="engine dead: exit code 1"), now_s=1.0)
    v1, v2, v3 = instance_views(fleet.snapshot(now_s=1.1))
    assert (v1.schedulable, v1.leaving) == (False, True)
    assert (v2.schedulable, v2.leaving) == (False, False)
    assert (v3.schedulable, v3.leaving) == (True, False)


def test_a_leaving_worker_with_nowhere_to_go_is_refused_with_the_reason_and_drains_by_waiting():
    # The last worker of its model and role leaves (the other worker serves another model): no pair, a rejection that
    # names the leave; the worker then waits for its requests as without a rescheduler.
    views = [view(1, 0.6, schedulable=False, leaving=True), view(2, 0.1, model="other")]
    plan = plan_cycle(views, cfg("decode_failover"))
    assert plan.pairs == ()
    [why] = plan.rejected
    assert (why.source_id, why.destination_id) == (1, None)
    assert why.reason.startswith("unschedulable (leaving: draining); no healthy decode worker of 'm'")
