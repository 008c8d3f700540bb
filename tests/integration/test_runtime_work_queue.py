"""Work queues (the prefill queue of disaggregated serving) against a real nats-server with JetStream.

Each test pins one promise of ``components.runtime.bus``'s module docstring: one consumer per item, nak and the ack
wait bring an item back with ``delivered`` one higher, ``in_progress`` holds it, ``term`` drops it, ``max_items`` is
kept atomically, ``stats`` counts as the test counted, any model name gets a queue of its own, and a NATS server
without JetStream is said so. Nothing sleeps to wait for a subscription: conditions are polled with a bound
(tests.support.waiting); the sleeps left are the time that must pass for the behaviour under test (a heartbeat
period, a gap between two pushes).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from components.runtime import ConfigError, QueueFullError, QueueStats, QueueUnavailableError, RecoverableError
from components.runtime import bus as bus_module
from components.runtime.servers import NatsServer
from tests.support.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.integration

# Generous: the machine running these is shared (2 cores), and JetStream's ack-wait timer fires on its own schedule.
POP_S = 15.0


async def stats_become(queue, timeout_s: float = 10.0, **expected: int) -> QueueStats:
    """Until ``queue.stats()`` has the expected counts (acks, naks and terms are processed by the server after the
    call returns); returns the matching stats."""
    last: list[QueueStats] = []

    async def check() -> bool:
        last[:] = [await queue.stats()]
        return all(getattr(last[0], k) == v for k, v in expected.items())

    try:
        await wait_until_async(check, timeout_s=timeout_s, step_s=0.02)
    except AssertionError:
        raise AssertionError(f"stats never became {expected}: last {last}") from None
    return last[0]


async def test_each_item_goes_to_exactly_one_of_two_concurrent_consumers(make_runtime, namespace):
    producer, rt_a, rt_b = await make_runtime(), await make_runtime(), await make_runtime()
    q = await producer.namespace(namespace).work_queue("jobs")
    consumers = {
        "a": await rt_a.namespace(namespace).work_queue("jobs"),
        "b": await rt_b.namespace(namespace).work_queue("jobs"),
    }
    n = 40
    got: dict[str, list[int]] = {"a": [], "b": []}
    done = asyncio.Event()

    async def consume(who: str) -> None:
        while not done.is_set():
            item = await consumers[who].pop(timeout_s=0.5)
            if item is None:
                continue
            assert item.delivered == 1
            got[who].append(int(item.data))
            await item.ack()
            if len(got["a"]) + len(got["b"]) >= n:
                done.set()

    tasks = [asyncio.create_task(consume(w), name=f"consume-{w}") for w in consumers]
    for i in range(n):
        await q.push(str(i).encode())
    await asyncio.wait_for(done.wait(), 30)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    everything = got["a"] + got["b"]
    assert sorted(everything) == list(range(n))  # nothing lost, nothing twice
    assert await q.size() == 0
    assert await q.pop(timeout_s=0.2) is None


async def test_nak_hands_the_item_back_with_delivered_two_and_a_delay_holds_it(make_runtime, namespace):
    rt_a, rt_b = await make_runtime(), await make_runtime()
    qa = await rt_a.namespace(namespace).work_queue("jobs")
    qb = await rt_b.namespace(namespace).work_queue("jobs")
    await qa.push(b"again")
    first = await qa.pop(timeout_s=POP_S)
    assert first is not None and first.data == b"again" and first.delivered == 1
    await first.nak()
    second = await qb.pop(timeout_s=POP_S)
    assert second is not None and second.data == b"again" and second.delivered == 2
    assert second.enqueued_s == first.enqueued_s  # the push time, not the delivery's

    # nak(delay_s): not delivered again before the delay (measured from before the nak was sent).
    t_nak = time.monotonic()
    await second.nak(delay_s=2.0)
    assert await qa.pop(timeout_s=0.2) is None
    third = await qa.pop(timeout_s=POP_S)
    assert third is not None and third.delivered == 3
    assert time.monotonic() - t_nak >= 1.9
    await third.ack()
    await stats_become(qa, waiting=0, in_flight=0)


async def test_an_item_whose_consumer_disconnects_is_redelivered_to_the_other_after_the_ack_wait(
    make_runtime, namespace
):
    producer, dying, survivor = await make_runtime(), await make_runtime(), await make_runtime()
    q = await producer.namespace(namespace).work_queue("prefill", ack_wait_s=1.0)
    q_dying = await dying.namespace(namespace).work_queue("prefill", ack_wait_s=1.0)
    q_survivor = await survivor.namespace(namespace).work_queue("prefill", ack_wait_s=1.0)
    await q.push(b"prompt")
    item = await q_dying.pop(timeout_s=POP_S)
    assert item is not None and item.delivered == 1
    t_popped = time.monotonic()

    waiter = asyncio.create_task(q_survivor.pop(timeout_s=POP_S), name="survivor-pop")
    await stats_become(q, pullers=1, in_flight=1, waiting=0)
    await dying.bus.close()  # the worker's process dies: its connection goes, the item is never acked

    again = await asyncio.wait_for(waiter, POP_S + 5)
    assert again is not None and again.data == b"prompt"
    assert again.delivered == 2
    assert again.enqueued_s == item.enqueued_s
    assert time.monotonic() - t_popped >= 0.9  # not before the ack wait
    await again.ack()
    await stats_become(q, waiting=0, in_flight=0)


async def test_in_progress_holds_an_item_past_the_ack_wait_and_silence_releases_it(make_runtime, namespace):
    rt_a, rt_b = await make_runtime(), await make_runtime()
    ack_wait_s = 1.0
    qa = await rt_a.namespace(namespace).work_queue("prefill", ack_wait_s=ack_wait_s)
    qb = await rt_b.namespace(namespace).work_queue("prefill", ack_wait_s=ack_wait_s)
    await qa.push(b"long prompt")
    item = await qa.pop(timeout_s=POP_S)
    assert item is not None

    # B waits for work while A works on the item for 3 ack waits, heartbeating every quarter of one.
    waiter = asyncio.create_task(qb.pop(timeout_s=POP_S), name="b-pop")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * ack_wait_s:
        await item.in_progress()
        await asyncio.sleep(ack_wait_s / 4)  # the heartbeat period under test
        assert not waiter.done(), "redelivered while its consumer was heartbeating"
    assert (await qa.stats()).in_flight == 1

    # A goes silent without settling: after one more ack wait, B gets the item.
    t_silent = time.monotonic()
    again = await asyncio.wait_for(waiter, POP_S + 5)
    assert again is not None and again.data == b"long prompt" and again.delivered == 2
    assert time.monotonic() - t_silent >= 0.5 * ack_wait_s
    await again.ack()
    await item.ack()  # A's late ack of the same item: harmless, the item is gone already
    await stats_become(qa, waiting=0, in_flight=0)


async def test_term_drops_the_item_for_good(make_runtime, namespace):
    rt = await make_runtime()
    q = await rt.namespace(namespace).work_queue("prefill", ack_wait_s=1.0)
    await q.push(b"poison")
    await q.push(b"fine")
    item = await q.pop(timeout_s=POP_S)
    assert item is not None and item.data == b"poison"
    await item.term()
    await item.nak()  # settled already: does nothing
    nxt = await q.pop(timeout_s=POP_S)
    assert nxt is not None and nxt.data == b"fine"
    await nxt.ack()
    await stats_become(q, waiting=0, in_flight=0)
    assert await q.size() == 0
    assert await q.pop(timeout_s=2.5) is None  # past two ack waits: the termed item does not come back


async def test_an_item_past_max_deliveries_is_dropped(make_runtime, namespace):
    rt = await make_runtime()
    q = await rt.namespace(namespace).work_queue("prefill", max_deliveries=2)
    await q.push(b"crashes workers")
    for delivered in (1, 2):
        item = await q.pop(timeout_s=POP_S)
        assert item is not None and item.delivered == delivered
        await item.nak()
    assert await q.pop(timeout_s=1.0) is None  # the third delivery is dropped by the pop that pulled it
    await stats_become(q, waiting=0, in_flight=0)


async def test_a_full_queue_refuses_a_push_clearly_and_loses_nothing(make_runtime, namespace):
    rt = await make_runtime()
    q = await rt.namespace(namespace).work_queue("prefill", max_items=3)
    for i in range(3):
        await q.push(f"item-{i}".encode())
    with pytest.raises(QueueFullError) as exc:
        await q.push(b"one too many")
    err = exc.value
    assert isinstance(err, RecoverableError)
    assert err.queue == f"{namespace}.prefill" and err.max_items == 3
    assert f"'{namespace}.prefill' is full" in str(err) and "3 items" in str(err) and "not enqueued" in str(err)
    assert await q.size() == 3

    # An item in flight still takes its place (max_items bounds waiting + in flight).
    first = await q.pop(timeout_s=POP_S)
    assert first is not None and first.data == b"item-0"
    with pytest.raises(QueueFullError):
        await q.push(b"still too many")
    await first.ack()
    await q.push(b"item-3")  # a place came free
    got = []
    while (item := await q.pop(timeout_s=0.5)) is not None:
        got.append(item.data)
        await item.ack()
    assert got == [b"item-1", b"item-2", b"item-3"]  # every stored item, in order; refused ones never appear


async def test_reopening_a_queue_applies_its_new_limit_and_keeps_its_items(make_runtime, namespace):
    rt, other = await make_runtime(), await make_runtime()
    q = await rt.namespace(namespace).work_queue("prefill", max_items=1)
    await q.push(b"kept")
    with pytest.raises(QueueFullError):
        await q.push(b"refused")
    wider = await other.namespace(namespace).work_queue(
        "prefill", max_items=2
    )  # the stream's limit is updated in place
    await q.push(b"now fits")
    with pytest.raises(QueueFullError):
        await wider.push(b"refused again")
    assert [(await wider.pop(timeout_s=POP_S)).data for _ in range(2)] == [b"kept", b"now fits"]


async def test_max_items_holds_when_two_producers_push_at_once(make_runtime, namespace):
    rt_a, rt_b = await make_runtime(), await make_runtime()
    qa = await rt_a.namespace(namespace).work_queue("prefill", max_items=5)
    qb = await rt_b.namespace(namespace).work_queue("prefill", max_items=5)
    pushes = [q.push(f"{who}-{i}".encode()) for i in range(8) for who, q in (("a", qa), ("b", qb))]
    results = await asyncio.gather(*pushes, return_exceptions=True)
    refused = [r for r in results if isinstance(r, QueueFullError)]
    assert [r for r in results if r is not None and not isinstance(r, QueueFullError)] == []
    # 16 pushes into 5 places: exactly 5 stored, 11 refused; the stream decides, so no two take the last place.
    assert len(refused) == 11
    assert await qa.size() == 5


async def test_stats_count_what_the_test_did(make_runtime, namespace):
    rt_a, rt_b = await make_runtime(), await make_runtime()
    qa = await rt_a.namespace(namespace).work_queue("prefill")
    qb = await rt_b.namespace(namespace).work_queue("prefill")
    assert await qa.stats() == QueueStats(waiting=0, in_flight=0, oldest_age_s=0.0, pullers=0, redelivered=0)

    t_first = time.time()
    await qa.push(b"old")
    await asyncio.sleep(0.5)  # a gap, so the two items' ages differ by it
    t_second = time.time()
    await qa.push(b"new")
    await qa.push(b"newest")
    s = await qa.stats()
    assert (s.waiting, s.in_flight, s.pullers, s.redelivered) == (3, 0, 0, 0)
    assert time.time() - t_first + 0.05 >= s.oldest_age_s >= 0.45  # "old" (the server stamps; same clock here)
    assert await qa.size() == 3

    # "old" goes in flight: the oldest *waiting* item is now "new", though "old" is still the stream's first message.
    old = await qb.pop(timeout_s=POP_S)
    assert old is not None and old.data == b"old"
    assert t_first - 0.05 <= old.enqueued_s <= t_second
    s = await qa.stats()
    assert (s.waiting, s.in_flight) == (2, 1)
    assert s.oldest_age_s <= time.time() - t_second + 0.05
    assert await qa.size() == 3

    # Handed back and delivered again: counted as redelivered while held.
    await old.nak()
    old = await qb.pop(timeout_s=POP_S)
    assert old is not None and old.data == b"old" and old.delivered == 2
    s = await stats_become(qa, waiting=2, in_flight=1, redelivered=1)
    await old.ack()
    for _ in range(2):
        item = await qb.pop(timeout_s=POP_S)
        assert item is not None
        await item.ack()
    assert await stats_become(qa, waiting=0, in_flight=0, redelivered=0) == QueueStats(0, 0, 0.0, 0, 0)

    # A pop waiting for work is a puller, over all processes, until it gets an item.
    waiter = asyncio.create_task(qb.pop(timeout_s=POP_S), name="waiting-pop")
    await stats_become(qa, pullers=1)
    await qa.push(b"for the waiter")
    item = await asyncio.wait_for(waiter, POP_S + 5)
    assert item is not None and item.data == b"for the waiter"
    await stats_become(qa, pullers=0, in_flight=1, waiting=0)
    await item.ack()


async def test_model_names_with_any_characters_get_queues_of_their_own(make_runtime, namespace):
    rt = await make_runtime()
    ns, other_ns = rt.namespace(namespace), rt.namespace(namespace + "u")
    models = [
        "Qwen/Qwen2.5-7B-Instruct:latest",
        "Qwen/Qwen2.5-7B-Instruct_latest",  # the same readable part as the first: only the hash tells them apart
        "meta-llama/Llama-3.1-8B",
        "a b*c>d\\e",
    ]
    queues = [await ns.prefill_queue(m) for m in models]
    for i, q in enumerate(queues):
        await q.push(f"for {i}".encode())
    for i, q in enumerate(queues):
        item = await q.pop(timeout_s=POP_S)
        assert item is not None and item.data == f"for {i}".encode()
        await item.ack()
        assert await q.pop(timeout_s=0.1) is None
    # The same model in another namespace is another queue; the same model again is the same one.
    await (await other_ns.prefill_queue(models[0])).push(b"elsewhere")
    assert await queues[0].pop(timeout_s=0.2) is None
    again = await ns.prefill_queue(models[0])
    await again.push(b"same")
    item = await queues[0].pop(timeout_s=POP_S)
    assert item is not None and item.data == b"same"
    await item.ack()
    with pytest.raises(ConfigError):
        await ns.prefill_queue("")


async def test_a_stream_made_for_another_name_is_never_shared(make_runtime, monkeypatch, namespace):
    # A hash collision, forced: "y" is given the stream and subject of "x".
    rt = await make_runtime()
    await rt.namespace(namespace).work_queue("x")
    real = bus_module.queue_names
    monkeypatch.setattr(bus_module, "queue_names", lambda name: real(f"{namespace}.x"))
    with pytest.raises(ConfigError, match="belongs to another queue"):
        await rt.namespace(namespace).work_queue("y", max_items=7)


async def test_closing_the_bus_after_a_pop_timed_out_takes_no_drain_timeout(make_runtime, namespace):
    # Regression: nats-py's drain waited for the pull subscription's queued messages (the server's expiry notice of a
    # pull request that timed out) to be marked done, which fetch never does: every close took the 5 s drain timeout.
    rt = await make_runtime()
    q = await rt.namespace(namespace).work_queue("prefill")
    assert await q.pop(timeout_s=0.2) is None
    await stats_become(q, pullers=0)  # the request expired on the server: its notice is on its way, or queued
    t0 = time.monotonic()
    await rt.bus.close()
    assert time.monotonic() - t0 < 2.5


@pytest.fixture
def plain_nats(tmp_path):
    server = NatsServer(data_dir=tmp_path / "plain-nats", jetstream=False)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


async def test_a_nats_server_without_jetstream_is_said_so(make_runtime, plain_nats, namespace):
    rt = await make_runtime(nats_url=plain_nats.url)
    with pytest.raises(QueueUnavailableError) as exc:
        await rt.namespace(namespace).work_queue("prefill")
    assert exc.value.queue == f"{namespace}.prefill" and exc.value.operation == "open"
    assert "JetStream is not enabled" in str(exc.value) and "-js" in str(exc.value)
    assert plain_nats.url in str(exc.value)


async def test_push_and_pop_say_so_when_jetstream_goes_away(make_runtime, nats_server, tmp_path, namespace):
    rt = await make_runtime()
    q = await rt.namespace(namespace).work_queue("prefill")
    await q.push(b"before")
    # The server is replaced, on the same address, by one without JetStream; the bus reconnects to it.
    nats_server.stop()
    await wait_until(lambda: not rt.bus.is_connected, timeout_s=10.0)  # else a push could go to the dying socket
    plain = NatsServer(data_dir=tmp_path / "plain-nats", port=nats_server.port, jetstream=False)
    plain.start()
    try:
        assert await rt.bus.wait_connected(30.0)
        with pytest.raises(QueueUnavailableError) as exc:
            await q.push(b"after")
        assert exc.value.operation == "push" and not exc.value.maybe_enqueued
        assert "without -js" in str(exc.value)
        with pytest.raises(QueueUnavailableError) as exc:
            await q.pop(timeout_s=5.0)
        assert exc.value.operation == "pop"
        with pytest.raises(QueueUnavailableError):
            await q.stats()
    finally:
        plain.cleanup()
