"""The router's benchmarks run end to end on tiny settings and print one JSON object with their fields as the last line.

These check behaviour (the benchmark completes, loses no request, reports every field), never speed: the targets'
``met`` may be anything on a test machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def bench(*argv: str, timeout_s: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "components.cli.main", "bench", *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_router_reports_decision_cost_per_fleet_size_and_ingest_rates():
    r = bench("router", "--workers", "8,32", "--indexed-blocks", "20000", "--families", "16", "--decisions", "100",
              "--warmup", "10", "--ingest-blocks", "5000")  # fmt: skip
    assert r["bench"] == "router" and [e["workers"] for e in r["results"]] == [8, 32]
    for e in r["results"]:
        assert e["indexed_blocks"] >= 20000 and e["distinct_hashes"] > 0
        assert set(e["policies"]) == {"kv", "round_robin", "least_loaded"}
        for stats in e["policies"].values():
            assert 0 < stats["decision_us"]["p50"] <= stats["decision_us"]["p99"] <= stats["decision_us"]["max"]
        kv = e["policies"]["kv"]
        assert kv["prepare_us"]["p50"] > 0 and kv["select_us"]["p50"] > 0 and kv["decision_cpu_us"]["p50"] > 0
        # Every cached conversation's previous turn went through the router: its chunks come from the memo.
        memo = kv["hash_memo"]
        assert memo["chunk_hits"] > 0 and memo["blocks_reused_per_decision"] > 0
        assert kv["hashing_us"]["p50"] > 0 and 0 < kv["hashed_blocks"] <= 8192 // 16
        assert 0 < kv["routed_cached_fraction"] <= 1  # requests continuing a cached conversation found it
        assert e["kv_overlaps_only_us"]["p50"] > 0
    ingest = r["ingest"]
    assert ingest["workers"] == 32  # no 256-worker fleet in this run: the last one is used
    for profile in ("mixed", "single_block"):
        for path in ("index", "with_decode"):
            m = ingest["profiles"][profile][path]
            assert m["block_events"] >= 5000 and m["events_per_s"] > 0 and m["block_events_per_s"] > 0
    t = r["targets"]
    assert t["kv_decision_p99_us_at_256_workers_1m_blocks"]["met"] is None  # not measured at that size
    assert isinstance(t["ingest_block_events_per_s"]["met"], bool)


@pytest.mark.skipif(not TRACE.is_file(), reason="needs ../shared/traces/mooncake_conversation_trace.jsonl")
def test_bench_routing_live_replays_a_trace_slice_per_policy(tmp_path):
    # 60 requests of the first ~25 trace seconds, 20x compressed, on 4 workers at full simulated speed. Two policies
    # (each is a serve of its own, ~13 s here): kv+autellix is routed in tests/integration/test_router.py.
    r = bench("routing-live", "--trace", str(TRACE), "--policies", "round_robin,kv", "--workers", "4",
              "--max-requests", "60", "--time-scale", "0.05", "--speedup-ratio", "10", "--max-output-tokens", "8",
              "--state-dir", str(tmp_path))  # fmt: skip
    assert r["bench"] == "routing" and r["fleet"]["workers"] == 4
    assert list(r["policies"]) == ["round_robin", "kv"]
    for row in r["policies"].values():
        assert row["requests_completed"] == 60 and row["errors"] == {}
        assert row["ttft_ms"]["p50"] > 0 and row["ttft_ms"]["p99"] >= row["ttft_ms"]["p50"]
        assert 0 < row["prefix_cache_hit_rate"] < 1  # every prompt starts with the trace's shared 512-token block
        assert row["output_tokens_per_s"] > 0
        w = row["workers"]
        assert len(w["mean_in_flight"]) == len(w["computed_tokens"]) == 4
        assert w["computed_tokens_max_over_mean"] >= 1  # every worker's prefills show in its KV events
        # Requests in flight are sampled every 100 ms; at this speed a worker may finish each between two samples.
        assert w["in_flight_max_over_mean"] is None or w["in_flight_max_over_mean"] >= 1
    t = r["targets"]
    assert {"kv_ttft_p99_speedup_over_round_robin", "kv_throughput_over_round_robin", "max_over_mean_load"} <= set(t)


def test_bench_routing_sweeps_policies_at_fractions_of_measured_capacity(tmp_path):
    png, md = tmp_path / "routing.png", tmp_path / "routing.md"
    argv = ["routing", "--synthetic", "documents", "--requests", "40", "--policies", "round_robin,least_loaded,kv",
            "--loads", "0.8,1.2", "--workers", "4", "--synthetic-scales", "1", "--png", str(png), "--seeds", "0,1",
            "--held-out", "1", "--markdown", str(md), "--jobs", "2"]  # fmt: skip
    if TRACE.is_file():
        argv += ["--trace", str(TRACE)]
    r = bench(*argv)
    assert r["bench"] == "routing" and r["loads"] == [0.8, 1.2] and r["seeds"] == [0, 1]
    assert r["fleets"] == ["host", "device"]  # both by default
    assert "synthetic_documents" in r["workloads"]
    assert ("mooncake_conversation_trace" in r["workloads"]) == TRACE.is_file()
    assert list(r["held_out"]) == ["heldout0_system_prompts"] and r["held_out"]["heldout0_system_prompts"]["params"]
    assert set(r["targets"]) == {"workloads", "held_out"} and set(r["targets"]["held_out"]) == {"host", "device"}
    for name, w in [*r["workloads"].items(), *r["held_out"].items()]:
        assert set(w["fleets"]) == {"host", "device"}
        for fleet, agg in w["fleets"].items():
            assert len(agg["replicates"]) == 2 and agg["oracle_reuse"]["min"] <= agg["oracle_reuse"]["median"]
            if name.startswith("heldout"):
                assert min(agg["seeds"]) >= 1_000_000  # seeds never tuned on
            if w["kind"] == "trace":
                assert [e["rows"][0] for e in agg["replicates"]] == [0, 40]  # two slices of the trace
            kv = agg["summary"]["kv"]["0.8"]
            assert len(kv["ttft_p99_ms"]["values"]) == 2
            assert kv["ttft_p99_ms"]["min"] <= kv["ttft_p99_ms"]["median"] <= kv["ttft_p99_ms"]["max"]
            assert set(kv["best_load_only"]) <= {"round_robin", "least_loaded"}
            # The best load-only policy is at least as good as round-robin: kv's ratio over it is the smaller.
            for a, b in zip(kv["p99_speedup_over_best_load_only"]["values"],
                            kv["p99_speedup_over_round_robin"]["values"], strict=True):  # fmt: skip
                assert a <= b + 1e-9
            assert agg["targets"]["kv_p99_speedup_over_round_robin_at_0.8"]["met_per_seed"] is not None
            for entry in agg["replicates"]:
                assert entry["requests"] == 40 and entry["capacity_rps"] > 0
                assert entry["fleet"]["num_host_blocks"] == (65_536 if fleet == "host" else 0)
                assert 0 <= entry["oracle_reuse_fleet_device_memory"] <= entry["oracle_reuse_fleet_memory"]
                assert entry["oracle_reuse_fleet_memory"] <= entry["oracle_reuse"] <= 1
                assert entry["fleet"]["workers"] == 4
                assert entry["fleet"]["max_model_len"] >= entry["prompt_tokens"]["max"]
                ws = entry["working_set"]
                assert ws["blocks"] > 0 and ws["over_worker_device"] >= ws["over_worker_memory"]
                assert ws["over_worker_memory"] >= ws["over_fleet_memory"]
                assert 0 < entry["ttft_floor_ms"]["p50"] <= entry["ttft_floor_ms"]["p99"]
                # Causality only delays a request's cached prefix: per request, so per percentile, the causal floor
                # is higher.
                assert set(entry["ttft_causal_floor_ms"]) == {"0.8", "1.2"}
                for f in entry["ttft_causal_floor_ms"].values():
                    assert entry["ttft_floor_ms"]["p99"] <= f["p99"] and entry["ttft_floor_ms"]["p50"] <= f["p50"]
                for policy in ("round_robin", "least_loaded", "kv"):
                    low, high = entry["points"][policy]["0.8"], entry["points"][policy]["1.2"]
                    assert low["requests"] == high["requests"] == 40  # every request completed
                    assert high["rate_rps"] == pytest.approx(1.5 * low["rate_rps"], rel=1e-3)
                    assert 0 < low["ttft_ms"]["p50"] <= low["ttft_ms"]["p99"]
                    assert 0 < low["itl_ms"]["p50"] <= low["itl_ms"]["p99"] and low["output_tokens_per_s"] > 0
                    assert 0 <= low["host_hit_rate"] <= low["hit_rate"] <= entry["oracle_reuse"] + 1e-9
                    assert sum(low["decision_kinds"].values()) == 40
                    if fleet == "device":
                        assert low["host_hit_rate"] == 0
                assert entry["points"]["round_robin"]["0.8"]["decision_kinds"] == {"rotation": 40}
    assert r["png"] == str(png) and png.stat().st_size > 10_000
    text = md.read_text()
    assert "| synthetic_documents | host | 0.8 |" in text
    for table in text.split("\n\n"):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) <= 1, table  # every row has the header's columns
    assert r["rules"]["host_kv_blocks_per_worker"] == 65_536 and r["rules"]["synthetic_scales"] == [1.0]


def test_bench_routing_refuses_bad_input_with_a_clear_message(tmp_path):
    for argv, message in [
        (["--trace", str(tmp_path / "nope.jsonl")], "no trace file at"),
        (["--synthetic", "documents", "--policies", "kv,bogus"], "unknown policy ['bogus']"),
        (["--synthetic", "documents", "--loads", "0.8,-1"], "loads must be > 0"),
        (["--synthetic", "documents", "--host-kv-blocks", "-1"], "--host-kv-blocks must be >= 0"),
        (["--synthetic", "documents", "--synthetic-scales", "1,0"], "scales must be > 0"),
        (["--synthetic", "documents", "--seeds", "1,1"], "distinct seeds"),
        (["--synthetic", "documents", "--fleets", "host,gpu"], "fleets are host, device"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "components.cli.main", "bench", "routing", *argv],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr)
