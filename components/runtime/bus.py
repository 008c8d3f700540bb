"""The message bus: subjects, inboxes, no-responders, and JetStream work queues.

``Bus`` is the protocol the request and event planes use; ``NatsBus`` implements it with nats-py (the only importer of
the NATS client in kvmesh) and ``components.runtime.memory.MemoryBus`` in memory.

Semantics both implementations keep:
- Messages from one publisher to one subscriber arrive in publish order.
- Publishing with a reply subject to a subject nobody subscribes to delivers one ``no_responders`` message to the reply
  subject at once (NATS 2.2+ does this for clients that announce header support); ``request`` raises
  ``NoRespondersError`` in that case instead of waiting for its timeout.
- A subscription callback runs in order, one message at a time; callbacks must not block.

Work queues (``Bus.work_queue``; the prefill queue of disaggregated serving is one per namespace and model): a
JetStream stream with work-queue retention and one durable pull consumer that every popper shares, so each item goes
to exactly one consumer at a time and stays in the stream until it is acknowledged (AckExplicit). What a consumer
must do with an item it popped, and what happens otherwise:

- ``ack()`` when done, ``nak(delay_s)`` to hand it back, ``term()`` to drop it for good: the server confirms each
  (once ack() returns the item is gone, once nak() returns it is back in line); the first of the three settles the
  item and later calls do nothing.
- ``in_progress()`` at least every ``ack_wait_s / 3`` while working on it: each call restarts the ack wait.
- An item neither settled nor kept in progress for ``ack_wait_s`` (its consumer died, or its process hung) is delivered
  again, to whichever consumer pulls next, with ``delivered`` one higher. Default 5 s (``DEFAULT_ACK_WAIT_S``): a
  prefill worker heartbeats, so the ack wait only bounds how long an item popped by a dead worker waits before another
  worker gets it, and a prefill the decode worker waits for must not wait 30 s for that. Its cost: a worker whose
  event loop stalls for 5 s has its item computed twice (wasted work, never a wrong answer: the first result wins).
- An item delivered more than ``max_deliveries`` times (default 3, ``DEFAULT_MAX_DELIVERIES``; a ``nak`` counts as a
  delivery) is dropped by the consumer that pulls it (``term``, one WARNING line) instead of being handed out again:
  an item that took down two workers is likely to take down a third, and by its third delivery after two such deaths
  (two ack waits, 10 s, after its first) the decode worker that pushed it has given up and prefilled locally. The
  bound is kept by the client, not by JetStream's own ``max_deliver``: a work-queue stream keeps a message that
  reached JetStream's bound forever (it is never acknowledged), where it would count against ``max_items``.
- ``max_items`` bounds the items the queue holds, waiting or in flight (JetStream's ``max_msgs`` with the discard-new
  policy): the stream refuses a publish that would exceed it, atomically, so two producers pushing at once cannot
  both take the last place as a check-then-publish could; ``push`` raises ``QueueFullError`` and nothing is stored.
- Any name works: the stream and subject are derived from it by ``queue_names`` (a readable part plus a hash of the
  whole name), and a stream records the name it was made for, so two names never share one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import nats
import nats.errors
import nats.js.api
import nats.js.errors
from nats.aio.msg import Msg

from components.runtime.config import RuntimeConfig
from components.runtime.credentials import nats_credentials
from components.runtime.errors import (
    ConfigError,
    ConnectError,
    QueueFullError,
    QueueUnavailableError,
    RecoverableError,
    RequestTimeoutError,
)

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


DEFAULT_ACK_WAIT_S = 5.0
DEFAULT_MAX_DELIVERIES = 3


class WorkItem(Protocol):
    """One item popped from a ``WorkQueue``; see the module docstring for what its consumer owes it."""

    data: bytes
    delivered: int
    """How many times the queue has delivered this item: 1 the first time."""
    enqueued_s: float
    """Wall-clock time (``time.time()``) the item was pushed, as the server stored it."""

    async def ack(self) -> None: ...

    async def nak(self, delay_s: float = 0.0) -> None: ...

    async def in_progress(self) -> None: ...

    async def term(self) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class QueueStats:
    """A snapshot of one work queue, as JetStream counts it.

    ``waiting``: items never delivered. ``in_flight``: items delivered and not settled, including those handed back
    (``nak``) or past their ack wait that wait to be delivered again (JetStream counts them as ack-pending until
    then). ``waiting + in_flight`` is what ``size()`` returns and what ``max_items`` bounds. ``oldest_age_s``: seconds
    since the oldest *never-delivered* item was pushed, 0.0 when there is none; an older item that waits to be
    delivered again is not counted (so the stream's first message, often an in-flight one, is not what is measured).
    ``pullers``: pops now waiting for an item, over all processes. ``redelivered``: unsettled items delivered more
    than once.
    """

    waiting: int
    in_flight: int
    oldest_age_s: float
    pullers: int
    redelivered: int


class WorkQueue(Protocol):
    """A durable queue where each item goes to exactly one consumer and stays until acknowledged."""

    name: str
    ack_wait_s: float

    async def push(self, data: bytes) -> None: ...

    async def pop(self, timeout_s: float) -> WorkItem | None: ...

    async def size(self) -> int: ...

    async def stats(self) -> QueueStats: ...


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def queue_names(name: str) -> tuple[str, str]:
    """``(stream, subject)`` for the work queue ``name``: deterministic, valid for JetStream whatever ``name`` holds
    (model names carry '/', '.', ':'; stream names forbid '.', '*', '>', '/', '\\' and whitespace), and distinct for
    distinct names: a readable part (unsafe runs become '_', at most 48 characters) plus 12 hex digits of the SHA-256
    of the whole name (48 bits: two of 10,000 queues share a hash with odds of about 2e-7, and ``work_queue`` refuses a
    stream made for another name rather than share it)."""
    readable = _UNSAFE.sub("_", name)[:48]
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    token = f"{readable}_{digest}"
    return f"KVMESH_{token}", f"kvmesh.queue.{token}"


def check_queue_limits(name: str, ack_wait_s: float, max_items: int | None, max_deliveries: int) -> None:
    """The arguments of ``Bus.work_queue`` both implementations refuse alike."""
    if not name:
        raise ConfigError("work queue name must not be empty")
    if not ack_wait_s > 0:
        raise ConfigError(f"work queue {name!r}: ack_wait_s must be > 0, got {ack_wait_s!r}")
    if max_items is not None and max_items < 1:
        raise ConfigError(f"work queue {name!r}: max_items must be None (unbounded) or >= 1, got {max_items!r}")
    if max_deliveries < 1:
        raise ConfigError(f"work queue {name!r}: max_deliveries must be >= 1, got {max_deliveries!r}")


class Bus(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None: ...

    async def subscribe(self, subject: str, callback: MessageCallback, queue: str = "") -> Subscription: ...

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes: ...

    def new_inbox(self) -> str: ...

    async def flush(self) -> None: ...

    async def work_queue(
        self,
        name: str,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
        max_items: int | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> WorkQueue: ...

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


# Shortest fetch: nats-py turns a fetch timeout into the pull request's expiry minus 100 us, and a request without an
# expiry would stay on the server for good.
_MIN_FETCH_S = 0.01
# How long ``ack()`` waits for the server's confirmation.
_ACK_TIMEOUT_S = 5.0
_ERR_MAX_MSGS = 10077  # JetStream's "maximum messages exceeded", the answer to a publish into a full discard-new stream
_ERR_STREAM_CONFIG = 10058  # "stream name already in use with a different configuration"
_WORKERS = "workers"  # the durable consumer of each queue's stream, shared by every popper


def _queue_error(queue: str, operation: str, e: BaseException, nats_url: str) -> QueueUnavailableError:
    """A nats-py failure of a queue operation, said in words a caller can act on."""
    if isinstance(e, nats.js.errors.NoStreamResponseError):
        reason = f"no JetStream stream answered at {nats_url} (nats-server without -js, or the stream was deleted)"
    elif isinstance(e, nats.js.errors.ServiceUnavailableError) and e.err_code is None:
        reason = f"JetStream is not enabled on the NATS server at {nats_url} (start nats-server with -js)"
    elif isinstance(e, nats.js.errors.APIError):
        reason = f"JetStream refused it: {e.description} (code {e.code}, err_code {e.err_code})"
    elif isinstance(e, TimeoutError):
        reason = f"JetStream at {nats_url} did not answer in time"
    else:
        reason = f"{type(e).__name__}: {e}".rstrip(": ")
    # A publish that timed out may have been stored all the same; every other failure is an answer, or no send.
    maybe_enqueued = operation == "push" and isinstance(e, TimeoutError)
    return QueueUnavailableError(queue, operation, reason, maybe_enqueued=maybe_enqueued)


class _NatsWorkItem:
    __slots__ = ("_msg", "_queue", "_settled", "data", "delivered", "enqueued_s", "seq")

    def __init__(self, msg: Msg, queue: _NatsWorkQueue) -> None:
        md = msg.metadata  # parsed from the reply subject (the ack subject): no round trip
        self._msg = msg
        self._queue = queue
        self._settled = False
        self.data = msg.data
        self.delivered = md.num_delivered
        self.enqueued_s = md.timestamp.timestamp()  # the stream's store time, not the delivery's
        self.seq = md.sequence.stream

    async def _settle(self, operation: str, payload: bytes) -> None:
        """Send ``payload`` (``+ACK``, ``-NAK``, ``+TERM``) as a request: the server confirms each (one round trip,
        ~0.6 ms on loopback), so once ack() returns the item is out of the stream and once nak() returns it is back in
        line. A fire-and-forget ack lost on a reconnect would have the item prefilled twice. The first settling call
        wins; later ones do nothing."""
        if self._settled:
            return
        self._settled = True
        try:
            await self._queue.nc.request(self._msg.reply, payload, timeout=_ACK_TIMEOUT_S)
        except (nats.errors.Error, TimeoutError) as e:
            raise _queue_error(self._queue.name, operation, e, self._queue.nats_url) from e

    async def ack(self) -> None:
        await self._settle("ack", Msg.Ack.Ack)

    async def nak(self, delay_s: float = 0.0) -> None:
        delay = b' {"delay": %d}' % int(delay_s * 1e9) if delay_s > 0 else b""  # nanoseconds
        await self._settle("nak", Msg.Ack.Nak + delay)

    async def term(self) -> None:
        await self._settle("term", Msg.Ack.Term)

    async def in_progress(self) -> None:
        # Fire and forget: a heartbeat is repeated every ack_wait_s / 3, so one lost on a reconnect costs nothing.
        if self._settled:
            return
        try:
            await self._queue.nc.publish(self._msg.reply, Msg.Ack.Progress)
        except nats.errors.Error as e:
            raise _queue_error(self._queue.name, "in_progress", e, self._queue.nats_url) from e


class _NatsWorkQueue:
    def __init__(
        self,
        nc: nats.NATS,
        js: nats.js.JetStreamContext,
        name: str,
        stream: str,
        subject: str,
        psub: Any,
        nats_url: str,
    ) -> None:
        self.nc = nc
        self._js = js
        self.name = name
        self._stream = stream
        self._subject = subject
        self._psub = psub
        self.ack_wait_s = DEFAULT_ACK_WAIT_S
        self.max_items: int | None = None
        self.max_deliveries = DEFAULT_MAX_DELIVERIES
        self.nats_url = nats_url

    async def push(self, data: bytes) -> None:
        """Enqueue ``data``; ``QueueFullError`` when the queue holds ``max_items`` already (nothing is stored),
        ``QueueUnavailableError`` when JetStream does not take it."""
        try:
            await self._js.publish(self._subject, data, stream=self._stream)
        except nats.js.errors.ServiceUnavailableError as e:
            if e.err_code == _ERR_MAX_MSGS:
                raise QueueFullError(self.name, self.max_items) from e
            raise _queue_error(self.name, "push", e, self.nats_url) from e
        except (nats.errors.Error, TimeoutError) as e:
            raise _queue_error(self.name, "push", e, self.nats_url) from e

    async def pop(self, timeout_s: float) -> WorkItem | None:
        """The next item, or None after ``timeout_s`` without one. Pops may run concurrently (each is one pull
        request); an item past ``max_deliveries`` is dropped here and the pop goes on waiting."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        left_s = max(timeout_s, _MIN_FETCH_S)
        while left_s >= _MIN_FETCH_S:
            try:
                msgs = await self._psub.fetch(1, timeout=left_s)
            except TimeoutError:  # nats-py's TimeoutError and FetchTimeoutError derive from it
                # Also what a concurrent pop's expired pull request ends this one with (their statuses share an
                # inbox): wait on for what is left of this one's timeout.
                msgs = []
            except nats.errors.Error as e:
                raise _queue_error(self.name, "pop", e, self.nats_url) from e
            for msg in msgs:
                item = _NatsWorkItem(msg, self)
                if item.delivered <= self.max_deliveries:
                    return item
                logger.warning(
                    "work queue %s: item %d delivered %d times, more than max_deliveries %d: dropped",
                    self.name,
                    item.seq,
                    item.delivered,
                    self.max_deliveries,
                )
                await item.term()
            left_s = deadline - loop.time()
        return None

    async def size(self) -> int:
        """Items held, waiting or in flight (what ``max_items`` bounds). Counted from the consumer, which settles an
        item before the ack's confirmation goes out; the stream drops an acked message a moment later."""
        try:
            ci = await self._js.consumer_info(self._stream, _WORKERS)
        except (nats.errors.Error, TimeoutError) as e:
            raise _queue_error(self.name, "size", e, self.nats_url) from e
        return (ci.num_pending or 0) + (ci.num_ack_pending or 0)

    async def stats(self) -> QueueStats:
        try:
            ci = await self._js.consumer_info(self._stream, _WORKERS)
            waiting = ci.num_pending or 0
            oldest_age_s = 0.0
            if waiting and ci.delivered is not None:
                # The consumer hands out messages in stream order, so the oldest never-delivered one is the first
                # message after the last one it delivered; it may be delivered meanwhile (then a newer one, or none).
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    first = await self._js.get_msg(
                        self._stream, seq=ci.delivered.stream_seq + 1, subject=self._subject, next=True
                    )
                    if first.time is not None:
                        oldest_age_s = max(0.0, time.time() - first.time.timestamp())
        except (nats.errors.Error, TimeoutError) as e:
            raise _queue_error(self.name, "stats", e, self.nats_url) from e
        return QueueStats(
            waiting=waiting,
            in_flight=ci.num_ack_pending or 0,
            oldest_age_s=oldest_age_s,
            pullers=ci.num_waiting or 0,
            redelivered=ci.num_redelivered or 0,
        )


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
        self._queues: dict[str, _NatsWorkQueue] = {}
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
            async with asyncio.timeout(self._config.connect_timeout_s):
                self._nc = await nats.connect(
                    self._config.nats_url,
                    name=self._name,
                    connect_timeout=self._config.connect_timeout_s,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.2,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    **nats_credentials(),
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
                async with asyncio.timeout(min(0.05, left_s)):
                    await self._connected.wait()
        return self.is_connected

    async def close(self) -> None:
        if self._nc is None or self._nc.is_closed:
            return
        self._closing = True
        # Pull subscriptions first, unsubscribed rather than drained: nats-py's drain waits for every message a pull
        # subscription ever queued to be marked done, which fetch never does (5 s lost per close). An item this process
        # was sent but never handed out is delivered again after its ack wait, as for a process that died.
        for q in self._queues.values():
            with contextlib.suppress(nats.errors.Error, ValueError):
                await q._psub.unsubscribe()
        try:
            async with asyncio.timeout(5.0):
                await self._nc.drain()
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

    async def work_queue(
        self,
        name: str,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
        max_items: int | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> WorkQueue:
        """The work queue ``name`` (any string; see ``queue_names``), created if missing: a JetStream stream with
        work-queue retention, file storage and ``max_items`` as its discard-new ``max_msgs``, and the durable pull
        consumer every popper shares. Opening a queue that exists applies these settings to it (the stream's limit and
        the consumer's ack wait are updated in place): every process should pass the same ones, from one config. One
        process gets one object per name (one pull subscription), however often it opens it.

        ``QueueUnavailableError`` when JetStream does not answer (a nats-server without ``-js``), ``ConfigError`` for
        bad limits or a stream that was made for another name."""
        check_queue_limits(name, ack_wait_s, max_items, max_deliveries)
        if self._js is None:
            self._js = self.nc.jetstream()
        stream, subject = queue_names(name)
        description = f"kvmesh work queue {name!r}"
        config = nats.js.api.StreamConfig(
            name=stream,
            description=description,
            subjects=[subject],
            retention=nats.js.api.RetentionPolicy.WORK_QUEUE,
            storage=nats.js.api.StorageType.FILE,
            max_msgs=max_items if max_items is not None else -1,
            discard=nats.js.api.DiscardPolicy.NEW,
        )
        try:
            try:
                await self._js.add_stream(config)  # idempotent when the stream exists with this very config
            except nats.js.errors.BadRequestError as e:
                if e.err_code != _ERR_STREAM_CONFIG:
                    raise
                info = await self._js.stream_info(stream)
                if info.config.description != description:
                    raise ConfigError(
                        f"work queue {name!r}: stream {stream} belongs to another queue ({info.config.description!r})"
                    ) from e
                await self._js.update_stream(config)
                logger.info(
                    "work queue %s: stream %s updated (max_items %s -> %s)",
                    name,
                    stream,
                    info.config.max_msgs,
                    config.max_msgs,
                )
            # Creates the consumer, or updates its ack wait in place (the server's create-or-update).
            await self._js.add_consumer(
                stream,
                nats.js.api.ConsumerConfig(
                    name=_WORKERS,
                    durable_name=_WORKERS,
                    filter_subject=subject,
                    ack_policy=nats.js.api.AckPolicy.EXPLICIT,
                    ack_wait=ack_wait_s,
                    max_deliver=-1,  # max_deliveries is kept by the poppers: see the module docstring
                    max_ack_pending=-1,
                ),
            )
            if (q := self._queues.get(name)) is None:
                psub = await self._js.pull_subscribe_bind(durable=_WORKERS, stream=stream)
                q = self._queues.setdefault(
                    name, _NatsWorkQueue(self.nc, self._js, name, stream, subject, psub, self._config.nats_url)
                )
                if q._psub is not psub:  # a concurrent open of the same name got there first
                    await psub.unsubscribe()
        except (nats.errors.Error, TimeoutError) as e:
            raise _queue_error(name, "open", e, self._config.nats_url) from e
        q.ack_wait_s, q.max_items, q.max_deliveries = ack_wait_s, max_items, max_deliveries
        return q
