"""One client request's life on the workers, in one place: route, send, first item, retry elsewhere, stream, finish.

``Dispatch`` owns the request's *upstream*: which worker it runs on now (``instance_id``, under ``route_id``), the
runtime stream from that worker (``stream``), and every call the router's bookkeeping needs (``prepare``, ``select``,
``on_routed``, ``on_first_token``, ``on_finished``: no other frontend module makes them). The client-facing
``Generation`` (service.py) reads items from ``Dispatch.next_item`` and never holds a worker or a stream, so the
upstream can change under it without the client noticing. A request's life::

    start()       router.prepare once, then _place(): up to 1 + max_retries attempts, each
                      select -> on_routed -> _attempt (send, wait for the first item) -> on_first_token: current
                      or (failed before any output) on_finished, the worker's process suspect, the next worker
    next_item()   the current stream's items; an abnormal end after the first one (the worker's process died, its
                      engine failed, it aborted the request on a drain) raises Interrupted, and the Generation
                      hands it to resume() with the position the client has reached (its output tokens so far)
    close()       _release(): cancel the request on its worker if it still runs, on_finished

Migration, two ways, one client stream:

- **live** (the workers move a running request, components/migration/agent.py): the stream itself is handed over in
  the runtime (components/runtime/request_plane.py, hand-over: the old worker's last frame says MOVED, the new one
  answers on the same stream, frames reordered by number). ``next_item`` only notices that the stream's instance
  changed: the router's bookkeeping moves with it (``Router.on_migrated``), counted as a ``live`` migration.
- **failover** (``resume``): a running request whose worker dies (no responders, a cut stream, its engine failed)
  is re-issued, up to ``migration_limit`` times: ``_release`` the broken attempt, mark its worker down in the router
  (no new request goes there from now on), ``router.prepare`` the prompt plus the outputs so far, ``_place`` it with
  a continuation ``GenerateRequest`` (``num_output_tokens``: the engine resumes the sampler and numbers its output
  from there) on another worker, and return the item that continues at the client's position. With
  ``migration_limit`` 0, or once used up, the request fails with ``UpstreamError`` saying so.

Every chunk carries its output position (``TokenChunk.position``) and ``next_item`` splices by it, whichever way
the stream went on: a chunk starting below the position the client has reached is trimmed to the part it lacks (a
repeat is never delivered), one starting above it means tokens were lost, which ends the upstream as an
interruption (and so a failover from the last token the client has).

- **disaggregated prefill** needs nothing here: as in Dynamo, the decode worker a request is routed to decides
  whether its prompt is prefilled remotely and does the hop itself (components/workers/disagg.py), because only it
  knows its own prefix cache and holds the blocks the KV must land in. The frontend routes to decode (and
  aggregated) workers only; a decode worker that fails before its first item is a failed attempt like any other.

Retries before the first item: a worker that is gone, draining, dead, aborted the request, or whose stream broke is
replaced by another (up to ``max_retries``) without the client seeing anything. Error codes from the worker
(``RemoteHandlerError.code``, components/protocol/errors.py) decide the rest: ``REQUEST_INVALID`` is the client's to
fix (``InvalidRequestError``, 400, naming the parameter), a fatal code fails the request (``UpstreamError``), a
recoverable one tries another worker. A failure makes its whole process *suspect*: the other workers of the same
process (same node and pid in their ``WorkerMetadata``) share its fault, so this request's retries, and other
requests for ``SUSPECT_PROCESS_S``, go to another process while one exists (a SIGKILLed process hosting 8 workers
must not absorb the whole retry budget before its leases expire).

Metrics: every decision the router returns is counted by its kind (``ModelMetrics.count_decision``), and the attempt
that produced the first item by its worker, prompt and cached tokens (``count_placement``): a request retried
before its first output counts on the worker it ran on only.

Hot path: ``next_item`` is one ``__anext__`` and one finish-reason check per chunk, ``poll`` the same without a
coroutine for a chunk that is here already; everything else runs once per attempt.

Imports: the router (no I/O parts), the runtime's client side, the protocol; never aiohttp.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from components.frontend.errors import InvalidRequestError, ServiceUnavailableError, UpstreamError, UpstreamTimeoutError
from components.protocol.errors import ErrorCode
from components.protocol.kv_hashing import PromptHashes, packed_prompt
from components.protocol.messages import GenerateRequest
from components.protocol.metadata import WorkerMetadata
from components.router import NoWorkersError, Router, RouteRequest
from components.router.types import DecisionKind
from components.runtime import (
    BusUnavailableError,
    InstanceDrainingError,
    InstanceGoneError,
    RemoteHandlerError,
    ResponseStream,
    StreamInterruptedError,
)

if TYPE_CHECKING:
    from components.frontend.config import FrontendConfig
    from components.frontend.metrics import ModelMetrics
    from components.frontend.models import ModelRegistry
    from components.frontend.service import Prepared

logger = logging.getLogger(__name__)

# Errors after which the same request may go to another worker, provided nothing has reached the client yet.
RETRIABLE = (InstanceGoneError, InstanceDrainingError, StreamInterruptedError)
# How long a process whose worker failed a request is avoided by new requests (while another process can serve).
# A dead process's workers are excluded by the router once their load reports go stale (~0.5 s) and by discovery
# once their leases expire (10 s); this bridges the first of those gaps for every request, not only the failed one.
SUSPECT_PROCESS_S = 2.0
# The most blocks of a prompt a request report's prefix names (``on_prefix``): 1,024 blocks are 16,384 tokens at
# block size 16, past the documents shape's longest document (docs/router.md), and cost ~0.2 ms of hashing at most.
PREFIX_REPORT_BLOCKS = 1024

ProcessKey = tuple[str, int]


def _head(hashes: Sequence[int], n: int) -> Sequence[int]:
    """The first ``n`` of a prompt's block hashes, computing no more of a lazy ``PromptHashes`` than those."""
    if isinstance(hashes, PromptHashes):
        return hashes.ensure(n)[: min(n, len(hashes))]
    return hashes[:n]


class Suspects:
    """Processes whose worker just failed, until when they are avoided. Shared by every request of a frontend."""

    def __init__(self, hold_s: float = SUSPECT_PROCESS_S) -> None:
        self.hold_s = hold_s
        self._until: dict[ProcessKey, float] = {}

    def mark(self, key: ProcessKey, now_s: float) -> None:
        if key != ("", 0):  # a worker that did not say where it runs shares nothing known with the others
            self._until[key] = now_s + self.hold_s

    def active(self, now_s: float) -> set[ProcessKey]:
        if not self._until:
            return set()
        expired = [k for k, t in self._until.items() if t <= now_s]
        for k in expired:
            del self._until[k]
        return set(self._until)


def avoid(
    instances: Mapping[int, Any], excluded: set[int], suspect: set[ProcessKey], process_of: Callable[[Any], ProcessKey]
) -> frozenset[int]:
    """Instances a retry should not use: those already tried, plus every instance of a suspect process, unless that
    would leave none (then only those already tried: a suspect process is better than no answer). Pure."""
    if not suspect:
        return frozenset(excluded)
    shunned = {iid for iid, info in instances.items() if process_of(info) in suspect}
    if set(instances) - excluded - shunned:
        return frozenset(excluded | shunned)
    return frozenset(excluded)


def _process_of(info: Any) -> ProcessKey:
    return WorkerMetadata.from_dict(info.metadata).process_key


# The pause before the next attempt after "no responders", doubled each attempt (``Dispatch._place``).
NO_RESPONDERS_BACKOFF_S = 0.1


async def _pause(seconds: float) -> None:
    await asyncio.sleep(seconds)


def _is_death(e: BaseException) -> bool:
    """Whether ``e`` says the worker itself is gone (its process: no responders, no answer to a probe; or its
    engine died), not merely this request: then no new request should go there (``Router.mark_down``)."""
    if isinstance(e, StreamInterruptedError):
        # Not a lost frame or a request the instance forgot: those say nothing of the instance itself.
        return "no responders" in e.reason or "no answer to a liveness probe" in e.reason
    if isinstance(e, InstanceGoneError):
        return "no responders" in str(e)
    return isinstance(e, RemoteHandlerError) and e.code == ErrorCode.ENGINE_DEAD


class _Aborted(Exception):
    """A stream that ended before its first output: the worker gave up on it (retriable)."""


class Interrupted(Exception):
    """The current upstream ended abnormally after the first item (``next_item``): hand it to ``Dispatch.resume``
    with the position the client has reached. ``__cause__`` is the runtime's error, if one was raised."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Dispatch:
    """The upstream of one client request. ``start`` returns the first item, ``next_item`` the following ones,
    ``resume`` what follows an ``Interrupted``; ``close`` cancels whatever still runs and settles the router's
    bookkeeping (idempotent)."""

    def __init__(
        self,
        config: FrontendConfig,
        registry: ModelRegistry,
        router: Router,
        suspects: Suspects,
        prepared: Prepared,
        metrics: ModelMetrics,
        on_retry: Callable[[str], None] | None = None,
        on_prefix: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        """``on_prefix``: told the routed prompt's chained block hashes, up to ``PREFIX_REPORT_BLOCKS``, once (a
        KV-aware router's; the request reports' prefixes, ``RequestCounts.carried``)."""
        self.config = config
        self.registry = registry
        self.router = router
        self.suspects = suspects
        self.prepared = prepared
        self.metrics = metrics
        self._on_retry = on_retry
        self._on_prefix = on_prefix
        # The current attempt: its stream, the id the router and the engine know it by, its worker.
        self.stream: ResponseStream | None = None
        self.route_id = prepared.request_id
        self.instance_id: int | None = None
        self.num_attempts = 0  # requests sent to a worker, all placements together (they number the route ids)
        self._open = False  # router bookkeeping open for route_id
        # Output tokens delivered to the Generation so far (the splice point), and which.
        self.position = 0
        self.output_ids: list[int] = []
        # An item ``poll`` took from the stream but left to ``next_item`` (out of order, an abort, a moved stream).
        self._stash: dict[str, Any] | None = None
        self.num_failovers = 0  # re-issues after a worker died (bounded by migration_limit)
        self.num_live_moves = 0  # moves made by the workers, noticed on the stream

    # --- placement: before the first item -----------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Route and wait for the first item, trying other workers while nothing has been produced.

        Raises ServiceUnavailableError (no worker could take it), UpstreamTimeoutError (no first output within
        ``first_token_timeout_s``), InvalidRequestError (the engine refused the request) or UpstreamError.
        """
        p = self.prepared
        hints = p.hints
        # Prepared once: KV-aware policies hash the prompt here, not again on every retry. A router that hashes it
        # gets it packed (``Prepared.packed_prompt``: its buffer is hashed as it is, ~38 us less per 8k-token
        # decision); the worker is sent the list (msgpack, below).
        route = self.router.prepare(
            RouteRequest(
                p.packed_prompt() if self.router.uses_kv else p.prompt_ids,
                p.model.name,
                time.monotonic(),
                program_id=hints.program_id,
                ends_program=hints.ends_program,
                pinned_instance_id=hints.pinned_instance_id,
            )
        )
        if self._on_prefix is not None and route.block_hashes is not None:
            self._on_prefix(_head(route.block_hashes, PREFIX_REPORT_BLOCKS))
        body = GenerateRequest(p.request_id, p.prompt_ids, p.sampling).to_dict()
        first = await self._place(route, body, set())
        item = self._accept(first)
        assert item is not None  # the first item of a request starts at position 0
        return item

    async def _place(self, route: RouteRequest, body: dict[str, Any], excluded: set[int]) -> dict[str, Any]:
        """Put ``body`` on a worker (not one of ``excluded``) and return its first item; that attempt becomes the
        current upstream. Up to ``1 + max_retries`` attempts; see ``start`` for what it raises."""
        p = self.prepared
        cfg = self.config
        last_error = ""
        for attempt in range(cfg.max_retries + 1):
            now = time.monotonic()
            shunned = avoid(p.model.instances, excluded, self.suspects.active(now), _process_of)
            if attempt or shunned:
                route = dataclasses.replace(route, now_s=now, excluded_instance_ids=shunned)
            try:
                decision = self.router.select(route)
            except NoWorkersError as e:
                self.metrics.count_decision(DecisionKind.NOWHERE)
                detail = f"; last failure: {last_error}" if last_error else ""
                raise ServiceUnavailableError(f"{e.reason}{detail}") from None
            self.metrics.count_decision(decision.kind)
            iid = decision.instance_id
            assert iid is not None
            client = self.registry.client_for(iid)
            if client is None:  # discovery changed between the router's view and the registry's
                excluded.add(iid)
                continue
            # The engine refuses an id it already holds; a retry may land where an earlier attempt is being aborted.
            route_id = f"{p.request_id}.{self.num_attempts}" if self.num_attempts else p.request_id
            body["request_id"] = route_id
            self.num_attempts += 1
            self.router.on_routed(route_id, decision, route)
            stream: ResponseStream | None = None
            first: dict[str, Any] | None = None
            try:
                stream, first = await self._attempt(client, body, iid)
            except (*RETRIABLE, _Aborted) as e:
                failure: Exception = e
                if _is_death(e):
                    self.router.mark_down(iid, time.monotonic(), str(e))
            except RemoteHandlerError as e:
                # Decided on the wire code, never on the raising class's name (components/protocol/errors.py).
                if e.code == ErrorCode.REQUEST_INVALID:
                    # About the request itself: retrying elsewhere would fail the same way; the client's to fix.
                    raise InvalidRequestError(e.message, param=e.payload.param) from e
                if not e.recoverable:
                    raise UpstreamError(f"the worker failed the request: {e.error_type}: {e.message}") from e
                failure = e  # its engine is gone: another worker may serve it
                if _is_death(e):
                    self.router.mark_down(iid, time.monotonic(), e.message)
            except BusUnavailableError as e:
                raise ServiceUnavailableError(f"the request plane is down: {e}") from e
            finally:
                if first is None:  # failed, or cancelled (the client left): release the attempt
                    self.router.on_finished(route_id)
            if first is not None and stream is not None:
                self.router.on_first_token(route_id)
                self.metrics.count_placement(
                    iid,
                    len(route.token_ids),
                    first.get("num_cached_tokens", 0),
                    first.get("num_host_cached_tokens", 0),
                )
                self.stream, self.route_id, self.instance_id, self._open = stream, route_id, iid, True
                return first
            excluded.add(iid)
            info = p.model.instances.get(iid)
            if info is not None and not isinstance(failure, InstanceDrainingError):
                self.suspects.mark(_process_of(info), time.monotonic())  # its siblings share the fault
            last_error = str(failure)
            if self._on_retry is not None:
                self._on_retry(type(failure).__name__)
            logger.info("request %s: worker %x failed before its first output (%s)", p.request_id, iid, last_error)
            if attempt < cfg.max_retries and isinstance(failure, InstanceGoneError) and "no responders" in last_error:
                # Nobody listens on its subject: a dead worker, or every worker for a moment while nats-server comes
                # back and they subscribe again (seen in CI: 4 immediate attempts all met "no responders" right after
                # an embedded nats-server's restart, and the request failed). A short pause before the next worker
                # (0.1, 0.2, 0.4 s) rides out that window; a dead worker's request waits 0.1 s more for the next one.
                await _pause(NO_RESPONDERS_BACKOFF_S * 2**attempt)
        raise ServiceUnavailableError(
            f"no worker could take the request after {cfg.max_retries + 1} attempts; last failure: {last_error}"
        )

    async def _attempt(self, client: Any, body: dict[str, Any], iid: int) -> tuple[ResponseStream, dict[str, Any]]:
        """One worker's try: send, then wait for its first item. Disaggregation inserts its prefill hop here, before
        the send (module docstring); whatever it raises counts as this attempt's failure."""
        stream = await client.generate(body, instance_id=iid)
        try:
            return stream, await self._first_item(stream, iid)
        except BaseException:
            await stream.aclose()
            raise

    async def _first_item(self, stream: ResponseStream, instance_id: int) -> dict[str, Any]:
        timeout_s = self.config.first_token_timeout_s or None
        try:
            async with asyncio.timeout(timeout_s):
                item: dict[str, Any] = await stream.__anext__()
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"no output from worker {instance_id:x} within {timeout_s:g} s (first_token_timeout_s)"
            ) from None
        except StopAsyncIteration:
            raise _Aborted(f"worker {instance_id:x} ended the stream without output") from None
        if item["finish_reason"] == "abort":  # tokens or not, nothing has reached the client: another worker's turn
            raise _Aborted(f"worker {instance_id:x} aborted the request before its first output")
        return item

    # --- streaming: after it ------------------------------------------------------------------------------------------

    async def next_item(self) -> dict[str, Any]:
        """The next item from the current upstream. Raises ``Interrupted`` where it broke in a way another worker
        could continue from (``resume``), ``UpstreamError`` where it could not."""
        stream = self.stream
        assert stream is not None, "start() first"
        while True:
            try:
                stash = self._stash
                if stash is not None:
                    self._stash = None
                    item: dict[str, Any] = stash
                else:
                    item = await stream.__anext__()
            except StopAsyncIteration:
                raise UpstreamError("the worker ended the stream without a finish reason") from None
            except RemoteHandlerError as e:
                message = f"the worker failed mid-stream: {e.error_type}: {e.message}"
                if e.code == ErrorCode.ABORTED:
                    raise UpstreamError(f"the request was aborted: {e.message}") from e
                if not e.recoverable:  # about the request or a bug: another worker would fail the same way
                    raise UpstreamError(message) from e
                raise Interrupted(message) from e
            except StreamInterruptedError as e:
                raise Interrupted(f"the worker stopped answering mid-stream: {e.reason}") from e
            if stream.instance_id != self.instance_id:
                self._moved(stream.instance_id)
            if item["finish_reason"] == "abort":
                # The worker gave up on the request (its engine shut down, its drain timed out): not a normal end.
                raise Interrupted("the worker aborted the request")
            accepted = self._accept(item)
            if accepted is not None:
                return accepted

    def ready(self) -> bool:
        """Whether ``next_item`` has an item here already (it may still wait: a repeat that brings nothing new)."""
        stream = self.stream
        return stream is not None and (self._stash is not None or stream.ready())

    def poll(self) -> dict[str, Any] | None:
        """The next item if it is here already and follows on at the client's position: what ``next_item`` would
        return, taken without waiting. None otherwise; an item this cannot settle without ``next_item`` (an abort,
        a position that is not the client's, a stream that moved) is kept for it."""
        stream = self.stream
        if stream is None or self._stash is not None:
            return None
        item: dict[str, Any] | None = stream.poll()
        if item is None:
            return None
        ids: list[int] = item["token_ids"]
        if (
            stream.instance_id != self.instance_id
            or item["finish_reason"] == "abort"
            or (ids and item.get("position", self.position) != self.position)
        ):
            self._stash = item
            return None
        if ids:  # _accept's in-order case
            self.position += len(ids)
            self.output_ids += ids
        return item

    def _accept(self, item: dict[str, Any]) -> dict[str, Any] | None:
        """Splice ``item`` at the client's position (module docstring): the item to deliver (trimmed of tokens the
        client has), None when it brings nothing new; ``Interrupted`` when tokens before it are missing."""
        ids: list[int] = item["token_ids"]
        if ids:
            pos = item.get("position", self.position)
            if pos != self.position:
                if pos > self.position:
                    raise Interrupted(f"output tokens {self.position}..{pos - 1} never arrived")
                skip = self.position - pos
                if skip >= len(ids) and item["finish_reason"] is None:
                    return None  # a repeat of what the client has
                ids = ids[skip:]
                item = {**item, "token_ids": ids, "position": self.position}
            self.position += len(ids)
            self.output_ids += ids
        return item

    def _moved(self, instance_id: int) -> None:
        """The workers moved the request (live migration): its load goes with it."""
        old = self.instance_id
        self.instance_id = instance_id
        self.num_live_moves += 1
        if self._open:
            self.router.on_migrated(self.route_id, instance_id)
        self.metrics.count_migration("live")
        logger.info("request %s moved from worker %x to %x", self.prepared.request_id, old or 0, instance_id)

    async def resume(self, interruption: Interrupted, position: int) -> dict[str, Any]:
        """What follows an ``Interrupted`` upstream once the client has received ``position`` output tokens: the
        item that continues the output at that position, from another worker (failover, module docstring). Raises
        ``UpstreamError`` when ``migration_limit`` re-issues are used up (0: none allowed) and whatever ``_place``
        raises when no other worker takes it (``close`` then settles what is left)."""
        p = self.prepared
        limit = self.config.migration_limit
        cause = interruption.__cause__
        broken = self.instance_id
        if broken is not None and cause is not None and _is_death(cause):
            self.router.mark_down(broken, time.monotonic(), interruption.message)
            info = p.model.instances.get(broken)
            if info is not None:
                self.suspects.mark(_process_of(info), time.monotonic())
        if self.num_failovers >= limit:
            self.metrics.count_migration_failure("limit")
            why = "migration_limit is 0" if limit == 0 else f"it was re-issued {limit} times (migration_limit)"
            raise UpstreamError(f"{interruption.message}; not re-issued elsewhere: {why}") from cause
        await self._release()
        self.num_failovers += 1
        logger.warning(
            "request %s: %s; re-issuing it from output token %d on another worker (%d of %d)",
            p.request_id,
            interruption.message,
            self.position,
            self.num_failovers,
            limit,
        )
        prompt = p.prompt_ids + self.output_ids
        hints = p.hints
        # The packed prompt reused, only the outputs packed (a copy of its buffer, not a pass over 8k ints).
        routed: Sequence[int] = p.packed_prompt() + packed_prompt(self.output_ids) if self.router.uses_kv else prompt
        route = self.router.prepare(RouteRequest(routed, p.model.name, time.monotonic(), program_id=hints.program_id))
        body = GenerateRequest(p.request_id, prompt, p.sampling, num_output_tokens=len(self.output_ids)).to_dict()
        try:
            first = await self._place(route, body, {broken} if broken is not None else set())
        except ServiceUnavailableError:
            self.metrics.count_migration_failure("nowhere")
            raise
        self.metrics.count_migration("failover")
        item = self._accept(first)
        while item is None:  # the new worker's first chunk repeated tokens the client has (cannot happen today)
            item = await self.next_item()
        return item

    # --- the end ------------------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel the request on its worker if it still runs, and settle the router's bookkeeping. Idempotent."""
        await self._release()

    async def _release(self) -> None:
        """End the current attempt: close its stream (which cancels it on the worker) and report it finished."""
        stream, self.stream = self.stream, None
        try:
            if stream is not None:
                await stream.aclose()
        finally:
            if self._open:
                self._open = False
                self.router.on_finished(self.route_id)
