"""The in-memory work queue keeps the semantics of the JetStream one (components.runtime.bus's module docstring), so
unit tests of the prefill orchestration built on MemoryBus see what production does. Its clock is ``bus.now_s``,
moved by ``bus.advance``; tests/integration/test_runtime_work_queue.py pins the same promises on a real nats-server.
Also here: the pure naming and argument checks both implementations share.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from components.runtime import ConfigError, QueueFullError, QueueStats, RecoverableError, Runtime, RuntimeConfig
from components.runtime.bus import DEFAULT_ACK_WAIT_S, DEFAULT_MAX_DELIVERIES, queue_names
from components.runtime.memory import MemoryBus, MemoryDiscovery, MemoryStore

pytestmark = pytest.mark.unit


async def settle(rounds: int = 20) -> None:
    """Give every waiting pop a chance to run (used before asserting that something did NOT happen)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def pop_now(q):
    item = await q.pop(timeout_s=0.01)
    assert item is not None
    return item


async def test_an_item_carries_its_delivery_count_and_push_time():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill")
    bus.advance(12.5)
    await q.push(b"a")
    bus.advance(1.0)
    item = await pop_now(q)
    assert (item.data, item.delivered, item.enqueued_s) == (b"a", 1, 12.5)
    await item.nak()
    again = await pop_now(q)
    assert (again.delivered, again.enqueued_s) == (2, 12.5)


async def test_the_ack_wait_redelivers_an_unsettled_item_and_in_progress_restarts_it():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill", ack_wait_s=2.0)
    other = await bus.work_queue("t.prefill", ack_wait_s=2.0)
    await q.push(b"job")
    item = await pop_now(q)

    for _ in range(5):  # 5 s of work, a heartbeat every second: never past the 2 s ack wait
        bus.advance(1.0)
        await item.in_progress()
    assert await other.pop(timeout_s=0.01) is None

    waiter = asyncio.create_task(other.pop(timeout_s=5.0))
    await settle()
    bus.advance(1.9)  # silence, but less than the ack wait
    await settle()
    assert not waiter.done()
    bus.advance(0.1)  # the ack wait ran out: the waiting pop gets it
    again = await asyncio.wait_for(waiter, 1.0)
    assert again is not None and again.data == b"job" and again.delivered == 2
    await item.in_progress()  # the first consumer's late heartbeat does not take it back
    bus.advance(1.9)
    assert await q.pop(timeout_s=0.01) is None
    await item.ack()  # ...but its late ack settles the item, as JetStream's does
    await again.ack()  # nothing left to settle
    assert await q.size() == 0


async def test_nak_with_a_delay_holds_the_item_until_the_delay_has_passed():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill")
    await q.push(b"later")
    await q.push(b"now")
    first = await pop_now(q)
    await first.nak(delay_s=3.0)
    second = await pop_now(q)
    assert second.data == b"now"  # the delayed one waits, the next one goes
    assert await q.pop(timeout_s=0.01) is None
    bus.advance(3.0)
    again = await pop_now(q)
    assert (again.data, again.delivered) == (b"later", 2)


async def test_term_drops_the_item_and_later_settles_do_nothing():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill", ack_wait_s=1.0)
    await q.push(b"poison")
    item = await pop_now(q)
    await item.term()
    await item.nak()  # settled already
    await item.in_progress()
    assert await q.size() == 0
    bus.advance(10.0)
    assert await q.pop(timeout_s=0.01) is None


async def test_an_item_past_max_deliveries_is_dropped_by_the_pop_that_pulls_it():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill", max_deliveries=2)
    await q.push(b"crashes workers")
    await q.push(b"fine")
    for delivered in (1, 2):
        item = await pop_now(q)
        assert (item.data, item.delivered) == (b"crashes workers", delivered)
        await item.nak()
    nxt = await pop_now(q)  # the third delivery is dropped, and the pop goes on to the next item
    assert nxt.data == b"fine"
    await nxt.ack()
    assert await q.size() == 0


async def test_a_full_queue_refuses_a_push_and_in_flight_items_take_their_places():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill", max_items=2)
    await q.push(b"a")
    await q.push(b"b")
    with pytest.raises(QueueFullError) as exc:
        await q.push(b"c")
    assert isinstance(exc.value, RecoverableError)
    assert (exc.value.queue, exc.value.max_items) == ("t.prefill", 2)
    assert "is full" in str(exc.value) and "not enqueued" in str(exc.value)
    item = await pop_now(q)
    with pytest.raises(QueueFullError):
        await q.push(b"c")  # "a" is in flight: still held
    await item.ack()
    await q.push(b"c")
    assert [(await pop_now(q)).data for _ in range(2)] == [b"b", b"c"]


async def test_stats_count_as_jetstream_counts():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill")
    assert await q.stats() == QueueStats(waiting=0, in_flight=0, oldest_age_s=0.0, pullers=0, redelivered=0)
    await q.push(b"old")
    bus.advance(4.0)
    await q.push(b"new")
    bus.advance(1.0)
    assert await q.stats() == QueueStats(waiting=2, in_flight=0, oldest_age_s=5.0, pullers=0, redelivered=0)

    old = await pop_now(q)
    # The oldest *waiting* item is "new" (1 s), though "old" (5 s) is still held.
    assert await q.stats() == QueueStats(waiting=1, in_flight=1, oldest_age_s=1.0, pullers=0, redelivered=0)
    await old.nak()  # handed back: ack-pending until delivered again, as JetStream counts it
    assert await q.stats() == QueueStats(waiting=1, in_flight=1, oldest_age_s=1.0, pullers=0, redelivered=0)
    old = await pop_now(q)
    assert (await q.stats()).redelivered == 1
    assert await q.size() == 2

    waiters = [asyncio.create_task(q.pop(timeout_s=5.0)) for _ in range(2)]
    await settle()
    assert (await q.stats()).pullers == 1  # one pop took "new" at once; the other waits
    await q.push(b"newest")
    got = await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
    assert sorted(i.data for i in got if i is not None) == [b"new", b"newest"]
    assert (await q.stats()).pullers == 0


async def test_two_waiting_pops_and_one_push_leave_the_other_pop_waiting():
    bus = MemoryBus()
    q = await bus.work_queue("t.prefill")
    waiters = [asyncio.create_task(q.pop(timeout_s=5.0)) for _ in range(2)]
    await settle()
    await q.push(b"one")
    await settle()
    assert sum(w.done() for w in waiters) == 1  # the loser does not return None early: it waits on
    await q.push(b"two")
    got = await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
    assert sorted(i.data for i in got if i is not None) == [b"one", b"two"]


def test_queue_names_are_valid_deterministic_and_distinct():
    names = [
        "t.prefill.Qwen/Qwen2.5-7B-Instruct:latest",
        "t.prefill.Qwen/Qwen2.5-7B-Instruct_latest",  # the same readable part as the first
        "t.prefill.Qwen/Qwen2.5-7B-Instruct.latest",
        "u.prefill.Qwen/Qwen2.5-7B-Instruct:latest",
        "t.prefill." + "x" * 500,
        "t.prefill.a b*c>d\\e\tf",
        "t.prefill.ünï",
    ]
    derived = [queue_names(n) for n in names]
    assert derived == [queue_names(n) for n in names]  # deterministic
    assert len({s for s, _ in derived}) == len(names) and len({subj for _, subj in derived}) == len(names)
    for stream, subject in derived:
        # JetStream stream names: no '.', '*', '>', path separators or whitespace; kept well under 255 bytes.
        assert re.fullmatch(r"KVMESH_[A-Za-z0-9_-]+_[0-9a-f]{12}", stream) and len(stream) <= 80
        assert re.fullmatch(r"kvmesh\.queue\.[A-Za-z0-9_-]+", subject)
    assert queue_names("t.prefill.Qwen/Qwen2.5-7B-Instruct:latest")[0].startswith("KVMESH_t_prefill_Qwen_Qwen2_5-7B")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ack_wait_s": 0}, "ack_wait_s"),
        ({"ack_wait_s": -1.0}, "ack_wait_s"),
        ({"max_items": 0}, "max_items"),
        ({"max_deliveries": 0}, "max_deliveries"),
    ],
)
async def test_bad_queue_limits_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        await MemoryBus().work_queue("t.prefill", **kwargs)


async def test_defaults_are_the_documented_ones():
    q = await MemoryBus().work_queue("t.prefill")
    assert (q.ack_wait_s, DEFAULT_ACK_WAIT_S, DEFAULT_MAX_DELIVERIES) == (5.0, 5.0, 3)


async def test_prefill_queues_are_per_namespace_and_model():
    bus = MemoryBus()
    rt = await Runtime.from_parts(RuntimeConfig(), MemoryDiscovery(MemoryStore()), bus)
    try:
        a = await rt.namespace("t").prefill_queue("Qwen/Qwen2.5-7B:latest", max_items=4)
        assert a.name == "t.prefill.Qwen/Qwen2.5-7B:latest"
        assert await rt.namespace("t").prefill_queue("Qwen/Qwen2.5-7B:latest") is a
        assert await rt.namespace("u").prefill_queue("Qwen/Qwen2.5-7B:latest") is not a
        assert await rt.namespace("t").prefill_queue("Qwen/Qwen2.5-7B_latest") is not a
        assert await rt.namespace("t").work_queue("prefill") is not a
        with pytest.raises(ConfigError, match="model name"):
            await rt.namespace("t").prefill_queue("")
    finally:
        await rt.shutdown()
