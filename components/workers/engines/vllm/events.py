"""Subscriber to vLLM's ZMQ KV-event publisher, with gap repair through the publisher's replay socket.

vLLM's ``ZmqEventPublisher`` runs in the engine-core process and sends ``[topic, seq (8 bytes big-endian, from 0),
msgpack KVEventBatch]`` on a PUB socket; it keeps the last ``buffer_steps`` batches behind a ROUTER "replay" socket
(send the first wanted seq as 8 bytes, receive ``[topic, seq, payload]`` frames, then an end marker whose seq is -1).

Security: both endpoints are ``ipc://`` paths in a private temporary directory (mode 0700, made by the engine), which
the publisher binds (vLLM binds ``ipc://`` endpoints, connects to plain ``tcp://host:port`` ones); nothing listens on
a network interface. ``tcp://*:port`` would bind every interface.

PUB/SUB drops what is sent before the subscription reaches the publisher ("slow joiner") and when the high-water mark
overflows. Both show up here as a jump in ``seq``; the missing batches are then fetched from the replay socket before
the new one is handled, so batches reach ``on_batch`` exactly once and in ``seq`` order. A gap older than the replay
buffer cannot be repaired: it is logged and counted, and the mirror of cached blocks may then hold stale entries
until the next ``AllBlocksCleared``.

Imports pyzmq (a vLLM dependency), lazily: this module is only imported when a vLLM engine starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["KvEventSubscriber"]

logger = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0

OnBatch = Callable[[int, bytes], None]


class KvEventSubscriber:
    """Receives vLLM's KV-event batches and hands ``(seq, payload)`` to ``on_batch`` in order, without gaps."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, on_batch: OnBatch, topic: str = "") -> None:
        import zmq
        import zmq.asyncio

        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_batch = on_batch
        self._ctx = zmq.asyncio.Context()
        self._sub: Any = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self.next_seq = 0
        self.num_batches = 0
        self.num_replayed = 0
        self.num_lost = 0  # batches neither received nor replayable

    async def run(self) -> None:
        """Receive until cancelled."""
        while True:
            _topic, seq_bytes, payload = await self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < self.next_seq:
                continue  # already delivered through a replay
            if seq > self.next_seq:
                await self._repair(seq)
            self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self.num_batches += 1
        self._on_batch(seq, payload)

    async def _repair(self, upto: int) -> None:
        """Fetch batches ``next_seq .. upto-1`` from the replay socket."""
        want = self.next_seq
        if self.replay_endpoint is not None:
            try:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    await self._replay(upto)
            except TimeoutError:
                logger.warning("KV-event replay from %s timed out after %.0f s", self.replay_endpoint, REPLAY_TIMEOUT_S)
        if self.next_seq < upto:
            lost = upto - self.next_seq
            self.num_lost += lost
            logger.warning(
                "lost %d KV-event batches (seq %d..%d); the KV mirror may be stale until the cache is cleared",
                lost,
                self.next_seq,
                upto - 1,
            )
            self.next_seq = upto
        else:
            logger.info("replayed KV-event batches %d..%d", want, upto - 1)

    async def _replay(self, upto: int) -> None:
        import zmq

        sock: Any = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while True:
                frames = await sock.recv_multipart()
                _empty, _topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq < self.next_seq or seq >= upto:
                    continue
                if seq > self.next_seq:  # the buffer no longer reaches back that far
                    self.num_lost += seq - self.next_seq
                    logger.warning("lost %d KV-event batches (seq %d..%d)", seq - self.next_seq, self.next_seq, seq - 1)
                self.num_replayed += 1
                self._deliver(seq, payload)
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()
