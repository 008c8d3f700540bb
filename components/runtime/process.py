"""The process kit: what every long-running kvmesh component process (worker, frontend, router, and the planner and
rescheduler to come) does around its own work, written once.

- ``add_runtime_arguments``/``runtime_config_from_args``: the etcd/NATS/lease/transport flags, derived from
  ``RuntimeConfig`` (``--etcd`` and ``--nats`` kept as short spellings); precedence is defaults < environment
  (``KVMESH_ETCD_ENDPOINTS`` ...) < flags.
- ``run_component``: connect the runtime, install SIGTERM/SIGINT handling, start the component, freeze the start-up
  heap, print ``READY <what>``, wait for a signal or for the component to end by itself, stop it, leave the mesh and
  print its last line (``STOPPED``, or why it ended). Tests and ``kvmesh serve`` read those lines.

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
            code, last = await component.stop()
    finally:
        await runtime.shutdown(drain_timeout_s=drain_timeout_s)
    print(last, flush=True)
    return code


async def never() -> None:
    """``Component.ended`` for components that only end when told to."""
    await asyncio.Event().wait()
