"""The simulated engine's migration contract (components/migration/engine.py) between two MockEngines in one loop,
without the agent: suspend at a step boundary, state, reserve/extend/commit on the destination, resume, cancel,
and continuations. The reference for "same tokens" is the same request run unmoved on a third engine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from components.migration.engine import SuspendedChunk, supports_migration
from components.protocol.messages import FinishReason, GenerateRequest, SamplingParams, TokenChunk
from components.protocol.migration import MigratingRequest
from components.workers.engines.base import EngineRequestError
from components.workers.engines.mock import MockEngine, MockEngineConfig

pytestmark = pytest.mark.unit


def make_config(**overrides: object) -> MockEngineConfig:
    fields: dict[str, object] = {
        "num_gpu_blocks": 256,
        "block_size": 16,
        "max_model_len": 1024,
        "speedup_ratio": float("inf"),
    }
    fields.update(overrides)
    return MockEngineConfig(**fields)  # type: ignore[arg-type]


async def make_engine(name: str, **overrides: object) -> MockEngine:
    engine = MockEngine(make_config(**overrides), name=name)
    await engine.start()
    return engine


def request(rid: str = "r", prompt_len: int = 70, max_tokens: int = 40, seed: int | None = None) -> GenerateRequest:
    return GenerateRequest(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, seed=seed))


async def unmoved(req: GenerateRequest) -> list[int]:
    ref = await make_engine("ref")
    try:
        return [t async for c in ref.generate(req) for t in c.token_ids]
    finally:
        await ref.shutdown()


async def read_until_suspended(stream: AsyncIterator[TokenChunk], src: MockEngine, rid: str, after: int) -> list[int]:
    """Tokens until ``after`` have arrived, then suspend and read up to the SuspendedChunk."""
    got: list[int] = []
    asked = False
    async for chunk in stream:
        if chunk.__class__ is SuspendedChunk:
            assert asked
            return got
        assert chunk.finish_reason is None, "finished before it could be moved"
        assert chunk.position == len(got)
        got += chunk.token_ids
        if len(got) >= after and not asked:
            assert src.suspend(rid)
            asked = True
    raise AssertionError("the stream ended without a SuspendedChunk")


@pytest.mark.parametrize("live", [True, False])
async def test_a_request_moved_mid_decode_continues_with_the_tokens_of_an_unmoved_run(live: bool) -> None:
    req = request(max_tokens=40, seed=3)
    expected = await unmoved(req)
    src, dst = await make_engine("src"), await make_engine("dst")
    assert supports_migration(src)
    stream = src.generate(req)
    before = await read_until_suspended(stream, src, "r", after=10)
    state = src.suspended_state("r")
    assert state is not None and state.output_token_ids == before and state.position == len(before)
    # At a step boundary the KV covers everything but the last sampled token.
    assert state.num_computed_tokens == len(state.all_token_ids) - 1
    mid = None
    if live:
        extent = src.kv_extent("r")
        assert extent is not None and extent.num_full_blocks == state.num_computed_tokens // 16
        mid = "m1"
        assert dst.reserve_migration(mid, "r", extent.token_ids) == 0  # nothing cached there yet
    else:
        state.num_computed_tokens = 0
    moved = dst.commit_migration(mid, state)
    await stream.aclose()  # the source's copy is released
    assert "r" not in src.scheduler.requests and src.scheduler.pool.num_active_blocks == 0
    after: list[int] = []
    async for chunk in moved:
        assert chunk.position == len(before) + len(after)
        after += chunk.token_ids
        last = chunk
    assert last.finish_reason == FinishReason.LENGTH
    assert before + after == expected
    await src.shutdown()
    await dst.shutdown()


async def test_live_commit_runs_at_once_while_recompute_prefills_the_whole_sequence_again() -> None:
    src, dst_live, dst_re = await make_engine("src"), await make_engine("live"), await make_engine("re")
    stream = src.generate(request(prompt_len=200, max_tokens=60))
    await read_until_suspended(stream, src, "r", after=5)
    state = src.suspended_state("r")
    assert state is not None
    extent = src.kv_extent("r")
    assert extent is not None
    dst_live.reserve_migration("m", "r", extent.token_ids)
    live = dst_live.commit_migration("m", state)
    assert dst_live.scheduler.requests["r"].is_decoding  # decodes in its next step: nothing to recompute
    re_state = src.suspended_state("r")
    assert re_state is not None
    re_state.num_computed_tokens = 0
    re = dst_re.commit_migration(None, re_state)
    assert dst_re.scheduler.requests["r"].num_computed_tokens == 0
    a = [t async for c in live for t in c.token_ids]
    b = [t async for c in re for t in c.token_ids]
    assert a == b  # the same continuation either way; only the work to get there differs
    assert dst_re.scheduler.requests == {} and dst_live.scheduler.requests == {}
    await stream.aclose()
    for e in (src, dst_live, dst_re):
        await e.shutdown()


async def test_reserve_shares_the_destinations_prefix_cache_and_extend_adds_blocks() -> None:
    dst = await make_engine("dst")
    warm = request("warm", prompt_len=64, max_tokens=1)
    [c async for c in dst.generate(warm)]  # its 4 prompt blocks are now cached on dst
    tokens = list(range(1, 97))  # 6 blocks; the first 4 equal warm's prompt
    assert dst.reserve_migration("m", "r", tokens) == 4
    pool = dst.scheduler.pool
    active = pool.num_active_blocks
    assert dst.extend_migration("m", list(range(97, 129)))  # 2 more blocks
    assert pool.num_active_blocks == active + 2
    assert dst.cancel_migration("m")
    assert pool.num_active_blocks == 0
    assert not dst.cancel_migration("m")
    await dst.shutdown()


async def test_no_room_on_the_destination_is_an_answer_not_a_crash() -> None:
    dst = await make_engine("dst", num_gpu_blocks=70)  # 70 x 16 = 1120 tokens >= max_model_len 1024
    assert dst.reserve_migration("m", "r", list(range(71 * 16))) is None
    assert dst.scheduler.pool.num_active_blocks == 0
    await dst.shutdown()


async def test_resume_after_a_suspension_continues_on_the_source() -> None:
    req = request(max_tokens=30)
    expected = await unmoved(req)
    src = await make_engine("src")
    stream = src.generate(req)
    got = await read_until_suspended(stream, src, "r", after=7)
    assert src.resume("r")
    async for chunk in stream:
        got += chunk.token_ids
    assert got == expected
    await src.shutdown()


async def test_a_commit_that_does_not_match_the_blocks_sent_is_refused_and_frees_them() -> None:
    src, dst = await make_engine("src"), await make_engine("dst")
    stream = src.generate(request(max_tokens=40))
    await read_until_suspended(stream, src, "r", after=20)
    state = src.suspended_state("r")
    assert state is not None
    dst.reserve_migration("m", "r", [9] * 32)  # not this request's tokens
    with pytest.raises(EngineRequestError, match="does not match"):
        dst.commit_migration("m", state)
    assert dst.scheduler.pool.num_active_blocks == 0
    with pytest.raises(EngineRequestError, match="no blocks reserved"):
        dst.commit_migration("gone", state)
    await stream.aclose()
    await src.shutdown()
    await dst.shutdown()


async def test_a_continuation_request_produces_the_rest_of_the_unmoved_output() -> None:
    req = request(max_tokens=25, seed=11)
    expected = await unmoved(req)
    eng = await make_engine("e")
    cont = GenerateRequest("c", req.token_ids + expected[:9], req.sampling, num_output_tokens=9)
    chunks = [c async for c in eng.generate(cont)]
    assert chunks[0].position == 9 and chunks[0].num_prompt_tokens == 0
    assert [t for c in chunks for t in c.token_ids] == expected[9:]
    with pytest.raises(EngineRequestError, match="nothing left to produce"):
        [c async for c in eng.generate(GenerateRequest("d", [1, 2, 3], SamplingParams(max_tokens=2), 2))]
    await eng.shutdown()


async def test_a_request_moved_without_kv_queues_by_the_age_of_its_wall_clock_arrival() -> None:
    # The agent stamps a request's first arrival on the wall clock; the engine queues by its own clock (here held
    # at 1000 s). A request that arrived 5 s ago goes between one queued at 990 s and one at 999 s; one with no
    # stamp (0.0) goes first, as before. Inspected before the engine's loop runs a step.
    engine = MockEngine(make_config(), name="dst", clock=lambda: 1000.0)
    await engine.start()
    try:
        engine.scheduler.add_request(request("c"), 990.0)
        engine.scheduler.add_request(request("d"), 999.0)
        stamped = MigratingRequest("x", list(range(1, 71)), [], SamplingParams(max_tokens=5), arrival_s=time.time() - 5)
        x = engine.commit_migration(None, stamped)
        unstamped = MigratingRequest("y", list(range(1, 71)), [], SamplingParams(max_tokens=5))
        y = engine.commit_migration(None, unstamped)
        assert [r.request_id for r in engine.scheduler.waiting] == ["y", "c", "x", "d"]
        assert 994.0 < engine.scheduler.requests["x"].arrival_s < 996.0
        assert engine.scheduler.abort("c") and engine.scheduler.abort("d")
        assert len([t async for c in x for t in c.token_ids]) == 5
        assert len([t async for c in y for t in c.token_ids]) == 5
    finally:
        await engine.shutdown()
