"""Disaggregated serving inside a worker: the decode side (``RemotePrefiller``) and the prefill side (``PrefillLoop``).

A request reaches a **decode** worker like any other (the frontend routes clients to decode and aggregated workers,
never to prefill workers). Before its engine starts the prompt, the decode worker asks the pure rule
``decide_prefill`` (components/router/policies/disagg.py) with the prompt's length, what its own prefix cache holds,
the prefill queue's depth and how many prefill workers are alive. Remote: its engine reserves blocks for the prompt
(``generate_remote``), and the worker pushes a ``RemotePrefillRequest`` onto the model's JetStream prefill queue
naming itself as where to deliver, then waits for the result (at most ``remote_prefill_timeout_s``).

A **prefill** worker pops one item at a time, heartbeats it (``in_progress`` every ack wait / 3, so a slow prefill is
not redelivered), prefills the prompt on its engine (the request's own sampling parameters; the first output token is
kept and the rest aborted), charges the KV transfer (the simulated engine's modelled time), delivers a
``RemotePrefillResult`` to the decode worker's ``prefill_result`` endpoint, and only then acks. The decode worker's
engine commits the blocks and the first token and decodes on, in the client's same stream.

How the KV gets to the decode engine is the engines' business: a simulated decode engine commits the blocks it
reserved; a vLLM decode engine with NIXL (``remote_prefill_mode`` kv_transfer) pulls them from the prefill engine,
which kept them because the item said the decode worker would pull (``RemotePrefillRequest.kv_transfer``) and named
them in the result (``kv_transfer_params``, from the engine's ``prefill_handoff``); a vLLM decode engine without it
recomputes the prompt (components/workers/engines/vllm/nixl.py, docs/disagg.md).

What can go wrong, and what happens:

* The queue is full, unreachable, or no prefill worker is alive: ``decide_prefill`` (or the push) says local; the
  decode worker prefills the prompt itself. Nothing waits on a queue nobody reads.
* A prefill worker dies mid-item (SIGKILL): it never acked, so JetStream redelivers the item after the ack wait (5 s,
  ``DEFAULT_ACK_WAIT_S``) to another prefill worker; the decode worker is still waiting (its timeout is longer than
  the ack wait plus a prefill) and receives one result. A result is accepted once per request: a second delivery
  (the first worker delivered, then died before its ack) is refused and dropped. The client sees one stream.
* The decode worker dies, or the request was aborted, or it gave up waiting: its reservation went with it (or was
  released); the prefill worker's delivery is refused (no responders, or ``accepted: false``) and it acks the item.
  An item popped after its deadline is acked unprefilled.
* The prompt is bad (too long for the prefill engine): the prefill worker delivers ``error``; the decode worker
  prefills locally, where its own engine reports the error to the client as usual.
* SIGTERM to a prefill worker: it stops popping, finishes and acks the item in hand, then leaves; items still queued
  stay for the other prefill workers. SIGTERM to a decode worker: its ``generate`` drain waits for its requests,
  remote prefills included (``prefill_result`` is the last endpoint it stops).

Queue metrics: each prefill worker publishes a ``PrefillQueueReport`` every ``metrics_interval_ms`` on
``TOPIC_PREFILL_QUEUE``; decode workers count the prefill workers alive from who reports (a report older than
the fleet's staleness rule for queue reports allows, ``components.fleet.rules.QUEUE_REPORTS``, no longer counts);
the planner and the frontend's ``/metrics`` read the same reports.

Imports: the runtime, the protocol, the pure ``decide_prefill`` rule, and this package's config and engine contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from components.fleet.queues import PrefillQueues
from components.protocol.endpoints import ENDPOINT_PREFILL_RESULT, TOPIC_PREFILL_QUEUE
from components.protocol.messages import (
    GenerateRequest,
    PrefillQueueReport,
    RemotePrefillRequest,
    RemotePrefillResult,
    TokenChunk,
)
from components.protocol.metadata import RemotePrefillMode, WorkerRole
from components.router.policies.disagg import PrefillDecision, decide_prefill
from components.runtime import (
    Client,
    EventSubscription,
    QueueFullError,
    QueueUnavailableError,
    RecoverableError,
    RemoteHandlerError,
    Runtime,
    WorkQueue,
)
from components.runtime.codec import pack, unpack
from components.workers.config import WorkerConfig
from components.workers.engines.base import Engine, EngineError, remote_prefill_mode_of

logger = logging.getLogger(__name__)

__all__ = ["PrefillLoop", "PrefillWorkers", "RemotePrefiller", "supports_remote_decode"]

# How long a decode worker waits for the queue's depth before deciding without it (local).
QUEUE_STATS_TIMEOUT_S = 1.0
# How long a prefill worker waits for a decode worker to take a delivered result.
DELIVERY_TIMEOUT_S = 10.0
# How long one pop waits before the prefill loop checks whether it should stop.
POP_TIMEOUT_S = 0.5


def supports_remote_decode(engine: object) -> bool:
    """Whether ``engine`` can take a remotely prefilled prompt (``generate_remote`` and ``cached_prefix_tokens``)."""
    return hasattr(engine, "generate_remote") and hasattr(engine, "cached_prefix_tokens")


class PrefillWorkers:
    """The prefill workers alive for one model, as a decode worker hears their ``PrefillQueueReport``s: the one rule
    frontend and status use too (``components.fleet.queues.PrefillQueues``), for this model only."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._queues = PrefillQueues()

    def apply(self, source_id: int, report: PrefillQueueReport, now_s: float) -> None:
        if report.model == self.model:
            self._queues.apply(source_id, report, now_s)

    def forget(self, source_id: int) -> None:
        self._queues.forget(source_id)

    def count(self, now_s: float) -> int:
        return self._queues.count(self.model, now_s)


@dataclasses.dataclass(slots=True)
class DecodeCounters:
    """A decode worker's remote-prefill outcomes (tests, logs): decisions by kind, and what came of the remote
    ones."""

    decisions: dict[str, int] = dataclasses.field(default_factory=dict)
    remote_committed: int = 0  # a result arrived and was handed to the engine
    remote_timed_out: int = 0  # no result within remote_prefill_timeout_s: prefilled locally
    remote_failed: int = 0  # the prefill worker reported an error, or the push failed: prefilled locally
    results_refused: int = 0  # deliveries for requests no longer waiting here (late, duplicate, aborted)


class RemotePrefiller:
    """A decode worker's side of disaggregation (module docstring): decide, enqueue, wait, accept the result."""

    def __init__(self, runtime: Runtime, config: WorkerConfig, engine: Engine, instance_id: int) -> None:
        self.runtime = runtime
        self.config = config
        self.engine = engine
        self.instance_id = instance_id
        self.prefill_workers = PrefillWorkers(config.model)
        self.counters = DecodeCounters()
        self._queue: WorkQueue | None = None
        self._waiting: dict[str, asyncio.Future[RemotePrefillResult]] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def outstanding(self) -> int:
        """Remote prefills this worker waits for now."""
        return len(self._waiting)

    @property
    def pulls_kv(self) -> bool:
        """Whether this worker's engine pulls a remotely prefilled prompt's KV (else it recomputes the prompt, and
        asks the prefill worker to keep no KV for it)."""
        return remote_prefill_mode_of(self.engine, WorkerRole.DECODE) == RemotePrefillMode.KV_TRANSFER

    async def start(self) -> None:
        ns = self.runtime.namespace(self.config.namespace)
        self._queue = await ns.prefill_queue(self.config.model)
        sub: EventSubscription[Any] = await ns.events.subscribe(TOPIC_PREFILL_QUEUE, max_pending=10_000)
        self._task = self.runtime.supervisor.spawn(self._follow(sub), name=f"prefill-reports:{self.instance_id:x}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _follow(self, sub: EventSubscription[Any]) -> None:
        try:
            async for ev in sub:
                try:
                    report = PrefillQueueReport.from_dict(ev.payload)
                except (KeyError, TypeError) as e:
                    logger.warning("prefill queue report from %x does not parse: %r", ev.source_id, e)
                    continue
                self.prefill_workers.apply(ev.source_id, report, time.monotonic())
        finally:
            with contextlib.suppress(Exception):
                await sub.close()

    async def decide(self, request: GenerateRequest) -> PrefillDecision:
        engine: Any = self.engine
        n = len(request.token_ids)
        cached = int(engine.cached_prefix_tokens(request.token_ids))
        cfg = self.config
        if n - min(n, cached) <= cfg.max_local_prefill_length:  # short: the queue is not asked (decide_prefill's order)
            decision = decide_prefill(
                n,
                cached,
                queue_size=None,
                prefill_workers=0,
                max_local_prefill_length=cfg.max_local_prefill_length,
                max_prefill_queue_size=cfg.max_prefill_queue_size,
            )
        else:
            workers = self.prefill_workers.count(time.monotonic())
            size = await self._queue_size() if workers else None
            decision = decide_prefill(
                n,
                cached,
                queue_size=size,
                prefill_workers=workers,
                max_local_prefill_length=cfg.max_local_prefill_length,
                max_prefill_queue_size=cfg.max_prefill_queue_size,
            )
        kind = str(decision.kind)
        self.counters.decisions[kind] = self.counters.decisions.get(kind, 0) + 1
        return decision

    async def _queue_size(self) -> int | None:
        """Items waiting in the queue (never delivered: Dynamo's measure), None when it cannot be read in time."""
        if self._queue is None:
            return None
        try:
            async with asyncio.timeout(QUEUE_STATS_TIMEOUT_S):
                stats = await self._queue.stats()
        except (QueueUnavailableError, TimeoutError) as e:
            logger.debug("prefill queue depth unknown: %s", e)
            return None
        return stats.waiting

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """The engine's stream of ``request`` with its prompt prefilled remotely (or locally after all)."""
        engine: Any = self.engine
        return engine.generate_remote(request, lambda: self.prefill(request))  # type: ignore[no-any-return]

    async def prefill(self, request: GenerateRequest) -> RemotePrefillResult | None:
        """Enqueue ``request``'s prompt and wait for its result; None: prefill locally (full queue, unreachable
        queue, prefill error, no result in time)."""
        rid = request.request_id
        if self._queue is None or rid in self._waiting:
            self.counters.remote_failed += 1
            return None
        now = time.time()
        timeout_s = self.config.remote_prefill_timeout_s
        item = RemotePrefillRequest(
            request=request,
            decode_instance=self.instance_id,
            decode_component=self.config.component,
            deadline_s=now + timeout_s,
            enqueued_s=now,
            kv_transfer=self.pulls_kv,
        )
        fut: asyncio.Future[RemotePrefillResult] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            try:
                await self._queue.push(pack(item.to_dict()))
            except (QueueFullError, QueueUnavailableError) as e:
                logger.info("request %s: remote prefill not enqueued (%s): prefilling locally", rid, e)
                self.counters.remote_failed += 1
                return None
            try:
                async with asyncio.timeout(timeout_s):
                    result = await asyncio.shield(fut)
            except TimeoutError:
                logger.warning(
                    "request %s: no remote prefill result in %g s (remote_prefill_timeout_s): prefilling locally",
                    rid,
                    timeout_s,
                )
                self.counters.remote_timed_out += 1
                return None
        finally:
            self._waiting.pop(rid, None)
        if result.error:
            logger.info("request %s: remote prefill failed (%s): prefilling locally", rid, result.error)
            self.counters.remote_failed += 1
            return None
        self.counters.remote_committed += 1
        return result

    def accept(self, body: Any) -> bool:
        """A prefill worker delivers a result: True when this request waits for it here (it is taken), False when
        not (done, given up, aborted, or a duplicate delivery): the prefill worker drops it."""
        try:
            result = RemotePrefillResult.from_dict(body)
        except (KeyError, TypeError) as e:
            logger.warning("remote prefill result does not parse: %r", e)
            return False
        fut = self._waiting.get(result.request_id)
        if fut is None or fut.done():
            self.counters.results_refused += 1
            return False
        fut.set_result(result)
        return True


@dataclasses.dataclass(slots=True)
class PrefillCounters:
    items: int = 0  # items popped
    delivered: int = 0  # results a decode worker took
    refused: int = 0  # results no decode worker took (gone, gave up, duplicate): dropped
    expired: int = 0  # items popped after their deadline: dropped unprefilled
    errors: int = 0  # prompts the engine refused: an error delivered
    redelivered: int = 0  # items this worker got on a second or later delivery


class PrefillLoop:
    """A prefill worker's side of disaggregation (module docstring): pop, prefill, deliver, ack; report the queue."""

    def __init__(self, runtime: Runtime, config: WorkerConfig, engine: Engine, instance_id: int) -> None:
        self.runtime = runtime
        self.config = config
        self.engine = engine
        self.instance_id = instance_id
        self.counters = PrefillCounters()
        self.busy = False
        self._queue: WorkQueue | None = None
        self._stopping = asyncio.Event()
        self._reporting = True  # the report loop runs while this holds (stop: why not by cancellation alone)
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: dict[str, Client] = {}

    async def start(self) -> None:
        ns = self.runtime.namespace(self.config.namespace)
        self._queue = await ns.prefill_queue(self.config.model)
        sup = self.runtime.supervisor
        self._tasks = [
            sup.spawn(self._loop(), name=f"prefill-loop:{self.instance_id:x}"),
            sup.spawn(self._report(), name=f"prefill-report:{self.instance_id:x}"),
        ]

    async def stop(self) -> None:
        """Pop no more; finish, deliver and ack the item in hand; then stop reporting."""
        self._stopping.set()
        busy = self.busy
        logger.info(
            "prefill worker %x stopping: %s", self.instance_id,
            "finishing the item in hand first" if busy else "no item in hand",
        )  # fmt: skip
        tasks, self._tasks = self._tasks, []
        if tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await tasks[0]  # the loop: it ends after the item in hand
        if busy:
            c = self.counters
            logger.info(
                "prefill worker %x: the item in hand is done; %d items taken, %d delivered", self.instance_id,
                c.items, c.delivered,
            )  # fmt: skip
        # The report loop ends at its next turn once this is False, even if the cancel below is lost: on Python 3.11
        # asyncio.wait_for (its queue-stats read) can swallow a cancellation that lands as the read completes, and
        # a loop that only ended by cancellation then ran on (seen once in a fresh-clone suite run: a prefill worker
        # still alive 30 s after its item was done).
        self._reporting = False
        for t in tasks[1:]:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

    async def _loop(self) -> None:
        assert self._queue is not None
        queue = self._queue
        while not self._stopping.is_set():
            try:
                item = await queue.pop(POP_TIMEOUT_S)
            except QueueUnavailableError as e:
                logger.warning("prefill queue: %s", e)
                await asyncio.sleep(POP_TIMEOUT_S)
                continue
            if item is None:
                continue
            self.busy = True
            try:
                await self._handle(item)
            except Exception:
                logger.exception("prefill worker %x: item failed; handing it back", self.instance_id)
                with contextlib.suppress(Exception):
                    await item.nak()
            finally:
                self.busy = False

    async def _handle(self, item: Any) -> None:
        self.counters.items += 1
        if item.delivered > 1:
            self.counters.redelivered += 1
        try:
            job = RemotePrefillRequest.from_dict(unpack(item.data))
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("prefill queue item does not parse (%r): dropped", e)
            await item.term()
            return
        rid = job.request.request_id
        if time.time() > job.deadline_s:
            logger.info("request %s: popped after its deadline (the decode worker prefilled it): dropped", rid)
            self.counters.expired += 1
            await item.ack()
            return
        heartbeat = asyncio.ensure_future(self._heartbeat(item))
        try:
            result = await self._prefill(job)
            accepted = await self._deliver(job, result)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        if accepted:
            self.counters.delivered += 1
        else:
            self.counters.refused += 1
            logger.info("request %s: decode worker %x no longer waits for it: result dropped", rid, job.decode_instance)
        await item.ack()

    async def _heartbeat(self, item: Any) -> None:
        interval = max(0.05, self._queue.ack_wait_s / 3 if self._queue is not None else 1.0)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                await item.in_progress()

    async def _prefill(self, job: RemotePrefillRequest) -> RemotePrefillResult:
        request = job.request
        # Its own id on this engine: a retried item must not collide with a request still being aborted here.
        local = GenerateRequest(f"{request.request_id}@prefill", request.token_ids, request.sampling)
        first: TokenChunk | None = None
        kv_transfer_params: dict[str, Any] | None = None
        # An engine that can keep the KV for the decode engine to pull (vLLM with NIXL) does, when the decode worker
        # will pull it; otherwise the first token is all that goes back.
        handoff = getattr(self.engine, "prefill_handoff", None) if job.kv_transfer else None
        try:
            if handoff is not None:
                first, kv_transfer_params = await handoff(local)
            else:
                async with contextlib.aclosing(self.engine.generate(local)) as chunks:  # type: ignore[type-var]
                    async for chunk in chunks:
                        if chunk.token_ids:
                            first = chunk
                            break
                        if chunk.finish_reason is not None:
                            break
        except EngineError as e:
            self.counters.errors += 1
            return RemotePrefillResult(request.request_id, self.instance_id, error=str(e))
        if first is None:
            return RemotePrefillResult(request.request_id, self.instance_id, error="the engine produced no token")
        n = len(request.token_ids)
        transfer_s = 0.0
        transfer = getattr(self.engine, "kv_transfer_time_s", None)
        if transfer is not None:
            transfer_s = float(transfer(n))
            if transfer_s > 0:
                await asyncio.sleep(transfer_s)  # the KV is on its way to the decode worker
        bs = self.engine.block_size
        return RemotePrefillResult(
            request_id=request.request_id,
            prefill_instance=self.instance_id,
            token_ids=first.token_ids[:1],
            num_prompt_tokens=n,
            num_cached_tokens=first.num_cached_tokens,
            num_blocks=-(-n // bs),
            transfer_s=transfer_s,
            kv_transfer_params=kv_transfer_params,
        )

    async def _deliver(self, job: RemotePrefillRequest, result: RemotePrefillResult) -> bool:
        client = self._clients.get(job.decode_component)
        if client is None:
            ep = self.runtime.namespace(self.config.namespace).component(job.decode_component)
            client = await ep.endpoint(ENDPOINT_PREFILL_RESULT).client()
            self._clients[job.decode_component] = client
        try:
            stream = await client.direct(result.to_dict(), job.decode_instance)
            async with stream:
                async for reply in stream:
                    return bool(reply.get("accepted"))
        except (RecoverableError, RemoteHandlerError, TimeoutError) as e:
            logger.info("delivering %s to %x: %s", result.request_id, job.decode_instance, e)
        return False

    async def _report(self) -> None:
        assert self._queue is not None
        events = self.runtime.namespace(self.config.namespace).events
        interval_s = self.config.metrics_interval_ms / 1000
        while self._reporting:
            report = PrefillQueueReport(
                model=self.config.model,
                waiting=0,
                in_flight=0,
                oldest_age_s=0.0,
                pullers=0,
                redelivered=0,
                busy=self.busy,
                items_done=self.counters.delivered + self.counters.refused + self.counters.expired,
            )
            try:
                async with asyncio.timeout(QUEUE_STATS_TIMEOUT_S):
                    stats = await self._queue.stats()
                report.waiting = stats.waiting
                report.in_flight = stats.in_flight
                report.oldest_age_s = stats.oldest_age_s
                report.pullers = stats.pullers
                report.redelivered = stats.redelivered
            except (QueueUnavailableError, TimeoutError) as e:
                report.stats_error = str(e) or type(e).__name__
            try:
                await events.publish(TOPIC_PREFILL_QUEUE, report.to_dict(), source_id=self.instance_id)
            except Exception as e:  # noqa: BLE001 - NATS reconnecting: skip this sample
                logger.debug("publishing prefill queue report: %s", e)
            await asyncio.sleep(interval_s)
