"""The in-memory twins keep the semantics the runtime relies on (components.runtime.memory).

Unit tests of everything above the runtime build on MemoryStore/MemoryDiscovery/MemoryBus, so a twin that drifts from
etcd or NATS would let those tests pass against behaviour production never shows. Each test here pins one promise of
the module docstrings of memory.py, bus.py and discovery.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from components.runtime.bus import BusMessage, NoRespondersError, is_no_responders
from components.runtime.discovery import WatchEvent, WatchEventKind, diff_listing
from components.runtime.errors import RecoverableError, RequestTimeoutError, RuntimeMeshError
from components.runtime.memory import MemoryBus, MemoryDiscovery, MemoryStore, subject_matches
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

PUT, DELETE = WatchEventKind.PUT, WatchEventKind.DELETE


async def settle(rounds: int = 20) -> None:
    """Give every delivery task a chance to run (used before asserting that something did NOT happen)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Recorder:
    """A subscription callback that keeps what it got."""

    def __init__(self) -> None:
        self.msgs: list[BusMessage] = []

    async def __call__(self, msg: BusMessage) -> None:
        self.msgs.append(msg)

    @property
    def data(self) -> list[bytes]:
        return [m.data for m in self.msgs]


async def next_event(it, timeout_s: float = 1.0) -> WatchEvent:
    return await asyncio.wait_for(it.__anext__(), timeout_s)


# -- subjects ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.b.c", "a.b", False),
        ("a.b", "a.b.c", False),
        ("a.*.c", "a.x.c", True),
        ("a.*.c", "a.x.y.c", False),  # '*' is exactly one token
        ("a.*", "a", False),
        ("*", "a", True),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),  # '>' is every remaining token
        ("a.>", "a", False),  # ... but at least one
        (">", "a.b", True),
        ("a.*.>", "a.b", False),
        ("a.*.>", "a.b.c", True),
        ("a.b.c", "a.b.x", False),
    ],
)
def test_subject_wildcards(pattern, subject, expected):
    assert subject_matches(pattern, subject) is expected


async def test_wildcard_subscriptions_receive_matching_publishes_only():
    bus = MemoryBus()
    star, tail, exact = Recorder(), Recorder(), Recorder()
    await bus.subscribe("kv.*.load", star)
    await bus.subscribe("kv.>", tail)
    await bus.subscribe("kv.ns.load", exact)
    await bus.publish("kv.ns.load", b"1")
    await bus.publish("kv.other.load", b"2")
    await bus.publish("kv.ns.load.extra", b"3")
    await bus.publish("elsewhere", b"4")
    await wait_until(lambda: len(tail.msgs) == 3)
    await settle()
    assert star.data == [b"1", b"2"]
    assert tail.data == [b"1", b"2", b"3"]
    assert exact.data == [b"1"]
    assert [m.subject for m in tail.msgs] == ["kv.ns.load", "kv.other.load", "kv.ns.load.extra"]


async def test_each_subscriber_sees_publish_order():
    bus = MemoryBus()
    a, b = Recorder(), Recorder()
    await bus.subscribe("s", a)
    await bus.subscribe("s.>", b)
    sent = [str(i).encode() for i in range(500)]
    for d in sent:
        await bus.publish("s", d)
        await bus.publish("s.x", d)
    await wait_until(lambda: len(a.msgs) == 500 and len(b.msgs) == 500)
    assert a.data == sent
    assert b.data == sent


async def test_a_callback_runs_one_message_at_a_time():
    bus = MemoryBus()
    active, max_active, seen = 0, 0, []

    async def slow(msg: BusMessage) -> None:
        nonlocal active, max_active
        active += 1
        max_active = max(max_active, active)
        await asyncio.sleep(0.001)
        seen.append(msg.data)
        active -= 1

    await bus.subscribe("s", slow)
    for i in range(10):
        await bus.publish("s", bytes([i]))
    await wait_until(lambda: len(seen) == 10)
    assert max_active == 1
    assert seen == [bytes([i]) for i in range(10)]


async def test_queue_group_delivers_each_message_to_exactly_one_member():
    bus = MemoryBus(seed=1)
    members = [Recorder() for _ in range(3)]
    for m in members:
        await bus.subscribe("work", m, queue="workers")
    plain = Recorder()
    await bus.subscribe("work", plain)  # a plain subscriber beside the group gets everything
    n = 60
    for i in range(n):
        await bus.publish("work", str(i).encode())
    await wait_until(lambda: sum(len(m.msgs) for m in members) == n and len(plain.msgs) == n)
    await settle()
    got = [d for m in members for d in m.data]
    assert sorted(got) == sorted(str(i).encode() for i in range(n))  # each exactly once
    assert sum(len(m.msgs) for m in members) == n
    # A random choice among 3 over 60 messages leaves a member empty with probability ~3 * (2/3)^60: never.
    assert all(m.msgs for m in members)
    assert plain.data == [str(i).encode() for i in range(n)]


async def test_two_queue_groups_each_get_every_message_once():
    bus = MemoryBus()
    g1, g2 = [Recorder(), Recorder()], [Recorder(), Recorder()]
    for m in g1:
        await bus.subscribe("e", m, queue="g1")
    for m in g2:
        await bus.subscribe("e", m, queue="g2")
    for i in range(20):
        await bus.publish("e", bytes([i]))
    await wait_until(lambda: sum(len(m.msgs) for m in g1 + g2) == 40)
    await settle()
    assert sorted(d for m in g1 for d in m.data) == [bytes([i]) for i in range(20)]
    assert sorted(d for m in g2 for d in m.data) == [bytes([i]) for i in range(20)]


async def test_unsubscribe_stops_delivery():
    bus = MemoryBus()
    rec = Recorder()
    sub = await bus.subscribe("s", rec)
    await bus.publish("s", b"before")
    await wait_until(lambda: len(rec.msgs) == 1)
    await sub.unsubscribe()
    await bus.publish("s", b"after")
    await settle()
    assert rec.data == [b"before"]


# -- no responders, request/reply ---------------------------------------------------------------------------------


async def test_publish_with_reply_to_nobody_delivers_a_no_responders_status():
    bus = MemoryBus()
    inbox = bus.new_inbox()
    replies = Recorder()
    await bus.subscribe(inbox + ".*", replies)
    await bus.publish("nobody.listens", b"req", reply=inbox + ".7")
    await wait_until(lambda: len(replies.msgs) == 1)
    status = replies.msgs[0]
    assert status.subject == inbox + ".7"
    assert status.data == b""
    assert is_no_responders(status)
    # A publish without a reply subject to nobody is simply dropped; nothing reaches the inbox.
    await bus.publish("nobody.listens", b"fire-and-forget")
    await settle()
    assert len(replies.msgs) == 1


async def test_ordinary_empty_reply_is_not_a_no_responders_status():
    bus = MemoryBus()

    async def responder(msg: BusMessage) -> None:
        await bus.publish(msg.reply, b"")

    await bus.subscribe("svc", responder)
    replies = Recorder()
    inbox = bus.new_inbox()
    await bus.subscribe(inbox, replies)
    await bus.publish("svc", b"x", reply=inbox)
    await wait_until(lambda: len(replies.msgs) == 1)
    assert not is_no_responders(replies.msgs[0])
    assert await bus.request("svc", b"x", timeout_s=1.0) == b""


async def test_request_to_nobody_raises_no_responders_at_once():
    bus = MemoryBus()
    t0 = time.monotonic()
    with pytest.raises(NoRespondersError) as exc:
        await bus.request("nobody.home", b"?", timeout_s=5.0)
    # The status arrives on the next loop iterations; waiting out the 5 s timeout would be the bug.
    assert time.monotonic() - t0 < 0.5
    assert exc.value.subject == "nobody.home"
    assert isinstance(exc.value, RecoverableError)


async def test_request_gets_the_reply_and_cleans_up_its_inbox():
    bus = MemoryBus()

    async def echo(msg: BusMessage) -> None:
        await bus.publish(msg.reply, msg.data.upper())

    await bus.subscribe("echo", echo)
    assert await bus.request("echo", b"hi", timeout_s=1.0) == b"HI"
    assert await bus.request("echo", b"again", timeout_s=1.0) == b"AGAIN"
    # Only the responder's subscription is left: each request's inbox subscription was removed.
    assert [s.subject for s in bus._subs] == ["echo"]


async def test_request_without_answer_times_out_as_both_kvmesh_and_builtin_timeout():
    bus = MemoryBus()
    swallowed = Recorder()
    await bus.subscribe("silent", swallowed)  # subscribed, so no no-responders status, but never answers
    t0 = time.monotonic()
    with pytest.raises(RequestTimeoutError) as exc:
        await bus.request("silent", b"?", timeout_s=0.05)
    took = time.monotonic() - t0
    assert 0.04 < took < 1.0
    assert isinstance(exc.value, TimeoutError)
    assert isinstance(exc.value, RuntimeMeshError)
    assert exc.value.timeout_s == 0.05
    assert "silent" in str(exc.value)
    assert swallowed.data == [b"?"]
    # ``except TimeoutError`` is enough for callers that do not know kvmesh.
    with pytest.raises(TimeoutError):
        await bus.request("silent", b"?", timeout_s=0.01)


# -- work queues ---------------------------------------------------------------------------------------------------


async def test_work_queue_push_pop_ack_nak_size():
    bus = MemoryBus()
    q = await bus.work_queue("ns.prefill")
    for d in (b"a", b"b", b"c"):
        await q.push(d)
    assert await q.size() == 3

    first = await q.pop(timeout_s=0.1)
    assert first is not None and first.data == b"a"
    assert await q.size() == 3  # popped but not acknowledged: still counted, as JetStream counts it
    await first.ack()
    assert await q.size() == 2

    second = await q.pop(timeout_s=0.1)
    assert second is not None and second.data == b"b"
    await second.nak()  # handed back: the next pop gets it again, before c
    assert await q.size() == 2
    again = await q.pop(timeout_s=0.1)
    assert again is not None and again.data == b"b"
    await again.ack()
    third = await q.pop(timeout_s=0.1)
    assert third is not None and third.data == b"c"
    await third.ack()
    assert await q.size() == 0


async def test_work_queue_pop_times_out_empty_and_wakes_on_push():
    bus = MemoryBus()
    q = await bus.work_queue("jobs")
    t0 = time.monotonic()
    assert await q.pop(timeout_s=0.05) is None
    assert time.monotonic() - t0 >= 0.04

    waiter = asyncio.create_task(q.pop(timeout_s=5.0))
    await settle()
    assert not waiter.done()
    await q.push(b"job")
    item = await asyncio.wait_for(waiter, 1.0)
    assert item is not None and item.data == b"job"


async def test_work_queue_is_shared_by_name_and_each_item_goes_to_one_popper():
    bus = MemoryBus()
    producer = await bus.work_queue("shared")
    consumers = [await bus.work_queue("shared") for _ in range(2)]
    assert await bus.work_queue("other") is not producer
    for i in range(6):
        await producer.push(bytes([i]))
    got = []
    for i in range(6):
        item = await consumers[i % 2].pop(timeout_s=0.1)
        assert item is not None
        got.append(item.data)
        await item.ack()
    assert got == [bytes([i]) for i in range(6)]  # FIFO, nothing duplicated
    assert await consumers[0].pop(timeout_s=0.01) is None


# -- store leases and watches --------------------------------------------------------------------------------------


async def test_lease_expires_after_ttl_and_watchers_see_delete():
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    lease = await disc.grant_lease(10)
    await disc.put("p/a", b"1", lease=lease)
    await disc.put("p/forever", b"x")  # no lease: never expires
    events = disc.watch_prefix("p/")
    assert {(await next_event(events)).key for _ in range(2)} == {"p/a", "p/forever"}

    store.advance(9.9)
    assert "p/a" in store.listing("p/")
    store.advance(0.1)  # deadline = 0 + 10 s reached
    assert store.listing("p/") == {"p/forever": b"x"}
    ev = await next_event(events)
    assert ev == WatchEvent(DELETE, "p/a", None)
    assert disc.server_lease_id(lease) not in store.leases
    await events.aclose()


async def test_keep_alive_refreshes_the_deadline():
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    lease = await disc.grant_lease(10)
    await disc.put("k", b"v", lease=lease)
    for _ in range(5):  # 5 x 8 s = 40 s, four TTLs, kept alive every 8 s
        store.advance(8)
        await disc.keep_alive()
    assert store.listing("k") == {"k": b"v"}
    store.advance(10)  # no keep-alive for a whole TTL
    assert store.listing("k") == {}


async def test_revoke_deletes_keys_at_once_and_is_idempotent():
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    lease = await disc.grant_lease(10)
    await disc.put("k/1", b"1", lease=lease)
    await disc.put("k/2", b"2", lease=lease)
    await disc.revoke_lease(lease)
    assert store.listing("k/") == {}
    await disc.revoke_lease(lease)
    await disc.delete("k/1")  # deleting a missing key is not an error either


async def test_lost_lease_is_regranted_with_its_keys_under_the_same_handle():
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    other = MemoryDiscovery(store)  # another process watching the same store
    lease = await disc.grant_lease(10)
    old_server_id = disc.server_lease_id(lease)
    await disc.put("inst/a", b"A", lease=lease)
    await disc.put("inst/b", b"B", lease=lease)
    events = other.watch_prefix("inst/")
    assert [(e.kind, e.key) for e in [await next_event(events), await next_event(events)]] == [
        (PUT, "inst/a"),
        (PUT, "inst/b"),
    ]

    store.lose_lease(old_server_id)  # etcd wiped: the keys vanish, the lease is unknown
    assert store.listing("inst/") == {}
    assert {(await next_event(events)).kind for _ in range(2)} == {DELETE}

    await disc.keep_alive()  # the refresh says "unknown": grant again and put every key again
    new_server_id = disc.server_lease_id(lease)
    assert new_server_id != old_server_id
    assert new_server_id in store.leases
    assert store.listing("inst/") == {"inst/a": b"A", "inst/b": b"B"}
    assert {(e.kind, e.key, e.value) for e in [await next_event(events), await next_event(events)]} == {
        (PUT, "inst/a", b"A"),
        (PUT, "inst/b", b"B"),
    }
    # The caller's handle keeps working: new puts go under the new server lease and expire with it.
    await disc.put("inst/c", b"C", lease=lease)
    assert store.kv["inst/c"][1] == new_server_id
    store.advance(10)
    assert store.listing("inst/") == {}
    await events.aclose()


async def test_deleted_key_is_not_restored_when_the_lease_is_regranted():
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    lease = await disc.grant_lease(10)
    await disc.put("inst/a", b"A", lease=lease)
    await disc.put("inst/b", b"B", lease=lease)
    await disc.delete("inst/a")  # deregistered on purpose
    store.lose_lease(disc.server_lease_id(lease))
    await disc.keep_alive()
    assert store.listing("inst/") == {"inst/b": b"B"}


async def test_watch_lists_existing_keys_first_then_streams_changes():
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    await disc.put("ns/a", b"1")
    await disc.put("ns/b", b"2")
    await disc.put("nsx/other", b"outside the prefix")
    events = disc.watch_prefix("ns/")
    first = [await next_event(events), await next_event(events)]
    assert sorted((e.kind, e.key, e.value) for e in first) == [(PUT, "ns/a", b"1"), (PUT, "ns/b", b"2")]

    await disc.put("ns/c", b"3")
    await disc.put("nsx/other", b"changed")  # not under "ns/": not delivered
    await disc.put("ns/a", b"1bis")
    await disc.delete("ns/b")
    await disc.delete("ns/missing")  # nothing was there: no event
    await disc.put("ns/d", b"4")
    got = [await next_event(events) for _ in range(4)]
    assert got == [
        WatchEvent(PUT, "ns/c", b"3"),
        WatchEvent(PUT, "ns/a", b"1bis"),
        WatchEvent(DELETE, "ns/b", None),
        WatchEvent(PUT, "ns/d", b"4"),
    ]
    await events.aclose()
    assert store._watchers == []  # closing the watch removes its watcher


async def test_changes_while_the_listing_is_consumed_are_not_lost_or_reordered():
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    await disc.put("p/a", b"1")
    events = disc.watch_prefix("p/")
    assert await next_event(events) == WatchEvent(PUT, "p/a", b"1")  # the watch is registered from here on
    await disc.delete("p/a")
    await disc.put("p/a", b"2")
    assert [await next_event(events), await next_event(events)] == [
        WatchEvent(DELETE, "p/a", None),
        WatchEvent(PUT, "p/a", b"2"),
    ]
    await events.aclose()


async def test_store_revision_counts_every_change():
    store = MemoryStore()
    r0 = store.revision
    store.put("a", b"1")
    store.put("a", b"2")
    store.delete("a")
    store.delete("a")  # a no-op is not a revision
    assert store.revision == r0 + 3


def test_put_under_an_unknown_lease_is_refused():
    store = MemoryStore()
    with pytest.raises(KeyError):
        store.put("k", b"v", lid=0xDEAD)
    assert store.listing("") == {}


def test_diff_listing_turns_known_into_listing():
    known = {"a": b"1", "b": b"2", "c": b"3"}
    listing = {"b": b"2", "c": b"9", "d": b"4"}
    events = diff_listing(known, listing)
    assert sorted(events, key=lambda e: e.key) == [
        WatchEvent(DELETE, "a", None),
        WatchEvent(PUT, "c", b"9"),
        WatchEvent(PUT, "d", b"4"),
    ]
    # Deletes come first, so a consumer applying them in order never holds a key that is gone.
    assert [e.kind for e in events] == [DELETE, PUT, PUT]
    assert diff_listing(listing, listing) == []
    assert diff_listing({}, {}) == []
    assert diff_listing({}, {"x": b"1"}) == [WatchEvent(PUT, "x", b"1")]
    assert diff_listing({"x": b"1"}, {}) == [WatchEvent(DELETE, "x", None)]


async def test_watch_from_a_known_listing_yields_only_the_difference():
    """A caller that applied its own listing hands it over; what changed since arrives, deletions included."""
    store = MemoryStore()
    disc = MemoryDiscovery(store)
    await disc.put("p/same", b"1")
    await disc.put("p/changed", b"old")
    await disc.put("p/gone", b"x")
    known = await disc.get_prefix("p/")
    await disc.delete("p/gone")  # between the caller's listing and the watch's
    await disc.put("p/changed", b"new")
    await disc.put("p/new", b"2")
    events = disc.watch_prefix("p/", known=known)
    first = [await next_event(events) for _ in range(3)]
    assert first == [
        WatchEvent(DELETE, "p/gone", None),
        WatchEvent(PUT, "p/changed", b"new"),
        WatchEvent(PUT, "p/new", b"2"),
    ]
    await disc.put("p/later", b"3")
    assert await next_event(events) == WatchEvent(PUT, "p/later", b"3")  # nothing about p/same came in between
    await events.aclose()
    assert known == {"p/same": b"1", "p/changed": b"old", "p/gone": b"x"}  # the caller's mapping is not modified
