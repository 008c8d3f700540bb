"""The rescheduler's loop with the real policies, on real etcd and nats-server, moving requests between simulated
workers (components/rescheduler/loop.py; the policies are components/rescheduler/policies/).

Workers run in this process, each on its own runtime (its own etcd and NATS connections, as separate processes
would; the helpers of test_migration.py). Clients stream from a worker's ``generate`` directly, so a token lost,
repeated or out of order shows as a position mismatch (``Stream`` checks each chunk's position on arrival) or as a
difference from the same request's tokens on an unmoved engine. The rescheduler has its own runtime and follows the
fleet as ``kvmesh rescheduler`` does (its ``LiveFleet``); it cycles every 50 ms so a test waits for events, not for
the default 500 ms interval. Each test is bounded by its waits (a few seconds) and the requests' length (~1-2 s of
decoding at the mock engine's ~5 ms steps).
"""

from __future__ import annotations

from typing import Any

import pytest

from components.protocol.messages import GenerateRequest
from components.rescheduler.config import ReschedulerConfig
from components.rescheduler.executor import PairResult
from components.rescheduler.loop import Rescheduler
from components.workers.worker import Worker
from tests.integration.test_migration import Stream, clients, gen_request, start_worker, unmoved
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def config(*policies: str, **over: Any) -> ReschedulerConfig:
    return ReschedulerConfig(
        enable_rescheduling=True,
        rescheduling_interval_ms=50,
        rescheduling_policies=list(policies),
        rescheduling_migrate_timeout_s=10.0,
        **over,
    )


async def start_streams(crt: Any, namespace: str, src: Worker, requests: list[GenerateRequest]) -> list[Stream]:
    gen, _, _ = await clients(crt, namespace)
    await gen.wait_for_instances(2, timeout_s=5)
    streams = [Stream(await gen.direct(r.to_dict(), src.instance_id)) for r in requests]
    # Every request is decoding on the source before anything may move it.
    await wait_until(lambda: all(len(s.tokens) >= 2 for s in streams), timeout_s=10)
    return streams


def committed_pairs(r: Rescheduler, policy: str) -> list[PairResult]:
    """The pairs of ``policy`` that committed something, over the cycles the loop keeps (``history``)."""
    return [p for cycle in r.history for p in cycle.results if p.order.policy == policy and p.num_committed]


async def test_a_draining_worker_is_emptied_by_failover_and_every_stream_completes_unchanged(
    make_runtime, namespace
) -> None:
    a = await start_worker(make_runtime, namespace, 0)
    b = await start_worker(make_runtime, namespace, 1)
    crt = await make_runtime()
    # Three long outputs: 400 tokens at ~5 ms a step is ~2 s each on its own; the drain below would wait for them.
    requests = [gen_request(f"drain-{i}", 64 + 16 * i, 400) for i in range(3)]
    expected = await unmoved(requests)
    r = Rescheduler.from_config(await make_runtime(), namespace, config("neutral_failover"))
    streams = await start_streams(crt, namespace, a, requests)
    await r.start()
    try:
        # Drain: a says it is unschedulable, then waits for its requests; it returns once the rescheduler has moved
        # every one of them off (none was cancelled).
        assert await a.stop() == 0
        for req, s in zip(requests, streams, strict=True):
            assert await s.done(timeout_s=15) == expected[req.request_id]
        moved = committed_pairs(r, "neutral_failover")
        assert moved, r.status()
        assert {(p.order.source_id, p.order.destination_id) for p in moved} == {(a.instance_id, b.instance_id)}
        # Every request moved: the drain ended before any of them had produced its 400 tokens on the source.
        reports = [rep for p in moved for rep in p.reports if rep.state == "committed"]
        assert sorted(rep.request_id for rep in reports) == sorted(q.request_id for q in requests)
        assert all(rep.position < 400 for rep in reports)
        assert "unschedulable" in moved[0].order.reason
    finally:
        await r.stop()
        await b.stop()


async def test_a_stale_worker_is_emptied_and_its_streams_complete_unchanged(make_runtime, namespace) -> None:
    a = await start_worker(make_runtime, namespace, 0)
    b = await start_worker(make_runtime, namespace, 1)
    crt = await make_runtime()
    requests = [gen_request(f"stale-{i}", 48 + 16 * i, 300) for i in range(2)]
    expected = await unmoved(requests)
    # Stale after 0.3 s without a load report (the workers report every 50 ms: 6 reports missed).
    r = Rescheduler.from_config(
        await make_runtime(), namespace, config("neutral_failover", instance_staleness_seconds=0.3)
    )
    streams = await start_streams(crt, namespace, a, requests)
    await r.start()
    try:
        # A worker never heard from is not stale (it may be starting): the rescheduler hears a first.
        await wait_until(lambda: getattr(r.fleet.instance(a.instance_id), "load", None) is not None, timeout_s=5)
        a.load_reports_paused = True  # a hung publisher: a still serves, its reports stop
        for req, s in zip(requests, streams, strict=True):
            assert await s.done(timeout_s=15) == expected[req.request_id]
        moved = committed_pairs(r, "neutral_failover")
        assert moved, r.status()
        assert {(p.order.source_id, p.order.destination_id) for p in moved} == {(a.instance_id, b.instance_id)}
        reports = [rep for p in moved for rep in p.reports if rep.state == "committed"]
        assert sorted(rep.request_id for rep in reports) == sorted(q.request_id for q in requests)
        assert moved[0].order.reason.startswith("stale: last report")
        assert a.engine.snapshot().num_running == 0  # a is empty, still registered
    finally:
        await r.stop()
        for w in (a, b):
            await w.stop()


async def test_an_imbalanced_pair_of_workers_gets_a_load_balancing_migration(make_runtime, namespace) -> None:
    # 256 blocks of 16 tokens: four requests of 400-448 prompt tokens (no prefix in common: gen_request offsets the
    # prompt by the id's length) hold 25-28 blocks each, 106 of 256 = 0.41 of a's KV before their outputs' blocks
    # (0.430 was read when the first pair was chosen, in one run), and b holds none. At a
    # threshold of 0.2 a is a source, b a destination, and the gap (0.41) is above the 0.01 load-balance threshold.
    # Each pair moves one request (num_requests 1).
    engine = {"num_gpu_blocks": 256}
    a = await start_worker(make_runtime, namespace, 0, **engine)
    b = await start_worker(make_runtime, namespace, 1, **engine)
    crt = await make_runtime()
    requests = [gen_request("load-" + "x" * (i + 1), 400 + 16 * i, 300) for i in range(4)]
    expected = await unmoved(requests)
    cfg = config(
        "neutral_load",
        rescheduling_neutral_load_threshold=0.2,
        rescheduling_req_select_rule="num_requests",
        rescheduling_req_select_value=1,
    )
    r = Rescheduler.from_config(await make_runtime(), namespace, cfg)
    streams = await start_streams(crt, namespace, a, requests)
    await r.start()
    try:
        await wait_until(lambda: bool(committed_pairs(r, "neutral_load")), timeout_s=10)
        first = committed_pairs(r, "neutral_load")[0]
        assert (first.order.source_id, first.order.destination_id) == (a.instance_id, b.instance_id)
        assert first.order.reason.startswith("projected KV use")
        first_src, first_dst = (float(x) for x in first.order.reason.split(" (")[0].split("use ")[1].split(" -> "))
        assert first_src >= round(106 / 256, 3) and first_dst == 0.0
        assert [rep.dst_instance_id for rep in first.reports] == [b.instance_id]  # one request, to b
        for req, s in zip(requests, streams, strict=True):
            assert await s.done(timeout_s=15) == expected[req.request_id]
        # Later pairs may go either way (requests end at different times, and each pair moves the fuller worker's
        # shortest request to the emptier one); each names its loads, the source's the higher.
        for p in committed_pairs(r, "neutral_load"):
            src_load, dst_load = (float(x) for x in p.order.reason.split(" (")[0].split("use ")[1].split(" -> "))
            assert src_load - dst_load > cfg.rescheduling_load_balance_threshold, p.order.reason
    finally:
        await r.stop()
        for w in (a, b):
            await w.stop()


async def test_waiting_requests_a_full_worker_cannot_admit_move_to_an_idle_one_and_complete_unchanged(
    make_runtime, namespace
) -> None:
    # waiting_fit on a live pair. 64 blocks of 16 tokens each; six requests of 400-405 prompt tokens (25-26 blocks,
    # no prefix in common) and 40 outputs all go to a: it admits two (~51 blocks, growing to ~56) and four wait
    # (~102 blocks against ~13 free: a backlog of ~89 blocks); b is idle (backlog -64). waiting_fit pairs a -> b with
    # a budget of half the gap (~76 blocks, ~1,200 tokens): the first waiting requests in a's queue move to b
    # with nothing to copy, b queues them by their first arrival and runs them. At a fifth of the modelled speed a
    # request decodes for ~1 s, so the queue lasts many 50 ms cycles.
    engine = {"num_gpu_blocks": 64, "max_model_len": 1024, "speedup_ratio": 0.2}
    a = await start_worker(make_runtime, namespace, 0, **engine)
    b = await start_worker(make_runtime, namespace, 1, **engine)
    crt = await make_runtime()
    requests = [gen_request("wait-" + "x" * (i + 1), 400 + i, 40) for i in range(6)]
    expected = await unmoved(requests)
    r = Rescheduler.from_config(await make_runtime(), namespace, config("waiting_fit"))
    gen, _, _ = await clients(crt, namespace)
    await gen.wait_for_instances(2, timeout_s=5)
    streams = [Stream(await gen.direct(req.to_dict(), a.instance_id)) for req in requests]
    await r.start()
    try:
        await wait_until(lambda: bool(committed_pairs(r, "waiting_fit")), timeout_s=10)
        first = committed_pairs(r, "waiting_fit")[0]
        assert (first.order.source_id, first.order.destination_id) == (a.instance_id, b.instance_id)
        moved = [rep for p in committed_pairs(r, "waiting_fit") for rep in p.reports if rep.state == "committed"]
        assert moved and all(rep.dst_instance_id == b.instance_id for rep in moved), [m.request_id for m in moved]
        for req, s in zip(requests, streams, strict=True):
            assert await s.done(timeout_s=30) == expected[req.request_id]
        # At least one moved before a admitted it: no output yet, no block copied. (One chosen while waiting can be
        # admitted before the agent suspends it; it then moves live, its blocks copied: seen in a run here.)
        waited = [m.request_id for m in moved if m.position == 0 and m.num_blocks_copied == 0]
        assert waited, [(m.request_id, m.position, m.num_blocks_copied) for m in moved]
    finally:
        await r.stop()
        for w in (a, b):
            await w.stop()
