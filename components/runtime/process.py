"""The process kit: what every long-running kvmesh component process (worker, frontend, router, and the planner and
rescheduler to come) does around its own work, written once.

- ``add_runtime_arguments``/``runtime_config_from_args``: the etcd/NATS/lease/transport flags, derived from
  ``RuntimeConfig`` (``--etcd`` and ``--nats`` kept as short spellings); precedence is defaults < environment
  (``KVMESH_ETCD_ENDPOINTS`` ...) < flags.
- ``run_component``: connect the runtime, install SIGTERM/SIGINT handling, start the component, freeze the start-up
  heap, print ``READY <what>``, wait for a signal or for the component to end by itself, stop it, leave the mesh and
  print its last line (``STOPPED``, or why it ended). Tests and ``kvmesh serve`` read those lines. A stop still
  running after ``SLOW_STOP_REPORT_S`` logs, once, every task of the process and where each one waits; a process
  still alive ``eventloop.EXIT_REPORT_S`` after that writes its threads' stacks to stderr.

A component is anything with the ``Component`` protocol's three methods; it never imports ``components.cli``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from components.runtime import eventloop
from components.runtime.config import RuntimeConfig
from components.runtime.flags import add_model_arguments, given_values
from components.runtime.runtime import Runtime

logger = logging.getLogger(__name__)

# A stop with nothing in flight takes well under a second (a worker drains, deregisters and revokes its leases); one
# that outlives its supervisor's graceful timeout (75 s for a worker under ``kvmesh serve``) is SIGKILLed without a word
# about what it waited for. Issue 28: twice in fresh-clone CI runs, after an external nats-server's restart, ``kvmesh
# stop`` took 76 s with no log line saying which wait held a worker. 20 s: past any healthy stop, and early enough that
# the report is written well before a 40 s (frontend) or 75 s (worker) graceful timeout runs out.
SLOW_STOP_REPORT_S = 20.0


class Component(Protocol):
    """One component's life inside its process."""

    async def start(self) -> str:
        """Start serving; return what the READY line announces (a URL, instance ids)."""
        ...

    async def ended(self) -> None:
        """Return when the component ended by itself (a worker whose engines all died); never, for most."""
        ...

    async def stop(self) -> tuple[int, str]:
        """Drain and stop; return the process's exit code and its last line (``STOPPED``, ``DEAD <reason>``)."""
        ...


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, RuntimeConfig)


def runtime_config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """Defaults, then the environment, then the flags that were given."""
    return RuntimeConfig.from_env(**given_values(RuntimeConfig, args))


async def run_component(
    args: argparse.Namespace, name: str, build: Callable[[Runtime], Component], drain_timeout_s: float = 5.0
) -> int:
    """Run one component in this process until SIGTERM/SIGINT or until it ends by itself; returns the exit code."""
    runtime = await Runtime.connect(runtime_config_from_args(args), name=name)
    stop = eventloop.stop_on_signals()
    code, last = 1, "STOPPED"
    report: asyncio.Task[None] | None = None
    try:
        component = build(runtime)
        try:
            ready = await component.start()
            eventloop.freeze_startup_heap()
            print(f"READY {ready}", flush=True)
            waits: list[asyncio.Future[Any]] = [
                asyncio.ensure_future(stop.wait()),
                asyncio.ensure_future(component.ended()),
            ]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
                # Collect both outcomes: a cancelled future left unawaited logs "exception was never retrieved".
                await asyncio.gather(*waits, return_exceptions=True)
            logger.info("%s: stopping", name)
        finally:
            report = asyncio.ensure_future(report_slow_stop(name, SLOW_STOP_REPORT_S))
            code, last = await component.stop()
    finally:
        try:
            await runtime.shutdown(drain_timeout_s=drain_timeout_s)
        finally:
            if report is not None:
                report.cancel()
                await asyncio.gather(report, return_exceptions=True)
    print(last, flush=True)
    # What is left runs outside this coroutine: the loop's teardown (every task cancelled and awaited, the default
    # executor's threads joined), then the interpreter's (non-daemon threads joined).
    eventloop.report_a_slow_exit()
    return code


def _frame_where(frame: Any) -> str:
    path = frame.f_code.co_filename
    for root in ("components/", "site-packages/", "asyncio/"):
        if root in path:
            path = path[path.rindex(root) :]
            break
    return f"{frame.f_code.co_name} ({path}:{frame.f_lineno})"


def _await_chain(coro: Any) -> list[Any]:
    """The frames of a suspended coroutine and of what it awaits, outermost first (``Task.get_stack`` gives only the
    outermost for a suspended task). The walk stops at a future or at an async generator's ``asend``."""
    frames: list[Any] = []
    obj = coro
    while obj is not None and len(frames) < 64:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None) or getattr(obj, "ag_await", None)
    return frames


def waiting_tasks(depth: int = 4) -> list[str]:
    """Every task of the running loop but the caller's, by name, with where it waits: its ``depth`` innermost
    frames, innermost first (``wait_for (asyncio/tasks.py:476) < drain (components/runtime/request_plane.py:413)``)."""
    me = asyncio.current_task()
    out = []
    for task in asyncio.all_tasks():
        if task is me:
            continue
        frames = _await_chain(task.get_coro())
        where = " < ".join(_frame_where(f) for f in reversed(frames[-depth:])) if frames else "not started"
        out.append(f"{task.get_name()}: {where}")
    return sorted(out)


async def report_slow_stop(name: str, after_s: float) -> None:
    """Once, ``after_s`` into a stop: a WARNING with every task still there and where it waits (cancelled when the
    stop ends first)."""
    await asyncio.sleep(after_s)
    tasks = waiting_tasks()
    logger.warning("%s: still stopping after %g s; %d tasks wait:\n  %s", name, after_s, len(tasks), "\n  ".join(tasks))


async def never() -> None:
    """``Component.ended`` for components that only end when told to."""
    await asyncio.Event().wait()
