"""``kvmesh bench simvalidate``'s comparison: one percentile rule for both sides, ratios simulated/live, the issue's
tolerances, the pairing of requests, and the warnings that say a live run is no fair reference."""

from __future__ import annotations

import pytest

from components.cli.bench.simvalidate import compare, warnings

pytestmark = pytest.mark.unit


def sides(live_ttft: list[float], sim_ttft: list[float], live_tps: float, sim_tps: float) -> tuple[dict, dict]:
    n = len(live_ttft)
    load = {"requests_sent": n, "requests_completed": n, "output_tokens_per_s": live_tps, "duration_s": 10.0,
            "cached_input_tokens": 25, "input_tokens": 100}  # fmt: skip
    live = {"load": load, "ttft_s": live_ttft, "itl_s": [0.05] * 10,
            "ttft_by_row": {7 + k: t for k, t in enumerate(live_ttft)}}  # fmt: skip
    summary = {"requests": len(sim_ttft), "refused_too_long": 0, "itl_ms": {"p50": 50.0, "p90": 50.0, "p99": 55.0},
               "output_tokens_per_s": sim_tps, "makespan_s": 9.0, "prefix_hit_rate": 0.25}  # fmt: skip
    return live, {"summary": summary, "ttft_s": sim_ttft}


def test_ratios_and_tolerances_from_one_percentile_rule():
    # 100 requests: live TTFT k/100 s, simulated 0.95 x that. Nearest rank: p50 is the 50th value (0.50 s live),
    # p99 the 99th (0.99 s); the simulated ones are 0.95 x those, so both ratios are 0.95: within 10% and 20%.
    live_ttft = [k / 100 for k in range(1, 101)]
    live, sim = sides(live_ttft, [0.95 * t for t in live_ttft], 100.0, 125.0)
    r = compare(live, sim)
    assert r["live"]["ttft_ms"] == {"p50": 500.0, "p90": 900.0, "p99": 990.0}
    assert r["simulated"]["ttft_ms"]["p50"] == pytest.approx(475.0)
    assert r["ratios"]["ttft_p50"] == r["ratios"]["ttft_p99"] == pytest.approx(0.95)
    # Throughput 125 / 100 = 1.25: outside 20%.
    assert r["ratios"]["output_tokens_per_s"] == 1.25
    assert {k: v["met"] for k, v in r["within_tolerance"].items()} == {
        "ttft_p50": True, "ttft_p99": True, "output_tokens_per_s": False,
    }  # fmt: skip
    assert r["ratios"]["itl_p50"] == 1.0 and r["ratios"]["makespan_s"] == 0.9
    assert r["live"]["prefix_hit_rate"] == 0.25 and r["live"]["completed"] == r["simulated"]["completed"] == 100
    # Row 7 + k is the simulator's request k: live minus simulated is 0.05 x k/100 s, so its median (nearest rank,
    # the 50th of 100) is 0.05 x 0.50 s = 25 ms.
    assert r["live_minus_simulated_ttft_ms"]["p50"] == pytest.approx(25.0)


def test_a_p50_off_by_more_than_ten_percent_is_not_met():
    live, sim = sides([1.0] * 10, [1.11] * 10, 100.0, 100.0)
    r = compare(live, sim)
    assert r["ratios"]["ttft_p50"] == pytest.approx(1.11) and r["within_tolerance"]["ttft_p50"]["met"] is False
    assert r["within_tolerance"]["ttft_p99"]["met"] is True  # 11% is within p99's 20%


def test_warnings_name_a_late_load_generator_and_lost_requests():
    live, sim = sides([1.0] * 10, [1.0] * 10, 100.0, 100.0)
    r = compare(live, sim)
    r |= {"load_on_the_host": {"dispatch_lag_ms_p99": 6.0}, "errors": {}}
    assert warnings(r) == []
    r["load_on_the_host"]["dispatch_lag_ms_p99"] = 5003.7
    r["live"]["completed"] = 7
    r["errors"] = {"http_503": 3}
    w = warnings(r)
    assert len(w) == 2 and "5004 ms" in w[0] and w[1].startswith("3 live requests failed")
