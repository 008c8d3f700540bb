"""``waiting_fit`` (components/rescheduler/policies/waiting.py): waiting requests from a worker whose queue does not
fit its free KV to one whose free KV fits them, with the module docstring's worked example."""

from __future__ import annotations

import pytest

from components.rescheduler.config import Policy, ReschedulerConfig
from components.rescheduler.policies import plan_cycle
from components.rescheduler.policies.waiting import waiting_fit
from components.rescheduler.types import InstanceView, Role

pytestmark = pytest.mark.unit


def view(iid: int, used: int, waiting: int, total: int = 100, **kw) -> InstanceView:
    fields = {"model": "m", "role": Role.AGGREGATED, "num_total_blocks": total, "num_used_blocks": used}
    fields.update(kw)
    return InstanceView(iid, num_waiting_blocks=waiting, **fields)


def cfg(**kw) -> ReschedulerConfig:
    return ReschedulerConfig(rescheduling_policies=["waiting_fit"], **kw)


def test_the_worked_example_pairs_the_largest_backlog_with_the_smallest():
    # Backlogs (queue past free KV): 1: 40 - 2 = 38, 2: 20 - 5 = 15, 3: 20 - 10 = 10, 4: 20 - 30 = -10. Upper half
    # (1, 2) are sources, lower half (3, 4) destinations: 1 -> 4 with min(38, 48 // 2 = 24) = 24 blocks x 16 = 384
    # tokens, 2 -> 3 with min(15, 5 // 2 = 2) = 2 blocks = 32 tokens, first come waiting.
    views = [view(1, 98, 40), view(2, 95, 20), view(3, 90, 20), view(4, 70, 20)]
    result = waiting_fit(views, cfg())
    got = [(p.source_id, p.destination_id, p.select_value, p.select_rule, p.select_order) for p in result.pairs]
    assert got == [(1, 4, 384.0, "tokens", "first_come_waiting"), (2, 3, 32.0, "tokens", "first_come_waiting")]
    assert all(p.policy == Policy.WAITING_FIT for p in result.pairs) and result.rejected == ()


def test_the_budget_is_never_more_than_the_source_cannot_admit():
    # 1: backlog 40 - 0 = 40; 2: 0 - 100 = -100 (idle). Half the gap is 70, but only 40 blocks of 1's queue do not
    # fit: 40 x 16 = 640 tokens.
    assert [p.select_value for p in waiting_fit([view(1, 100, 40), view(2, 0, 0)], cfg()).pairs] == [640.0]


def test_a_full_worker_with_no_queue_is_no_source_and_a_queue_that_fits_is_none_either():
    # Worker 1 is full (99 of 100) but nothing waits: backlog -1. Worker 2 has a queue of 20 blocks and 40 free:
    # backlog -20, it admits them itself. No positive backlog: no source (neutral_load at 0.7 would pair 1).
    result = waiting_fit([view(1, 99, 0), view(2, 60, 20), view(3, 10, 0), view(4, 50, 0)], cfg())
    assert result.pairs == () and result.rejected == ()


def test_a_fleet_short_everywhere_still_pairs_the_longest_backlog_with_the_shortest():
    # No worker has a free block to spare: backlogs 60, 5. The gap (55) is past the threshold (0.01 x 100 = 1):
    # 1 -> 2 with min(60, 27) = 27 blocks. Two equal backlogs make no pair (gap 0), with the reason.
    assert [p.select_value for p in waiting_fit([view(1, 100, 60), view(2, 100, 5)], cfg()).pairs] == [27 * 16]
    even = waiting_fit([view(1, 100, 30), view(2, 100, 30)], cfg())
    assert even.pairs == () and [(r.source_id, r.destination_id) for r in even.rejected] == [(1, 2)]


def test_headroom_counts_as_backlog():
    # Destination 2: 30 free, a queue of 5: backlog -25 with no headroom, -25 + 0.2 x 100 = -5 with 0.2. Source 1:
    # 32 waiting, none free: backlog 32, and 52 with 0.2. Budgets min(32, 57 // 2 = 28) = 28 and min(52, 57 // 2)
    # = 28 blocks: the gap is the same, both sides carry the headroom.
    views = [view(1, 100, 32), view(2, 70, 5)]
    assert [p.select_value for p in waiting_fit(views, cfg()).pairs] == [28 * 16]
    assert [p.select_value for p in waiting_fit(views, cfg(rescheduling_waiting_fit_headroom=0.2)).pairs] == [28 * 16]


def test_only_healthy_aggregated_workers_of_one_model_take_part():
    views = [
        view(1, 100, 30),
        view(2, 0, 0, role=Role.DECODE),  # another role
        view(3, 0, 0, model="other"),  # another model
        view(4, 0, 0, fresh=False),  # numbers not current
        view(5, 0, 0, migratable=False),  # no migration agent
        view(6, 40, 0),
    ]
    # Candidates 1 (backlog 30) and 6 (-60); the others take no part.
    assert [(p.source_id, p.destination_id) for p in waiting_fit(views, cfg()).pairs] == [(1, 6)]


def test_the_cycle_runs_it_by_name_and_validates_its_pairs():
    # Through plan_cycle: listed in --rescheduling-policies, its pair is validated like any other (a source in
    # flight is refused).
    views = [view(1, 100, 30), view(2, 40, 0)]
    plan = plan_cycle(views, cfg())
    assert [(p.source_id, p.destination_id) for p in plan.pairs] == [(1, 2)]
    busy = plan_cycle(views, cfg(), in_flight=[(1, 3)])
    assert busy.pairs == () and busy.rejected
