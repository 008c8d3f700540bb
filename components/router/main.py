"""``kvmesh router``: a standalone router for a namespace's workers, until SIGTERM/SIGINT.

    kvmesh router --namespace NS [--component router] [--components backend] [--router-policy kv]
                  [--router-temperature 0] [--kv-overlap-score-weight 1] [--no-router-kv-events] ...
                  [--etcd URL] [--nats URL]

Every ``RouterServiceConfig`` field is a flag (``kvmesh router --help``). Prints ``READY <instance id>`` once it serves
``route`` and ``report`` (components/router/protocol.py), and ``STOPPED`` after a graceful shutdown. Run several with
the same namespace and component: they share their in-flight assignments (``--router-replica-sync``, on by default).
"""

from __future__ import annotations

import argparse
import logging

from components.router.config import RouterServiceConfig
from components.router.service import RouterService
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.process import add_runtime_arguments, never, run_component

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    add_model_arguments(p, RouterServiceConfig)


class RouterProcess:
    """The standalone router as the process kit runs it."""

    def __init__(self, cfg: RouterServiceConfig, runtime: Runtime) -> None:
        self.service = RouterService(cfg, runtime)

    async def start(self) -> str:
        await self.service.start()
        return f"{self.service.instance_id:x}"

    async def ended(self) -> None:
        await never()

    async def stop(self) -> tuple[int, str]:
        logger.info("router %x shutting down", self.service.instance_id)
        await self.service.stop()
        return 0, "STOPPED"


def main(args: argparse.Namespace) -> int:
    cfg = model_from_args(RouterServiceConfig, args)
    return eventloop.run(
        run_component(args, f"kvmesh-router-{cfg.namespace}", lambda runtime: RouterProcess(cfg, runtime))
    )
