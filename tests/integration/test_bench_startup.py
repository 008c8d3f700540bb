"""``kvmesh bench startup`` against real etcd and nats-server: it spawns ``kvmesh worker`` processes one after
another, times each from its spawn to its registration as a watching client sees it, and leaves none running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_bench_startup_times_simulated_workers_to_their_registration(session_etcd, session_nats):
    cmd = [sys.executable, "-m", "components.cli.main", "bench", "startup", "--kinds", "simulated", "--runs", "2",
           "--etcd", session_etcd.endpoint, "--nats", session_nats.url, "--timeout-s", "60"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "startup" and set(r["kinds"]) == {"simulated"}
    sim = r["kinds"]["simulated"]
    assert len(sim["runs"]) == 2 and "worker" in sim["command"]
    for run in sim["runs"]:
        # Registered within the timeout; the READY line and the watch see the same registration, each after the spawn.
        assert 0 < run["registered_s"] < 60 and 0 < run["ready_line_s"] < 60 and run["stop_s"] >= 0
    times = sorted(x["registered_s"] for x in sim["runs"])
    # Two runs: the median is their mean, the spread their extremes.
    assert sim["registered"] == {"median_s": pytest.approx(sum(times) / 2, abs=1e-3), "min_s": times[0],
                                 "max_s": times[1]}  # fmt: skip
    assert proc.stderr.count("bench startup: simulated run") == 2
    # Every worker it spawned has exited: no process serves either run's namespace.
    namespaces = {run["namespace"] for run in sim["runs"]}
    assert len(namespaces) == 2
    for p in psutil.process_iter(["pid", "cmdline"]):
        assert not namespaces & set(p.info["cmdline"] or []), p.info


def test_bench_startup_refuses_an_unknown_kind():
    proc = subprocess.run([sys.executable, "-m", "components.cli.main", "bench", "startup", "--kinds", "sglang"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "kinds are simulated, vllm" in proc.stderr
