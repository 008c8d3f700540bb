"""The per-worker migration agent (Llumnix's llumlet): moves this worker's running requests to other workers, takes
theirs, and forwards aborts to wherever a request went.

Every client request the worker serves goes through ``MigrationAgent.serve`` (the worker's ``generate`` handler
wraps its engine stream in it), so the agent knows each request's stream (its ``RequestContext``: where its frames
go, and how many it sent) and can park it. Endpoints, on the worker's instance id:

- ``migrate`` (``MigrateRequest``): pick requests (``request_ids``, or the pure ``select_requests`` over the
  engine's request table) and move each to the destination, at most ``max_migration_concurrency`` at once; one
  ``MigrationReport`` per request.
- ``migrate_in`` (``MigrateInMessage``): the destination's half, one message per step (below).
- ``abort`` (``AbortRequest``): end a request here, or forward to the worker it was moved to.

One migration, source side (``states.py`` names the states):

1. ``pending``: a slot is taken (or the request waits for one, up to ``migration_call_timeout_s``).
2. ``pre_copying`` (live only): stage after stage, the whole KV blocks the request has now and the destination
   lacks are sent (``pre_alloc``, then ``copy``: the destination reserves blocks, sharing what its prefix cache
   holds, and the transfer takes ``engine.transfer_time_s`` while the request keeps decoding here) until at most
   ``migration_last_stage_max_blocks`` remain; not within ``migration_max_stages`` stages: aborted by source.
3. ``final_stage``: the engine suspends the request at its next step boundary; its stream delivers every token
   produced before and parks (``SuspendedChunk``), giving the agent the client's reply route and the frame number
   to continue at. The rest of the KV is sent (live) or none (recompute), then ``commit`` carries the request
   (``MigratingRequest``): the destination's engine takes it and its ``generate`` endpoint *adopts* the client's
   stream (components/runtime/request_plane.py, hand-over).
4. ``committed``: the parked stream says MOVED and ends; closing it frees the request's blocks here. The agent
   remembers where the request went (aborts and CANCELs are forwarded there).

Failures: the destination refuses (no room, at its cap, draining) or is gone (no responders): aborted by
destination, the request resumes here where it stopped, its client sees a pause and nothing else. The request ends
meanwhile (finished, aborted, its client left): aborted by source, the destination frees what it reserved. A commit
that gets no answer at all (the destination may or may not have taken it) cannot be resumed here without risking
two workers answering one stream: the request ends here with a recoverable error (the frontend re-issues it by
recompute from its position, components/frontend/dispatch.py) and the destination is told to abort.

Destination side: ``pre_alloc`` takes a slot and reserves blocks, ``copy`` reserves more, ``commit`` makes the
request run and adopts its stream, ``abort`` frees. A watchdog frees a reservation whose source has sent nothing
for ``pending_migrate_in_timeout_s``, or whose source no longer exists (its subject has no responders, checked
every ``migration_source_check_s``): a SIGKILLed source leaves nothing reserved behind.

Imports: the runtime, the protocol, and this package; never an engine (it is given one that implements
``engine.MigratableEngine``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from components.migration.config import MigrationConfig
from components.migration.engine import MigratableEngine, SuspendedChunk
from components.migration.errors import MigrationError
from components.migration.policies.selection import select_requests
from components.migration.states import Direction, Migration, MigrationState, MigrationTable
from components.migration.types import RequestTable
from components.protocol.endpoints import ENDPOINT_ABORT, ENDPOINT_GENERATE, ENDPOINT_MIGRATE, ENDPOINT_MIGRATE_IN
from components.protocol.errors import ErrorCode
from components.protocol.messages import FinishReason, GenerateRequest, TokenChunk
from components.protocol.migration import (
    AbortReply,
    AbortRequest,
    MigrateInMessage,
    MigrateInOp,
    MigrateInReply,
    MigrateRequest,
    MigrationCountersReport,
    MigrationMode,
    MigrationOutcomeCount,
    MigrationReport,
)
from components.runtime import (
    Client,
    InstanceDrainingError,
    InstanceGoneError,
    RecoverableError,
    RemoteHandlerError,
    RequestContext,
    Runtime,
    ServedEndpoint,
    probe_instance,
)

logger = logging.getLogger(__name__)

__all__ = ["MigrationAgent", "RequestAbortedError"]

# How many moved requests a worker remembers (to forward aborts), the oldest forgotten first.
FORWARD_MEMORY = 4096
# An abort is forwarded at most this many times (a request moved A -> B -> C ... ; more means a cycle).
MAX_ABORT_HOPS = 16

S = MigrationState


class RequestAbortedError(MigrationError):
    """The request was ended on purpose through the ``abort`` endpoint; it travels as ``aborted`` (never re-issued)."""

    wire_code = ErrorCode.ABORTED


class MigrationInterruptedError(MigrationError):
    """A commit got no answer: the request ends here and its client's frontend re-issues it elsewhere (recoverable,
    as an engine death is)."""

    wire_code = ErrorCode.ENGINE_DEAD


class _Refused(Exception):
    """The destination answered no (``MigrateInReply.ok`` False), or certainly never got the message."""


class _NoAnswer(Exception):
    """The destination did not answer in time: it may or may not have acted on the message."""


_ENDED = object()  # a park's result when the request's stream ended before parking (it finished meanwhile)


@dataclasses.dataclass(slots=True, eq=False)
class _Tracked:
    """One request served here (``serve``): its stream's context, how many outputs its client has, and the two
    futures of a final stage: ``park`` (the stream is parked: reply route and next frame number, or ``_ENDED``) and
    ``decision`` (where it went: (subject, instance id); None: resume here; an exception: end with it)."""

    request: GenerateRequest
    ctx: RequestContext
    position: int
    arrival_s: float
    num_cached_tokens: int = 0
    park: asyncio.Future[Any] | None = None
    decision: asyncio.Future[Any] | None = None
    abort_reason: str | None = None
    closed: bool = False


class MigrationAgent:
    """One worker's migration agent (module docstring). ``start`` serves its endpoints, ``serve`` wraps every
    request's stream, ``stop`` releases everything."""

    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        component: str,
        config: MigrationConfig,
        engine: MigratableEngine,
        instance_id: int,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.component = component
        self.config = config
        self.engine = engine
        self.instance_id = instance_id
        self.table = MigrationTable(config.max_migration_concurrency)
        self.generate_endpoint: ServedEndpoint | None = None  # set by the worker once it serves generate
        self.accepting = True  # False once the worker drains or its engine died: no migrate_in is taken
        self._tracked: dict[str, _Tracked] = {}
        self._forward: collections.OrderedDict[str, tuple[int, str]] = collections.OrderedDict()
        self._committed_in: collections.OrderedDict[str, str] = collections.OrderedDict()  # migration id -> request
        self._sources: dict[str, str] = {}  # incoming migration id -> its source's migrate_in subject
        self._reserved_in: set[str] = set()  # incoming migrations the engine reserved room for (pre_alloc)
        self._served: list[ServedEndpoint] = []
        self._clients: dict[tuple[str, str], Client] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._slot_freed = asyncio.Event()
        self._ids = itertools.count()
        self._subject = ""
        self.num_aborts_forwarded = 0
        self.num_uncertain_commits = 0

    # --- life -------------------------------------------------------------------------------------------------------

    async def start(self, metadata: dict[str, Any], lease: int) -> None:
        comp = self.runtime.namespace(self.namespace).component(self.component)
        for name, handler in (
            (ENDPOINT_MIGRATE_IN, self._migrate_in),
            (ENDPOINT_ABORT, self._abort),
            (ENDPOINT_MIGRATE, self._migrate),
        ):
            served = await comp.endpoint(name).serve(
                handler, metadata=metadata, lease=lease, instance_id=self.instance_id
            )
            self._served.append(served)
        self._subject = self._served[0].info.subject
        self._watchdog = self.runtime.supervisor.spawn(
            self._watch_incoming(), name=f"migration-watchdog:{self.instance_id:x}"
        )

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop taking migrations, let those under way end (bounded), free what is reserved for incoming ones."""
        self.accepting = False
        for served in reversed(self._served):
            with contextlib.suppress(Exception):
                await served.stop(drain_timeout_s=drain_timeout_s)
        self._served.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=drain_timeout_s)
        for t in tasks:
            t.cancel()
        for m in self.table.active:
            if m.direction == Direction.IN:
                self._release_in(m.migration_id)
                self._end(m, S.ABORTED_BY_DESTINATION, "the destination stopped")
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

    def counters(self) -> dict[str, int]:
        """Migrations by direction and outcome (``out_committed``, ``in_aborted_by_source``, ...), plus forwards."""
        out = self.table.counters()
        out["aborts_forwarded"] = self.num_aborts_forwarded
        out["uncertain_commits"] = self.num_uncertain_commits
        return out

    def counters_report(self, model: str, kv_pull_failures: int = 0) -> MigrationCountersReport:
        """The counters as the worker publishes them (``TOPIC_MIGRATION_COUNTERS``): by direction, outcome and the
        mode that ran; ``kv_pull_failures`` is the engine's (kv_transfer migrations taken whose pull failed)."""
        return MigrationCountersReport(
            model=model,
            mode=str(self.mode),
            outcomes=[MigrationOutcomeCount(*row) for row in self.table.outcome_counts()],
            kv_pull_failures=kv_pull_failures,
            aborts_forwarded=self.num_aborts_forwarded,
            uncertain_commits=self.num_uncertain_commits,
        )

    @property
    def mode(self) -> MigrationMode:
        """How this worker's engine moves requests; read from the engine each time (vLLM decides at start)."""
        return MigrationMode(str(self.engine.migration_mode))

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    # --- every request's stream ---------------------------------------------------------------------------------------

    async def serve(
        self, request: GenerateRequest, ctx: RequestContext, chunks: AsyncIterator[TokenChunk], num_cached: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """The worker's ``generate`` items for ``request``: its engine's chunks, parked and handed over when a
        migration's final stage asks (module docstring). Closing it closes ``chunks`` (which frees the request)."""
        rid = request.request_id
        t = _Tracked(request, ctx, request.num_output_tokens, time.time(), num_cached)
        self._tracked[rid] = t
        try:
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    if chunk.__class__ is SuspendedChunk:
                        if await self._parked(t):
                            return  # handed over: the destination answers the client from here on
                        continue
                    if chunk.finish_reason == FinishReason.ABORT and t.abort_reason is not None:
                        raise RequestAbortedError(f"request {rid} aborted: {t.abort_reason}")
                    if not t.position and chunk.token_ids:
                        t.num_cached_tokens = chunk.num_cached_tokens
                    t.position += len(chunk.token_ids)
                    yield chunk.to_dict()
        finally:
            t.closed = True
            if self._tracked.get(rid) is t:
                del self._tracked[rid]
            if t.park is not None and not t.park.done():
                t.park.set_result(_ENDED)  # a migration waiting for it to park: it ended first

    async def _parked(self, t: _Tracked) -> bool:
        """The request is suspended and every token before it delivered: tell the migration where the stream
        stands and wait for its decision. True: handed over (the handler ends)."""
        park, decision = t.park, t.decision
        if park is None or decision is None or park.done():
            # Suspended without a migration waiting (it gave up in the meantime): carry on here.
            self.engine.resume(t.request.request_id)
            return False
        park.set_result(t.ctx.reply_route())
        where = await decision
        t.park = t.decision = None
        if where is None:
            return False
        if isinstance(where, BaseException):
            raise where
        subject, instance_id = where
        t.ctx.hand_over(subject, instance_id)
        return True

    # --- migrate: the source side -----------------------------------------------------------------------------------

    async def _migrate(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        req = MigrateRequest.from_dict(body)
        if req.dst_instance_id == self.instance_id:
            raise MigrationError(f"worker {self.instance_id:x} cannot migrate requests to itself")
        mode = MigrationMode(req.mode) if req.mode else None  # None: the engine's own, per request (_mode_for)
        if mode is not None and mode != MigrationMode.RECOMPUTE and mode != self.mode:
            raise MigrationError(f"this worker's engine migrates by {self.mode} (or recompute), not {mode}")
        if req.request_ids:
            ids = list(req.request_ids)
            reason = f"{len(ids)} requests named"
        else:
            sel = select_requests(self._table_for_selection(), req.select_rule, req.select_value, req.select_order)
            ids, reason = list(sel.request_ids), sel.reason
        logger.info(
            "worker %x: migrating %d requests to %x (%s; trigger %s)",
            self.instance_id,
            len(ids),
            req.dst_instance_id,
            reason,
            req.trigger or "-",
        )
        component = req.dst_component or self.component
        # Owned by the agent, not by this handler: a caller that leaves must not cut a migration mid-stage.
        tasks = [
            self._spawn(self.migrate_one(rid, req.dst_instance_id, component, mode), f"migrate:{rid}") for rid in ids
        ]
        for next_done in asyncio.as_completed(tasks):
            report = await next_done
            yield report.to_dict()

    def _table_for_selection(self) -> RequestTable:
        table = self.engine.request_table()
        migrating = self.table.is_migrating

        def mark(views: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(dataclasses.replace(v, migrating=True) if migrating(v.request_id) else v for v in views)

        return RequestTable(mark(table.running), mark(table.waiting), table.kv_capacity_tokens)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def migrate_one(
        self, request_id: str, dst: int, component: str, mode: MigrationMode | None = None
    ) -> MigrationReport:
        """Move one request to worker ``dst`` (of ``component``) by ``mode`` (None: the engine's own, ``_mode_for``);
        the report says how it went. Never raises for a migration that failed: that is the report's ``state``."""
        loop = asyncio.get_running_loop()
        report = MigrationReport(request_id, str(S.ABORTED_BY_SOURCE), mode=str(mode or self.mode))
        report.src_instance_id, report.dst_instance_id = self.instance_id, dst
        t0 = loop.time()
        t = self._tracked.get(request_id)
        if t is None:
            report.reason = "not running here"
            return report
        if mode is None:
            mode = self._mode_for(t)
            report.mode = str(mode)
        if not await self._wait_for_slot(loop.time() + self.config.migration_call_timeout_s):
            report.reason = f"no migration slot within {self.config.migration_call_timeout_s:g} s"
            return report
        mid = f"{self.instance_id:x}-{next(self._ids)}"
        m = self.table.begin(mid, request_id, Direction.OUT, dst, loop.time())
        if m is None:
            report.reason = "already migrating"
            return report
        m.mode = str(mode)
        try:
            await self._run_out(m, t, component, mode)
        except asyncio.CancelledError:
            if not m.state.is_terminal and self.table.get(mid) is not None:
                await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, "the source agent stopped", False)
            raise
        except Exception as e:  # a bug: the request must not stay suspended, nor the destination's blocks reserved
            logger.exception("migration %s of %s failed", mid, request_id)
            if self.table.get(mid) is not None:
                await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, f"{type(e).__name__}: {e}", False)
        finally:
            self._slot_freed.set()
        report.state = str(m.state)
        report.mode = m.mode
        report.reason = m.reason
        report.num_stages = m.num_stages
        report.num_blocks_copied = m.num_blocks
        report.num_blocks_cached = m.num_cached_blocks
        report.position = t.position
        report.downtime_s = m.downtime_s
        report.duration_s = loop.time() - t0
        log = logger.info if m.state == S.COMMITTED else logger.warning
        log(
            "migration %s: %s %x -> %x %s (%s; %d stages, %d blocks copied, %d cached, downtime %.1f ms)",
            mid,
            request_id,
            self.instance_id,
            dst,
            m.state,
            m.reason or m.mode,
            m.num_stages,
            m.num_blocks,
            m.num_cached_blocks,
            m.downtime_s * 1e3,
        )
        return report

    def _mode_for(self, t: _Tracked) -> MigrationMode:
        """The engine's mode, except that a kv_transfer migration of a request shorter than
        ``migration_kv_transfer_min_tokens`` (prompt + outputs so far) goes by recompute: below some length the
        destination computes the tokens again sooner than a KV hand-off takes (measured in docs/migration.md)."""
        mode = self.mode
        if mode == MigrationMode.KV_TRANSFER and self.config.migration_kv_transfer_min_tokens:
            r = t.request
            if len(r.token_ids) - r.num_output_tokens + t.position < self.config.migration_kv_transfer_min_tokens:
                return MigrationMode.RECOMPUTE
        return mode

    async def _wait_for_slot(self, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        while not self.table.has_slot():
            self._slot_freed.clear()
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._slot_freed.wait()
        return True

    async def _run_out(self, m: Migration, t: _Tracked, component: str, mode: MigrationMode) -> None:
        """The source's stages (module docstring); leaves ``m`` in a terminal state."""
        cfg = self.config
        engine = self.engine
        loop = asyncio.get_running_loop()
        rid = m.request_id
        bs = engine.block_size
        live = mode == MigrationMode.LIVE
        kv = mode == MigrationMode.KV_TRANSFER
        sent = 0  # whole blocks the destination holds (shared from its cache, or sent)
        reserved = False
        if kv:
            # Room on the destination before the request is suspended (a refusal costs the client no pause); the
            # KV itself moves after the suspension (export, then the destination's engine pulls at the commit).
            kv = await self._reserve_for_pull(m, t, component)
            if m.state.is_terminal:
                return None
            reserved = True
        if live:
            final = False
            for stage in range(1, cfg.migration_max_stages + 1):
                if t.closed or t.abort_reason is not None:
                    return await self._settle_failure(
                        m, t, component, S.ABORTED_BY_SOURCE, "the request ended", reserved
                    )
                extent = engine.kv_extent(rid)
                if extent is None:
                    return await self._settle_failure(
                        m, t, component, S.ABORTED_BY_SOURCE, "the request ended", reserved
                    )
                new = extent.num_full_blocks - sent
                if new <= cfg.migration_last_stage_max_blocks:
                    final = True
                    break
                if m.state == S.PENDING:
                    self.table.advance(m.migration_id, S.PRE_COPYING, loop.time())
                tokens = extent.token_ids[sent * bs :]
                try:
                    to_copy = await self._send_blocks(m, component, tokens, reserved)
                    reserved = True
                    if to_copy:
                        await self._transfer(m, component, to_copy)
                except (_Refused, _NoAnswer) as e:
                    # Silence may hide a reservation made: tell the destination to free it either way.
                    told = reserved or isinstance(e, _NoAnswer)
                    return await self._settle_failure(m, t, component, S.ABORTED_BY_DESTINATION, str(e), told)
                m.num_blocks += to_copy
                m.num_stages = stage
                sent = extent.num_full_blocks
            if not final:
                return await self._settle_failure(
                    m,
                    t,
                    component,
                    S.ABORTED_BY_SOURCE,
                    f"did not converge to {cfg.migration_last_stage_max_blocks} blocks in {cfg.migration_max_stages} "
                    "stages",
                    reserved,
                )
        # --- final stage: suspend, the rest of the KV, commit -----------------------------------------------------
        if t.closed or t.abort_reason is not None:
            return await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, "the request ended", reserved)
        self.table.advance(m.migration_id, S.FINAL_STAGE, loop.time())
        m.num_stages += 1
        t.park = loop.create_future()
        t.decision = loop.create_future()
        if not engine.suspend(rid):
            t.park = t.decision = None
            return await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, "the request ended", reserved)
        try:
            async with asyncio.timeout(cfg.migration_call_timeout_s):
                parked = await asyncio.shield(t.park)
        except TimeoutError:
            parked = None
        if parked is None or parked is _ENDED:
            if parked is None:
                engine.resume(rid)
            self._decide(t, None)
            why = "the request ended" if parked is _ENDED else "its stream did not park in time"
            return await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, why, reserved)
        route, next_seq = parked
        state = engine.suspended_state(rid)
        if state is None:  # cannot happen: suspended requests keep their state until freed
            self._decide(t, None)
            return await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, "no state", reserved)
        if live:
            extent = engine.kv_extent(rid)
            assert extent is not None
            try:
                if not reserved:
                    to_copy = await self._send_blocks(m, component, extent.token_ids, reserved)
                    reserved = True
                    to_copy += extent.num_blocks - extent.num_full_blocks  # the partial last block
                else:
                    # The few blocks produced since the last stage: the commit reserves them on the destination (one
                    # round trip less while the request is suspended).
                    to_copy = extent.num_blocks - sent
                if to_copy:
                    await self._transfer(m, component, to_copy)
            except (_Refused, _NoAnswer) as e:
                engine.resume(rid)
                self._decide(t, None)
                told = reserved or isinstance(e, _NoAnswer)
                return await self._settle_failure(m, t, component, S.ABORTED_BY_DESTINATION, str(e), told)
            m.num_blocks += to_copy
        elif kv:
            await self._export(m, state)
        else:
            state.num_computed_tokens = 0
        state.reply = route
        state.next_seq = next_seq
        state.arrival_s = t.arrival_s
        state.num_cached_tokens = t.num_cached_tokens
        if t.abort_reason is not None:  # aborted while suspended: nothing to commit
            self._decide(t, None)
            await engine.abort(rid)
            return await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, "the request was aborted", reserved)
        commit = MigrateInMessage(
            MigrateInOp.COMMIT, m.migration_id, rid, self.instance_id, self._subject, request=state
        )
        try:
            reply = await self._call(component, m.peer_instance_id, commit)
        except _Refused as e:
            engine.resume(rid)
            self._decide(t, None)
            return await self._settle_failure(m, t, component, S.ABORTED_BY_DESTINATION, str(e), reserved)
        except _NoAnswer as e:
            # The destination may have taken it: resuming here could make two workers answer one stream. End it
            # here; the frontend re-issues it from its position.
            self.num_uncertain_commits += 1
            self._decide(t, MigrationInterruptedError(f"request {rid}: migration commit unanswered ({e})"))
            self._spawn(self._send_abort(component, m, "commit unanswered"), f"migration-abort:{m.migration_id}")
            self._end(m, S.ABORTED_BY_DESTINATION, f"commit unanswered: {e}")
            return None
        dst_subject = (
            self.runtime.namespace(self.namespace)
            .component(component)
            .endpoint(ENDPOINT_GENERATE)
            .subject_of(m.peer_instance_id)
        )
        if reply.mode:  # how the destination took it (recompute where it could not use the KV hand-off)
            m.mode = reply.mode
        self._remember_forward(rid, m.peer_instance_id, component)
        if t.closed or t.abort_reason is not None:
            # Its client left (or someone aborted it) while the commit was on its way: end it where it is now.
            self._decide(t, None)
            self._spawn(self._forward_abort(rid, t.abort_reason or "the client left", 0), f"abort-forward:{rid}")
        else:
            self._decide(t, (dst_subject, m.peer_instance_id))
        self._end(m, S.COMMITTED, "")
        return None

    async def _reserve_for_pull(self, m: Migration, t: _Tracked, component: str) -> bool:
        """kv_transfer: ``pre_alloc`` on the destination for the request's blocks as they are now. True: it will
        pull; False: it can only recompute (its answer's mode), and the migration goes on by recompute. A refusal
        or silence ends the migration here (``m`` terminal), before any suspension."""
        extent = self.engine.kv_extent(m.request_id)
        if extent is None or t.closed or t.abort_reason is not None:
            await self._settle_failure(m, t, component, S.ABORTED_BY_SOURCE, "the request ended", False)
            return False
        msg = MigrateInMessage(
            MigrateInOp.PRE_ALLOC,
            m.migration_id,
            m.request_id,
            self.instance_id,
            self._subject,
            token_ids=extent.token_ids,
        )
        try:
            reply = await self._call(component, m.peer_instance_id, msg)
        except (_Refused, _NoAnswer) as e:
            await self._settle_failure(m, t, component, S.ABORTED_BY_DESTINATION, str(e), isinstance(e, _NoAnswer))
            return False
        m.num_cached_blocks = reply.num_cached_blocks
        if reply.mode and reply.mode != MigrationMode.KV_TRANSFER:
            m.mode = str(MigrationMode.RECOMPUTE)
            return False
        return True

    async def _export(self, m: Migration, state: Any) -> None:
        """kv_transfer, suspended: the engine makes the request's KV pullable and names it in the commit's request
        (``kv_transfer_params``). Without a hand-off (the engine failed, or took longer than the call timeout) the
        commit goes without one and the destination computes the request again (counted as recompute)."""
        try:
            async with asyncio.timeout(self.config.migration_call_timeout_s):
                params = await self.engine.export_kv(m.request_id)
        except TimeoutError:
            params = None
        if not params:
            logger.warning(
                "migration %s of %s: no KV hand-off; the destination recomputes", m.migration_id, m.request_id
            )
            m.mode = str(MigrationMode.RECOMPUTE)
            state.num_computed_tokens = 0
            return
        state.kv_transfer_params = params
        n = len(state.all_token_ids)
        state.num_computed_tokens = n
        m.num_blocks = max(0, -(-n // self.engine.block_size) - m.num_cached_blocks)  # what the destination pulls

    async def _send_blocks(self, m: Migration, component: str, tokens: list[int], reserved: bool) -> int:
        """Ask the destination to reserve blocks for ``tokens`` (whole blocks); returns how many must be copied
        (those its prefix cache does not already hold)."""
        n = len(tokens) // self.engine.block_size
        op = MigrateInOp.COPY if reserved else MigrateInOp.PRE_ALLOC
        msg = MigrateInMessage(op, m.migration_id, m.request_id, self.instance_id, self._subject, token_ids=tokens)
        reply = await self._call(component, m.peer_instance_id, msg)
        if op == MigrateInOp.PRE_ALLOC:
            m.num_cached_blocks = reply.num_cached_blocks
            return n - reply.num_cached_blocks
        return n

    async def _transfer(self, m: Migration, component: str, num_blocks: int) -> None:
        """The KV of ``num_blocks`` blocks on its way: ``engine.transfer_time_s`` of them (0 where the engine moves
        real bytes itself). A transfer to a peer that dies fails, as an RDMA write to a dead NIC does: a long one
        checks every ``migration_source_check_s`` that the destination still exists (``_Refused`` if not)."""
        seconds = self.engine.transfer_time_s(num_blocks)
        if seconds <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        check_s = self.config.migration_source_check_s
        subject = ""
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(left, check_s))
            if loop.time() >= deadline:
                return
            if not subject:
                ep = self.runtime.namespace(self.namespace).component(component).endpoint(ENDPOINT_MIGRATE_IN)
                subject = ep.subject_of(m.peer_instance_id)
            if await probe_instance(self.runtime.bus, subject, self.runtime.config.probe_timeout_s) is False:
                raise _Refused("the destination died during the transfer")

    @staticmethod
    def _decide(t: _Tracked, decision: Any) -> None:
        if t.decision is not None and not t.decision.done():
            t.decision.set_result(decision)

    async def _settle_failure(
        self, m: Migration, t: _Tracked, component: str, state: MigrationState, reason: str, reserved: bool
    ) -> None:
        """End a migration that did not commit: the destination frees what it reserved (told, best effort), and the
        request, if it was parked, goes on here."""
        self._decide(t, None)
        if reserved:
            self._spawn(self._send_abort(component, m, reason), f"migration-abort:{m.migration_id}")
        self._end(m, state, reason)

    def _end(self, m: Migration, state: MigrationState, reason: str) -> None:
        if self.table.get(m.migration_id) is not None:
            self.table.advance(m.migration_id, state, asyncio.get_running_loop().time(), reason)
        self._slot_freed.set()

    async def _send_abort(self, component: str, m: Migration, reason: str) -> None:
        msg = MigrateInMessage(MigrateInOp.ABORT, m.migration_id, m.request_id, self.instance_id, self._subject)
        with contextlib.suppress(_Refused, _NoAnswer):
            await self._call(component, m.peer_instance_id, msg)

    async def _client(self, component: str, endpoint: str) -> Client:
        key = (component, endpoint)
        client = self._clients.get(key)
        if client is None:
            client = await self.runtime.namespace(self.namespace).component(component).endpoint(endpoint).client()
            self._clients[key] = client
        return client

    async def _call(self, component: str, dst: int, msg: MigrateInMessage) -> MigrateInReply:
        """One message to the destination's ``migrate_in`` and its reply. Raises ``_Refused`` for a "no" or a
        destination that certainly never got it (no responders, draining), ``_NoAnswer`` for silence."""
        client = await self._client(component, ENDPOINT_MIGRATE_IN)
        try:
            async with asyncio.timeout(self.config.migration_call_timeout_s):
                stream = await client.direct(msg.to_dict(), dst)
                async with stream:
                    async for item in stream:
                        reply = MigrateInReply.from_dict(item)
                        if not reply.ok:
                            raise _Refused(f"the destination refused {msg.op}: {reply.reason}")
                        return reply
        except TimeoutError:
            raise _NoAnswer(f"no answer to {msg.op} within {self.config.migration_call_timeout_s:g} s") from None
        except InstanceDrainingError:
            raise _Refused("the destination is draining") from None
        except InstanceGoneError as e:
            if "no responders" in str(e):
                raise _Refused(f"the destination is gone ({e})") from None
            raise _NoAnswer(str(e)) from None
        except RemoteHandlerError as e:
            raise _Refused(f"the destination failed {msg.op}: {e.message}") from None
        except RecoverableError as e:
            raise _NoAnswer(str(e)) from None
        raise _NoAnswer(f"the destination's answer to {msg.op} was empty")

    def _remember_forward(self, request_id: str, dst: int, component: str) -> None:
        self._forward[request_id] = (dst, component)
        self._forward.move_to_end(request_id)
        if len(self._forward) > FORWARD_MEMORY:
            self._forward.popitem(last=False)

    # --- migrate_in: the destination side ---------------------------------------------------------------------------

    async def _migrate_in(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        msg = MigrateInMessage.from_dict(body)
        yield self._handle_in(msg).to_dict()

    def _handle_in(self, msg: MigrateInMessage) -> MigrateInReply:
        now = asyncio.get_running_loop().time()
        mid = msg.migration_id
        if msg.op == MigrateInOp.ABORT:
            m = self.table.get(mid)
            if m is not None and m.direction == Direction.IN:
                self._release_in(mid)
                self._end(m, S.ABORTED_BY_SOURCE, "the source aborted")
            elif mid in self._committed_in:  # a commit whose answer the source never got: end what runs here
                rid = self._committed_in.pop(mid)
                t = self._tracked.get(rid)
                if t is not None:
                    t.abort_reason = "its migration's commit went unanswered"
                    self._spawn(self.engine.abort(rid), f"abort:{rid}")
            return MigrateInReply(True)
        if msg.op == MigrateInOp.PRE_ALLOC:
            if not self.accepting:
                return MigrateInReply(False, "this worker takes no new requests (draining or its engine died)")
            m = self.table.begin(mid, msg.request_id, Direction.IN, msg.src_instance_id, now)
            if m is None:
                return MigrateInReply(False, f"at capacity ({self.table.max_concurrent} migrations) or migrating")
            self._sources[mid] = msg.src_subject
            m.mode = str(self.mode)
            if self.mode == MigrationMode.RECOMPUTE:
                # An engine that takes no KV: a slot only; the source learns from the mode to send none.
                return MigrateInReply(True, mode=str(self.mode))
            try:
                cached = self.engine.reserve_migration(mid, msg.request_id, msg.token_ids)
            except Exception as e:  # noqa: BLE001 - the engine refused (dead, duplicate): the source is told why
                self._end(m, S.ABORTED_BY_DESTINATION, str(e))
                return MigrateInReply(False, str(e))
            if cached is None:
                n = len(msg.token_ids) // self.engine.block_size
                self._end(m, S.ABORTED_BY_DESTINATION, f"no room for {n} blocks")
                return MigrateInReply(False, f"no room for {n} blocks")
            self._reserved_in.add(mid)
            if self.mode == MigrationMode.LIVE:
                self.table.advance(mid, S.PRE_COPYING, now)
            m.num_cached_blocks = cached
            return MigrateInReply(True, num_cached_blocks=cached, mode=str(self.mode))
        if msg.op == MigrateInOp.COPY:
            m = self.table.get(mid)
            if m is None:
                return MigrateInReply(False, f"migration {mid} is not pending here (its reservation expired?)")
            self.table.touch(mid, now)
            if not self.engine.extend_migration(mid, msg.token_ids):
                self._release_in(mid)
                self._end(m, S.ABORTED_BY_DESTINATION, "no room for more blocks")
                return MigrateInReply(False, "no room for more blocks")
            m.num_stages += 1
            m.num_blocks += len(msg.token_ids) // self.engine.block_size
            return MigrateInReply(True)
        return self._commit_in(msg, now)

    def _commit_in(self, msg: MigrateInMessage, now: float) -> MigrateInReply:
        req = msg.request
        if req is None:
            return MigrateInReply(False, "a commit without its request")
        mid = msg.migration_id
        # With the room reserved for it (pre_alloc: live, kv_transfer); otherwise by recompute, which needs no KV.
        m = self.table.get(mid)
        if m is None:
            if req.num_computed_tokens:
                return MigrateInReply(False, f"migration {mid} has no blocks reserved here (expired?)")
            m = self.table.begin(mid, req.request_id, Direction.IN, msg.src_instance_id, now)
            if m is None:
                return MigrateInReply(False, f"at capacity ({self.table.max_concurrent} migrations) or migrating")
        reserved = mid in self._reserved_in
        self.table.advance(mid, S.FINAL_STAGE, now)
        served = self.generate_endpoint
        if not self.accepting or served is None:
            self._release_in(mid)
            self._end(m, S.ABORTED_BY_DESTINATION, "this worker takes no new requests")
            return MigrateInReply(False, "this worker takes no new requests (draining or its engine died)")
        try:
            chunks = self.engine.commit_migration(mid if reserved else None, req)
        except Exception as e:  # noqa: BLE001 - refused by the engine (no room, mismatch, dead): the source resumes
            self._release_in(mid)
            self._end(m, S.ABORTED_BY_DESTINATION, str(e))
            return MigrateInReply(False, str(e))
        self._reserved_in.discard(mid)  # the engine took what was reserved
        # The mode that ran: the engine clears a KV hand-off it could not use (it recomputes then).
        if req.kv_transfer_params:
            m.mode = str(MigrationMode.KV_TRANSFER)
        elif reserved and self.mode == MigrationMode.LIVE:
            m.mode = str(MigrationMode.LIVE)
        else:
            m.mode = str(MigrationMode.RECOMPUTE)
        request = GenerateRequest(req.request_id, req.all_token_ids, req.sampling, num_output_tokens=req.position)

        def handler(body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
            return self.serve(request, ctx, chunks, req.num_cached_tokens)

        try:
            served.adopt(handler, None, req.reply, req.next_seq)
        except (InstanceDrainingError, ValueError) as e:
            self._spawn(_aclose(chunks), f"release:{req.request_id}")  # frees the request in the engine
            self._end(m, S.ABORTED_BY_DESTINATION, str(e))
            return MigrateInReply(False, str(e))
        self._committed_in[mid] = req.request_id
        if len(self._committed_in) > FORWARD_MEMORY:
            self._committed_in.popitem(last=False)
        self._forward.pop(req.request_id, None)  # it runs here again
        self._sources.pop(mid, None)
        self._end(m, S.COMMITTED, "")
        return MigrateInReply(True, mode=m.mode)

    async def _watch_incoming(self) -> None:
        """Free reservations whose source went silent or away (module docstring)."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(cfg.migration_source_check_s)
            now = loop.time()
            for m in self.table.stalled(now, cfg.pending_migrate_in_timeout_s):
                self._drop_incoming(m, f"its source was silent for {cfg.pending_migrate_in_timeout_s:g} s")
            pending = [m for m in self.table.active if m.direction == Direction.IN and m.migration_id in self._sources]
            if not pending:
                continue
            answers = await asyncio.gather(
                *(
                    probe_instance(self.runtime.bus, self._sources[m.migration_id], self.runtime.config.probe_timeout_s)
                    for m in pending
                )
            )
            for m, alive in zip(pending, answers, strict=True):
                if alive is False and self.table.get(m.migration_id) is m:
                    self._drop_incoming(m, "its source is gone")

    def _drop_incoming(self, m: Migration, why: str) -> None:
        logger.warning(
            "worker %x: incoming migration %s of %s dropped: %s", self.instance_id, m.migration_id, m.request_id, why
        )
        self._release_in(m.migration_id)
        self._sources.pop(m.migration_id, None)
        self._end(m, S.ABORTED_BY_SOURCE, why)

    def _release_in(self, migration_id: str) -> None:
        """Free what the engine reserved for an incoming migration (nothing for a slot-only one)."""
        if migration_id in self._reserved_in:
            self._reserved_in.discard(migration_id)
            self.engine.cancel_migration(migration_id)

    # --- abort ------------------------------------------------------------------------------------------------------

    async def _abort(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        req = AbortRequest.from_dict(body)
        yield (await self.abort(req.request_id, req.reason or "aborted", req.hops)).to_dict()

    async def abort(self, request_id: str, reason: str, hops: int = 0) -> AbortReply:
        """End ``request_id`` here, or where it was moved to (forwarded); ``aborted`` False if neither knows it."""
        t = self._tracked.get(request_id)
        if t is not None:
            t.abort_reason = reason
            if t.decision is None or t.decision.done():  # not parked by a final stage (that one sees the reason)
                await self.engine.abort(request_id)
            return AbortReply(True, self.instance_id)
        if request_id in self._forward:
            return await self._forward_abort(request_id, reason, hops)
        return AbortReply(False, self.instance_id, "no such request here")

    async def _forward_abort(self, request_id: str, reason: str, hops: int) -> AbortReply:
        where = self._forward.get(request_id)
        if where is None:
            return AbortReply(False, self.instance_id, "no such request here")
        if hops >= MAX_ABORT_HOPS:
            return AbortReply(False, self.instance_id, f"forwarded {hops} times: giving up (a cycle?)")
        dst, component = where
        self.num_aborts_forwarded += 1
        client = await self._client(component, ENDPOINT_ABORT)
        try:
            async with asyncio.timeout(self.config.migration_call_timeout_s):
                stream = await client.direct(AbortRequest(request_id, reason, hops + 1).to_dict(), dst)
                async with stream:
                    async for item in stream:
                        return AbortReply.from_dict(item)
        except (TimeoutError, RecoverableError, RemoteHandlerError) as e:
            return AbortReply(False, dst, f"forwarding to {dst:x} failed: {e}")
        return AbortReply(False, dst, "no answer")


async def _aclose(chunks: AsyncIterator[TokenChunk]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
