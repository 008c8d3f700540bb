"""The frontend's Prometheus metrics (components/frontend/metrics.py): per-worker counters labelled by hex instance id
and routing decisions labelled by their kind's word, with one series per worker or kind, never one per request."""

from __future__ import annotations

import pytest

from components.frontend.metrics import FrontendMetrics
from components.router.types import DecisionKind

pytestmark = pytest.mark.unit


def test_placements_and_decisions_are_counted_per_worker_and_per_kind():
    m = FrontendMetrics(policy="kv")
    mm = m.model("m")
    # 1000 requests over two workers: 600 on 0xa1 with 64 of 100 prompt tokens cached, 400 on 0xb2 with none.
    for i in range(1000):
        if i % 5 < 3:
            mm.count_placement(0xA1, 100, 64)
            mm.count_decision(DecisionKind.CACHE_HIT)
        else:
            mm.count_placement(0xB2, 100, 0)
            mm.count_decision(DecisionKind.LOAD)
    mm.count_decision(DecisionKind.NOWHERE)
    mm.count_placement(0xC3, 100, 90, 80)  # a worker with a host-memory tier: 80 of its 90 cached tokens loaded

    def value(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, {"model": "m", **labels})

    assert value("kvmesh_frontend_worker_requests_total", worker="a1") == 600
    assert value("kvmesh_frontend_worker_requests_total", worker="b2") == 400
    assert value("kvmesh_frontend_worker_prompt_tokens_total", worker="a1") == 600 * 100
    assert value("kvmesh_frontend_worker_cached_tokens_total", worker="a1") == 600 * 64
    assert value("kvmesh_frontend_worker_cached_tokens_total", worker="b2") == 0  # a series, at zero
    assert value("kvmesh_frontend_worker_cached_tokens_total", worker="c3") == 90
    assert value("kvmesh_frontend_worker_host_cached_tokens_total", worker="c3") == 80
    assert value("kvmesh_frontend_worker_host_cached_tokens_total", worker="a1") == 0
    decided = "kvmesh_frontend_routing_decisions_total"
    assert value(decided, policy="kv", kind="cache_hit") == 600
    assert value(decided, policy="kv", kind="load") == 400
    assert value(decided, policy="kv", kind="nowhere") == 1

    # Bounded cardinality: three workers and three kinds make 3 series per worker counter and 3 decision series.
    text = m.render().decode()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert sum(line.startswith("kvmesh_frontend_worker_requests_total{") for line in lines) == 3
    assert sum(line.startswith(decided + "{") for line in lines) == 3
    assert 'kind="cache_hit"' in text and "DecisionKind" not in text
