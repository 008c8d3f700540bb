"""``kvmesh profile --engine vllm`` on the tiny model here, with a tiny grid (~35 s, most of it vLLM's start-up)."""

from __future__ import annotations

import math

import pytest

from components.perf.model import StepTimeModel
from components.perf.profile import Profile
from tests.integration.test_profile_cli import run_profile
from tests.support.vllm import MODEL_DIR, check_weights, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.integration, requires_vllm]


def test_a_vllm_profile_of_the_tiny_model(tmp_path):
    check_weights()
    out = tmp_path / "tiny.json"
    summary = run_profile(
        out, "--engine", "vllm", "--model-path", str(MODEL_DIR), "--prompt-tokens", "32,256", "--batch-sizes", "1,4",
        "--context-tokens", "64", "--repeats", "2", "--decode-steps", "4", "--png", "",
    )  # fmt: skip
    profile = Profile.load(out)
    assert summary["profile_id"] == profile.profile_id and summary["png"] is None
    assert profile.meta["engine"] == "vllm" and profile.max_num_batched_tokens == 2048
    assert [p.repeats for p in profile.prefill] == [2, 2]
    # Real times: positive and finite, each median within its repeats; the fit announces valid coefficients.
    points = [*profile.prefill, *(p for row in profile.decode for p in row)]
    assert all(0 < p.min_ms <= p.median_ms <= p.max_ms < 10_000 for p in points)
    assert StepTimeModel.from_mapping(profile.step_time()) == profile.fit
    assert all(math.isfinite(v) and v >= 0 for v in profile.fit_error.values())
