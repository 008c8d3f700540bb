"""``kvmesh bench transport``: the runtime's request plane against a bare nats-py request/stream loop, same run.

Both sides stream ``chunks`` msgpack chunks per request from a server process to this client process:
- bare: the server subscribes to one subject and publishes chunks straight to the request's reply inbox; the client
  multiplexes replies over one wildcard inbox, as nats-py's own request() does. No acks, no sequence checks, no
  cancellation or liveness: the floor of what streaming over NATS costs in Python.
- runtime: ``Endpoint.serve`` / ``Client.generate`` with everything the runtime adds (ack, sequence numbers, END
  frame, discovery, cancellation support), its answers on a direct TCP connection (``response_transport`` "tcp",
  the default).
- runtime_bus: the same client with ``response_transport`` "bus": answers through nats-server, batched per client.

Two phases per side: latency (sequential requests: request -> first chunk p50/p99) and throughput (``concurrency``
concurrent streams: chunks/s). The last line printed is one JSON object with both sides and their ratios.

The bare side's nats-py code lives in ``components/runtime/bare_nats.py``: the runtime is the only package allowed
to import nats-py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from components.cli.bench.mesh import add_mesh_arguments, mesh_servers
from components.runtime.bare_nats import BareClient, BareResponder
from components.runtime.config import RuntimeConfig
from components.runtime.runtime import Runtime

BARE_SUBJECT = "kvmesh_bench.bare"
NAMESPACE = "bench"


def _chunk(i: int) -> dict[str, Any]:
    # About what a worker streams per decode step: a few token ids and a finish flag.
    return {"token_ids": [1000 + i], "finish_reason": None}


async def serve(cfg: RuntimeConfig) -> None:
    """The server process: one bare nats-py responder and one runtime endpoint, both streaming ``n`` chunks."""
    bare = await BareResponder.start(cfg.nats_url, BARE_SUBJECT, _chunk)
    rt = await Runtime.connect(cfg)

    async def handler(body: Any, ctx: Any) -> Any:
        for i in range(body["n"]):
            yield _chunk(i)

    await rt.namespace(NAMESPACE).component("backend").endpoint("generate").serve(handler)
    print("READY", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await rt.shutdown(drain_timeout_s=1)
    await bare.close()


async def _runtime_stream(client: Any, n: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    stream = await client.generate({"n": n})
    first = 0.0
    got = 0
    async for _ in stream:
        if got == 0:
            first = time.perf_counter() - t0
        got += 1
    return first, got


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def _measure(one: Any, chunks: int, latency_requests: int, requests: int, concurrency: int) -> dict[str, Any]:
    for _ in range(20):  # warm-up
        await one(chunks)
    firsts = [(await one(chunks))[0] for _ in range(latency_requests)]
    it = iter(range(requests))
    total = 0

    async def worker() -> None:
        nonlocal total
        for _ in it:
            _, got = await one(chunks)
            total += got

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    assert total == requests * chunks, f"lost chunks: {total} != {requests * chunks}"
    return {
        "chunks_per_s": round(total / wall, 1),
        "requests_per_s": round(requests / wall, 1),
        "first_chunk_p50_us": round(_pct(firsts, 50) * 1e6, 1),
        "first_chunk_p99_us": round(_pct(firsts, 99) * 1e6, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with mesh_servers(args.etcd, args.nats) as (etcd, nats_url):
        return await _run(args, etcd, nats_url)


async def _run(args: argparse.Namespace, etcd: str, nats_url: str) -> dict[str, Any]:
    cfg = RuntimeConfig(etcd_endpoints=[etcd], nats_url=nats_url)
    env = os.environ | {"KVMESH_ETCD_ENDPOINTS": etcd, "KVMESH_NATS_URL": nats_url}
    child = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
        [sys.executable, "-m", "components.cli.bench.transport", "--serve"], stdout=subprocess.PIPE, env=env
    )
    rt = rt_bus = None
    bare: BareClient | None = None
    try:
        assert child.stdout is not None
        async with asyncio.timeout(60):
            line = await asyncio.to_thread(child.stdout.readline)
        if line.strip() != b"READY":
            raise RuntimeError(f"bench server did not start: {line!r}")
        bare = await BareClient.connect(nats_url, BARE_SUBJECT)
        rt = await Runtime.connect(cfg.model_copy(update={"response_transport": "tcp"}))
        client = await rt.namespace(NAMESPACE).component("backend").endpoint("generate").client()
        await client.wait_for_instances(1)
        rt_bus = await Runtime.connect(cfg.model_copy(update={"response_transport": "bus"}))
        client_bus = await rt_bus.namespace(NAMESPACE).component("backend").endpoint("generate").client()
        await client_bus.wait_for_instances(1)

        async def rt_one(k: int) -> tuple[float, int]:
            return await _runtime_stream(client, k)

        async def rt_bus_one(k: int) -> tuple[float, int]:
            return await _runtime_stream(client_bus, k)

        m = (args.chunks, args.latency_requests, args.requests, args.concurrency)
        # Interleave the sides so drift on a noisy machine affects them alike.
        results: dict[str, list[dict[str, Any]]] = {"bare_nats": [], "runtime": [], "runtime_bus": []}
        for _ in range(args.rounds):
            results["bare_nats"].append(await _measure(bare.stream, *m))
            results["runtime"].append(await _measure(rt_one, *m))
            results["runtime_bus"].append(await _measure(rt_bus_one, *m))
        best = {
            side: {
                "chunks_per_s": max(r["chunks_per_s"] for r in rs),
                "requests_per_s": max(r["requests_per_s"] for r in rs),
                "first_chunk_p50_us": min(r["first_chunk_p50_us"] for r in rs),
                "first_chunk_p99_us": min(r["first_chunk_p99_us"] for r in rs),
            }
            for side, rs in results.items()
        }
        b, r, rb = best["bare_nats"], best["runtime"], best["runtime_bus"]
        return {
            "bench": "transport",
            "chunks_per_request": args.chunks,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "rounds": args.rounds,
            "bare_nats": b,
            "runtime": r,
            "runtime_bus": rb,
            "throughput_ratio_bare_over_runtime": round(b["chunks_per_s"] / r["chunks_per_s"], 3),
            "throughput_ratio_tcp_over_bus": round(r["chunks_per_s"] / rb["chunks_per_s"], 3),
            "first_chunk_p50_ratio_tcp_over_bus": round(r["first_chunk_p50_us"] / rb["first_chunk_p50_us"], 3),
            "first_chunk_p50_ratio_runtime_over_bare": round(r["first_chunk_p50_us"] / b["first_chunk_p50_us"], 3),
            "first_chunk_p99_ratio_runtime_over_bare": round(r["first_chunk_p99_us"] / b["first_chunk_p99_us"], 3),
            "target": "both ratios <= 1.3",
        }
    finally:
        for runtime in (rt, rt_bus):
            if runtime is not None:
                await runtime.shutdown(drain_timeout_s=1)
        if bare is not None:
            await bare.close()
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(10)
        if child.poll() is None:
            child.kill()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=2000, help="requests in the throughput phase")
    ap.add_argument("--concurrency", type=int, default=64, help="concurrent streams in the throughput phase")
    ap.add_argument("--chunks", type=int, default=64, help="chunks streamed per request")
    ap.add_argument("--latency-requests", type=int, default=500, help="sequential requests in the latency phase")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per side; the best of each is kept")
    add_mesh_arguments(ap)


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:
        asyncio.run(serve(RuntimeConfig.from_env()))
    else:
        ap = argparse.ArgumentParser()
        add_arguments(ap)
        sys.exit(main(ap.parse_args()))
