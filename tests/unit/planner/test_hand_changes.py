"""A pool count changed by hand (the connector's ``pool_size``) is where the planner goes on from
(components/planner/loop.py ``Planner._follow_hand_changes``): the difference from the registered workers counts as
a change in progress until the fleet shows it, a count the planner set itself is never taken for one, and a hand
change that never completes stops holding the planner after ``hand_change_timeout_s``. Pure: a ``MemoryFleet`` and
a planner that is constructed, never started (Dynamo's issue 4420: its planner could not scale down after a hand
edit)."""

from __future__ import annotations

import asyncio

import pytest

from components.fleet import MemoryFleet
from components.planner.config import PlannerConfig
from components.planner.connectors.base import ConnectorError
from components.planner.controller import PendingChange
from components.planner.loop import Planner
from components.planner.policy import Pool
from components.protocol.metadata import WorkerMetadata, WorkerRole
from tests.support.planner_stubs import ApplyOnlyRuntime, swap

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


# --- a swap within one adjustment: removals first ---------------------------------------------------------------------


class OrderedConnector(SizedConnector):
    """Records when each set_pool_size began and ended; a removal takes a while (a drain), and may fail."""

    def __init__(self, fail: Pool | None = None) -> None:
        super().__init__()
        self.log: list[tuple[str, Pool, int]] = []
        self.fail = fail

    async def set_pool_size(self, pool: Pool, count: int) -> None:
        self.log.append(("begin", pool, count))
        await asyncio.sleep(0.05 if pool == Pool.PREFILL else 0)
        if pool == self.fail:
            raise ConnectorError("stub", pool, count, "refused")
        self.log.append(("end", pool, count))

    def gpus_per_worker(self, pool: Pool) -> int | None:
        return None


def applying_planner(conn: OrderedConnector) -> Planner:
    return Planner(ApplyOnlyRuntime(), PlannerConfig(), "ns", MODEL, conn, clock=Clock())  # type: ignore[arg-type]


async def test_a_swap_removes_before_it_adds_so_the_budget_is_never_exceeded():
    conn = OrderedConnector()
    p = applying_planner(conn)
    p.apply(swap(decode=2, prefill=2, budget=4))  # prefill 2 -> 1 frees the GPU decode 2 -> 3 takes
    await asyncio.gather(*list(p._change_tasks.values()))
    # The decode addition began only after the prefill removal ended (on the old code both began at once).
    assert conn.log == [("begin", Pool.PREFILL, 1), ("end", Pool.PREFILL, 1), ("begin", Pool.DECODE, 3),
                        ("end", Pool.DECODE, 3)]  # fmt: skip
    assert p.changes_in_progress() == {} and p.num_changes_applied == 2


async def test_an_addition_whose_removal_failed_is_not_started():
    conn = OrderedConnector(fail=Pool.PREFILL)
    p = applying_planner(conn)
    p.apply(swap(decode=2, prefill=2, budget=4))  # prefill 2 -> 1 frees the GPU decode 2 -> 3 takes
    await asyncio.gather(*list(p._change_tasks.values()))
    assert [e for e in conn.log if e[1] == Pool.DECODE] == []
    assert "a removal it needed failed" in p.last_change_error and p.num_change_failures == 2
    assert p.changes_in_progress() == {}
