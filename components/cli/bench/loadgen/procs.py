"""``run_load_procs(config, n)``: one load split over ``n`` load-generator processes, their results merged.

One Python process parsing 64 SSE streams spends ~1-1.3 CPU-ms a request (docs/frontend.md), so a single load
generator caps a run at ~800-1,000 requests/s on its one core, whatever the server could serve: a many-core
machine needs several. Each process runs ``run_load`` on a shard of the workload (``LoadConfig.shard_count`` and
``shard_index``: the same seed, so the same shared prefixes, and disjoint prompts), with its share of the concurrency
and of ``max_requests``. The processes start (spawned: a fresh interpreter, nothing inherited from the caller's event
loop or threads), say they are ready, and are released together; the CPU of the measured ``pids`` is read around
that release and their end, not their start-up.

Merged: counts, tokens and errors summed; requests/s and tokens/s summed over the processes (each is its own
completed requests over its own duration, and the processes run side by side); TTFT, ITL and end-to-end
percentiles over every request of every process (each process hands back its raw samples, not only its
percentiles); the load generators' CPU summed (``cpu.loadgen_cpu_ms``) and listed per process.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
from collections import Counter
from typing import Any

from .config import DEFAULT_CONCURRENCY, LoadConfig
from .errors import LoadgenError
from .runner import _per_request, run_load
from .stats import CpuMeter, RequestResult, summarize_ms

START_TIMEOUT_S = 120.0  # a spawned process imports aiohttp and the loadgen (~1-2 s; much more on a busy machine)


def split(cfg: LoadConfig, n: int) -> list[LoadConfig]:
    """``cfg`` as ``n`` shards: concurrency and max_requests divided as evenly as integers allow (the first shards
    take one more), no CPU measured or progress drawn by a shard (the caller measures around all of them)."""
    concurrency = cfg.concurrency or DEFAULT_CONCURRENCY
    if n < 1 or n > concurrency or n > cfg.max_requests:
        raise LoadgenError(f"{n} load generators for concurrency {concurrency} and {cfg.max_requests} requests")
    out = []
    for i in range(n):
        out.append(
            cfg.model_copy(
                update={
                    "concurrency": concurrency // n + (i < concurrency % n),
                    "max_requests": cfg.max_requests // n + (i < cfg.max_requests % n),
                    "shard_count": n,
                    "shard_index": i,
                    "pids": [],
                    "progress": False,
                }
            )
        )
    return out


def _child(cfg_json: str, ready: Any, go: Any, results: Any) -> None:  # pragma: no cover - runs in a child process
    cfg = LoadConfig.model_validate_json(cfg_json)
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []

    def keep(r: RequestResult) -> None:
        if r.error is None:
            if r.ttft_s is not None:
                ttft.append(r.ttft_s)
            if r.e2e_s is not None:
                e2e.append(r.e2e_s)
            itl.extend(r.itl_s)

    ready.put(cfg.shard_index)
    go.wait()
    try:
        out = asyncio.run(run_load(cfg, on_result=keep))
    except Exception as e:  # noqa: BLE001 - handed to the parent, which raises it
        results.put((cfg.shard_index, None, f"{type(e).__name__}: {e}", [], [], []))
        return
    results.put((cfg.shard_index, out, None, ttft, itl, e2e))


def merge(outs: list[dict[str, Any]], ttft: list[float], itl: list[float], e2e: list[float]) -> dict[str, Any]:
    """The shards' ``run_load`` results as one (module docstring); ``cpu.pids`` is left to the caller."""
    done = sum(o["requests_completed"] for o in outs)
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for o in outs:
        errors.update(o["errors"])
        for k, v in o["error_examples"].items():
            examples.setdefault(k, v)
    loadgen_ms = [o["cpu"]["loadgen_cpu_ms"] for o in outs]
    first = outs[0]
    return {
        "bench": "load",
        "url": first["url"],
        "model": first["model"],
        "mode": first["mode"],
        "concurrency": sum(o["concurrency"] or 0 for o in outs),
        "source": first["source"],
        "trace": first["trace"],
        "loadgen_procs": len(outs),
        "requests_sent": sum(o["requests_sent"] for o in outs),
        "requests_completed": done,
        "requests_failed": sum(o["requests_failed"] for o in outs),
        "requests_cancelled": sum(o["requests_cancelled"] for o in outs),
        "duration_s": max(o["duration_s"] for o in outs),
        "requests_per_s": round(sum(o["requests_per_s"] for o in outs), 3),
        "output_tokens": sum(o["output_tokens"] for o in outs),
        "input_tokens": sum(o["input_tokens"] for o in outs),
        "cached_input_tokens": sum(o["cached_input_tokens"] for o in outs),
        "output_tokens_per_s": round(sum(o["output_tokens_per_s"] for o in outs), 3),
        "input_tokens_per_s": round(sum(o["input_tokens_per_s"] for o in outs), 3),
        "ttft_ms": summarize_ms(ttft),
        "itl_ms": summarize_ms(itl),
        "e2e_ms": summarize_ms(e2e),
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "usage_missing": sum(o["usage_missing"] for o in outs),
        "max_in_flight": sum(o["max_in_flight"] for o in outs),
        "cpu": {
            "pids": {},
            "pids_include_children": first["cpu"]["pids_include_children"],
            "pids_cpu_ms_per_request": None,
            "loadgen_cpu_ms": round(sum(loadgen_ms), 3),
            "loadgen_cpu_ms_per_request": _per_request(sum(loadgen_ms), done),
            "loadgen_cpu_ms_per_proc": loadgen_ms,
        },
    }


def _run(cfg: LoadConfig, n: int) -> dict[str, Any]:
    """Blocking: start the shards, release them together, measure ``cfg.pids`` around them, merge."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_child, args=(c.model_dump_json(), ready, go, results), name=f"kvmesh-loadgen-{c.shard_index}"
        )
        for c in split(cfg, n)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            try:
                ready.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                raise LoadgenError(f"a load-generator process was not ready within {START_TIMEOUT_S:.0f} s") from None
        cpu = CpuMeter(cfg.pids, cfg.pids_include_children)
        cpu.start()
        go.set()
        got: list[tuple[int, dict[str, Any] | None, str | None, list[float], list[float], list[float]]] = []
        bound_s = cfg.duration_s + cfg.drain_timeout_s + START_TIMEOUT_S
        for _ in procs:
            try:
                got.append(results.get(timeout=bound_s))
            except queue.Empty:
                raise LoadgenError(f"a load-generator process sent no result within {bound_s:.0f} s") from None
        pid_ms, _ = cpu.stop()
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    failed = [err for _, out, err, *_ in got if out is None]
    if failed:
        raise LoadgenError(f"load-generator process failed: {failed[0]}")
    got.sort(key=lambda g: g[0])
    outs = [out for _, out, *_ in got if out is not None]
    merged = merge(
        outs,
        [x for g in got for x in g[3]],
        [x for g in got for x in g[4]],
        [x for g in got for x in g[5]],
    )
    done = merged["requests_completed"]
    known = [ms for ms in pid_ms.values() if ms is not None]
    merged["cpu"]["pids"] = {
        str(p): {"cpu_ms": None if ms is None else round(ms, 3), "cpu_ms_per_request": _per_request(ms, done)}
        for p, ms in pid_ms.items()
    }
    merged["cpu"]["pids_cpu_ms_per_request"] = (
        _per_request(sum(known), done) if pid_ms and len(known) == len(pid_ms) else None
    )
    return merged


async def run_load_procs(config: LoadConfig, n: int) -> dict[str, Any]:
    """``run_load(config)`` split over ``n`` processes (module docstring); ``n`` 1 runs it here, in this process."""
    if n <= 1:
        return await run_load(config)
    return await asyncio.to_thread(_run, config, n)
