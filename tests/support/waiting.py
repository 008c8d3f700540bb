"""Waiting for an event, not for a while: the one ``wait_until`` every test uses, and its relatives.

A test that sleeps for a subscription, a server or a thread to be ready flakes on a loaded machine; these poll the
condition itself, with a bounded timeout that fails the test with what was awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0, step_s: float = 0.005) -> float:
    """Until ``pred()`` holds; returns how long it took. AssertionError after ``timeout_s``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(step_s)
    return time.monotonic() - t0


async def wait_until_async(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0, step_s: float = 0.01) -> float:
    """``wait_until`` for a condition that must be awaited (a probe over the bus)."""
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(step_s)
    return time.monotonic() - t0


def wait_until_sync(pred: Callable[[], bool], timeout_s: float = 5.0, step_s: float = 0.005) -> float:
    """``wait_until`` for a test without an event loop (threads, subprocesses)."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(step_s)
    return time.monotonic() - t0


async def until_subscribed(publish_marker: Callable[[], Awaitable[None]], sub: Any, timeout_s: float = 5.0) -> None:
    """Until an event-plane subscription receives what is published: publish markers until one arrives, then drain
    the ones still in flight. Core NATS delivers only to live subscriptions, and a flush of the subscriber's own
    connection does not always make it live for another connection's publishes (measured: 1-2 of 150 tries lost
    the first events). The caller must recognise and skip markers (e.g. by a source id nothing else uses)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await publish_marker()
        with contextlib.suppress(TimeoutError):
            await sub.get(timeout_s=0.05)
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the subscription received nothing within {timeout_s} s")
    while True:  # markers still in flight
        try:
            await sub.get(timeout_s=0.1)
        except TimeoutError:
            return
