"""Requests nobody waits for any more end on their instance, and requests wait for a bus that is coming back.

Over the in-memory twins (one MemoryStore, one MemoryBus shared by a "server" and a "client" runtime, as two
processes would talk), so each mechanism is seen alone:

- a client that gave up on a stream re-sends its CANCEL when frames keep coming (the first one was lost);
- an instance cancels the requests of a client whose process is gone (nobody answers on the client's subjects);
- a live client's requests are never cancelled by that check;
- a request made while the bus is down waits for it (bounded), or fails with BusUnavailableError.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from components.runtime import BusUnavailableError, request_plane
from components.runtime.bus import BusMessage
from components.runtime.codec import pack, unpack
from components.runtime.request_plane import ACK, CANCEL, REQ, RequestContext
from tests.support.mesh import Mesh
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    m = Mesh()
    yield m
    await m.shutdown()


class Endless:
    """A handler that streams an item every 5 ms until it is cancelled, and remembers that it was."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def __call__(self, body: object, ctx: RequestContext) -> AsyncIterator[dict[str, int]]:
        self.started += 1
        i = 0
        try:
            while True:
                yield {"i": i}
                i += 1
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def serve_endless(mesh: Mesh, **config: object):
    server = await mesh.runtime(**config)
    handler = Endless()
    served = await server.namespace("t").component("c").endpoint("gen").serve(handler)
    return server, served, handler


async def test_a_stream_whose_cancel_was_lost_is_cancelled_again_when_its_frames_keep_coming(mesh, monkeypatch):
    monkeypatch.setattr(request_plane, "CANCEL_RESEND_S", 0.02)
    _, served, handler = await serve_endless(mesh)
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    stream = await client.generate({}, instance_id=served.instance_id)
    assert (await stream.__anext__()) == {"i": 0}
    # Give up on it as aclose() does, but without the CANCEL reaching the instance (as when the bus was down).
    stream._finish()
    client_rt.mux.abandon(stream._key, stream.subject, stream.request_id)
    await wait_until(lambda: handler.cancelled == 1)
    assert client_rt.mux.num_cancels_resent >= 1
    assert served.server.num_inflight == 0


async def test_a_finished_abandoned_stream_is_forgotten_without_another_cancel(mesh, monkeypatch):
    monkeypatch.setattr(request_plane, "CANCEL_RESEND_S", 60.0)  # no re-send within the test: only the END counts
    server = await mesh.runtime()

    async def three(body: object, ctx: RequestContext) -> AsyncIterator[int]:
        for i in range(3):
            yield i
            await asyncio.sleep(0.01)

    served = await server.namespace("t").component("c").endpoint("gen").serve(three)
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    stream = await client.generate({}, instance_id=served.instance_id)
    stream._finish()
    client_rt.mux.abandon(stream._key, stream.subject, stream.request_id)
    await wait_until(lambda: served.server.num_inflight == 0)
    await wait_until(lambda: not client_rt.mux._abandoned)  # its END removed it
    assert client_rt.mux.num_cancels_resent == 0


async def test_a_request_cancelled_before_its_handler_ran_leaves_nothing_in_flight(mesh):
    # Regression (issue 28: ``kvmesh stop`` took 76 s after an external nats-server's restart under load). A REQ and
    # its CANCEL that the instance reads together (a client's bus keeps both while the server is away and sends them
    # in one write when it is back) are handled in one event-loop round: the CANCEL cancelled the handler's task
    # before its first step, so the cleanup in its ``finally`` never ran and the request stayed in flight for good;
    # the worker's drain then waited its whole timeout (60 s) for a request nobody ran.
    _, served, handler = await serve_endless(mesh)
    frames: list[list[object]] = []

    async def on_reply(msg: BusMessage) -> None:
        frames.append(unpack(msg.data))

    await mesh.bus.subscribe("inbox.together", on_reply)
    for rid in ("a", "b"):
        await mesh.bus.publish(served.info.subject, pack([REQ, rid, {}]), reply="inbox.together")
        await mesh.bus.publish(served.info.subject, pack([CANCEL, rid]))
    await wait_until(lambda: len(frames) == 2)  # both ACKed: the instance took both requests
    assert frames == [[0, ACK, None], [0, ACK, None]]
    await wait_until(lambda: served.server.num_inflight == 0, timeout_s=1.0)
    assert handler.started == 0  # cancelled before they ran
    assert await asyncio.wait_for(served.server.drain(timeout_s=30.0), 1.0) == 0  # nothing to wait for


async def test_a_caller_that_leaves_while_waiting_for_the_ack_cancels_the_request(mesh, monkeypatch):
    # The caller of ``generate`` is cancelled (its HTTP client left) after the REQ went out and before the ACK came:
    # a window of up to ``request_ack_timeout_s`` (2 s) while nats-server is away and the REQ waits in the client's
    # buffer. The instance gets the REQ all the same; it used to run the request to its end for nobody (no CANCEL was
    # sent, and its frames were dropped without the re-sent CANCEL an abandoned stream gets), holding a drain that
    # long. Here the caller leaves right after sending, so its wait for the ACK is what gets cancelled.
    _, served, handler = await serve_endless(mesh)
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    real_publish = mesh.bus.publish

    async def publish_then_leave(subject: str, data: bytes, reply: str = "") -> None:
        await real_publish(subject, data, reply)
        if unpack(data)[0] == REQ:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # the caller's next await (the ACK's) raises CancelledError

    acks: list[object] = []

    async def on_batch(msg: BusMessage) -> None:
        acks.extend(item for item in unpack(msg.data) if item[1] == 0 and item[2] == ACK)

    await mesh.bus.subscribe(client_rt.mux.batch_subject, on_batch)
    monkeypatch.setattr(mesh.bus, "publish", publish_then_leave)
    calling = asyncio.ensure_future(client.generate({}, instance_id=served.instance_id))
    with pytest.raises(asyncio.CancelledError):
        await calling
    await wait_until(lambda: len(acks) == 1)  # the instance took the request
    await wait_until(lambda: served.server.num_inflight == 0, timeout_s=1.0)  # and it ended there
    assert handler.started == handler.cancelled


async def test_an_instance_cancels_the_requests_of_a_client_that_is_gone(mesh):
    _, served, handler = await serve_endless(mesh, client_check_s=0.05, probe_timeout_s=0.2)
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    streams = [await client.generate({}, instance_id=served.instance_id) for _ in range(3)]
    for s in streams:
        await s.__anext__()
    # The client process dies: its response subscription vanishes and no CANCEL is ever sent.
    for s in streams:
        s._finish()
    await client_rt.mux.stop()
    await wait_until(lambda: handler.cancelled == 3)
    assert served.server.num_orphans_cancelled == 3
    assert served.server.num_inflight == 0


async def test_a_live_client_s_requests_are_left_alone_by_the_check(mesh):
    _, served, _ = await serve_endless(mesh, client_check_s=0.02, probe_timeout_s=0.2)
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    stream = await client.generate({}, instance_id=served.instance_id)
    got = []
    async for item in stream:
        got.append(item["i"])
        if len(got) == 40:  # ~200 ms: about ten checks
            break
    await stream.aclose()
    assert got == list(range(40))
    assert served.server.num_orphans_cancelled == 0


async def test_one_no_responders_answer_is_not_proof_that_a_client_is_gone(mesh, monkeypatch):
    # Right after nats-server comes back, an instance can probe a live client before it has re-subscribed (the fault
    # tests: a worker cancelled 3 requests of a live frontend in the millisecond it reconnected, 9 ms before the
    # frontend did). Here the first check of the client answers "no responders", every later one the truth.
    real = request_plane.probe_instance
    answers: list[bool | None] = []

    async def flaky_probe(bus, subject, timeout_s):
        alive = False if not answers else await real(bus, subject, timeout_s)
        answers.append(alive)
        return alive

    monkeypatch.setattr(request_plane, "probe_instance", flaky_probe)
    _, served, handler = await serve_endless(mesh, client_check_s=0.02, probe_timeout_s=0.2)
    client_rt = await mesh.runtime()
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    stream = await client.generate({}, instance_id=served.instance_id)
    got = []
    async for item in stream:
        got.append(item["i"])
        if len(answers) >= 5:  # ~100 ms: the false answer and four true ones
            break
    await stream.aclose()
    # Later answers are the live client's (None: its reply is not an instance's PROBE_ACK; only False condemns).
    assert answers[0] is False and False not in answers[1:5]
    assert got == list(range(len(got)))  # never cut
    assert served.server.num_orphans_cancelled == 0 and handler.cancelled <= 1  # (1: the client's own CANCEL)


async def test_a_request_made_while_the_bus_is_down_waits_for_it(mesh):
    _, served, _ = await serve_endless(mesh)
    client_rt = await mesh.runtime(bus_wait_s=5.0)
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    mesh.bus.is_connected = False
    pending = asyncio.ensure_future(client.generate({}, instance_id=served.instance_id))
    await asyncio.sleep(0.05)  # the scenario: the outage lasts a while
    assert not pending.done()
    mesh.bus.is_connected = True
    stream = await asyncio.wait_for(pending, 2.0)
    assert (await stream.__anext__()) == {"i": 0}
    await stream.aclose()


async def test_a_bus_that_stays_down_fails_the_request_clearly(mesh):
    _, served, handler = await serve_endless(mesh)
    client_rt = await mesh.runtime(bus_wait_s=0.05)
    client = await client_rt.namespace("t").component("c").endpoint("gen").client()
    mesh.bus.is_connected = False
    with pytest.raises(BusUnavailableError) as exc:
        await client.generate({}, instance_id=served.instance_id)
    assert isinstance(exc.value, TimeoutError) and "unreachable for 0.05 s" in str(exc.value)
    assert handler.started == 0  # nothing was sent
    mesh.bus.is_connected = True


async def test_an_instance_probe_tells_serving_from_draining_from_gone(mesh):
    from components.runtime.request_plane import probe_instance

    _, served, _ = await serve_endless(mesh)
    subject = served.info.subject
    assert await probe_instance(mesh.bus, subject, 0.5) is True
    served.server.draining = True  # as during a drain: no new requests
    assert await probe_instance(mesh.bus, subject, 0.5) is False
    await served.server.stop()
    assert await probe_instance(mesh.bus, subject, 0.5) is False  # nobody subscribes: no responders
