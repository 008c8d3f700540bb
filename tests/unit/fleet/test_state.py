"""What only the in-memory twin's API has (components/fleet/state.py): a model's whole set at once, the listener
calls a reader gets, immutable snapshots, the bounded memory of departed ids; and a router reading a fleet that
already knows workers. The behaviours both views share are in tests/support/fleet.py."""

from __future__ import annotations

from typing import Any

import pytest

from components.fleet.model import LoadRecord
from components.fleet.state import MAX_DEPARTED, REQUEST_HORIZON_S, FleetState
from components.protocol.messages import LoadSnapshot, RequestStatsReport
from components.protocol.migration import WorkerStatus
from components.router import Router, RouterConfig, RouteRequest

pytestmark = pytest.mark.unit


def md(model: str = "m") -> dict[str, Any]:
    return {"model": model, "block_size": 16}


def snap() -> LoadSnapshot:
    return LoadSnapshot(0.0, 0.5, 100, 50, 1, 0, 0, 0, 1, 0)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def fleet_members(self, model: str, joined: set[int], left: set[int]) -> None:
        self.calls.append(("members", model, sorted(joined), sorted(left)))

    def fleet_load(self, instance_id: int, record: LoadRecord | None) -> None:
        self.calls.append(("load", instance_id, None if record is None else record.received_s))

    def fleet_schedulability(self, instance_id: int) -> None:
        self.calls.append(("schedulability", instance_id))


def test_set_members_replaces_a_models_set_and_tells_the_listeners_who_joined_and_left():
    f, rec = FleetState(), Recorder()
    f.add_listener(rec)
    f.set_members("m", [(1, md()), (2, md())])
    f.apply_load(2, snap(), 1.0)
    f.set_members("m", [(1, md()), (3, md())])
    assert rec.calls == [
        ("members", "m", [1, 2], []),
        ("load", 2, 1.0),
        ("load", 2, None),  # 2 left: its report is dropped first, then the model's change is told
        ("members", "m", [3], [2]),
    ]
    assert sorted(f.members("m")) == [1, 3] and f.has_departed(2) and f.load(2) is None
    f.set_members("m", [])
    assert f.models() == [] and f.snapshot(2.0).instances == {}


def test_an_instance_listed_under_another_model_moves_without_leaving():
    f, rec = FleetState(), Recorder()
    f.set_members("a", [(1, md("a")), (2, md("a"))])
    f.apply_status(1, WorkerStatus(False, "draining"))
    f.add_listener(rec)
    f.set_members("b", [(1, md("b"))])
    # b is told 1 is in it (not joined: it was in the fleet), a is told its set changed; nothing left.
    assert rec.calls == [("members", "b", [], []), ("members", "a", [], [])]
    assert sorted(f.members("a")) == [2] and sorted(f.members("b")) == [1]
    assert not f.has_departed(1) and f.unschedulable() == {1: "draining"}  # its status went with it
    assert f.snapshot(0.0).instances[1].model == "b"


def test_a_snapshot_is_immutable_and_later_changes_do_not_reach_it():
    f = FleetState()
    f.add_instance(1, md())
    before = f.snapshot(0.0)
    f.apply_load(1, snap(), 0.5)
    f.apply_status(1, WorkerStatus(False, "draining"))
    f.add_instance(2, md())
    assert before.instances[1].load is None and before.instances[1].schedulable and list(before.instances) == [1]
    with pytest.raises(TypeError):
        before.instances[3] = before.instances[1]  # type: ignore[index]
    after = f.snapshot(0.5)
    assert after.instances[1].load is not None and not after.instances[1].schedulable


def test_departed_ids_are_remembered_up_to_a_bound_oldest_forgotten_first():
    f = FleetState()
    n = MAX_DEPARTED + 2
    for iid in range(n):
        f.add_instance(iid, md())
        f.remove_instance(iid)
    # The first two are forgotten: their late reports count again (as a not-yet-registered instance's would).
    assert not f.has_departed(0) and not f.has_departed(1) and f.has_departed(2) and f.has_departed(n - 1)
    f.apply_load(0, snap(), 1.0)
    f.apply_load(2, snap(), 1.0)
    assert f.load(0) is not None and f.load(2) is None


def test_a_router_given_a_fleet_that_knows_workers_routes_to_them_and_shares_its_reports():
    f = FleetState()
    f.set_members("m", [(1, md()), (2, md()), (3, {"model": "m", "role": "prefill"})])
    f.apply_load(1, snap(), 10.0)
    f.apply_status(2, WorkerStatus(False, "draining"))
    r = Router(RouterConfig(router_policy="round_robin", router_seed=0), fleet=f)
    # The prefill worker is in the fleet, not in the router's table; 2 is unschedulable: 1 is the only choice.
    assert [w.instance_id for w in r.workers("m")] == [1, 2]
    assert r.workers("m")[0].metrics_received_s == 10.0
    assert {r.select(RouteRequest([1, 2], "m", 10.0)).instance_id for _ in range(4)} == {1}
    # What the router is told goes into the same fleet: one picture.
    r.apply_load(2, snap(), 10.1)
    r.set_schedulable(2, True)
    assert f.load(2) is not None and f.is_schedulable(2)
    assert {r.select(RouteRequest([1, 2], "m", 10.1)).instance_id for _ in range(4)} == {1, 2}


# --- request reports (the SLA planner's input) -------------------------------------------------------------------


def _req(model: str = "m", **kw) -> RequestStatsReport:
    return RequestStatsReport(model=model, interval_s=1.0, **kw)


def test_a_request_window_sums_the_reports_received_inside_it_from_every_frontend():
    fleet = FleetState()
    fleet.apply_request_stats("fe-a", _req(requests=3, prompt_tokens=300, ttft_count=2, ttft_sum_s=0.4), 1.0)
    fleet.apply_request_stats("fe-b", _req(requests=1, prompt_tokens=100, finished=2, output_tokens=50), 1.5)
    fleet.apply_request_stats("fe-a", _req(requests=4, prompt_tokens=800, itl_count=10, itl_sum_s=0.2), 2.0)
    fleet.apply_request_stats("fe-a", _req(model="other", requests=9), 2.0)
    snap = fleet.snapshot(2.0)
    w = snap.request_window("m", 1.0)  # (1.0, 2.0]: the report at 1.0 is outside
    assert (w.reports, w.sources, w.requests, w.prompt_tokens) == (2, 2, 5, 900)
    assert w.request_rate == 5 / 1.0 and w.mean_isl == 900 / 5
    assert w.mean_osl == 50 / 2 and w.mean_itl_s == pytest.approx(0.2 / 10) and w.mean_ttft_s is None
    whole = snap.request_window("m", 0.0)
    assert (whole.requests, whole.mean_ttft_s) == (8, pytest.approx(0.2))
    nothing = snap.request_window("unknown", 0.0)
    assert nothing.reports == 0 and nothing.request_rate is None  # nothing heard is not "no load"


def test_request_reports_older_than_the_horizon_are_dropped():
    fleet = FleetState()
    fleet.apply_request_stats("fe", _req(requests=1), 0.0)
    fleet.apply_request_stats("fe", _req(requests=2), REQUEST_HORIZON_S + 1.0)
    snap = fleet.snapshot(REQUEST_HORIZON_S + 1.0)
    assert [r.report.requests for r in snap.requests["m"]] == [2]


def test_a_request_report_survives_its_wire_form():
    r = _req(requests=2, prompt_tokens=10, failed=1, ttft_max_s=0.5, itl_max_s=0.1)
    assert RequestStatsReport.from_dict(r.to_dict()) == r
    assert RequestStatsReport.from_dict({"model": "m", "interval_s": 1.0}) == _req()  # absent counts are 0
