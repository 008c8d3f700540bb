"""The planner's Prometheus metrics and the small HTTP server that exposes them (``GET /metrics``, loopback by
default: ``--metrics-host``/``--metrics-port``, port 0 = a free one, announced on the READY line and by ``kvmesh
status``). A registry of its own, as the frontend's: several planners in one test process must not share one.

The gauges are the figures the TensorBoard scalars hold (``PlannerBoard``), one name per tag, computed at scrape time
from the planner's latest pull and adjustment (absent while unknown, as TensorBoard leaves a point out):

    pull/kv_usage                        kvmesh_planner_kv_usage{model}                   fraction 0..1
    pull/prefill_queue_size              kvmesh_planner_prefill_queue_size{model}         items waiting
    pull/prefill_queue_utilisation       kvmesh_planner_prefill_queue_utilisation{model}  waiting per prefill worker
    pull/running_requests                kvmesh_planner_running_requests{model}           requests
    pull/waiting_requests                kvmesh_planner_waiting_requests{model}           requests
    pull/decode_workers, prefill_workers kvmesh_planner_workers{model,pool}               workers registered
    pull/gpus                            kvmesh_planner_gpus{model}                       GPUs (budget count)
    adjustment/kv_usage, ...             kvmesh_planner_adjustment_kv_usage{model}, ...   the interval's averages
    adjustment/decode_workers, ...       kvmesh_planner_adjustment_target_workers{model,pool}  the targets
    adjustment/gpus                      kvmesh_planner_adjustment_gpus{model}            GPUs after the decisions

The SLA planner's figures (``SlaFigures``, TensorBoard ``sla/*``) as ``kvmesh_planner_sla_<field>{model}``: the
latest pull's, over the latest throughput decision's where a pull leaves one out (observed and predicted load and
latency are known at decisions only); seconds, requests/s, tokens or workers as the field's name says.

Counters: ``kvmesh_planner_decisions_total{model,pool,direction}`` (every decision, hold included; under
``--no-operation`` the would-be ones), ``kvmesh_planner_changes_total{model,pool,direction,outcome}`` (changes the
connector was asked to make: ``done`` or ``failed``), ``kvmesh_planner_pulls_total`` and
``kvmesh_planner_adjustments_total``; gauges ``kvmesh_planner_no_operation{model}`` (1 under --no-operation) and
``kvmesh_planner_change_in_progress{model,pool}``.

Imports prometheus_client; the HTTP server is ``components.runtime.metrics_http``'s (nothing of the mesh).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from components.planner.policy import Adjustment, Observation, Pool, PullFigures
from components.planner.sla.figures import SlaFigures

logger = logging.getLogger(__name__)


class PlannerMetrics:
    """What ``/metrics`` shows for one planner (module docstring)."""

    def __init__(self, model: str, no_operation: bool = False) -> None:
        self.model = model
        self.no_operation = no_operation
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "kvmesh_planner_decisions",
            "Scaling decisions by pool and direction (up, down, hold); under --no-operation, what it would do",
            ["model", "pool", "direction"],
            registry=self.registry,
        )
        self.changes = Counter(
            "kvmesh_planner_changes",
            "Pool changes the connector was asked to make, by outcome (done, failed)",
            ["model", "pool", "direction", "outcome"],
            registry=self.registry,
        )
        self.pulls = Counter("kvmesh_planner_pulls", "Metric pulls", ["model"], registry=self.registry)
        self.adjustments = Counter(
            "kvmesh_planner_adjustments", "Adjustment intervals decided", ["model"], registry=self.registry
        )
        self.last_pull: tuple[Observation, PullFigures, int, int] | None = None
        self.last_adjustment: Adjustment | None = None
        self.sla_figures: dict[str, float] = {}  # the SLA planner's latest numbers (module docstring)
        self.in_progress: Callable[[], Mapping[Pool, object]] = dict
        self.registry.register(_Figures(self))

    def pull(self, obs: Observation, figures: PullFigures, running: int, waiting: int) -> None:
        self.pulls.labels(self.model).inc()
        self.last_pull = (obs, figures, running, waiting)

    def sla(self, figures: SlaFigures) -> None:
        self.sla_figures.update(figures.scalars())

    def adjustment(self, adj: Adjustment) -> None:
        self.adjustments.labels(self.model).inc()
        for d in adj.decisions:
            self.decisions.labels(self.model, str(d.pool), str(d.direction)).inc()
        self.last_adjustment = adj

    def change(self, pool: Pool, direction: str, ok: bool) -> None:
        self.changes.labels(self.model, str(pool), direction, "done" if ok else "failed").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Figures(Collector):
    """The gauges, computed at scrape time from the latest pull and adjustment."""

    def __init__(self, metrics: PlannerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        model = m.model

        def gauge(name: str, doc: str, value: float | None, extra: Mapping[str, str] | None = None) -> Metric:
            labels = ["model", *(extra or {})]
            g = GaugeMetricFamily(name, doc, labels=labels)
            if value is not None:
                g.add_metric([model, *(extra or {}).values()], float(value))
            return g

        yield gauge("kvmesh_planner_no_operation", "1 when the planner only reports (--no-operation)", m.no_operation)
        changing = GaugeMetricFamily(
            "kvmesh_planner_change_in_progress", "1 while a pool change is being made", labels=["model", "pool"]
        )
        pending = m.in_progress()
        for pool in Pool:
            changing.add_metric([model, str(pool)], 1.0 if pool in pending else 0.0)
        yield changing
        if m.last_pull is not None:
            obs, fig, running, waiting = m.last_pull
            yield gauge("kvmesh_planner_kv_usage", "Mean KV-cache use of fresh decode workers, 0..1", fig.kv_usage)
            yield gauge("kvmesh_planner_prefill_queue_size", "Prefill queue items waiting", fig.queue_waiting)
            yield gauge(
                "kvmesh_planner_prefill_queue_utilisation",
                "Prefill queue items waiting per prefill worker",
                fig.queue_utilisation,
            )
            yield gauge("kvmesh_planner_running_requests", "Requests running on fresh decode workers", running)
            yield gauge("kvmesh_planner_waiting_requests", "Requests waiting on fresh decode workers", waiting)
            workers = GaugeMetricFamily(
                "kvmesh_planner_workers", "Workers registered per pool", labels=["model", "pool"]
            )
            workers.add_metric([model, str(Pool.DECODE)], obs.decode.workers)
            if obs.prefill is not None:
                workers.add_metric([model, str(Pool.PREFILL)], obs.prefill.workers)
            yield workers
            yield gauge("kvmesh_planner_gpus", "GPUs the registered workers count for in the budget", fig.gpus)
        for name, value in sorted(m.sla_figures.items()):
            yield gauge(f"kvmesh_planner_sla_{name}", f"SLA planner: {name.replace('_', ' ')}", value)
        adj = m.last_adjustment
        if adj is not None:
            decode, prefill = adj.decision(Pool.DECODE), adj.decision(Pool.PREFILL)
            yield gauge(
                "kvmesh_planner_adjustment_kv_usage",
                "The last interval's mean KV-cache use of decode workers, 0..1",
                None if decode is None else decode.metrics.get("kv_usage"),
            )
            yield gauge(
                "kvmesh_planner_adjustment_prefill_queue_size",
                "The last interval's mean prefill queue items waiting",
                None if prefill is None else prefill.metrics.get("queue_waiting"),
            )
            yield gauge(
                "kvmesh_planner_adjustment_prefill_queue_utilisation",
                "The last interval's prefill queue utilisation (items waiting per prefill worker)",
                None if prefill is None else prefill.metrics.get("queue_utilisation"),
            )
            targets = GaugeMetricFamily(
                "kvmesh_planner_adjustment_target_workers",
                "Workers per pool the last adjustment decided",
                labels=["model", "pool"],
            )
            for d in adj.decisions:
                targets.add_metric([model, str(d.pool)], d.target)
            yield targets
            yield gauge("kvmesh_planner_adjustment_gpus", "GPUs with the last decisions applied", adj.gpus_after)
