"""``kvmesh bench simvalidate`` end to end on a tiny slice: ``kvmesh serve`` (real etcd, NATS, frontend and simulated
workers on loopback) and ``kvmesh simulate`` on the same rows, one JSON object with both sides.

Checks behaviour (every request served on both sides, every field reported, the same prefix hits), never the
agreement itself: a test machine's other work sets the live side's tails (docs/simulate.md, "Validation").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]

ROWS = 12
PROMPT = 600  # tokens: the shared 512-token block 0, then 88 of the row's own block
OUTPUT = 8


def trace(path: Path) -> Path:
    """``ROWS`` Mooncake rows 150 ms apart, every one starting with the same block 0."""
    with path.open("w") as f:
        for i in range(ROWS):
            row = {"timestamp": 150 * i, "input_length": PROMPT, "output_length": OUTPUT, "hash_ids": [0, 100 + i]}
            f.write(json.dumps(row) + "\n")
    return path


def test_simvalidate_serves_and_simulates_the_same_slice(tmp_path):
    t = trace(tmp_path / "t.jsonl")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "components.cli.main", "bench", "simvalidate", "--trace", str(t), "--workers", "2",
         "--max-requests", str(ROWS), "--max-output-tokens", str(OUTPUT), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r == json.loads((out / "simvalidate.json").read_text())
    assert r["bench"] == "simvalidate" and r["fleet"]["workers"] == 2
    assert r["slice"] == {"start_offset_s": 0.0, "max_requests": ROWS, "time_scale": 1.0,
                          "max_input_tokens": 2048 - OUTPUT, "max_output_tokens": OUTPUT}  # fmt: skip
    # Both sides served every row of the slice.
    for side in ("live", "simulated"):
        s = r[side]
        assert s["requests"] == s["completed"] == ROWS, side
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
        assert 0 < s["itl_ms"]["p50"] <= s["itl_ms"]["p99"]
        assert s["output_tokens_per_s"] > 0 and s["makespan_s"] > 0
        # Every row but the first on each worker finds block 0 cached (whole 16-token blocks: 512 tokens): wherever
        # the rows land, (ROWS - 2) x 512 of ROWS x 600 prompt tokens are hits.
        assert s["prefix_hit_rate"] == pytest.approx((ROWS - 2) * 512 / (ROWS * PROMPT), abs=1e-4), side
    assert r["errors"] == {}
    # No request lost on either side (a busy test machine may still earn a dispatch-lag warning).
    assert isinstance(r["warnings"], list) and not any("failed" in w or "refused" in w for w in r["warnings"])
    assert set(r["ratios"]) == {
        "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99", "output_tokens_per_s", "makespan_s",
    }  # fmt: skip
    ttft_p50 = r["simulated"]["ttft_ms"]["p50"] / r["live"]["ttft_ms"]["p50"]
    assert r["ratios"]["ttft_p50"] == pytest.approx(ttft_p50, rel=1e-3)
    assert set(r["within_tolerance"]) == {"ttft_p50", "ttft_p99", "output_tokens_per_s"}
    assert r["within_tolerance"]["ttft_p50"]["tolerance"] == 0.10
    assert all(isinstance(v["met"], bool) for v in r["within_tolerance"].values())
    assert set(r["live_minus_simulated_ttft_ms"]) == {"p10", "p50", "p90"}
    # One row every 150 ms: 6.67 requests/s offered (Workload.rate: 11 gaps over 1.65 s).
    assert r["capacity"]["offered_rps"] == pytest.approx(1 / 0.15, abs=1e-3)
    assert 0 < r["capacity"]["offered_over_capacity"] < 1
    assert r["commands"]["simulated"].startswith("kvmesh simulate --graph graphs/mock_agg.yaml")
    assert r["commands"]["live"].startswith("kvmesh serve graphs/mock_agg.yaml --detach")
    assert (out / "sim" / "requests.csv").is_file()
    if r["png"] is not None:
        assert Path(r["png"]).stat().st_size > 5_000
