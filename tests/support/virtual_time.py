"""An asyncio event loop on a virtual clock, for unit tests of code that measures time through the loop's own timers.

``VirtualTimeLoop.time()`` starts at 0 and moves only when the loop would otherwise wait: where a real loop blocks in
``select`` until its earliest timer is due, this one returns at once with the clock advanced to that timer. So
``await asyncio.sleep(0.03)`` takes exactly 0.03 s of this clock and no wall time, and code that computes between
awaits takes no virtual time at all. A test that measures a simulated engine (whose steps are sleeps) with
``clock=loop.time`` therefore reads the modelled times exactly, on any machine, however loaded.

Real I/O still works (the selector is polled without blocking before the clock moves), but a wait with no timer
pending and no ready file descriptor raises instead of hanging: in virtual time it would never end.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        assert self.loop is not None
        if timeout is None:
            raise RuntimeError("the virtual-time loop has nothing scheduled: it would wait forever")
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


def run_virtual(coro: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """Run ``coro`` to completion on a fresh ``VirtualTimeLoop``; its result and the virtual seconds it took."""
    loop = VirtualTimeLoop()
    try:
        result = loop.run_until_complete(coro)
        return result, loop.time()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
