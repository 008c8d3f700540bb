"""The simulated engine's scheduler, driven step by step with builders (no asyncio, no clock)."""

from __future__ import annotations

from typing import Any

import pytest

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import FinishReason, GenerateRequest, KvEventKind, SamplingParams
from components.protocol.migration import MigratingRequest
from components.workers.engines.base import EngineRequestError
from components.workers.engines.mock.config import MockEngineConfig
from components.workers.engines.mock.scheduler import (
    DuplicateRequestError,
    PromptTooLongError,
    RequestStatus,
    Scheduler,
    StepOutput,
)

pytestmark = pytest.mark.unit


def make_scheduler(**overrides) -> Scheduler:
    """A small engine: 64 blocks of 16 tokens, room for 4 sequences of max_model_len 256."""
    fields: dict[str, Any] = {
        "num_gpu_blocks": 64,
        "block_size": 16,
        "max_model_len": 256,
        "max_num_batched_tokens": 256,
    }
    fields.update(overrides)
    return Scheduler(MockEngineConfig(**fields))


def make_request(
    request_id: str,
    prompt: int | list[int] = 20,
    *,
    max_tokens: int = 8,
    offset: int = 0,
    ignore_eos: bool = True,
    **sampling,
) -> GenerateRequest:
    """``prompt`` is a token list or a length (tokens ``offset, offset+1, ...``)."""
    tokens = list(range(offset, offset + prompt)) if isinstance(prompt, int) else list(prompt)
    return GenerateRequest(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling))


def run_until_idle(sched: Scheduler, *, max_steps: int = 10_000) -> tuple[dict[str, list[int]], list[StepOutput]]:
    """Step until no request is left; returns each request's output tokens and every step's output."""
    tokens: dict[str, list[int]] = {}
    steps: list[StepOutput] = []
    for i in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens, steps
        out = sched.step(now_s=float(i))
        steps.append(out)
        for rid, chunk in out.chunks.items():
            tokens.setdefault(rid, []).extend(chunk.token_ids)
    raise AssertionError(f"not idle after {max_steps} steps")


def solo_output(request: GenerateRequest, **overrides) -> list[int]:
    sched = make_scheduler(**overrides)
    sched.add_request(request, 0.0)
    tokens, _ = run_until_idle(sched)
    return tokens[request.request_id]


# --- basics -----------------------------------------------------------------------------------------------------------


def test_a_request_prefills_in_one_step_then_decodes_one_token_per_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", 20, max_tokens=5), 0.0)
    tokens, steps = run_until_idle(sched)
    assert [s.num_scheduled_tokens for s in steps] == [{"a": 20}] + [{"a": 1}] * 4
    assert len(tokens["a"]) == 5
    first = steps[0].chunks["a"]
    assert first.num_prompt_tokens == 20 and first.num_cached_tokens == 0
    assert steps[-1].finished == {"a": FinishReason.LENGTH}
    assert [s.finished for s in steps[:-1]] == [{}] * 4
    assert sched.pool.num_active_blocks == 0 and not sched.running


def test_step_time_follows_the_configured_polynomial():
    sched = make_scheduler(
        prefill_base_ms=10,
        prefill_ms_per_token=0.5,
        prefill_ms_per_token_sq=0.01,
        decode_base_ms=4,
        decode_ms_per_seq=1,
        decode_ms_per_kv_token=0.1,
    )
    sched.add_request(make_request("a", 20, max_tokens=3), 0.0)
    prefill = sched.step(0.0)
    # 10 + 0.5 * 20 + 0.01 * 400 = 24 ms
    assert prefill.num_prefill_tokens == 20 and prefill.num_decode_seqs == 0
    assert prefill.step_time_s == pytest.approx(0.024)
    decode = sched.step(1.0)
    # one sequence attending to its 20 prompt tokens + the 1 being computed: 4 + 1 + 0.1 * 21 = 7.1 ms
    assert decode.num_decode_seqs == 1 and decode.num_decode_kv_tokens == 21 and decode.num_prefill_tokens == 0
    assert decode.step_time_s == pytest.approx(0.0071)
    sched.add_request(make_request("b", 10, offset=500), 2.0)
    mixed = sched.step(2.0)
    # both parts: (10 + 5 + 1) + (4 + 1 + 0.1 * 22) = 23.2 ms
    assert mixed.num_scheduled_tokens == {"a": 1, "b": 10}
    assert mixed.step_time_s == pytest.approx(0.0232)


def test_validation_rejects_what_can_never_be_served():
    sched = make_scheduler(max_model_len=64, vocab_size=1000, eos_token_id=None)
    with pytest.raises(PromptTooLongError) as exc_info:
        sched.add_request(make_request("long", 65), 0.0)
    assert isinstance(exc_info.value, EngineRequestError)
    assert exc_info.value.num_prompt_tokens == 65 and exc_info.value.max_model_len == 64
    assert "65 tokens" in str(exc_info.value) and "64" in str(exc_info.value)
    with pytest.raises(EngineRequestError, match="empty"):
        sched.add_request(make_request("empty", []), 0.0)
    with pytest.raises(EngineRequestError, match="token ids"):
        sched.add_request(make_request("vocab", [1, 1000]), 0.0)
    with pytest.raises(EngineRequestError, match="max_tokens"):
        sched.add_request(make_request("zero", 4, max_tokens=0), 0.0)
    sched.add_request(make_request("ok", 64), 0.0)
    with pytest.raises(DuplicateRequestError):
        sched.add_request(make_request("ok", 4), 0.0)
    assert list(sched.requests) == ["ok"]


# --- prefix caching ---------------------------------------------------------------------------------------------------


def test_second_request_with_a_shared_prefix_reuses_cached_blocks():
    sched = make_scheduler()
    prefix = list(range(1000, 1064))  # 4 full blocks
    sched.add_request(make_request("a", prefix + list(range(10)), max_tokens=2), 0.0)
    run_until_idle(sched)
    sched.add_request(make_request("b", prefix + list(range(50, 60)), max_tokens=2), 1.0)
    out = sched.step(1.0)
    assert out.num_scheduled_tokens == {"b": 10}  # 74 - 64 cached
    assert out.num_prefill_tokens == 10
    assert out.chunks["b"].num_cached_tokens == 64 and out.chunks["b"].num_prompt_tokens == 74


def test_an_identical_prompt_still_computes_its_last_block():
    sched = make_scheduler()
    sched.add_request(make_request("a", 64, max_tokens=1), 0.0)
    run_until_idle(sched)
    sched.add_request(make_request("b", 64, max_tokens=1), 1.0)
    out = sched.step(1.0)
    # The last token must be computed to sample from it, so only 3 of the 4 blocks come from the cache.
    assert out.chunks["b"].num_cached_tokens == 48 and out.num_scheduled_tokens == {"b": 16}


def test_running_requests_share_prefix_blocks_by_refcount():
    sched = make_scheduler()
    prefix = list(range(1000, 1032))  # 2 full blocks
    a = sched.add_request(make_request("a", [*prefix, 1, 2, 3], max_tokens=50), 0.0)
    sched.step(0.0)
    b = sched.add_request(make_request("b", [*prefix, 4, 5, 6], max_tokens=50), 1.0)
    sched.step(1.0)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [sched.pool.ref_cnt(x) for x in a.block_ids[:3]] == [2, 2, 1]
    assert sched.pool.num_active_blocks == 4  # 2 shared + one partial block each
    sched.abort("a")
    assert [sched.pool.ref_cnt(x) for x in b.block_ids[:2]] == [1, 1]


def test_prefix_caching_disabled_recomputes_everything():
    sched = make_scheduler(enable_prefix_caching=False)
    sched.add_request(make_request("a", 64, max_tokens=1), 0.0)
    run_until_idle(sched)
    sched.add_request(make_request("b", 64, max_tokens=1), 1.0)
    out = sched.step(1.0)
    assert out.num_scheduled_tokens == {"b": 64} and out.chunks["b"].num_cached_tokens == 0
    assert sched.take_kv_events() == []


# --- in-batch prefix caching (enable_in_batch_prefix_caching) ---------------------------------------------------------

PREFIX = list(range(1000, 1064))  # 4 full blocks of 16


def test_in_batch_prefix_caching_off_both_compute_the_prefix_on_the_second_waits_and_then_hits_4_blocks():
    def two_together(**overrides) -> Scheduler:
        sched = make_scheduler(**overrides)
        sched.add_request(make_request("a", [*PREFIX, *range(10)], max_tokens=2), 0.0)
        sched.add_request(make_request("b", [*PREFIX, *range(50, 60)], max_tokens=2), 0.0)
        return sched

    off = two_together().step(0.0)
    # vLLM's behaviour (the default): a block is cached only once computed, so b computes a's 4 blocks beside it.
    assert off.num_scheduled_tokens == {"a": 74, "b": 74} and off.chunks["b"].num_cached_tokens == 0

    sched = two_together(enable_in_batch_prefix_caching=True)
    first = sched.step(0.0)
    assert first.num_scheduled_tokens == {"a": 74}  # b's first block is being computed by a: held
    assert sched.is_waiting("b")
    second = sched.step(1.0)
    # a's 4 prefix blocks are stored now: b is admitted with them (64 tokens) and computes its own 10.
    assert second.num_scheduled_tokens == {"a": 1, "b": 10}
    assert second.chunks["b"].num_cached_tokens == 64 and second.num_prefill_tokens == 10
    tokens, _ = run_until_idle(sched)
    plain = make_request("b", [*PREFIX, *range(50, 60)], max_tokens=2)
    assert second.chunks["b"].token_ids + tokens["b"] == solo_output(plain)  # the same answer as alone


def test_in_batch_prefix_caching_holds_through_a_chunked_prefill_and_lets_other_prefixes_pass():
    # a's 74 tokens take 2 steps at 40 a step; b (same prefix) waits them out, c (another prefix, queued behind b)
    # does not wait for b.
    sched = make_scheduler(enable_in_batch_prefix_caching=True, max_num_batched_tokens=40)
    sched.add_request(make_request("a", [*PREFIX, *range(10)], max_tokens=1), 0.0)
    sched.add_request(make_request("b", [*PREFIX, *range(50, 60)], max_tokens=1), 0.0)
    sched.add_request(make_request("c", 20, offset=5000, max_tokens=1), 0.0)
    sched.add_request(make_request("d", 8, offset=7000, max_tokens=1), 0.0)
    _, steps = run_until_idle(sched)
    scheduled = [s.num_scheduled_tokens for s in steps]
    assert scheduled[0] == {"a": 40}  # 2 whole blocks and 8 tokens of the third: the budget is spent
    # a's last 34 tokens, then c, behind the held b, gets the 6 left (chunked). b is held: a computes its block 2.
    assert scheduled[1] == {"a": 34, "c": 6}
    # a stored the 4 prefix blocks: b is admitted with them (10 to compute) in queue order, before d.
    assert scheduled[2] == {"c": 14, "b": 10, "d": 8}
    first_chunks = {rid: c for s in steps for rid, c in s.chunks.items() if c.position == 0}
    assert first_chunks["b"].num_cached_tokens == 64 and first_chunks["c"].num_cached_tokens == 0


def test_in_batch_prefix_caching_admits_a_held_request_once_its_holder_is_aborted():
    # At most 16 tokens a prefill a step while others wait: a computes block 0 in the first step, b is held.
    sched = make_scheduler(
        enable_in_batch_prefix_caching=True, max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    sched.add_request(make_request("a", [*PREFIX, *range(10)], max_tokens=1), 0.0)
    sched.add_request(make_request("b", [*PREFIX, *range(50, 60)], max_tokens=1), 0.0)
    assert sched.step(0.0).num_scheduled_tokens == {"a": 16}
    assert sched.abort("a")
    out = sched.step(1.0)
    # Nobody computes b's block 1 any more: b is admitted, alone (no cap), hits a's stored block 0 and computes the
    # other 58 tokens itself.
    assert out.num_scheduled_tokens == {"b": 58} and out.chunks["b"].num_cached_tokens == 16
    assert not sched.has_unfinished_requests()


def test_in_batch_prefix_caching_does_not_deadlock_when_the_holder_is_preempted():
    # 7 blocks of 16, a budget of 64 and at most 16 tokens a prefill a step: x (31 tokens, then decoding), a and b (the
    # 4-block prefix and 10 tokens each) arrive together. Off, b computes the prefix beside a from the first step. On,
    # b is held while a computes it; a, the newest running request, is preempted when its fifth block does not fit
    # (x's decode grows); once x has finished a is admitted again and stores the prefix, and b follows with 4 blocks
    # from the cache. Every request finishes with its solo answer.
    overrides = {"enable_in_batch_prefix_caching": True, "num_gpu_blocks": 7, "max_model_len": 112}
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16, **overrides)
    requests = [
        make_request("x", 31, offset=9000, max_tokens=60),
        make_request("a", [*PREFIX, *range(10)], max_tokens=3),
        make_request("b", [*PREFIX, *range(50, 60)], max_tokens=3),
    ]
    for r in requests:
        sched.add_request(r, 0.0)
    tokens, steps = run_until_idle(sched)
    preempted_at = next(i for i, s in enumerate(steps) if "a" in s.preempted_ids)
    assert steps[0].num_scheduled_tokens == {"x": 16, "a": 16}  # b held from the first step
    assert all("b" not in s.num_scheduled_tokens for s in steps[: preempted_at + 1])
    assert set(tokens) == {"x", "a", "b"}
    for r in requests:
        assert tokens[r.request_id] == solo_output(r, **overrides)
    first_b = next(s.chunks["b"] for s in steps if "b" in s.chunks)
    assert first_b.num_cached_tokens == 64  # a stored the whole prefix again before b was admitted


# --- batching bounds --------------------------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", 100, max_tokens=2), 0.0)
    _, steps = run_until_idle(sched)
    # 100 = 32 + 32 + 32 + 4, then one decode; only the step that completes the prompt samples a token.
    assert [s.num_scheduled_tokens["a"] for s in steps] == [32, 32, 32, 4, 1]
    assert [bool(s.chunks) for s in steps] == [False, False, False, True, True]
    assert all(s.num_prefill_tokens <= 32 for s in steps)


def test_decodes_and_a_prefill_chunk_share_the_budget():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", 10, max_tokens=20), 0.0)
    sched.step(0.0)  # a prefilled, now decoding
    sched.add_request(make_request("b", 100, offset=300), 1.0)
    out = sched.step(1.0)
    assert out.num_scheduled_tokens == {"a": 1, "b": 31}  # the running decode goes first
    snap = sched.snapshot(1.0)
    assert snap.num_running == 2 and snap.num_waiting == 0
    assert snap.num_waiting_prefill_tokens == 69  # b's remaining prompt; a's pending token is a decode


def test_long_prefill_token_threshold_caps_a_prefill_s_share_of_a_step_while_others_wait_on_it():
    sched = make_scheduler(max_num_batched_tokens=128, long_prefill_token_threshold=24)
    sched.add_request(make_request("a", 10, max_tokens=20), 0.0)
    sched.step(0.0)  # a alone: prefilled whole, now decoding
    sched.add_request(make_request("b", 100, offset=300, max_tokens=2), 1.0)
    _, steps = run_until_idle(sched)
    # With a decoding, b gets at most 24 tokens a step (the budget would allow 127): 100 = 24 + 24 + 24 + 24 + 4.
    b_chunks = [s.num_scheduled_tokens["b"] for s in steps if "b" in s.num_scheduled_tokens]
    assert b_chunks[:5] == [24, 24, 24, 24, 4]
    assert all(s.num_scheduled_tokens.get("a", 1) == 1 for s in steps)  # a decodes in every step meanwhile


def test_long_prefill_token_threshold_leaves_a_lone_request_the_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=128, long_prefill_token_threshold=24)
    sched.add_request(make_request("a", 100, max_tokens=2), 0.0)
    _, steps = run_until_idle(sched)
    assert [s.num_scheduled_tokens["a"] for s in steps] == [100, 1]  # nobody to starve: not capped (vLLM's rule)


def test_long_prefill_token_threshold_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        MockEngineConfig(max_model_len=256, num_gpu_blocks=64, long_prefill_token_threshold=257)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    sched.add_request(make_request("a", 10, max_tokens=3), 0.0)
    sched.step(0.0)
    sched.add_request(make_request("b", 64, offset=300, max_tokens=1), 1.0)
    out = sched.step(1.0)
    assert out.num_scheduled_tokens == {"a": 1}  # 63 tokens left in the budget: b does not fit whole
    tokens, steps = run_until_idle(sched)
    assert {"b": 64} in [s.num_scheduled_tokens for s in steps]
    assert len(tokens["b"]) == 1


def test_max_num_seqs_bounds_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 10, offset=100 * i, max_tokens=4), 0.0)
    sched.step(0.0)
    assert [r.request_id for r in sched.running] == ["r0", "r1"] and len(sched.waiting) == 3
    snap = sched.snapshot(0.0)
    assert snap.num_running == 2 and snap.num_waiting == 3 and snap.num_waiting_prefill_tokens == 30
    assert snap.batch_size == 2
    tokens, steps = run_until_idle(sched)
    assert all(s.batch_size <= 2 for s in steps)
    assert sorted(tokens) == ["r0", "r1", "r2", "r3", "r4"] and all(len(t) in (3, 4) for t in tokens.values())


# --- preemption -------------------------------------------------------------------------------------------------------


def tight_config() -> dict:
    # 8 blocks of 4 tokens = 32 tokens; each request below grows to 8 + 20 = 28 tokens (7 blocks), so two of them
    # cannot both finish without one being preempted.
    return {"num_gpu_blocks": 8, "block_size": 4, "max_model_len": 32, "max_num_batched_tokens": 64}


def test_preemption_when_blocks_run_out_and_the_preempted_request_still_completes_identically():
    a = make_request("a", 8, offset=0, max_tokens=20)
    b = make_request("b", 8, offset=100, max_tokens=20)
    expected = {"a": solo_output(a, **tight_config()), "b": solo_output(b, **tight_config())}

    sched = make_scheduler(**tight_config())
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    tokens, steps = run_until_idle(sched)
    preempting = [s for s in steps if s.preempted_ids]
    assert preempting, "the pool is too small for both: someone must be preempted"
    assert preempting[0].preempted_ids == ["b"]  # the newest running request goes
    assert sched.num_preemptions >= 1
    assert tokens == expected
    assert sched.pool.num_active_blocks == 0


def test_a_preempted_request_goes_to_the_front_of_the_waiting_queue_without_blocks():
    sched = make_scheduler(**tight_config(), max_num_seqs=2)
    sched.add_request(make_request("a", 8, offset=0, max_tokens=20), 0.0)
    sched.add_request(make_request("b", 8, offset=100, max_tokens=20), 0.0)
    sched.add_request(make_request("c", 4, offset=200, max_tokens=20), 0.0)
    for i in range(100):
        out = sched.step(float(i))
        if out.preempted_ids:
            break
    else:
        raise AssertionError("no preemption")
    b = sched.requests["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert len(b.output_token_ids) > 0  # sampled tokens are kept and recomputed, not resampled
    snap = sched.snapshot(float(i))
    assert snap.num_preemptions == 1 and snap.num_waiting == 2
    # b must recompute prompt and outputs (minus its last sampled token's KV, which was never computed).
    assert snap.num_waiting_prefill_tokens == b.num_tokens + 4


def test_a_handed_over_waiting_request_queues_by_arrival_behind_the_preempted():
    # The queue after a preemption: b (preempted, front), then c (arrived at 0.0) and d (arrived at 5.0). A request
    # handed over by another engine that arrived at 3.0 goes between c and d; one that arrived at -1.0 (before
    # everyone) still goes behind b (a preempted request keeps the front); one that arrived at 9.0 goes last.
    sched = make_scheduler(**tight_config(), max_num_seqs=2)
    sched.add_request(make_request("a", 8, offset=0, max_tokens=20), 0.0)
    sched.add_request(make_request("b", 8, offset=100, max_tokens=20), 0.0)
    sched.add_request(make_request("c", 4, offset=200, max_tokens=20), 0.0)
    for i in range(100):
        if sched.step(float(i)).preempted_ids:
            break
    else:
        raise AssertionError("no preemption")
    sched.add_request(make_request("d", 4, offset=300, max_tokens=4), 5.0)
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]
    sched.add_request_by_arrival(make_request("x", 4, offset=400, max_tokens=4), 6.0, arrival_s=3.0)
    sched.add_request_by_arrival(make_request("y", 4, offset=500, max_tokens=4), 6.0, arrival_s=-1.0)
    sched.add_request_by_arrival(make_request("z", 4, offset=600, max_tokens=4), 6.0, arrival_s=9.0)
    assert [r.request_id for r in sched.waiting] == ["b", "y", "c", "x", "d", "z"]
    assert sched.requests["x"].arrival_s == 3.0 and sched.requests["x"].status is RequestStatus.WAITING
    assert sched.is_waiting("b") and sched.is_waiting("x") and not sched.is_waiting("a")
    assert not sched.is_waiting("nobody")
    tokens, _ = run_until_idle(sched)
    assert len(tokens["x"]) == len(tokens["y"]) == len(tokens["z"]) == 4


def test_a_request_committed_without_kv_queues_by_arrival_and_without_one_at_the_front():
    # A migration by recompute (no KV reserved): with its first arrival known (3.0) it queues as a handed-over
    # waiting request does, behind the preempted b and the earlier c, ahead of d (5.0); with none it goes first.
    sched = make_scheduler(**tight_config(), max_num_seqs=2)
    sched.add_request(make_request("a", 8, offset=0, max_tokens=20), 0.0)
    sched.add_request(make_request("b", 8, offset=100, max_tokens=20), 0.0)
    sched.add_request(make_request("c", 4, offset=200, max_tokens=20), 0.0)
    for i in range(100):
        if sched.step(float(i)).preempted_ids:
            break
    else:
        raise AssertionError("no preemption")
    sched.add_request(make_request("d", 4, offset=300, max_tokens=4), 5.0)
    moved = MigratingRequest("x", list(range(400, 404)), [], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.commit_migration(None, moved, 6.0, arrival_s=3.0)
    assert [r.request_id for r in sched.waiting] == ["b", "c", "x", "d"]
    assert sched.requests["x"].arrival_s == 3.0 and sched.requests["x"].status is RequestStatus.WAITING
    unknown = MigratingRequest("y", list(range(500, 504)), [], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.commit_migration(None, unknown, 6.0)
    assert [r.request_id for r in sched.waiting] == ["y", "b", "c", "x", "d"]
    assert sched.requests["y"].status is RequestStatus.PREEMPTED
    tokens, _ = run_until_idle(sched)
    assert len(tokens["x"]) == len(tokens["y"]) == 4


# --- output tokens ----------------------------------------------------------------------------------------------------


def test_output_tokens_are_deterministic_and_depend_on_prompt_and_seed():
    r = make_request("x", 30, max_tokens=16)
    assert solo_output(r) == solo_output(r)
    assert solo_output(r) == solo_output(make_request("other-id", 30, max_tokens=16))  # the id does not matter
    assert solo_output(r) != solo_output(make_request("x", 30, offset=1, max_tokens=16))
    assert solo_output(r) != solo_output(make_request("x", 30, max_tokens=16, seed=5))
    assert solo_output(r) != solo_output(r, seed=1)  # the engine seed


def test_resending_with_outputs_appended_continues_the_same_answer():
    r = make_request("x", 30, max_tokens=16)
    full = solo_output(r)
    resumed = solo_output(make_request("x", list(range(30)) + full[:6], max_tokens=10))
    assert resumed == full[6:]


def test_eos_and_stop_tokens_end_a_request_unless_ignored():
    small = {"vocab_size": 4, "eos_token_id": 3}
    prompt = [0, 1, 2, 0, 1, 2]
    stopped = make_scheduler(**small)
    stopped.add_request(make_request("a", prompt, max_tokens=200, ignore_eos=False), 0.0)
    tokens, steps = run_until_idle(stopped)
    # With 4 token ids, EOS comes up within a few tokens (200 draws without it: probability (3/4)^200).
    assert steps[-1].finished == {"a": FinishReason.STOP} and tokens["a"][-1] == 3 and 3 not in tokens["a"][:-1]

    ignoring = make_scheduler(**small)
    ignoring.add_request(make_request("a", prompt, max_tokens=200, ignore_eos=True), 0.0)
    tokens, steps = run_until_idle(ignoring)
    assert steps[-1].finished == {"a": FinishReason.LENGTH} and len(tokens["a"]) == 200

    stop_id = make_scheduler(**small)
    stop_id.add_request(make_request("a", prompt, max_tokens=200, stop_token_ids=[2]), 0.0)
    tokens, steps = run_until_idle(stop_id)
    assert steps[-1].finished == {"a": FinishReason.STOP} and tokens["a"][-1] == 2


def test_generation_stops_at_max_model_len():
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("a", 30, max_tokens=100), 0.0)
    tokens, steps = run_until_idle(sched)
    assert len(tokens["a"]) == 2 and steps[-1].finished == {"a": FinishReason.LENGTH}


# --- KV events --------------------------------------------------------------------------------------------------------


def test_kv_events_follow_prefill_and_decode_block_by_block():
    sched = make_scheduler()
    req = sched.add_request(make_request("a", 40, max_tokens=30), 0.0)
    run_until_idle(sched)
    events = sched.take_kv_events()
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    assert all(e.kind is KvEventKind.BLOCK_STORED and e.num_tokens_per_block == 16 for e in events)
    # 40 prompt + 30 outputs = 70 tokens, of which 69 were computed (the last sample never is): 4 full blocks.
    # Prefill stores blocks 0-1 at once; decode stores block 2 when token 48 is computed and block 3 at token 64.
    expected = block_hashes(req.all_token_ids[:64], 16)
    assert [e.block_hashes for e in events] == [expected[:2], expected[2:3], expected[3:4]]
    assert [e.parent_hash for e in events] == [None, expected[1], expected[2]]
    state = sched.kv_state()
    assert state.block_hashes == expected and state.last_event_id == 3 and state.block_size == 16


def test_evictions_emit_removed_events_for_stored_hashes():
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=256, max_num_batched_tokens=256)
    stored: list[int] = []
    removed: list[int] = []
    for i in range(6):  # 6 x 64-token prompts = 24 full blocks through a 16-block pool
        sched.add_request(make_request(f"r{i}", 64, offset=1000 * i, max_tokens=1), float(i))
        run_until_idle(sched)
        for e in sched.take_kv_events():
            (stored if e.kind is KvEventKind.BLOCK_STORED else removed).extend(e.block_hashes)
    assert removed and set(removed) <= set(stored)
    assert set(sched.kv_state().block_hashes) == set(stored) - set(removed)
    assert sched.pool.num_cached_blocks <= 16


# --- abort and snapshot -----------------------------------------------------------------------------------------------


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 40, max_tokens=100), 0.0)
    sched.add_request(make_request("wait", 40, offset=500, max_tokens=100), 0.0)
    sched.step(0.0)
    assert sched.pool.num_active_blocks == 3
    assert sched.abort("wait") and [r.request_id for r in sched.waiting] == []
    assert sched.abort("run") and sched.pool.num_active_blocks == 0
    assert not sched.abort("run") and not sched.abort("never-seen")
    snap = sched.snapshot(1.0)
    assert (snap.kv_usage, snap.num_running, snap.num_waiting, snap.batch_size) == (0.0, 0, 0, 0)
    assert not sched.has_unfinished_requests()


def test_snapshot_under_pressure():
    sched = make_scheduler(max_num_seqs=1, num_gpu_blocks=32)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 20, offset=100 * i, max_tokens=10), 0.0)
    sched.step(0.0)
    sched.step(1.0)
    snap = sched.snapshot(2.0)
    assert snap.now_s == 2.0
    assert snap.num_running == 1 and snap.num_waiting == 2
    assert snap.num_waiting_prefill_tokens == 40
    assert snap.num_total_blocks == 32 and snap.num_active_blocks == 2  # 20 + 2 tokens in 16-token blocks
    assert snap.kv_usage == pytest.approx(2 / 32)
    assert snap.batch_size == 1 and snap.num_kv_tokens == 21


def test_a_snapshot_reports_the_prefill_chunk_of_the_step_in_progress():
    # Budget 64 tokens a step. "a" (40 prompt tokens) is prefilled whole in step 1; a report then says 40 computed and
    # nothing queued. In step 2 "a" decodes (1 token) beside the first 63 of "b"'s 100: the report says 63 computed,
    # 37 still queued; the queue alone would show the next step's chunk, never this one's. Step 3: 37 and a decode.
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("a", 40, max_tokens=8), 0.0)
    sched.step(0.0)
    snap = sched.snapshot(0.5)
    assert (snap.num_prefill_tokens, snap.num_waiting_prefill_tokens, snap.batch_size) == (40, 0, 1)
    sched.add_request(make_request("b", 100, offset=1000, max_tokens=8), 1.0)
    out = sched.step(1.0)
    snap = sched.snapshot(1.5)
    assert out.num_prefill_tokens == 63 and out.num_decode_seqs == 1
    assert (snap.num_prefill_tokens, snap.num_waiting_prefill_tokens, snap.batch_size) == (63, 37, 2)
    sched.step(2.0)
    assert (sched.snapshot(2.5).num_prefill_tokens, sched.snapshot(2.5).num_waiting_prefill_tokens) == (37, 0)
    run_until_idle(sched)
    assert sched.snapshot(9.0).num_prefill_tokens == 0  # idle: no step in progress


def test_an_idle_engine_reports_no_batch_and_counts_its_cached_blocks_as_free():
    sched = make_scheduler()
    sched.add_request(make_request("a", 40, max_tokens=3), 0.0)
    run_until_idle(sched)
    snap = sched.snapshot(9.0)
    # Nothing runs: its 2 full prompt blocks stay cached but free (40 + 3 tokens in 16-token blocks: 2 full, 1 not).
    assert (snap.now_s, snap.num_running, snap.num_waiting, snap.num_waiting_prefill_tokens) == (9.0, 0, 0, 0)
    assert (snap.batch_size, snap.num_kv_tokens) == (0, 0)
    assert snap.num_active_blocks == 0 and snap.kv_usage == 0.0 and snap.num_total_blocks == 64
    assert sched.pool.num_cached_blocks == 2


def test_every_step_computes_its_prefill_tokens_plus_one_token_per_decoding_sequence():
    """What a step reports of its shape (prefill tokens, decoding sequences and the context they attend to) is what it
    scheduled, and its time is the perf model's for that shape: through chunked prefill (budget 64), prefix hits
    (every prompt starts with the same 32 tokens) and preemptions (16 blocks; 6 requests of 42 to 77 prompt tokens
    and 40 output tokens need 30 at their ends, 2 of them shared)."""
    sched = make_scheduler(num_gpu_blocks=16, max_num_batched_tokens=64)
    contexts: dict[str, int] = {}
    for i in range(6):
        req = make_request(f"r{i}", list(range(32)) + list(range(100 * i, 100 * i + 10 + 7 * i)), max_tokens=40)
        sched.add_request(req, 0.0)
    steps = []
    for k in range(500):
        if not sched.has_unfinished_requests():
            break
        # Each running request's context before the step: a decoding one attends to all of it.
        contexts = {r.request_id: r.num_tokens for r in sched.running if r.is_decoding}
        out = sched.step(float(k))
        steps.append(out)
        decoding = [rid for rid in out.num_scheduled_tokens if rid in contexts]
        assert out.num_decode_seqs == len(decoding)
        assert out.num_decode_kv_tokens == sum(contexts[rid] for rid in decoding)
        assert all(out.num_scheduled_tokens[rid] == 1 for rid in decoding)
        assert sum(out.num_scheduled_tokens.values()) == out.num_prefill_tokens + out.num_decode_seqs
        model = sched.config.step_time_model
        assert (
            out.step_time_s
            == model.step_ms(out.num_prefill_tokens, out.num_decode_seqs, out.num_decode_kv_tokens) / 1000
        )
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0 and any(out.num_prefill_tokens == 64 for out in steps)


# -- remote prefill (disaggregated serving) --------------------------------------------------------------------------


def _first_token(sched: Scheduler, req: GenerateRequest) -> int:
    """The token a prefill engine (same config) samples first for ``req``."""
    prefill = Scheduler(sched.config)
    prefill.add_request(GenerateRequest(req.request_id, req.token_ids, req.sampling), 0.0)
    tokens, _ = run_until_idle(prefill)
    return tokens[req.request_id][0]


def test_a_remotely_prefilled_request_decodes_the_same_tokens_without_computing_its_prompt():
    req = make_request("r", 100, max_tokens=6)
    local = make_scheduler()
    local.add_request(make_request("r", 100, max_tokens=6), 0.0)
    want, _ = run_until_idle(local)

    sched = make_scheduler()
    reserved = sched.reserve_remote_prefill(req, 0.0)
    assert reserved is not None and reserved.status is RequestStatus.REMOTE_PREFILL
    assert len(reserved.block_ids) == 7  # ceil(100 / 16): the whole prompt's blocks, held while it is prefilled
    assert not sched.has_unfinished_requests()  # nothing to step until the KV arrives
    assert sched.snapshot(0.0).num_running == 1
    first = sched.commit_remote_prefill("r", _first_token(sched, req))
    assert first is not None and first.num_prompt_tokens == 100 and first.finish_reason is None
    assert [e.kind for e in sched.take_kv_events()] == [KvEventKind.BLOCK_STORED]  # its 6 full blocks, now cached
    got, steps = run_until_idle(sched)
    assert first.token_ids + got["r"] == want["r"]
    assert all(s.num_prefill_tokens == 0 for s in steps)  # decode steps only: the prompt was never computed here


def test_a_reservation_shares_the_cached_prefix_and_counts_it():
    sched = make_scheduler()
    sched.add_request(make_request("warm", 64, max_tokens=1), 0.0)
    run_until_idle(sched)
    assert sched.cached_prefix_tokens(list(range(100))) == 64  # the 4 full blocks the first prompt stored
    assert sched.cached_prefix_tokens(list(range(64))) == 48  # never the whole prompt: one token must be computed
    free_before = sched.pool.num_free_blocks
    reserved = sched.reserve_remote_prefill(make_request("r", 100), 0.0)
    assert reserved is not None and reserved.num_cached_tokens == 64
    # 7 blocks: the 4 cached ones reactivated (idle cached blocks count as free until reused) and 3 new.
    assert free_before - sched.pool.num_free_blocks == 7 and len(reserved.block_ids) == 7
    assert reserved.num_stored_blocks == 4


def test_a_cancelled_reservation_is_prefilled_locally_and_an_aborted_one_frees_its_blocks():
    sched = make_scheduler()
    free = sched.pool.num_free_blocks
    assert sched.reserve_remote_prefill(make_request("a", 100), 0.0) is not None
    assert sched.abort("a") and sched.pool.num_free_blocks == free and not sched.requests
    assert sched.commit_remote_prefill("a", 1) is None  # gone: a late result commits nothing

    assert sched.reserve_remote_prefill(make_request("b", 100, max_tokens=3), 0.0) is not None
    assert sched.cancel_remote_prefill("b") and sched.pool.num_free_blocks == free
    got, steps = run_until_idle(sched)
    assert len(got["b"]) == 3 and steps[0].num_prefill_tokens == 100  # computed here after all
    assert not sched.cancel_remote_prefill("b")


def test_a_reservation_without_room_changes_nothing_and_a_bad_prompt_is_refused():
    sched = make_scheduler(num_gpu_blocks=16)
    assert sched.reserve_remote_prefill(make_request("big", 250), 0.0) is not None  # 16 blocks: all of them
    assert sched.reserve_remote_prefill(make_request("more", 100), 0.0) is None
    assert "more" not in sched.requests
    with pytest.raises(PromptTooLongError):
        sched.reserve_remote_prefill(make_request("long", 300), 0.0)
    with pytest.raises(DuplicateRequestError):
        sched.reserve_remote_prefill(make_request("big", 10), 0.0)


def test_a_first_token_that_ends_the_request_finishes_it_at_commit():
    sched = make_scheduler()
    free = sched.pool.num_free_blocks
    sched.reserve_remote_prefill(make_request("one", 40, max_tokens=1), 0.0)
    chunk = sched.commit_remote_prefill("one", 5)
    assert chunk is not None and chunk.token_ids == [5] and chunk.finish_reason is FinishReason.LENGTH
    assert not sched.requests and sched.pool.num_free_blocks == free


# --- host-memory tier -------------------------------------------------------------------------------------------------


def test_a_prefix_evicted_from_the_device_is_loaded_from_the_host_tier_at_the_modelled_cost():
    # 8 device blocks of 16 tokens, a host tier of 32; prefill 10 ms + 0.5 ms a token; loads at 8 Gb/s (1 GB/s).
    sched = make_scheduler(
        num_gpu_blocks=8,
        max_model_len=128,
        max_num_batched_tokens=128,
        num_host_blocks=32,
        host_kv_bandwidth_gbps=8.0,
        host_kv_latency_ms=0.1,
        prefill_base_ms=10,
        prefill_ms_per_token=0.5,
        prefill_ms_per_token_sq=0,
    )
    a = list(range(1000, 1064))  # 4 full blocks
    sched.add_request(make_request("a", a, max_tokens=1), 0.0)
    run_until_idle(sched)
    sched.add_request(make_request("b", 120, max_tokens=1, offset=5000), 1.0)  # 8 blocks: evicts a's from the device
    run_until_idle(sched)
    assert sched.pool.lookup_prefix(block_hashes(a, 16)) == [] and sched.pool.num_host_cached_blocks == 4 + 7
    sched.add_request(make_request("a2", [*a, *range(10)], max_tokens=1), 2.0)
    out = sched.step(2.0)
    # a's 64 tokens come from host memory: only the 10 new ones are computed, and the step waits for the load of 4
    # blocks of 2 MiB (Llama-3-8B's 2 x 32 layers x 8 heads x 128 dims x 2 bytes x 16 tokens) at 1 GB/s.
    assert out.num_scheduled_tokens == {"a2": 10} and out.num_host_loaded_blocks == 4
    chunk = out.chunks["a2"]
    assert chunk.num_cached_tokens == 64 and chunk.num_host_cached_tokens == 64
    load_ms = 0.1 + 4 * 2 * 1024 * 1024 * 8 / 8e9 * 1e3
    assert out.step_time_s == pytest.approx((10 + 0.5 * 10 + load_ms) / 1e3)
    # The loaded blocks are on the device again: the next request with that prefix finds them there.
    sched.add_request(make_request("a3", [*a, *range(20, 30)], max_tokens=1), 3.0)
    out = sched.step(3.0)
    assert out.chunks["a3"].num_cached_tokens == 64 and out.chunks["a3"].num_host_cached_tokens == 0
    assert out.num_host_loaded_blocks == 0


def test_without_a_host_tier_an_evicted_prefix_is_recomputed():
    sched = make_scheduler(num_gpu_blocks=8, max_model_len=128, max_num_batched_tokens=128)
    a = list(range(1000, 1064))
    sched.add_request(make_request("a", a, max_tokens=1), 0.0)
    run_until_idle(sched)
    sched.add_request(make_request("b", 120, max_tokens=1, offset=5000), 1.0)
    run_until_idle(sched)
    sched.add_request(make_request("a2", [*a, *range(10)], max_tokens=1), 2.0)
    out = sched.step(2.0)
    assert out.num_scheduled_tokens == {"a2": 74} and out.chunks["a2"].num_cached_tokens == 0
    assert all(e.medium is None for e in sched.take_kv_events())
