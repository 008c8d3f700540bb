"""In-memory twins of discovery and the bus, with the real semantics, for unit tests of pure logic only.

- ``MemoryStore`` is the shared "server": keys, leases with deadlines, revisions, watchers. Time is an input: leases
  expire when a test calls ``store.advance(seconds)`` (no background clock).
- ``MemoryDiscovery`` is one process's client of a store: lease handles that survive lease loss (``store.lose_lease``
  makes the next keep-alive re-grant and re-put, as etcd's loss would), watches that list first, then stream changes.
- ``MemoryBus`` delivers in publish order per subscriber, answers no-responders at once, supports NATS wildcards
  (``*`` one token, ``>`` the rest) and queue groups, and has work queues with ack/nak.

Integration tests use the real servers (``components.runtime.servers``); nothing here is called done for production.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
from collections import deque
from collections.abc import AsyncIterator, Mapping

from components.runtime.bus import (
    NO_RESPONDERS_HEADERS,
    BusMessage,
    MessageCallback,
    NoRespondersError,
    WorkItem,
    WorkQueue,
    is_no_responders,
)
from components.runtime.discovery import WatchEvent, WatchEventKind, diff_listing
from components.runtime.errors import RequestTimeoutError, ShutdownError


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


@dataclasses.dataclass
class _MemItem:
    data: bytes
    _queue: _MemWorkQueue

    async def ack(self) -> None:
        self._queue._unacked.discard(id(self))

    async def nak(self, delay_s: float = 0.0) -> None:
        self._queue._unacked.discard(id(self))
        self._queue._items.appendleft(self.data)
        self._queue._ready.set()


class _MemWorkQueue:
    def __init__(self) -> None:
        self._items: deque[bytes] = deque()
        self._unacked: set[int] = set()
        self._ready = asyncio.Event()

    async def push(self, data: bytes) -> None:
        self._items.append(data)
        self._ready.set()

    async def pop(self, timeout_s: float) -> WorkItem | None:
        if not self._items:
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        if not self._items:
            return None
        item = _MemItem(self._items.popleft(), self)
        self._unacked.add(id(item))
        return item

    async def size(self) -> int:
        return len(self._items) + len(self._unacked)


class MemoryBus:
    """An in-process bus shared by every runtime built on it (pass the same instance)."""

    def __init__(self, seed: int = 0) -> None:
        self._subs: set[_MemSub] = set()
        self._inbox_ids = itertools.count()
        self._rng = random.Random(seed)
        self._queues: dict[str, _MemWorkQueue] = {}
        self._connected = asyncio.Event()
        self._connected.set()

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
            await asyncio.wait_for(self._connected.wait(), timeout_s)
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
                msg = await asyncio.wait_for(fut, timeout_s)
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

    async def work_queue(self, name: str, ack_wait_s: float = 30.0) -> WorkQueue:
        return self._queues.setdefault(name, _MemWorkQueue())
