"""The frontend's prefill-queue gauges (components/frontend/metrics.py): per model, rendered at scrape time from the
prefill workers' reports, with an explicit clock; and the frontend's live fleet view (components/fleet/live.py),
which follows the reports on the event plane (in-memory twins)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from components.fleet.live import LiveFleet
from components.fleet.queues import PrefillQueues, PrefillQueueView
from components.frontend.config import FrontendConfig
from components.frontend.metrics import PREFILL_QUEUE_GAUGES, FrontendMetrics, prefill_queue_families
from components.frontend.server import Frontend
from components.protocol.endpoints import TOPIC_PREFILL_QUEUE
from components.protocol.messages import PrefillQueueReport
from tests.support.mesh import Mesh
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

NS = "ns"
WAITING = "kvmesh_frontend_prefill_queue_waiting"
IN_FLIGHT = "kvmesh_frontend_prefill_queue_in_flight"
OLDEST = "kvmesh_frontend_prefill_queue_oldest_age_seconds"
WORKERS = "kvmesh_frontend_prefill_queue_prefill_workers"
REDELIVERED = "kvmesh_frontend_prefill_queue_redelivered"


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def report(model: str, waiting: int, in_flight: int = 0, oldest_age_s: float = 0.0, redelivered: int = 0, **kw):
    return PrefillQueueReport(model, waiting, in_flight, oldest_age_s, 1, redelivered, False, **kw)


def samples(m: FrontendMetrics) -> dict[tuple[str, str], float]:
    """(metric, model) -> value, parsed back out of the exposition text /metrics serves."""
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        if family.name.startswith("kvmesh_frontend_prefill_queue_"):
            for s in family.samples:
                out[(s.name, s.labels["model"])] = s.value
    return out


def test_the_gauges_show_each_models_freshest_reading_and_its_live_workers():
    clock = Clock()
    m = FrontendMetrics(policy="round_robin", clock=clock)
    q = m.prefill_queues
    # Model a: two prefill workers; worker 2's report is the newer one. Model b: one worker, one redelivered item.
    q.apply(1, report("a", 4, in_flight=1, oldest_age_s=0.3), 0.0)
    q.apply(2, report("a", 3, in_flight=2, oldest_age_s=0.2), 0.05)
    q.apply(3, report("b", 0, in_flight=1, redelivered=1), 0.05)
    clock.now_s = 0.1
    assert samples(m) == {
        (WAITING, "a"): 3,
        (IN_FLIGHT, "a"): 2,
        (OLDEST, "a"): 0.2,
        (WORKERS, "a"): 2,
        (REDELIVERED, "a"): 0,
        (WAITING, "b"): 0,
        (IN_FLIGHT, "b"): 1,
        (OLDEST, "b"): 0,
        (WORKERS, "b"): 1,
        (REDELIVERED, "b"): 1,
    }
    # Worker 3 keeps reporting, the others go silent: after their 1 s, model a has no prefill workers and no numbers
    # (absent, not 0: an empty queue and a queue nobody reports on are different things).
    for t in (0.5, 1.0, 1.5):
        q.apply(3, report("b", 2), t)
    clock.now_s = 1.6
    got = samples(m)
    assert got[(WORKERS, "a")] == 0 and (WAITING, "a") not in got and (IN_FLIGHT, "a") not in got
    assert got[(WORKERS, "b")] == 1 and got[(WAITING, "b")] == 2


def test_a_worker_that_cannot_read_the_queue_counts_but_shows_no_depth():
    families = prefill_queue_families([PrefillQueueView("m", prefill_workers=1, stats_error="nats: timeout")])
    assert [f.name for f in families] == [name for name, _, _ in PREFILL_QUEUE_GAUGES]
    by_name = {f.name: [s.value for s in f.samples] for f in families}
    assert by_name[WORKERS] == [1.0]
    assert all(by_name[name] == [] for name in (WAITING, IN_FLIGHT, OLDEST, REDELIVERED))


def test_no_report_means_no_series_and_help_lines_still_there():
    text = FrontendMetrics(policy="kv").render().decode()
    assert f"# HELP {WAITING} " in text and f"\n{WAITING}{{" not in text


async def test_the_live_fleet_view_applies_the_reports_published_on_the_event_plane():
    mesh = Mesh()
    try:
        worker_rt, frontend_rt = await mesh.runtime(), await mesh.runtime()
        clock = Clock()
        feed = LiveFleet(frontend_rt, NS, clock=clock, watch_membership=False)
        queues = feed.state.queues
        await feed.start()
        try:
            events = worker_rt.namespace(NS).events
            await events.publish(TOPIC_PREFILL_QUEUE, report("m", 2, in_flight=1).to_dict(), source_id=0xA)
            await events.publish(TOPIC_PREFILL_QUEUE, {"not": "a report"}, source_id=0xB)  # counted, not applied
            await events.publish(TOPIC_PREFILL_QUEUE, report("m", 1).to_dict(), source_id=0xC)
            await worker_rt.namespace("other").events.publish(  # another namespace's queue is not ours
                TOPIC_PREFILL_QUEUE, report("x", 9).to_dict(), source_id=0xD
            )
            await wait_until(lambda: _count(queues) == 2 and feed.unparsed[TOPIC_PREFILL_QUEUE] == 1, timeout_s=5)
            view = queues.view("m", clock.now_s)
            assert (view.prefill_workers, view.waiting, view.in_flight) == (2, 1, 0)  # 0xC's report is the newer
            assert queues.models() == ["m"]
        finally:
            await feed.stop()
        assert "fleet-prefill_queue:ns" not in " ".join(frontend_rt.supervisor.task_names)
    finally:
        await mesh.shutdown()


def _count(queues: PrefillQueues) -> int:
    return len(queues.sources())


async def test_the_frontend_renders_what_its_feed_hears():
    mesh = Mesh()
    try:
        frontend = Frontend(FrontendConfig(namespace=NS), await mesh.runtime())
        # Wired to one PrefillQueues, the fleet view's: what the view applies is what /metrics renders.
        assert frontend.fleet.state.queues is frontend.metrics.prefill_queues
        assert frontend.fleet.state is frontend.router.fleet
        await frontend.fleet.start()
        try:
            worker_rt = await mesh.runtime()
            await worker_rt.namespace(NS).events.publish(
                TOPIC_PREFILL_QUEUE, report("m", 5, oldest_age_s=1.5).to_dict(), source_id=7
            )
            await wait_until(lambda: (WAITING, "m") in samples(frontend.metrics), timeout_s=5)
            got = samples(frontend.metrics)
            assert (got[(WAITING, "m")], got[(OLDEST, "m")], got[(WORKERS, "m")]) == (5, 1.5, 1)
        finally:
            await frontend.fleet.stop()
    finally:
        await mesh.shutdown()
