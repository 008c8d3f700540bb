"""``Planner``: the planner's adapter. It does all of the planner's I/O around the controller (controller.py, the
pull as a function of the fleet view, which the simulator runs too) and the pure policy (policy.py):

- every ``metric_pulling_interval`` it hands ``PlannerController.pull`` a snapshot of its fleet view
  (``components.fleet.live.LiveFleet``: membership watched in etcd, the ``load_metrics``, ``worker_status`` and
  ``prefill_queue`` topics, stamped with the planner's clock). The pools, loads (fresh by the fleet's one staleness
  rule), the prefill queue and the changes in progress become the policy's ``Observation`` there. Before each pull
  one etcd listing checks that discovery answers: with etcd unreachable the pull is skipped rather than decided on a
  membership that may be stale;
  * GPUs per worker: ``Connector.gpus_per_worker`` (the local connector: the graph group's gpus_per_replica, from
    the state file), else the config's ``*_engine_num_gpu``;
- applies each ``Adjustment`` (``apply``): one named task per pool change, through the connector, announced to the
  controller (``change_started``/``change_ended``: a pool whose ``Connector.set_pool_size`` has not returned counts
  the difference asked for as starting or leaving, which pauses the policy's intervals); a failed change is logged
  and the next interval decides again;
- logs one INFO line per adjustment with its reasons, writes TensorBoard scalars at every pull and adjustment and
  each decision as text (``PlannerBoard``, with ``--log-dir``), keeps the same figures and counters of decisions for
  Prometheus (``metrics.PlannerMetrics``, served on ``GET /metrics`` when a metrics host is given), keeps
  ``last_decision`` and puts the planner's status (``status_payload``: pool sizes, the last decision with its
  reasons, changes in progress, the last failed change, the metrics URL), as JSON, at
  ``kvmesh/<ns>/planner/status/<model>`` under the planner's lease for ``kvmesh status``: at start, at every
  adjustment and when a change starts or ends.

Owns: its fleet view, its tasks (``planner-*``, in the runtime's supervisor), the connector and the TensorBoard
writer, all released by ``stop()``, each in its own try.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from components.fleet.live import LiveFleet
from components.fleet.model import FleetSnapshot
from components.planner.board import PlannerBoard
from components.planner.config import DEFAULT_SCALING_TIMEOUT_S, AnyPlannerConfig, PlannerConfig
from components.planner.connectors.base import Connector, ConnectorError
from components.planner.controller import PendingChange, PlannerController
from components.planner.metrics import PlannerMetrics
from components.planner.policy import (
    Adjustment,
    Direction,
    Observation,
    Pool,
)
from components.planner.sla.controller import SlaController
from components.planner.status import status_key
from components.runtime import Runtime
from components.runtime.errors import ConnectError, RuntimeMeshError
from components.runtime.metrics_http import MetricsServer

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# Pure: status and logs


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
    mode: str = "load",
    sla: Mapping[str, float] | None = None,
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
        "mode": mode,
        "sla": {k: v for k, v in (sla or {}).items() if math.isfinite(v)} or None,
    }


# --------------------------------------------------------------------------------------------------------------------
# The loop


class Planner:
    """Pulls, decides and applies for one served model in one namespace (module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        config: AnyPlannerConfig,
        namespace: str,
        model: str,
        connector: Connector,
        controller: PlannerController | SlaController | None = None,
        log_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_host: str | None = None,
        metrics_port: int = 0,
        hand_change_timeout_s: float = DEFAULT_SCALING_TIMEOUT_S,
    ) -> None:
        self.runtime = runtime
        # A count changed by hand (the connector's pool_size) counts as a change in progress until the fleet shows
        # it, at most this long: a hand change that never completes (pods Pending for want of a GPU) must not stop
        # the planner for good.
        self.hand_change_timeout_s = hand_change_timeout_s
        self._last_size: dict[Pool, int] = {}  # the count each pool was last set to, by this planner or by hand
        self._hand: dict[Pool, float] = {}  # pools whose change in progress is a hand change: since when
        self.config = config
        self.namespace = namespace
        self.model = model
        self.connector = connector
        self.log_dir = log_dir
        self.board: PlannerBoard | None = None
        self.clock = clock
        # The policy and its changes in progress (no I/O: the simulator runs the same class; the load planner's
        # unless one is given, e.g. components.planner.main's SlaController), and the fleet view it reads: membership
        # from discovery, load, prefill queue and frontends' request reports, stamped with ``clock``.
        if controller is None:
            if not isinstance(config, PlannerConfig):
                raise TypeError("the SLA planner's config needs its controller (components.planner.main)")
            controller = PlannerController(config, model)
        self.controller: PlannerController | SlaController = controller
        self.mode = "sla" if isinstance(self.controller, SlaController) else "load"
        self.fleet = LiveFleet(runtime, namespace, clock=clock)
        self.last_decision: Adjustment | None = None
        self.last_observation: Observation | None = None
        self.num_changes_applied = 0
        self.num_change_failures = 0
        self.last_change_error = ""
        self.last_decision_walltime: float | None = None
        self.metrics = PlannerMetrics(model, no_operation=config.no_operation)
        self.metrics.in_progress = self.changes_in_progress
        self._metrics_server = None if metrics_host is None else MetricsServer(self.metrics, metrics_host, metrics_port)
        self.metrics_url = ""
        self._change_tasks: dict[Pool, asyncio.Task[bool]] = {}  # each pool's latest change
        self._superseded: set[asyncio.Task[bool]] = set()  # earlier changes a raise went past, still running
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
        await self.fleet.start()
        self._loop_task = self.runtime.supervisor.spawn(self._run(), name=f"planner-loop:{self.namespace}")
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
        tasks = [*self._tasks, *self._change_tasks.values(), *self._superseded]
        self._tasks.clear()
        self._change_tasks.clear()
        self._superseded.clear()
        for t in tasks:
            t.cancel()
        # gather, not "await t" under suppress(CancelledError): a stop() that is itself cancelled stays cancelled.
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.fleet.stop()
        except Exception as e:  # noqa: BLE001 - release the rest
            logger.warning("stopping the fleet view: %s", e)
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

    @property
    def num_pulls(self) -> int:
        return self.controller.num_pulls

    @property
    def num_adjustments(self) -> int:
        return self.controller.num_adjustments

    @property
    def _pending(self) -> dict[Pool, PendingChange]:
        return self.controller.pending

    async def pull(self) -> Adjustment | None:
        """One pull: observe, decide, and apply the decision if one is due. Returns the adjustment, if any."""
        try:
            # Not for its answer (the fleet view's watch keeps membership): with etcd unreachable the pool sizes
            # may be stale, so no observation. Not fatal to the planner: etcd is expected back, and the next pull
            # tries again (its interval restarts on the fleet it sees).
            await self.runtime.namespace(self.namespace).list_instances()
        except ConnectError as e:
            logger.warning("planner pull skipped: %s", e)
            return None
        gpus = {pool: self.connector.gpus_per_worker(pool) for pool in Pool}
        sizes = await self._pool_sizes()
        snap = self.fleet.snapshot(self.clock())
        self._follow_hand_changes(snap, sizes)
        out = self.controller.pull(snap, gpus)
        obs, figures = out.observation, out.figures
        self.last_observation = obs
        walltime = time.time()
        self.metrics.pull(obs, figures, out.running, out.waiting)
        if out.sla is not None:
            self.metrics.sla(out.sla)
        if self.board is not None:
            self.board.pull(self.num_pulls, obs, figures, out.running, out.waiting, walltime)
            if out.sla is not None:
                self.board.sla(self.num_pulls, out.sla, walltime)
        adj = out.adjustment
        if adj is None:
            return None
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

    async def _pool_sizes(self) -> dict[Pool, int]:
        """The connector's counts of the pools no change of this planner is running on (``Connector.pool_size``)."""
        sizes: dict[Pool, int] = {}
        for pool in Pool:
            if pool in self._change_tasks:
                continue
            try:
                size = await self.connector.pool_size(pool)
            except ConnectorError as e:
                logger.debug("reading the %s pool's size: %s", pool, e)
                continue
            if size is not None:
                sizes[pool] = size
        return sizes

    def _follow_hand_changes(self, snap: FleetSnapshot, sizes: dict[Pool, int]) -> None:
        """A count set by someone else (``kubectl scale``, ``circusctl``) is where the planner goes on from: the
        difference from the workers registered counts as starting or leaving (the policy holds, as for its own
        change) until the fleet shows it or ``hand_change_timeout_s`` passed. A count this planner set is not a
        hand change, however long its workers take to register."""
        now = self.clock()
        for pool, size in sizes.items():
            if pool in self._change_tasks:
                continue
            if pool == Pool.PREFILL and not snap.disaggregated(self.model):
                continue
            registered = len(snap.prefill(self.model) if pool == Pool.PREFILL else snap.serving(self.model))
            if pool in self._hand:
                pending = self._pending.get(pool)
                timed_out = now - self._hand[pool] > self.hand_change_timeout_s
                if size == registered or timed_out or pending is None:
                    if timed_out and size != registered:
                        logger.warning(
                            "%s pool: set to %d by hand %.0f s ago, %d registered: the planner goes on from %d",
                            pool, size, now - self._hand[pool], registered, registered,
                        )  # fmt: skip
                    del self._hand[pool]
                    self.controller.change_ended(pool)
                    self._last_size[pool] = size
                    continue
                if pending.target != size:  # changed by hand again meanwhile
                    self.controller.change_started(pool, registered, size)
                    self._last_size[pool] = size
                continue
            known = self._last_size.get(pool)
            self._last_size[pool] = size
            if known == size or size == registered:
                continue  # its own count (its workers may still be registering), or nothing to wait for
            logger.info(
                "%s pool: set to %d by hand (%d registered): the planner goes on from there", pool, size, registered
            )
            self._hand[pool] = now
            self.controller.change_started(pool, registered, size)

    def apply(self, adj: Adjustment) -> None:
        """Start one task per pool change (none under no_operation). A pool whose previous change is still running
        is left alone: the policy holds while a change is in progress, so this only happens when a caller applies
        by hand. Within one adjustment the removals go first: an addition's task waits until every removal of the
        same adjustment has finished (and is skipped if one failed), so a swap at full GPU budget never asks for
        more than the budget at any moment (a Pending pod on Kubernetes; Dynamo's issue 12428)."""
        removals: list[asyncio.Task[bool]] = []
        for d in sorted(adj.changes(), key=lambda d: d.target > d.current):  # removals first
            running = self._pending.get(d.pool)
            if d.pool in self._change_tasks:
                # An addition in progress may be raised (the SLA planner does: a larger absolute count, which the
                # connector applies after the first, adding the rest); anything else waits for it.
                raising = running is not None and running.target > running.before and d.target > running.target
                if not raising:
                    logger.warning("%s pool: a change is still in progress; not applying %s", d.pool, d.summary())
                    continue
                self._superseded.add(self._change_tasks[d.pool])
            self.controller.change_started(d.pool, d.current, d.target)
            self._hand.pop(d.pool, None)
            self._last_size[d.pool] = d.target
            after = list(removals) if d.target > d.current else []
            task = self.runtime.supervisor.spawn(
                self._change(d.pool, d.target, str(d.direction), after), name=f"planner-scale:{d.pool}"
            )
            self._change_tasks[d.pool] = task
            if d.target < d.current:
                removals.append(task)

    async def _change(self, pool: Pool, target: int, direction: str, after: Sequence[asyncio.Task[bool]] = ()) -> bool:
        ok = False
        try:
            blocked = False
            if after:
                done = await asyncio.gather(*after, return_exceptions=True)
                blocked = not all(r is True for r in done)
            if blocked:
                self.num_change_failures += 1
                self.last_change_error = f"{pool} pool to {target} workers: not started, a removal it needed failed"
                logger.warning("%s; the planner decides again at a later interval", self.last_change_error)
            else:
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
            task = asyncio.current_task()
            if self._change_tasks.get(pool) is task:
                # The pool's latest change ended: it is settled (a superseded one ending first does not say so).
                del self._change_tasks[pool]
                self.controller.change_ended(pool)
            self._superseded.discard(task)  # type: ignore[arg-type]
        self.metrics.change(pool, direction, ok)
        await self._publish_status()
        return ok

    def changes_in_progress(self) -> dict[Pool, PendingChange]:
        return self.controller.in_progress()

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
            mode=self.mode,
            sla=self.metrics.sla_figures,
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
