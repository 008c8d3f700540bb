"""``kvmesh frontend``: serve the OpenAI API for a namespace's workers until SIGTERM/SIGINT.

    kvmesh frontend --namespace NS [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--etcd URL] [--nats URL]

Prints ``READY http://host:port`` once listening (the real port when ``--port 0``), and ``STOPPED`` after a graceful
shutdown: stop listening, let requests in flight finish for up to ``--shutdown-timeout-s``, leave the mesh.
"""

from __future__ import annotations

import argparse
import logging
import os

from components.cli.args import add_model_arguments, model_from_args
from components.frontend.config import FrontendConfig
from components.frontend.server import Frontend
from components.runtime import Runtime, RuntimeConfig, eventloop

logger = logging.getLogger(__name__)

API_KEY_ENV = "KVMESH_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=None, help="etcd endpoint (default: $KVMESH_ETCD_ENDPOINTS or 127.0.0.1:2379)")
    p.add_argument("--nats", default=None, help="NATS URL (default: $KVMESH_NATS_URL or 127.0.0.1:4222)")
    add_model_arguments(p, FrontendConfig)


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    extra = {}
    if getattr(args, "api_key", None) is None and os.environ.get(API_KEY_ENV):
        extra["api_key"] = os.environ[API_KEY_ENV]
    return model_from_args(FrontendConfig, args, **extra)


async def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    rcfg = RuntimeConfig.from_env(etcd_endpoints=[args.etcd] if args.etcd else None, nats_url=args.nats)
    runtime = await Runtime.connect(rcfg, name=f"kvmesh-frontend-{cfg.namespace}")
    stop = eventloop.stop_on_signals()
    frontend = Frontend(cfg, runtime)
    try:
        url = await frontend.start()
        eventloop.freeze_startup_heap()
        print(f"READY {url}", flush=True)
        await stop.wait()
        logger.info("shutting down: requests in flight get up to %g s", cfg.shutdown_timeout_s)
    finally:
        try:
            await frontend.stop()
        finally:
            await runtime.shutdown()
    print("STOPPED", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    return eventloop.run(run(args))
