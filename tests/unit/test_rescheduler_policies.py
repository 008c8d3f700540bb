"""The rescheduler's pure policies and ``plan_cycle``: issue 26's worked examples with their numbers derived here,
each filter, the cycle's pair validation, and the FleetSnapshot converter on real fleet records.

Builder: ``view(iid, load=..., tpot=...)`` makes a healthy, fresh, migratable decode worker with 100 KV blocks, so a
load of 0.9 is 90 blocks in use; ``cfg(...)`` a config running only the policies named."""

from __future__ import annotations

import math

import pytest

from components.fleet.state import FleetState
from components.perf.model import StepTimeModel
from components.protocol.messages import LoadSnapshot
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.protocol.migration import WorkerStatus
from components.rescheduler.config import FailoverDomain, Policy, ReschedulerConfig
from components.rescheduler.policies import plan_cycle, projected_kv_use
from components.rescheduler.policies.common import domain_of, fence
from components.rescheduler.types import InstanceView, Role
from components.rescheduler.views import instance_views

pytestmark = pytest.mark.unit

MODEL = "m"


def view(iid: int, load: float = 0.5, *, tpot: float | None = None, running: int = 4, **kw) -> InstanceView:
    fields = {
        "instance_id": iid,
        "model": MODEL,
        "role": Role.DECODE,
        "node": f"n{iid}",
        "unit": f"n{iid}",
        "num_total_blocks": 100,
        "num_used_blocks": round(load * 100),
        "num_running_decode": running,
        "predicted_tpot_ms": tpot,
    }
    return InstanceView(**(fields | kw))


def cfg(*policies: str, **kw) -> ReschedulerConfig:
    return ReschedulerConfig(rescheduling_policies=list(policies), **kw)


def pairs_of(plan) -> list[tuple[int, int]]:
    return [(p.source_id, p.destination_id) for p in plan.pairs]


# --- the load metric ------------------------------------------------------------------------------------------------


def test_projected_kv_use_counts_the_blocks_the_queue_will_need():
    # policies/common.py's worked number: 1,000 blocks, 600 in use, two waiting 1,000-token prompts at 16 tokens a
    # block need ceil(1000 / 16) = 63 blocks each: (600 + 2 x 63) / 1000 = 0.726.
    waiting = 2 * math.ceil(1000 / 16)
    v = InstanceView(1, MODEL, Role.DECODE, num_total_blocks=1000, num_used_blocks=600, num_waiting_blocks=waiting)
    assert projected_kv_use(v) == pytest.approx(0.726)
    assert projected_kv_use(InstanceView(2, MODEL, Role.DECODE, report_age_s=None)) is None  # no blocks: no data


# --- load balancing -------------------------------------------------------------------------------------------------


def test_the_seeds_load_balance_example_pairs_highest_with_lowest():
    # Loads 0.9, 0.3, 0.8, 0.2, 0.4 at threshold 0.7: sources 0.9, 0.8 (>= 0.7), destinations 0.2, 0.3, 0.4;
    # the highest source with the lowest destination: 0.9 -> 0.2, 0.8 -> 0.3; 0.4 is left over.
    views = [view(i, load) for i, load in enumerate([0.9, 0.3, 0.8, 0.2, 0.4], start=1)]
    plan = plan_cycle(views, cfg("decode_load", rescheduling_decode_load_threshold=0.7))
    assert pairs_of(plan) == [(1, 4), (3, 2)]
    assert plan.rejected == ()
    first = plan.pairs[0]
    assert first.policy == Policy.DECODE_LOAD and first.model == MODEL
    assert (first.select_rule, first.select_order, first.select_value) == ("tokens", "shortest_running", 1024)
    assert "0.900 -> 0.200" in first.reason and "gap 0.700" in first.reason


def test_a_gap_budget_moves_a_share_of_each_pairs_gap():
    # The seeds' example with rescheduling_load_balance_gap_budget 0.5: 0.9 -> 0.2 (gap 0.7) gets kv_ratio 0.35 of
    # the source's KV, 0.8 -> 0.3 (gap 0.5) 0.25; at 0.25, 0.175 and 0.125. The order stays the configured one.
    views = [view(i, load) for i, load in enumerate([0.9, 0.3, 0.8, 0.2, 0.4], start=1)]
    for share, values in ((0.5, [0.35, 0.25]), (0.25, [0.175, 0.125])):
        plan = plan_cycle(
            views,
            cfg("decode_load", rescheduling_decode_load_threshold=0.7, rescheduling_load_balance_gap_budget=share),
        )
        assert pairs_of(plan) == [(1, 4), (3, 2)]
        assert [(p.select_rule, p.select_order) for p in plan.pairs] == [("kv_ratio", "shortest_running")] * 2
        assert [p.select_value for p in plan.pairs] == [pytest.approx(v) for v in values]


def test_the_waiting_queue_makes_a_source():
    # 0.5 in use + 0.3 needed by the queue = 0.8 >= 0.7: a source although its plain KV use is below the threshold.
    views = [view(1, 0.5, num_waiting_blocks=30), view(2, 0.2)]
    assert pairs_of(plan_cycle(views, cfg("decode_load", rescheduling_decode_load_threshold=0.7))) == [(1, 2)]


def test_the_load_balance_threshold_refuses_a_pair_that_narrows_the_gap_too_little():
    # 0.75 against 0.69: a gap of 0.06. Refused at a load-balance threshold of 0.1, made at 0.05.
    views = [view(1, 0.75), view(2, 0.69)]
    refused = plan_cycle(
        views, cfg("decode_load", rescheduling_decode_load_threshold=0.7, rescheduling_load_balance_threshold=0.1)
    )
    assert refused.pairs == ()
    [why] = refused.rejected
    assert (why.source_id, why.destination_id) == (1, 2)
    assert "gap 0.060 <= load-balance threshold 0.1" in why.reason
    made = plan_cycle(
        views, cfg("decode_load", rescheduling_decode_load_threshold=0.7, rescheduling_load_balance_threshold=0.05)
    )
    assert pairs_of(made) == [(1, 2)]


def test_a_source_with_no_destination_left_is_reported():
    views = [view(1, 0.9), view(2, 0.8), view(3, 0.1)]
    plan = plan_cycle(views, cfg("decode_load", rescheduling_decode_load_threshold=0.7))
    assert pairs_of(plan) == [(1, 3)]
    [why] = plan.rejected
    assert (why.source_id, why.destination_id) == (2, None) and "no destination left" in why.reason


def test_unit_scope_balances_inside_each_unit_at_any_load():
    # Units u1 (0.6, 0.2) and u2 (0.5, 0.45, 0.1), every load below the default threshold 1.0: cluster scope pairs
    # nothing; unit scope pairs each unit's highest with its lowest, never across units: 0.6 -> 0.2 and 0.5 -> 0.1.
    views = [
        view(1, 0.6, unit="u1"),
        view(2, 0.2, unit="u1"),
        view(3, 0.5, unit="u2"),
        view(4, 0.45, unit="u2"),
        view(5, 0.1, unit="u2"),
    ]
    assert plan_cycle(views, cfg("decode_load")).pairs == ()
    plan = plan_cycle(views, cfg("decode_load", rescheduling_load_balance_scope="unit"))
    assert pairs_of(plan) == [(1, 2), (3, 5)]
    assert "unit 'u1'" in plan.pairs[0].reason


def test_unit_scope_refuses_equal_loads():
    views = [view(1, 0.5, unit="u"), view(2, 0.5, unit="u")]
    plan = plan_cycle(views, cfg("decode_load", rescheduling_load_balance_scope="unit"))
    assert plan.pairs == () and "gap 0.000" in plan.rejected[0].reason


@pytest.mark.parametrize(
    "unfit",
    [
        {"schedulable": False},
        {"fresh": False},
        {"report_age_s": 61.0},  # older than instance_staleness_seconds (60)
        {"report_age_s": None, "num_total_blocks": 0},  # never reported
        {"migratable": False},
        {"role": Role.AGGREGATED},  # neutral_load's, not decode_load's
        {"model": "other"},
    ],
)
def test_load_balancing_takes_no_unfit_worker(unfit):
    # Worker 2 (0.1) would be the destination of 1 (0.9); unfit, it is none, and 3 (0.3) takes 1's requests.
    views = [view(1, 0.9), view(2, 0.1, **unfit), view(3, 0.3)]
    assert pairs_of(plan_cycle(views, cfg("decode_load", rescheduling_decode_load_threshold=0.7))) == [(1, 3)]


def test_neutral_load_balances_aggregated_workers():
    views = [view(1, 0.9, role=Role.AGGREGATED), view(2, 0.1, role=Role.AGGREGATED), view(3, 0.0)]
    plan = plan_cycle(views, cfg("neutral_load", "decode_load", rescheduling_neutral_load_threshold=0.7))
    assert pairs_of(plan) == [(1, 2)] and plan.pairs[0].policy == Policy.NEUTRAL_LOAD


# --- failover -------------------------------------------------------------------------------------------------------


def test_failover_with_domain_node_never_chooses_a_destination_on_the_failed_node():
    # 1 fails on node n1; 2 shares n1 and is the least loaded worker (0.1), 3 on n2 carries 0.5. Domain node fences
    # n1 off: 1 -> 3. Domain instance fences only 1: 1 -> 2 (the least loaded).
    views = [
        view(1, 0.6, node="n1", schedulable=False),
        view(2, 0.1, node="n1"),
        view(3, 0.5, node="n2"),
    ]
    node = plan_cycle(views, cfg("decode_failover", failover_domain="node"))
    assert pairs_of(node) == [(1, 3)]
    pair = node.pairs[0]
    # Everything moves: the agent's num_requests -1, longest running first.
    assert (pair.select_rule, pair.select_order, pair.select_value) == ("num_requests", "longest_running", -1)
    assert pair.reason.startswith("unschedulable") and "node 'n2'" in pair.reason
    assert pairs_of(plan_cycle(views, cfg("decode_failover", failover_domain="instance"))) == [(1, 2)]


def test_failover_with_no_destination_outside_the_domain_says_so():
    views = [view(1, node="n1", schedulable=False), view(2, node="n1")]
    plan = plan_cycle(views, cfg("decode_failover", failover_domain="node"))
    assert plan.pairs == ()
    [why] = plan.rejected
    assert (why.source_id, why.destination_id) == (1, None)
    assert "outside the failing node domains (2 workers fenced)" in why.reason


def test_a_stale_source_is_emptied_and_a_fresh_enough_one_is_not():
    # Last report 61 s ago > instance_staleness_seconds 60: failing, emptied. 59 s: not failing (and, its numbers
    # being old by the fleet's rule, no destination either).
    stale = [view(1, report_age_s=61.0, fresh=False), view(2)]
    plan = plan_cycle(stale, cfg("decode_failover"))
    assert pairs_of(plan) == [(1, 2)]
    assert "stale: last report 61.0 s ago > 60 s" in plan.pairs[0].reason
    assert plan_cycle([view(1, report_age_s=59.0, fresh=False), view(2)], cfg("decode_failover")).pairs == ()


def test_failover_round_robins_over_destinations_least_loaded_first():
    # Failing 1, 2, 3 and destinations 4 (0.2) and 5 (0.4): 1 -> 4, 2 -> 5, 3 -> 4 (i mod 2).
    views = [view(i, schedulable=False) for i in (1, 2, 3)] + [view(4, 0.2), view(5, 0.4)]
    assert pairs_of(plan_cycle(views, cfg("decode_failover"))) == [(1, 4), (2, 5), (3, 4)]


def test_each_failover_policy_takes_its_own_role():
    views = [
        view(1, role=Role.PREFILL, schedulable=False),
        view(2, role=Role.PREFILL),
        view(3, role=Role.AGGREGATED, schedulable=False),
        view(4, role=Role.AGGREGATED),
        view(5, schedulable=False),
        view(6),
    ]
    assert pairs_of(plan_cycle(views, cfg("prefill_failover"))) == [(1, 2)]
    assert pairs_of(plan_cycle(views, cfg("neutral_failover"))) == [(3, 4)]
    assert pairs_of(plan_cycle(views, cfg("decode_failover"))) == [(5, 6)]


def test_a_failing_worker_without_a_migration_agent_is_reported_not_paired():
    plan = plan_cycle([view(1, schedulable=False, migratable=False), view(2)], cfg("decode_failover"))
    assert plan.pairs == () and "runs no migration agent" in plan.rejected[0].reason


def test_the_four_failure_domains():
    # 1 fails on node a in unit u1; 2 shares node a but sits in unit u2; 3 shares unit u1 on node b; 4 is in u2 on
    # node c; 5 is alone (node d, unit u3).
    views = [
        view(1, node="a", unit="u1", schedulable=False),
        view(2, node="a", unit="u2"),
        view(3, node="b", unit="u1"),
        view(4, node="c", unit="u2"),
        view(5, node="d", unit="u3"),
    ]
    assert domain_of(views[0], views, FailoverDomain.INSTANCE) == {1}
    assert domain_of(views[0], views, FailoverDomain.NODE) == {1, 2}
    assert domain_of(views[0], views, FailoverDomain.INSTANCE_UNIT) == {1, 3}
    # node-unit: the units with a worker on node a (u1, u2) and everyone in them.
    assert domain_of(views[0], views, FailoverDomain.NODE_UNIT) == {1, 2, 3, 4}
    assert fence(views, cfg("decode_failover", failover_domain="node-unit")) == {1, 2, 3, 4}
    plan = plan_cycle(views, cfg("decode_failover", failover_domain="node-unit"))
    assert pairs_of(plan) == [(1, 5)]


def test_a_fenced_worker_is_no_load_balancing_destination():
    # 2 (0.1) shares node "x" with failing 3: with domain node it is fenced, and 1's requests go to 4 (0.3).
    views = [view(1, 0.9), view(2, 0.1, node="x"), view(3, node="x", schedulable=False), view(4, 0.3)]
    plan = plan_cycle(views, cfg("decode_load", rescheduling_decode_load_threshold=0.7, failover_domain="node"))
    assert pairs_of(plan) == [(1, 4)]


# --- bin-packing ----------------------------------------------------------------------------------------------------


def test_mitigation_moves_from_above_the_ceiling_to_below_dispatch():
    # SLO 50 ms: ceiling 0.95 x 50 = 47.5, dispatch 0.85 x 50 = 42.5. D1 at 48 >= 47.5 is a source; D2 at 35 < 42.5
    # a destination; D3 at 45 is neither (below the ceiling, not below dispatch).
    config = cfg("binpacking_mitigation", tpot_slo=50)
    ceiling, dispatch = 0.95 * 50, 0.85 * 50
    assert 48 >= ceiling and 35 < dispatch <= 45 < ceiling
    plan = plan_cycle([view(1, tpot=48.0), view(2, tpot=35.0), view(3, tpot=45.0)], config)
    assert pairs_of(plan) == [(1, 2)]
    assert "48.0 ms >= ceiling 47.5 ms -> 35.0 ms < dispatch 42.5 ms" in plan.pairs[0].reason
    # 47 ms is below the ceiling: nothing to mitigate.
    assert plan_cycle([view(1, tpot=47.0), view(2, tpot=35.0)], config).pairs == ()


def test_mitigation_makes_one_pair_highest_source_to_the_fullest_destination():
    # Sources 48 and 49 ms: one pair a cycle, from 49. Destinations 35 and 40 ms: the fullest below 42.5, 40.
    views = [view(1, tpot=48.0), view(2, tpot=49.0), view(3, tpot=35.0), view(4, tpot=40.0)]
    assert pairs_of(plan_cycle(views, cfg("binpacking_mitigation"))) == [(2, 4)]


def test_mitigation_moves_decode_requests_only():
    # An order that takes waiting requests (FCWSR) becomes shortest running; rule and value stay the configured.
    config = cfg(
        "binpacking_mitigation",
        rescheduling_req_select_order="FCWSR",
        rescheduling_req_select_rule="NUM_REQ",
        rescheduling_req_select_value=2,
    )
    [pair] = plan_cycle([view(1, tpot=48.0), view(2, tpot=35.0)], config).pairs
    assert (pair.select_rule, pair.select_order, pair.select_value) == ("num_requests", "shortest_running", 2)


def test_mitigation_with_no_room_anywhere_says_so():
    plan = plan_cycle([view(1, tpot=48.0), view(2, tpot=43.0)], cfg("binpacking_mitigation"))
    assert plan.pairs == ()
    assert "no decode worker of 'm' below dispatch 42.5 ms" in plan.rejected[0].reason


def test_consolidation_empties_an_instance_below_the_floor_into_the_fullest_one():
    # Floor 0.60 x 50 = 30 ms: D3 at 25 ms with 3 decode requests is a source; D4 at 40 ms (< 42.5) the fullest
    # destination (D5 at 32 ms is emptier); D6 at 20 ms runs nothing, so it is neither.
    floor = 0.60 * 50
    assert 25 < floor
    views = [view(3, tpot=25.0, running=3), view(4, tpot=40.0), view(5, tpot=32.0), view(6, tpot=20.0, running=0)]
    plan = plan_cycle(views, cfg("binpacking_consolidation"))
    assert pairs_of(plan) == [(3, 4)]
    pair = plan.pairs[0]
    # All of D3's running requests: num_requests 3, shortest first.
    assert (pair.select_rule, pair.select_order, pair.select_value) == ("num_requests", "shortest_running", 3)
    assert "25.0 ms < floor 30.0 ms, 3 decode requests -> 40.0 ms < dispatch 42.5 ms" in pair.reason


def test_bin_packing_leaves_prefill_workers_alone():
    views = [view(1, tpot=48.0, role=Role.PREFILL), view(2, tpot=35.0, role=Role.PREFILL)]
    assert plan_cycle(views, cfg("binpacking_mitigation", "binpacking_consolidation")).pairs == ()


# --- the cycle's validation -----------------------------------------------------------------------------------------


def test_a_to_b_and_b_to_a_are_never_both_chosen():
    # decode_load: A (load 0.9, 35 ms) -> B (0.2, 48 ms). binpacking_mitigation would move B (48 >= 47.5) -> A
    # (35 < 42.5): refused.
    a, b = view(1, 0.9, tpot=35.0), view(2, 0.2, tpot=48.0)
    plan = plan_cycle([a, b], cfg("decode_load", "binpacking_mitigation", rescheduling_decode_load_threshold=0.7))
    assert pairs_of(plan) == [(1, 2)]
    [why] = plan.rejected
    assert why.policy == Policy.BINPACKING_MITIGATION and (why.source_id, why.destination_id) == (2, 1)
    assert "1 -> 2 is already chosen or running" in why.reason
    # The policies' order is a priority: mitigation first wins.
    plan = plan_cycle([a, b], cfg("binpacking_mitigation", "decode_load", rescheduling_decode_load_threshold=0.7))
    assert pairs_of(plan) == [(2, 1)]


def test_a_running_migration_counts_for_the_direction_rule():
    views = [view(1, 0.9), view(2, 0.2)]
    plan = plan_cycle(views, cfg("decode_load", rescheduling_decode_load_threshold=0.7), in_flight=[(2, 1)])
    assert plan.pairs == () and "2 -> 1 is already chosen or running" in plan.rejected[0].reason


def test_one_migration_per_source_unless_configured():
    # decode_load: 1 (0.9) -> 2 (0.2); mitigation: 1 (48 ms) -> 3 (35 ms, load 0.8 >= 0.7 so no decode_load
    # destination). One per source: the second is refused; two per source: both are made.
    views = [view(1, 0.9, tpot=48.0), view(2, 0.2, tpot=44.0), view(3, 0.8, tpot=35.0)]
    policies = ("decode_load", "binpacking_mitigation")
    # 3 at 0.8 is also a decode_load source, with no destination left after 2.
    one = plan_cycle(views, cfg(*policies, rescheduling_decode_load_threshold=0.7))
    assert pairs_of(one) == [(1, 2)]
    assert any("source 1 already takes part in 1 migration(s), at most 1" in r.reason for r in one.rejected)
    two = plan_cycle(
        views, cfg(*policies, rescheduling_decode_load_threshold=0.7, rescheduling_max_migrations_per_source=2)
    )
    assert pairs_of(two) == [(1, 2), (1, 3)]
    # A migration still running from the last cycle counts too.
    busy = plan_cycle(views, cfg("decode_load", rescheduling_decode_load_threshold=0.7), in_flight=[(1, 9)])
    assert busy.pairs == ()


def test_a_destination_is_not_also_a_source_in_one_cycle():
    # decode_load: 1 (0.9) -> 2 (0.2); mitigation would move 2 (48 ms) -> 3 (35 ms): 2 is a destination already.
    views = [view(1, 0.9, tpot=44.0), view(2, 0.2, tpot=48.0), view(3, 0.75, tpot=35.0)]
    plan = plan_cycle(views, cfg("decode_load", "binpacking_mitigation", rescheduling_decode_load_threshold=0.7))
    assert pairs_of(plan) == [(1, 2)]
    assert any("source 2 is already a destination this cycle" in r.reason for r in plan.rejected)


def test_the_plan_reads_as_a_dict_for_status():
    plan = plan_cycle([view(1, 0.9), view(2, 0.2)], cfg("decode_load", rescheduling_decode_load_threshold=0.7))
    d = plan.to_dict()
    assert d["pairs"][0]["policy"] == "decode_load" and d["pairs"][0]["source_id"] == 1
    assert d["rejected"] == []


# --- the converter, on real fleet records ---------------------------------------------------------------------------


def _meta(role: WorkerRole, node: str, **extra) -> dict:
    md = WorkerMetadata(model=MODEL, role=role, node=node, pid=100, block_size=16, migration_mode="live").to_dict()
    md.update(extra)
    return md


def test_instance_views_from_a_fleet_snapshot():
    step = {"decode_base_ms": 6.0, "decode_ms_per_seq": 0.5, "decode_ms_per_kv_token": 0.001}
    fleet = FleetState()
    fleet.add_instance(1, _meta(WorkerRole.DECODE, "n1", step_time=step, failure_unit="rack-1"))
    fleet.add_instance(2, _meta(WorkerRole.DECODE, "n2"))
    fleet.add_instance(3, _meta(WorkerRole.DECODE, "n1", migration_mode=""))  # no agent, never reports
    # 1: 1,000 blocks, 700 in use, 100 prompt tokens waiting (ceil(100 / 16) = 7 blocks), 40 sequences, 20,000 KV
    # tokens; 2: idle.
    fleet.apply_load(1, LoadSnapshot(0.0, 0.7, 1000, 700, 40, 2, 100, 0, 40, 20_000), now_s=10.0)
    fleet.apply_load(2, LoadSnapshot(0.0, 0.1, 1000, 100, 0, 0, 0, 0, 0, 0), now_s=10.2)
    fleet.apply_status(2, WorkerStatus(schedulable=False, reason="draining"), now_s=10.2)

    v1, v2, v3 = instance_views(fleet.snapshot(now_s=10.3))
    assert (v1.instance_id, v1.role, v1.model, v1.node, v1.unit) == (1, Role.DECODE, MODEL, "n1", "rack-1")
    assert v1.schedulable and v1.migratable and v1.fresh
    assert v1.report_age_s == pytest.approx(0.3)
    assert (v1.num_total_blocks, v1.num_used_blocks, v1.num_waiting_blocks) == (1000, 700, math.ceil(100 / 16))
    assert (v1.batch_size, v1.num_kv_tokens, v1.num_running_decode) == (40, 20_000, 40)
    # Its announced model: 6 + 40 x 0.5 + 20,000 x 0.001 = 46 ms.
    assert v1.predicted_tpot_ms == pytest.approx(6 + 40 * 0.5 + 20_000 * 0.001)
    assert v1.predicted_tpot_ms == pytest.approx(StepTimeModel.from_mapping(step).decode_ms(40, 20_000))
    assert projected_kv_use(v1) == pytest.approx((700 + 7) / 1000)
    assert not v2.schedulable and v2.unit == "n2"  # no failure_unit label: the node
    assert v2.predicted_tpot_ms == 0.0  # nothing decoding
    assert not v3.migratable and v3.report_age_s is None and not v3.fresh and v3.predicted_tpot_ms is None

    # The draining worker 2 is failed over to the only healthy, migratable decode worker, 1.
    plan = plan_cycle(instance_views(fleet.snapshot(now_s=10.3)), cfg("decode_failover", "decode_load"))
    assert pairs_of(plan) == [(2, 1)]


def test_a_worker_silent_past_the_staleness_time_is_failed_over():
    fleet = FleetState()
    fleet.add_instance(1, _meta(WorkerRole.DECODE, "n1"))
    fleet.add_instance(2, _meta(WorkerRole.DECODE, "n2"))
    fleet.apply_load(1, LoadSnapshot(0.0, 0.5, 100, 50, 3, 0, 0, 0, 3, 300), now_s=0.0)
    fleet.apply_load(2, LoadSnapshot(0.0, 0.1, 100, 10, 1, 0, 0, 0, 1, 100), now_s=70.0)
    views = instance_views(fleet.snapshot(now_s=70.5))
    assert views[0].report_age_s == pytest.approx(70.5) and not views[0].fresh
    plan = plan_cycle(views, cfg("decode_failover"))  # 70.5 s > 60 s
    assert pairs_of(plan) == [(1, 2)] and "stale" in plan.pairs[0].reason
