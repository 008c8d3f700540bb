"""Handing a stream over to another instance (components/runtime/request_plane.py, "Hand-over"): the client's one
stream continues from the instance that adopted the request, in order whatever the interleaving of the two
instances' frames, and its probes and CANCEL follow it.

Two runtimes serve one instance each (A and B, as two worker processes would) over the shared in-memory bus; a
third is the client. The handlers cooperate as a migration does: A yields some items, takes its reply route, has B
adopt the request, then hands over.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from components.runtime import ServedEndpoint, collect
from components.runtime.codec import pack, unpack
from components.runtime.request_plane import CANCEL, PROBE, RequestContext
from tests.support.mesh import Mesh
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

FAST = {"stream_idle_probe_s": 0.05, "probe_timeout_s": 0.2, "request_ack_timeout_s": 0.5}


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    m = Mesh()
    yield m
    await m.shutdown()


class Relay:
    """Instances that pass a request along: each yields ``per_hop`` items numbered on from ``body["start"]``, then
    hands it to the next instance in ``route`` (or ends). ``order``: "new_first" makes the adopting instance send
    all its items before the old one's MOVED leaves (the race a client must survive), "old_first" the reverse."""

    def __init__(self, per_hop: int, order: str = "new_first", gate_last: bool = False) -> None:
        self.per_hop = per_hop
        self.order = order
        self.gate_last = gate_last
        self.served: list[ServedEndpoint] = []
        self.hops: list[int] = []  # instance ids in the order they served
        self.go = asyncio.Event()
        self.cancelled: list[int] = []
        self.sent: dict[int, asyncio.Event] = {}
        self.num_handovers = 0

    def handler(self, index: int):
        async def handle(body, ctx: RequestContext):
            self.hops.append(ctx.instance_id)
            start, hops_left = body["start"], body["hops"]
            try:
                gate = self.gate_last and hops_left == 0
                for i in range(start, start + self.per_hop):
                    yield i
                    if gate:
                        await self.go.wait()  # the last hop holds after its first item until the test says go
                ev = self.sent.get(ctx.instance_id)
                if ev is not None:
                    ev.set()  # every item of this hop is on its way
                if hops_left == 0:
                    return
                # A migration commits one move at a time: the previous holder has handed over before this one
                # hands on (without it, "new_first" would have this hop adopt the request back on an instance
                # whose own hop has not yet said MOVED).
                await wait_until(lambda: self.num_handovers == len(self.hops) - 1, step_s=0)
                nxt = self.served[(index + 1) % len(self.served)]
                route, first_seq = ctx.reply_route()
                done = self.sent.setdefault(nxt.instance_id, asyncio.Event())
                done.clear()
                nxt.adopt(
                    self.handler((index + 1) % len(self.served)),
                    {"start": start + self.per_hop, "hops": hops_left - 1},
                    route,
                    first_seq,
                )
                if self.order == "new_first":
                    await done.wait()  # the adopting instance has sent all its items: they leave before our MOVED
                ctx.hand_over(nxt.info.subject, nxt.instance_id)
                self.num_handovers += 1
            except asyncio.CancelledError:
                self.cancelled.append(ctx.instance_id)
                raise

        return handle


async def serve_relay(mesh: Mesh, relay: Relay, n: int = 2, **config: object):
    for i in range(n):
        rt = await mesh.runtime(**FAST, **config)
        ep = rt.namespace("t").component("backend").endpoint("generate")
        relay.served.append(await ep.serve(relay.handler(i)))
    client_rt = await mesh.runtime(**FAST, **config)
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client("direct")
    await client.wait_for_instances(n, timeout_s=1.0)
    return client


@pytest.mark.parametrize("transport", ["bus", "tcp"])
@pytest.mark.parametrize("order", ["new_first", "old_first"])
async def test_a_handed_over_stream_continues_in_order(mesh, transport, order):
    relay = Relay(per_hop=5, order=order)
    client = await serve_relay(mesh, relay, response_transport=transport)
    a, b = relay.served
    stream = await client.generate({"start": 0, "hops": 1}, instance_id=a.instance_id)
    assert await collect(stream) == list(range(10))
    assert relay.hops == [a.instance_id, b.instance_id]
    assert stream.instance_id == b.instance_id and stream.num_moves == 1
    assert a.server.num_handed_over == 1 and b.server.num_adopted == 1


async def test_a_stream_moved_back_and_forth_many_times_loses_repeats_and_reorders_nothing(mesh):
    relay = Relay(per_hop=3)
    client = await serve_relay(mesh, relay, n=2, response_transport="tcp")
    a, b = relay.served
    stream = await client.generate({"start": 0, "hops": 9}, instance_id=a.instance_id)
    assert await collect(stream) == list(range(30))
    assert relay.hops == [a.instance_id, b.instance_id] * 5
    assert stream.num_moves == 9


async def test_cancel_follows_the_stream_and_a_stale_cancel_is_forwarded(mesh):
    relay = Relay(per_hop=2, order="old_first", gate_last=True)
    client = await serve_relay(mesh, relay)
    a, b = relay.served
    stream = await client.generate({"start": 0, "hops": 1}, instance_id=a.instance_id)
    await wait_until(lambda: b.server.num_inflight == 1 and a.server.num_inflight == 0)
    # A CANCEL sent to where the request was (a client that had not yet read the MOVED frame) is forwarded.
    await client.runtime.bus.publish(a.info.subject, pack([CANCEL, stream.request_id]))
    await wait_until(lambda: relay.cancelled == [b.instance_id])
    assert a.server.num_cancels_forwarded == 1
    await stream.aclose()


async def test_closing_a_moved_stream_cancels_it_on_the_new_instance(mesh):
    relay = Relay(per_hop=2, order="old_first", gate_last=True)
    client = await serve_relay(mesh, relay)
    a, b = relay.served
    stream = await client.generate({"start": 0, "hops": 1}, instance_id=a.instance_id)
    assert [await stream.__anext__(), await stream.__anext__()] == [0, 1]
    assert await stream.__anext__() == 2  # from B: the MOVED frame was read
    assert stream.instance_id == b.instance_id
    await stream.aclose()
    await wait_until(lambda: relay.cancelled == [b.instance_id])
    assert a.server.num_cancels_forwarded == 0  # it went straight to B
    relay.go.set()


async def test_idle_probes_of_a_moved_stream_do_not_interrupt_it(mesh):
    relay = Relay(per_hop=1, order="old_first", gate_last=True)
    client = await serve_relay(mesh, relay)
    a, b = relay.served
    probes: list[str] = []

    async def spy(msg):
        frame = unpack(msg.data)
        if frame[0] == PROBE:
            probes.append(msg.subject)

    await mesh.bus.subscribe("kvmesh.t.backend.generate.*", spy)
    stream = await client.generate({"start": 0, "hops": 1}, instance_id=a.instance_id)
    assert [await stream.__anext__(), await stream.__anext__()] == [0, 1]
    # B holds after its first item: the stream's reader, waiting, probes every 50 ms of silence; B (where it runs
    # now) answers alive.
    rest = asyncio.ensure_future(collect(stream))
    await wait_until(lambda: probes.count(b.info.subject) >= 3, timeout_s=2.0)
    assert not rest.done()
    relay.go.set()
    assert await rest == []
    assert stream.instance_id == b.instance_id


async def test_adopting_a_request_already_in_flight_or_while_draining_is_refused(mesh):
    relay = Relay(per_hop=1, gate_last=True)
    await serve_relay(mesh, relay)
    a, _ = relay.served
    route = {"inbox": "_INBOX.none", "request_id": "r"}
    a.adopt(relay.handler(0), {"start": 0, "hops": 0}, route, 1)
    with pytest.raises(ValueError, match="already in flight"):
        a.adopt(relay.handler(0), {"start": 0, "hops": 0}, route, 1)
    with pytest.raises(ValueError, match="not a reply route"):
        a.adopt(relay.handler(0), {"start": 0, "hops": 0}, {"inbox": "_INBOX.none"}, 1)
    relay.go.set()
    await a.server.drain(1.0)
    from components.runtime import InstanceDrainingError

    with pytest.raises(InstanceDrainingError):
        a.adopt(relay.handler(0), {"start": 0, "hops": 0}, {**route, "request_id": "r2"}, 1)


async def test_a_no_responders_answer_that_overtakes_the_moved_frame_does_not_cut_the_stream(mesh):
    """An instance that hands a stream over and leaves at once (a worker whose engine died just after a migration's
    export): the bus's "no responders" to the client's probe can arrive before the old instance's MOVED frame. The
    client probes again before calling the stream lost, and by then the stream is at its new instance."""
    from components.runtime.request_plane import _NO_RESPONDERS

    hand_over = asyncio.Event()
    served: list[ServedEndpoint] = []

    async def new_home(body, ctx: RequestContext):
        for i in (2, 3):
            yield i

    async def old_home(body, ctx: RequestContext):
        yield 0
        yield 1
        await hand_over.wait()
        route, first_seq = ctx.reply_route()
        served[1].adopt(new_home, {}, route, first_seq)
        ctx.hand_over(served[1].info.subject, served[1].instance_id)

    for handler in (old_home, new_home):
        rt = await mesh.runtime(**FAST)
        served.append(await rt.namespace("t").component("backend").endpoint("generate").serve(handler))
    client_rt = await mesh.runtime(**FAST)
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client("direct")
    await client.wait_for_instances(2, timeout_s=1.0)
    stream = await client.generate({}, instance_id=served[0].instance_id)
    assert [await stream.__anext__(), await stream.__anext__()] == [0, 1]
    stream._q.put_nowait(_NO_RESPONDERS)  # the bus's answer, ahead of the MOVED frame not yet sent
    hand_over.set()
    assert await collect(stream) == [2, 3]
    assert stream.instance_id == served[1].instance_id and stream.num_moves == 1


async def test_an_instance_that_is_gone_still_cuts_its_stream_after_the_second_probe(mesh):
    from components.runtime import StreamInterruptedError

    stop = asyncio.Event()

    async def handler(body, ctx: RequestContext):
        yield 0
        await stop.wait()
        yield 1

    rt = await mesh.runtime(**FAST)
    ep = await rt.namespace("t").component("backend").endpoint("generate").serve(handler)
    client_rt = await mesh.runtime(**FAST)
    client = await client_rt.namespace("t").component("backend").endpoint("generate").client("direct")
    await client.wait_for_instances(1, timeout_s=1.0)
    stream = await client.generate({}, instance_id=ep.instance_id)
    assert await stream.__anext__() == 0
    await ep.server.stop()  # unsubscribed: every probe now gets "no responders"
    with pytest.raises(StreamInterruptedError, match="no responders"):
        await asyncio.wait_for(stream.__anext__(), 2.0)
