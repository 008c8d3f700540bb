"""A pool count changed by hand (the connector's ``pool_size``) is where the planner goes on from
(components/planner/loop.py ``Planner._follow_hand_changes``): the difference from the registered workers counts as
a change in progress until the fleet shows it, a count the planner set itself is never taken for one, and a hand
change that never completes stops holding the planner after ``hand_change_timeout_s``. Pure: a ``MemoryFleet`` and
a planner that is constructed, never started (Dynamo's issue 4420: its planner could not scale down after a hand
edit)."""

from __future__ import annotations

import pytest

from components.fleet import MemoryFleet
from components.planner.config import PlannerConfig
from components.planner.controller import PendingChange
from components.planner.loop import Planner
from components.planner.policy import Pool
from components.protocol.metadata import WorkerMetadata, WorkerRole

pytestmark = pytest.mark.unit
MODEL = "m"


class SizedConnector:
    name = "stub"

    def __init__(self) -> None:
        self.sizes: dict[Pool, int] = {}

    async def pool_size(self, pool: Pool) -> int | None:
        return self.sizes.get(pool)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def planner(connector: SizedConnector, clock: Clock, timeout_s: float = 60.0) -> Planner:
    return Planner(
        object(),  # type: ignore[arg-type]  # never started: the runtime is not touched
        PlannerConfig(),
        "ns",
        MODEL,
        connector,  # type: ignore[arg-type]
        clock=clock,
        hand_change_timeout_s=timeout_s,
    )


def fleet(n: int) -> MemoryFleet:
    f = MemoryFleet()
    for iid in range(1, n + 1):
        f.add_instance(iid, WorkerMetadata(model=MODEL, role=WorkerRole.AGGREGATED).to_dict())
    return f


async def follow(p: Planner, f: MemoryFleet, clock: Clock) -> None:
    p._follow_hand_changes(f.snapshot(clock.now), await p._pool_sizes())


async def test_a_hand_scale_up_holds_the_pool_until_its_workers_register_then_is_the_start():
    conn, clock = SizedConnector(), Clock()
    p = planner(conn, clock)
    conn.sizes[Pool.DECODE] = 2
    await follow(p, fleet(2), clock)
    assert p.changes_in_progress() == {}  # the count the fleet shows: nothing to wait for
    # Someone scales to 4; two workers still starting: the pool counts as changing 2 -> 4.
    conn.sizes[Pool.DECODE] = 4
    await follow(p, fleet(2), clock)
    assert p.changes_in_progress() == {Pool.DECODE: PendingChange(before=2, target=4)}
    await follow(p, fleet(3), clock)
    assert p.changes_in_progress() == {Pool.DECODE: PendingChange(before=2, target=4)}
    await follow(p, fleet(4), clock)  # all four registered: settled, the planner goes on from 4
    assert p.changes_in_progress() == {}
    # A hand scale-down (4 -> 1) likewise: the leaving workers count as leaving until they are gone.
    conn.sizes[Pool.DECODE] = 1
    await follow(p, fleet(4), clock)
    assert p.changes_in_progress() == {Pool.DECODE: PendingChange(before=4, target=1)}
    await follow(p, fleet(1), clock)
    assert p.changes_in_progress() == {}


async def test_a_count_the_planner_set_is_not_a_hand_change_while_its_workers_register():
    conn, clock = SizedConnector(), Clock()
    p = planner(conn, clock)
    conn.sizes[Pool.DECODE] = 2
    await follow(p, fleet(2), clock)
    p._last_size[Pool.DECODE] = 3  # what apply() records when the planner asks for 3 (its change then ended)
    conn.sizes[Pool.DECODE] = 3
    await follow(p, fleet(2), clock)  # the third not in the fleet view yet: no hand change, no hold
    assert p.changes_in_progress() == {}


async def test_a_hand_change_that_never_completes_stops_holding_after_the_timeout():
    conn, clock = SizedConnector(), Clock()
    p = planner(conn, clock, timeout_s=60.0)
    conn.sizes[Pool.DECODE] = 5  # three pods Pending forever (no GPU free)
    await follow(p, fleet(2), clock)
    assert p.changes_in_progress() == {Pool.DECODE: PendingChange(before=2, target=5)}
    clock.now += 59.0
    await follow(p, fleet(2), clock)
    assert Pool.DECODE in p.changes_in_progress()
    clock.now += 2.0
    await follow(p, fleet(2), clock)
    assert p.changes_in_progress() == {}  # the planner decides again, from the 2 registered
    await follow(p, fleet(2), clock)
    assert p.changes_in_progress() == {}  # and the same count is not a new hand change


async def test_changed_by_hand_again_while_the_first_settles_follows_the_latest():
    conn, clock = SizedConnector(), Clock()
    p = planner(conn, clock)
    conn.sizes[Pool.DECODE] = 4
    await follow(p, fleet(2), clock)
    conn.sizes[Pool.DECODE] = 3
    await follow(p, fleet(2), clock)
    assert p.changes_in_progress() == {Pool.DECODE: PendingChange(before=2, target=3)}
    await follow(p, fleet(3), clock)
    assert p.changes_in_progress() == {}


async def test_an_aggregated_fleet_has_no_prefill_pool_to_follow():
    conn, clock = SizedConnector(), Clock()
    p = planner(conn, clock)
    conn.sizes[Pool.PREFILL] = 2
    await follow(p, fleet(1), clock)
    assert p.changes_in_progress() == {}
