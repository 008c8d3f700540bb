"""``kvmesh frontend``: serve the OpenAI API for a namespace's workers until SIGTERM/SIGINT.

    kvmesh frontend --namespace NS [--host 127.0.0.1] [--port 8000] [--replicas N] [--api-key KEY] [--etcd URL] ...

Prints ``READY http://host:port`` once listening (the real port when ``--port 0``), and ``STOPPED`` after a graceful
shutdown: stop listening, let requests in flight finish for up to ``--shutdown-timeout-s``, leave the mesh. The
process around it (flags of the runtime, signals, READY/STOPPED) is ``components.runtime.process``.

``--replicas N`` (default: one per two usable cores, 1 to 8) with N > 1 runs N such processes on the one port under a
small supervisor (``components.frontend.replicas``); N = 1 serves in this process.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os

from components.frontend.config import FrontendConfig, default_replicas
from components.frontend.replicas import REPLICA_ENV, run_replicas
from components.frontend.server import Frontend
from components.frontend.tokenizer import Tokenizer, load_tokenizer
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.process import add_runtime_arguments, never, run_component

logger = logging.getLogger(__name__)

API_KEY_ENV = "KVMESH_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    add_model_arguments(p, FrontendConfig)


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    extra = {}
    if getattr(args, "api_key", None) is None and os.environ.get(API_KEY_ENV):
        extra["api_key"] = os.environ[API_KEY_ENV]
    return model_from_args(FrontendConfig, args, **extra)


def load_tokenizer_and_freeze(path: str) -> Tokenizer:
    """``load_tokenizer`` (in a thread, as the registry calls it), then the heap frozen again.

    The process kit froze the start-up heap before any model was discovered; transformers' imports and the
    tokenizer come later (~250 k tracked objects). Left in the collector's reach, every full collection walked them
    all while serving: measured under ``kvmesh bench frontend`` (kv, 64 streams), 13 full collections in 15 CPU-s of
    serving, ~11 s of wall time in the collector on the loaded 2-core machine. Frozen, a collection walks only what
    requests in flight hold."""
    tok = load_tokenizer(path)
    eventloop.freeze_startup_heap()
    return tok


# The youngest generation's threshold while serving (CPython's default: 700 allocations). Every streamed token
# allocates a few containers (its frame, its item, its chunk), so at 700 the young objects of requests in flight
# (their streams, queues, timers) were scanned and promoted again and again: with the heap frozen, the collector
# still took ~5.6% of the frontend's CPU under ``kvmesh bench frontend`` (kv, 64 streams). A larger young
# generation lets most of a token's garbage die by reference count before a collection looks at it.
GC_YOUNG_THRESHOLD = 20_000


class FrontendProcess:
    """The frontend as the process kit runs it."""

    def __init__(self, cfg: FrontendConfig, runtime: Runtime) -> None:
        self.cfg = cfg
        self.frontend = Frontend(cfg, runtime, tokenizer_loader=load_tokenizer_and_freeze)
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)

    async def start(self) -> str:
        return await self.frontend.start()

    async def ended(self) -> None:
        await never()

    async def stop(self) -> tuple[int, str]:
        logger.info("shutting down: requests in flight get up to %g s", self.cfg.shutdown_timeout_s)
        await self.frontend.stop()
        return 0, "STOPPED"


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    num = cfg.replicas if cfg.replicas is not None else default_replicas()
    if num > 1:
        return run_replicas(cfg, num, args)
    replica = os.environ.get(REPLICA_ENV)
    name = f"kvmesh-frontend-{cfg.namespace}" + (f"-{replica}" if replica else "")
    return eventloop.run(run_component(args, name, lambda runtime: FrontendProcess(cfg, runtime)))
