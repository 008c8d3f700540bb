"""``Rescheduler``: the rescheduler's adapter. All of its I/O around the pure cycle (policies/: the fleet view's
snapshot in, validated migration pairs out):

- every ``rescheduling_interval_ms`` one cycle: a snapshot of its fleet view (``components.fleet.live.LiveFleet``:
  membership watched in etcd, the ``load_metrics`` and ``worker_status`` topics, stamped with the rescheduler's
  clock, as the planner reads it), the plan (``CyclePlanner``; ``policy_planner``: the policies' ``plan_cycle``
  over the snapshot's instance views, given the migrations still in flight), then the pairs run concurrently
  through the sources' ``migrate`` endpoints (``MigrationExecutor``, each call under the per-call timeout). A pair
  whose source has a call in flight is dropped, whatever the plan said. The loop awaits its pairs before the next
  cycle: cycles never overlap; one that overran skips the slots it missed rather than bunching cycles together;
- keeps the last cycle that chose or refused a pair (``last_cycle``: its pairs with their outcomes and reasons, the
  candidates the validation refused), the totals by policy, and Prometheus counters (``metrics.ReschedulerMetrics``,
  on ``GET /metrics`` when a metrics host is given); puts its status (``status()``) as JSON at
  ``kvmesh/<ns>/rescheduler/status/<lease>`` under the runtime's lease for ``kvmesh status``: at start, after every
  cycle that chose or refused a pair, and at least every ``STATUS_REPEAT_S``;
- logs one INFO line per cycle that chose a pair (and one per pair, the executor's);
- with ``prefix_replication`` among its policies, runs hot-prefix replication after the cycle's migrations
  (``replicator.LiveReplicator``: its own KV index and fleet view, the policy, the copies and drops, each under the
  call timeout): the cycle's copies and drops with their outcomes are in its record (``prefix_actions``), their
  totals by kind and outcome in the status (``prefix_replication``) and in Prometheus.

Runs standalone (``kvmesh rescheduler``) or colocated in a frontend process (``kvmesh frontend
--colocated-rescheduling-mode``): the same class, ``where`` says which (a label of its metrics and status).

Owns: its fleet view, its migrate client, its loop task (``rescheduler-loop:<ns>``, in the runtime's supervisor) and
its metrics server, all released by ``stop()``, each in its own try.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from components.fleet.live import LiveFleet
from components.fleet.model import FleetSnapshot
from components.rescheduler.config import Policy, ReplicationConfig, ReschedulerConfig
from components.rescheduler.executor import (
    MigrationExecutor,
    MigrationOrder,
    PairResult,
    counts_by_policy,
    migrate_client,
    totals_to_dict,
)
from components.rescheduler.metrics import ReschedulerMetrics
from components.rescheduler.policies import plan_cycle
from components.rescheduler.replicator import ActionResult, LiveReplicator
from components.rescheduler.status import status_key
from components.rescheduler.views import instance_views
from components.runtime import Client, Runtime, RuntimeMeshError
from components.runtime.metrics_http import MetricsServer

logger = logging.getLogger(__name__)

# The status key is rewritten at least this often, so ``kvmesh status`` can tell a live rescheduler that has had
# nothing to do (its ``walltime`` is recent) from one that is stuck.
STATUS_REPEAT_S = 5.0
# Cycles that ran pairs kept in ``Rescheduler.history``: at 2 cycles a second, the last half minute or more.
HISTORY = 64


@dataclasses.dataclass(frozen=True, slots=True)
class RejectedPair:
    """A candidate pair a policy or the cycle's validation refused, and why (``destination_id`` None: no
    destination was found)."""

    source_id: int
    destination_id: int | None
    policy: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source_id,
            "destination": self.destination_id,
            "policy": self.policy,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class CycleDecision:
    """What one cycle's plan says to do: the pairs as orders, and the candidates refused."""

    orders: tuple[MigrationOrder, ...] = ()
    rejected: tuple[RejectedPair, ...] = ()


# snapshot, (source, destination) of the migrations in flight -> decision (``policy_planner``: the policies).
CyclePlanner = Callable[[FleetSnapshot, frozenset[tuple[int, int]]], CycleDecision]


def policy_planner(config: ReschedulerConfig) -> CyclePlanner:
    """The policies' cycle as the loop calls it: the snapshot's instance views (views.py) through ``plan_cycle``
    (policies/cycle.py, the same function the simulator calls), its pairs as the executor's orders (each asks the
    source's agent for the pair's selection, ``trigger`` = the policy)."""

    def plan(snapshot: FleetSnapshot, in_flight: frozenset[tuple[int, int]]) -> CycleDecision:
        cycle = plan_cycle(instance_views(snapshot), config, sorted(in_flight))
        orders = tuple(
            MigrationOrder(
                source_id=p.source_id,
                destination_id=p.destination_id,
                policy=str(p.policy),
                reason=p.reason,
                select_rule=p.select_rule,
                select_order=p.select_order,
                select_value=p.select_value,
            )
            for p in cycle.pairs
        )
        rejected = tuple(RejectedPair(r.source_id, r.destination_id, str(r.policy), r.reason) for r in cycle.rejected)
        return CycleDecision(orders, rejected)

    return plan


@dataclasses.dataclass(slots=True)
class CycleRecord:
    """One cycle as it ran: what ``kvmesh status`` shows."""

    number: int
    walltime: float
    now_s: float
    num_instances: int
    results: list[PairResult]
    rejected: tuple[RejectedPair, ...]
    skipped_in_flight: list[MigrationOrder]
    plan_s: float = 0.0
    duration_s: float = 0.0
    prefix_actions: list[ActionResult] = dataclasses.field(default_factory=list)  # prefix_replication's

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "walltime": self.walltime,
            "num_instances": self.num_instances,
            "plan_ms": round(self.plan_s * 1e3, 3),
            "duration_s": round(self.duration_s, 4),
            "pairs": [r.to_dict() for r in self.results],
            "rejected": [r.to_dict() for r in self.rejected],
            "skipped_in_flight": [
                {"source": o.source_id, "destination": o.destination_id, "policy": o.policy}
                for o in self.skipped_in_flight
            ],
            "counts": totals_to_dict(counts_by_policy(self.results)),
            "prefix_actions": [a.to_dict() for a in self.prefix_actions],
        }


class Rescheduler:
    """Reads the fleet, plans and moves requests in one namespace (module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        plan: CyclePlanner,
        *,
        interval_s: float,
        call_timeout_s: float,
        policies: Sequence[str] = (),
        where: str = "standalone",
        component: str = "backend",
        clock: Callable[[], float] = time.monotonic,
        metrics_host: str | None = None,
        metrics_port: int = 0,
        fleet: LiveFleet | None = None,
        replication: ReplicationConfig | None = None,
    ) -> None:
        """``replication``: run hot-prefix replication with these knobs each cycle (None: not)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.runtime = runtime
        self.namespace = namespace
        self.plan = plan
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.policies = list(policies)
        self.where = where
        self.component = component
        self.clock = clock
        # Not following the prefill queue or the frontends' request reports: no policy reads them.
        self.fleet = fleet or LiveFleet(runtime, namespace, clock=clock, follow_queues=False, follow_requests=False)
        self._own_fleet = fleet is None
        self._client: Client | None = None
        self.executor: MigrationExecutor | None = None
        self.metrics = ReschedulerMetrics(where, in_flight=lambda: len(self.in_flight))
        self._metrics_server = None if metrics_host is None else MetricsServer(self.metrics, metrics_host, metrics_port)
        self.metrics_url = ""
        self.num_cycles = 0
        self.last_cycle: CycleRecord | None = None  # the last one that chose or refused a pair
        # The latest cycles that ran pairs, oldest first (tests, embedders; the status shows the last only).
        self.history: collections.deque[CycleRecord] = collections.deque(maxlen=HISTORY)
        self.pairs_by_policy: collections.Counter[str] = collections.Counter()
        self._loop_task: asyncio.Task[None] | None = None
        self._status_at = -math.inf
        self.replication = replication
        self.replicator: LiveReplicator | None = None
        # prefix_replication's copies and drops by (kind, outcome), and the last cycle that had any.
        self.prefix_totals: collections.Counter[tuple[str, str]] = collections.Counter()
        self.last_prefix_cycle: CycleRecord | None = None

    @classmethod
    def from_config(cls, runtime: Runtime, namespace: str, config: ReschedulerConfig, **kw: Any) -> Rescheduler:
        """A rescheduler running the policies of ``config`` (``policy_planner``) at its interval and call timeout."""
        return cls(
            runtime,
            namespace,
            policy_planner(config),
            interval_s=config.interval_s,
            call_timeout_s=config.rescheduling_migrate_timeout_s,
            policies=[str(p) for p in config.rescheduling_policies],
            replication=config if Policy.PREFIX_REPLICATION in config.rescheduling_policies else None,
            **kw,
        )

    @property
    def in_flight(self) -> frozenset[tuple[int, int]]:
        """(source, destination) of the migrate calls in flight."""
        return frozenset() if self.executor is None else self.executor.in_flight

    # --- life -------------------------------------------------------------------------------------------------------

    async def start(self) -> str:
        if self._metrics_server is not None:
            server = self._metrics_server
            try:
                self.metrics_url = await server.start()
            except OSError as e:
                raise SystemExit(
                    f"kvmesh rescheduler: cannot serve /metrics on {server.host}:{server.port}: {e.strerror or e} "
                    "(--metrics-port 0 takes a free port)"
                ) from None
        self._client = await migrate_client(self.runtime, self.namespace, self.component)
        self.executor = MigrationExecutor(self._client, self.call_timeout_s)
        if self._own_fleet:
            await self.fleet.start()
        if self.replication is not None:
            self.replicator = LiveReplicator(
                self.runtime,
                self.namespace,
                self.component,
                self.replication,
                call_timeout_s=self.call_timeout_s,
                clock=self.clock,
            )
            await self.replicator.start()
        self._loop_task = self.runtime.supervisor.spawn(self._run(), name=f"rescheduler-loop:{self.namespace}")
        logger.info(
            "rescheduler (%s) for %s: every %g ms, policies %s, call timeout %g s",
            self.where,
            self.namespace,
            self.interval_s * 1e3,
            ", ".join(self.policies) or "-",
            self.call_timeout_s,
        )
        await self._publish_status()
        metrics = f", metrics {self.metrics_url}" if self.metrics_url else ""
        return f"rescheduler {self.namespace} ({self.where}){metrics}"

    async def ended(self) -> None:
        """Returns only if the loop died (a bug: every expected failure is handled inside a cycle), so the process
        exits non-zero instead of running on without rescheduling."""
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task])

    async def stop(self) -> tuple[int, str]:
        code, last = 0, "STOPPED"
        task, self._loop_task = self._loop_task, None
        if task is not None:
            if task.done() and not task.cancelled() and task.exception():
                logger.error("rescheduler loop died: %r", task.exception())
                code, last = 1, f"DEAD rescheduler loop: {task.exception()!r}"
            task.cancel()
            # gather, not "await task" under suppress(CancelledError): a stop() that is itself cancelled stays so.
            await asyncio.gather(task, return_exceptions=True)
        replicator, self.replicator = self.replicator, None
        if replicator is not None:
            try:
                await replicator.stop()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("stopping the prefix replicator: %s", e)
        if self._own_fleet:
            try:
                await self.fleet.stop()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("stopping the fleet view: %s", e)
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("closing the migrate client: %s", e)
        if self._metrics_server is not None:
            try:
                await self._metrics_server.stop()
            except OSError as e:
                logger.warning("stopping the metrics server: %s", e)
        return code, last

    # --- the loop ---------------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_s
        next_at = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            await self.cycle()
            next_at += interval
            now = loop.time()
            if next_at < now:
                next_at += math.ceil((now - next_at) / interval) * interval

    async def cycle(self) -> CycleRecord:
        """One cycle: plan on the fleet as it is now, run the pairs, record. Returns the record (also when it chose
        nothing; ``last_cycle`` keeps only those that chose or refused a pair)."""
        assert self.executor is not None, "start() first"
        self.num_cycles += 1
        t0 = time.monotonic()
        now_s = self.clock()
        snapshot = self.fleet.snapshot(now_s)
        in_flight = self.executor.in_flight
        decision = self.plan(snapshot, in_flight)
        plan_s = time.monotonic() - t0
        # The policies were told; a plan that still names a busy source is not run (one migrate call per source).
        busy = {src for src, _ in in_flight}
        orders = [o for o in decision.orders if o.source_id not in busy]
        skipped = [o for o in decision.orders if o.source_id in busy]
        record = CycleRecord(
            number=self.num_cycles,
            walltime=time.time(),
            now_s=now_s,
            num_instances=len(snapshot.instances),
            results=[],
            rejected=decision.rejected,
            skipped_in_flight=skipped,
            plan_s=plan_s,
        )
        pairs = collections.Counter(o.policy for o in orders)
        self.pairs_by_policy.update(pairs)
        self.metrics.cycle(dict(pairs), dict(collections.Counter(r.policy for r in decision.rejected)))
        if orders:
            logger.info(
                "rescheduling cycle %d: %s",
                record.number,
                "; ".join(f"{o.policy} {o.source_id:x} -> {o.destination_id:x} ({o.reason})" for o in orders),
            )
            record.results = await self.executor.execute(orders)
            self.metrics.results(record.results)
            self.history.append(record)
        if self.replicator is not None:
            replicated = await self.replicator.cycle(now_s)
            record.prefix_actions = list(replicated.results)
            for a in replicated.results:
                self.prefix_totals[(str(a.action.kind), str(a.outcome))] += 1
            self.metrics.prefix_actions(replicated.results)
            if replicated.results:
                self.last_prefix_cycle = record
        record.duration_s = time.monotonic() - t0
        chose = bool(orders or decision.rejected or skipped or record.prefix_actions)
        if chose:
            self.last_cycle = record
        if chose or time.monotonic() - self._status_at >= STATUS_REPEAT_S:
            await self._publish_status()
        return record

    # --- status -----------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        totals = {} if self.executor is None else totals_to_dict(self.executor.totals)
        return {
            "namespace": self.namespace,
            "where": self.where,
            "walltime": time.time(),
            "interval_ms": self.interval_s * 1e3,
            "call_timeout_s": self.call_timeout_s,
            "policies": self.policies,
            "num_cycles": self.num_cycles,
            "pairs_by_policy": dict(sorted(self.pairs_by_policy.items())),
            "totals": totals,
            "in_flight": [list(p) for p in sorted(self.in_flight)],
            "last_cycle": None if self.last_cycle is None else self.last_cycle.to_dict(),
            "last_pairs_cycle": self.history[-1].to_dict() if self.history else None,
            "prefix_replication": None
            if self.replication is None
            else {
                "totals": {
                    kind: {o: n for (k, o), n in sorted(self.prefix_totals.items()) if k == kind}
                    for kind in ("copy", "drop")
                },
                "last_cycle": None if self.last_prefix_cycle is None else self.last_prefix_cycle.to_dict(),
            },
            "metrics_url": self.metrics_url,
        }

    async def _publish_status(self) -> None:
        self._status_at = time.monotonic()
        lease = self.runtime.primary_lease
        try:
            await self.runtime.discovery.put(
                status_key(self.namespace, lease), json.dumps(self.status()).encode(), lease=lease
            )
        except RuntimeMeshError as e:
            logger.debug("publishing rescheduler status: %s", e)
