"""In-memory twins of discovery and the bus, with the real semantics, for unit tests of pure logic only.

- ``MemoryStore`` is the shared "server": keys, leases with deadlines, revisions, watchers. Time is an input: leases
  expire when a test calls ``store.advance(seconds)`` (no background clock).
- ``MemoryDiscovery`` is one process's client of a store: lease handles that survive lease loss (``store.lose_lease``
  makes the next keep-alive re-grant and re-put, as etcd's loss would), watches that list first, then stream changes.
- ``MemoryBus`` delivers in publish order per subscriber, answers no-responders at once, supports NATS wildcards
  (``*`` one token, ``>`` the rest) and queue groups, and has work queues with JetStream's semantics as
  ``components.runtime.bus`` describes them: ack/nak/term/in_progress, ``delivered``, redelivery after the ack wait,
  ``max_deliveries``, ``max_items`` and ``stats()`` counted as JetStream counts. Their clock is ``bus.now_s``, moved
  by ``bus.advance(seconds)``: items are stamped with it, and ack waits and nak delays run out only when a test moves
  it (a pop's own ``timeout_s`` is real time, as a pop's wait is no part of the queue's state).

Integration tests use the real servers (``components.runtime.servers``); nothing here is called done for production.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Mapping

from components.runtime.bus import (
    DEFAULT_ACK_WAIT_S,
    DEFAULT_MAX_DELIVERIES,
    NO_RESPONDERS_HEADERS,
    BusMessage,
    MessageCallback,
    NoRespondersError,
    QueueStats,
    WorkItem,
    WorkQueue,
    check_queue_limits,
    is_no_responders,
)
from components.runtime.discovery import WatchEvent, WatchEventKind, diff_listing
from components.runtime.errors import QueueFullError, RequestTimeoutError, ShutdownError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _MemLease:
    server_id: int
    ttl_s: int
    deadline_s: float
    keys: set[str] = dataclasses.field(default_factory=set)


class MemoryStore:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.revision = 0
        self.kv: dict[str, tuple[bytes, int]] = {}  # key -> (value, server lease id or 0)
        self.leases: dict[int, _MemLease] = {}
        self._lease_ids = itertools.count(0x1000)
        self._watchers: list[tuple[str, asyncio.Queue[WatchEvent]]] = []

    # -- server side -----------------------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        lid = next(self._lease_ids)
        self.leases[lid] = _MemLease(lid, ttl_s, self.now_s + ttl_s)
        return lid

    def refresh(self, lid: int) -> int:
        lease = self.leases.get(lid)
        if lease is None:
            return -1
        lease.deadline_s = self.now_s + lease.ttl_s
        return lease.ttl_s

    def revoke(self, lid: int) -> None:
        lease = self.leases.pop(lid, None)
        if lease is not None:
            for k in list(lease.keys):
                self.delete(k)

    def lose_lease(self, lid: int) -> None:
        """Forget a lease as a wiped etcd would: its keys vanish, the next refresh says it is unknown."""
        self.revoke(lid)

    def advance(self, dt_s: float) -> None:
        """Move time forward; leases past their deadline expire and take their keys with them."""
        self.now_s += dt_s
        for lid, lease in list(self.leases.items()):
            if lease.deadline_s <= self.now_s:
                self.revoke(lid)

    def put(self, key: str, value: bytes, lid: int = 0) -> None:
        if lid and lid not in self.leases:
            raise KeyError(f"lease {lid:x} not found")
        old = self.kv.get(key)
        if old and old[1] and old[1] in self.leases:
            self.leases[old[1]].keys.discard(key)
        self.kv[key] = (value, lid)
        if lid:
            self.leases[lid].keys.add(key)
        self.revision += 1
        self._notify(WatchEvent(WatchEventKind.PUT, key, value))

    def delete(self, key: str) -> None:
        old = self.kv.pop(key, None)
        if old is None:
            return
        if old[1] in self.leases:
            self.leases[old[1]].keys.discard(key)
        self.revision += 1
        self._notify(WatchEvent(WatchEventKind.DELETE, key, None))

    def listing(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, (v, _) in self.kv.items() if k.startswith(prefix)}

    def _notify(self, ev: WatchEvent) -> None:
        for prefix, q in self._watchers:
            if ev.key.startswith(prefix):
                q.put_nowait(ev)

    def add_watcher(self, prefix: str) -> asyncio.Queue[WatchEvent]:
        q: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._watchers.append((prefix, q))
        return q

    def remove_watcher(self, q: asyncio.Queue[WatchEvent]) -> None:
        self._watchers = [(p, w) for p, w in self._watchers if w is not q]


class MemoryDiscovery:
    """One client of a ``MemoryStore``. ``keep_alive()`` is what the etcd client's background task does once."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self._handles: dict[int, int] = {}  # handle -> server lease id
        self._handle_ttl: dict[int, int] = {}
        self._handle_keys: dict[int, dict[str, bytes]] = {}
        self._next = itertools.count(1)
        self._closed = False

    async def start(self) -> None:
        pass

    async def close(self, *, revoke: bool = True) -> None:
        if revoke:
            for lid in self._handles.values():
                self.store.revoke(lid)
        self._closed = True

    async def grant_lease(self, ttl_s: int) -> int:
        h = next(self._next)
        self._handles[h] = self.store.grant(ttl_s)
        self._handle_ttl[h] = ttl_s
        self._handle_keys[h] = {}
        return h

    def server_lease_id(self, lease: int) -> int:
        return self._handles[lease]

    async def keep_alive(self) -> None:
        """Refresh every lease; a lease the store forgot is granted again and its keys put again."""
        for h, lid in list(self._handles.items()):
            if self.store.refresh(lid) <= 0:
                self._handles[h] = new = self.store.grant(self._handle_ttl[h])
                for k, v in self._handle_keys[h].items():
                    self.store.put(k, v, new)

    async def revoke_lease(self, lease: int) -> None:
        lid = self._handles.pop(lease, None)
        self._handle_keys.pop(lease, None)
        if lid is not None:
            self.store.revoke(lid)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        if self._closed:
            raise ShutdownError("discovery is closed")
        lid = 0
        if lease is not None:
            lid = self._handles[lease]
            self._handle_keys[lease][key] = value
        self.store.put(key, value, lid)

    async def delete(self, key: str) -> None:
        for keys in self._handle_keys.values():
            keys.pop(key, None)
        self.store.delete(key)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return self.store.listing(prefix)

    async def watch_prefix(self, prefix: str, known: Mapping[str, bytes] | None = None) -> AsyncIterator[WatchEvent]:
        q = self.store.add_watcher(prefix)
        try:
            for ev in diff_listing(dict(known or {}), self.store.listing(prefix)):
                yield ev
            while True:
                yield await q.get()
        finally:
            self.store.remove_watcher(q)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` matches one token, ``>`` one or more trailing tokens."""
    pt, st = pattern.split("."), subject.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(st) > i
        if i >= len(st) or (p != "*" and p != st[i]):
            return False
    return len(pt) == len(st)


class _MemSub:
    def __init__(self, bus: MemoryBus, subject: str, callback: MessageCallback, queue: str) -> None:
        self.bus = bus
        self.subject = subject
        self.queue = queue
        self._callback = callback
        self._inbox: asyncio.Queue[BusMessage] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"memsub:{subject}")

    async def _run(self) -> None:
        while True:
            msg = await self._inbox.get()
            await self._callback(msg)

    def deliver(self, msg: BusMessage) -> None:
        self._inbox.put_nowait(msg)

    async def unsubscribe(self) -> None:
        self.bus._subs.discard(self)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@dataclasses.dataclass(slots=True)
class _MemEntry:
    """One unsettled item. Never delivered: in ``_fresh``. Delivered: ``ack_deadline_s`` set while a consumer has
    it, ``ready_s`` set while it waits to be delivered again (handed back, or its ack wait ran out)."""

    seq: int
    data: bytes
    enqueued_s: float
    delivered: int = 0
    ack_deadline_s: float | None = None
    ready_s: float | None = None


@dataclasses.dataclass(slots=True)
class _MemItem:
    data: bytes
    delivered: int
    enqueued_s: float
    seq: int
    _queue: _MemWorkQueue
    _settled: bool = False

    def _settle(self) -> bool:
        first = not self._settled
        self._settled = True
        return first

    def _current(self) -> _MemEntry | None:
        """The entry while this very delivery holds it (not once it was delivered again)."""
        e = self._queue._entries.get(self.seq)
        return e if e is not None and e.delivered == self.delivered and e.ack_deadline_s is not None else None

    async def ack(self) -> None:
        # By sequence, as JetStream acks: an ack from a delivery whose ack wait ran out still removes the item.
        if self._settle():
            self._queue._remove(self.seq)

    async def term(self) -> None:
        if self._settle():
            self._queue._remove(self.seq)

    async def nak(self, delay_s: float = 0.0) -> None:
        if self._settle() and (e := self._current()) is not None:
            self._queue._hand_back(e, self._queue._clock() + delay_s)

    async def in_progress(self) -> None:
        if not self._settled and (e := self._current()) is not None:
            e.ack_deadline_s = self._queue._clock() + self._queue.ack_wait_s


class _MemWorkQueue:
    def __init__(self, bus: MemoryBus, name: str) -> None:
        self._bus = bus
        self.name = name
        self.ack_wait_s = DEFAULT_ACK_WAIT_S
        self.max_items: int | None = None
        self.max_deliveries = DEFAULT_MAX_DELIVERIES
        self._seqs = itertools.count(1)
        self._entries: dict[int, _MemEntry] = {}  # every unsettled item, in push order
        self._fresh: deque[int] = deque()  # never delivered, in push order
        self._again: deque[int] = deque()  # to be delivered again, in the order they came back; before fresh ones
        self._changed = asyncio.Event()  # replaced on every change; a waiting pop holds the one it saw
        self._pullers = 0

    def _clock(self) -> float:
        return self._bus.now_s

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _remove(self, seq: int) -> None:
        e = self._entries.pop(seq, None)
        if e is None:
            return
        if e.delivered == 0:
            self._fresh.remove(seq)
        elif e.ready_s is not None:
            self._again.remove(seq)

    def _hand_back(self, e: _MemEntry, ready_s: float) -> None:
        e.ack_deadline_s = None
        e.ready_s = ready_s
        self._again.append(e.seq)
        self._notify()

    def expire(self, now_s: float) -> None:
        """What the server does as time passes: items past their ack wait wait to be delivered again, and items whose
        nak delay ran out can be delivered again; waiting pops look again."""
        for e in self._entries.values():
            if e.ack_deadline_s is not None and e.ack_deadline_s <= now_s:
                e.ack_deadline_s = None
                e.ready_s = now_s
                self._again.append(e.seq)
        if self._again:
            self._notify()

    def _next(self) -> _MemEntry | None:
        now_s = self._clock()
        for seq in self._again:
            e = self._entries[seq]
            if e.ready_s is not None and e.ready_s <= now_s:
                self._again.remove(seq)
                return e
        return self._entries[self._fresh.popleft()] if self._fresh else None

    async def push(self, data: bytes) -> None:
        if self.max_items is not None and len(self._entries) >= self.max_items:
            raise QueueFullError(self.name, self.max_items)
        seq = next(self._seqs)
        self._entries[seq] = _MemEntry(seq, data, self._clock())
        self._fresh.append(seq)
        self._notify()

    async def pop(self, timeout_s: float) -> WorkItem | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._pullers += 1
        try:
            while True:
                changed = self._changed
                e = self._next()
                if e is not None:
                    e.delivered += 1
                    e.ready_s = None
                    if e.delivered > self.max_deliveries:
                        logger.warning(
                            "work queue %s: item %d delivered %d times, more than max_deliveries %d: dropped",
                            self.name,
                            e.seq,
                            e.delivered,
                            self.max_deliveries,
                        )
                        del self._entries[e.seq]
                        continue
                    e.ack_deadline_s = self._clock() + self.ack_wait_s
                    return _MemItem(e.data, e.delivered, e.enqueued_s, e.seq, self)
                left_s = deadline - loop.time()
                if left_s <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left_s):
                        await changed.wait()
        finally:
            self._pullers -= 1

    async def size(self) -> int:
        return len(self._entries)

    async def stats(self) -> QueueStats:
        oldest_age_s = self._clock() - self._entries[self._fresh[0]].enqueued_s if self._fresh else 0.0
        return QueueStats(
            waiting=len(self._fresh),
            in_flight=len(self._entries) - len(self._fresh),
            oldest_age_s=max(0.0, oldest_age_s),
            pullers=self._pullers,
            # As JetStream counts it: held by a consumer after more than one delivery.
            redelivered=sum(1 for e in self._entries.values() if e.delivered > 1 and e.ack_deadline_s is not None),
        )


class MemoryBus:
    """An in-process bus shared by every runtime built on it (pass the same instance)."""

    def __init__(self, seed: int = 0) -> None:
        self._subs: set[_MemSub] = set()
        self._inbox_ids = itertools.count()
        self._rng = random.Random(seed)
        self._queues: dict[str, _MemWorkQueue] = {}
        self._connected = asyncio.Event()
        self._connected.set()
        self.now_s = 0.0  # the work queues' clock: see the module docstring

    def advance(self, dt_s: float) -> None:
        """Move the work queues' clock forward: ack waits and nak delays that ran out make items deliverable again."""
        self.now_s += dt_s
        for q in self._queues.values():
            q.expire(self.now_s)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        matched = [s for s in self._subs if subject_matches(s.subject, subject)]
        if not matched:
            if reply:
                self._deliver_status(reply)
            return
        plain = [s for s in matched if not s.queue]
        groups: dict[str, list[_MemSub]] = {}
        for s in matched:
            if s.queue:
                groups.setdefault(s.queue, []).append(s)
        for s in plain:
            s.deliver(BusMessage(subject, data, reply))
        for members in groups.values():
            self._rng.choice(members).deliver(BusMessage(subject, data, reply))

    def _deliver_status(self, reply: str) -> None:
        for s in self._subs:
            if subject_matches(s.subject, reply):
                s.deliver(BusMessage(reply, b"", "", dict(NO_RESPONDERS_HEADERS)))

    async def subscribe(self, subject: str, callback: MessageCallback, queue: str = "") -> _MemSub:
        sub = _MemSub(self, subject, callback, queue)
        self._subs.add(sub)
        return sub

    @property
    def is_connected(self) -> bool:
        return self._connected.is_set()

    @is_connected.setter
    def is_connected(self, value: bool) -> None:
        """A test takes the twin's connection down and back up by setting this; waiters wake up when it is back."""
        if value:
            self._connected.set()
        else:
            self._connected.clear()

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._connected.wait()
        return self.is_connected

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        inbox = self.new_inbox()
        fut: asyncio.Future[BusMessage] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: BusMessage) -> None:
            if not fut.done():
                fut.set_result(msg)

        sub = await self.subscribe(inbox, on_reply)
        try:
            await self.publish(subject, data, reply=inbox)
            try:
                async with asyncio.timeout(timeout_s):
                    msg = await fut
            except TimeoutError:
                raise RequestTimeoutError(f"request on {subject}", timeout_s) from None
            if is_no_responders(msg):
                raise NoRespondersError(subject)
            return msg.data
        finally:
            await sub.unsubscribe()

    def new_inbox(self) -> str:
        return f"_INBOX.mem{next(self._inbox_ids)}"

    async def flush(self) -> None:
        await asyncio.sleep(0)

    async def work_queue(
        self,
        name: str,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
        max_items: int | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> WorkQueue:
        """One queue per name, shared by every caller; as with JetStream, the last opener's settings apply to all."""
        check_queue_limits(name, ack_wait_s, max_items, max_deliveries)
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _MemWorkQueue(self, name)
        q.ack_wait_s, q.max_items, q.max_deliveries = ack_wait_s, max_items, max_deliveries
        return q
