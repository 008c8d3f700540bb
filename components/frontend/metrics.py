"""The frontend's Prometheus metrics, in a registry of its own (several frontends in one test process must not
share the global one).

Names follow Dynamo's frontend where it has the metric (``dynamo_frontend_*`` -> ``kvmesh_frontend_*``). Inter-token
latency is observed once per request, as the mean gap between its output tokens ((last - first) / (n - 1)): a worker
sends tokens in chunks, so per-token gaps would mostly be zeros, and one observation per request keeps the hot path
free of per-token work.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, exposition, generate_latest

CONTENT_TYPE = exposition.CONTENT_TYPE_LATEST

# Seconds. TTFT from a few ms (mock workers, cached prefixes) to minutes (a long queue); ITL from 1 ms to 1 s.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class ModelMetrics:
    """The children of every labelled metric for one model, resolved once (``labels()`` costs a lock and a dict)."""

    __slots__ = ("e2e", "inflight", "input_tokens", "itl", "output_tokens", "ttft")

    def __init__(self, m: FrontendMetrics, model: str) -> None:
        self.ttft = m.ttft.labels(model=model)
        self.itl = m.itl.labels(model=model)
        self.e2e = m.e2e.labels(model=model)
        self.inflight = m.inflight.labels(model=model)
        self.input_tokens = m.input_tokens.labels(model=model)
        self.output_tokens = m.output_tokens.labels(model=model)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvmesh_frontend_requests",
            "HTTP requests answered, by endpoint, model and status code",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.inflight = Gauge("kvmesh_frontend_inflight_requests", "Requests being generated", ["model"], registry=r)
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
        self._models: dict[str, ModelMetrics] = {}

    def model(self, name: str) -> ModelMetrics:
        mm = self._models.get(name)
        if mm is None:
            mm = self._models[name] = ModelMetrics(self, name)
        return mm

    def count_request(self, endpoint: str, model: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, model=model, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
