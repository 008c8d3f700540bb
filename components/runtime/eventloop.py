"""The event loop long-running kvmesh processes (worker, frontend, router) run on: uvloop where it is installed.

Every streamed token crosses two kvmesh event loops (the worker's and the frontend's) besides the engine's, so
their per-wake-up cost is per-token CPU taken from the engine on a busy machine. uvloop (libuv) wakes up and
dispatches socket events several times cheaper than asyncio's default selector loop; vLLM's own OpenAI server
runs on it too (uvicorn picks it). ``KVMESH_UVLOOP=0`` falls back to the default loop; without uvloop installed
(it has no wheels for some platforms) the default loop is used.

Imports: the standard library; ``uvloop`` lazily.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

ENV_UVLOOP = "KVMESH_UVLOOP"


def uvloop_wanted() -> bool:
    return os.environ.get(ENV_UVLOOP, "1").strip().lower() not in ("0", "false", "no", "off")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop when it is installed and not switched off."""
    if uvloop_wanted():
        try:
            import uvloop
        except ImportError:
            logger.debug("uvloop is not installed: the default asyncio loop runs")
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call inside the running loop): a component's ``run`` waits on it, then
    drains and exits."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def freeze_startup_heap() -> int:
    """Put everything start-up allocated out of the cyclic garbage collector's reach; returns how many objects.

    A worker's heap after start-up holds what vLLM and torch imported (importing the adapter's vLLM names alone
    leaves ~600 k objects tracked), a frontend's what aiohttp did (~70 k; transformers and the tokenizer load later,
    and the frontend freezes again once they have: ``components.frontend.main.load_tokenizer_and_freeze``). Each full
    collection while serving would walk all of it again, a pause on the event loop that relays every token. Frozen
    objects are never collected (they live as long as the process anyway) and never scanned. vLLM's OpenAI server
    does the same once it has started.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("start-up heap frozen: %d objects out of the garbage collector's scans", frozen)
    return frozen
