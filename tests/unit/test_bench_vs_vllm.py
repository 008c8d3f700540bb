"""The headline numbers of `kvmesh bench vs-vllm`, from two load results (pure)."""

from __future__ import annotations

import pytest

from components.cli.bench_vs_vllm import compare

pytestmark = pytest.mark.unit


def result(tps: float, p50: float | None, p99: float | None) -> dict:
    return {"output_tokens_per_s": tps, "ttft_ms": {"p50": p50, "p90": None, "p99": p99, "mean": None}}


def test_ratio_and_added_ttft_against_the_targets():
    # 2400 / 2500 = 0.96 >= 0.95 and 43 - 40 = 3 ms <= 5 ms: both targets met.
    c = compare(result(2400.0, 43.0, 90.0), result(2500.0, 40.0, 100.0))
    assert c["output_tokens_per_s_ratio"] == 0.96
    assert (c["added_ttft_p50_ms"], c["added_ttft_p99_ms"]) == (3.0, -10.0)
    assert c["meets_targets"] is True
    # 2300 / 2500 = 0.92 misses the throughput target even with no added latency.
    assert compare(result(2300.0, 40.0, 90.0), result(2500.0, 40.0, 100.0))["meets_targets"] is False
    # 46 - 40 = 6 ms misses the TTFT target.
    assert compare(result(2500.0, 46.0, 90.0), result(2500.0, 40.0, 100.0))["meets_targets"] is False


def test_a_side_without_output_gives_no_numbers_and_no_pass():
    c = compare(result(100.0, None, None), result(0.0, None, None))
    assert c["output_tokens_per_s_ratio"] is None and c["added_ttft_p50_ms"] is None
    assert c["meets_targets"] is False
