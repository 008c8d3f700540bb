"""``kvmesh bench startup``: how long a new worker takes to register, on this machine (issue 25, "Start-up aware").

For each kind (``simulated``: ``kvmesh worker`` with the mock engine; ``vllm``: ``kvmesh worker --engine vllm`` on
``models/tiny-llama``) and each of ``--runs`` runs: a client watches the generate endpoint of a fresh namespace
(etcd watch, as a router and the planner's fleet view do), the worker process is spawned, and two times are taken
from the spawn: when the worker prints its ``READY`` line (``ready_line_s``) and when the watching client first sees
its instance (``registered_s``: what a planner waits for before the worker takes requests). The worker is then
stopped (SIGTERM; its process group killed if it has not exited within ``--stop-timeout-s``) before the next run, so
the runs do not overlap. etcd and nats-server are started on free loopback ports unless ``--etcd``/``--nats`` are
given. Per kind: every run, the median, the smallest and the largest (the spread).

A start-up here runs from the spawn, so it includes starting Python and importing kvmesh; on a shared 2-core machine
the figures move with the load average, which the JSON reports beside each run.

JSON is the last line on stdout; a line per run goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from components.cli.bench.mesh import add_mesh_arguments, mesh_servers
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.runtime.config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[3]
MODEL_DIR = ROOT / "models" / "tiny-llama"
KINDS = ("simulated", "vllm")
# The mock engine as tests/integration/test_worker.py starts it (speedup 1: real step times).
MOCK_FLAGS = ["--speedup-ratio", "1", "--vocab-size", "1000", "--eos-token-id", "999"]
MOCK_FLAGS += ["--num-gpu-blocks", "1024", "--max-model-len", "4096"]
# vLLM (CPU) on the tiny model with a small KV cache, as tests/integration/test_vllm_failover.py starts it.
VLLM_FLAGS = ["--engine", "vllm", "--model-path", str(MODEL_DIR), "--kv-cache-memory-bytes", str(4 * 2**20)]
VLLM_FLAGS += ["--max-model-len", "1024"]


def worker_command(kind: str, namespace: str) -> list[str]:
    cmd = [sys.executable, "-m", "components.cli.main", "--log-level", "WARNING", "worker", "--namespace", namespace]
    return [*cmd, *(MOCK_FLAGS if kind == "simulated" else VLLM_FLAGS)]


async def _ready_line(proc: asyncio.subprocess.Process, t0: float) -> float:
    """Seconds from ``t0`` to the worker's READY line (vLLM logs to stderr; stdout carries the worker's own lines)."""
    assert proc.stdout is not None
    while True:
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited ({proc.returncode}) before its READY line")
        if line.startswith(b"READY"):
            return time.monotonic() - t0


async def _stop(proc: asyncio.subprocess.Process, timeout_s: float) -> float:
    """SIGTERM the worker and wait; kill its process group (its own: started with a new session) past
    ``timeout_s``. Returns the seconds it took to exit."""
    t0 = time.monotonic()
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            async with asyncio.timeout(10):
                await proc.wait()
    return time.monotonic() - t0


async def one_run(cfg: RuntimeConfig, kind: str, timeout_s: float, stop_timeout_s: float) -> dict[str, Any]:
    from components.runtime import Runtime

    namespace = f"startup-{kind}-{uuid.uuid4().hex[:8]}"
    rt = await Runtime.connect(cfg)
    try:
        client = await rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        env = os.environ | {"KVMESH_ETCD_ENDPOINTS": cfg.etcd_endpoints[0], "KVMESH_NATS_URL": cfg.nats_url}
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *worker_command(kind, namespace),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        ready = asyncio.ensure_future(_ready_line(proc, t0))
        try:
            await client.wait_for_instances(1, timeout_s=timeout_s)
            registered = time.monotonic() - t0
            async with asyncio.timeout(timeout_s):
                ready_line = await ready
        finally:
            ready.cancel()
            stopped = await _stop(proc, stop_timeout_s)
        return {
            "namespace": namespace,
            "pid": proc.pid,
            "registered_s": round(registered, 3),
            "ready_line_s": round(ready_line, 3),
            "stop_s": round(stopped, 2),
        }
    finally:
        await rt.shutdown(drain_timeout_s=1.0)


def spread(values: list[float]) -> dict[str, float]:
    """Median, smallest and largest."""
    return {
        "median_s": round(statistics.median(values), 3),
        "min_s": round(min(values), 3),
        "max_s": round(max(values), 3),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    with mesh_servers(args.etcd, args.nats) as (etcd, nats_url):
        cfg = RuntimeConfig(etcd_endpoints=[etcd], nats_url=nats_url)
        kinds: dict[str, Any] = {}
        for kind in args.kinds:
            runs = []
            for i in range(args.runs):
                load = os.getloadavg()[0]
                r = await one_run(cfg, kind, args.timeout_s, args.stop_timeout_s) | {"load_avg_1m": round(load, 2)}
                runs.append(r)
                print(
                    f"bench startup: {kind} run {i + 1}/{args.runs}: registered after {r['registered_s']:.2f} s "
                    f"(READY line {r['ready_line_s']:.2f} s; load average {load:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
            kinds[kind] = {
                "command": " ".join(worker_command(kind, "NS")[1:]),
                "runs": runs,
                "registered": spread([r["registered_s"] for r in runs]),
                "ready_line": spread([r["ready_line_s"] for r in runs]),
            }
        return {
            "bench": "startup",
            "kinds": kinds,
            "cpus": os.cpu_count(),
            "wall_s": round(time.perf_counter() - t_start, 1),
        }


def _kinds(text: str) -> tuple[str, ...]:
    out = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in out if k not in KINDS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(KINDS)}; got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kinds", type=_kinds, default=KINDS, help="comma-separated: simulated, vllm (default both)")
    p.add_argument("--runs", type=int, default=3, help="start-ups per kind, one after another (default 3)")
    p.add_argument(
        "--timeout-s", type=float, default=300.0, help="longest wait for one worker to register (default 300)"
    )
    p.add_argument(
        "--stop-timeout-s",
        type=float,
        default=60.0,
        help="seconds a stopped worker has to exit before its process group is killed (default 60)",
    )
    add_mesh_arguments(p)


def main(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.timeout_s <= 0:
        print("kvmesh bench startup: --runs must be >= 1 and --timeout-s > 0", file=sys.stderr)
        return 2
    if "vllm" in args.kinds and not (MODEL_DIR / "config.json").is_file():
        print(f"kvmesh bench startup: no model at {MODEL_DIR} for the vllm kind", file=sys.stderr)
        return 2
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0
