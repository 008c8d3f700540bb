"""The frontend's Prometheus metrics, in a registry of its own (several frontends in one test process must not
share the global one).

Names follow Dynamo's frontend where it has the metric (``dynamo_frontend_*`` -> ``kvmesh_frontend_*``). Inter-token
latency is observed once per request, as the mean gap between its output tokens ((last - first) / (n - 1)): a worker
sends tokens in chunks, so per-token gaps would mostly be zeros, and one observation per request keeps the hot path
free of per-token work.

Per worker (``kvmesh_frontend_worker_*{model,worker}``, ``worker`` the instance id in hex as ``kvmesh status`` prints
it): requests, prompt tokens and prefix-cached prompt tokens, counted once per request on the worker that produced
its first output (``Dispatch._place``), so attempts that failed before it and were retried elsewhere count nowhere.
A request that ``Dispatch.resume`` re-issues on another worker counts on each worker it ran on, with the prompt it
was sent there (prompt plus the outputs so far); one moved live by the workers counts where it started only.
``kvmesh_frontend_migrations_total{model,kind}`` counts streams that went on from another worker (``live``,
``failover``) and ``kvmesh_frontend_migration_failures_total{model,reason}`` those that could not.
``kvmesh_frontend_routing_decisions_total{model,policy,kind}`` counts every decision the router returns, retries'
included (so it is at least the number of requests placed); ``kind`` is ``DecisionKind`` (components/router/types.py),
a word, never the free-text reason.

Prefill queues (disaggregated serving), per model, from the ``PrefillQueueReport``s prefill workers publish on
``TOPIC_PREFILL_QUEUE`` (the frontend's live fleet view, ``components.fleet.live.LiveFleet``, follows them into a
``PrefillQueues``, whose module says which reporters count as alive and which report the numbers come from):
``kvmesh_frontend_prefill_queue_*`` gauges ``waiting``, ``in_flight``, ``oldest_age_seconds`` and ``redelivered`` (the
queue, as of the freshest report that read it: absent while no alive prefill worker could read it) and
``prefill_workers`` (alive reporters; 0 once they all went silent). They are computed at scrape time from the reports (a
collector, not gauges set on every report), so a silent worker stops counting without a timer, and a queue nobody reads
is not shown as empty.

Several processes (``kvmesh frontend --replicas N``, components/frontend/replicas.py): with prometheus_client's
``PROMETHEUS_MULTIPROC_DIR`` set in the environment before it is imported, every process writes its counters,
histograms and gauges to files there and ``render`` sums every process's (``kvmesh_frontend_inflight_requests`` over
the live ones), so a scrape answered by any replica counts every replica's requests. The collectors computed at
scrape time (worker info, prefill queues, the router's view) come from the answering process, whose view of the
workers is the same as the others' (with router replica sync, so are its in-flight counts; every replica follows
the KV events, so are its KV blocks).

The router's own view, per worker, at scrape time: ``kvmesh_frontend_router_inflight_requests`` (requests in
flight there as it counts them) and ``kvmesh_frontend_router_kv_blocks`` (blocks its KV index holds, KV policies).

Migrations as the workers count them (``components.frontend.migration_counters`` follows their
``MigrationCountersReport``s on ``TOPIC_MIGRATION_COUNTERS``), rendered at scrape time with the worker's own
cumulative values: ``kvmesh_worker_migrations_total{model,worker,direction,outcome,mode}`` (``direction`` out: the
worker was the source, in: the destination; ``outcome`` committed, aborted_by_source, aborted_by_destination, or
refused at the worker's cap; ``mode`` the one that ran for a committed migration, ``kv_transfer``, ``live`` or
``recompute``: a kv_transfer worker whose migration had to recompute, because the destination could not pull or the
source could not export, counts it as recompute), ``kvmesh_worker_migration_kv_pull_failures_total{model,worker}``
(of the kv_transfer migrations a worker took, those whose pull failed and which its engine computed again),
``kvmesh_worker_migration_aborts_forwarded_total`` and ``kvmesh_worker_migration_uncertain_commits_total``. They are
``kvmesh_worker_*``, not ``kvmesh_frontend_*``: every frontend of a namespace relays the same numbers, which are the
workers' and not what this frontend saw (that is ``kvmesh_frontend_migrations_total``). A worker silent for 5 minutes
is dropped with its series.

Cardinality: one ``worker`` value per worker that ever served a request through this frontend, never one per request.
A worker that leaves keeps its series until the frontend restarts: removing them when the frontend forgets it would
lose the increments since the last scrape, and the frontend does not know when that was. A fleet that churns through
many instance ids over one frontend's life grows the exposition by three series per instance.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, exposition, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from components.fleet.queues import PrefillQueues, PrefillQueueView
from components.frontend.migration_counters import MigrationCounters, WorkerCounters

CONTENT_TYPE = exposition.CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Seconds. TTFT from a few ms (mock workers, cached prefixes) to minutes (a long queue); ITL from 1 ms to 1 s.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


# (name, help, the PrefillQueueView field it shows). Only prefill_workers is never None.
PREFILL_QUEUE_GAUGES = (
    ("kvmesh_frontend_prefill_queue_waiting", "Prefill queue items never delivered to a prefill worker", "waiting"),
    (
        "kvmesh_frontend_prefill_queue_in_flight",
        "Prefill queue items delivered to a prefill worker and not yet acknowledged",
        "in_flight",
    ),
    (
        "kvmesh_frontend_prefill_queue_oldest_age_seconds",
        "Age of the oldest prefill queue item never delivered, as of the freshest report (0 when none waits)",
        "oldest_age_s",
    ),
    (
        "kvmesh_frontend_prefill_queue_prefill_workers",
        "Prefill workers reporting on the queue (silent for 3 of their intervals, at least 1 s: not counted)",
        "prefill_workers",
    ),
    (
        "kvmesh_frontend_prefill_queue_redelivered",
        "Unacknowledged prefill queue items delivered more than once (a prefill worker died or stalled)",
        "redelivered",
    ),
)


def prefill_queue_families(views: Iterable[PrefillQueueView]) -> list[Metric]:
    """The prefill-queue gauges of ``views``, one sample per model and gauge (none where the view says None)."""
    families = [GaugeMetricFamily(name, doc, labels=["model"]) for name, doc, _ in PREFILL_QUEUE_GAUGES]
    for view in views:
        for family, (_, _, field) in zip(families, PREFILL_QUEUE_GAUGES, strict=True):
            value = getattr(view, field)
            if value is not None:
                family.add_metric([view.model], float(value))
    return list(families)


WORKER_INFO_LABELS = ("model", "worker", "engine", "role", "remote_prefill_mode", "migration_mode")


def worker_info_family(workers: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> GaugeMetricFamily:
    """``kvmesh_frontend_worker_info``: 1 per routable worker, labelled with what its metadata says of it, notably
    ``remote_prefill_mode`` (``kv_transfer``: a decode worker receives the KV; ``recompute``: it computes the prompt
    again, as vLLM decode workers do on the CPU build; "" for an aggregated worker) and ``migration_mode`` (``live``:
    a running request's KV is copied to the worker it moves to; ``recompute``: that worker computes it again, as
    vLLM workers do on the CPU build; "": the worker cannot move requests)."""
    family = GaugeMetricFamily(
        "kvmesh_frontend_worker_info",
        "Workers this frontend routes to, by engine, role and how a decode worker takes a remotely prefilled prompt",
        labels=list(WORKER_INFO_LABELS),
    )
    for model, by_id in sorted(workers.items()):
        for iid, meta in sorted(by_id.items()):
            labels = [
                model,
                f"{iid:x}",
                str(meta.get("engine", "")),
                str(meta.get("role", "")),
                str(meta.get("remote_prefill_mode", "")),
                str(meta.get("migration_mode", "")),
            ]
            family.add_metric(labels, 1.0)
    return family


MIGRATION_LABELS = ("model", "worker", "direction", "outcome", "mode")
# (name without _total, help, the MigrationCountersReport field) of the per-worker totals beside the outcomes.
MIGRATION_TOTALS = (
    (
        "kvmesh_worker_migration_kv_pull_failures",
        "kv_transfer migrations a worker took whose KV pull failed (its engine computed the request again)",
        "kv_pull_failures",
    ),
    (
        "kvmesh_worker_migration_aborts_forwarded",
        "Aborts a worker forwarded to where a request had moved",
        "aborts_forwarded",
    ),
    (
        "kvmesh_worker_migration_uncertain_commits",
        "Migration commits a worker got no answer to (the request ended there with a recoverable error)",
        "uncertain_commits",
    ),
)


def migration_families(workers: list[WorkerCounters]) -> list[Metric]:
    """The workers' migration counters (module docstring), one sample per worker and row."""
    outcomes = CounterMetricFamily(
        "kvmesh_worker_migrations",
        "Migrations of running requests as each worker counts them, by direction (out: source, in: destination), "
        "outcome (committed, aborted_by_source, aborted_by_destination, refused) and the mode that ran (kv_transfer, "
        "live, recompute)",
        labels=list(MIGRATION_LABELS),
    )
    totals = [CounterMetricFamily(name, doc, labels=["model", "worker"]) for name, doc, _ in MIGRATION_TOTALS]
    for w in workers:
        r, worker = w.report, f"{w.instance_id:x}"
        for o in r.outcomes:
            outcomes.add_metric([r.model, worker, o.direction, o.outcome, o.mode], float(o.count))
        for family, (_, _, field) in zip(totals, MIGRATION_TOTALS, strict=True):
            family.add_metric([r.model, worker], float(getattr(r, field)))
    return [outcomes, *totals]


class MigrationCountersCollector(Collector):
    """Renders ``counters`` at scrape time (``clock``: the monotonic clock its reports were applied with)."""

    def __init__(self, counters: MigrationCounters, clock: Callable[[], float]) -> None:
        self.counters = counters
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        return iter(migration_families(self.counters.workers(self.clock())))

    def describe(self) -> Iterator[Metric]:
        return iter(migration_families([]))


class WorkerInfoCollector(Collector):
    """Renders ``source()`` (each model's workers and their metadata) at scrape time."""

    def __init__(self, source: Callable[[], Mapping[str, Mapping[int, Mapping[str, Any]]]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        return iter([worker_info_family(self.source())])

    def describe(self) -> Iterator[Metric]:
        return iter([worker_info_family({})])


def router_view_families(view: Mapping[str, Mapping[int, tuple[int, int | None]]]) -> list[Metric]:
    """The router's own view of each worker (``Router.load_view``): requests in flight and indexed KV blocks."""
    inflight = GaugeMetricFamily(
        "kvmesh_frontend_router_inflight_requests",
        "Requests in flight on the worker as the router of the frontend process that answers counts them (its own "
        "and, with router replica sync, those its replicas placed)",
        labels=["model", "worker"],
    )
    blocks = GaugeMetricFamily(
        "kvmesh_frontend_router_kv_blocks",
        "KV blocks the router of the frontend process that answers indexes for the worker (KV-aware policies)",
        labels=["model", "worker"],
    )
    for model, by_id in sorted(view.items()):
        for iid, (n, kv) in sorted(by_id.items()):
            inflight.add_metric([model, f"{iid:x}"], float(n))
            if kv is not None:
                blocks.add_metric([model, f"{iid:x}"], float(kv))
    return [inflight, blocks]


class RouterViewCollector(Collector):
    """Renders ``source()`` (``Router.load_view``) at scrape time."""

    def __init__(self, source: Callable[[], Mapping[str, Mapping[int, tuple[int, int | None]]]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        return iter(router_view_families(self.source()))

    def describe(self) -> Iterator[Metric]:
        return iter(router_view_families({}))


class PrefillQueueCollector(Collector):
    """Renders ``queues`` at scrape time (``clock``: the monotonic clock its reports were applied with)."""

    def __init__(self, queues: PrefillQueues, clock: Callable[[], float]) -> None:
        self.queues = queues
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        return iter(prefill_queue_families(self.queues.views(self.clock())))

    def describe(self) -> Iterator[Metric]:
        return iter(prefill_queue_families(()))


class WorkerMetrics:
    """One worker's children of the per-worker counters, for one model."""

    __slots__ = ("cached_tokens", "host_cached_tokens", "prompt_tokens", "requests")

    def __init__(self, m: FrontendMetrics, model: str, instance_id: int) -> None:
        worker = f"{instance_id:x}"
        self.requests = m.worker_requests.labels(model=model, worker=worker)
        self.prompt_tokens = m.worker_prompt_tokens.labels(model=model, worker=worker)
        self.cached_tokens = m.worker_cached_tokens.labels(model=model, worker=worker)
        self.host_cached_tokens = m.worker_host_cached_tokens.labels(model=model, worker=worker)


class ModelMetrics:
    """The children of every labelled metric for one model, resolved once (``labels()`` costs a lock and a dict);
    those of per-worker and per-kind metrics on first use (one dict lookup per request after that)."""

    __slots__ = (
        "_decisions",
        "_m",
        "_workers",
        "e2e",
        "inflight",
        "input_tokens",
        "itl",
        "model",
        "output_tokens",
        "ttft",
    )

    def count_migration(self, kind: str) -> None:
        """A running request went on from another worker (``live``: moved by the workers; ``failover``)."""
        self._m.migrations.labels(model=self.model, kind=kind).inc()

    def count_migration_failure(self, reason: str) -> None:
        self._m.migration_failures.labels(model=self.model, reason=reason).inc()

    def __init__(self, m: FrontendMetrics, model: str) -> None:
        self._m = m
        self.model = model
        self.ttft = m.ttft.labels(model=model)
        self.itl = m.itl.labels(model=model)
        self.e2e = m.e2e.labels(model=model)
        self.inflight = m.inflight.labels(model=model)
        self.input_tokens = m.input_tokens.labels(model=model)
        self.output_tokens = m.output_tokens.labels(model=model)
        self._decisions: dict[str, Counter] = {}
        self._workers: dict[int, WorkerMetrics] = {}

    def count_decision(self, kind: str) -> None:
        """One routing decision of this ``kind`` (a ``DecisionKind`` value)."""
        child = self._decisions.get(kind)
        if child is None:
            child = self._decisions[kind] = self._m.routing_decisions.labels(
                model=self.model, policy=self._m.policy, kind=kind
            )
        child.inc()

    def count_placement(
        self, instance_id: int, prompt_tokens: int, cached_tokens: int, host_cached_tokens: int = 0
    ) -> None:
        """A request's first output came from ``instance_id``, which served ``cached_tokens`` of its
        ``prompt_tokens`` from its prefix cache, ``host_cached_tokens`` of them loaded from its host-memory tier."""
        wm = self._workers.get(instance_id)
        if wm is None:
            wm = self._workers[instance_id] = WorkerMetrics(self._m, self.model, instance_id)
        wm.requests.inc()
        wm.prompt_tokens.inc(prompt_tokens)
        if cached_tokens:
            wm.cached_tokens.inc(cached_tokens)
        if host_cached_tokens:
            wm.host_cached_tokens.inc(host_cached_tokens)


class FrontendMetrics:
    """``policy``: the router policy's readable name, the ``policy`` label of routing decisions. ``prefill_queues``
    is what the prefill-queue gauges show (``components.frontend.prefill_queue`` fills it), read with ``clock``.
    ``multiprocess_dir`` (default: ``$PROMETHEUS_MULTIPROC_DIR``): render every process's metrics written there
    (module docstring); it must be the directory prometheus_client was imported with."""

    def __init__(
        self,
        policy: str,
        prefill_queues: PrefillQueues | None = None,
        clock: Callable[[], float] = time.monotonic,
        worker_metadata: Callable[[], Mapping[str, Mapping[int, Mapping[str, Any]]]] | None = None,
        multiprocess_dir: str | None = None,
        router_view: Callable[[], Mapping[str, Mapping[int, tuple[int, int | None]]]] | None = None,
    ) -> None:
        self.policy = policy
        self.multiprocess_dir = multiprocess_dir or os.environ.get(MULTIPROC_ENV) or None
        self.prefill_queues = prefill_queues if prefill_queues is not None else PrefillQueues()
        # The workers' migration counters (components.frontend.migration_counters fills it), read with ``clock``.
        self.migration_counters = MigrationCounters()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvmesh_frontend_requests",
            "HTTP requests answered, by endpoint, model and status code",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.inflight = Gauge(
            "kvmesh_frontend_inflight_requests",
            "Requests being generated",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",  # several replicas: the sum over the live ones
        )
        self.ttft = Histogram(
            "kvmesh_frontend_time_to_first_token_seconds",
            "From the request's arrival to its first output token",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvmesh_frontend_inter_token_latency_seconds",
            "Mean gap between a request's output tokens, one observation per request",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvmesh_frontend_request_duration_seconds",
            "From the request's arrival to its last byte",
            ["model"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter("kvmesh_frontend_input_tokens", "Prompt tokens", ["model"], registry=r)
        self.output_tokens = Counter("kvmesh_frontend_output_tokens", "Generated tokens", ["model"], registry=r)
        self.retries = Counter(
            "kvmesh_frontend_retries",
            "Requests sent to another worker before their first token",
            ["reason"],
            registry=r,
        )
        self.migrations = Counter(
            "kvmesh_frontend_migrations",
            "Running requests whose stream went on from another worker: kind=live (moved by the workers, the client "
            "saw a pause), kind=failover (its worker died or broke; re-issued here by recompute)",
            ["model", "kind"],
            registry=r,
        )
        self.migration_failures = Counter(
            "kvmesh_frontend_migration_failures",
            "Requests that failed mid-stream because they could not go on elsewhere, by reason: limit "
            "(--migration-limit re-issues used up, 0 included), nowhere (no other worker took it)",
            ["model", "reason"],
            registry=r,
        )
        self.worker_requests = Counter(
            "kvmesh_frontend_worker_requests",
            "Requests whose output came from this worker (counted at its first output; a retry counts where it ran)",
            ["model", "worker"],
            registry=r,
        )
        self.worker_prompt_tokens = Counter(
            "kvmesh_frontend_worker_prompt_tokens",
            "Prompt tokens of the requests counted in kvmesh_frontend_worker_requests",
            ["model", "worker"],
            registry=r,
        )
        self.worker_cached_tokens = Counter(
            "kvmesh_frontend_worker_cached_tokens",
            "Of those prompt tokens, how many the worker's engine served from its prefix cache",
            ["model", "worker"],
            registry=r,
        )
        self.worker_host_cached_tokens = Counter(
            "kvmesh_frontend_worker_host_cached_tokens",
            "Of those cached tokens, how many the worker's engine loaded from its host-memory KV tier",
            ["model", "worker"],
            registry=r,
        )
        self.routing_decisions = Counter(
            "kvmesh_frontend_routing_decisions",
            "Routing decisions (retries included), by what decided them: pinned, cache_hit, load, imbalance, "
            "affinity, rotation, nowhere",
            ["model", "policy", "kind"],
            registry=r,
        )
        # What /metrics renders: this registry, or with replicas every process's files plus this one's live views.
        self._render_registry = r
        if self.multiprocess_dir is not None:
            self._render_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._render_registry, path=self.multiprocess_dir)
        self._render_registry.register(PrefillQueueCollector(self.prefill_queues, clock))
        self._render_registry.register(MigrationCountersCollector(self.migration_counters, clock))
        if worker_metadata is not None:
            self._render_registry.register(WorkerInfoCollector(worker_metadata))
        if router_view is not None:
            self._render_registry.register(RouterViewCollector(router_view))
        self._models: dict[str, ModelMetrics] = {}
        self._request_children: dict[tuple[str, str, int], Counter] = {}  # count_request: bounded label sets

    def model(self, name: str) -> ModelMetrics:
        mm = self._models.get(name)
        if mm is None:
            mm = self._models[name] = ModelMetrics(self, name)
        return mm

    def count_request(self, endpoint: str, model: str, status: int) -> None:
        key = (endpoint, model, status)
        child = self._request_children.get(key)
        if child is None:  # labels() takes a lock and builds a key per call: once per label set, not per request
            child = self._request_children[key] = self.requests.labels(
                endpoint=endpoint, model=model, status=str(status)
            )
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self._render_registry)
