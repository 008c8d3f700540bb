"""``kvmesh frontend``: the frontend (components/frontend/main.py), and, with ``--enable-rescheduling
--colocated-rescheduling-mode``, the rescheduler's loop in the same process (Llumnix's colocated mode: the
rescheduler runs beside the scheduler instead of as its own process).

The frontend package does not import the rescheduler (both rank 5, tests/unit/test_layering.py): this command wires
them. Its flags are the frontend's, plus the rescheduler's policy flags (``ReschedulerConfig``); without both
switches the command is exactly ``components.frontend.main``. Colocated, the rescheduler:

- follows the frontend's ``--namespace`` and calls the workers of component ``backend``;
- has a fleet view of its own (a ``LiveFleet`` following membership, as a standalone one: the frontend's router
  state is the frontend's own and is not shared across the package line);
- serves its counters on a ``/metrics`` of its own on a free loopback port (``kvmesh status`` shows its URL), so the
  frontend's ``/metrics`` is unchanged;
- starts after the frontend listens and stops before it drains (no migration is started into a frontend shutdown).

The READY line is the frontend's (``READY http://host:port``: ``kvmesh serve`` and tests read it); the rescheduler's
start is logged. With ``--replicas`` above 1 the command refuses colocated mode (exit 2): each replica would run a
rescheduler of its own over the same workers; run ``kvmesh rescheduler`` beside them instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from pydantic import ValidationError

from components.frontend import main as frontend_main
from components.frontend.config import FrontendConfig, default_replicas
from components.frontend.replicas import REPLICA_ENV
from components.rescheduler.config import REPORTED_PREFIXES, Policy, ReschedulerConfig
from components.rescheduler.loop import Rescheduler
from components.rescheduler.run_config import flag_problems
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.process import Component, run_component

logger = logging.getLogger(__name__)

EXIT_USAGE = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    frontend_main.add_arguments(p)
    add_model_arguments(p, ReschedulerConfig)


class Colocated:
    """A component with a rescheduler beside it in its process (module docstring)."""

    def __init__(self, inner: Component, rescheduler: Rescheduler) -> None:
        self.inner = inner
        self.rescheduler = rescheduler

    async def start(self) -> str:
        ready = await self.inner.start()
        logger.info("colocated %s", await self.rescheduler.start())
        return ready

    async def ended(self) -> None:
        """When either ends by itself (a dead rescheduler loop ends the process, as a standalone one would)."""
        waits = [asyncio.ensure_future(self.inner.ended()), asyncio.ensure_future(self.rescheduler.ended())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def stop(self) -> tuple[int, str]:
        code_r, last_r = await self.rescheduler.stop()
        code, last = await self.inner.stop()
        return (code, last) if code else (code_r, last_r if code_r else last)


def colocated_frontend_config(cfg: FrontendConfig, resched: ReschedulerConfig) -> FrontendConfig:
    """The frontend's config beside a colocated rescheduler: with ``prefix_replication``, whose inputs include this
    frontend's request reports' prefixes, those reports carry ``REPORTED_PREFIXES`` unless the flag was given."""
    if (
        Policy.PREFIX_REPLICATION in resched.rescheduling_policies
        and "request_stats_prefixes" not in cfg.model_fields_set
    ):
        return cfg.model_copy(update={"request_stats_prefixes": REPORTED_PREFIXES})
    return cfg


def main(args: argparse.Namespace) -> int:
    try:
        resched = model_from_args(ReschedulerConfig, args)
    except ValidationError as e:
        raise SystemExit("kvmesh frontend: " + flag_problems(e)) from None
    if not resched.colocated_rescheduling_mode:
        return frontend_main.main(args)
    if not resched.enable_rescheduling:
        print(
            "kvmesh frontend: --colocated-rescheduling-mode without --enable-rescheduling: no rescheduler runs",
            file=sys.stderr,
        )
        return frontend_main.main(args)
    cfg = colocated_frontend_config(frontend_main.config_from_args(args), resched)
    num = cfg.replicas if cfg.replicas is not None else default_replicas()
    if num > 1:
        print(
            f"kvmesh frontend: --colocated-rescheduling-mode runs one rescheduler in one frontend process; with "
            f"{num} replicas each would run its own over the same workers. Give --replicas 1, or run "
            "`kvmesh rescheduler` beside the replicas.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    replica = os.environ.get(REPLICA_ENV)
    name = f"kvmesh-frontend-{cfg.namespace}" + (f"-{replica}" if replica else "")

    def build(runtime: Runtime) -> Colocated:
        rescheduler = Rescheduler.from_config(
            runtime, cfg.namespace, resched, where="colocated", metrics_host="127.0.0.1"
        )
        return Colocated(frontend_main.FrontendProcess(cfg, runtime), rescheduler)

    return eventloop.run(run_component(args, name, build))
