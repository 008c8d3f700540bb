"""The rescheduler's loop (components/rescheduler/loop.py) over the in-memory mesh twins: a scripted plan, sources
served as ``migrate`` endpoints that answer as the test says. Checks the cadence (a cycle never overlaps the
previous one), what the last cycle keeps, the status key and the counters. The policies' own tests are theirs; the
loop with real workers and real policies is tests/integration/test_rescheduler.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from components.fleet.model import FleetSnapshot
from components.protocol.endpoints import ENDPOINT_MIGRATE
from components.protocol.migration import MigrateRequest, MigrationReport
from components.rescheduler.executor import MigrationOrder
from components.rescheduler.loop import CycleDecision, RejectedPair, Rescheduler
from components.rescheduler.status import status_key, status_prefix
from components.runtime import RequestContext
from tests.support.mesh import Mesh
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

NS = "resched-unit"


class Sources:
    """``migrate`` served for instance ids 1 and 2: each call is recorded with its start and end on the loop's
    clock, takes ``hold_s``, then reports one committed migration per request id asked (or one, by selection)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.calls: list[tuple[int, MigrateRequest, float, float]] = []

    def handler(self, iid: int) -> Any:
        async def migrate(body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
            loop = asyncio.get_running_loop()
            req = MigrateRequest.from_dict(body)
            t0 = loop.time()
            await asyncio.sleep(self.hold_s)  # a migration takes a while (simulated)
            self.calls.append((iid, req, t0, loop.time()))
            for rid in req.request_ids or ["r"]:
                yield MigrationReport(rid, "committed", mode="live", src_instance_id=iid).to_dict()

        return migrate


async def start_sources(mesh: Mesh, sources: Sources) -> None:
    rt = await mesh.runtime()
    ep = rt.namespace(NS).component("backend").endpoint(ENDPOINT_MIGRATE)
    for iid in (1, 2):
        await ep.serve(sources.handler(iid), instance_id=iid)


async def test_cycles_never_overlap_and_the_last_cycle_and_the_status_say_what_moved() -> None:
    mesh = Mesh()
    # Each migration takes 3 intervals: a loop that started cycles on the clock would overlap them.
    sources = Sources(hold_s=0.15)
    await start_sources(mesh, sources)
    plans: list[tuple[float, frozenset[tuple[int, int]]]] = []

    def plan(snapshot: FleetSnapshot, in_flight: frozenset[tuple[int, int]]) -> CycleDecision:
        plans.append((asyncio.get_running_loop().time(), in_flight))
        if len(plans) > 3:
            return CycleDecision()
        return CycleDecision(
            orders=(MigrationOrder(1, 2, "decode_load", reason="0.9 vs 0.2"),),
            rejected=(RejectedPair(2, 1, "decode_load", "reverse of a chosen pair"),),
        )

    rt = await mesh.runtime()
    r = Rescheduler(rt, NS, plan, interval_s=0.05, call_timeout_s=5, policies=["decode_load"])
    try:
        await r.start()
        await wait_until(lambda: r.num_cycles >= 5, timeout_s=10)
    finally:
        await r.stop()
        await mesh.shutdown()
    # Three cycles chose a pair; every plan came after the previous cycle's call had ended.
    assert len(sources.calls) == 3
    for (_, _, _, end), (t_plan, in_flight) in zip(sources.calls, plans[1:], strict=False):
        assert t_plan >= end
        assert in_flight == frozenset()
    assert all(c[1].trigger == "decode_load" and c[1].dst_instance_id == 2 for c in sources.calls)
    last = r.last_cycle
    assert last is not None and last.number == 3  # cycles 4 and 5 chose nothing: the third stays
    d = last.to_dict()
    assert [(p["source"], p["destination"], p["policy"], p["outcome"], p["committed"]) for p in d["pairs"]] == [
        (1, 2, "decode_load", "done", 1)
    ]
    assert d["rejected"] == [
        {"source": 2, "destination": 1, "policy": "decode_load", "reason": "reverse of a chosen pair"}
    ]
    st = r.status()
    assert st["totals"]["decode_load"]["committed"] == 3
    assert st["pairs_by_policy"] == {"decode_load": 3}
    text = r.metrics.render().decode()
    assert 'kvmesh_rescheduler_pairs_total{policy="decode_load",rescheduler="standalone"} 3.0' in text
    assert 'kvmesh_rescheduler_rejected_pairs_total{policy="decode_load",rescheduler="standalone"} 3.0' in text
    assert (
        'kvmesh_rescheduler_migrations_succeeded_total{mode="live",policy="decode_load",rescheduler="standalone"} 3.0'
        in text
    )


async def test_the_status_key_holds_the_last_cycle_and_goes_with_the_lease() -> None:
    mesh = Mesh()
    sources = Sources(hold_s=0.0)
    await start_sources(mesh, sources)
    asked = []

    def plan(snapshot: FleetSnapshot, in_flight: frozenset[tuple[int, int]]) -> CycleDecision:
        asked.append(1)
        return CycleDecision(
            orders=(MigrationOrder(2, 1, "decode_failover", reason="stale"),) if len(asked) == 1 else ()
        )

    rt = await mesh.runtime()
    r = Rescheduler(rt, NS, plan, interval_s=0.02, call_timeout_s=5, where="colocated")
    reader = await mesh.runtime()
    await r.start()
    try:
        await wait_until(lambda: r.last_cycle is not None, timeout_s=5)
        key = status_key(NS, rt.primary_lease)

        async def published() -> dict[str, Any] | None:
            v = (await reader.discovery.get_prefix(status_prefix(NS))).get(key)
            return None if v is None else json.loads(v)

        st = await published()
        assert st is not None and st["where"] == "colocated"
        assert st["last_cycle"]["pairs"][0]["policy"] == "decode_failover"
        assert st["last_cycle"]["pairs"][0]["source"] == 2
    finally:
        await r.stop()
        await rt.shutdown(drain_timeout_s=0.1)  # revokes the lease: the key goes with it
    assert key not in await reader.discovery.get_prefix(status_prefix(NS))
    await mesh.shutdown()


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Rescheduler(None, NS, lambda s, f: CycleDecision(), interval_s=0, call_timeout_s=1)  # type: ignore[arg-type]
