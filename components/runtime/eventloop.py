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
import faulthandler
import gc
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

ENV_UVLOOP = "KVMESH_UVLOOP"

# A process still alive this long after its main coroutine returned (the loop's teardown waits for a task that
# ignores its cancel or for an executor thread; the interpreter joins a thread that never ends) writes every thread's
# Python stack to stderr, its log under ``kvmesh serve``. A supervisor SIGKILLs it at its graceful timeout otherwise
# with nothing said (issue 28: a worker SIGKILLed at 75 s, cause unknown; the stop itself is covered by
# ``process.report_slow_stop``). A healthy exit takes well under a second.
EXIT_REPORT_S = 20.0


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


def report_a_slow_exit(after_s: float = EXIT_REPORT_S) -> None:
    """Call once a process is done and about to exit: if it is still alive ``after_s`` later, every thread's Python
    stack goes to stderr (``EXIT_REPORT_S``). faulthandler's own watchdog thread does it: it holds nothing up and
    needs neither the event loop nor the main thread; a process that exits first cancels it."""
    faulthandler.dump_traceback_later(after_s, exit=False)


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
