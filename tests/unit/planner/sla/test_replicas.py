"""The SLA planner's replica formulas on ``StepTimeModel``s whose step times are worked out by hand here.

ROUND: prefill 10 ms + 0.04 ms/token (no square term): a 1000-token prompt takes 50 ms, 20000 tokens/s per
worker. Decode: the defaults (5 ms + 0.02 ms/sequence + 3e-5 ms/KV token); with isl 1000 and osl 200 a sequence
holds 1000 + 200 / 2 = 1100 KV tokens on average, so a batch of b steps in 5 + (0.02 + 1100 x 3e-5) b = 5 + 0.053 b ms.
"""

from __future__ import annotations

import math

import pytest

from components.perf.model import StepTimeModel
from components.perf.profile import Profile
from components.planner.sla.replicas import DEFAULT_MAX_BATCH, decode_workers, prefill_workers, workers_for

pytestmark = pytest.mark.unit

ROUND = StepTimeModel(prefill_base_ms=10.0, prefill_ms_per_token=0.04, prefill_ms_per_token_sq=0.0)


def test_prefill_workers_are_prompt_tokens_over_one_workers_throughput():
    # 30 requests/s x 1000 tokens = 30000 tokens/s over 20000 per worker = 1.5 -> 2.
    workers, d = prefill_workers(30, 1000, ROUND, ttft_target_s=0.5)
    assert workers == 2
    assert d.target_met
    assert d.metrics["prefill_s"] == pytest.approx(0.050)
    assert d.metrics["worker_tokens_per_s"] == pytest.approx(20000)
    assert d.metrics["demand_tokens_per_s"] == pytest.approx(30000)


def test_an_exact_multiple_asks_for_exactly_that_many():
    # 40 requests/s x 1000 = 40000 tokens/s = exactly 2 workers' 20000: 2, not 3 (float slack in the ceiling).
    assert prefill_workers(40, 1000, ROUND, ttft_target_s=0.5)[0] == 2
    assert prefill_workers(40.001, 1000, ROUND, ttft_target_s=0.5)[0] == 3


def test_the_correction_factor_scales_the_prefill_time():
    # Observed 1.2x slower: 60 ms a prompt, 16667 tokens/s; 40000 / 16667 = 2.4 -> 3.
    workers, d = prefill_workers(40, 1000, ROUND, ttft_target_s=0.5, correction=1.2)
    assert workers == 3
    assert d.metrics["prefill_s"] == pytest.approx(0.060)


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks_on_the_default_model():
    # Default model, isl 10000 with max_num_batched_tokens 8192: one chunk of 8192 then 1808.
    m = StepTimeModel()

    def p(n):  # the default polynomial, ms
        return m.prefill_base_ms + m.prefill_ms_per_token * n + m.prefill_ms_per_token_sq * n * n

    s = (p(8192) + p(1808)) / 1e3  # 0.1697 + 0.0455 = 0.215 s
    workers, d = prefill_workers(20, 10000, m, ttft_target_s=3.0)
    assert d.metrics["prefill_s"] == pytest.approx(s)
    assert workers == math.ceil(20 * s)  # 20 x 10000 tokens/s over 10000 / s per worker = 20 s = 4.3 -> 5
    assert workers == 5


def test_a_prompt_that_alone_breaks_the_ttft_target_is_flagged_and_sized_on_throughput():
    # Default model, 8192 tokens: 16.5 + 0.01518 x 8192 + 4.21e-7 x 8192^2 = 16.5 + 124.35 + 28.25 = 169.1 ms > 100.
    workers, d = prefill_workers(10, 8192, StepTimeModel(), ttft_target_s=0.1)
    assert not d.target_met
    assert "over the 100 ms TTFT target" in d.reason
    assert d.metrics["prefill_s"] == pytest.approx(0.1691, abs=1e-4)
    assert workers == 2  # 10 prompts/s x 0.169 s each = 1.69 workers busy all the time


def test_queue_wait_caps_each_workers_utilisation_so_the_mean_ttft_meets_the_target():
    # S = 0.05 s, T = 0.5 s: rho = 2 (T - S) / (2T - S) = 0.9 / 0.95 = 0.947; 40 prompts/s x 0.05 s = 2 workers
    # busy all the time, over 0.947 each: 2.11 -> 3 (without the queue: exactly 2).
    s, t = 0.05, 0.5
    rho = 2 * (t - s) / (2 * t - s)
    assert rho * s / (2 * (1 - rho)) + s == pytest.approx(t)  # M/D/1 mean wait + service = the target exactly
    workers, d = prefill_workers(40, 1000, ROUND, ttft_target_s=t, queue_wait=True)
    assert d.metrics["max_utilisation"] == pytest.approx(rho)
    assert workers == 3
    assert prefill_workers(40, 1000, ROUND, ttft_target_s=t)[0] == 2


def test_decode_takes_the_largest_batch_within_the_itl_target():
    # 5 + 0.053 b <= 20 ms: b <= 283.02, so b = 283 (19.999 ms); b = 284 would take 20.052 ms.
    # 100 requests/s x 200 output tokens = 20000 tokens/s over 283 / 0.019999 = 14151 per worker: 1.41 -> 2.
    workers, d = decode_workers(100, 1000, 200, StepTimeModel(), itl_target_s=0.020, max_batch=512)
    assert d.metrics["batch"] == 283
    assert d.metrics["step_s"] == pytest.approx((5 + 0.053 * 283) / 1e3)
    assert d.metrics["kv_tokens"] == pytest.approx(283 * 1100)
    assert d.metrics["worker_tokens_per_s"] == pytest.approx(283 / 0.019999)
    assert workers == 2
    assert d.target_met


def test_decode_batch_is_capped_by_max_batch_and_kv_capacity():
    # The default max_batch (1024, vLLM's on an H100) is above 283: the ITL target decides.
    assert DEFAULT_MAX_BATCH == 1024
    assert decode_workers(100, 1000, 200, StepTimeModel(), itl_target_s=0.020)[1].metrics["batch"] == 283
    # max_batch 256 < 283: b = 256, step 5 + 13.568 = 18.568 ms.
    _, d = decode_workers(100, 1000, 200, StepTimeModel(), itl_target_s=0.020, max_batch=256)
    assert d.metrics["batch"] == 256
    assert d.metrics["step_s"] == pytest.approx(0.018568)
    # 100000 KV tokens hold 100000 / 1100 = 90.9 sequences: b = 90.
    _, d = decode_workers(100, 1000, 200, StepTimeModel(), itl_target_s=0.020, kv_capacity_tokens=100_000)
    assert d.metrics["batch"] == 90


def test_the_decode_correction_factor_shrinks_the_batch():
    # Observed 2x the model: 2 (5 + 0.053 b) <= 20 -> b <= 94.3 -> 94.
    # 100 x 200 = 20000 tokens/s over 94 / (2 x 9.982 ms) = 4708.5 per worker: 4.25 -> 5.
    workers, d = decode_workers(100, 1000, 200, StepTimeModel(), itl_target_s=0.020, correction=2.0)
    assert d.metrics["batch"] == 94
    assert d.metrics["step_s"] == pytest.approx(2 * (5 + 0.053 * 94) / 1e3)
    assert workers == 5


def test_an_itl_target_under_one_sequences_step_is_flagged_and_sized_on_batch_one():
    # One sequence: 5 + 0.053 = 5.053 ms > 4 ms. Sized on 1 / 5.053 ms = 197.9 tokens/s per worker:
    # 2 requests/s x 200 = 400 tokens/s -> 2.02 -> 3.
    workers, d = decode_workers(2, 1000, 200, StepTimeModel(), itl_target_s=0.004)
    assert not d.target_met
    assert d.metrics["batch"] == 1
    assert "over the 4 ms ITL target" in d.reason
    assert workers == 3


def test_no_load_still_keeps_one_worker_in_each_pool():
    assert prefill_workers(0, 1000, ROUND, ttft_target_s=0.5)[0] == 1
    assert decode_workers(0, 1000, 200, StepTimeModel(), itl_target_s=0.05)[0] == 1
    assert workers_for(0.0, 10.0) == 1


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="ttft_target_s"):
        prefill_workers(1, 1000, ROUND, ttft_target_s=0)
    with pytest.raises(ValueError, match="requests_per_s"):
        decode_workers(-1, 1000, 200, ROUND, itl_target_s=0.05)
    with pytest.raises(ValueError, match="max_batch"):
        decode_workers(1, 1000, 200, ROUND, itl_target_s=0.05, max_batch=0)


def test_a_measured_profile_gives_the_same_sizes_as_the_model_it_measured():
    # A Profile whose grid points are ROUND's own step times: prefill is linear in n (no square term), so the
    # piecewise-linear interpolation between grid points is exact; decode 5 + 0.02 b + 3e-5 b c is of the form
    # a + x b + y c + z b c, which bilinear interpolation over (batch, context) reproduces exactly inside the grid.
    # The replica formulas only read the PerfModel protocol, so both must give the same workers and batch.
    prompts = [128, 1024, 8192]
    batches, contexts = [1, 64, 512], [256.0, 4096.0]
    prof = Profile.build(
        prompt_tokens=prompts,
        prefill_samples_ms=[[ROUND.prefill_ms(n)] for n in prompts],
        batch_sizes=batches,
        context_tokens=contexts,
        decode_samples_ms=[[[ROUND.decode_ms(b, b * c)] for c in contexts] for b in batches],
        max_num_batched_tokens=ROUND.max_num_batched_tokens,
    )
    assert prof.decode_ms(283, 283 * 1100) == pytest.approx(ROUND.decode_ms(283, 283 * 1100))
    for perf in (ROUND, prof):
        workers, d = prefill_workers(30, 1000, perf, ttft_target_s=0.5)
        assert workers == 2 and d.metrics["prefill_s"] == pytest.approx(0.050)
        workers, d = decode_workers(100, 1000, 200, perf, itl_target_s=0.020, max_batch=512)
        assert workers == 2 and d.metrics["batch"] == 283
