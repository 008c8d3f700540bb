"""The ITL the tokens see, from load reports sampled at pulls (components/planner/sla/itl.py).

The steps of the tests (ROUND, tests/unit/planner/sla/support.py: prefill 10 ms + 0.04 ms/token; decode 5 ms + 0.02
ms/sequence + 3e-5 ms/KV token): a batch of 20 over 22000 KV tokens decodes in 5 + 0.4 + 0.66 = 6.06 ms; with a
2000-token prompt chunk beside it the step takes 10 + 80 + 6.06 = 96.06 ms.
"""

from __future__ import annotations

import bisect
import math
import random

import pytest

from components.perf.model import StepTimeModel
from components.planner.sla import itl
from tests.unit.planner.sla.support import ROUND

pytestmark = pytest.mark.unit

DECODE_MS = 5 + 0.02 * 20 + 3e-5 * 22_000
CHUNK_MS = 10 + 0.04 * 2000 + DECODE_MS


def test_a_steps_time_is_its_decode_part_plus_the_chunk_it_computes():
    assert itl.step_ms(ROUND, 20, 22_000, 0) == pytest.approx(DECODE_MS)
    assert itl.step_ms(ROUND, 20, 22_000, 2000) == pytest.approx(CHUNK_MS)
    # The step's own chunk is what counts, not the queue left after it: 5000 tokens still wait, the step computes 2000.
    assert itl.step_ms(ROUND, 20, 22_000, 2000, waiting_prefill_tokens=5000) == pytest.approx(CHUNK_MS)


def test_without_the_steps_chunk_the_queue_is_read_within_the_budget_and_the_free_kv():
    # An engine that does not report its step's chunk: the queue's 5000 tokens (< 8192 - 20), 10 + 200 + 6.06 ms;
    # 20000 waiting are cut to the budget left by the batch, 8172; a full cache prefills nothing; 160 free KV tokens
    # take 160.
    assert itl.step_ms(ROUND, 20, 22_000, None, waiting_prefill_tokens=5000) == pytest.approx(210 + DECODE_MS)
    assert itl.step_ms(ROUND, 20, 22_000, None, waiting_prefill_tokens=20_000) == pytest.approx(
        10 + 0.04 * 8172 + DECODE_MS
    )
    assert itl.step_ms(ROUND, 20, 22_000, None, waiting_prefill_tokens=5000, free_kv_tokens=0) == pytest.approx(
        DECODE_MS
    )
    assert itl.step_ms(ROUND, 20, 22_000, None, waiting_prefill_tokens=5000, free_kv_tokens=160) == pytest.approx(
        10 + 0.04 * 160 + DECODE_MS
    )


def test_reports_sampled_in_time_give_the_mean_gap_the_tokens_saw():
    # One worker repeats a chunk step (96.06 ms) then 10 decode steps (6.06 ms each), 20 sequences decoding in every
    # step: a cycle of 156.66 ms sends 11 x 20 tokens, each 220 of them after a gap of its step, so the tokens' mean
    # gap is 156.66 / 11 = 14.24 ms. A report describes the step in progress: reports taken at evenly spread instants
    # land in the chunk step 96.06 / 156.66 = 61% of the time. Their plain mean is the time-weighted step,
    # (96.06^2 + 10 x 6.06^2) / 156.66 = 61.25 ms, 4.3x what the tokens saw; weighted by batch / step it is 14.24.
    shape = [(2000, CHUNK_MS)] + [(0, DECODE_MS)] * 10
    cycle_ms = sum(ms for _, ms in shape)
    truth = sum(20 * ms for _, ms in shape) / (20 * len(shape))
    assert truth == pytest.approx(cycle_ms / 11) and truth == pytest.approx(14.2418, abs=1e-3)
    starts = [sum(ms for _, ms in shape[:k]) for k in range(len(shape))]
    sampled = itl.ItlSum()
    plain = []
    n = 10_007  # instants spread over 100 cycles, not in step with them
    for k in range(n):
        t = (k * 100 * cycle_ms / n) % cycle_ms
        chunk, _ = shape[bisect.bisect_right(starts, t) - 1]
        ms = itl.step_ms(ROUND, 20, 22_000, chunk)
        sampled = sampled.add(20, ms)
        plain.append(ms)
    assert sampled.mean_ms == pytest.approx(truth, rel=0.01)
    assert sum(plain) / n == pytest.approx((CHUNK_MS**2 + 10 * DECODE_MS**2) / cycle_ms, rel=0.01)


def test_workers_with_more_sequences_weigh_more():
    # Two workers at one pull: 40 sequences stepping in 10 ms send 4000 tokens/s, 10 stepping in 50 ms 200: their
    # tokens' mean gap is (4000 x 10 + 200 x 50) / 4200 = 11.90 ms, not (10 + 50) / 2 = 30.
    s = itl.ItlSum().add(40, 10.0).add(10, 50.0)
    assert s.mean_ms == pytest.approx((4000 * 10 + 200 * 50) / 4200)
    # Sums add: two pulls' samples make the interval's.
    assert (itl.ItlSum().add(40, 10.0) + itl.ItlSum().add(10, 50.0)).mean_ms == pytest.approx(s.mean_ms)


def test_no_sample_is_no_prediction():
    assert itl.ItlSum().mean_ms is None
    assert itl.ItlSum().add(0, 6.0).add(20, 0.0).mean_ms is None


# The live check's engine (kvmesh bench planner-live: 20 + 3 ms a sequence, 10 + 0.1 ms a prompt token).
LIVE = StepTimeModel(
    prefill_base_ms=10.0,
    prefill_ms_per_token=0.1,
    prefill_ms_per_token_sq=0.0,
    decode_base_ms=20.0,
    decode_ms_per_seq=3.0,
    decode_ms_per_kv_token=0.0,
)


def test_the_expected_chunk_part_matches_a_hand_computation():
    # 9 sequences a worker (the live check's edge: 20 + 27 = 47 ms), 1 prompt/s of 700 tokens. A step takes the
    # prompts that arrived during the one before, K ~ Poisson(t / 1000) for a mean step t ms, each 10 + 70 ms beside
    # the decode: t = 47 + 10 (1 - exp(-t / 1000)) + 0.07 t. From t = 51: 10 (1 - exp(-0.051)) = 0.497, t = 47.497 /
    # 0.93 = 51.07; again, the same to 0.01 ms. The sampled prediction's expectation is close (a report lands in a
    # 127 ms chunk step 0.973 x 0.127 = 12.4% of the time: 1 / (0.876 / 47 + 0.124 / 127) = 50.97 ms), but an
    # interval holds 14-20 reports, of which 1-5 landed in one: 3.5-8% apart between draws.
    t = itl.expected_step_ms(LIVE, 47.0, 9, 1.0, 700)
    assert t == pytest.approx(51.07, abs=0.01)
    assert t == pytest.approx(47 + 10 * (1 - math.exp(-t / 1000)) + 0.07 * t, abs=1e-9)


def test_no_prompts_leave_the_decode_part_and_a_worker_short_of_steps_takes_a_full_chunk_at_each():
    assert itl.expected_step_ms(LIVE, 47.0, 9, 0.0, 700) == 47.0
    # 20 prompts/s of 700 tokens need 20 x 80 = 1600 ms of prefill a second: every step computes the whole budget,
    # 8192 - 9 tokens (10 + 818.3 ms), the rest queues.
    assert itl.expected_step_ms(LIVE, 47.0, 9, 20.0, 700) == pytest.approx(47 + 10 + 0.1 * (8192 - 9))


def _simulated_mean_step_ms(perf: StepTimeModel, decode_ms: float, batch: int, rate: float, tokens: int) -> float:
    """An engine stepping as the expectation assumes, seeded: Poisson arrivals, each step computing what arrived
    during the one before (up to the budget; the rest waits), beside its decode part."""
    rng = random.Random(1)
    budget = perf.max_num_batched_tokens - batch
    prev_ms, total_ms, backlog, steps = decode_ms, 0.0, 0, 200_000
    for _ in range(steps):
        arrived, at_s = 0, rng.expovariate(rate)
        while at_s < prev_ms / 1e3:
            arrived, at_s = arrived + 1, at_s + rng.expovariate(rate)
        backlog += arrived * tokens
        chunk = min(backlog, budget)
        backlog -= chunk
        prev_ms = decode_ms + perf.prefill_ms(chunk)
        total_ms += prev_ms
    return total_ms / steps


@pytest.mark.parametrize(
    ("perf", "decode_ms", "batch", "rate", "tokens"),
    [
        (LIVE, 47.0, 9, 1.0, 700),  # the live check
        (StepTimeModel(), 10.0, 16, 1.1, 8000),  # the step load's plateau: 8000-token prompts, ~1 a worker a second
        (StepTimeModel(), 30.0, 170, 8.0, 1000),  # a sinusoid's peak: many prompts share a step's base cost
    ],
)
def test_the_expected_step_matches_an_engine_stepping_so(
    perf: StepTimeModel, decode_ms: float, batch: int, rate: float, tokens: int
) -> None:
    # The mean field (K drawn over the mean step, not the step before) is within 1% of the stepped engine here.
    # Not near saturation with short decode steps (ROUND, 6 ms, 20 prompts/s of 1000 tokens, 80% of a second in
    # prefill: 67.3 ms against 49.4 stepped): there short steps follow short steps, the chunk steps bunch, and fewer
    # steps carry one than Poisson over the mean step says (docs/sla-planner.md, "The chunk part in expectation").
    simulated = _simulated_mean_step_ms(perf, decode_ms, batch, rate, tokens)
    assert itl.expected_step_ms(perf, decode_ms, batch, rate, tokens) == pytest.approx(simulated, rel=0.01)
