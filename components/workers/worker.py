"""One worker: an engine served on the mesh under its own lease.

Serves ``generate`` and ``kv_state`` (same instance id, so a router can ask the worker whose events it follows),
publishes a ``LoadSnapshot`` every ``metrics_interval_ms`` and KV events in batches every ``kv_events_batch_ms``.
``stop()`` says it takes no new requests (``worker_status``), refuses new ones (a frontend that has not heard yet
retries elsewhere), lets the requests in flight finish (up to ``drain_timeout_s``), deregisters, then revokes the
lease and shuts the engine down.

Every ``engine_check_interval_ms`` it asks the engine whether it died (``Engine.dead_reason``: vLLM's engine-core
process exited, a simulated engine's ``fail_after_s`` fault); a dead engine's worker stops itself, so it leaves the
fleet within a check interval instead of failing every request routed to it until the lease expires, and sets
``dead`` (``kvmesh worker`` exits 1 once all its workers are dead, for its supervisor to start a fresh one).

Migration (components/migration/agent.py): a worker whose engine can move requests (``supports_migration``: the
simulated engine live, vLLM by kv_transfer or recompute) runs a ``MigrationAgent``: every request's stream goes
through it, and it serves ``migrate``, ``migrate_in`` and ``abort`` on the worker's instance id; ``migration_mode``
in the metadata says how, and its counters (by direction, outcome and the mode that ran) go out on
``migration_counters`` whenever they change and every ``MIGRATION_COUNTERS_REPEAT_S`` (the frontend exports them).
When the engine dies, or on ``stop()``, the worker first says on the event plane that it takes no new requests
(``WorkerStatus`` on ``worker_status``, repeated every ``metrics_interval_ms`` while it is registered), so routers
stop choosing it at once; its ``generate`` registration stays until its requests are gone (drained, or moved off by
the rescheduler), then goes.

Roles (``WorkerConfig.role``; components/workers/disagg.py has the protocol): an aggregated worker is the above. A
decode worker also serves ``prefill_result`` (where prefill workers deliver) and prefills long prompts remotely
through the model's prefill queue. A prefill worker serves ``kv_state`` but no ``generate`` (its work comes from the
prefill queue only) and publishes the queue's state; on ``stop()`` it first finishes and acks the item in hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from components.migration.agent import MigrationAgent
from components.migration.engine import MigratableEngine, supports_migration
from components.perf.profile import Profile
from components.protocol.endpoints import (
    ENDPOINT_DROP_PREFIX,
    ENDPOINT_EXPORT_PREFIX,
    ENDPOINT_GENERATE,
    ENDPOINT_IMPORT_PREFIX,
    ENDPOINT_KV_STATE,
    ENDPOINT_PREFILL_RESULT,
    TOPIC_KV_EVENTS,
    TOPIC_LOAD_METRICS,
    TOPIC_MIGRATION_COUNTERS,
    TOPIC_WORKER_STATUS,
)
from components.protocol.kv_hashing import HASH_SCHEME_VERSION
from components.protocol.messages import GenerateRequest, KvEvent
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.protocol.migration import DRAINING_REASON, WorkerStatus
from components.runtime import RequestContext, Runtime, ServedEndpoint
from components.workers.config import WorkerConfig
from components.workers.disagg import PrefillLoop, RemotePrefiller, supports_remote_decode
from components.workers.engines.base import Engine, remote_prefill_mode_of
from components.workers.replication import PrefixImporter, can_import, can_pull, prefix_copy_mode

logger = logging.getLogger(__name__)

# Migration counters go out when they changed (checked every metrics interval) and at least this often otherwise, so
# a frontend that starts later hears them within it.
MIGRATION_COUNTERS_REPEAT_S = 10.0


class Worker:
    def __init__(
        self, runtime: Runtime, config: WorkerConfig, engine: Engine, index: int = 0, profile: Profile | None = None
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.engine = engine
        self.index = index
        # A measured profile of this engine (``--profile``): announced instead of the engine's own step-time model.
        self.profile = profile
        self.instance_id = secrets.randbits(63)
        self.lease = 0
        self._served: list[ServedEndpoint] = []
        self._importer: PrefixImporter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending_events: list[KvEvent] = []
        self._events_ready = asyncio.Event()
        self.num_kv_batches_published = 0
        self.started_at = 0.0  # set when it registers
        # Set once the engine died and this worker left the fleet (``dead_reason`` says why).
        self.dead = asyncio.Event()
        self.dead_reason: str | None = None
        self._stop_task: asyncio.Task[int] | None = None
        # Disaggregated serving (components/workers/disagg.py): a decode worker's remote prefills, a prefill
        # worker's queue loop; neither on an aggregated worker.
        self.remote: RemotePrefiller | None = None
        self.prefill_loop: PrefillLoop | None = None
        engine_role = getattr(engine, "role", None)
        if engine_role is not None and engine_role != config.role:
            # An engine built for another role would set up the wrong KV connector (a prefill engine keeps KV for
            # pulls, a decode engine pulls): refused rather than announcing a mode the engine cannot keep.
            raise ValueError(f"a {config.role} worker got an engine built for role {engine_role}")
        if config.role == WorkerRole.DECODE:
            if not supports_remote_decode(engine):
                raise ValueError(f"engine {config.engine} cannot decode remotely prefilled prompts (role decode)")
            self.remote = RemotePrefiller(runtime, config, engine, self.instance_id)
        elif config.role == WorkerRole.PREFILL:
            self.prefill_loop = PrefillLoop(runtime, config, engine, self.instance_id)
        # Migration: a prefill worker serves no client stream, so it has nothing to move.
        self.agent: MigrationAgent | None = None
        if config.role != WorkerRole.PREFILL and supports_migration(engine):
            migratable = cast(MigratableEngine, engine)  # supports_migration checked the protocol
            self.agent = MigrationAgent(
                runtime, config.namespace, config.component, config, migratable, self.instance_id
            )
        # Set when it stops taking new requests (its engine died, it drains): why, for the worker_status topic.
        self.unschedulable_reason: str | None = None
        # A fault for tests: True stops the load reports (a hung publisher, a worker cut off from the event plane)
        # while the worker goes on serving; the fleet view then calls it stale (components/fleet/rules.py) and the
        # rescheduler's failover moves its requests off (tests/integration/test_rescheduler.py).
        self.load_reports_paused = False
        self._generate_served: ServedEndpoint | None = None
        self._counters_sent: dict[str, Any] | None = None
        self._counters_sent_s = 0.0

    @property
    def metadata(self) -> dict[str, Any]:
        return WorkerMetadata(
            model=self.config.model,
            model_path=self.config.model_path,
            role=self.config.role,
            remote_prefill_mode=remote_prefill_mode_of(self.engine, self.config.role),
            engine=str(self.config.engine),
            block_size=self.engine.block_size,
            # How its KV events hash blocks: a router ignores the events of a worker hashing differently.
            kv_hash_scheme=HASH_SCHEME_VERSION,
            max_model_len=self.engine.max_model_len,
            # On Kubernetes the node is the machine the pod runs on and the pod is the process's own (the downward
            # API's spec.nodeName and metadata.name); elsewhere the host name, and no pod.
            node=os.environ.get("KVMESH_NODE_NAME") or socket.gethostname(),
            pod=os.environ.get("KVMESH_POD_NAME", ""),
            pid=os.getpid(),
            unit=self.index,
            # Wall-clock registration time, so `kvmesh status` can show an instance's age from etcd alone.
            started_at=self.started_at,
            # The step-time model: the measured profile's fit where the worker runs with one, else the engine's own
            # where it knows one (the mock engine's configured coefficients).
            step_time=self.profile.step_time()
            if self.profile is not None
            else dict(getattr(self.engine, "step_time", None) or {}),
            profile_id="" if self.profile is None else self.profile.profile_id,
            migration_mode="" if self.agent is None else str(self.agent.mode),
            # A prefill worker serves no import_prefix (a copy makes a holder only where requests are routed).
            prefix_copy_mode="" if self.prefill_loop is not None else prefix_copy_mode(self.engine),
        ).to_dict()

    async def start(self) -> None:
        await self.engine.start()
        self.lease = await self.runtime.create_lease()
        comp = self.runtime.namespace(self.config.namespace).component(self.config.component)
        if self.prefill_loop is not None:
            # Pulling before it registers: a registered prefill worker is one that takes work.
            await self.prefill_loop.start()
        self.started_at = time.time()
        meta = self.metadata
        # kv_state first: once generate is discoverable, a router may ask for the KV state at once.
        self._served.append(
            await comp.endpoint(ENDPOINT_KV_STATE).serve(
                self._kv_state, metadata=meta, lease=self.lease, instance_id=self.instance_id
            )
        )
        if self.prefill_loop is None and (can_import(self.engine) or can_pull(self.engine)):
            # Hot-prefix replication's destination side (workers/replication.py): a copy makes this worker a holder
            # routers can send the prefix to, so only a worker that takes requests serves it.
            self._importer = PrefixImporter(
                self.runtime, self.config.namespace, self.config.component, self.engine, self.instance_id
            )
            self._served.append(
                await comp.endpoint(ENDPOINT_IMPORT_PREFIX).serve(
                    self._importer.handle, metadata=meta, lease=self.lease, instance_id=self.instance_id
                )
            )
            self._served.append(
                await comp.endpoint(ENDPOINT_DROP_PREFIX).serve(
                    self._importer.handle_drop, metadata=meta, lease=self.lease, instance_id=self.instance_id
                )
            )
            if can_pull(self.engine):
                # The source side of a pulled copy (vLLM): keep a cached prefix's blocks for another worker's pull.
                self._served.append(
                    await comp.endpoint(ENDPOINT_EXPORT_PREFIX).serve(
                        self._importer.handle_export, metadata=meta, lease=self.lease, instance_id=self.instance_id
                    )
                )
        if self.remote is not None:
            # Before generate (and stopped after it): a remote prefill's result must find its way back while the
            # requests waiting for it drain.
            await self.remote.start()
            self._served.append(
                await comp.endpoint(ENDPOINT_PREFILL_RESULT).serve(
                    self._prefill_result, metadata=meta, lease=self.lease, instance_id=self.instance_id
                )
            )
        if self.agent is not None:
            # Before generate: a worker a router can send requests to can also take them by migration.
            await self.agent.start(meta, self.lease)
        if self.prefill_loop is None:
            # A prefill worker takes its work from the prefill queue only: no client or router can send it any.
            self._generate_served = await comp.endpoint(ENDPOINT_GENERATE).serve(
                self._generate, metadata=meta, lease=self.lease, instance_id=self.instance_id
            )
            self._served.append(self._generate_served)
            if self.agent is not None:
                self.agent.generate_endpoint = self._generate_served
        sup = self.runtime.supervisor
        self._tasks = [
            sup.spawn(self._publish_metrics(), name=f"metrics:{self.instance_id:x}"),
            sup.spawn(self._collect_kv_events(), name=f"kv-collect:{self.instance_id:x}"),
            sup.spawn(self._publish_kv_events(), name=f"kv-publish:{self.instance_id:x}"),
            sup.spawn(self._watch_engine(), name=f"engine-watch:{self.instance_id:x}"),
        ]

    async def _watch_engine(self) -> None:
        """Leave the fleet when the engine dies: a dead engine's worker would otherwise stay discoverable and fail
        every request a router sends it until its process is restarted."""
        interval_s = self.config.engine_check_interval_ms / 1000
        while True:
            reason = self.engine.dead_reason()
            if reason is not None:
                break
            await asyncio.sleep(interval_s)
        logger.error("worker %x: %s; leaving the fleet", self.instance_id, reason)
        self.dead_reason = reason
        self.dead.set()
        await self._stop_scheduling(f"its engine died: {reason}")
        self._tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        await self.stop()

    async def _generate(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        request = GenerateRequest.from_dict(body)
        if self.remote is not None and (await self.remote.decide(request)).remote:
            stream = self.remote.generate(request)
        else:
            stream = self.engine.generate(request)
        if self.agent is not None:
            # Through the agent: it can park and hand the stream over mid-way (components/migration/agent.py).
            async with contextlib.aclosing(self.agent.serve(request, ctx, stream)) as items:  # type: ignore[type-var]
                async for item in items:
                    yield item
            return
        async with contextlib.aclosing(stream) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                yield chunk.to_dict()

    async def _stop_scheduling(self, reason: str) -> None:
        """Say, once, that this worker takes no new requests (routers stop choosing it at once), and refuse
        incoming migrations; the metrics loop repeats the status while the worker is registered."""
        if self.unschedulable_reason is not None:
            return
        self.unschedulable_reason = reason
        if self.agent is not None:
            self.agent.accepting = False
        await self._publish_status()

    async def _publish_status(self) -> None:
        if self.unschedulable_reason is None:
            return
        n = self._generate_served.server.num_inflight if self._generate_served is not None else 0
        status = WorkerStatus(False, self.unschedulable_reason, n)
        try:
            await self.runtime.namespace(self.config.namespace).events.publish(
                TOPIC_WORKER_STATUS, status.to_dict(), source_id=self.instance_id
            )
        except Exception as e:  # noqa: BLE001 - NATS reconnecting: the next interval repeats it
            logger.debug("publishing worker status: %s", e)

    async def _prefill_result(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        assert self.remote is not None
        yield {"accepted": self.remote.accept(body)}

    async def _kv_state(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        yield self.engine.kv_state().to_dict()

    async def _publish_metrics(self) -> None:
        events = self.runtime.namespace(self.config.namespace).events
        interval_s = self.config.metrics_interval_ms / 1000
        while True:
            try:
                if not self.load_reports_paused:
                    snapshot = self.engine.snapshot().to_dict()
                    await events.publish(TOPIC_LOAD_METRICS, snapshot, source_id=self.instance_id)
            except Exception as e:  # noqa: BLE001 - NATS reconnecting: skip this sample, the next one follows
                logger.debug("publishing load metrics: %s", e)
            if self.unschedulable_reason is not None:
                await self._publish_status()  # a router that started since hears it too
            if self.agent is not None:
                await self._publish_migration_counters()
            await asyncio.sleep(interval_s)

    def migration_counters(self) -> dict[str, Any] | None:
        """This worker's ``MigrationCountersReport`` as published (None without a migration agent). An engine that
        pulls KV (vLLM) counts the migrations it took whose pull failed in ``migrations_in.pull_failed``."""
        if self.agent is None:
            return None
        pull_failed = int(getattr(getattr(self.engine, "migrations_in", None), "pull_failed", 0))
        return self.agent.counters_report(self.config.model, kv_pull_failures=pull_failed).to_dict()

    async def _publish_migration_counters(self) -> None:
        """``TOPIC_MIGRATION_COUNTERS``: when they changed, and every ``MIGRATION_COUNTERS_REPEAT_S`` regardless."""
        report = self.migration_counters()
        now = time.monotonic()
        if report is None or (
            report == self._counters_sent and now - self._counters_sent_s < MIGRATION_COUNTERS_REPEAT_S
        ):
            return
        try:
            await self.runtime.namespace(self.config.namespace).events.publish(
                TOPIC_MIGRATION_COUNTERS, report, source_id=self.instance_id
            )
        except Exception as e:  # noqa: BLE001 - NATS reconnecting: the next interval tries again
            logger.debug("publishing migration counters: %s", e)
            return
        self._counters_sent, self._counters_sent_s = report, now

    async def _collect_kv_events(self) -> None:
        async for batch in self.engine.kv_events():
            self._pending_events.extend(batch)
            self._events_ready.set()

    async def _publish_kv_events(self) -> None:
        events = self.runtime.namespace(self.config.namespace).events
        batch_s = self.config.kv_events_batch_ms / 1000
        while True:
            await self._events_ready.wait()
            if batch_s:
                await asyncio.sleep(batch_s)
            self._events_ready.clear()
            batch, self._pending_events = self._pending_events, []
            if batch:
                await events.publish(TOPIC_KV_EVENTS, [e.to_dict() for e in batch], source_id=self.instance_id)
                self.num_kv_batches_published += 1

    async def stop(self) -> int:
        """Drain and leave; returns how many requests had to be cancelled after ``drain_timeout_s``. A second call
        (SIGTERM while a dead engine's worker is leaving) waits for the first."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop())
        return await asyncio.shield(self._stop_task)

    async def _stop(self) -> int:
        cancelled = 0
        if self.prefill_loop is not None:
            # No more pops; the item in hand is prefilled, delivered and acked first (queued ones stay queued).
            await self.prefill_loop.stop()
        await self._stop_scheduling(self.unschedulable_reason or DRAINING_REASON)
        if self._generate_served is not None:
            # Refuse new requests and let those in flight finish while still registered (the rescheduler may move
            # them off meanwhile); only then deregister.
            try:
                cancelled += await self._generate_served.server.drain(self.config.drain_timeout_s)
            except Exception as e:  # noqa: BLE001 - keep releasing the rest
                logger.warning("draining %s: %s", self._generate_served.info.subject, e)
        # generate last in the list: stop it first so routing stops, then kv_state.
        for served in reversed(self._served):
            try:
                cancelled += await served.stop(drain_timeout_s=self.config.drain_timeout_s)
            except Exception as e:  # noqa: BLE001 - keep releasing the rest
                logger.warning("stopping %s: %s", served.info.subject, e)
        if self.remote is not None:
            await self.remote.stop()
        if self._importer is not None:
            try:
                await self._importer.close()
            except Exception as e:  # noqa: BLE001 - keep releasing the rest
                logger.warning("closing the prefix importer: %s", e)
        if self.agent is not None:
            await self.agent.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        try:
            await self.runtime.discovery.revoke_lease(self.lease)
        except Exception as e:  # noqa: BLE001
            logger.warning("revoking lease of worker %x: %s", self.instance_id, e)
        try:
            await self.engine.shutdown()
        except Exception as e:  # noqa: BLE001
            logger.warning("engine shutdown of worker %x: %s", self.instance_id, e)
        return cancelled
