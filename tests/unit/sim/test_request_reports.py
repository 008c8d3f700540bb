"""The simulated frontend's request reports (components/sim/replay.py, ``_STATS``): with a scaler, one
``RequestStatsReport`` per virtual second reaches the fleet view the scaler reads, and summed they are the replay's
own per-request results. Expected values come from the ``RunResult`` and the workload (each request's arrival time,
first-token time = arrival + its TTFT), never from the reports' producer."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from components.fleet.model import FleetSnapshot, RequestRecord
from components.router import Router
from components.sim import FleetSpec, Workload, replay
from components.sim.dynamics import PoolState, Resize
from components.sim.replay import SIM_FRONTEND
from components.sim.workloads import synthetic
from components.workers.simulated import MockEngineConfig

pytestmark = pytest.mark.unit

UNTIL_S = 40.0  # past the last finish of every workload below (asserted), so the last pull has heard every report


@dataclasses.dataclass
class Listener:
    """A scaler that never resizes and keeps the request reports the fleet view held at its last pull."""

    interval_s: float = 1.0
    start_s: float = 1.0
    until_s: float = UNTIL_S
    heard: tuple[RequestRecord, ...] = ()

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]:
        self.heard = fleet.requests.get("sim", ())
        return []

    def resize_done(self, pool: str, now_s: float) -> None:
        pass


def workload() -> Workload:
    return synthetic("system_prompts", 60, vocab_size=1000, seed=3).at_rate(5.0)  # arrivals over ~12 s


FLEETS = {
    "aggregated": FleetSpec(workers=3, engine=MockEngineConfig(num_gpu_blocks=512)),
    # Remote prefills: first tokens come from the prefill engines' deliveries.
    "disaggregated": FleetSpec(
        workers=2, prefill=2, engine=MockEngineConfig(num_gpu_blocks=2048), max_local_prefill_length=50
    ),
}


@pytest.mark.parametrize("fleet", sorted(FLEETS))
def test_the_reports_summed_are_the_replays_own_results(fleet: str):
    w = workload()
    listener = Listener()
    res = replay(w, FLEETS[fleet], "kv", seed=1, scaler=listener)
    assert res.last_finish_s < UNTIL_S - 1
    if fleet == "disaggregated":
        assert res.remote > 0
    heard = listener.heard
    # One report a second from the simulated frontend, received at the end of each interval, none missing.
    assert [r.received_s for r in heard] == [float(k) for k in range(1, len(heard) + 1)]
    assert len(heard) >= UNTIL_S - 1 and {r.source for r in heard} == {SIM_FRONTEND}
    reports = [r.report for r in heard]
    assert all(r.model == "sim" and r.interval_s == 1.0 for r in reports)
    n = len(w.requests)
    assert sum(r.requests for r in reports) == sum(r.finished for r in reports) == n
    assert sum(r.failed for r in reports) == 0
    assert sum(r.prompt_tokens for r in reports) == res.prompt_tokens
    assert sum(r.output_tokens for r in reports) == res.output_tokens
    assert sum(r.ttft_count for r in reports) == len(res.ttft_s) == n
    assert math.isclose(sum(r.ttft_sum_s for r in reports), sum(res.ttft_s), rel_tol=1e-9)
    assert max(r.ttft_max_s for r in reports) == max(res.ttft_s)
    # One gap per token after a request's first; every chunk here carries one token, so the replay's gaps too.
    outputs = [r.max_tokens for r in w.requests]  # ignore_eos: each request generates max_tokens
    assert sum(r.itl_count for r in reports) == sum(o - 1 for o in outputs) == len(res.itl_s)
    assert math.isclose(sum(r.itl_sum_s for r in reports), sum(res.itl_s), rel_tol=1e-9)
    assert max(r.itl_max_s for r in reports) == max(res.itl_s)
    # Counts go to the interval they happened in: the reports up to the one at k hold the arrivals and first tokens
    # at or before k (the first arrival is at 0).
    firsts = [r.arrival_s + t for r, t in zip(w.requests, res.ttft_by_request_s, strict=True)]
    requests = prompt_tokens = ttft_count = 0
    for k, rep in enumerate(reports, start=1):
        requests += rep.requests
        prompt_tokens += rep.prompt_tokens
        ttft_count += rep.ttft_count
        assert requests == sum(1 for r in w.requests if r.arrival_s <= k), k
        assert prompt_tokens == sum(len(r.prompt) for r in w.requests if r.arrival_s <= k), k
        assert ttft_count == sum(1 for f in firsts if f <= k), k
    # After the last finish: reports of zeros (heard, no load), not silence.
    idle = [r for r in heard if r.received_s > res.last_finish_s + 1]
    assert idle and all((r.report.requests, r.report.finished, r.report.itl_count) == (0, 0, 0) for r in idle)


def test_the_reports_change_nothing_the_replay_does():
    # The same scaled replay with a report every second and with (virtually) none: every field of the result equal.
    w = workload()
    fleet = FLEETS["aggregated"]
    often = replay(w, fleet, "kv", seed=1, scaler=Listener())
    never = replay(w, fleet, "kv", seed=1, scaler=Listener(), request_stats_interval_s=1e9)
    assert often == never


def test_a_static_replay_reports_nothing(monkeypatch):
    # Without a scaler nobody reads the fleet view's requests: the replay applies none (its events are those it had
    # before request reports existed). The router it made is watched to read its fleet view afterwards.
    module = sys.modules["components.sim.replay"]  # the package exports the function under the module's name
    routers: list[Router] = []

    class Watched(Router):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            routers.append(self)

    monkeypatch.setattr(module, "Router", Watched)
    res = replay(workload(), FLEETS["aggregated"], "kv", seed=1)
    [router] = routers
    assert router.fleet.snapshot(res.last_finish_s).requests == {}
    # The same replay with a scaler has them: the check above can see reports.
    replay(workload(), FLEETS["aggregated"], "kv", seed=1, scaler=Listener())
    assert len(routers[1].fleet.snapshot(res.last_finish_s).requests["sim"]) > 0


def test_the_reports_come_on_the_phase_given():
    # A live frontend reports on its own cadence, from its own start (here 0.3 s past each second, as the bench
    # planner-live measures it): the first report, at 0.3, holds the arrivals in [0, 0.3], each later one those of
    # the second before it, so a planner's window counts the arrivals up to its last report's phase.
    w = workload()
    listener = Listener()
    res = replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=listener, request_stats_offset_s=0.3)
    heard = listener.heard
    assert [r.received_s for r in heard] == pytest.approx([0.3 + k for k in range(len(heard))])
    assert len(heard) >= UNTIL_S - 1
    requests = 0
    for rep in heard:
        requests += rep.report.requests
        assert requests == sum(1 for r in w.requests if r.arrival_s <= rep.received_s), rep.received_s
    assert requests == len(w.requests)
    # Only the reports moved: the replay itself is the one at whole seconds.
    assert res == replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=Listener())
    with pytest.raises(ValueError, match="request_stats_offset_s"):
        replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=Listener(), request_stats_offset_s=1.0)


@dataclasses.dataclass
class Watcher(Listener):
    """A Listener that also keeps, at each pull, its time, the serving workers with a fresh load report, and the
    request reports heard so far."""

    pulls: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]:
        fresh = sum(1 for i in fleet.serving("sim") if i.fresh(now_s))
        self.pulls.append((now_s, fresh, len(fleet.requests.get("sim", ()))))
        return super().pull(now_s, fleet, pools)


def test_a_scaler_started_before_the_load_watches_a_serving_fleet_from_its_start():
    # A live planner starts with its deployment, before the load: its first pulls see the workers' load reports and
    # the frontend's reports of zero requests. Here the first pull is 2.5 s before the first arrival (at 0): the three
    # workers are there, fresh, from it, and request reports come from the first whole second after it (-2, -1, 0,
    # ...), those before 0 empty: a decision at 7.5 reads the window (-2.5, 7.5] as a live one would.
    w = workload()
    watcher = Watcher(start_s=-2.5)
    res = replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=watcher)
    first_now, first_fresh, _ = watcher.pulls[0]
    assert first_now == -2.5 and first_fresh == 3
    assert [n for _, _, n in watcher.pulls[:3]] == [0, 1, 2]  # at -2.5, -1.5, -0.5: the reports at -2 and -1
    heard = watcher.heard
    assert [r.received_s for r in heard[:3]] == [-2.0, -1.0, 0.0]
    assert [r.report.requests for r in heard[:2]] == [0, 0]
    assert heard[2].report.requests == sum(1 for r in w.requests if r.arrival_s <= 0.0) >= 1
    assert sum(r.report.requests for r in heard) == len(w.requests)
    # The load is served as by a fleet started at 0: the same requests' times (worker-seconds count from -2.5).
    late = replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=Listener(start_s=0.0))
    assert res.ttft_by_request_s == late.ttft_by_request_s and res.e2e_s == late.e2e_s


@dataclasses.dataclass
class Ages(Listener):
    """A Listener that keeps, at each pull, the age of every serving worker's load report in the fleet view."""

    ages: list[list[float]] = dataclasses.field(default_factory=list)

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]:
        loads = [i.load for i in fleet.serving("sim")]
        self.ages.append(sorted(round(now_s - x.received_s, 6) for x in loads if x is not None))
        return super().pull(now_s, fleet, pools)


def test_staggered_load_reports_reach_the_fleet_view_each_on_its_workers_phase():
    # Live workers publish every 100 ms, each from its own start: a planner pulling every second reads each worker's
    # report at its own age, 0-100 ms. At one tick for all (the default), every report is the same age at every
    # pull: here 0.05 s (ticks at 0.1 k, pulls at 0.35 + k), for the whole run.
    w = workload()
    together, staggered, again = Ages(start_s=0.35), Ages(start_s=0.35), Ages(start_s=0.35)
    replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=together)
    res = replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=staggered, staggered_load_reports=True)
    assert all(a == pytest.approx([0.05] * 3, abs=1e-6) for a in together.ages)
    # Staggered: three different ages within [0, 0.1), each worker keeping its own from pull to pull.
    first = staggered.ages[0]
    assert len(first) == 3 and len(set(first)) == 3 and all(0 <= x < 0.1 for x in first)
    assert all(a == pytest.approx(first, abs=1e-6) for a in staggered.ages)
    # Drawn from the seed (apart from the router's draws): the same seed, the same phases; another, others.
    replay(w, FLEETS["aggregated"], "kv", seed=1, scaler=again, staggered_load_reports=True)
    assert again.ages == staggered.ages
    other = Ages(start_s=0.35)
    replay(w, FLEETS["aggregated"], "kv", seed=2, scaler=other, staggered_load_reports=True)
    assert other.ages[0] != first
    # Every request served (the router reads the reports too: its choices may differ from the tick's).
    assert len(res.e2e_s) == len(w.requests)
