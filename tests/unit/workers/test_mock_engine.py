"""MockEngine: the asyncio step loop around the scheduler, behind the Engine protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import FinishReason, GenerateRequest, KvEvent, KvEventKind, SamplingParams, TokenChunk
from components.workers.engines.base import Engine, EngineDeadError, EngineRequestError
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.engines.mock import engine as mock_engine_module
from components.workers.engines.mock.engine import MAX_CATCH_UP_S, step_end_s
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

INF = float("inf")


def make_config(**overrides) -> MockEngineConfig:
    fields: dict[str, Any] = {"num_gpu_blocks": 256, "block_size": 16, "max_model_len": 1024, "speedup_ratio": INF}
    fields.update(overrides)
    return MockEngineConfig(**fields)


async def make_engine(**overrides) -> MockEngine:
    engine = MockEngine(make_config(**overrides), name="test")
    await engine.start()
    return engine


def make_request(request_id: str, prompt_len: int = 32, *, offset: int = 0, max_tokens: int = 8) -> GenerateRequest:
    tokens = list(range(offset, offset + prompt_len))
    return GenerateRequest(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in stream]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_config_accepts_inf_and_rejects_inconsistent_settings():
    assert MockEngineConfig(speedup_ratio="inf").is_infinitely_fast  # type: ignore[arg-type]
    assert not MockEngineConfig().is_infinitely_fast
    with pytest.raises(ValidationError, match="cannot hold one sequence"):
        MockEngineConfig(num_gpu_blocks=10, block_size=16, max_model_len=161)
    with pytest.raises(ValidationError, match="without chunked prefill"):
        MockEngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=2048, max_model_len=4096)
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        MockEngineConfig(vocab_size=100)
    with pytest.raises(ValidationError, match="greater than 0"):
        MockEngineConfig(speedup_ratio=0)
    with pytest.raises(ValidationError, match="Extra inputs"):
        MockEngineConfig(num_blocks=10)  # type: ignore[call-arg]  # a typo must not silently become a default


async def test_implements_the_engine_protocol():
    engine = MockEngine(make_config())
    assert isinstance(engine, Engine)
    assert engine.block_size == 16


async def test_generate_streams_max_tokens_then_finishes():
    engine = await make_engine()
    try:
        chunks = await collect(engine.generate(make_request("a", 40, max_tokens=12)))
    finally:
        await engine.shutdown()
    assert len(tokens_of(chunks)) == 12
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[0].num_prompt_tokens == 40 and chunks[0].num_cached_tokens == 0


async def test_identical_requests_give_identical_tokens_on_different_engines():
    e1, e2 = await make_engine(), await make_engine(speedup_ratio=1000.0, max_num_seqs=4)
    try:
        t1 = tokens_of(await collect(e1.generate(make_request("a", 50, max_tokens=20))))
        t2 = tokens_of(await collect(e2.generate(make_request("b", 50, max_tokens=20))))
        t3 = tokens_of(await collect(e2.generate(make_request("c", 50, offset=7, max_tokens=20))))
    finally:
        await e1.shutdown()
        await e2.shutdown()
    assert t1 == t2 and len(t1) == 20
    assert t1 != t3


@pytest.mark.timeout(60)
async def test_infinite_speedup_never_sleeps_and_serves_a_crowd():
    engine = await make_engine(num_gpu_blocks=4096, max_model_len=2048)
    try:
        results = await asyncio.gather(
            *(collect(engine.generate(make_request(f"r{i}", 64, offset=i, max_tokens=64))) for i in range(200))
        )
    finally:
        await engine.shutdown()
    assert all(len(tokens_of(chunks)) == 64 for chunks in results)
    assert engine.num_timed_sleeps == 0
    # 200 x 64 = 12800 prompt tokens over 8192-token steps, then ~64 decode steps, all batched together.
    assert 64 < engine.num_steps < 80
    assert engine.simulated_time_s > 0  # time was modelled, just not waited for


async def test_finite_speedup_sleeps_the_modelled_time():
    engine = await make_engine(speedup_ratio=10.0)
    try:
        await collect(engine.generate(make_request("a", 32, max_tokens=5)))
    finally:
        await engine.shutdown()
    assert engine.num_steps == 5
    # 1 prefill step (16.5 + 0.49 + ~0 ms) + 4 decode steps (~5.0 ms each): ~37 ms simulated, 3.7 ms of sleeps,
    # far more than the ~0.05 ms of Python a step costs.
    assert engine.simulated_time_s == pytest.approx(0.037, abs=0.002)
    assert engine.num_timed_sleeps >= 1  # not == 5: a loaded CI machine may stall one step past its deadline


def test_a_step_ends_on_the_schedule_of_the_busy_engine():
    # 47 ms steps. The previous step was due at 1.000 s; this one started 3 ms late: it still ends 47 ms after 1.000.
    assert step_end_s(1.003, 0.047, 1.000) == pytest.approx(1.047)
    # A timer that fired early changes nothing either.
    assert step_end_s(0.999, 0.047, 1.000) == pytest.approx(1.047)
    # After idling (no previous end) or a stall beyond the catch-up bound, the step counts from its own start.
    assert step_end_s(1.003, 0.047, None) == pytest.approx(1.050)
    late = 1.000 + MAX_CATCH_UP_S + 0.001
    assert step_end_s(late, 0.047, 1.000) == pytest.approx(late + 0.047)


async def test_late_timers_do_not_slow_the_modelled_engine(monkeypatch):
    # A virtual clock and a sleep that always wakes 3 ms late (a busy event loop). Each step's sleep is shortened by
    # the previous one's lateness, so the engine's elapsed time is the modelled time plus the last step's 3 ms, not
    # plus 3 ms for every step (which is what sleeping each step's full time from its own start would give).
    now = [0.0]
    real_sleep = asyncio.sleep

    async def late_sleep(delay: float, *args: Any) -> None:
        if delay > 0:
            now[0] += delay + 0.003
        await real_sleep(0)

    monkeypatch.setattr(mock_engine_module.asyncio, "sleep", late_sleep)
    engine = MockEngine(make_config(speedup_ratio=1.0), name="late", clock=lambda: now[0])
    await engine.start()
    try:
        await collect(engine.generate(make_request("a", 32, max_tokens=20)))
    finally:
        await engine.shutdown()
    assert engine.num_steps == 20
    assert now[0] == pytest.approx(engine.simulated_time_s + 0.003, abs=1e-6)


async def test_an_idle_engine_waits_instead_of_spinning():
    engine = await make_engine()
    try:
        await collect(engine.generate(make_request("a", max_tokens=3)))
        steps = engine.num_steps
        await asyncio.sleep(0.05)
        assert engine.num_steps == steps
        # ... and wakes up for the next request.
        await collect(engine.generate(make_request("b", max_tokens=3)))
        assert engine.num_steps == steps + 3
    finally:
        await engine.shutdown()


async def test_closing_the_stream_early_aborts_and_frees_blocks():
    engine = await make_engine(speedup_ratio=1.0)  # real time: ~5 ms per decode step, so it is still running
    try:
        stream = engine.generate(make_request("a", 100, max_tokens=500))
        first = await anext(stream)
        assert first.token_ids and engine.snapshot().num_active_blocks > 0
        await stream.aclose()
        snap = engine.snapshot()
        assert (snap.num_active_blocks, snap.kv_usage, snap.num_running) == (0, 0.0, 0)
    finally:
        await engine.shutdown()


async def test_abort_ends_the_stream_with_an_abort_chunk():
    engine = await make_engine(speedup_ratio=1.0)
    try:
        stream = engine.generate(make_request("a", 100, max_tokens=500))
        await anext(stream)
        await engine.abort("a")
        rest = await collect(stream)
        assert rest[-1].finish_reason is FinishReason.ABORT
        assert engine.snapshot().num_active_blocks == 0
        await engine.abort("unknown")  # ignored
    finally:
        await engine.shutdown()


async def test_prompt_longer_than_max_model_len_is_a_request_error_and_the_engine_keeps_serving():
    engine = await make_engine(max_model_len=64)
    try:
        with pytest.raises(EngineRequestError, match="longer than the maximum model length of 64"):
            await collect(engine.generate(make_request("long", 65)))
        chunks = await collect(engine.generate(make_request("ok", 64, max_tokens=1)))
        assert chunks[-1].finish_reason is FinishReason.LENGTH
    finally:
        await engine.shutdown()


async def test_a_duplicate_request_id_is_rejected():
    engine = await make_engine(speedup_ratio=1.0)
    try:
        stream = engine.generate(make_request("a", max_tokens=500))
        await anext(stream)
        with pytest.raises(EngineRequestError, match="already"):
            await collect(engine.generate(make_request("a")))
        await stream.aclose()
        # Once the first stream is closed the id is free again.
        chunks = await collect(engine.generate(make_request("a", max_tokens=1)))
        assert chunks[-1].finish_reason is FinishReason.LENGTH
    finally:
        await engine.shutdown()


async def test_not_started_or_shut_down_is_dead():
    engine = MockEngine(make_config())
    with pytest.raises(EngineDeadError, match="not started"):
        await collect(engine.generate(make_request("a")))
    await engine.start()
    await engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await collect(engine.generate(make_request("a")))
    await engine.shutdown()  # idempotent


async def test_shutdown_ends_open_streams_and_the_event_iterator():
    engine = await make_engine(speedup_ratio=1.0)
    stream = engine.generate(make_request("a", max_tokens=500))
    await anext(stream)
    events = engine.kv_events()
    first_batch = await anext(events)
    assert first_batch[0].event_id == 1
    await engine.shutdown()
    rest = await collect(stream)
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert [b async for b in events] == []


async def test_kv_events_are_contiguous_and_match_the_hashes_of_the_tokens():
    engine = await make_engine()
    received: list[KvEvent] = []

    async def consume() -> None:
        async for batch in engine.kv_events():
            received.extend(batch)

    consumer = asyncio.create_task(consume(), name="test-kv-consumer")
    try:
        prompt = make_request("a", 40, max_tokens=30)
        chunks = await collect(engine.generate(prompt))
        await wait_until(lambda: bool(received) and received[-1].event_id == engine.kv_state().last_event_id)
    finally:
        await engine.shutdown()
        await consumer
    assert [e.event_id for e in received] == list(range(1, len(received) + 1))
    # 40 + 30 tokens, 69 of them computed: 4 full blocks, stored as the prompt is prefilled and decode goes on.
    all_tokens = prompt.token_ids + tokens_of(chunks)
    expected = block_hashes(all_tokens[:64], 16)
    assert all(e.kind is KvEventKind.BLOCK_STORED for e in received)
    assert [h for e in received for h in e.block_hashes] == expected
    state = engine.kv_state()
    assert state.block_hashes == expected and state.last_event_id == received[-1].event_id


async def test_an_unconsumed_event_buffer_drops_the_oldest_batches():
    engine = await make_engine(max_pending_kv_event_batches=2)
    try:
        for i in range(4):  # each request stores its 2 prompt blocks in one batch
            await collect(engine.generate(make_request(f"r{i}", 32, offset=100 * i, max_tokens=1)))
        assert engine.num_dropped_kv_event_batches == 2
        batch = await anext(engine.kv_events())
        assert batch[0].event_id == 3  # ids 1 and 2 were dropped: the consumer sees the gap and resyncs
        assert engine.kv_state().last_event_id == 4
    finally:
        await engine.shutdown()


async def test_reset_prefix_cache_publishes_all_cleared():
    engine = await make_engine()
    try:
        await collect(engine.generate(make_request("a", 32, max_tokens=1)))
        engine.reset_prefix_cache()
        events = engine.kv_events()
        assert (await anext(events))[0].kind is KvEventKind.BLOCK_STORED
        (cleared,) = await anext(events)
        assert cleared.kind is KvEventKind.ALL_CLEARED and cleared.event_id == 2
        assert engine.kv_state().block_hashes == []
    finally:
        await engine.shutdown()


async def test_snapshot_under_pressure():
    engine = await make_engine(speedup_ratio=1.0, max_num_seqs=2)
    streams = [engine.generate(make_request(f"r{i}", 32, offset=100 * i, max_tokens=500)) for i in range(6)]
    tasks = [asyncio.create_task(collect(s), name=f"test-consumer-{i}") for i, s in enumerate(streams)]
    try:
        await wait_until(lambda: engine.snapshot().num_running == 2 and engine.num_steps >= 2)
        snap = engine.snapshot()
        assert snap.num_running == 2 and snap.num_waiting == 4
        assert snap.num_waiting_prefill_tokens == 4 * 32
        assert snap.batch_size == 2 and snap.num_kv_tokens > 64
        assert snap.num_active_blocks >= 6 and snap.kv_usage == snap.num_active_blocks / 256
        assert snap.num_preemptions == 0
    finally:
        await engine.shutdown()
        results = await asyncio.gather(*tasks)
    assert all(r[-1].finish_reason is FinishReason.ABORT for r in results)


async def test_preemption_under_block_pressure_keeps_outputs_identical():
    # 16 blocks of 4 tokens = 64 tokens for 4 requests growing to 8 + 24 = 32 tokens each.
    tight = {"num_gpu_blocks": 16, "block_size": 4, "max_model_len": 64}
    reqs = [make_request(f"r{i}", 8, offset=50 * i, max_tokens=24) for i in range(4)]
    roomy = await make_engine()
    try:
        expected = [tokens_of(await collect(roomy.generate(r))) for r in reqs]
    finally:
        await roomy.shutdown()
    engine = await make_engine(**tight)
    try:
        results = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
        assert engine.snapshot().num_preemptions > 0
    finally:
        await engine.shutdown()
    assert [tokens_of(r) for r in results] == expected


async def test_a_crashed_step_loop_fails_consumers_with_engine_dead():
    engine = await make_engine()

    def broken_step(now_s: float):
        raise RuntimeError("simulated bug")

    engine.scheduler.step = broken_step  # type: ignore[method-assign]
    try:
        with pytest.raises(EngineDeadError, match="simulated bug"):
            await collect(engine.generate(make_request("a")))
        with pytest.raises(EngineDeadError):
            await collect(engine.generate(make_request("b")))
    finally:
        await engine.shutdown()


async def test_an_imported_prefix_is_announced_and_hit_by_a_later_request():
    # Hot-prefix replication's copy on a simulated engine: engine 2 imports the 4-block (64-token) prefix that
    # engine 1 computed, with no request. Its BLOCK_STORED names the 4 hashes, and a 70-token request with that
    # prefix then finds 64 tokens cached on engine 2 (the 4 full blocks), where it would have found 0.
    e1, e2 = await make_engine(), await make_engine()
    try:
        await collect(e1.generate(make_request("a", 64, max_tokens=1)))
        hashes = e1.kv_state().block_hashes[:4]
        assert hashes == block_hashes(list(range(64)), 16)
        assert e2.import_prefix(hashes) == 4
        batch = await anext(e2.kv_events())
        assert [(e.kind, e.block_hashes) for e in batch] == [(KvEventKind.BLOCK_STORED, hashes)]
        chunks = await collect(e2.generate(make_request("b", 70, max_tokens=1)))
    finally:
        await e1.shutdown()
        await e2.shutdown()
    assert chunks[0].num_cached_tokens == 64


async def test_a_dropped_prefix_is_announced_removed_and_missed_by_a_later_request():
    # The drop of a cold replica: engine imports a 4-block (64-token) prefix, then drops it. Its BLOCK_REMOVED names
    # the 4 hashes, and a 70-token request with that prefix then finds 0 tokens cached (it would have found 64).
    e = await make_engine()
    try:
        hashes = block_hashes(list(range(64)), 16)
        assert e.import_prefix(hashes) == 4
        await anext(e.kv_events())
        assert e.drop_prefix(hashes) == (4, 0)
        batch = await anext(e.kv_events())
        assert [(ev.kind, ev.block_hashes) for ev in batch] == [(KvEventKind.BLOCK_REMOVED, hashes)]
        chunks = await collect(e.generate(make_request("b", 70, max_tokens=1)))
    finally:
        await e.shutdown()
    assert chunks[0].num_cached_tokens == 0


def test_the_engines_request_errors_survive_pickling_with_their_fields():
    # A simulation sweep's worker process hands a failed replay's error to its parent by pickle; the default
    # (cls(*args) with the message) could not rebuild PromptTooLongError, and the parent's pool hung.
    import pickle

    from components.workers.engines.mock.scheduler import DuplicateRequestError, PromptTooLongError

    e = pickle.loads(pickle.dumps(PromptTooLongError("r1", 9000, 8192)))
    assert (type(e), e.request_id, e.num_prompt_tokens, e.max_model_len) == (PromptTooLongError, "r1", 9000, 8192)
    assert str(e) == str(PromptTooLongError("r1", 9000, 8192))
    d = pickle.loads(pickle.dumps(DuplicateRequestError("r2")))
    assert (type(d), d.request_id, str(d)) == (DuplicateRequestError, "r2", str(DuplicateRequestError("r2")))


async def test_in_batch_prefix_caching_holds_a_request_whose_prefix_is_being_computed_in_the_live_engine_too():
    # Two streams opened together are queued before the first step (asyncio runs the two tasks before the step loop
    # it woke): off, both compute the 4-block prefix; on, the second waits for the first to store it and hits it.
    def pair() -> list[GenerateRequest]:
        prefix = list(range(1000, 1064))
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        return [GenerateRequest("a", [*prefix, *range(10)], sampling), GenerateRequest("b", [*prefix, 7], sampling)]

    cached = {}
    for on in (False, True):
        engine = await make_engine(enable_in_batch_prefix_caching=on)
        try:
            a, b = await asyncio.gather(*(collect(engine.generate(r)) for r in pair()))
        finally:
            await engine.shutdown()
        assert len(tokens_of(a)) == len(tokens_of(b)) == 4
        cached[on] = (a[0].num_cached_tokens, b[0].num_cached_tokens)
    assert cached == {False: (0, 0), True: (0, 64)}
