"""The message bus: subjects, inboxes, no-responders, and JetStream work queues.

``Bus`` is the protocol the request and event planes use; ``NatsBus`` implements it with nats-py (the only importer of
the NATS client in kvmesh) and ``components.runtime.memory.MemoryBus`` in memory.

Semantics both implementations keep:
- Messages from one publisher to one subscriber arrive in publish order.
- Publishing with a reply subject to a subject nobody subscribes to delivers one ``no_responders`` message to the reply
  subject at once (NATS 2.2+ does this for clients that announce header support); ``request`` raises
  ``NoRespondersError`` in that case instead of waiting for its timeout.
- A subscription callback runs in order, one message at a time; callbacks must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import nats
import nats.errors
import nats.js.api
import nats.js.errors
from nats.aio.msg import Msg

from components.runtime.config import RuntimeConfig
from components.runtime.errors import ConnectError, RecoverableError, RequestTimeoutError

logger = logging.getLogger(__name__)


class NoRespondersError(RecoverableError):
    """Nobody subscribes to the subject a request was sent to."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"no responders on {subject}")
        self.subject = subject


@dataclasses.dataclass(slots=True)
class BusMessage:
    """A delivered message. nats-py's own ``Msg`` has the same four fields and is passed through as is, so the hot
    path allocates nothing extra; ``headers`` carries ``Status: 503`` for a no-responders answer."""

    subject: str
    data: bytes
    reply: str = ""
    headers: dict[str, str] | None = None


NO_RESPONDERS_HEADERS = {"Status": "503"}


def is_no_responders(msg: BusMessage) -> bool:
    h = msg.headers
    return bool(h) and h.get("Status") == "503" and not msg.data  # type: ignore[union-attr]


MessageCallback = Callable[[BusMessage], Awaitable[None]]


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


class WorkItem(Protocol):
    data: bytes

    async def ack(self) -> None: ...

    async def nak(self, delay_s: float = 0.0) -> None: ...


class WorkQueue(Protocol):
    """A durable queue where each item goes to exactly one consumer and stays until acknowledged."""

    async def push(self, data: bytes) -> None: ...

    async def pop(self, timeout_s: float) -> WorkItem | None: ...

    async def size(self) -> int: ...


class Bus(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None: ...

    async def subscribe(self, subject: str, callback: MessageCallback, queue: str = "") -> Subscription: ...

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes: ...

    def new_inbox(self) -> str: ...

    async def flush(self) -> None: ...

    async def work_queue(self, name: str, ack_wait_s: float = 30.0) -> WorkQueue: ...

    @property
    def is_connected(self) -> bool: ...

    async def wait_connected(self, timeout_s: float) -> bool:
        """Return True once connected (at once when connected already), False after ``timeout_s`` without."""
        ...


class _NatsSubscription:
    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        with contextlib.suppress(nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
            await self._sub.unsubscribe()


class _NatsWorkItem:
    def __init__(self, msg: Msg) -> None:
        self._msg = msg
        self.data = msg.data

    async def ack(self) -> None:
        await self._msg.ack()

    async def nak(self, delay_s: float = 0.0) -> None:
        await self._msg.nak(delay=delay_s or None)


class _NatsWorkQueue:
    def __init__(self, js: nats.js.JetStreamContext, stream: str, subject: str, psub: object) -> None:
        self._js = js
        self._stream = stream
        self._subject = subject
        self._psub = psub

    async def push(self, data: bytes) -> None:
        await self._js.publish(self._subject, data, stream=self._stream)

    async def pop(self, timeout_s: float) -> WorkItem | None:
        try:
            msgs = await self._psub.fetch(1, timeout=timeout_s)  # type: ignore[attr-defined]
        except (TimeoutError, nats.errors.TimeoutError):
            return None
        return _NatsWorkItem(msgs[0]) if msgs else None

    async def size(self) -> int:
        info = await self._js.stream_info(self._stream)
        return int(info.state.messages)


class NatsBus:
    """Bus on a NATS server; reconnects forever and re-subscribes (nats-py does the re-subscribing)."""

    # A slow subscriber would otherwise drop messages at nats-py's default 64k-message / 64 MiB pending limit. Streams
    # are bounded by the requests in flight, so the limits only guard against a wedged consumer.
    PENDING_MSGS_LIMIT = 1_000_000
    PENDING_BYTES_LIMIT = 512 * 1024 * 1024

    def __init__(self, config: RuntimeConfig, name: str = "kvmesh") -> None:
        self._config = config
        self._name = name
        self._nc: nats.NATS | None = None
        self._js: nats.js.JetStreamContext | None = None
        self._closing = False
        self._connected = asyncio.Event()

    async def start(self) -> None:
        connecting = True

        async def on_error(e: Exception) -> None:
            if not connecting:  # during start-up the failure is reported once, by the ConnectError below
                logger.warning("nats: %s", e)

        async def on_disconnect() -> None:
            if self._closing:
                return
            self._connected.clear()
            logger.warning("nats: disconnected from %s", self._config.nats_url)

        async def on_reconnect() -> None:
            self._connected.set()
            logger.info("nats: reconnected to %s", self._config.nats_url)

        try:
            # With reconnects unbounded, nats-py retries the first connection forever too: bound it here.
            self._nc = await asyncio.wait_for(
                nats.connect(
                    self._config.nats_url,
                    name=self._name,
                    connect_timeout=self._config.connect_timeout_s,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.2,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                ),
                self._config.connect_timeout_s,
            )
        except (nats.errors.NoServersError, OSError, TimeoutError) as e:
            raise ConnectError("NATS", self._config.nats_url, f"{type(e).__name__} {e}".strip()) from e
        finally:
            connecting = False
        self._connected.set()
        self.publish = self._nc.publish  # type: ignore[method-assign,assignment]

    @property
    def nc(self) -> nats.NATS:
        if self._nc is None:
            raise RuntimeError("bus not started")
        return self._nc

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def wait_connected(self, timeout_s: float) -> bool:
        if self.is_connected:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.is_connected and (left_s := deadline - loop.time()) > 0:
            # Woken by the reconnect callback; re-checked every 50 ms as the callback may lag nats-py's own state.
            self._connected.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._connected.wait(), min(0.05, left_s))
        return self.is_connected

    async def close(self) -> None:
        if self._nc is None or self._nc.is_closed:
            return
        self._closing = True
        try:
            await asyncio.wait_for(self._nc.drain(), 5.0)
        except Exception as e:  # noqa: BLE001
            logger.debug("nats drain: %s", e)
        if not self._nc.is_closed:
            await self._nc.close()

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        # Replaced by the connection's own publish once connected (one coroutine frame less per streamed chunk).
        await self.nc.publish(subject, data, reply=reply)

    async def subscribe(self, subject: str, callback: MessageCallback, queue: str = "") -> Subscription:
        sub = await self.nc.subscribe(
            subject,
            queue=queue,
            cb=callback,  # type: ignore[arg-type]  # nats Msg has BusMessage's fields
            pending_msgs_limit=self.PENDING_MSGS_LIMIT,
            pending_bytes_limit=self.PENDING_BYTES_LIMIT,
        )
        return _NatsSubscription(sub)

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        try:
            msg = await self.nc.request(subject, data, timeout=timeout_s)
        except nats.errors.NoRespondersError as e:
            raise NoRespondersError(subject) from e
        except nats.errors.TimeoutError as e:
            raise RequestTimeoutError(f"request on {subject}", timeout_s) from e
        return msg.data

    def new_inbox(self) -> str:
        return self.nc.new_inbox()

    async def flush(self) -> None:
        await self.nc.flush()

    async def work_queue(self, name: str, ack_wait_s: float = 30.0) -> WorkQueue:
        """A JetStream stream with work-queue retention and one durable pull consumer shared by all poppers."""
        if self._js is None:
            self._js = self.nc.jetstream()
        stream = f"KVMESH_{name}".replace(".", "_").replace("-", "_")
        subject = f"kvmesh.queue.{name}"
        try:
            await self._js.add_stream(
                name=stream,
                subjects=[subject],
                retention=nats.js.api.RetentionPolicy.WORK_QUEUE,
                storage=nats.js.api.StorageType.FILE,
            )
        except nats.js.errors.BadRequestError as e:  # already exists with the same config
            logger.debug("stream %s: %s", stream, e)
        psub = await self._js.pull_subscribe(
            subject,
            durable=f"{stream}_workers",
            stream=stream,
            config=nats.js.api.ConsumerConfig(ack_wait=ack_wait_s, max_ack_pending=-1),
        )
        return _NatsWorkQueue(self._js, stream, subject, psub)
