"""``kvmesh bench planner`` runs end to end on a tiny, time-compressed slice and prints one JSON object with its fields
as the last line. Behaviour only (every fleet served the same requests, the accounting adds up, the PNG is drawn),
never speed: whether the goal is met means nothing on so short a run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
SHAREGPT = TRACES / "sharegpt_v3_filtered_500.json"
FLEETS = {"planner", "planner_dynamo_setting", "fixed_peak", "fixed_mean"}
ORACLES = {f"oracle_step_i{i}_u{u}" for i in (30, 10) for u in ("1", "0.9", "0.8")}


def bench(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "components.cli.main", "bench", "planner", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("trace", [AZURE, SHAREGPT], ids=["azure", "sharegpt"])
def test_bench_planner_compares_the_planner_with_fixed_fleets(tmp_path, trace):
    if not trace.is_file():
        pytest.skip(f"needs {trace.name} in ../shared/traces")
    png = tmp_path / "planner.png"
    # 20x compressed: 7.5 s periods over 30 s, planner adjusting every 1.5 s (10 s for Dynamo's setting: 0.5 s).
    proc = bench("--trace", str(trace), "--peak-workers", "3", "--time-compression", "20", "--capacity-requests",
                 "120", "--jobs", "2", "--png", str(png))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "planner" and r["workload"]["name"] == trace.stem
    assert r["capacity"]["peak_workers"] == 3 and r["capacity"]["capacity_rps"] > 0
    load = r["load"]
    assert (load["period_s"], load["duration_s"], load["low"], load["high"]) == (7.5, 30.0, 0.25, 1.0)
    assert load["time_compression"] == 20 and load["startup_s"] == 1.5 and load["warmup_s"] == 3.0
    assert load["peak_rps"] == pytest.approx(4 * load["trough_rps"], rel=1e-3) and load["requests"] > 0
    slo = r["slo"]
    assert slo["ttft_ms"] > 0 and slo["itl_ms"] > 0 and slo["quantile"] == 0.99 and slo["reference_requests"] > 0
    assert 0 <= slo["reference_kv_usage_mean"] <= slo["reference_kv_usage_max"] <= 1
    assert set(r["fleets"]) == FLEETS | ORACLES
    for name, f in r["fleets"].items():
        assert f["requests"] == load["requests"], name  # the same measured requests, every one finished
        assert 0 < f["ttft_ms"]["p50"] <= f["ttft_ms"]["p99"]
        assert 0 < f["itl_ms"]["p50"] <= f["itl_ms"]["p99"]
        att = f["slo_attainment_pct"]
        assert 0 <= att["both"] <= min(att["ttft"], att["itl"]) <= 100
        assert f["worker_seconds"] == pytest.approx(f["mean_workers"] * 30.0, rel=1e-3)
        assert f["adjustments"] > 0
    peak, mean = r["fleets"]["fixed_peak"], r["fleets"]["fixed_mean"]
    assert peak["worker_seconds"] == pytest.approx(3 * 30.0) and peak["workers"] == 3
    assert mean["workers"] == 2 and mean["worker_seconds"] == pytest.approx(2 * 30.0)  # round(0.625 * 3) = 2
    for fixed in (peak, mean):
        assert fixed["scaling_actions"]["up"] == fixed["scaling_actions"]["down"] == 0  # no-operation
    for name in ("planner", "planner_dynamo_setting"):
        f = r["fleets"][name]
        assert f["start_workers"] == 1  # ceil(0.25 * 3)
        assert f["planner_config"]["max_gpu_budget"] == 3 and f["planner_config"]["no_operation"] is False
        acts = f["scaling_actions"]
        assert len(acts["actions"]) == acts["up"] + acts["down"]
        for a in acts["actions"]:
            assert abs(a["to"] - a["from"]) == 1 and a["reason"]
        g = r["goal"][name]
        assert isinstance(g["met"], bool) and g["met"] == r["goal_met"][name]
    assert r["fleets"]["planner"]["planner_config"]["adjustment_interval"] == 1.5
    assert r["fleets"]["planner_dynamo_setting"]["planner_config"]["adjustment_interval"] == 0.5
    # The swing asks for 0.75 * 3 workers in 3.75 s; one scale-up takes an interval plus the 1.5 s start-up:
    # floor(3.75 / 3.0) = 1 with 1.5 s intervals, floor(3.75 / 2.0) = 1 with 0.5 s ones.
    assert load["swing_workers"] == 2.25
    assert r["fleets"]["planner"]["most_scale_ups_per_half_period"] == 1
    assert r["fleets"]["planner_dynamo_setting"]["most_scale_ups_per_half_period"] == 1
    # The clairvoyant fleets: each utilisation at each interval, under the step rules, judged like the planners.
    for name in ORACLES:
        f, o = r["fleets"][name], r["fleets"][name]["oracle"]
        assert o["rules"] == "step" and name == f"oracle_step_i{o['interval_s_uncompressed']:g}_u{o['utilisation']:g}"
        assert o["interval_s"] == pytest.approx(o["interval_s_uncompressed"] / 20)
        assert 1 <= o["start_workers"] <= o["max_workers"] == 3
        assert o["per_worker_rps"] == pytest.approx(r["capacity"]["capacity_rps"] / 3, rel=1e-3)
        # Always at least the need: it holds no fewer worker-seconds than the need's integral.
        assert f["worker_seconds"] >= o["need_worker_seconds"] * 0.999
        for a in f["scaling_actions"]["actions"]:
            assert abs(a["to"] - a["from"]) == 1 and a["reason"].startswith(("add", "remove"))
        assert r["goal"][name]["met"] == r["goal_met"][name]
    # The schedule without latency: both rule sets, each interval, utilisation and start-up (0, 10, 20, 30 s); the
    # greedy schedule never beats the lower bound, and the loop's extra rules never loosen it.
    rows = {(b["rules"], b["interval_s"], b["utilisation"], b["startup_s"]): b for b in r["schedule_bound"]}
    assert len(rows) == 2 * 2 * 3 * 4
    for (_rules, interval, u, startup), b in rows.items():
        assert b["worker_seconds"] >= b["least_worker_seconds"] * 0.999
        assert b["most_saving_vs_fixed_peak"] <= rows[("step", interval, u, startup)]["most_saving_vs_fixed_peak"]
    assert set(r["verdict"]) == {"step_i30", "step_i10", "loop_i30", "loop_i10"}
    assert all(v.startswith(("feasible", "infeasible", "not reached")) for v in r["verdict"].values())
    # Fairness: smaller fleets at the reference's load per worker (start 1 and mean 2 of 3), and the share of the
    # requests that arrive while the load is within the mean fleet's 2 of 3 workers: cos(2 pi t / P) >= c with
    # c = (0.625 - 2/3) / 0.375, a = acos(c): (0.625 a - 0.375 sin a) / (0.625 pi) = 34.6%.
    fair = r["fairness"]
    checks = fair["slo_at_full_load_per_worker"]
    assert [(c["workers"], c["reference"]) for c in checks] == [(3, True), (1, False), (2, False)]
    assert checks[1]["load"] == pytest.approx(1 / 3, abs=1e-4) and checks[2]["requests"] > 0
    a = math.acos((0.625 - 2 / 3) / 0.375)
    share = (0.625 * a - 0.375 * math.sin(a)) / (0.625 * math.pi)
    assert fair["fixed_mean_requests_within_capacity_pct"] == pytest.approx(100 * share, abs=0.2)
    assert r["png"] == str(png) and png.stat().st_size > 10_000
    assert "SLO per request" in proc.stderr and "goal planner:" in proc.stderr and "verdict loop_i10" in proc.stderr


def test_bench_planner_runs_fixed_length_requests(tmp_path):
    # Dynamo's benchmark shape (every prompt and output the same length), tiny: 2 workers, one clairvoyant fleet.
    proc = bench("--lengths", "500:50", "--peak-workers", "2", "--time-compression", "20", "--capacity-requests", "60",
                 "--oracle-utilisation", "1.0", "--oracle-intervals", "10", "--no-dynamo-setting", "--jobs", "2",
                 "--png", "")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    w = r["workload"]
    assert (w["name"], w["lengths"], w["trace"]) == ("fixed_500_50", [500, 50], None)
    assert w["prompt_tokens"] == {"p50": 500, "mean": 500} and w["output_tokens"] == {"p50": 50, "mean": 50}
    assert set(r["fleets"]) == {"planner", "fixed_peak", "fixed_mean", "oracle_step_i10_u1"}
    assert all(f["requests"] == r["load"]["requests"] > 0 for f in r["fleets"].values())
    assert "png" not in r


def test_bench_planner_refuses_bad_settings_before_running(tmp_path):
    proc = bench("--low", "0.9", "--high", "0.5", "--trace", str(AZURE), timeout=60)
    assert proc.returncode == 2 and "--low (0.9) must not exceed --high (0.5)" in proc.stderr
    proc = bench("--adjustment-interval", "0.5", "--trace", str(AZURE), timeout=60)
    assert proc.returncode == 2 and "--adjustment-interval" not in proc.stdout
    assert "metric_pulling_interval (1.0 s) must not exceed adjustment_interval (0.5 s)" in proc.stderr
    proc = bench("--policy", "fastest", "--trace", str(AZURE), timeout=60)
    assert proc.returncode == 2 and "unknown policy 'fastest'" in proc.stderr
    proc = bench("--trace", str(tmp_path / "missing.csv"), timeout=60)
    assert proc.returncode == 2 and "no trace file" in proc.stderr
    proc = bench("--trace", str(AZURE), "--lengths", "3000:150", timeout=60)
    assert proc.returncode == 2 and "give --trace or --lengths, not both" in proc.stderr
    proc = bench("--lengths", "3000", timeout=60)
    assert proc.returncode == 2 and "expected PROMPT:OUTPUT" in proc.stderr
    proc = bench("--oracle-utilisation", "1.0,1.5", "--trace", str(AZURE), timeout=60)
    assert proc.returncode == 2 and "a fraction in (0, 1]" in proc.stderr


# Three CLI runs: each takes 12-15 s to start on 2 cores under a load average of 10 (imports), beside the bound's
# arithmetic (seconds of CPU).
@pytest.mark.timeout(300)
def test_bench_planner_schedule_only_bounds_any_schedule_without_simulating(tmp_path):
    proc = bench("--schedule-only", "--oracle-utilisation", "")
    assert proc.returncode == 2 and "--schedule-only needs at least one --oracle-utilisation" in proc.stderr
    # No trace is read (a missing one is not an error here) and no fleet is simulated: only the bound and its verdicts.
    proc = bench("--schedule-only", "--oracle-intervals", "30,1", "--oracle-utilisation", "1.0",
                 "--trace", str(tmp_path / "missing.csv"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["schedule_only"] is True and r["fleets"] == {} and "capacity" not in r
    rows = {(b["rules"], b["interval_s"], b["startup_s"]): b for b in r["schedule_bound"]}
    assert len(rows) == 2 * 2 * 4 and {b["utilisation"] for b in r["schedule_bound"]} == {1.0}
    for key, b in rows.items():
        assert b["worker_seconds"] >= b["least_worker_seconds"] * 0.999
        assert b["most_saving_vs_fixed_peak"] <= rows[("step", *key[1:])]["most_saving_vs_fixed_peak"]
    # With no start-up and a decision every second the step limit never binds, so the bound is the need's integral:
    # 8 f(t) = 5 - 3 cos(2 pi t / 150) runs from 2 to 8, and ceil of it is 2 plus one for each w in 3..7 below it
    # (and one for w = 2 but at the trough): the share of a period with 5 - 3 cos > w is 1 - acos((5 - w) / 3) / pi,
    # whose terms pair up to 1 (w = 3 with 7, 4 with 6) beside 1/2 at w = 5: a mean of 2 + 1 + 2 + 0.5 = 5.5 workers,
    # 3,300 worker-seconds over 600 s, 31.25% fewer than the peak fleet's 4,800.
    free = rows[("step", 1.0, 0.0)]
    assert free["least_worker_seconds"] == pytest.approx(3300, abs=2)
    assert free["most_saving_vs_fixed_peak"] == pytest.approx(0.3125, abs=5e-4)
    # A 30 s start-up holds each of the 6 additions of each of the 4 periods at most 30 s early: at most 720 more.
    slow = rows[("step", 1.0, 30.0)]
    assert 3300 < slow["least_worker_seconds"] <= 3300 + 720 + 2
    # The rules (30 s start-up, one worker per 30 s interval, the loop's pause and grace) leave less than 25%
    # to save whatever the latency, and so does a decision every second with that start-up.
    assert r["verdict"]["loop_i30"].startswith("infeasible") and r["verdict"]["step_i1"].startswith("infeasible")
    assert "verdict loop_i30: infeasible" in proc.stderr
    # Without a start-up and with a decision every second the bound leaves more than 25%: the verdict waits for a
    # simulated clairvoyant fleet's latency.
    proc = bench("--schedule-only", "--oracle-intervals", "1", "--oracle-utilisation", "1.0", "--startup-s", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["verdict"]["step_i1"].startswith("undecided") and r["load"]["startup_s"] == 0
