"""The rescheduler's Prometheus metrics and the small HTTP server that exposes them (``GET /metrics``, loopback by
default; port 0 = a free one, announced on the READY line and in ``kvmesh status``). A registry of its own, as the
planner's and the frontend's: several reschedulers in one test process must not share one.

Counters (``mode`` is the migration mode that ran, as the source reported it: ``live``, ``kv_transfer``,
``recompute``; for a call that ended without a report, the mode asked for, ``auto`` when the source's own):

    kvmesh_rescheduler_cycles_total{rescheduler}                                    cycles run
    kvmesh_rescheduler_pairs_total{rescheduler,policy}                              pairs chosen (validated)
    kvmesh_rescheduler_rejected_pairs_total{rescheduler,policy}                     candidates the validation refused
    kvmesh_rescheduler_migrations_attempted_total{rescheduler,policy,mode}          migrations tried
    kvmesh_rescheduler_migrations_succeeded_total{rescheduler,policy,mode}          committed
    kvmesh_rescheduler_migrations_failed_total{rescheduler,policy,mode,outcome}     aborted, failed, timed_out
    kvmesh_rescheduler_prefix_actions_total{rescheduler,kind,outcome}               prefix_replication's copies and
                                                                                    drops: succeeded, failed, timed_out

and the gauge ``kvmesh_rescheduler_in_flight_sources{rescheduler}`` (sources with a ``migrate`` call in flight).
``rescheduler`` is ``standalone`` or ``colocated``, where it runs.

Imports prometheus_client; the HTTP server is ``components.runtime.metrics_http``'s (nothing of the mesh).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from components.rescheduler.executor import CallOutcome, PairResult
from components.rescheduler.replicator import ActionResult

AUTO_MODE = "auto"


class ReschedulerMetrics:
    """What ``/metrics`` shows for one rescheduler (module docstring)."""

    def __init__(self, where: str, in_flight: Callable[[], int] = lambda: 0) -> None:
        self.where = where
        self.registry = CollectorRegistry()
        labels = ["rescheduler"]
        self.cycles = Counter("kvmesh_rescheduler_cycles", "Rescheduling cycles run", labels, registry=self.registry)
        self.pairs = Counter(
            "kvmesh_rescheduler_pairs", "Migration pairs chosen, by policy", [*labels, "policy"], registry=self.registry
        )
        self.rejected = Counter(
            "kvmesh_rescheduler_rejected_pairs",
            "Candidate pairs the validation refused, by policy",
            [*labels, "policy"],
            registry=self.registry,
        )
        self.attempted = Counter(
            "kvmesh_rescheduler_migrations_attempted",
            "Migrations tried, by policy and mode",
            [*labels, "policy", "mode"],
            registry=self.registry,
        )
        self.succeeded = Counter(
            "kvmesh_rescheduler_migrations_succeeded",
            "Migrations committed, by policy and mode",
            [*labels, "policy", "mode"],
            registry=self.registry,
        )
        self.failed = Counter(
            "kvmesh_rescheduler_migrations_failed",
            "Migrations not done, by policy, mode and outcome (aborted, failed, timed_out)",
            [*labels, "policy", "mode", "outcome"],
            registry=self.registry,
        )
        self.prefix = Counter(
            "kvmesh_rescheduler_prefix_actions",
            "prefix_replication's KV copies and drops, by kind (copy, drop) and outcome (succeeded, failed, timed_out)",
            [*labels, "kind", "outcome"],
            registry=self.registry,
        )
        self.in_flight = in_flight
        self.registry.register(_Gauges(self))

    def cycle(self, pairs_by_policy: dict[str, int], rejected_by_policy: dict[str, int]) -> None:
        self.cycles.labels(self.where).inc()
        for policy, n in pairs_by_policy.items():
            self.pairs.labels(self.where, policy).inc(n)
        for policy, n in rejected_by_policy.items():
            self.rejected.labels(self.where, policy).inc(n)

    def results(self, results: list[PairResult]) -> None:
        for r in results:
            policy = r.order.policy
            for rep in r.reports:
                mode = rep.mode or r.order.mode or AUTO_MODE
                self.attempted.labels(self.where, policy, mode).inc()
                if rep.state == "committed":
                    self.succeeded.labels(self.where, policy, mode).inc()
                else:
                    self.failed.labels(self.where, policy, mode, "aborted").inc()
            if not r.reports and r.outcome != CallOutcome.DONE:
                mode = r.order.mode or AUTO_MODE
                self.attempted.labels(self.where, policy, mode).inc()
                self.failed.labels(self.where, policy, mode, str(r.outcome)).inc()

    def prefix_actions(self, results: tuple[ActionResult, ...]) -> None:
        for r in results:
            self.prefix.labels(self.where, str(r.action.kind), str(r.outcome)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges(Collector):
    def __init__(self, metrics: ReschedulerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvmesh_rescheduler_in_flight_sources", "Sources with a migrate call in flight", labels=["rescheduler"]
        )
        g.add_metric([self.m.where], float(self.m.in_flight()))
        yield g
