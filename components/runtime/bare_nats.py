"""A bare nats-py request/stream loop: the floor ``kvmesh bench transport`` measures the runtime against.

The responder subscribes to one subject and publishes msgpack ``[i, chunk]`` frames straight to the request's reply
inbox, then ``[n, None]``; the client multiplexes replies over one wildcard inbox, as nats-py's own request() does.
No acks, no sequence checks, no cancellation or liveness. It lives here because ``components/runtime`` is the only
package that may import nats-py; the benchmark itself lives in ``components/cli/bench/transport.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import msgpack
import nats


class BareResponder:
    """Streams ``make_chunk(i)`` for i in range(n) to every request ``{"n": n}`` on ``subject``."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc

    @classmethod
    async def start(cls, nats_url: str, subject: str, make_chunk: Callable[[int], Any]) -> BareResponder:
        nc = await nats.connect(nats_url)
        packb = msgpack.packb

        async def on_request(msg: Any) -> None:
            n = msgpack.unpackb(msg.data)["n"]
            for i in range(n):
                await nc.publish(msg.reply, packb([i, make_chunk(i)]))
            await nc.publish(msg.reply, packb([n, None]))

        await nc.subscribe(subject, cb=on_request)
        await nc.flush()
        return cls(nc)

    async def close(self) -> None:
        await self.nc.close()


class BareClient:
    """Requests ``n`` chunks from a ``BareResponder`` and times the first."""

    def __init__(self, nc: Any, subject: str) -> None:
        self.nc = nc
        self.subject = subject
        self.prefix = nc.new_inbox()
        self.queues: dict[str, asyncio.Queue[bytes]] = {}
        self.ids = itertools.count()

    @classmethod
    async def connect(cls, nats_url: str, subject: str) -> BareClient:
        client = cls(await nats.connect(nats_url), subject)

        async def on_msg(msg: Any) -> None:
            q = client.queues.get(msg.subject)
            if q is not None:
                q.put_nowait(msg.data)

        await client.nc.subscribe(client.prefix + ".*", cb=on_msg, pending_msgs_limit=1_000_000)
        return client

    async def stream(self, n: int) -> tuple[float, int]:
        """Returns (seconds to first chunk, chunks received)."""
        inbox = f"{self.prefix}.{next(self.ids)}"
        q: asyncio.Queue[bytes] = asyncio.Queue()
        self.queues[inbox] = q
        t0 = time.perf_counter()
        await self.nc.publish(self.subject, msgpack.packb({"n": n}), reply=inbox)
        first = 0.0
        got = 0
        try:
            while True:
                _, chunk = msgpack.unpackb(await q.get())
                if chunk is None:
                    return first, got
                if got == 0:
                    first = time.perf_counter() - t0
                got += 1
        finally:
            del self.queues[inbox]

    async def close(self) -> None:
        await self.nc.close()
