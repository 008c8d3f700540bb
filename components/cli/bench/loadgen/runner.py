"""``run_load(config) -> dict``: drives a load against an OpenAI-compatible endpoint and returns its measurements.

Two ways to send:
* **closed loop** (``concurrency`` set, or a source without timestamps: synthetic prompts, ShareGPT): ``concurrency``
  tasks each send a request, wait for its end, send the next; trace timestamps are ignored.
* **replay** (a Mooncake or Azure trace and no ``concurrency``): open loop, each request is sent at its scaled trace
  time whatever is in flight, as the trace's users did. How late the sends were against the schedule is reported
  (``dispatch_lag_ms``): a large lag means the load generator, not the server, shaped the load.

Bounds, always both: at most ``max_requests`` requests, none sent after ``duration_s``; requests still in flight then
get ``drain_timeout_s`` and are cancelled (``requests_cancelled``). Rates are over the run's duration: from the
first send to the end of the last request.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import aiohttp

from components.sim.traces import MooncakeBlocks, TraceRow, detect_format, read_trace, synthetic_rows

from .client import send_request
from .config import DEFAULT_CONCURRENCY, LoadConfig, base_url
from .errors import LoadgenError
from .progress import make_progress
from .stats import Aggregate, CpuMeter, RequestResult, summarize_ms
from .traces import build_request, replay_schedule, select_rows

logger = logging.getLogger(__name__)

TIMESTAMPED_FORMATS = ("mooncake", "azure")


def _per_request(ms: float | None, n: int) -> float | None:
    return None if ms is None or n == 0 else round(ms / n, 3)


class _Run:
    """One run's state: the session, the aggregate, the tasks in flight."""

    def __init__(
        self,
        cfg: LoadConfig,
        base: str,
        session: aiohttp.ClientSession,
        total: int | None,
        stream: IO[str],
        on_result: Callable[[RequestResult], None] | None = None,
    ):
        self.cfg = cfg
        self.on_result = on_result
        self.base = base
        self.session = session
        self.agg = Aggregate()
        self.blocks = MooncakeBlocks(cfg.vocab_size, cfg.seed)
        self.progress = make_progress(cfg.progress, total, stream)
        self.in_flight = 0
        self.max_in_flight = 0
        self.lags_s: list[float] = []

    async def one(self, row: TraceRow) -> None:
        spec = build_request(row, self.cfg, self.blocks)
        self.agg.sent += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            result = await send_request(
                self.session,
                self.base,
                spec,
                model=self.cfg.model,
                ignore_eos=self.cfg.ignore_eos,
                extra_body=self.cfg.extra_body,
                timeout_s=self.cfg.request_timeout_s,
            )
        finally:
            self.in_flight -= 1
        self.agg.add(result)
        if self.on_result is not None:
            self.on_result(result)
        self.progress.update(result.error is not None)

    async def closed_loop(self, rows: Iterator[TraceRow], concurrency: int, send_until: float) -> None:
        loop = asyncio.get_running_loop()

        async def worker() -> None:
            while loop.time() < send_until:
                row = next(rows, None)
                if row is None:
                    return
                await self.one(row)

        workers = [asyncio.create_task(worker(), name=f"loadgen-worker-{i}") for i in range(concurrency)]
        await _finish(workers, send_until + self.cfg.drain_timeout_s)

    async def replay(self, schedule: list[tuple[float, TraceRow]], start: float, send_until: float) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        try:
            for send_at, row in schedule:
                delay = start + send_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                now = loop.time()
                if now >= send_until:
                    break
                self.lags_s.append(max(0.0, now - start - send_at))
                task = asyncio.create_task(self.one(row), name=f"loadgen-request-{row.index}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except BaseException:
            await _cancel(list(tasks))
            raise
        await _finish(list(tasks), send_until + self.cfg.drain_timeout_s)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _finish(tasks: list[asyncio.Task[None]], hard_deadline: float) -> None:
    """Wait for ``tasks`` until ``hard_deadline`` (loop time), cancel the rest, re-raise the first task error."""
    try:
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, hard_deadline - asyncio.get_running_loop().time()))
    finally:
        # Also on our own cancellation: no request outlives run_load.
        await _cancel([t for t in tasks if not t.done()])
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]  # a bad trace row, met while sending


async def run_load(
    config: LoadConfig | Mapping[str, Any],
    *,
    progress_stream: IO[str] | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
) -> dict[str, Any]:
    """Run one load as configured and return the measurements (the dict ``kvmesh bench load`` prints as JSON).
    ``on_result`` is called with each request's result as it ends (a caller that wants the distributions, not only
    their percentiles).

    Raises ``LoadgenError`` (a remote URL without ``allow_remote``) or ``TraceFormatError`` (a bad trace) before
    sending anything, or when a trace row turns out malformed while sending; errors of single requests are counted,
    never raised.
    """
    cfg = config if isinstance(config, LoadConfig) else LoadConfig.model_validate(config)
    base = base_url(cfg.url, cfg.allow_remote)
    fmt = "synthetic"
    rows: Iterator[TraceRow]
    if cfg.trace:
        fmt = detect_format(cfg.trace) if cfg.trace_format == "auto" else cfg.trace_format
        rows = read_trace(cfg.trace, fmt)
    else:
        rows = synthetic_rows(cfg.prompt_tokens, cfg.max_tokens)
    if cfg.shard_count > 1:
        rows = (r for r in rows if r.index % cfg.shard_count == cfg.shard_index)
    timestamped = fmt in TIMESTAMPED_FORMATS
    if cfg.start_offset_s and not timestamped:
        raise LoadgenError(f"start_offset_s needs a timestamped trace (Mooncake, Azure); {fmt} has no timestamps")
    replay = timestamped and cfg.concurrency is None
    concurrency = None if replay else (cfg.concurrency or DEFAULT_CONCURRENCY)

    schedule: list[tuple[float, TraceRow]] = []
    if replay:
        schedule = replay_schedule(rows, cfg.start_offset_s, cfg.time_scale, cfg.max_requests, cfg.duration_s)
        total: int | None = len(schedule)
    else:
        rows = select_rows(rows, cfg.start_offset_s, cfg.max_requests)
        total = cfg.max_requests
    logger.info(
        "load on %s: %s, source %s, at most %d requests in %.1f s",
        base,
        "replay" if replay else f"concurrency {concurrency}",
        fmt,
        total,
        cfg.duration_s,
    )

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # No connection cap (the concurrency or the trace sets it) and no session-wide timeout (request_timeout_s is
    # applied per request; aiohttp's default total of 300 s would cut long streams).
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    cpu = CpuMeter(cfg.pids, cfg.pids_include_children)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        run = _Run(cfg, base, session, total, progress_stream or sys.stderr, on_result)
        loop = asyncio.get_running_loop()
        try:
            cpu.start()
            t0 = time.perf_counter()
            start = loop.time()
            if replay:
                await run.replay(schedule, start, start + cfg.duration_s)
            else:
                assert concurrency is not None
                await run.closed_loop(rows, concurrency, start + cfg.duration_s)
            duration_s = time.perf_counter() - t0
            pid_ms, own_ms = cpu.stop()
        finally:
            run.progress.close()

    agg = run.agg
    done = agg.completed

    def rate(x: float) -> float:
        return round(x / duration_s, 3) if duration_s > 0 else 0.0

    known = [ms for ms in pid_ms.values() if ms is not None]
    pids_total = sum(known) if pid_ms and len(known) == len(pid_ms) else None  # None if a pid was missing
    out: dict[str, Any] = {
        "bench": "load",
        "url": base,
        "model": cfg.model,
        "mode": "replay" if replay else "concurrency",
        "concurrency": concurrency,
        "source": fmt,
        "trace": cfg.trace,
        "time_scale": cfg.time_scale if replay else None,
        "requests_sent": agg.sent,
        "requests_completed": done,
        "requests_failed": agg.failed,
        "requests_cancelled": agg.sent - done - agg.failed,
        "duration_s": round(duration_s, 3),
        "requests_per_s": rate(done),
        "output_tokens": agg.output_tokens,
        "input_tokens": agg.prompt_tokens,
        "cached_input_tokens": agg.cached_tokens,  # as the server reported them (0 where it does not)
        "output_tokens_per_s": rate(agg.output_tokens),
        "input_tokens_per_s": rate(agg.prompt_tokens),
        "ttft_ms": summarize_ms(agg.ttft_s),
        "itl_ms": summarize_ms(agg.itl_s),
        "e2e_ms": summarize_ms(agg.e2e_s),
        "errors": dict(sorted(agg.errors.items())),
        "error_examples": agg.error_examples,
        "usage_missing": agg.usage_missing,
        "max_in_flight": run.max_in_flight,
        "dispatch_lag_ms": summarize_ms(run.lags_s) if replay else None,
        # CPU per *completed* request: the cost of useful work (failed requests' CPU is included in the numerator).
        "cpu": {
            "pids": {
                str(p): {"cpu_ms": None if ms is None else round(ms, 3), "cpu_ms_per_request": _per_request(ms, done)}
                for p, ms in pid_ms.items()
            },
            "pids_include_children": cfg.pids_include_children,
            "pids_cpu_ms_per_request": _per_request(pids_total, done),
            "loadgen_cpu_ms": round(own_ms, 3),
            "loadgen_cpu_ms_per_request": _per_request(own_ms, done),
        },
    }
    return out
