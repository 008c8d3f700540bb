"""``MockEngine``: the simulated vLLM engine behind the ``Engine`` protocol, for fleets of hundreds on one machine.

What it owns: one step-loop task per engine, named ``mock-engine-step:<name>``, that runs ``Scheduler.step``, waits
the modelled step time divided by ``speedup_ratio``, then hands each request its new tokens and publishes the step's
KV events. It waits on an ``asyncio.Event`` while there is nothing to do, so an idle engine costs nothing, and with
``speedup_ratio = inf`` it never sleeps: each step ends with ``asyncio.sleep(0)``, a bare yield, so a few hundred
engines interleave on one event loop at the speed of the CPU.

Timing: steps keep a schedule. A step ends ``step_time / speedup`` after the previous step's scheduled end while the
engine stays busy (``step_end_s``), so neither the Python of a step (0.1-1 ms with 256 running requests) nor a timer
that fires late (the event loop busy handing out tokens) slows the simulated GPU down: a step that ended late is paid
back by the next ones. Before this, each step slept its time from its own start, and the lateness added up: 9
sequences for 100 steps at ``speedup_ratio`` 1 took 1.15x their modelled time on the 2-core VM (14-16% with and
without two CPU burners; /tmp script, 28 Nov 2026). Lateness beyond ``MAX_CATCH_UP_S`` is not paid back: that is a
stalled host, and a real engine starved of its host CPU stalls too.

Tokens reach ``generate()`` through one ``asyncio.Queue`` per request; tokens that pile up while the consumer is busy
are merged into one chunk. KV events go into a bounded buffer (``max_pending_kv_event_batches``); when it overflows
the oldest batch is dropped and the single ``kv_events()`` consumer sees a gap in event ids, its cue to resynchronise
from ``kv_state()``.

Imports asyncio, the engine contract and this package; no network.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from components.migration.engine import KvExtent, SuspendedChunk
from components.migration.types import RequestTable
from components.protocol.messages import (
    FinishReason,
    GenerateRequest,
    KvEvent,
    KvStateSnapshot,
    LoadSnapshot,
    RemotePrefillResult,
    TokenChunk,
)
from components.protocol.metadata import RemotePrefillMode
from components.protocol.migration import MigratingRequest, MigrationMode

from ..base import EngineDeadError, EngineError
from .config import MockEngineConfig
from .perf_model import transfer_time_s
from .scheduler import DuplicateRequestError, Scheduler, StepOutput

__all__ = ["MAX_CATCH_UP_S", "MockEngine", "step_end_s"]

logger = logging.getLogger(__name__)

_QueueItem = TokenChunk | EngineError

# How late a step may start against the previous step's scheduled end and still be paid back by shorter sleeps: a
# few late timer firings (~1 ms each on the 2-core VM) are, a stall of a starved host (tens of ms and more) is not.
MAX_CATCH_UP_S = 0.05


def step_end_s(started_s: float, step_s: float, previous_end_s: float | None) -> float:
    """When a step that started at ``started_s`` and is modelled to take ``step_s`` should end.

    Counted from the previous step's scheduled end while the engine stayed busy (``previous_end_s``; None after idling)
    and the step started at most ``MAX_CATCH_UP_S`` after it, otherwise from the step's own start. Example: steps of
    47 ms, the previous one scheduled to end at 1.000 s, this one started at 1.003 s (a late timer): it ends at
    1.047 s, not 1.050 s.
    """
    if previous_end_s is not None and started_s - previous_end_s <= MAX_CATCH_UP_S:
        return previous_end_s + step_s
    return started_s + step_s


class MockEngine:
    """A simulated vLLM engine. ``start()`` it, ``generate()`` on it, ``shutdown()`` it."""

    # A simulated hand-off delivers the KV blocks themselves (kv_transfer_time_s); the decode engine computes nothing.
    remote_prefill_mode = RemotePrefillMode.KV_TRANSFER
    # A running request's blocks are copied to another engine while it decodes (components/migration/agent.py).
    migration_mode = MigrationMode.LIVE

    def __init__(
        self,
        config: MockEngineConfig | None = None,
        *,
        name: str = "mock",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or MockEngineConfig()
        self.name = name
        self.block_size = self.config.block_size
        self.max_model_len = self.config.max_model_len
        self._clock = clock
        self._scheduler = Scheduler(self.config)
        self._queues: dict[str, asyncio.Queue[_QueueItem]] = {}
        self._wakeup = asyncio.Event()
        self._kv_batches: collections.deque[list[KvEvent]] = collections.deque()
        self._kv_ready = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        # Migration: requests to suspend at the next step boundary, and whether a step is in flight (computed, its
        # tokens not yet delivered: a suspension waits for them).
        self._suspending: set[str] = set()
        self._in_step = False
        self._dead: EngineDeadError | None = None
        self._fault: asyncio.TimerHandle | None = None
        # Observable counters (tests, metrics): steps run, steps followed by a real (positive) sleep, the simulated
        # time those steps modelled, and KV event batches dropped because nobody consumed them.
        self.num_steps = 0
        self.num_timed_sleeps = 0
        self.simulated_time_s = 0.0
        self.num_dropped_kv_event_batches = 0
        # Remote prefills (generate_remote): KV committed, prefilled here after all, no room to reserve.
        self.num_remote_prefill_commits = 0
        self.num_remote_prefill_fallbacks = 0
        self.num_remote_prefill_no_room = 0

    # --- lifecycle --------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop_task is not None:
            return
        if self._closed:
            raise EngineDeadError(f"mock engine {self.name!r} was shut down")
        self._loop_task = asyncio.create_task(self._run_step_loop(), name=f"mock-engine-step:{self.name}")
        if self.config.fail_after_s is not None:
            self._fault = asyncio.get_running_loop().call_later(self.config.fail_after_s, self._inject_failure)

    async def shutdown(self) -> None:
        """Stop the step loop, end every open ``generate()`` with an ``abort`` chunk, and end ``kv_events()``."""
        if self._closed:
            return
        self._closed = True
        if self._fault is not None:
            self._fault.cancel()
        task, self._loop_task = self._loop_task, None
        try:
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise  # our own caller is cancelling us: let it through
        finally:
            self._scheduler.abort_all()
            # Every open generate() ends; one whose final chunk is already queued sees that chunk first.
            for rid in list(self._queues):
                self._push(rid, TokenChunk(token_ids=[], finish_reason=FinishReason.ABORT))
            self._kv_ready.set()

    # --- requests ---------------------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream the request's tokens; the last chunk has a ``finish_reason``.

        Raises ``EngineRequestError`` (on first iteration) for a prompt longer than ``max_model_len``, an empty prompt,
        token ids outside the vocabulary, ``max_tokens < 1`` or a request id already in flight; ``EngineDeadError``
        if the engine is not started, shut down or crashed. Closing the iterator early aborts the request.
        """
        self._check_alive()
        rid = request.request_id
        if rid in self._queues:
            # Finished in the scheduler but its last chunk not yet delivered: reusing the id now would hand this
            # stream the previous request's final chunk.
            raise DuplicateRequestError(rid)
        self._scheduler.add_request(request, self._clock())
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._queues[rid] = queue
        self._wakeup.set()
        async with contextlib.aclosing(self._stream(rid, queue)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def generate_remote(
        self, request: GenerateRequest, prefill: Callable[[], Awaitable[RemotePrefillResult | None]]
    ) -> AsyncGenerator[TokenChunk, None]:
        """Decode a request whose prompt another engine prefills (disaggregated serving).

        Reserves blocks for the prompt (sharing what the prefix cache holds), awaits ``prefill()`` (the worker's
        remote prefill: the queue hop, the prefill engine, the KV transfer), then commits the delivered KV and first
        token and streams the rest as ``generate`` does. ``prefill()`` returning None, or a result with an error,
        means "prefill here after all": the reservation is released and the prompt is computed locally, in the
        same stream. Without room for the prompt now, it is prefilled locally from the start (``prefill`` is not
        called). Closing the iterator early, at any point, aborts the request and frees its blocks.
        """
        self._check_alive()
        rid = request.request_id
        if rid in self._queues:
            raise DuplicateRequestError(rid)
        sched = self._scheduler
        if sched.reserve_remote_prefill(request, self._clock()) is None:
            self.num_remote_prefill_no_room += 1
            async with contextlib.aclosing(self.generate(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._queues[rid] = queue
        try:
            result = await prefill()
        except BaseException:
            del self._queues[rid]
            sched.abort(rid)
            raise
        if result is None or result.error or not result.token_ids:
            if sched.cancel_remote_prefill(rid):
                self.num_remote_prefill_fallbacks += 1
                self._wakeup.set()
        else:
            first = sched.commit_remote_prefill(rid, result.token_ids[0])
            if first is not None:
                self.num_remote_prefill_commits += 1
                queue.put_nowait(first)
                self._publish_kv_events(sched.take_kv_events())
                self._wakeup.set()
        async with contextlib.aclosing(self._stream(rid, queue)) as chunks:
            async for chunk in chunks:
                yield chunk

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Leading prompt tokens this engine's prefix cache holds now (what a local prefill would not compute)."""
        return self._scheduler.cached_prefix_tokens(token_ids)

    def kv_transfer_time_s(self, num_tokens: int) -> float:
        """Simulated wall time to send the KV of ``num_tokens`` prompt tokens to another engine: the modelled
        transfer (``perf_model.transfer_time_s``, whole blocks) divided by ``speedup_ratio``; 0 when infinitely
        fast."""
        cfg = self.config
        if cfg.is_infinitely_fast:
            return 0.0
        blocks = -(-num_tokens // self.block_size)
        s = transfer_time_s(
            blocks,
            bytes_per_block=cfg.kv_bytes_per_block,
            bandwidth_gbps=cfg.kv_transfer_bandwidth_gbps,
            latency_ms=cfg.kv_transfer_latency_ms,
        )
        return s / cfg.speedup_ratio

    async def _stream(self, rid: str, queue: asyncio.Queue[_QueueItem]) -> AsyncGenerator[TokenChunk, None]:
        """A request's chunks from its queue until its last one; closing early aborts it (a suspended one too: after
        a migration's commit that is how the source's copy is freed)."""
        finished = False
        carry: _QueueItem | None = None
        try:
            while True:
                if carry is not None:
                    item, carry = carry, None
                else:
                    item = await queue.get()
                if item.__class__ is SuspendedChunk:
                    assert isinstance(item, TokenChunk)
                    yield item
                    continue
                # Merge whatever else is already queued: one chunk per wakeup of the consumer, not per token.
                while not isinstance(item, EngineError) and item.finish_reason is None and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, EngineError):
                        item = nxt
                        break
                    if nxt.__class__ is SuspendedChunk:  # never merged away: it follows the tokens before it
                        carry = nxt
                        break
                    item = _merge(item, nxt)
                if isinstance(item, EngineError):
                    finished = True  # the engine is gone; there is nothing to abort
                    # A fresh exception per stream: the shared one would collect every stream's traceback.
                    raise EngineDeadError(str(item)) from item.__cause__
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if self._queues.get(rid) is queue:
                del self._queues[rid]
            if not finished:
                self._scheduler.abort(rid)

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks; its ``generate()`` ends with an ``abort`` chunk."""
        self._scheduler.abort(request_id)
        self._push(request_id, TokenChunk(token_ids=[], finish_reason=FinishReason.ABORT))

    # --- migration (components/migration/engine.py) ------------------------------------------------------------------

    def request_table(self) -> RequestTable:
        return self._scheduler.request_table()

    def kv_extent(self, request_id: str) -> KvExtent | None:
        return self._scheduler.kv_extent(request_id)

    def suspend(self, request_id: str) -> bool:
        """Suspend at the next step boundary (at once when no step is in flight); its stream then yields a
        ``SuspendedChunk`` after every token produced before. False when the request is not in a queue here or has
        no stream (a remote prefill's reservation, a finished request)."""
        req = self._scheduler.requests.get(request_id)
        if req is None or request_id not in self._queues or req.status.value not in ("running", "waiting", "preempted"):
            return False
        self._suspending.add(request_id)
        if not self._in_step:
            self._apply_suspensions()
        return True

    def _apply_suspensions(self) -> None:
        rids, self._suspending = self._suspending, set()
        for rid in rids:
            if self._scheduler.suspend(rid) is not None:
                self._push(rid, SuspendedChunk(token_ids=[]))

    def suspended_state(self, request_id: str) -> MigratingRequest | None:
        return self._scheduler.migration_state(request_id)

    def resume(self, request_id: str) -> bool:
        self._suspending.discard(request_id)
        if not self._scheduler.resume(request_id):
            return False
        self._wakeup.set()
        return True

    def transfer_time_s(self, num_blocks: int) -> float:
        """Simulated wall time to send ``num_blocks`` KV blocks to another engine (``perf_model.transfer_time_s``
        over ``speedup_ratio``); 0 when infinitely fast or for no blocks."""
        cfg = self.config
        if cfg.is_infinitely_fast or num_blocks <= 0:
            return 0.0
        s = transfer_time_s(
            num_blocks,
            bytes_per_block=cfg.kv_bytes_per_block,
            bandwidth_gbps=cfg.kv_transfer_bandwidth_gbps,
            latency_ms=cfg.kv_transfer_latency_ms,
        )
        return s / cfg.speedup_ratio

    async def export_kv(self, request_id: str) -> dict[str, Any] | None:
        return None  # live: the blocks were copied stage by stage (kv_transfer is vLLM's)

    def reserve_migration(self, migration_id: str, request_id: str, token_ids: list[int]) -> int | None:
        self._check_alive()
        hits = self._scheduler.reserve_migration(migration_id, request_id, token_ids, self._clock())
        self._publish_kv_events(self._scheduler.take_kv_events())
        return hits

    def extend_migration(self, migration_id: str, token_ids: list[int]) -> bool:
        ok = self._scheduler.extend_migration(migration_id, token_ids)
        self._publish_kv_events(self._scheduler.take_kv_events())
        return ok

    def cancel_migration(self, migration_id: str) -> bool:
        return self._scheduler.cancel_migration(migration_id)

    def commit_migration(self, migration_id: str | None, request: MigratingRequest) -> AsyncGenerator[TokenChunk, None]:
        """Make ``request`` (suspended on another engine) run here and return its stream (the scheduler's
        ``commit_migration``: with the KV reserved under ``migration_id``, or by recompute). Raises at once (not on
        first iteration) so the caller can refuse the commit."""
        self._check_alive()
        rid = request.request_id
        if rid in self._queues:
            raise DuplicateRequestError(rid)
        now_s = self._clock()
        # The agent stamps the request's first arrival on the wall clock (0.0: unknown, e.g. an older agent); the
        # scheduler orders its queue on this engine's clock, so the stamp crosses over by its age.
        arrival_s = now_s - max(0.0, time.time() - request.arrival_s) if request.arrival_s > 0.0 else None
        self._scheduler.commit_migration(migration_id, request, now_s, arrival_s)
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._queues[rid] = queue
        self._publish_kv_events(self._scheduler.take_kv_events())
        self._wakeup.set()
        return self._stream(rid, queue)

    # --- observation ------------------------------------------------------------------------------------------------

    @property
    def step_time(self) -> dict[str, float]:
        """The step-time model this engine simulates, announced in the worker's metadata for the kv router."""
        return self.config.step_time_model.to_mapping()

    def snapshot(self) -> LoadSnapshot:
        return self._scheduler.snapshot(self._clock())

    def kv_state(self) -> KvStateSnapshot:
        return self._scheduler.kv_state()

    async def kv_events(self) -> AsyncGenerator[list[KvEvent], None]:
        """Batches of KV events in event-id order until shutdown (one consumer: two would split the batches)."""
        while True:
            while not self._kv_batches:
                if self._closed or self._dead is not None:
                    return
                self._kv_ready.clear()
                await self._kv_ready.wait()
            yield self._kv_batches.popleft()

    def import_prefix(self, block_hashes: list[int]) -> int:
        """Cache a prefix's blocks whose KV another engine sent, with no request (hot-prefix replication's copy;
        ``BlockPool.import_prefix``): their ``BLOCK_STORED`` event follows on ``kv_events()``, so the router sees
        the new holder. The caller charges the transfer (``transfer_time_s``). Returns the blocks imported."""
        n = self._scheduler.pool.import_prefix(block_hashes)
        self._publish_kv_events(self._scheduler.take_kv_events())
        return n

    def drop_prefix(self, block_hashes: list[int]) -> tuple[int, int]:
        """Evict a prefix's cached blocks no request uses (hot-prefix replication's drop; ``BlockPool.drop_prefix``):
        their ``BLOCK_REMOVED`` follows on ``kv_events()``. Returns (blocks dropped, blocks kept in use)."""
        out = self._scheduler.pool.drop_prefix(block_hashes)
        self._publish_kv_events(self._scheduler.take_kv_events())
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (an ``ALL_CLEARED`` event follows on ``kv_events()``)."""
        self._scheduler.reset_prefix_cache()
        self._publish_kv_events(self._scheduler.take_kv_events())

    @property
    def scheduler(self) -> Scheduler:
        """The pure scheduler inside, for tests and diagnostics; do not mutate it."""
        return self._scheduler

    # --- the step loop ----------------------------------------------------------------------------------------------

    async def _run_step_loop(self) -> None:
        try:
            await self._step_loop()
        except Exception as exc:  # a bug in the simulator: fail every consumer loudly instead of hanging them
            logger.exception("mock engine %s: step loop crashed", self.name)
            dead = EngineDeadError(f"mock engine {self.name!r} step loop crashed: {exc!r}")
            dead.__cause__ = exc
            self._die(dead)

    def _die(self, dead: EngineDeadError) -> None:
        self._dead = dead
        for rid in list(self._queues):
            self._push(rid, dead)
        self._kv_ready.set()

    def _inject_failure(self) -> None:
        """``fail_after_s`` is up: die as a crashed engine process would."""
        logger.error("mock engine %s: injected failure after %g s", self.name, self.config.fail_after_s)
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._die(EngineDeadError(f"mock engine {self.name!r} died (fail_after_s={self.config.fail_after_s:g})"))

    def dead_reason(self) -> str | None:
        return None if self._dead is None else str(self._dead)

    async def _step_loop(self) -> None:
        sched = self._scheduler
        infinite = self.config.is_infinitely_fast
        speedup = self.config.speedup_ratio
        previous_end_s: float | None = None  # the last step's scheduled end while the engine stays busy
        while True:
            if not sched.has_unfinished_requests():
                previous_end_s = None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            started_s = self._clock()
            self._in_step = True
            out = sched.step(started_s)
            self.num_steps += 1
            self.simulated_time_s += out.step_time_s
            if out.batch_size == 0 and not out.preempted_ids:
                self._in_step = False
                # Cannot happen with a validated config (an empty pool always fits one max_model_len sequence and
                # a step that preempts has changed state); waiting for the next request or abort beats spinning at
                # 100% CPU if it ever does.
                logger.warning("mock engine %s: nothing schedulable with %d waiting", self.name, len(sched.waiting))
                previous_end_s = None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if infinite:
                await asyncio.sleep(0)
            else:
                end_s = step_end_s(started_s, out.step_time_s / speedup, previous_end_s)
                previous_end_s = end_s
                delay_s = end_s - self._clock()
                if delay_s > 0:
                    self.num_timed_sleeps += 1
                    await asyncio.sleep(delay_s)
                else:
                    await asyncio.sleep(0)
            self._deliver(out)
            self._publish_kv_events(sched.take_kv_events())
            self._in_step = False
            if self._suspending:
                self._apply_suspensions()  # the step's tokens are queued ahead of the SuspendedChunk

    def _deliver(self, out: StepOutput) -> None:
        for rid, chunk in out.chunks.items():
            self._push(rid, chunk)

    def _push(self, request_id: str, item: _QueueItem) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:  # None: the consumer already left (its generate() aborted the request)
            queue.put_nowait(item)

    def _publish_kv_events(self, events: list[KvEvent]) -> None:
        if not events:
            return
        if len(self._kv_batches) >= self.config.max_pending_kv_event_batches:
            self._kv_batches.popleft()
            self.num_dropped_kv_event_batches += 1
        self._kv_batches.append(events)
        self._kv_ready.set()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead.__cause__
        if self._closed:
            raise EngineDeadError(f"mock engine {self.name!r} was shut down")
        if self._loop_task is None:
            raise EngineDeadError(f"mock engine {self.name!r} is not started: await start() first")


def _merge(a: TokenChunk, b: TokenChunk) -> TokenChunk:
    return TokenChunk(
        token_ids=a.token_ids + b.token_ids,
        finish_reason=b.finish_reason,
        num_prompt_tokens=a.num_prompt_tokens or b.num_prompt_tokens,
        num_cached_tokens=a.num_cached_tokens or b.num_cached_tokens,
        position=a.position if a.token_ids else b.position,
    )
