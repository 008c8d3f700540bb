"""The one TTFT model the router and the SLA planner share (components/perf/queueing.py), worked out by hand, and the
router's per-worker wait shown to be that model on the rates the router keeps."""

from __future__ import annotations

import pytest

from components.perf.model import StepTimeModel
from components.perf.profile import Profile
from components.perf.queueing import (
    STEP_RESIDUAL_SHARE,
    predicted_ttft_ms,
    prefill_fixed_ms,
    prefill_ms_per_prompt_token,
    queued_wait_ms,
    step_residual_ms,
)
from components.router.types import StepTime, WorkerSnapshot
from components.router.types import queued_wait_ms as router_queued_wait_ms

pytestmark = pytest.mark.unit

# Prefill 10 ms + 0.04 ms/token; decode 5 ms + 0.02 ms/sequence + 3e-5 ms/KV token (the defaults).
ROUND = StepTimeModel(prefill_base_ms=10.0, prefill_ms_per_token=0.04, prefill_ms_per_token_sq=0.0)


def test_the_wait_and_ttft_worked_out_by_hand():
    # 100 sequences decoding over 200000 KV tokens: chunk 8192 - 100 = 8092 prompt tokens a step, costing
    # 10 + 0.04 x 8092 = 333.68 ms of prefill plus 5 + 2 + 6 = 13 ms of decode: 346.68 / 8092 ms a token.
    per_token = (10 + 0.04 * 8092 + 13) / 8092
    assert prefill_ms_per_prompt_token(ROUND, 100, 200_000) == pytest.approx(per_token)
    assert STEP_RESIDUAL_SHARE == 0.5 and step_residual_ms(ROUND) == 5.0 and prefill_fixed_ms(ROUND) == 10.0
    # 3000 tokens queued: 3000 x per_token + 5 ms; then a 1000-token prompt's own 10 + 40 = 50 ms.
    assert predicted_ttft_ms(ROUND, 1000, 3000, 100, 200_000) == pytest.approx(3000 * per_token + 5 + 50)
    # Nothing queued: no wait, not even the residual.
    assert queued_wait_ms(0, per_token, 5.0) == 0.0
    assert predicted_ttft_ms(ROUND, 1000, 0) == pytest.approx(50)


def test_a_profile_uses_its_fitted_fixed_cost():
    # A profile measured on ROUND itself: the fit recovers its 10 ms fixed cost.
    prof = Profile.build(
        prompt_tokens=[512, 1024, 2048],
        prefill_samples_ms=[[ROUND.prefill_ms(n)] for n in (512, 1024, 2048)],
        batch_sizes=[1, 8],
        context_tokens=[1024, 8192],
        decode_samples_ms=[[[ROUND.decode_ms(b, b * c)] for c in (1024, 8192)] for b in (1, 8)],
        max_num_batched_tokens=8192,
    )
    assert prefill_fixed_ms(prof) == prof.fit.prefill_base_ms == pytest.approx(10.0, abs=1e-6)


@pytest.mark.parametrize(("seqs", "kv_tokens", "queued"), [(0, 0, 0), (0, 0, 700), (37, 90_000, 4096), (300, 10, 1)])
def test_the_routers_wait_is_the_shared_model_bit_for_bit(seqs, kv_tokens, queued):
    step = StepTime(prefill_base_ms=16.5, decode_ms_per_seq=0.03)
    w = WorkerSnapshot(
        instance_id=1,
        metadata={},
        queued_prefill_tokens=queued,
        prefill_ms_per_token=step.prefill_ms_per_prompt_token(seqs, kv_tokens),
        step_residual_ms=step.step_residual_ms(),
    )
    shared = predicted_ttft_ms(step, 1, queued, seqs, kv_tokens) - step.chunked_prefill_ms(1)
    assert router_queued_wait_ms(w) == pytest.approx(shared, rel=1e-12, abs=1e-12)
    # The router's rates are the shared functions' (the same floats, not approximately).
    assert step.prefill_ms_per_prompt_token(seqs, kv_tokens) == (
        (step.prefill_ms(step.max_num_batched_tokens - seqs) + step.decode_ms(seqs, kv_tokens))
        / (step.max_num_batched_tokens - seqs)
    )
    assert step.step_residual_ms() == 0.5 * 16.5
