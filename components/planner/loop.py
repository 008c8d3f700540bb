"""``Planner``: the planner's adapter. It does all of the planner's I/O around the pure policy (policy.py):

- every ``metric_pulling_interval`` it builds an ``Observation`` and calls ``decide``:
  * pools from discovery: the decode pool is every ``generate`` instance of the served model whose role is decode
    or aggregated; the prefill pool is every instance of the model whose role is prefill (a prefill worker serves
    only ``kv_state``). Read with one etcd listing per pull (``Namespace.list_instances``) rather than a watch per
    component: the planner does not know which components a graph put its workers under, and one listing a second
    is nothing to etcd;
  * a deployment is disaggregated (``Observation.prefill`` is not None) when any worker of the model is a prefill
    or decode worker; otherwise its aggregated workers are the decode pool;
  * loads: the latest ``LoadSnapshot`` (``load_metrics`` topic) of each decode-pool worker, stamped with the
    planner's receive time (the policy leaves out those older than 3 pulls);
  * queue: the freshest ``PrefillQueueReport`` (``prefill_queue`` topic) for the model that read the queue;
  * changes in progress: a pool whose ``Connector.set_pool_size`` has not returned counts the difference asked for
    as ``starting`` (or ``leaving``), which pauses the policy's intervals (connectors/base.py);
  * GPUs per worker: ``Connector.gpus_per_worker`` (the local connector: the graph group's gpus_per_replica, from
    the state file), else the config's ``*_engine_num_gpu``;
- applies each ``Adjustment`` (``apply``): one named task per pool change, through the connector; a failed change is
  logged and the next interval decides again;
- logs one INFO line per adjustment with its reasons, writes TensorBoard scalars at every pull and adjustment and
  each decision as text (``PlannerBoard``, with ``--log-dir``), keeps the same figures and counters of decisions for
  Prometheus (``metrics.PlannerMetrics``, served on ``GET /metrics`` when a metrics host is given), keeps
  ``last_decision`` and puts the planner's status (``status_payload``: pool sizes, the last decision with its
  reasons, changes in progress, the last failed change, the metrics URL), as JSON, at
  ``kvmesh/<ns>/planner/status/<model>`` under the planner's lease for ``kvmesh status``: at start, at every
  adjustment and when a change starts or ends.

The wire-to-policy conversions (``fleet_from_instances``, ``pool_view``, ``queue_reading``, ``build_observation``,
``request_totals``) are pure functions with unit tests (tests/unit/planner/test_loop.py).

Owns: its two subscriptions, its tasks (``planner-*``, in the runtime's supervisor), the connector and the
TensorBoard writer, all released by ``stop()``, each in its own try.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from components.planner.config import PlannerConfig
from components.planner.connectors.base import Connector, ConnectorError
from components.planner.metrics import MetricsServer, PlannerMetrics
from components.planner.policy import (
    STALE_AFTER_PULLS,
    Adjustment,
    Direction,
    Observation,
    PlannerState,
    Pool,
    PoolView,
    PullFigures,
    QueueReading,
    WorkerLoad,
    decide,
    pull_figures,
)
from components.planner.status import status_key
from components.protocol.endpoints import ENDPOINT_GENERATE, TOPIC_LOAD_METRICS, TOPIC_PREFILL_QUEUE
from components.protocol.messages import LoadSnapshot, PrefillQueueReport
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.runtime import EventSubscription, InstanceInfo, Runtime
from components.runtime.errors import ConnectError, RuntimeMeshError

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# Pure: wire types -> the policy's observation


@dataclasses.dataclass(frozen=True, slots=True)
class Fleet:
    """The model's workers as discovery lists them now."""

    decode: frozenset[int]  # decode or aggregated workers (instance ids)
    prefill: frozenset[int]
    disaggregated: bool  # any prefill or decode worker: the prefill pool exists (maybe empty)


def fleet_from_instances(instances: Iterable[InstanceInfo], model: str) -> Fleet:
    """Group one discovery listing into pools. A worker registers once per endpoint it serves: counted once."""
    decode: set[int] = set()
    prefill: set[int] = set()
    disaggregated = False
    for info in instances:
        meta = WorkerMetadata.from_dict(info.metadata)
        if meta.model != model:
            continue
        if meta.role == WorkerRole.PREFILL:
            prefill.add(info.instance_id)
            disaggregated = True
        elif info.endpoint == ENDPOINT_GENERATE:
            decode.add(info.instance_id)
            disaggregated = disaggregated or meta.role == WorkerRole.DECODE
    return Fleet(frozenset(decode), frozenset(prefill), disaggregated)


@dataclasses.dataclass(frozen=True, slots=True)
class PendingChange:
    """A ``set_pool_size`` that has not returned: the pool had ``before`` workers when ``target`` was asked for."""

    before: int
    target: int


def pool_view(workers: int, pending: PendingChange | None) -> PoolView:
    """A pool as the policy sees it: registered workers, and the change asked for that has not finished (at least
    one starting or leaving while it runs, even when discovery already shows the new count: the connector has not
    said it is done)."""
    if pending is None or pending.target == pending.before:
        return PoolView(workers=workers)
    if pending.target > pending.before:
        return PoolView(workers=workers, starting=max(1, pending.target - workers))
    return PoolView(workers=workers, leaving=max(1, workers - pending.target))


def queue_reading(reports: Mapping[int, tuple[PrefillQueueReport, float]], model: str) -> QueueReading | None:
    """The freshest report of ``model``'s prefill queue (every prefill worker reports the same queue), leaving out
    reports whose worker could not read the queue (``stats_error``: their counts are 0, not a measurement)."""
    best: tuple[PrefillQueueReport, float] | None = None
    for report, received_s in reports.values():
        if report.model != model or report.stats_error:
            continue
        if best is None or received_s > best[1]:
            best = (report, received_s)
    if best is None:
        return None
    return QueueReading(waiting=best[0].waiting, in_flight=best[0].in_flight, received_s=best[1])


def build_observation(
    now_s: float,
    fleet: Fleet,
    loads: Mapping[int, tuple[LoadSnapshot, float]],
    queue: QueueReading | None,
    pending: Mapping[Pool, PendingChange],
    gpus_per_worker: Mapping[Pool, int | None] | None = None,
) -> Observation:
    """One pull's ``Observation``: ``loads`` maps an instance id to its latest snapshot and the planner-clock time
    it arrived; only the decode pool's workers count (a prefill worker's KV use is not the decode pool's).
    ``gpus_per_worker``: what the deployment says a pool's worker uses (None or absent: the config's figure)."""
    worker_loads = tuple(
        WorkerLoad(worker_id=iid, kv_usage=snap.kv_usage, received_s=received_s)
        for iid, (snap, received_s) in sorted(loads.items())
        if iid in fleet.decode
    )
    gpus = gpus_per_worker or {}

    def view(pool: Pool, workers: int) -> PoolView:
        return dataclasses.replace(pool_view(workers, pending.get(pool)), gpus_per_worker=gpus.get(pool))

    prefill = view(Pool.PREFILL, len(fleet.prefill)) if fleet.disaggregated else None
    return Observation(
        now_s=now_s,
        decode=view(Pool.DECODE, len(fleet.decode)),
        prefill=prefill,
        loads=worker_loads,
        queue=queue if fleet.disaggregated else None,
    )


def request_totals(
    loads: Mapping[int, tuple[LoadSnapshot, float]], fleet: Fleet, now_s: float, config: PlannerConfig
) -> tuple[int, int]:
    """(running, waiting) requests over the decode pool's workers with a fresh snapshot, by the policy's rule."""
    oldest_s = now_s - STALE_AFTER_PULLS * config.metric_pulling_interval
    fresh = [snap for iid, (snap, received_s) in loads.items() if iid in fleet.decode and received_s >= oldest_s]
    return sum(s.num_running for s in fresh), sum(s.num_waiting for s in fresh)


def adjustment_to_dict(adj: Adjustment) -> dict[str, Any]:
    """An adjustment as JSON-able data (the status key, logs)."""
    return {
        "now_s": adj.now_s,
        "no_operation": adj.no_operation,
        "gpus_before": adj.gpus_before,
        "gpus_after": adj.gpus_after,
        "note": adj.note,
        "decisions": [
            {
                "pool": str(d.pool),
                "direction": str(d.direction),
                "current": d.current,
                "target": d.target,
                "reason": d.reason,
                "summary": d.summary(),
                "metrics": {k: v for k, v in d.metrics.items() if math.isfinite(v)},
            }
            for d in adj.decisions
        ],
    }


def status_payload(
    *,
    model: str,
    connector: str,
    walltime: float,
    no_operation: bool,
    observation: Observation | None,
    adjustment: Adjustment | None,
    adjustment_walltime: float | None,
    pending: Mapping[Pool, PendingChange],
    changes_applied: int,
    change_failures: int,
    last_change_error: str,
    metrics_url: str,
) -> dict[str, Any]:
    """What ``kvmesh status`` reads at ``status_key``: JSON-ready. ``pools`` are the workers registered at the last
    pull (prefill None for an aggregated deployment); ``last_decision`` is ``adjustment_to_dict`` plus its wall-clock
    time, None before the first adjustment."""
    pools: dict[str, int | None] | None = None
    if observation is not None:
        pools = {
            str(Pool.DECODE): observation.decode.workers,
            str(Pool.PREFILL): None if observation.prefill is None else observation.prefill.workers,
        }
    last = None
    if adjustment is not None:
        last = adjustment_to_dict(adjustment) | {"walltime": adjustment_walltime}
    return {
        "model": model,
        "connector": connector,
        "walltime": walltime,
        "no_operation": no_operation,
        "pools": pools,
        "last_decision": last,
        "changes_in_progress": {str(p): {"from": c.before, "to": c.target} for p, c in sorted(pending.items())},
        "changes_applied": changes_applied,
        "change_failures": change_failures,
        "last_change_error": last_change_error,
        "metrics_url": metrics_url,
    }


# --------------------------------------------------------------------------------------------------------------------
# TensorBoard


class PlannerBoard:
    """TensorBoard scalars and text for ``tensorboard --logdir DIR``. Tags:

    ``pull/*`` at every pull (step = pull number): kv_usage, prefill_queue_size, prefill_queue_utilisation (absent
    when unknown), running_requests, waiting_requests, decode_workers, prefill_workers, gpus;
    ``adjustment/*`` at every adjustment (same step): the interval's kv_usage, prefill_queue_size and
    prefill_queue_utilisation (when the interval had samples), decode_workers/prefill_workers (the targets), gpus
    (after the decisions), and ``adjustment/decisions`` as text, one line per pool with its reason.
    """

    def __init__(self, log_dir: str) -> None:
        from tensorboardX import SummaryWriter  # imported here: only a planner with --log-dir needs it

        self.log_dir = log_dir
        self._writer = SummaryWriter(logdir=log_dir)

    def pull(
        self, step: int, obs: Observation, figures: PullFigures, running: int, waiting: int, walltime: float
    ) -> None:
        scalars: dict[str, float | None] = {
            "pull/kv_usage": figures.kv_usage,
            "pull/prefill_queue_size": figures.queue_waiting,
            "pull/prefill_queue_utilisation": figures.queue_utilisation,
            "pull/running_requests": running,
            "pull/waiting_requests": waiting,
            "pull/decode_workers": obs.decode.workers,
            "pull/prefill_workers": None if obs.prefill is None else obs.prefill.workers,
            "pull/gpus": figures.gpus,
        }
        self._scalars(scalars, step, walltime)

    def adjustment(self, step: int, adj: Adjustment, walltime: float) -> None:
        decode, prefill = adj.decision(Pool.DECODE), adj.decision(Pool.PREFILL)
        scalars: dict[str, float | None] = {
            "adjustment/kv_usage": None if decode is None else decode.metrics.get("kv_usage"),
            "adjustment/prefill_queue_size": None if prefill is None else prefill.metrics.get("queue_waiting"),
            "adjustment/prefill_queue_utilisation": None
            if prefill is None
            else prefill.metrics.get("queue_utilisation"),
            "adjustment/decode_workers": None if decode is None else decode.target,
            "adjustment/prefill_workers": None if prefill is None else prefill.target,
            "adjustment/gpus": adj.gpus_after,
        }
        self._scalars(scalars, step, walltime)
        lines = [("[no-operation] " if adj.no_operation else "") + d.summary() for d in adj.decisions]
        if adj.note:
            lines.append(f"note: {adj.note}")
        lines.append(f"GPUs {adj.gpus_before} -> {adj.gpus_after}")
        # Markdown: two trailing spaces end a line without starting a paragraph.
        self._writer.add_text("adjustment/decisions", "  \n".join(lines), step, walltime=walltime)

    def _scalars(self, scalars: Mapping[str, float | None], step: int, walltime: float) -> None:
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(tag, value, step, walltime=walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# --------------------------------------------------------------------------------------------------------------------
# The loop


class Planner:
    """Pulls, decides and applies for one served model in one namespace (module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        config: PlannerConfig,
        namespace: str,
        model: str,
        connector: Connector,
        log_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_host: str | None = None,
        metrics_port: int = 0,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.namespace = namespace
        self.model = model
        self.connector = connector
        self.log_dir = log_dir
        self.board: PlannerBoard | None = None
        self.clock = clock
        self.state = PlannerState()
        self.last_decision: Adjustment | None = None
        self.last_observation: Observation | None = None
        self.num_pulls = 0
        self.num_adjustments = 0
        self.num_changes_applied = 0
        self.num_change_failures = 0
        self.last_change_error = ""
        self.last_decision_walltime: float | None = None
        self.metrics = PlannerMetrics(model, no_operation=config.no_operation)
        self.metrics.in_progress = self.changes_in_progress
        self._metrics_server = None if metrics_host is None else MetricsServer(self.metrics, metrics_host, metrics_port)
        self.metrics_url = ""
        self._loads: dict[int, tuple[LoadSnapshot, float]] = {}
        self._queue_reports: dict[int, tuple[PrefillQueueReport, float]] = {}
        self._pending: dict[Pool, PendingChange] = {}
        self._change_tasks: dict[Pool, asyncio.Task[None]] = {}
        self._subs: list[EventSubscription[Any]] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._loop_task: asyncio.Task[None] | None = None

    # --- life -------------------------------------------------------------------------------------------------------

    async def start(self) -> str:
        if self.log_dir:
            # In a thread: tensorboardX imports torch when it is installed (2.5-7 s here, with vLLM's), which on the
            # event loop would stall every lease keep-alive of this process past a 3 s TTL.
            self.board = await asyncio.to_thread(PlannerBoard, self.log_dir)
        if self._metrics_server is not None:
            server = self._metrics_server
            try:
                self.metrics_url = await server.start()
            except OSError as e:
                raise SystemExit(
                    f"kvmesh planner: cannot serve /metrics on {server.host}:{server.port}: {e.strerror or e} "
                    "(--metrics-port 0 takes a free port)"
                ) from None
        try:
            await self.connector.start()
        except ConnectorError as e:
            logger.warning("%s; the planner runs on", e)
        ns = self.runtime.namespace(self.namespace)
        spawn = self.runtime.supervisor.spawn
        loads: EventSubscription[Any] = await ns.events.subscribe(TOPIC_LOAD_METRICS)
        self._subs.append(loads)
        self._tasks.append(spawn(self._consume_loads(loads), name=f"planner-loads:{self.namespace}"))
        queue: EventSubscription[Any] = await ns.events.subscribe(TOPIC_PREFILL_QUEUE)
        self._subs.append(queue)
        self._tasks.append(spawn(self._consume_queue(queue), name=f"planner-queue:{self.namespace}"))
        self._loop_task = spawn(self._run(), name=f"planner-loop:{self.namespace}")
        self._tasks.append(self._loop_task)
        cfg = self.config
        logger.info(
            "planner for %s in %s (%s connector%s): pull every %g s, adjust every %g s",
            self.model,
            self.namespace,
            self.connector.name,
            ", no-operation" if cfg.no_operation else "",
            cfg.metric_pulling_interval,
            cfg.adjustment_interval,
        )
        await self._publish_status()
        metrics = f", metrics {self.metrics_url}" if self.metrics_url else ""
        return f"planner {self.namespace}/{self.model} ({self.connector.name}){metrics}"

    async def ended(self) -> None:
        """Returns only if the pull loop died (a bug: every expected failure is handled inside a pull), so the
        process exits non-zero instead of running on without deciding anything."""
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task])

    async def stop(self) -> tuple[int, str]:
        code, last = 0, "STOPPED"
        loop_task = self._loop_task
        if loop_task is not None and loop_task.done() and not loop_task.cancelled() and loop_task.exception():
            logger.error("planner loop died: %r", loop_task.exception())
            code, last = 1, f"DEAD planner loop: {loop_task.exception()!r}"
        tasks = [*self._tasks, *self._change_tasks.values()]
        self._tasks.clear()
        self._change_tasks.clear()
        for t in tasks:
            t.cancel()
        # gather, not "await t" under suppress(CancelledError): a stop() that is itself cancelled stays cancelled.
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in self._subs:
            try:
                await sub.close()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("closing subscription %s: %s", sub.topic, e)
        self._subs.clear()
        try:
            await self.connector.close()
        except Exception as e:  # noqa: BLE001 - release the rest
            logger.warning("closing %s connector: %s", self.connector.name, e)
        if self.board is not None:
            try:
                self.board.close()
            except OSError as e:
                logger.warning("closing TensorBoard writer: %s", e)
        if self._metrics_server is not None:
            try:
                await self._metrics_server.stop()
            except OSError as e:
                logger.warning("stopping the metrics server: %s", e)
        return code, last

    # --- inputs -----------------------------------------------------------------------------------------------------

    async def _consume_loads(self, sub: EventSubscription[Any]) -> None:
        async for ev in sub:
            try:
                snap = LoadSnapshot.from_dict(ev.payload)
            except (KeyError, TypeError) as e:
                logger.warning("load metrics from %x do not parse: %r", ev.source_id, e)
                continue
            self._loads[ev.source_id] = (snap, self.clock())

    async def _consume_queue(self, sub: EventSubscription[Any]) -> None:
        async for ev in sub:
            try:
                report = PrefillQueueReport.from_dict(ev.payload)
            except (KeyError, TypeError) as e:
                logger.warning("prefill queue report from %x does not parse: %r", ev.source_id, e)
                continue
            self._queue_reports[ev.source_id] = (report, self.clock())

    # --- pull, decide, apply ----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.metric_pulling_interval
        next_at = loop.time()
        while True:
            await self.pull()
            # Fixed cadence; a pull that overran skips the missed slots rather than bunching pulls together.
            next_at += interval
            now = loop.time()
            if next_at < now:
                next_at += math.ceil((now - next_at) / interval) * interval
            await asyncio.sleep(next_at - now)

    async def pull(self) -> Adjustment | None:
        """One pull: observe, decide, and apply the decision if one is due. Returns the adjustment, if any."""
        try:
            instances = await self.runtime.namespace(self.namespace).list_instances()
        except ConnectError as e:
            # etcd unreachable for connect_timeout_s: no pool sizes, so no observation. Not fatal to the planner:
            # etcd is expected back, and the next pull tries again (its interval restarts on the fleet it sees).
            logger.warning("planner pull skipped: %s", e)
            return None
        now = self.clock()
        fleet = fleet_from_instances(instances, self.model)
        # Forget the snapshots of workers that left the pool, and reports of prefill workers long silent.
        for iid in [i for i in self._loads if i not in fleet.decode]:
            del self._loads[iid]
        oldest_s = now - STALE_AFTER_PULLS * self.config.metric_pulling_interval
        for iid in [i for i, (_, t) in self._queue_reports.items() if t < oldest_s and i not in fleet.prefill]:
            del self._queue_reports[iid]
        gpus = {pool: self.connector.gpus_per_worker(pool) for pool in Pool}
        obs = build_observation(
            now, fleet, self._loads, queue_reading(self._queue_reports, self.model), dict(self._pending), gpus
        )
        figures = pull_figures(obs, self.config)
        self.num_pulls += 1
        self.last_observation = obs
        walltime = time.time()
        running, waiting = request_totals(self._loads, fleet, now, self.config)
        self.metrics.pull(obs, figures, running, waiting)
        if self.board is not None:
            self.board.pull(self.num_pulls, obs, figures, running, waiting, walltime)
        adj, self.state = decide(self.state, obs, self.config)
        if adj is None:
            return None
        self.num_adjustments += 1
        self.last_decision = adj
        self.last_decision_walltime = walltime
        self.metrics.adjustment(adj)
        changed = any(d.direction != Direction.HOLD for d in adj.decisions)
        logger.log(
            logging.INFO if changed or self.num_adjustments == 1 else logging.DEBUG,
            "planner adjustment %d%s: %s; GPUs %d -> %d",
            self.num_adjustments,
            " [no-operation]" if adj.no_operation else "",
            "; ".join(d.summary() for d in adj.decisions),
            adj.gpus_before,
            adj.gpus_after,
        )
        if self.board is not None:
            self.board.adjustment(self.num_pulls, adj, walltime)
            self.board.flush()
        self.apply(adj)
        await self._publish_status()
        return adj

    def apply(self, adj: Adjustment) -> None:
        """Start one task per pool change (none under no_operation). A pool whose previous change is still running
        is left alone: the policy holds while a change is in progress, so this only happens when a caller applies
        by hand."""
        for d in adj.changes():
            if d.pool in self._change_tasks:
                logger.warning("%s pool: a change is still in progress; not applying %s", d.pool, d.summary())
                continue
            self._pending[d.pool] = PendingChange(before=d.current, target=d.target)
            self._change_tasks[d.pool] = self.runtime.supervisor.spawn(
                self._change(d.pool, d.target, str(d.direction)), name=f"planner-scale:{d.pool}"
            )

    async def _change(self, pool: Pool, target: int, direction: str) -> None:
        ok = False
        try:
            await self.connector.set_pool_size(pool, target)
            ok = True
            self.num_changes_applied += 1
        except ConnectorError as e:
            self.num_change_failures += 1
            self.last_change_error = str(e)
            logger.warning("%s; the planner decides again at a later interval", e)
        except RuntimeMeshError as e:
            self.num_change_failures += 1
            self.last_change_error = f"{pool} pool to {target} workers: {e}"
            logger.warning("%s pool to %d workers: %s; the planner decides again later", pool, target, e)
        finally:
            self._pending.pop(pool, None)
            if self._change_tasks.get(pool) is asyncio.current_task():
                del self._change_tasks[pool]
        self.metrics.change(pool, direction, ok)
        await self._publish_status()

    def changes_in_progress(self) -> dict[Pool, PendingChange]:
        return dict(self._pending)

    def status(self) -> dict[str, Any]:
        return status_payload(
            model=self.model,
            connector=self.connector.name,
            walltime=time.time(),
            no_operation=self.config.no_operation,
            observation=self.last_observation,
            adjustment=self.last_decision,
            adjustment_walltime=self.last_decision_walltime,
            pending=self._pending,
            changes_applied=self.num_changes_applied,
            change_failures=self.num_change_failures,
            last_change_error=self.last_change_error,
            metrics_url=self.metrics_url,
        )

    async def _publish_status(self) -> None:
        """The planner's status (``status_payload``), where ``kvmesh status`` can read it; it goes with the planner's
        lease."""
        value = json.dumps(self.status())
        try:
            await self.runtime.discovery.put(
                status_key(self.namespace, self.model), value.encode(), lease=self.runtime.primary_lease
            )
        except RuntimeMeshError as e:
            logger.debug("publishing planner status: %s", e)
