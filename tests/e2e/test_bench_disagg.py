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
        fleets = {"aggregated", "disaggregated", "disaggregated_full"}  # no cap, so no capped control
        rules = entry["fleet"]["rules"]
        assert rules["disaggregated"] == {"max_local_prefill_length": 1000, "max_prefill_queue_size": 3,
                                          "decode_long_prefill_token_threshold": 0}  # fmt: skip
        # Full: every prompt remote while fewer than 4 items per prefill engine (1 here) wait.
        assert rules["disaggregated_full"]["max_local_prefill_length"] == 0
        assert rules["disaggregated_full"]["max_prefill_queue_size"] == 4
        assert set(entry["capacity_rps"]) == set(entry["points"]) == fleets
        assert all(c > 0 for c in entry["capacity_rps"].values())
        agg = entry["points"]["aggregated"]
        assert list(agg) == ["0.5", "0.8"]
        for fleet in ("disaggregated", "disaggregated_full"):
            dis = entry["points"][fleet]
            assert list(dis) == ["0.5", "0.8"]
            for load in agg:
                assert agg[load]["rate_rps"] == dis[load]["rate_rps"] > 0  # both at one fraction of one capacity
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
                rt = entry["ratios"][fleet][load]
                assert rt["itl_p99_speedup"] > 0 and rt["ttft_p99_over_agg"] > 0 and rt["throughput_over_agg"] > 0
                assert isinstance(entry["target"][fleet][load]["met"], bool)
    assert set(r["target_met_at"]) == set(r["workloads"])
    assert r["png"] == str(png) and png.stat().st_size > 10_000


def test_bench_disagg_refuses_fleets_of_different_sizes():
    proc = subprocess.run(
        [sys.executable, "-m", "components.cli.main", "bench", "disagg", "--workers", "4", "--prefill", "1",
         "--decode", "2", "--trace", str(Path(__file__))],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "must equal --workers" in proc.stderr
