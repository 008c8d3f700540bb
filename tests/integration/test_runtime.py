"""The runtime against real etcd and nats-server processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from components.runtime import (
    ConnectError,
    InstanceGoneError,
    NoInstancesError,
    RemoteHandlerError,
    RuntimeConfig,
    StreamInterruptedError,
    collect,
)
from components.runtime.codec import pack, unpack
from components.runtime.request_plane import ACK, CANCEL, REQ, probe_instance
from components.runtime.runtime import Runtime
from tests.support.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


async def stream_handler(body, ctx):
    for i in range(body.get("n", 1)):
        if body.get("delay_s"):
            await asyncio.sleep(body["delay_s"])
        yield {"i": i}


class ChildServer:
    """tests/support/echo_server.py in its own process, so it can be SIGKILLed."""

    def __init__(self, cfg: RuntimeConfig, namespace: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.echo_server",
                "--etcd",
                cfg.etcd_endpoints[0],
                "--nats",
                cfg.nats_url,
                "--namespace",
                namespace,
                "--lease-ttl-s",
                str(cfg.lease_ttl_s),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )

    async def ready(self) -> int:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 30)
        assert line.startswith("READY "), line
        return int(line.split()[1], 16)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def child_servers(runtime_config, namespace):
    made: list[ChildServer] = []

    def make() -> ChildServer:
        c = ChildServer(runtime_config, namespace)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


async def test_register_watch_deregister(make_runtime, namespace):
    rt = await make_runtime()
    other = await make_runtime()
    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    assert client.instance_ids() == []

    served = [await ep.serve(stream_handler, metadata={"model": "m", "n": i}) for i in range(3)]
    await client.wait_for_instances(3, timeout_s=5)
    assert sorted(client.instance_ids()) == sorted(s.instance_id for s in served)
    assert {i.metadata["n"] for i in client.instances()} == {0, 1, 2}

    await served[1].stop()
    await wait_until(lambda: served[1].instance_id not in client.instance_ids(), 2)
    assert len(client.instance_ids()) == 2

    # Metadata updates are seen by watchers (the planner changes roles this way).
    await served[0].update_metadata(role="decode")
    await wait_until(lambda: client.instance(served[0].instance_id).metadata.get("role") == "decode", 2)

    listed = await other.namespace(namespace).list_instances()
    assert {i.instance_id for i in listed} == {served[0].instance_id, served[2].instance_id}


async def test_graceful_shutdown_revokes_lease_at_once(make_runtime, child_servers, namespace):
    other = await make_runtime(lease_ttl_s=30)
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    child = child_servers()
    iid = await child.ready()
    await client.wait_for_instances(1, timeout_s=5)
    child.proc.send_signal(signal.SIGTERM)
    # Well under the 3 s TTL: the key goes with the revoked lease, not with its expiry.
    took = await wait_until(lambda: iid not in client.instance_ids(), 1.5)
    assert took < 1.5
    assert child.proc.wait(10) == 0


async def test_lease_expiry_after_sigkill_removes_instance_within_ttl(
    make_runtime, child_servers, runtime_config, namespace
):
    other = await make_runtime()
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    child = child_servers()
    iid = await child.ready()
    await client.wait_for_instances(1, timeout_s=5)
    child.kill()
    t0 = time.monotonic()
    await wait_until(lambda: iid not in client.instance_ids(), runtime_config.lease_ttl_s + 2)
    # etcd expires a lease up to ~1 s after its TTL (its expiry check runs every 500 ms); ttl + 1.5 s bounds it.
    assert time.monotonic() - t0 <= runtime_config.lease_ttl_s + 1.5


async def _gone(rt, subject: str) -> bool:
    return await probe_instance(rt.bus, subject, 0.5) is False


async def test_request_to_killed_instance_fails_fast(make_runtime, child_servers, runtime_config, namespace):
    other = await make_runtime()
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    child = child_servers()
    iid = await child.ready()
    await client.wait_for_instances(1, timeout_s=5)
    assert len(await collect(await client.direct({"n": 2}, iid))) == 2

    child.kill()
    # nats-server drops the dead connection's subscriptions when it reads the socket's EOF; on a loaded machine that
    # can lag the kill by a few ms, and a request landing in that window is caught by the 2 s ACK timeout instead
    # (still InstanceGoneError, still far below the TTL). Wait until the server says nobody serves the subject.
    subject = client.instance(iid).subject  # type: ignore[union-attr]
    await wait_until_async(lambda: _gone(other, subject), timeout_s=5)
    # The instance is still listed (its lease has not expired) but a request to it fails at once.
    assert iid in client.instance_ids()
    t0 = time.monotonic()
    with pytest.raises(InstanceGoneError) as exc:
        await client.direct({"n": 2}, iid)
    took = time.monotonic() - t0
    assert exc.value.instance_id == iid
    assert "no responders" in str(exc.value)
    # NATS answers no-responders in about a millisecond; anything near the ack timeout (2 s) or the TTL would fail.
    assert took < 0.5, took


async def test_inflight_stream_from_killed_instance_is_interrupted(make_runtime, child_servers, namespace):
    other = await make_runtime()
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    child = child_servers()
    iid = await child.ready()
    await client.wait_for_instances(1, timeout_s=5)
    stream = await client.direct({"n": 1000, "delay_s": 0.05}, iid)
    got = []
    with pytest.raises(StreamInterruptedError) as exc:
        async for item in stream:
            got.append(item["i"])
            if len(got) == 5:
                child.kill()
    assert got[:5] == [0, 1, 2, 3, 4]
    assert got == list(range(len(got)))  # nothing lost or reordered before the interruption
    assert exc.value.instance_id == iid


async def test_a_killed_instance_s_streams_end_as_soon_as_its_connection_drops(make_runtime, child_servers, namespace):
    """Answers come on a direct connection; the kernel closes a SIGKILLed process's sockets, and the client probes
    that connection's streams at once instead of after idle_probe_s of silence (30 s here)."""
    other = await make_runtime(stream_idle_probe_s=30.0)
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    child = child_servers()
    iid = await child.ready()
    await client.wait_for_instances(1, timeout_s=5)
    stream = await client.direct({"n": 1000, "delay_s": 0.05}, iid)
    got = [(await stream.__anext__())["i"] for _ in range(3)]
    child.kill()
    t0 = time.monotonic()
    with pytest.raises(StreamInterruptedError) as exc:
        async with asyncio.timeout(20):
            async for item in stream:
                got.append(item["i"])
    took = time.monotonic() - t0
    # No responders at once, or no answer within probe_timeout_s (1 s) if NATS had not yet seen the process go.
    assert took < 2.5, took
    assert exc.value.instance_id == iid
    assert got == list(range(len(got)))  # nothing lost or reordered before the interruption


async def test_cancellation_reaches_the_handler(make_runtime, child_servers, namespace):
    other = await make_runtime()
    ns = other.namespace(namespace)
    cancelled = await ns.events.subscribe("handler_cancelled")
    client = await ns.component("backend").endpoint("generate").client()
    child = child_servers()
    iid = await child.ready()
    await client.wait_for_instances(1, timeout_s=5)

    # 1) aclose() on the stream.
    stream = await client.direct({"n": 1000, "delay_s": 0.01}, iid)
    assert (await stream.__anext__())["i"] == 0
    t0 = time.monotonic()
    await stream.aclose()
    ev = await cancelled.get(timeout_s=2)
    took = time.monotonic() - t0
    assert ev.payload["request_id"] == stream.request_id
    # The issue asks for 100 ms; the event itself needs a NATS round trip. 250 ms leaves room for a loaded CI box.
    assert took < 0.25, took

    # 2) Cancelling the task that iterates.
    stream2 = await client.direct({"n": 1000, "delay_s": 0.01}, iid)

    async def consume():
        async for _ in stream2:
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ev = await cancelled.get(timeout_s=2)
    assert ev.payload["request_id"] == stream2.request_id


async def test_handler_error_is_reported_and_instance_keeps_serving(make_runtime, namespace):
    rt = await make_runtime()

    async def handler(body, ctx):
        yield 1
        if body == "boom":
            raise ValueError("bad body")
        yield 2

    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    await ep.serve(handler)
    client = await ep.client()
    await client.wait_for_instances(1)
    stream = await client.generate("boom")
    assert await stream.__anext__() == 1
    with pytest.raises(RemoteHandlerError) as exc:
        await stream.__anext__()
    assert exc.value.error_type == "ValueError" and "bad body" in exc.value.message
    assert await collect(await client.generate("ok")) == [1, 2]


async def test_no_instances_error(make_runtime, namespace):
    rt = await make_runtime()
    client = await rt.namespace(namespace).component("nobody").endpoint("generate").client()
    with pytest.raises(NoInstancesError):
        await client.generate({})
    with pytest.raises(TimeoutError):
        await client.wait_for_instances(1, timeout_s=0.2)


async def test_round_robin_and_random_spread_requests(make_runtime, namespace):
    rt = await make_runtime()
    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    seen: dict[int, int] = {}

    def handler_for(i):
        async def handler(body, ctx):
            seen[i] = seen.get(i, 0) + 1
            yield ctx.instance_id

        return handler

    served = [await ep.serve(handler_for(i)) for i in range(3)]
    rr = await ep.client("round_robin")
    await rr.wait_for_instances(3)
    for _ in range(9):
        await collect(await rr.generate({}))
    assert sorted(seen.values()) == [3, 3, 3]
    rnd = await ep.client("random")
    await rnd.wait_for_instances(3)
    ids = [(await collect(await rnd.generate({})))[0] for _ in range(30)]
    assert set(ids) <= {s.instance_id for s in served}
    assert len(set(ids)) > 1


async def test_drain_finishes_inflight_and_refuses_new(make_runtime, namespace):
    rt = await make_runtime()
    other = await make_runtime()
    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    served = await ep.serve(stream_handler)
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(1)
    streams = [await client.generate({"n": 10, "delay_s": 0.02}) for _ in range(5)]
    stop = asyncio.create_task(served.stop(drain_timeout_s=10))
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert await stop == 0
    assert all([r["i"] for r in res] == list(range(10)) for res in results)


async def test_unreachable_servers_give_clear_errors(runtime_config):
    bad_etcd = runtime_config.model_copy(update={"etcd_endpoints": ["http://127.0.0.1:1"], "connect_timeout_s": 1.0})
    with pytest.raises(ConnectError) as exc:
        await Runtime.connect(bad_etcd)
    assert exc.value.service == "etcd" and "127.0.0.1:1" in str(exc.value)

    bad_nats = runtime_config.model_copy(update={"nats_url": "nats://127.0.0.1:1", "connect_timeout_s": 1.0})
    with pytest.raises(ConnectError) as exc:
        await Runtime.connect(bad_nats)
    assert exc.value.service == "NATS" and "127.0.0.1:1" in str(exc.value)


async def test_etcd_restart_is_survived(make_runtime, etcd_server, namespace):
    rt = await make_runtime()
    other = await make_runtime()
    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    served = await ep.serve(stream_handler)
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(1)

    # 1) A restart that keeps the data: the lease survives, the registration stays.
    etcd_server.stop()
    await asyncio.sleep(1.0)
    etcd_server.start()
    served2 = await ep.serve(stream_handler)  # a registration made after the restart is seen by the old watch
    await client.wait_for_instances(2, timeout_s=10)
    assert set(client.instance_ids()) == {served.instance_id, served2.instance_id}

    # 2) A restart that loses the data: the lease is re-acquired, every registration restored without a restart.
    etcd_server.stop()
    etcd_server.wipe()
    etcd_server.start()
    await wait_until(lambda: rt.discovery.lease_reacquisitions(rt.primary_lease) >= 1, 10)
    fresh = await make_runtime()
    listed = await fresh.namespace(namespace).list_instances()
    assert {i.instance_id for i in listed} == {served.instance_id, served2.instance_id}
    await wait_until(lambda: set(client.instance_ids()) == {served.instance_id, served2.instance_id}, 10)
    assert [x["i"] for x in await collect(await client.generate({"n": 3}))] == [0, 1, 2]


async def test_nats_restart_is_survived(make_runtime, nats_server, namespace):
    rt = await make_runtime()
    other = await make_runtime()
    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    await ep.serve(stream_handler)
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(1)
    assert len(await collect(await client.generate({"n": 3}))) == 3

    nats_server.stop()
    await asyncio.sleep(0.5)
    nats_server.start()
    await wait_until(lambda: rt.bus.is_connected and other.bus.is_connected, 10)

    async def call():
        return await collect(await client.generate({"n": 3}))

    # Re-subscription after reconnect races with the first request; a request that finds no responder yet fails
    # fast with InstanceGoneError, so retry for a bounded while.
    deadline = time.monotonic() + 10
    while True:
        try:
            got = await call()
            break
        except InstanceGoneError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    assert [x["i"] for x in got] == [0, 1, 2]


async def test_a_request_and_its_cancel_read_together_leave_nothing_in_flight(make_runtime, namespace):
    """Regression (issue 28: after an external nats-server's restart under load, ``kvmesh stop`` took 76 s against
    its 30 s bound while every worker reported nothing running). While nats-server is away, nats-py keeps what a
    client publishes and sends it all in one write once it is back: a REQ whose ACK did not come within
    ``request_ack_timeout_s`` and the CANCEL that followed it then reach the instance together. Read in one go, the
    CANCEL cancelled the handler's task before it had run a line, so the cleanup in its ``finally`` never ran: the
    request stayed in flight for good and the worker's drain waited out its 60 s for it. Here the two are sent the
    same way (one write, nothing awaited between them) with nats-server up, so the test does not depend on which
    process reconnects first after a restart."""
    rt = await make_runtime()
    other = await make_runtime()
    served = await rt.namespace(namespace).component("backend").endpoint("generate").serve(stream_handler)
    acks: list[str] = []
    inbox = other.bus.new_inbox()

    async def on_reply(msg: Any) -> None:
        if not msg.data:  # a status message (no responders): not the instance's
            return
        seq, kind, _ = unpack(msg.data)
        if seq == 0 and kind == ACK:
            acks.append(msg.subject)

    await other.bus.subscribe(inbox, on_reply)
    await other.bus.flush()
    num = 5
    for i in range(num):
        rid = f"together-{i}"
        # A request that would stream for 10 s were it not cancelled; no await yields between the two publishes.
        await other.bus.publish(served.info.subject, pack([REQ, rid, {"n": 1000, "delay_s": 0.01}]), reply=inbox)
        await other.bus.publish(served.info.subject, pack([CANCEL, rid]))
    await wait_until(lambda: len(acks) == num)  # every REQ reached the instance (it ACKs before starting one)
    await wait_until(lambda: served.server.num_inflight == 0, timeout_s=2)
    t0 = time.monotonic()
    assert await served.stop(drain_timeout_s=30) == 0  # nothing left to wait for or cancel
    assert time.monotonic() - t0 < 5


async def test_event_plane_typed_and_ordered(make_runtime, namespace):
    rt = await make_runtime()
    other = await make_runtime()
    sub = await other.namespace(namespace).events.subscribe("load", decode=lambda d: (d["seq"], d["kv"]))
    await other.bus.flush()
    # Core NATS delivers only to live subscriptions, and flush() alone did not always make it live for another
    # connection's publishes: in 150 tries of this sequence, 1-2 lost the first events (one try lost the first
    # 98), at this commit and before this session's changes alike. Wait until a marker gets through.
    for _ in range(100):
        await rt.namespace(namespace).events.publish("load", {"seq": -1, "kv": 0.0}, source_id=7)
        with contextlib.suppress(TimeoutError):
            await sub.get(timeout_s=0.05)
            break
    else:
        raise AssertionError("the event subscription never received anything")
    while True:  # markers still in flight
        with contextlib.suppress(TimeoutError):
            if (await sub.get(timeout_s=0.1)).payload[0] == -1:
                continue
            raise AssertionError("an event other than a marker arrived before any was sent")
        break
    for i in range(200):
        await rt.namespace(namespace).events.publish("load", {"seq": i, "kv": i / 200}, source_id=7)
    got = [await sub.get(timeout_s=5) for _ in range(200)]
    assert [e.payload[0] for e in got] == list(range(200))
    assert {e.source_id for e in got} == {7}
    # Another namespace sees nothing.
    other_ns = await other.namespace(namespace + "u").events.subscribe("load")
    await rt.namespace(namespace).events.publish("load", {"seq": 0, "kv": 0})
    with pytest.raises(TimeoutError):
        await other_ns.get(timeout_s=0.2)


async def test_jetstream_work_queue(make_runtime, namespace):
    rt = await make_runtime()
    other = await make_runtime()
    q1 = await rt.namespace(namespace).work_queue("prefill")
    q2 = await other.namespace(namespace).work_queue("prefill")
    for i in range(10):
        await q1.push(str(i).encode())
    assert await q1.size() == 10
    got = []
    for q in (q1, q2) * 5:
        item = await q.pop(timeout_s=5)
        assert item is not None
        assert item.delivered == 1
        got.append(int(item.data))
        await item.ack()
    assert sorted(got) == list(range(10))  # each item delivered to exactly one consumer
    assert await q2.pop(timeout_s=0.2) is None
    assert await q1.size() == 0  # acks are confirmed: once ack() returns, the item is gone
    # An item that is nak'ed comes back, one delivery later, with the time it was pushed.
    await q1.push(b"again")
    item = await q2.pop(timeout_s=5)
    assert item is not None
    await item.nak()
    again = await q1.pop(timeout_s=5)
    assert again is not None and again.data == b"again"
    assert (again.delivered, again.enqueued_s) == (2, item.enqueued_s)
    await again.ack()
    stats = await q1.stats()
    assert (stats.waiting, stats.in_flight) == (0, 0)


@pytest.mark.slow
async def test_thousand_concurrent_streams_in_order(make_runtime, namespace):
    rt = await make_runtime()
    other = await make_runtime()
    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    for _ in range(2):
        await ep.serve(stream_handler)
    client = await other.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(2)
    n_chunks = 20

    async def one():
        return [x["i"] for x in await collect(await client.generate({"n": n_chunks}))]

    results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(1000))), 120)
    assert len(results) == 1000
    assert all(r == list(range(n_chunks)) for r in results)


async def test_closing_a_client_right_after_creating_it_never_hangs(make_runtime, namespace):
    """Regression: a cancel delivered while aetcd sets up the watch could be lost (3.11's wait_for), and close()
    waited on the watch task forever. Each close must return promptly, however early it comes."""
    rt = await make_runtime()
    ep = rt.namespace(namespace).component("backend").endpoint("generate")
    for i in range(40):
        client = await ep.client()
        if i % 2:
            await asyncio.sleep(0)  # vary where in the watch set-up the cancel lands
        await asyncio.wait_for(client.close(), 5)
    assert rt._clients == []


async def test_shutdown_leaves_a_closing_step_that_never_answers_behind_and_says_which(make_runtime, caplog):
    """A peer that stops answering mid-shutdown must not hold the process: each closing step is bounded and named
    (a CI run's test teardown hung in ``Runtime.shutdown`` for more than 120 s)."""
    import logging

    rt = await make_runtime()
    real_close = rt.discovery.close

    async def never_answers(**_: object) -> None:
        await asyncio.Event().wait()

    rt.discovery.close = never_answers  # type: ignore[method-assign]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="components.runtime.runtime"):
        await rt.shutdown(drain_timeout_s=0.5, step_timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert "closing discovery: no answer within 0.3 s, left behind" in caplog.text
    assert not rt.bus.is_connected  # the steps after it still ran
    await real_close(revoke=True)
