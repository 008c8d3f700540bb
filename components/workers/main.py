"""``kvmesh worker``: run one or more workers in this process until SIGTERM/SIGINT, then drain and exit 0.

    kvmesh worker --engine mock --namespace NS --component backend --model NAME --num-workers 16 --speedup-ratio inf

Engine options come from the engine's own config model (``MockEngineConfig`` for the simulated engine).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from components.cli.args import add_model_arguments, model_from_args
from components.runtime import Runtime, RuntimeConfig
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.base import Engine
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=None, help="etcd endpoint (default: $KVMESH_ETCD_ENDPOINTS or 127.0.0.1:2379)")
    p.add_argument("--nats", default=None, help="NATS URL (default: $KVMESH_NATS_URL or 127.0.0.1:4222)")
    add_model_arguments(p, WorkerConfig)
    add_model_arguments(p, MockEngineConfig)


def make_engine(cfg: WorkerConfig, args: argparse.Namespace, index: int) -> Engine:
    if cfg.engine == EngineKind.MOCK:
        # One seed for the whole fleet: identical requests give identical tokens on every worker.
        return MockEngine(model_from_args(MockEngineConfig, args), name=f"mock-{index}")
    raise SystemExit(f"engine {cfg.engine} is not available in this build (supported: mock)")


async def run(args: argparse.Namespace) -> int:
    cfg = model_from_args(WorkerConfig, args)
    rcfg = RuntimeConfig.from_env(etcd_endpoints=[args.etcd] if args.etcd else None, nats_url=args.nats)
    runtime = await Runtime.connect(rcfg, name=f"kvmesh-worker-{cfg.namespace}")
    workers = [Worker(runtime, cfg, make_engine(cfg, args, i), index=i) for i in range(cfg.num_workers)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(*(w.start() for w in workers))
        ids = ",".join(f"{w.instance_id:x}" for w in workers)
        print(f"READY {len(workers)} workers: {ids}", flush=True)
        logger.info("%d %s workers serving %s in %s", len(workers), cfg.engine, cfg.model, cfg.namespace)
        await stop.wait()
        logger.info("draining %d workers", len(workers))
        cancelled = sum(await asyncio.gather(*(w.stop() for w in workers)))
        if cancelled:
            logger.warning("%d requests outlived the drain timeout and were cancelled", cancelled)
    finally:
        await runtime.shutdown(drain_timeout_s=cfg.drain_timeout_s)
    print("STOPPED", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(args))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvmesh worker")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
