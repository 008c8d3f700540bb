"""Direct TCP connections that carry response batches from instances to client runtimes, around nats-server.

A streamed token otherwise crosses nats-server: worker -> nats-server -> frontend, two socket hops and two process
wake-ups per engine step. Requests, cancels and probes still travel on the bus (discovery, no-responders, queue
groups); only the instance -> client batches (``request_plane``'s ``[[key, seq, kind, payload], ...]``) can take a
direct connection, as Dynamo's TCP response streams do.

- A client runtime listens on ``RuntimeConfig.response_host`` (127.0.0.1 unless configured: a worker on another
  machine needs an address it can reach) on a free port, and names ``host:port`` in every request.
- An instance opens one connection per client address, on first use, and writes each batch to it as one msgpack
  object; the stream of objects needs no framing (``msgpack.Unpacker``). Batches queued while it connects go out
  once connected, in order.
- A connection that cannot be opened, or breaks, is given up: the instance sends that client's batches over the bus
  from then on, the same bytes on the client's batch subject, so a client behind a firewall still gets its answers.
  Frames written into a connection that broke may be lost; the client notices as for a lost NATS message (a gap in
  sequence numbers, or silence and a probe).

Nothing here is specific to NATS or etcd; the module uses asyncio's sockets and msgpack only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, cast

import msgpack

logger = logging.getLogger(__name__)

BatchHandler = Callable[[list[Any], Any], None]  # (batch, the connection it came on)

# A malformed or hostile peer cannot make the listener buffer more than this for one object.
MAX_BUFFER_BYTES = 64 * 1024 * 1024


class _Inbound(asyncio.Protocol):
    """One instance's connection to this client: every msgpack object read is a batch for ``on_batch``."""

    def __init__(self, on_batch: BatchHandler, listener: ResponseListener) -> None:
        self._on_batch = on_batch
        self._listener = listener
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=MAX_BUFFER_BYTES)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._listener.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
            for batch in self._unpacker:
                if isinstance(batch, list):
                    self._on_batch(batch, self)
        except Exception as e:  # noqa: BLE001 - garbage on the socket: drop this peer, keep serving the others
            logger.warning("response channel: dropping a connection that sent a malformed batch: %s", e)
            if self._transport is not None:
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.connections.discard(self)
        if self._listener.on_lost is not None:
            self._listener.on_lost(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class ResponseListener:
    """The client side: accepts instances' connections and hands every batch read to ``on_batch`` with the
    connection it came on; ``on_lost(connection)`` when one closes (its instance's process may have died)."""

    def __init__(self, host: str, on_batch: BatchHandler, on_lost: Callable[[Any], None] | None = None) -> None:
        self.host = host
        self._on_batch = on_batch
        self.on_lost = on_lost
        self._server: asyncio.Server | None = None
        self.address = ""
        self.connections: set[_Inbound] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Inbound(self._on_batch, self), self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"{host}:{port}"

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for c in list(self.connections):
            c.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._server.wait_closed()
        self._server = None


class _Outbound(asyncio.Protocol):
    """One connection from this instance to one client address."""

    def __init__(self, owner: ResponseConnections, address: str) -> None:
        self._owner = owner
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] | None = []  # batches queued while connecting; None once connected
        self.broken = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        pending, self.pending = self.pending or [], None
        if pending:
            self.transport.writelines(pending)

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._lost(self, f"connection lost: {exc}" if exc else "closed by the client")

    def send(self, data: bytes) -> bool:
        """Queue or write one batch; False when this connection is broken (send it another way)."""
        if self.broken:
            return False
        if self.pending is not None:
            self.pending.append(data)
        else:
            self.transport.write(data)  # type: ignore[union-attr]
        return True


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


class ResponseConnections:
    """The instance side: one connection per client address, opened on first use; ``send`` returns False for an
    address that cannot be reached, with the batches that were waiting for it handed to ``fallback``."""

    def __init__(self, fallback: Callable[[str, list[bytes]], None], connect_timeout_s: float = 2.0) -> None:
        self._fallback = fallback
        self._connect_timeout_s = connect_timeout_s
        self._conns: dict[str, _Outbound] = {}
        self._unreachable: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, address: str, data: bytes) -> bool:
        if address in self._unreachable:
            return False
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = _Outbound(self, address)
            task = asyncio.get_running_loop().create_task(self._connect(conn), name=f"response-connect:{address}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return conn.send(data)

    async def _connect(self, conn: _Outbound) -> None:
        loop = asyncio.get_running_loop()
        try:
            host, port = split_address(conn.address)
            async with asyncio.timeout(self._connect_timeout_s):
                await loop.create_connection(lambda: conn, host, port)
        except Exception as e:  # noqa: BLE001 - unreachable (firewall, another network): the bus carries it
            logger.warning("response channel: cannot connect to %s (%s); answering over the bus", conn.address, e)
            self._unreachable.add(conn.address)
            self._lost(conn, str(e))

    def _lost(self, conn: _Outbound, why: str) -> None:
        if conn.broken:
            return
        conn.broken = True
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        pending, conn.pending = conn.pending or [], None
        logger.debug("response channel to %s given up: %s", conn.address, why)
        if pending:
            self._fallback(conn.address, pending)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for conn in list(self._conns.values()):
            conn.broken = True
            if conn.transport is not None:
                conn.transport.close()
        self._conns.clear()
