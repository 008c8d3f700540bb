"""The event plane: typed publish/subscribe per namespace (load metrics, KV events) over the bus.

Subject: ``kvmesh.<namespace>.events.<topic>``. Envelope: msgpack ``[source_instance_id, payload]``. A subscriber may
pass ``decode`` (e.g. ``LoadSnapshot.from_dict``) to receive typed payloads. Core NATS delivery: at most once, in
order per publisher; consumers that must not miss anything (the KV index) detect gaps with their own sequence numbers
and resynchronise.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from components.runtime.bus import Bus, BusMessage, Subscription
from components.runtime.codec import pack, unpack

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class Event(Generic[T]):
    topic: str
    source_id: int
    payload: T


def event_subject(namespace: str, topic: str) -> str:
    return f"kvmesh.{namespace}.events.{topic}"


class EventSubscription(Generic[T]):
    """An async iterator of events; ``close()`` unsubscribes. Bounded queue: the oldest events are dropped first."""

    def __init__(self, topic: str, decode: Callable[[Any], T] | None, max_pending: int) -> None:
        self.topic = topic
        self._decode = decode
        self._q: asyncio.Queue[Event[T]] = asyncio.Queue(max_pending)
        self._sub: Subscription | None = None
        self.num_dropped = 0

    async def _on_message(self, msg: BusMessage) -> None:
        source, payload = unpack(msg.data)
        ev = Event(self.topic, source, self._decode(payload) if self._decode else payload)
        if self._q.full():
            self._q.get_nowait()
            self.num_dropped += 1
        self._q.put_nowait(ev)

    def __aiter__(self) -> EventSubscription[T]:
        return self

    async def __anext__(self) -> Event[T]:
        return await self._q.get()

    async def get(self, timeout_s: float) -> Event[T]:
        async with asyncio.timeout(timeout_s):
            return await self._q.get()

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None


class EventPlane:
    def __init__(self, bus: Bus, namespace: str) -> None:
        self._bus = bus
        self.namespace = namespace

    async def publish(self, topic: str, payload: Any, source_id: int = 0) -> None:
        await self._bus.publish(event_subject(self.namespace, topic), pack([source_id, payload]))

    async def subscribe(
        self, topic: str, decode: Callable[[Any], T] | None = None, max_pending: int = 100_000
    ) -> EventSubscription[T]:
        sub: EventSubscription[T] = EventSubscription(topic, decode, max_pending)
        sub._sub = await self._bus.subscribe(event_subject(self.namespace, topic), sub._on_message)
        return sub
