"""The workers' migration counters on the frontend's /metrics (components/frontend/migration_counters.py and
metrics.py): kept per worker with an explicit clock, rendered at scrape time as Prometheus counters, and followed on
the event plane (in-memory twins)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from components.frontend import migration_counters as mc
from components.frontend.config import FrontendConfig
from components.frontend.metrics import FrontendMetrics, migration_families
from components.frontend.server import Frontend
from components.protocol.endpoints import TOPIC_MIGRATION_COUNTERS
from components.protocol.migration import MigrationCountersReport, MigrationOutcomeCount
from tests.support.mesh import Mesh
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

NS = "ns"


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def report(committed_kv: int = 0, committed_recompute: int = 0, pull_failures: int = 0) -> MigrationCountersReport:
    return MigrationCountersReport(
        model="m",
        mode="kv_transfer",
        outcomes=[
            MigrationOutcomeCount("out", "committed", "kv_transfer", committed_kv),
            MigrationOutcomeCount("out", "committed", "recompute", committed_recompute),
            MigrationOutcomeCount("in", "aborted_by_destination", "kv_transfer", 1),
            MigrationOutcomeCount("in", "refused", "", 2),
        ],
        kv_pull_failures=pull_failures,
        aborts_forwarded=3,
        uncertain_commits=0,
    )


def samples(m: FrontendMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name.startswith("kvmesh_worker_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_a_report_survives_the_wire_and_a_foreign_payload_is_not_one():
    r = report(4, 1, 1)
    assert MigrationCountersReport.from_dict(r.to_dict()) == r
    assert mc.parse_report({"not": "one"}) is None
    assert mc.parse_report([1, 2]) is None
    assert mc.parse_report({"model": "m", "outcomes": [["out", "committed"]]}) is None  # a row too short


def test_every_worker_s_counters_render_as_prometheus_counters_by_direction_outcome_and_mode():
    clock = Clock()
    m = FrontendMetrics("round_robin", clock=clock)
    m.migration_counters.apply(0xA, report(4, 1, pull_failures=1), clock.now_s)
    m.migration_counters.apply(0xB, report(2), clock.now_s)
    got = samples(m)
    total = "kvmesh_worker_migrations_total"
    assert got[key(total, model="m", worker="a", direction="out", outcome="committed", mode="kv_transfer")] == 4
    assert got[key(total, model="m", worker="a", direction="out", outcome="committed", mode="recompute")] == 1
    assert got[key(total, model="m", worker="b", direction="out", outcome="committed", mode="kv_transfer")] == 2
    assert got[key(total, model="m", worker="a", direction="in", outcome="refused", mode="")] == 2
    assert got[key("kvmesh_worker_migration_kv_pull_failures_total", model="m", worker="a")] == 1
    assert got[key("kvmesh_worker_migration_kv_pull_failures_total", model="m", worker="b")] == 0
    assert got[key("kvmesh_worker_migration_aborts_forwarded_total", model="m", worker="a")] == 3
    assert got[key("kvmesh_worker_migration_uncertain_commits_total", model="m", worker="b")] == 0
    # A newer report replaces the older one's values (they are the worker's cumulative counts).
    m.migration_counters.apply(0xA, report(5, 1, pull_failures=1), clock.now_s)
    assert samples(m)[key(total, model="m", worker="a", direction="out", outcome="committed", mode="kv_transfer")] == 5


def test_a_silent_worker_is_dropped_with_its_series_and_the_store_is_bounded(monkeypatch):
    clock = Clock()
    m = FrontendMetrics("round_robin", clock=clock)
    m.migration_counters.apply(0xA, report(1), 0.0)
    clock.now_s = mc.FORGET_AFTER_S - 1
    assert {s[1] for s in samples(m)} != set()
    clock.now_s = mc.FORGET_AFTER_S + 1  # not shown once silent for longer (even before another report sweeps)
    assert samples(m) == {}
    monkeypatch.setattr(mc, "MAX_WORKERS", 2)
    store = mc.MigrationCounters()
    for i in range(4):
        store.apply(i, report(i), now_s=float(i))
    store.apply(2, report(9), now_s=4.0)  # heard again: the most recent
    assert [w.instance_id for w in store.workers(4.0)] == [2, 3]
    assert migration_families([])[0].samples == []


async def test_the_frontend_follows_the_reports_on_the_event_plane():
    mesh = Mesh()
    try:
        frontend = Frontend(FrontendConfig(namespace=NS), await mesh.runtime())
        feed = frontend.migration_counters
        assert feed.counters is frontend.metrics.migration_counters
        await feed.start()
        try:
            worker_rt = await mesh.runtime()
            events = worker_rt.namespace(NS).events
            await events.publish(TOPIC_MIGRATION_COUNTERS, report(3).to_dict(), source_id=0xC)
            await events.publish(TOPIC_MIGRATION_COUNTERS, {"not": "a report"}, source_id=0xD)  # counted, not applied
            await worker_rt.namespace("other").events.publish(
                TOPIC_MIGRATION_COUNTERS, report(9).to_dict(), source_id=0xE
            )
            name = key(
                "kvmesh_worker_migrations_total",
                model="m",
                worker="c",
                direction="out",
                outcome="committed",
                mode="kv_transfer",
            )
            await wait_until(lambda: name in samples(frontend.metrics) and feed.num_unparsed == 1, timeout_s=5)
            assert samples(frontend.metrics)[name] == 3
            assert {dict(labels)["worker"] for _, labels in samples(frontend.metrics)} == {"c"}
        finally:
            await feed.stop()
        assert "frontend-migration-counters:ns" not in " ".join(frontend.runtime.supervisor.task_names)
    finally:
        await mesh.shutdown()
