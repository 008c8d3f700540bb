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


def test_the_worked_example_pairs_the_largest_deficit_with_the_largest_spare():
    # Free: 2, 5, 50, 30 blocks. Deficits (queue past free): 1: 40 - 2 = 38, 2: 10 - 5 = 5. Spares (free past the
    # own queue): 3: 50 - 0 = 50, 4: 30 - 20 = 10. Pairs 1 -> 3 with min(38, 50) = 38 blocks x 16 = 608 tokens and
    # 2 -> 4 with min(5, 10) = 5 x 16 = 80 tokens, first come waiting.
    views = [view(1, 98, 40), view(2, 95, 10), view(3, 50, 0), view(4, 70, 20)]
    result = waiting_fit(views, cfg())
    got = [(p.source_id, p.destination_id, p.select_value, p.select_rule, p.select_order) for p in result.pairs]
    assert got == [(1, 3, 608.0, "tokens", "first_come_waiting"), (2, 4, 80.0, "tokens", "first_come_waiting")]
    assert all(p.policy == Policy.WAITING_FIT for p in result.pairs) and result.rejected == ()


def test_a_full_worker_with_no_queue_is_no_source_and_a_queue_that_fits_is_none_either():
    # Worker 1 is full (99 of 100) but nothing waits: nothing to move (neutral_load at 0.7 would pair it). Worker 2
    # has a queue of 20 blocks and 40 free: it admits them itself. Nobody is a source.
    result = waiting_fit([view(1, 99, 0), view(2, 60, 20), view(3, 10, 0)], cfg())
    assert result.pairs == () and result.rejected == ()


def test_headroom_keeps_a_destination_s_blocks_for_its_own_growth():
    # Destination 2 has 30 free, a queue of 5: spare 25 with no headroom, 25 - 0.2 x 100 = 5 with 0.2, and none at
    # 0.3 (the source is then reported with no destination left).
    views = [view(1, 100, 32), view(2, 70, 5)]
    assert [p.select_value for p in waiting_fit(views, cfg()).pairs] == [25 * 16]
    assert [p.select_value for p in waiting_fit(views, cfg(rescheduling_waiting_fit_headroom=0.2)).pairs] == [5 * 16]
    none = waiting_fit(views, cfg(rescheduling_waiting_fit_headroom=0.3))
    assert none.pairs == () and [(r.source_id, r.destination_id) for r in none.rejected] == [(1, None)]


def test_only_healthy_aggregated_workers_of_one_model_take_part():
    views = [
        view(1, 100, 30),
        view(2, 0, 0, role=Role.DECODE),  # another role
        view(3, 0, 0, model="other"),  # another model
        view(4, 0, 0, fresh=False),  # numbers not current
        view(5, 0, 0, migratable=False),  # no migration agent
        view(6, 40, 0),
    ]
    assert [(p.source_id, p.destination_id) for p in waiting_fit(views, cfg()).pairs] == [(1, 6)]


def test_the_cycle_runs_it_by_name_and_validates_its_pairs():
    # Through plan_cycle: listed in --rescheduling-policies, its pair is validated like any other (a source in
    # flight is refused).
    views = [view(1, 100, 30), view(2, 40, 0)]
    plan = plan_cycle(views, cfg())
    assert [(p.source_id, p.destination_id) for p in plan.pairs] == [(1, 2)]
    busy = plan_cycle(views, cfg(), in_flight=[(1, 3)])
    assert busy.pairs == () and busy.rejected
