"""The rescheduler's executor (components/rescheduler/executor.py) and its counters (metrics.py), over a scripted
``migrate`` caller: each source answers as the test says (reports, a raise, a hang), so the outcome counting, the
per-call timeout and the independence of the pairs are checked without a mesh (the integration tests run the real
workers: tests/integration/test_rescheduler.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from components.protocol.migration import MigrateRequest, MigrationReport
from components.rescheduler.executor import CallOutcome, ExecutionCounts, MigrationExecutor, MigrationOrder
from components.rescheduler.metrics import ReschedulerMetrics
from components.runtime import InstanceGoneError

pytestmark = pytest.mark.unit


class _Stream:
    def __init__(self, items: list[dict[str, Any]], hang: bool) -> None:
        self.items = list(items)
        self.hang = hang
        self.closed = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.items:
            return self.items.pop(0)
        if self.hang:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


class ScriptedCaller:
    """Source id -> what its ``migrate`` answers: a list of reports, an exception to raise, or "hang"."""

    def __init__(self, script: dict[int, Any]) -> None:
        self.script = script
        self.asked: list[tuple[int, MigrateRequest]] = []
        self.streams: list[_Stream] = []
        self.in_flight_seen: list[frozenset[tuple[int, int]]] = []
        self.executor: MigrationExecutor | None = None

    async def direct(self, request: Any, instance_id: int) -> _Stream:
        self.asked.append((instance_id, MigrateRequest.from_dict(request)))
        if self.executor is not None:
            self.in_flight_seen.append(self.executor.in_flight)
        what = self.script[instance_id]
        if isinstance(what, BaseException):
            raise what
        s = _Stream([] if what == "hang" else [r.to_dict() for r in what], hang=what == "hang")
        self.streams.append(s)
        return s


def report(rid: str, state: str, mode: str = "live") -> MigrationReport:
    return MigrationReport(rid, state, mode=mode)


def order(src: int, dst: int, policy: str, **kw: Any) -> MigrationOrder:
    return MigrationOrder(src, dst, policy, **kw)


async def test_each_pair_is_one_call_to_its_source_with_the_selection_and_the_policy_as_trigger() -> None:
    caller = ScriptedCaller({1: [report("a", "committed")]})
    ex = MigrationExecutor(caller, call_timeout_s=5)
    o = order(1, 2, "decode_load", select_rule="num_requests", select_order="LCR", select_value=2.0, mode="recompute")
    [res] = await ex.execute([o])
    [(src, asked)] = caller.asked
    assert src == 1
    assert asked == MigrateRequest(
        dst_instance_id=2,
        select_rule="num_requests",
        select_value=2.0,
        select_order="LCR",
        trigger="decode_load",
        request_ids=[],
        mode="recompute",
    )
    assert res.outcome == CallOutcome.DONE and res.num_committed == 1
    assert ex.in_flight == frozenset()


async def test_failures_and_timeouts_are_counted_and_never_stop_the_other_pairs() -> None:
    # Source 1 commits two and aborts one, 2 is gone, 3 hangs past the timeout, 4 has nothing to move, 5 commits.
    caller = ScriptedCaller(
        {
            1: [report("a", "committed"), report("b", "aborted_by_destination"), report("c", "committed")],
            2: InstanceGoneError(2, "no responders"),
            3: "hang",
            4: [],
            5: [report("d", "committed", mode="recompute")],
        }
    )
    ex = MigrationExecutor(caller, call_timeout_s=0.2)
    caller.executor = ex
    orders = [
        order(1, 9, "decode_load"),
        order(2, 9, "decode_failover"),
        order(3, 9, "decode_failover"),
        order(4, 9, "decode_load"),
        order(5, 9, "decode_failover"),
    ]
    results = await ex.execute(orders)
    assert [r.outcome for r in results] == [
        CallOutcome.DONE,
        CallOutcome.FAILED,
        CallOutcome.TIMED_OUT,
        CallOutcome.DONE,
        CallOutcome.DONE,
    ]
    assert "is gone" in results[1].error
    # The hung call's stream was closed (which cancels the source's handler).
    assert [s.closed for s in caller.streams] == [True, True, True, True]
    # decode_load: 3 reports (2 committed, 1 aborted) + source 4's empty call; decode_failover: one failed call,
    # one timed out (1 attempt each: they ended without a report) and one committed report.
    assert ex.totals["decode_load"] == ExecutionCounts(pairs=2, attempted=3, committed=2, aborted=1, empty=1)
    assert ex.totals["decode_failover"] == ExecutionCounts(pairs=3, attempted=3, committed=1, failed=1, timed_out=1)
    assert ex.in_flight == frozenset()
    # Concurrent: source 5's call was made while source 3's hung call was still in flight (one after the other, it
    # would have waited for 3's timeout first and seen nothing in flight but itself).
    assert caller.in_flight_seen[-1] == frozenset({(3, 9), (5, 9)})

    m = ReschedulerMetrics("standalone")
    m.results(results)
    text = m.render().decode()
    # Label order is the declaration order: rescheduler, policy, mode[, outcome].
    for line in [
        'kvmesh_rescheduler_migrations_attempted_total{mode="live",policy="decode_load",rescheduler="standalone"} 3.0',
        'kvmesh_rescheduler_migrations_succeeded_total{mode="live",policy="decode_load",rescheduler="standalone"} 2.0',
        'kvmesh_rescheduler_migrations_failed_total{mode="live",outcome="aborted",policy="decode_load",'
        'rescheduler="standalone"} 1.0',
        'kvmesh_rescheduler_migrations_failed_total{mode="auto",outcome="failed",policy="decode_failover",'
        'rescheduler="standalone"} 1.0',
        'kvmesh_rescheduler_migrations_failed_total{mode="auto",outcome="timed_out",policy="decode_failover",'
        'rescheduler="standalone"} 1.0',
        'kvmesh_rescheduler_migrations_succeeded_total{mode="recompute",policy="decode_failover",'
        'rescheduler="standalone"} 1.0',
    ]:
        assert line in text, line


async def test_a_cancelled_cycle_cancels_its_calls_and_leaves_nothing_in_flight() -> None:
    caller = ScriptedCaller({1: "hang", 2: "hang"})
    ex = MigrationExecutor(caller, call_timeout_s=60)
    task = asyncio.ensure_future(ex.execute([order(1, 3, "x"), order(2, 3, "x")]))
    await _until(lambda: len(caller.streams) == 2)
    assert ex.in_flight == frozenset({(1, 3), (2, 3)})
    assert ex.in_flight_sources == frozenset({1, 2})
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ex.in_flight == frozenset()
    assert all(s.closed for s in caller.streams)


def test_a_call_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="call_timeout_s"):
        MigrationExecutor(ScriptedCaller({}), call_timeout_s=0)


async def _until(pred: Callable[[], bool]) -> None:
    from tests.support.waiting import wait_until

    await wait_until(pred, timeout_s=5)
