"""``kvmesh bench frontend``: what the frontend itself costs per request, next to the runtime client's own cost.

1. ``kvmesh serve graphs/mock_agg.yaml --detach`` with the simulated engines at infinite speed (so engine time is
   zero and only the control plane's cost remains) in a temporary state directory.
2. ``kvmesh bench load``'s Python API sends ``requests`` streamed completions, ``concurrency`` at a time, of
   ``prompt_tokens`` token-id prompts and ``max_tokens`` outputs, and reads the frontend process's CPU time from /proc.
3. Baseline in the same run: the same requests sent by a bare runtime ``Client`` from this process straight to the
   workers (no HTTP, no tokeniser, no OpenAI encoding), with this process's CPU-ms per request. The ratio says what
   the HTTP/OpenAI layer costs on top of the mesh client every frontend needs anyway.

Dynamo's Rust frontend needs about 1.8 CPU-ms for such a request (the issue's reference point, not measured here).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from components.cli.bench.loadgen import LoadConfig, run_load
from components.deploy.state import read_state, resolve_state_dir, state_path
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.runtime import Runtime, RuntimeConfig

ROOT = Path(__file__).resolve().parents[3]
DYNAMO_RUST_FRONTEND_CPU_MS_REFERENCE = 1.8


async def _runtime_baseline(cfg: RuntimeConfig, namespace: str, args: argparse.Namespace) -> dict[str, Any]:
    rt = await Runtime.connect(cfg, name="bench-frontend-baseline")
    try:
        client = await rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(1, timeout_s=30)
        rng = random.Random(args.seed)
        counter = iter(range(args.requests))
        out_tokens = 0
        ttfts_ms: list[float] = []

        async def loop() -> None:
            nonlocal out_tokens
            for i in counter:
                prompt = [rng.randrange(0, 256) for _ in range(args.prompt_tokens)]
                req = GenerateRequest(f"base{i}", prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
                sent = time.perf_counter()
                async for item in await client.generate(req.to_dict()):
                    n = len(TokenChunk.from_dict(item).token_ids)
                    if n and not out_tokens_of_request[i]:
                        ttfts_ms.append(1000 * (time.perf_counter() - sent))
                    out_tokens_of_request[i] += n
                    out_tokens += n

        out_tokens_of_request = [0] * args.requests

        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        return {
            "requests_per_s": round(args.requests / wall, 1),
            "output_tokens_per_s": round(out_tokens / wall, 1),
            "client_cpu_ms_per_request": round(1000 * (time.process_time() - c0) / args.requests, 3),
            # The same moment the loadgen times through the frontend: the first output that carries tokens.
            "ttft_ms_p50": round(statistics.median(ttfts_ms), 3) if ttfts_ms else None,
        }
    finally:
        await rt.shutdown(drain_timeout_s=1)


def _kvmesh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "components.cli.main", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    state_dir = resolve_state_dir(args.state_dir or tempfile.mkdtemp(prefix="kvmesh-bench-frontend-"))
    graph = str(ROOT / args.graph)
    started = await asyncio.to_thread(
        _kvmesh,
        "serve", graph, "--detach", "--state-dir", str(state_dir),
        "--set", "frontend.port=0", "--set", "workers[0].speedup_ratio=inf",
    )  # fmt: skip
    if started.returncode != 0:
        raise RuntimeError(
            f"kvmesh serve failed ({started.returncode}): {started.stdout[-2000:]}{started.stderr[-2000:]}"
        )
    namespace = ""
    try:
        states = list(state_dir.glob("*.json"))
        state = read_state(states[0])
        namespace = state.namespace
        frontend = next(w for w in state.watchers if w.kind == "frontend")
        if frontend is None or not frontend.processes or not state.frontend_url:
            raise RuntimeError("the graph has no running frontend")
        fe_pid = frontend.processes[0].pid
        load = await run_load(
            LoadConfig(
                url=state.frontend_url,
                model=args.model,
                concurrency=args.concurrency,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                max_requests=args.requests,
                pids=[fe_pid],
                progress=False,
                seed=args.seed,
            )
        )
        cfg = RuntimeConfig(etcd_endpoints=state.etcd_endpoints, nats_url=state.nats_url)
        baseline = await _runtime_baseline(cfg, namespace, args)
    finally:
        if namespace:
            await asyncio.to_thread(_kvmesh, "stop", namespace, "--state-dir", str(state_dir))
    fe_ms = load["cpu"]["pids_cpu_ms_per_request"]
    completed = load.get("requests_completed")
    return {
        "bench": "frontend",
        "graph": args.graph,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests_completed": completed,
        "errors": load.get("errors"),
        "frontend": {
            "requests_per_s": load["requests_per_s"],
            "output_tokens_per_s": load["output_tokens_per_s"],
            "frontend_cpu_ms_per_request": fe_ms,
            "ttft_ms": load.get("ttft_ms"),
        },
        "baseline_runtime_client": baseline,
        "frontend_cpu_over_runtime_client_cpu": None
        if fe_ms is None
        else round(fe_ms / baseline["client_cpu_ms_per_request"], 3),
        "reference_dynamo_rust_frontend_cpu_ms": DYNAMO_RUST_FRONTEND_CPU_MS_REFERENCE,
        "state_file": str(state_path(state_dir, namespace)) if namespace else None,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", default="graphs/mock_agg.yaml", help="graph to serve (relative to the repository)")
    p.add_argument("--model", default="tiny-llama", help="model name the graph serves")
    p.add_argument("--requests", type=int, default=1000, help="requests per side")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streams")
    p.add_argument("--prompt-tokens", type=int, default=1200, help="prompt length in tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument("--state-dir", default=None, help="where the served graph keeps its state (default: a temp dir)")


def main(args: argparse.Namespace) -> int:
    print(json.dumps(asyncio.run(run(args))))
    return 0
