"""The slow-stop report of ``run_component`` (components/runtime/process.py): which task a stop waits on, and where.

Issue 28: twice in fresh-clone CI runs ``kvmesh stop`` took 76 s after an external nats-server's restart, and nothing
the run kept said which wait held the worker until its 75 s graceful timeout ran out."""

from __future__ import annotations

import asyncio
import logging

from components.runtime.process import report_slow_stop, waiting_tasks


async def _held_here(started: asyncio.Event, release: asyncio.Event) -> None:
    started.set()
    await asyncio.wait_for(release.wait(), 3600)


async def _stopping(started: asyncio.Event, release: asyncio.Event) -> None:
    await _held_here(started, release)


async def test_the_report_names_each_waiting_task_with_its_innermost_frames_first(caplog):
    started, release = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_stopping(started, release), name="worker-stop")
    await started.wait()
    try:
        [line] = [t for t in waiting_tasks() if t.startswith("worker-stop: ")]
        # Innermost first: the wait_for it is suspended in, then the coroutines that awaited it, outward.
        assert line.index("wait_for (asyncio/tasks.py") < line.index("_held_here (") < line.index("_stopping (")
        assert "test_slow_stop_report.py:" in line
        with caplog.at_level(logging.WARNING, logger="components.runtime.process"):
            await report_slow_stop("kvmesh-worker-t", 0.0)
        [record] = caplog.records
        assert "kvmesh-worker-t: still stopping after 0 s" in record.getMessage()
        assert line in record.getMessage()
    finally:
        release.set()
        await task


async def test_a_report_cancelled_before_its_time_says_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="components.runtime.process"):
        report = asyncio.ensure_future(report_slow_stop("kvmesh-worker-t", 3600.0))
        report.cancel()
        await asyncio.gather(report, return_exceptions=True)
    assert caplog.records == []
