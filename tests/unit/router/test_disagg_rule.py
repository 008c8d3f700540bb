"""The "prefill remotely?" rule of conditional disaggregation, as a pure function: both thresholds and their
boundaries, cached tokens, and the branches where there is nowhere to send the prompt."""

from __future__ import annotations

import pytest

from components.router.policies import POLICIES
from components.router.policies.disagg import (
    DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
    DEFAULT_MAX_PREFILL_QUEUE_SIZE,
    PrefillDecision,
    PrefillKind,
    decide_prefill,
)

pytestmark = pytest.mark.unit

# Small thresholds so the numbers below read at a glance.
MAX_LOCAL = 100
MAX_QUEUE = 2


def decide(
    prompt: int,
    cached: int = 0,
    *,
    queue: int | None = 0,
    prefill_workers: int = 1,
    max_local: int = MAX_LOCAL,
    max_queue: int = MAX_QUEUE,
) -> PrefillDecision:
    return decide_prefill(
        prompt,
        cached,
        queue_size=queue,
        prefill_workers=prefill_workers,
        max_local_prefill_length=max_local,
        max_prefill_queue_size=max_queue,
    )


def test_a_long_prompt_with_room_in_the_queue_is_prefilled_remotely():
    d = decide(500, queue=0)
    assert d.remote and d.kind == PrefillKind.REMOTE and d.uncached_tokens == 500
    assert "500 uncached prompt tokens > max_local_prefill_length 100" in d.reason
    assert "queue holds 0 < 2 items" in d.reason


@pytest.mark.parametrize(("prompt", "remote"), [(99, False), (100, False), (101, True)])
def test_the_length_threshold_is_strict_the_boundary_stays_local(prompt, remote):
    d = decide(prompt)
    assert d.remote is remote
    assert d.kind == (PrefillKind.REMOTE if remote else PrefillKind.SHORT)


@pytest.mark.parametrize(("queue", "remote"), [(0, True), (1, True), (2, False), (7, False)])
def test_the_queue_threshold_is_strict_a_queue_at_its_size_is_full(queue, remote):
    d = decide(500, queue=queue)
    assert d.remote is remote
    if not remote:
        assert d.kind == PrefillKind.QUEUE_FULL
        assert f"holds {queue} items >= max_prefill_queue_size 2" in d.reason


def test_cached_tokens_shorten_the_uncached_part():
    # 500 - 400 cached = 100 uncached: at the threshold, so local; one token less cached is 101, remote.
    short = decide(500, 400)
    assert (short.kind, short.uncached_tokens) == (PrefillKind.SHORT, 100)
    assert "100 uncached prompt tokens (500 - 400 cached) <= max_local_prefill_length 100" in short.reason
    long = decide(500, 399)
    assert (long.kind, long.uncached_tokens) == (PrefillKind.REMOTE, 101)


def test_a_fully_cached_prompt_and_a_cache_report_longer_than_the_prompt_leave_nothing_to_prefill():
    assert decide(500, 500).uncached_tokens == 0
    assert decide(500, 512).uncached_tokens == 0  # whole blocks may overstate: counts as the whole prompt
    assert decide(0, 0, max_local=0).kind == PrefillKind.SHORT  # nothing to compute is never sent anywhere


def test_without_a_prefill_worker_a_long_prompt_is_prefilled_locally():
    d = decide(5000, queue=0, prefill_workers=0)
    assert not d.remote and d.kind == PrefillKind.NO_PREFILL_WORKERS
    assert "no prefill worker" in d.reason and "5000 tokens locally" in d.reason


def test_a_full_queue_keeps_a_long_prompt_local():
    d = decide(5000, queue=MAX_QUEUE)
    assert not d.remote and d.kind == PrefillKind.QUEUE_FULL


def test_an_unknown_queue_depth_is_a_decision_not_an_exception():
    d = decide(5000, queue=None)
    assert not d.remote and d.kind == PrefillKind.QUEUE_UNKNOWN and "unknown" in d.reason


def test_a_short_prompt_is_decided_before_the_queue_is_looked_at():
    # The caller may skip reading the queue for a short prompt: None (unknown) and no workers change nothing.
    for queue, workers in ((None, 0), (99, 1), (0, 0)):
        assert decide(50, queue=queue, prefill_workers=workers).kind == PrefillKind.SHORT


def test_zero_thresholds_turn_remote_prefill_off_or_send_every_uncached_token():
    assert decide(10_000, queue=0, max_queue=0).kind == PrefillKind.QUEUE_FULL
    assert decide(1, queue=0, max_local=0).kind == PrefillKind.REMOTE


def test_negative_token_counts_are_a_callers_bug():
    with pytest.raises(ValueError, match="cannot be negative"):
        decide(-1)
    with pytest.raises(ValueError, match="cannot be negative"):
        decide(10, -1)


def test_the_reason_is_formatted_once_and_equality_ignores_its_wording():
    calls = []

    def why() -> str:
        calls.append(1)
        return "text"

    d = PrefillDecision(PrefillKind.SHORT, 3, why)
    assert calls == []  # not formatted until read
    assert d.reason == "text" and d.reason == "text" and calls == [1]
    assert d == PrefillDecision(PrefillKind.SHORT, 3, "other words")
    assert d != PrefillDecision(PrefillKind.SHORT, 4, "text")
    assert "kind=<PrefillKind.SHORT: 'short'>" in repr(d)


def test_the_defaults_are_dynamo_s_and_the_rule_is_not_a_routing_policy():
    # examples/llm/utils/vllm.py in ai-dynamo/dynamo: --max-local-prefill-length 1000, --max-prefill-queue-size 3.
    assert (DEFAULT_MAX_LOCAL_PREFILL_LENGTH, DEFAULT_MAX_PREFILL_QUEUE_SIZE) == (1000, 3)
    assert not any("disagg" in name for name in POLICIES)
