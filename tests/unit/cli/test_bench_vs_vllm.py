"""The headline numbers of `kvmesh bench vs-vllm`, from two load results (pure)."""

from __future__ import annotations

import pytest

from components.cli.bench.vs_vllm import compare

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


def test_runs_alternate_abba_so_a_drift_weighs_on_both_sides():
    from components.cli.bench.vs_vllm import schedule

    assert schedule("vllm,kvmesh", 1) == ["vllm", "kvmesh"]
    assert schedule("vllm,kvmesh", 2) == ["vllm", "kvmesh", "kvmesh", "vllm"]
    assert schedule("kvmesh, vllm", 3) == ["kvmesh", "vllm", "vllm", "kvmesh", "kvmesh", "vllm"]


def summary(tps: float, p50: float, failed: int = 0, errors: dict | None = None, rc: int = 0) -> dict:
    return {
        "requests_completed": 100,
        "requests_failed": failed,
        "duration_s": 5.0,
        "output_tokens_per_s": tps,
        "requests_per_s": tps / 64,
        "ttft_ms": {"p50": p50, "p99": 2 * p50},
        "itl_ms": {"p50": 1.0, "p99": 3.0},
        "e2e_ms": {"p50": 90.0, "p99": None},
        "errors": errors or {},
        "startup_s": 20.0,
        "exit_code": rc,
        "cpu_ms_per_request": 30.0,
        "cpu_ms_per_request_by_process": {"worker": tps / 200, "frontend": 3.0},
    }


def test_a_sides_runs_are_averaged_and_counted_and_kept():
    from components.cli.bench.vs_vllm import combine

    c = combine(
        [summary(3000.0, 30.0, errors={"timeout": 1}), summary(4000.0, 40.0, failed=2, errors={"timeout": 2}, rc=1)]
    )
    assert c["output_tokens_per_s"] == 3500.0 and c["ttft_ms"] == {"p50": 35.0, "p99": 70.0}
    assert c["requests_completed"] == 200 and c["requests_failed"] == 2 and c["errors"] == {"timeout": 3}
    assert c["duration_s"] == 10.0 and len(c["runs"]) == 2
    assert c["e2e_ms"]["p99"] is None  # a percentile a run lacks is not averaged over the others
    assert c["cpu_ms_per_request_by_process"] == {"worker": 17.5, "frontend": 3.0}
    one = combine([summary(3000.0, 30.0)])
    assert one["output_tokens_per_s"] == 3000.0 and len(one["runs"]) == 1
    # The headline compares the means: 3500 / 3500 = 1.0, 35 - 30 = 5 ms.
    assert compare(c, combine([summary(3500.0, 30.0), summary(3500.0, 30.0)]))["added_ttft_p50_ms"] == 5.0


def test_each_pair_of_consecutive_runs_gives_its_own_ratio():
    from components.cli.bench.vs_vllm import pair_ratios, schedule

    order = schedule("vllm,kvmesh", 2)  # vllm, kvmesh | kvmesh, vllm
    runs = [summary(4000.0, 30.0), summary(3000.0, 30.0), summary(3300.0, 30.0), summary(3000.0, 30.0)]
    assert pair_ratios(order, runs) == [0.75, 1.1]  # 3000 / 4000, then 3300 / 3000: whichever side ran first
    assert pair_ratios(order, [*runs[:3], summary(0.0, 30.0)]) == [0.75, None]
