"""Every benchmark runs end to end on tiny settings and prints one JSON object as its last line.

These check behaviour (the benchmark completes, loses nothing, reports its fields), never speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.vllm import check_weights, requires_nixl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def bench(*argv: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "components.cli.main", "bench", *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_transport():
    r = bench("transport", "--requests", "100", "--concurrency", "8", "--chunks", "8", "--latency-requests", "20",
              "--rounds", "1")  # fmt: skip
    assert r["bench"] == "transport"
    assert r["bare_nats"]["chunks_per_s"] > 0 and r["runtime"]["chunks_per_s"] > 0
    assert r["runtime_bus"]["chunks_per_s"] > 0  # the same client over nats-server only
    assert r["throughput_ratio_bare_over_runtime"] > 0 and r["throughput_ratio_tcp_over_bus"] > 0


def test_bench_fleet():
    r = bench("fleet", "--workers", "8", "--requests", "100", "--concurrency", "8", "--idle-s", "0.2")
    assert r["fleet"]["workers"] == 8 and r["fleet"]["errors"] == 0
    assert r["baseline_one_worker"]["errors"] == 0
    assert r["fleet"]["fleet_cpu_ms_per_request"] > 0


def test_bench_frontend(tmp_path):
    # Sides 1, 2 (replicas) and baseline (this same checkout, run as --compare-tree would run an older one), one round
    # of the KV policy on the default graph's simulated workers (the ABBA order of later rounds: side_order's unit
    # test, tests/unit/cli/test_loadgen.py).
    r = bench("frontend", "--router-policies", "kv", "--rounds", "1", "--requests", "40", "--warmup-requests", "8",
              "--concurrency", "4", "--prompt-tokens", "64", "--shared-prefix-tokens", "32", "--max-tokens", "8",
              "--replicas", "2", "--compare-tree", str(ROOT), "--state-dir", str(tmp_path))  # fmt: skip
    (pol,) = r["policies"]
    assert pol["router_policy"] == "kv" and len(pol["rounds"]) == 1
    assert [x["side"] for x in pol["rounds"][0]] == ["1", "2", "baseline"]
    for rnd in pol["rounds"]:
        for x in rnd:
            assert x["requests_completed"] == 40 and x["errors"] == {}, x
            assert x["cpu_ms_per_request"]["frontend"] > 0 and x["requests_per_s"] > 0
            assert x["hit_rate"] is not None and x["ttft_ms"]["p99"] > 0
            # The machine's busy cores over the window: something ran (the load), at most every core.
            assert x["machine_cores"] >= 1 and 0 < x["machine_cores_busy"] <= x["machine_cores"] + 0.05
    assert {x["processes"]["frontend"] for x in pol["rounds"][0] if x["side"] == "2"} == {3}  # supervisor + 2
    assert {"2_over_1", "1_over_baseline", "2_over_baseline"} <= set(pol["paired_ratios"])
    t = r["targets"]["kv"]
    assert set(t["2_over_1"]) >= {"requests_per_s_at_least_1_5", "ttft_p99_lower", "hit_rate_within_2_points"}
    assert t["1_over_baseline"]["at_most_0_8"] in (True, False)


@pytest.mark.vllm
@requires_nixl
def test_bench_kv_transfer():
    check_weights()
    r = bench("kv-transfer", "--prompt-tokens", "64", "--rounds", "2")
    assert r["bench"] == "kv-transfer" and r["pull_failures"] == 0
    n64 = r["lengths"]["64"]
    assert n64["pull_ms"]["n"] == 2 and n64["recompute_ms"]["n"] == 2
    assert n64["pull_ms"]["median"] > 0 and n64["recompute_ms"]["median"] > 0
    assert n64["kv_bytes"] == 2 * 64 * 2**10  # two 32-token blocks of the tiny model, read per pull


def test_bench_migration(tmp_path):
    png = tmp_path / "m.png"
    r = bench("migration", "--lengths", "256,2048", "--repeats", "1", "--failover-requests", "12",
              "--failover-concurrency", "6", "--failover-tokens", "200", "--png", str(png))  # fmt: skip
    sim = r["simulated"]
    assert {(row["length"], row["mode"]) for row in sim["rows"]} == {
        (256, "live"),
        (256, "recompute"),
        (2048, "live"),
        (2048, "recompute"),
    }
    assert all(row["downtime_ms"] > 0 for row in sim["rows"])
    assert sim["live_ratio_2048_over_256"] > 0
    # Live copies blocks; recompute copies none.
    assert all((row["blocks_copied"] > 0) == (row["mode"] == "live") for row in sim["rows"])
    limits = r["failover"]["summary"]
    assert limits["limit_3"]["failed"] == [0]
    assert limits["limit_0"]["failed"][0] >= 1  # the killed worker held some of the first wave
    assert r["png"] == str(png) and png.stat().st_size > 0
