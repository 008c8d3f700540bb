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

from components.cli.args import add_model_arguments, model_from_args
from components.router.config import RouterServiceConfig
from components.router.service import RouterService
from components.runtime import Runtime, RuntimeConfig, eventloop

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=None, help="etcd endpoint (default: $KVMESH_ETCD_ENDPOINTS or 127.0.0.1:2379)")
    p.add_argument("--nats", default=None, help="NATS URL (default: $KVMESH_NATS_URL or 127.0.0.1:4222)")
    add_model_arguments(p, RouterServiceConfig)


async def run(args: argparse.Namespace) -> int:
    cfg = model_from_args(RouterServiceConfig, args)
    rcfg = RuntimeConfig.from_env(etcd_endpoints=[args.etcd] if args.etcd else None, nats_url=args.nats)
    runtime = await Runtime.connect(rcfg, name=f"kvmesh-router-{cfg.namespace}")
    stop = eventloop.stop_on_signals()
    service = RouterService(cfg, runtime)
    try:
        await service.start()
        eventloop.freeze_startup_heap()
        print(f"READY {service.instance_id:x}", flush=True)
        await stop.wait()
        logger.info("router %x shutting down", service.instance_id)
    finally:
        try:
            await service.stop()
        finally:
            await runtime.shutdown()
    print("STOPPED", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    return eventloop.run(run(args))
