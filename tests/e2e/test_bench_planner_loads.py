"""``kvmesh bench planner --load all`` runs end to end on tiny, time-compressed loads and prints one JSON object as
its last line: every load, every start-up, every side ran and served the same measured requests, the verdicts carry
their numbers, a PNG per load is drawn. Behaviour only: whether a target is met means nothing on so short a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
SIDES = {"fixed_peak", "planner", "sla", "clairvoyant_planner", "clairvoyant_sla"}


@pytest.mark.timeout(300)
def test_bench_planner_runs_every_load_with_every_side(tmp_path):
    if not AZURE.is_file():
        pytest.skip(f"needs {AZURE.name} in ../shared/traces")
    png = tmp_path / "loads.png"
    # 20x compressed, 2 workers, start-ups 1 and 20 s (1/20 and 1 s simulated): the sinusoid 7.5 s periods over 15 s,
    # the slow one 400 s (20 x 20 s) / 20 = 20 s periods over 40 s, the step 15 s, the trace's first 1500 rows
    # (about 110 s at half of 2 workers' capacity, 5.6 s compressed: a few 1.5 s planner intervals).
    argv = ["--load", "all", "--peak-workers", "2", "--time-compression", "20", "--capacity-requests", "60",
            "--duration-s", "300", "--startups-s", "1,20", "--trace-rows", "1500", "--step-lengths", "2000:200",
            "--jobs", "2", "--png", str(png)]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "components.cli.main", "bench", "planner", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "planner" and set(r["loads"]) == {"sinusoid", "slow", "trace", "step"}
    assert r["slo"]["ttft_ms"] == 500 and r["slo"]["itl_ms"] == 50 and r["startups_s"] == [1.0, 20.0]
    # Two request mixes, each measured once: the trace's and the step's fixed lengths.
    assert set(r["capacity"]) == {"AzureLLMInferenceTrace_conv", "fixed_2000_200"}
    shapes = {name: load["shape"] for name, load in r["loads"].items()}
    assert shapes["sinusoid"]["period_s_uncompressed"] == 150 and shapes["sinusoid"]["duration_s"] == 15
    assert shapes["slow"]["period_s_uncompressed"] == 400 and shapes["slow"]["duration_s"] == 40
    assert shapes["step"]["high_rps"] == pytest.approx(24 * shapes["step"]["low_rps"], rel=1e-3)
    assert shapes["trace"]["scaled_to"] == "mean" and shapes["trace"]["mean"] == pytest.approx(0.5, abs=0.1)
    for name, load in r["loads"].items():
        assert set(load["runs"]) == {"startup_1s", "startup_20s"}, name
        for label, run in load["runs"].items():
            assert run["startup_s_simulated"] == pytest.approx(run["startup_s"] / 20)
            # The step also replays the reactive bound (the clairvoyant schedule on the load seen a start-up late).
            assert set(run["sides"]) == SIDES | ({"reactive_sla"} if name == "step" else set()), (name, label)
            for side in ("planner", "sla"):
                o = run["sides"][side]["oscillations"]
                assert o["count"] == len(o["found"]) >= o["at_constant_load"] >= 0, (name, label, side)
            if name == "step":
                g = run["verdict"]["sla"]["goodput"]
                assert 0 <= g["reactive_bound_share_of_fixed_peak"] <= 1.5
                assert "reactive_bound_points_below_fixed_peak" in run["verdict"]["sla"]["attainment"]
            for side, f in run["sides"].items():
                # The same measured requests, every one finished, in every side.
                assert f["requests"] == load["shape"]["requests"] > 0, (name, label, side)
                assert 0 <= f["slo_attainment_pct"]["both"] <= 100 and f["goodput_rps"] >= 0
                assert f["worker_seconds"] > 0
            assert run["sides"]["fixed_peak"]["worker_seconds"] == pytest.approx(
                2 * load["shape"]["duration_s"], rel=0.01
            )
            assert run["sides"]["planner"]["adjustments"] > 0 and run["sides"]["sla"]["adjustments"] > 0
            # The SLA planner is told the side's start-up (its start-up lead), on the simulation's clock; its
            # interval is compressed as the load planner's (30 s / 20).
            sla = run["sides"]["sla"]["sla_config"]
            assert sla["worker_startup_s"] == pytest.approx(run["startup_s_simulated"], rel=1e-3)
            assert sla["adjustment_interval"] == 1.5 and sla["max_gpu_budget"] == 2
            for planner, clairvoyant, step in (("planner", "clairvoyant_planner", 1), ("sla", "clairvoyant_sla", None)):
                c = run["sides"][clairvoyant]["clairvoyant"]
                assert c["step_workers"] == step and c["interval_s_uncompressed"] == 30
                assert c["bound_least_worker_seconds"] > 0 and c["bound_most_saving"] <= 1
                v = run["verdict"][planner]
                assert isinstance(v["met"], bool) and "points_below_fixed_peak" in v["attainment"]
                assert ("goodput" in v) == (name == "step")
                if name != "step":
                    assert v["worker_seconds"]["clairvoyant_saving_vs_fixed_peak"] == c["saving_vs_fixed_peak"]
    for name, path in r["png"].items():
        assert path == str(tmp_path / f"loads-{name}.png") and Path(path).stat().st_size > 10_000
    assert "verdict planner:" in proc.stderr and "verdict sla:" in proc.stderr and "== step" in proc.stderr
