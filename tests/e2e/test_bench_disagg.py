"""``kvmesh bench disagg`` runs end to end on a tiny slice of each trace and prints one JSON object with its fields as
the last line. Behaviour only (every request served by both fleets, every field present), never speed: the target's
``met`` may be anything on so few requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"


@pytest.mark.skipif(not (AZURE.is_file() and MOONCAKE.is_file()), reason="needs the traces in ../shared/traces")
def test_bench_disagg_compares_both_fleets_at_fractions_of_measured_capacity(tmp_path):
    png = tmp_path / "disagg.png"
    argv = ["bench", "disagg", "--trace", str(AZURE), "--trace", str(MOONCAKE), "--requests", "40",
            "--loads", "0.5,0.8", "--workers", "2", "--jobs", "2", "--png", str(png)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "components.cli.main", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "disagg" and r["loads"] == [0.5, 0.8]
    assert list(r["workloads"]) == [AZURE.stem, MOONCAKE.stem]
    for entry in r["workloads"].values():
        assert entry["requests"] == 40 and entry["prompt_tokens"]["p50"] >= entry["min_prompt_tokens"] == 512
        assert entry["fleet"]["workers"] == 2 and entry["fleet"]["prefill"] == entry["fleet"]["decode"] == 1
        assert set(entry["capacity_rps"]) == {"aggregated", "disaggregated"}
        assert all(c > 0 for c in entry["capacity_rps"].values())
        agg, dis = entry["points"]["aggregated"], entry["points"]["disaggregated"]
        assert list(agg) == list(dis) == ["0.5", "0.8"]
        for load in agg:
            assert agg[load]["rate_rps"] == dis[load]["rate_rps"] > 0  # both at the same fraction of one capacity
            assert agg[load]["requests"] == dis[load]["requests"] == 40  # every request finished in both fleets
            assert agg[load]["output_tokens"] == dis[load]["output_tokens"] > 0
            for row in (agg[load], dis[load]):
                assert row["output_tokens_per_s"] > 0
                assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
                assert 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p99"]
            assert "prefill" not in agg[load]
            pf = dis[load]["prefill"]
            assert 0 <= pf["remote_fraction"] <= 1 and sum(pf["decisions"].values()) == 40
            assert len(pf["prefill_busy_fraction"]) == 1
            rt = entry["ratios"][load]
            assert rt["itl_p99_speedup"] > 0 and rt["ttft_p99_disagg_over_agg"] > 0
            assert isinstance(entry["target"][load]["met"], bool)
        assert entry["ratios"]["0.5"]["throughput_disagg_over_agg"] > 0
    assert set(r["target_met_at"]) == set(r["workloads"])
    assert r["png"] == str(png) and png.stat().st_size > 10_000


def test_bench_disagg_refuses_fleets_of_different_sizes():
    proc = subprocess.run(
        [sys.executable, "-m", "components.cli.main", "bench", "disagg", "--workers", "4", "--prefill", "1",
         "--decode", "2", "--trace", str(Path(__file__))],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "must equal --workers" in proc.stderr
