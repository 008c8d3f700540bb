"""A small supervisor: every background task is named, owned, logged when it fails and cancelled on close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"supervisor {self._name} is closed; cannot start {name}")
        task = asyncio.create_task(coro, name=f"{self._name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("task %s failed: %r", task.get_name(), exc, exc_info=exc)

    @property
    def task_names(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Cancel every task and wait for them, at most ``timeout_s``."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait(tasks, timeout=timeout_s)
