"""``kvmesh bench fleet``: what a fleet of simulated workers in one process costs, at infinite engine speed.

Starts ``kvmesh worker --num-workers N --speedup-ratio inf`` as a child process (etcd and NATS embedded unless given),
then, from this process:
1. idle: measures the fleet's CPU while nothing is requested (metrics publishing, lease keep-alives);
2. load: ``requests`` requests at ``concurrency``, round-robin over the fleet, and measures requests/s, output
   tokens/s and the fleet process's CPU-ms per request (from /proc/<pid>/stat).
The same is measured for a one-worker baseline in the same run, so ``cpu_ms_per_request_ratio`` tells what the
fleet's size adds per request. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

from components.cli.bench.mesh import add_mesh_arguments, mesh_servers
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.runtime import Runtime, RuntimeConfig

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def _measure_fleet(cfg: RuntimeConfig, args: argparse.Namespace, num_workers: int, namespace: str) -> dict:
    env = os.environ | {"KVMESH_ETCD_ENDPOINTS": cfg.etcd_endpoints[0], "KVMESH_NATS_URL": cfg.nats_url}
    cmd = [sys.executable, "-m", "components.cli.main", "worker", "--namespace", namespace]
    cmd += ["--num-workers", str(num_workers), "--speedup-ratio", "inf", "--model", "bench"]
    cmd += ["--num-gpu-blocks", str(args.num_gpu_blocks), "--max-model-len", str(args.prompt_tokens + args.max_tokens)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)  # noqa: ASYNC220 - before measuring
    rt = None
    try:
        assert child.stdout is not None
        async with asyncio.timeout(120):
            line = await asyncio.to_thread(child.stdout.readline)
        if not line.startswith("READY"):
            raise RuntimeError(f"fleet did not start: {line!r}")
        rt = await Runtime.connect(cfg, name="bench-fleet-client")
        client = await rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(num_workers, timeout_s=60)

        c0, t0 = cpu_s(child.pid), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle_cpu_pct = 100 * (cpu_s(child.pid) - c0) / (time.perf_counter() - t0)

        rng = random.Random(0)
        prompts = [[rng.randrange(1, 32000) for _ in range(args.prompt_tokens)] for _ in range(64)]
        counter = iter(range(args.requests))
        out_tokens = 0
        errors = 0

        async def one_loop() -> None:
            nonlocal out_tokens, errors
            for i in counter:
                req = GenerateRequest(
                    f"b{i}", prompts[i % len(prompts)], SamplingParams(args.max_tokens, ignore_eos=True)
                )
                try:
                    async for item in await client.generate(req.to_dict()):
                        out_tokens += len(TokenChunk.from_dict(item).token_ids)
                except Exception:  # noqa: BLE001 - counted and reported; a benchmark keeps going
                    errors += 1

        c0, t0, my0 = cpu_s(child.pid), time.perf_counter(), time.process_time()
        await asyncio.gather(*(one_loop() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        fleet_cpu = cpu_s(child.pid) - c0
        client_cpu = time.process_time() - my0
        return {
            "workers": num_workers,
            "requests": args.requests,
            "errors": errors,
            "requests_per_s": round(args.requests / wall, 1),
            "output_tokens_per_s": round(out_tokens / wall, 1),
            "fleet_cpu_ms_per_request": round(1000 * fleet_cpu / args.requests, 3),
            "client_cpu_ms_per_request": round(1000 * client_cpu / args.requests, 3),
            "fleet_idle_cpu_percent": round(idle_cpu_pct, 2),
        }
    finally:
        if rt is not None:
            await rt.shutdown(drain_timeout_s=1)
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(child.wait, 30)
        if child.poll() is None:
            child.kill()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with mesh_servers(args.etcd, args.nats) as (etcd, nats_url):
        cfg = RuntimeConfig(etcd_endpoints=[etcd], nats_url=nats_url)
        baseline = await _measure_fleet(cfg, args, 1, "benchfleet1")
        fleet = await _measure_fleet(cfg, args, args.workers, "benchfleet")
        return {
            "bench": "fleet",
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "fleet": fleet,
            "baseline_one_worker": baseline,
            "cpu_ms_per_request_ratio": round(
                fleet["fleet_cpu_ms_per_request"] / baseline["fleet_cpu_ms_per_request"], 3
            ),
            "requests_per_s_ratio": round(fleet["requests_per_s"] / baseline["requests_per_s"], 3),
        }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=64, help="simulated workers in the fleet process")
    p.add_argument("--requests", type=int, default=2000, help="requests in the load phase")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent requests")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="KV blocks per simulated worker")
    p.add_argument("--idle-s", type=float, default=2.0, help="length of the idle measurement")
    add_mesh_arguments(p)


def main(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(run(args))))
    return 0
