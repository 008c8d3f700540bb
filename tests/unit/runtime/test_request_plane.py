"""The request plane and the client over the in-memory twins (components.runtime.request_plane, runtime.Client).

Every runtime here is built with ``Runtime.from_parts`` on one shared MemoryStore and one shared MemoryBus, so a
"server" runtime and a "client" runtime talk exactly as two processes would, minus the sockets; responses go over
that bus too, except in the tests of the direct response connections (real loopback TCP). Frames are spied on
with a plain ``_INBOX.>`` subscription (the memory bus delivers to every matching subscriber) and injected by
publishing straight to a stream's inbox.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator

import pytest

from components.runtime import (
    InstanceDrainingError,
    InstanceGoneError,
    NoInstancesError,
    RecoverableError,
    RemoteHandlerError,
    StreamInterruptedError,
    collect,
)
from components.runtime.bus import BusMessage
from components.runtime.codec import pack, unpack
from components.runtime.request_plane import ACK, CANCEL, DATA, END, ERROR, PROBE, PROBE_ACK, REQ, RequestContext
from tests.support.mesh import Mesh
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

# Fast failure detection for the tests that need it; 20 ms idle probe, 100 ms probe answer, 100 ms ack.
FAST = {"stream_idle_probe_s": 0.02, "probe_timeout_s": 0.1, "request_ack_timeout_s": 0.1}


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    m = Mesh()
    yield m
    await m.shutdown()


class Frames:
    """Every frame published to any inbox or to one instance subject, decoded; a batch (``<prefix>.b``) counts as
    its frames, each filed under its stream's inbox (``<prefix>.<key>``)."""

    def __init__(self) -> None:
        self.msgs: list[tuple[str, list]] = []
        self.batches = 0

    async def __call__(self, msg: BusMessage) -> None:
        if not msg.data:
            return
        if msg.subject.endswith(".b"):
            self.batches += 1
            prefix = msg.subject[:-2]
            for key, *frame in unpack(msg.data):
                self.msgs.append((f"{prefix}.{key}", frame))
        else:
            self.msgs.append((msg.subject, unpack(msg.data)))

    def kinds(self, subject: str | None = None) -> list[list]:
        return [f for s, f in self.msgs if subject is None or s == subject]


class Probe:
    """A handler that records how it ended, released step by step through ``go``."""

    def __init__(self, n: int = 1_000_000, gated: bool = False, delay_s: float = 0.0) -> None:
        self.n = n
        self.gated = gated
        self.delay_s = delay_s
        self.go = asyncio.Event()
        self.started: list[RequestContext] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []

    async def __call__(self, body, ctx: RequestContext):
        self.started.append(ctx)
        try:
            for i in range(body.get("n", self.n) if isinstance(body, dict) else self.n):
                if self.gated:
                    await self.go.wait()
                await asyncio.sleep(self.delay_s)
                yield i
            self.finished.append(ctx.request_id)
        except asyncio.CancelledError:
            self.cancelled.append(ctx.request_id)
            raise


async def serve_and_connect(mesh: Mesh, handler, n: int = 1, mode: str = "round_robin", **config: object):
    """``n`` instances served by one runtime, and a client in another runtime that already sees them all."""
    server_rt = await mesh.runtime(**config)
    client_rt = await mesh.runtime(**config)
    ep = server_rt.namespace("t").component("backend").endpoint("generate")
    served = [await ep.serve(handler) for _ in range(n)]
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client(mode)
    await client.wait_for_instances(n, timeout_s=1.0)
    return served, client


# -- streaming ------------------------------------------------------------------------------------------------------


async def test_items_stream_in_order_with_sequence_numbers_then_end(mesh):
    spy = Frames()
    await mesh.bus.subscribe("_INBOX.>", spy)

    async def handler(body, ctx):
        for i in range(body["n"]):
            yield {"i": i, "req": ctx.request_id}

    [served], client = await serve_and_connect(mesh, handler)
    stream = await client.generate({"n": 50}, request_id="req-1")
    assert stream.request_id == "req-1" and stream.instance_id == served.instance_id
    items = await collect(stream)
    assert [x["i"] for x in items] == list(range(50))
    assert {x["req"] for x in items} == {"req-1"}
    assert stream.done
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()

    # On the wire: ACK as frame 0, DATA 1..50, END as 51. Nothing else.
    await wait_until(lambda: len(spy.msgs) == 52)
    frames = spy.kinds()
    assert [f[0] for f in frames] == list(range(52))
    assert [f[1] for f in frames] == [ACK] + [DATA] * 50 + [END]


async def test_empty_stream_ends_without_items(mesh):
    async def handler(body, ctx):
        return
        yield

    _, client = await serve_and_connect(mesh, handler)
    assert await collect(await client.generate({})) == []


async def test_handler_sees_its_request_and_instance(mesh):
    probe = Probe(n=1)
    [served], client = await serve_and_connect(mesh, probe)
    await collect(await client.generate({"n": 1}, request_id="abc"))
    assert probe.started == [RequestContext("abc", served.instance_id)]
    assert probe.finished == ["abc"]
    assert served.server.num_served == 1 and served.server.num_inflight == 0


async def test_concurrent_streams_do_not_mix(mesh):
    async def handler(body, ctx):
        for i in range(20):
            await asyncio.sleep(0)
            yield (body, i)

    _, client = await serve_and_connect(mesh, handler, n=2)
    streams = [await client.generate(k) for k in range(10)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert results == [[[k, i] for i in range(20)] for k in range(10)]


async def test_frames_of_one_round_travel_as_one_message_per_client(mesh):
    """An engine step wakes every stream's handler at once: their frames leave as one batch per client runtime."""
    spy = Frames()
    await mesh.bus.subscribe("_INBOX.>", spy)
    steps = [asyncio.Event() for _ in range(3)]

    async def handler(body, ctx):
        for i in range(3):
            await steps[i].wait()  # one engine step: every stream gets its item in the same round
            yield [body, i]

    [served], client = await serve_and_connect(mesh, handler)
    other = await (await mesh.runtime()).namespace("t").component("backend").endpoint("generate").client()
    await other.wait_for_instances(1, timeout_s=1.0)
    streams = [await client.generate(k) for k in range(8)] + [await other.generate(k) for k in range(8, 12)]
    await wait_until(lambda: len(spy.msgs) == 12)  # the ACKs
    acks_batches = spy.batches
    spy.batches = 0
    results = [asyncio.ensure_future(collect(st)) for st in streams]
    for i, step in enumerate(steps):
        step.set()
        await wait_until(lambda i=i: len(spy.msgs) == 12 * (2 + i) + (12 if i == 2 else 0))
    assert [await r for r in results] == [[[k, i] for i in range(3)] for k in range(12)]
    # 12 streams x (3 DATA + END) = 48 frames in one message per step per client: 3 steps (the last one's END
    # goes with its item) for 2 clients. Unbatched, this would have been 48 messages.
    assert spy.batches == 3 * 2, spy.batches
    assert acks_batches <= 12
    assert served.server._outbox.num_messages == acks_batches + spy.batches
    for st in streams:
        frames = spy.kinds(st._inbox)
        assert [f[0] for f in frames] == [0, 1, 2, 3, 4]
        assert [f[1] for f in frames] == [ACK, DATA, DATA, DATA, END]


async def test_a_client_that_does_not_batch_gets_one_message_per_frame(mesh):
    """A request without a batch subject (an older client) is answered frame by frame on its reply inbox."""

    async def handler(body, ctx):
        for i in range(body["n"]):
            yield i

    [served], _ = await serve_and_connect(mesh, handler)
    got = Frames()
    inbox = mesh.bus.new_inbox()
    await mesh.bus.subscribe(inbox, got)
    await mesh.bus.publish(served.info.subject, pack([REQ, "old-1", {"n": 3}]), reply=inbox)
    await wait_until(lambda: len(got.msgs) == 5)
    assert got.batches == 0
    assert got.kinds(inbox) == [[0, ACK, None], [1, DATA, 0], [2, DATA, 1], [3, DATA, 2], [4, END, None]]
    await mesh.bus.publish(served.info.subject, pack([PROBE, "old-1"]), reply=inbox)
    await wait_until(lambda: len(got.msgs) == 6)
    assert got.kinds(inbox)[-1] == [-1, PROBE_ACK, False]


async def test_a_probe_answer_never_overtakes_the_frames_before_it(mesh):
    """The last item, END and a probe answered just after END all leave in one batch, in that order: the client
    reads the whole stream, never 'no longer serves'."""
    probe = Probe(n=2, gated=True)
    [served], client = await serve_and_connect(mesh, probe, **FAST)
    stream = await client.generate({})
    probe.go.set()
    # Ask while the handler's last frames may still sit in the outbox (no await between the two).
    await mesh.bus.publish(
        served.info.subject,
        pack([PROBE, stream.request_id, client.runtime.mux.batch_subject, stream._key]),
        reply=stream._inbox,
    )
    assert await collect(stream) == [0, 1]


async def test_a_malformed_frame_on_a_stream_inbox_interrupts_it(mesh):
    probe = Probe(gated=True)
    _, client = await serve_and_connect(mesh, probe)
    stream = await client.generate({})
    await mesh.bus.publish(stream._inbox, b"\xc1not msgpack")
    with pytest.raises(StreamInterruptedError, match="expected frame 1, got -2"):
        await stream.__anext__()
    await wait_until(lambda: probe.cancelled == [stream.request_id])


# -- direct response connections (response_transport "tcp") ---------------------------------------------------------


async def test_with_tcp_responses_every_batch_takes_the_direct_connection(mesh):
    spy = Frames()
    await mesh.bus.subscribe("_INBOX.>", spy)

    async def handler(body, ctx):
        for i in range(20):
            await asyncio.sleep(0)
            yield [body, i]

    [served], client = await serve_and_connect(mesh, handler, response_transport="tcp")
    assert client.runtime.mux.response_address.startswith("127.0.0.1:")
    streams = [await client.generate(k) for k in range(6)]
    assert await asyncio.gather(*(collect(st) for st in streams)) == [[[k, i] for i in range(20)] for k in range(6)]
    outbox = served.server._outbox
    assert outbox.num_direct > 0 and outbox.num_messages == 0
    assert spy.msgs == []  # nothing of the answers crossed the bus


async def test_an_unreachable_response_address_falls_back_to_the_bus(mesh, caplog):
    async def handler(body, ctx):
        for i in range(5):
            yield i

    [served], client = await serve_and_connect(mesh, handler, response_transport="tcp")
    await client.runtime.mux._listener.close()  # still named in requests, but nothing listens there any more
    with caplog.at_level("WARNING"):
        assert await collect(await client.generate({})) == [0, 1, 2, 3, 4]
        assert await collect(await client.generate({})) == [0, 1, 2, 3, 4]
    outbox = served.server._outbox
    assert outbox.num_direct == 0 and outbox.num_messages >= 2
    assert "answering over the bus" in caplog.text


async def test_a_connection_lost_mid_stream_is_replaced_by_the_bus(mesh):
    probe = Probe(n=4, gated=True)
    [served], client = await serve_and_connect(mesh, probe, response_transport="tcp")
    stream = await client.generate({})
    outbox = served.server._outbox
    await wait_until(lambda: len(outbox._conns._conns) == 1)
    await client.runtime.mux._listener.close()  # the client side drops every connection and stops listening
    await wait_until(lambda: not outbox._conns._conns)  # the instance saw it go
    probe.go.set()
    assert await collect(stream) == [0, 1, 2, 3]
    assert outbox.num_messages >= 1


async def test_a_lost_connection_is_probed_again_until_the_bus_knows_the_instance_is_gone(mesh):
    """Regression (bench migration, a SIGKILLed worker): the probe sent when the connection closed reached
    nats-server before it noticed the process's NATS connection close, waited out the whole probe timeout on a
    subscription nobody read, and the death was seen 1 s late. Probes now repeat until one is answered."""
    probe = Probe(gated=True)
    [served], client = await serve_and_connect(mesh, probe, response_transport="tcp", probe_timeout_s=5.0)
    stream = await client.generate({})
    outbox = served.server._outbox
    await wait_until(lambda: len(outbox._conns._conns) == 1)
    # The "killed" instance: its subject swallows messages for a moment (nats-server has not noticed yet) ...
    await served.server._sub.unsubscribe()
    swallowed: list[object] = []

    async def black_hole(msg):
        swallowed.append(msg)

    hole = await mesh.bus.subscribe(served.info.subject, black_hole)
    reading = asyncio.ensure_future(stream.__anext__())
    await outbox._conns.close()  # ... and its connection closes (the kernel closes a dead process's sockets)
    await wait_until(lambda: len(swallowed) >= 1)
    t0 = time.monotonic()
    await hole.unsubscribe()  # nats-server noticed: no responders from now on
    with pytest.raises(StreamInterruptedError, match="no responders"):
        await asyncio.wait_for(reading, 2.0)
    assert time.monotonic() - t0 < 1.0  # a repeated probe, not the 5 s probe timeout
    assert len(swallowed) >= 1


async def test_garbage_on_the_response_listener_drops_only_that_connection(mesh):
    probe = Probe(n=3)
    [served], client = await serve_and_connect(mesh, probe, response_transport="tcp")
    host, port = client.runtime.mux.response_address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\xc1\xc1\xc1 not msgpack")
    await writer.drain()
    assert await reader.read() == b""  # closed by the listener
    writer.close()
    assert await collect(await client.generate({})) == [0, 1, 2]
    assert served.server._outbox.num_direct > 0


async def test_handler_error_becomes_remote_handler_error_and_the_instance_keeps_serving(mesh):
    async def handler(body, ctx):
        yield 1
        if body == "boom":
            raise KeyError("no such adapter")
        yield 2

    [served], client = await serve_and_connect(mesh, handler)
    stream = await client.generate("boom")
    assert await stream.__anext__() == 1
    with pytest.raises(RemoteHandlerError) as exc:
        await stream.__anext__()
    assert exc.value.error_type == "KeyError"
    assert "no such adapter" in exc.value.message
    assert exc.value.instance_id == served.instance_id
    assert isinstance(exc.value, RecoverableError)
    assert stream.done
    with pytest.raises(StopAsyncIteration):  # the error ended the stream
        await stream.__anext__()
    assert await collect(await client.generate("ok")) == [1, 2]
    assert served.server.num_inflight == 0


async def test_handler_error_before_any_item(mesh):
    async def handler(body, ctx):
        raise ValueError("bad prompt")
        yield

    _, client = await serve_and_connect(mesh, handler)
    with pytest.raises(RemoteHandlerError) as exc:
        await collect(await client.generate({}))
    assert (exc.value.error_type, exc.value.message) == ("ValueError", "bad prompt")


# -- instances that are not there ----------------------------------------------------------------------------------


async def test_request_to_a_subject_nobody_serves_fails_at_once(mesh):
    rt = await mesh.runtime()  # default ack timeout of 2 s: no-responders must not wait for it
    client = await rt.namespace("t").component("backend").endpoint("generate").client()
    t0 = time.monotonic()
    with pytest.raises(InstanceGoneError) as exc:
        await client.generate({}, instance_id=0xABC)
    assert time.monotonic() - t0 < 0.5
    assert exc.value.instance_id == 0xABC
    assert "no responders" in exc.value.reason
    assert rt.mux._queues == {}  # the inbox was released


async def test_registered_instance_whose_subscription_is_gone_fails_at_once(mesh):
    [served], client = await serve_and_connect(mesh, Probe(n=1))
    await served.server.stop()  # unsubscribed, but its key is still in discovery (a crash before the lease expires)
    assert client.instance_ids() == [served.instance_id]
    t0 = time.monotonic()
    with pytest.raises(InstanceGoneError):
        await client.generate({})
    assert time.monotonic() - t0 < 0.5


async def test_no_acknowledgement_is_instance_gone_and_the_request_is_cancelled(mesh):
    rt = await mesh.runtime(request_ack_timeout_s=0.05)
    ep = rt.namespace("t").component("backend").endpoint("generate")
    hung = Frames()
    subject = ep._subject(0x77)
    await mesh.bus.subscribe(subject, hung)  # subscribed (so no no-responders) but never answers: a hung process
    client = await ep.client()
    with pytest.raises(InstanceGoneError) as exc:
        await client.generate({"x": 1}, instance_id=0x77, request_id="r9")
    assert "no acknowledgement within 0.05 s" in exc.value.reason
    await wait_until(lambda: len(hung.msgs) == 2)
    # The request names the client's batch subject and the stream's key, so answers could come batched.
    # ("" for the response address: this runtime takes its answers over the bus.)
    assert hung.kinds() == [[REQ, "r9", {"x": 1}, rt.mux.batch_subject, 0, ""], [CANCEL, "r9"]]


async def test_no_instances_error_and_wait_for_instances_timeout(mesh):
    rt = await mesh.runtime()
    client = await rt.namespace("t").component("nobody").endpoint("generate").client()
    with pytest.raises(NoInstancesError) as exc:
        await client.generate({})
    assert exc.value.endpoint_path == "t/nobody/generate"
    with pytest.raises(NoInstancesError):
        await client.round_robin({})
    with pytest.raises(NoInstancesError):
        await client.random({})
    with pytest.raises(TimeoutError):
        await client.wait_for_instances(1, timeout_s=0.05)


async def test_direct_mode_needs_an_instance_id(mesh):
    [served], client = await serve_and_connect(mesh, Probe(n=2), mode="direct")
    with pytest.raises(ValueError, match="instance_id"):
        await client.generate({})
    assert await collect(await client.generate({}, instance_id=served.instance_id)) == [0, 1]
    assert await collect(await client.direct({}, served.instance_id)) == [0, 1]


# -- draining and cancellation --------------------------------------------------------------------------------------


async def test_draining_instance_refuses_new_requests_and_finishes_inflight_ones(mesh):
    probe = Probe(n=3, gated=True)
    [served], client = await serve_and_connect(mesh, probe)
    iid = served.instance_id
    streams = [await client.generate({}) for _ in range(3)]
    stop = asyncio.create_task(served.stop(drain_timeout_s=5.0))
    await wait_until(lambda: served.server.draining)

    with pytest.raises(InstanceDrainingError) as exc:
        await client.generate({}, instance_id=iid)
    assert exc.value.instance_id == iid
    await wait_until(lambda: client.instance_ids() == [])  # deregistered first: routing stops picking it
    with pytest.raises(NoInstancesError):
        await client.generate({})

    probe.go.set()
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert results == [[0, 1, 2]] * 3
    assert await stop == 0  # nothing had to be cancelled
    assert probe.cancelled == [] and len(probe.finished) == 3
    with pytest.raises(InstanceGoneError):  # and once stopped it is gone
        await client.generate({}, instance_id=iid)


async def test_drain_timeout_cancels_what_is_left(mesh):
    probe = Probe(gated=True)
    [served], client = await serve_and_connect(mesh, probe, **FAST)
    stream = await client.generate({})
    assert await served.stop(drain_timeout_s=0.05) == 1
    assert probe.cancelled == [stream.request_id]
    with pytest.raises(StreamInterruptedError):  # the client is told, through the idle probe
        await collect(stream)


async def test_aclose_cancels_the_handler(mesh):
    probe = Probe(delay_s=0.001)
    spy = Frames()
    [served], client = await serve_and_connect(mesh, probe)
    await mesh.bus.subscribe(served.info.subject, spy)
    stream = await client.generate({})
    assert await stream.__anext__() == 0
    await stream.aclose()
    assert stream.done
    await wait_until(lambda: probe.cancelled == [stream.request_id])
    assert served.server.num_inflight == 0
    assert [CANCEL, stream.request_id] in spy.kinds()
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    await stream.aclose()  # idempotent


async def test_async_with_cancels_on_early_exit(mesh):
    probe = Probe(delay_s=0.001)
    _, client = await serve_and_connect(mesh, probe)
    async with await client.generate({}) as stream:
        async for i in stream:
            if i == 3:
                break
    await wait_until(lambda: probe.cancelled == [stream.request_id])


async def test_cancelling_the_consuming_task_sends_cancel(mesh):
    probe = Probe(delay_s=0.001)
    spy = Frames()
    [served], client = await serve_and_connect(mesh, probe)
    await mesh.bus.subscribe(served.info.subject, spy)
    stream = await client.generate({})
    got: list[int] = []

    async def consume() -> None:
        async for i in stream:
            got.append(i)

    task = asyncio.create_task(consume())
    await wait_until(lambda: len(got) >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.done
    await wait_until(lambda: probe.cancelled == [stream.request_id])
    assert [CANCEL, stream.request_id] in spy.kinds()
    assert got == list(range(len(got)))


async def test_dropping_an_unfinished_stream_cancels_it(mesh):
    probe = Probe(delay_s=0.001)
    _, client = await serve_and_connect(mesh, probe)
    stream = await client.generate({})
    rid = stream.request_id
    assert await stream.__anext__() == 0
    del stream
    gc.collect()
    await wait_until(lambda: probe.cancelled == [rid])


async def test_cancel_for_an_unknown_request_is_ignored(mesh):
    probe = Probe(n=3)
    [served], client = await serve_and_connect(mesh, probe)
    await mesh.bus.publish(served.info.subject, pack([CANCEL, "never-sent"]))
    await mesh.bus.publish(served.info.subject, b"\xc1 not msgpack")  # malformed: logged, subscription survives
    assert await collect(await client.generate({})) == [0, 1, 2]


# -- interruption ---------------------------------------------------------------------------------------------------


async def test_server_vanishing_mid_stream_is_detected_by_the_idle_probe(mesh):
    probe = Probe(delay_s=0.001)
    [served], client = await serve_and_connect(mesh, probe, **FAST)
    stream = await client.generate({})
    got = [await stream.__anext__() for _ in range(5)]
    await served.server.stop()  # handler cancelled, subscription gone, no END sent: as a SIGKILL looks from outside
    t0 = time.monotonic()
    with pytest.raises(StreamInterruptedError) as exc:
        async for i in stream:
            got.append(i)
    took = time.monotonic() - t0
    # Idle probe after 20 ms, no responders at once, then 50 ms grace for frames in flight: ~70 ms; 1 s is slack.
    assert took < 1.0, took
    assert got == list(range(len(got))) and len(got) >= 5
    assert exc.value.instance_id == served.instance_id
    assert exc.value.request_id == stream.request_id
    assert exc.value.num_frames == len(got)
    assert stream.done


async def test_instance_that_forgot_the_request_is_detected_by_the_idle_probe(mesh):
    """Alive but not serving the request (its handler ended without END reaching us): the probe answers False."""
    probe = Probe(gated=True)
    [served], client = await serve_and_connect(mesh, probe, **FAST)
    stream = await client.generate({})
    # Cancel on the instance behind the client's back: the handler stops and sends nothing.
    await mesh.bus.publish(served.info.subject, pack([CANCEL, stream.request_id]))
    await wait_until(lambda: probe.cancelled == [stream.request_id])
    assert await mesh.bus.request(served.info.subject, pack([PROBE, stream.request_id]), 1.0) == pack(
        [-1, PROBE_ACK, False]
    )
    with pytest.raises(StreamInterruptedError, match="no longer serves"):
        await stream.__anext__()


async def test_slow_but_alive_handler_is_not_interrupted(mesh):
    # Items 60 ms apart with a 20 ms idle probe: about three probes per item, each answered "alive".
    probe = Probe(n=4, delay_s=0.06)
    spy = Frames()
    [served], client = await serve_and_connect(mesh, probe, **FAST)
    await mesh.bus.subscribe(served.info.subject, spy)
    assert await collect(await client.generate({})) == [0, 1, 2, 3]
    assert sum(1 for f in spy.kinds() if f[0] == PROBE) >= 3


async def test_a_frame_from_the_past_interrupts_the_stream_and_cancels_the_request(mesh):
    probe = Probe(gated=True)
    _, client = await serve_and_connect(mesh, probe)
    stream = await client.generate({})
    await mesh.bus.publish(stream._inbox, pack([0, DATA, "injected"]))
    with pytest.raises(StreamInterruptedError) as exc:
        await stream.__anext__()
    assert "expected frame 1, got 0" in exc.value.reason
    assert exc.value.num_frames == 0
    assert stream.done
    await wait_until(lambda: probe.cancelled == [stream.request_id])


@pytest.mark.parametrize("bad_seq", [2, 7])
async def test_a_missing_frame_is_declared_lost_once_the_instance_answers_a_probe(mesh, bad_seq):
    """Frames ahead of their turn are held (a hand-over's two instances race, test_stream_handover.py); the one
    missing is lost once the instance that owes it answers a probe, since its answer travels behind its frames."""
    probe = Probe(gated=True)
    _, client = await serve_and_connect(mesh, probe, **FAST)
    stream = await client.generate({})
    await mesh.bus.publish(stream._inbox, pack([bad_seq, DATA, "injected"]))
    with pytest.raises(StreamInterruptedError) as exc:
        await stream.__anext__()
    assert "frame 1 lost (1 later ones arrived)" in exc.value.reason
    assert exc.value.num_frames == 0
    assert stream.done
    await wait_until(lambda: probe.cancelled == [stream.request_id])


async def test_duplicate_frame_mid_stream_interrupts(mesh):
    probe = Probe(gated=True)
    _, client = await serve_and_connect(mesh, probe)
    stream = await client.generate({})
    await mesh.bus.publish(stream._inbox, pack([1, DATA, "a"]))
    assert await stream.__anext__() == "a"
    await mesh.bus.publish(stream._inbox, pack([1, DATA, "a again"]))
    with pytest.raises(StreamInterruptedError, match="expected frame 2, got 1"):
        await stream.__anext__()


async def test_unknown_frame_kind_interrupts_and_cancels_the_request(mesh):
    """Regression: an unknown frame kind ended the stream on the client but sent no CANCEL, so the handler kept
    generating on the instance into an inbox nobody read."""
    probe = Probe(gated=True)
    _, client = await serve_and_connect(mesh, probe)
    stream = await client.generate({})
    await mesh.bus.publish(stream._inbox, pack([1, 42, None]))
    with pytest.raises(StreamInterruptedError, match="unexpected frame kind 42"):
        await stream.__anext__()
    assert stream.done
    await wait_until(lambda: probe.cancelled == [stream.request_id])


async def test_error_frame_payload_reaches_the_caller(mesh):
    probe = Probe(n=1, gated=True)
    _, client = await serve_and_connect(mesh, probe)
    stream = await client.generate({})
    await mesh.bus.publish(stream._inbox, pack([1, ERROR, {"type": "EngineDeadError", "message": "cuda"}]))
    with pytest.raises(RemoteHandlerError) as exc:
        await stream.__anext__()
    assert (exc.value.error_type, exc.value.message) == ("EngineDeadError", "cuda")
    assert stream.done
    # An ERROR frame means the handler is over: the client sends no CANCEL (here the handler finishes on its own).
    probe.go.set()
    await wait_until(lambda: probe.finished == [stream.request_id])
    assert probe.cancelled == []


# -- the client's view of instances ---------------------------------------------------------------------------------


async def test_round_robin_spreads_evenly_in_id_order(mesh):
    async def handler(body, ctx):
        yield ctx.instance_id

    served, client = await serve_and_connect(mesh, handler, n=3)
    ids = sorted(s.instance_id for s in served)
    assert client.instance_ids() == ids
    picked = [(await collect(await client.generate({})))[0] for _ in range(9)]
    assert picked == ids * 3  # 9 requests over 3 instances: 3 each, cycling
    picked = [(await collect(await client.round_robin({})))[0] for _ in range(6)]
    assert sorted(picked) == sorted(ids * 2)


async def test_random_mode_spreads_over_every_instance(mesh):
    async def handler(body, ctx):
        yield ctx.instance_id

    served, client = await serve_and_connect(mesh, handler, n=3, mode="random")
    client._rng.seed(3)
    picked = [(await collect(await client.generate({})))[0] for _ in range(60)]
    # Each of 3 instances is missed by 60 uniform picks with probability (2/3)^60 < 1e-10.
    assert set(picked) == {s.instance_id for s in served}


async def test_wait_for_instances_returns_when_enough_are_served(mesh):
    client_rt = await mesh.runtime()
    server_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client()
    waiter = asyncio.create_task(client.wait_for_instances(2, timeout_s=2.0))
    ep = server_rt.namespace("t").component("backend").endpoint("generate")
    first = await ep.serve(Probe(n=1))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    second = await ep.serve(Probe(n=1))
    assert sorted(await waiter) == sorted([first.instance_id, second.instance_id])
    assert await client.wait_for_instances(1, timeout_s=0.01) == client.instance_ids()  # already satisfied


async def test_client_sees_instances_vanish_when_their_lease_expires(mesh):
    changes: list[list[int]] = []
    a_rt = await mesh.runtime(lease_ttl_s=10)
    b_rt = await mesh.runtime(lease_ttl_s=10)
    a = await a_rt.namespace("t").component("backend").endpoint("generate").serve(Probe(n=1))
    b = await b_rt.namespace("t").component("backend").endpoint("generate").serve(Probe(n=1))
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client()
    client.on_change(lambda: changes.append(client.instance_ids()))
    await client.wait_for_instances(2, timeout_s=1.0)

    # t=6: only A keeps its lease alive (deadline 16); B's deadline stays at 10.
    mesh.store.advance(6)
    await a_rt.discovery.keep_alive()
    mesh.store.advance(5)  # t=11: B expired, A alive
    await wait_until(lambda: client.instance_ids() == [a.instance_id])
    assert changes[-1] == [a.instance_id]
    assert client.instance(b.instance_id) is None
    assert await collect(await client.generate({})) == [0]  # routed to the survivor

    mesh.store.advance(5)  # t=16: A's refreshed lease runs out too
    await wait_until(lambda: client.instance_ids() == [])
    with pytest.raises(NoInstancesError):
        await client.generate({})


async def test_lost_lease_reregisters_the_same_instance(mesh):
    server_rt = await mesh.runtime()
    served = await server_rt.namespace("t").component("backend").endpoint("generate").serve(Probe(n=2), {"gpu": 0})
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client()
    await client.wait_for_instances(1, timeout_s=1.0)
    old_lease = server_rt.discovery.server_lease_id(server_rt.primary_lease)

    mesh.store.lose_lease(old_lease)
    await wait_until(lambda: client.instance_ids() == [])
    await server_rt.discovery.keep_alive()
    await wait_until(lambda: client.instance_ids() == [served.instance_id])
    assert server_rt.discovery.server_lease_id(server_rt.primary_lease) != old_lease
    assert client.instance(served.instance_id) == served.info  # same id, subject and metadata
    assert await collect(await client.generate({})) == [0, 1]


async def test_metadata_update_reaches_clients(mesh):
    server_rt = await mesh.runtime()
    served = await server_rt.namespace("t").component("backend").endpoint("generate").serve(Probe(n=1), {"role": "a"})
    client = await server_rt.namespace("t").component("backend").endpoint("generate").client()
    await client.wait_for_instances(1, timeout_s=1.0)
    await served.update_metadata(role="prefill", blocks=128)
    await wait_until(lambda: client.instance(served.instance_id).metadata.get("role") == "prefill")
    assert dict(client.instance(served.instance_id).metadata) == {"role": "prefill", "blocks": 128}
    assert [i.metadata["role"] for i in await server_rt.namespace("t").list_instances()] == ["prefill"]


async def test_shutdown_removes_instances_at_once(mesh):
    server_rt = await mesh.runtime()
    await server_rt.namespace("t").component("backend").endpoint("generate").serve(Probe(n=1))
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client()
    await client.wait_for_instances(1, timeout_s=1.0)
    await server_rt.shutdown(drain_timeout_s=0.1)
    await wait_until(lambda: client.instance_ids() == [])
    assert mesh.store.listing("kvmesh/") == {}


async def test_client_created_just_before_an_instance_stops_does_not_keep_it(mesh):
    """Regression: Client.start listed the instances, then its watch listed them again a moment later. A key deleted
    between the two listings was never reported (the watch's own listing no longer had it), so the client kept
    routing to a stopped instance forever."""
    rt = await mesh.runtime()
    ep = rt.namespace("t").component("backend").endpoint("generate")
    served = await ep.serve(Probe(n=1))
    client = await ep.client()
    assert client.instance_ids() == [served.instance_id]
    await served.stop(drain_timeout_s=0.1)  # deregisters before the client's watch task has run at all
    await wait_until(lambda: client.instance_ids() == [])
    with pytest.raises(NoInstancesError):
        await client.generate({})
