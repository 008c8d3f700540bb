"""The request plane: streaming requests to one instance over the bus.

Wire protocol (msgpack lists, smallest first):

    client -> instance subject    [REQ, request_id, body]      reply = the client's inbox token
                                  [CANCEL, request_id]         no reply
                                  [PROBE, request_id]          reply = the stream's inbox token
    instance -> client inbox      [seq, ACK, None]             seq 0, sent before the handler runs
                                  [seq, DATA, item]            seq 1, 2, ...
                                  [seq, END, None]             the stream is complete
                                  [seq, ERROR, {type, message}]
                                  [0, DRAINING, None]          the instance takes no new requests
                                  [-1, PROBE_ACK, alive]       answer to PROBE, outside the sequence

The probe's answer travels on the stream's own inbox, behind every frame the instance sent before it, so "not alive"
can never overtake the END frame of a request that just finished.

Failure detection, fastest first:
- No subscriber on the instance subject: the bus answers ``no_responders`` on the inbox at once -> InstanceGoneError.
- No ACK within ``request_ack_timeout_s`` (a hung process) -> InstanceGoneError.
- Mid-stream, nothing for ``stream_idle_probe_s``: the client probes the instance; no responder, no answer within
  ``probe_timeout_s`` or "not alive" -> StreamInterruptedError. A SIGKILLed worker is therefore noticed within about
  0.5 s + a round trip, long before its lease (10 s) expires, without any heartbeat traffic on healthy streams.
- A gap in sequence numbers (a frame lost) -> StreamInterruptedError.

Cancellation: closing the stream (``aclose``), cancelling the task iterating it, or dropping it unfinished sends
CANCEL; the instance cancels the handler's task, so the handler sees CancelledError at its next await.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from components.runtime.bus import Bus, BusMessage, Subscription, is_no_responders
from components.runtime.codec import pack, unpack
from components.runtime.errors import (
    InstanceDrainingError,
    InstanceGoneError,
    RemoteHandlerError,
    RequestTimeoutError,
    StreamInterruptedError,
)

logger = logging.getLogger(__name__)

REQ, CANCEL, PROBE = 0, 1, 2
ACK, DATA, END, ERROR, DRAINING, PROBE_ACK = 0, 1, 2, 3, 4, 5

_END_OF_STREAM = object()


@dataclasses.dataclass(slots=True)
class RequestContext:
    """What a handler knows about the request it serves."""

    request_id: str
    instance_id: int


Handler = Callable[[Any, RequestContext], AsyncIterator[Any]]


class InstanceServer:
    """Serves one instance subject: dispatches requests to handler tasks, answers cancels and probes."""

    def __init__(self, bus: Bus, subject: str, instance_id: int, handler: Handler) -> None:
        self._bus = bus
        self.subject = subject
        self.instance_id = instance_id
        self._handler = handler
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._sub: Subscription | None = None
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.num_served = 0

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def start(self) -> None:
        self._sub = await self._bus.subscribe(self.subject, self._on_message)

    async def _on_message(self, msg: BusMessage) -> None:
        try:
            frame = unpack(msg.data)
            kind, request_id = frame[0], frame[1]
        except Exception as e:  # noqa: BLE001
            logger.warning("malformed frame on %s: %s", self.subject, e)
            return
        if kind == REQ:
            if not msg.reply:
                return
            if self.draining:
                await self._bus.publish(msg.reply, pack([0, DRAINING, None]))
                return
            await self._bus.publish(msg.reply, pack([0, ACK, None]))
            task = asyncio.create_task(self._run(request_id, frame[2], msg.reply), name=f"handler:{request_id}")
            self._inflight[request_id] = task
            self._idle.clear()
        elif kind == CANCEL:
            running = self._inflight.get(request_id)
            if running is not None:
                running.cancel()
        elif kind == PROBE and msg.reply:
            await self._bus.publish(msg.reply, pack([-1, PROBE_ACK, request_id in self._inflight]))

    async def _run(self, request_id: str, body: Any, reply: str) -> None:
        seq = 1
        agen = self._handler(body, RequestContext(request_id, self.instance_id))
        publish = self._bus.publish
        try:
            async for item in agen:
                await publish(reply, pack([seq, DATA, item]))
                seq += 1
            await publish(reply, pack([seq, END, None]))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            logger.info("handler for %s raised %s: %s", request_id, type(e).__name__, e)
            with contextlib.suppress(Exception):
                await publish(reply, pack([seq, ERROR, {"type": type(e).__name__, "message": str(e)}]))
        finally:
            with contextlib.suppress(Exception):
                await agen.aclose()  # type: ignore[attr-defined]
            self._inflight.pop(request_id, None)
            self.num_served += 1
            if not self._inflight:
                self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait for those in flight (cancel what is left after ``timeout_s``).

        Returns how many had to be cancelled.
        """
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        left = list(self._inflight.values())
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left, timeout=1.0)
        return len(left)

    async def stop(self) -> None:
        for t in list(self._inflight.values()):
            t.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None


class ResponseMux:
    """One wildcard inbox subscription per runtime; each request gets a token and a queue."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._prefix = ""
        self._queues: dict[str, asyncio.Queue[BusMessage]] = {}
        self._sub: Subscription | None = None
        self._counter = itertools.count()
        self._salt = os.urandom(4).hex()

    async def start(self) -> None:
        self._prefix = self._bus.new_inbox()
        self._sub = await self._bus.subscribe(self._prefix + ".*", self._on_message)

    async def _on_message(self, msg: BusMessage) -> None:
        q = self._queues.get(msg.subject)
        if q is not None:
            q.put_nowait(msg)

    def open(self) -> tuple[str, asyncio.Queue[BusMessage]]:
        inbox = f"{self._prefix}.{next(self._counter)}"
        q: asyncio.Queue[BusMessage] = asyncio.Queue()
        self._queues[inbox] = q
        return inbox, q

    def close(self, inbox: str) -> None:
        self._queues.pop(inbox, None)

    def new_request_id(self) -> str:
        return f"{self._salt}-{next(self._counter)}"

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


class ResponseStream:
    """The client's side of one streamed request: an async iterator of the handler's items.

    Use ``async with`` or ``aclose()`` to cancel early; a stream dropped unfinished is cancelled too.
    """

    def __init__(
        self,
        bus: Bus,
        mux: ResponseMux,
        subject: str,
        instance_id: int,
        request_id: str,
        inbox: str,
        queue: asyncio.Queue[BusMessage],
        idle_probe_s: float,
        probe_timeout_s: float,
    ) -> None:
        self._bus = bus
        self._mux = mux
        self.subject = subject
        self.instance_id = instance_id
        self.request_id = request_id
        self._inbox = inbox
        self._q = queue
        self._idle_probe_s = idle_probe_s
        self._probe_timeout_s = probe_timeout_s
        self._next_seq = 1
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def __aiter__(self) -> ResponseStream:
        return self

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        try:
            msg = await self._next_frame()
        except asyncio.CancelledError:
            self._cancel_in_background()
            raise
        except BaseException:
            self._finish()
            raise
        seq, kind, payload = msg
        if seq != self._next_seq:
            self._cancel_in_background()
            raise StreamInterruptedError(
                self.instance_id, self.request_id, self._next_seq - 1, f"expected frame {self._next_seq}, got {seq}"
            )
        self._next_seq += 1
        if kind == DATA:
            return payload
        if kind == END:
            self._finish()
            raise StopAsyncIteration
        if kind == ERROR:
            self._finish()
            raise RemoteHandlerError(self.instance_id, payload.get("type", "?"), payload.get("message", ""))
        # A frame this client does not understand (a newer instance mid-upgrade): the handler may still be running,
        # so cancel it as for a sequence gap rather than leave it generating into an inbox nobody reads.
        self._cancel_in_background()
        raise StreamInterruptedError(self.instance_id, self.request_id, seq, f"unexpected frame kind {kind}")

    def _interrupted(self, reason: str) -> StreamInterruptedError:
        self._cancel_in_background()
        return StreamInterruptedError(self.instance_id, self.request_id, self._next_seq - 1, reason)

    async def _next_frame(self) -> list[Any]:
        """The next sequenced frame, unpacked. After ``idle_probe_s`` of silence, probe the instance on this
        stream's inbox; its answer (or a no-responders status) arrives in order with the frames."""
        q = self._q
        probe_deadline: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            if not q.empty():
                msg = q.get_nowait()
            else:
                wait_s = self._idle_probe_s if probe_deadline is None else max(0.0, probe_deadline - loop.time())
                try:
                    # asyncio.timeout, unlike wait_for on 3.11, creates no task: this runs once per streamed frame.
                    async with asyncio.timeout(wait_s):
                        msg = await q.get()
                except TimeoutError:
                    if probe_deadline is not None:
                        raise self._interrupted("no answer to a liveness probe") from None
                    await self._bus.publish(self.subject, pack([PROBE, self.request_id]), reply=self._inbox)
                    probe_deadline = loop.time() + self._probe_timeout_s
                    continue
            if is_no_responders(msg):
                raise self._interrupted("instance gone (no responders on its subject)")
            frame = unpack(msg.data)
            if frame[1] == PROBE_ACK and frame[0] == -1:
                if not frame[2]:
                    raise self._interrupted("instance no longer serves the request")
                probe_deadline = None  # alive: keep waiting, probe again after the next silence
                continue
            return frame  # type: ignore[no-any-return]

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._mux.close(self._inbox)

    async def aclose(self) -> None:
        """Cancel the request on the instance if it has not finished."""
        if self._done:
            return
        self._finish()
        with contextlib.suppress(Exception):
            await self._bus.publish(self.subject, pack([CANCEL, self.request_id]))

    def _cancel_in_background(self) -> None:
        if self._done:
            return
        self._finish()
        with contextlib.suppress(RuntimeError):  # no running loop: the process is exiting
            asyncio.get_running_loop().create_task(
                self._bus.publish(self.subject, pack([CANCEL, self.request_id])), name=f"cancel:{self.request_id}"
            )

    def __del__(self) -> None:
        if not self._done:
            self._cancel_in_background()


async def open_stream(
    bus: Bus,
    mux: ResponseMux,
    subject: str,
    instance_id: int,
    body: Any,
    ack_timeout_s: float,
    idle_probe_s: float,
    probe_timeout_s: float,
    request_id: str | None = None,
) -> ResponseStream:
    """Send a request and wait for its ACK; raise InstanceGoneError/InstanceDrainingError when there is none."""
    rid = request_id or mux.new_request_id()
    inbox, q = mux.open()
    try:
        await bus.publish(subject, pack([REQ, rid, body]), reply=inbox)
        try:
            async with asyncio.timeout(ack_timeout_s):
                msg = await q.get()
        except TimeoutError:
            with contextlib.suppress(Exception):
                await bus.publish(subject, pack([CANCEL, rid]))
            raise InstanceGoneError(instance_id, f"no acknowledgement within {ack_timeout_s:g} s") from None
        if is_no_responders(msg):
            raise InstanceGoneError(instance_id, "no responders on its subject")
        seq, kind, _ = unpack(msg.data)
        if kind == DRAINING:
            raise InstanceDrainingError(instance_id)
        if seq != 0 or kind != ACK:
            raise InstanceGoneError(instance_id, f"protocol error: first frame {seq}/{kind}")
    except BaseException:
        mux.close(inbox)
        raise
    return ResponseStream(bus, mux, subject, instance_id, rid, inbox, q, idle_probe_s, probe_timeout_s)


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    """Every item of a stream, in order (a convenience for tests and non-streaming callers)."""
    return [item async for item in stream]


__all__ = [
    "Handler",
    "InstanceServer",
    "RequestContext",
    "RequestTimeoutError",
    "ResponseMux",
    "ResponseStream",
    "collect",
    "open_stream",
]
