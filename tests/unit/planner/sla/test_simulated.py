"""The SLA controller as the simulator's scaler: ``SimulatedPlanner`` driving ``SlaController`` through
``components.sim.replay`` on a small synthetic load, a step up and back down; the pool follows.

The replay does not yet publish the frontends' request reports into its fleet view (another change wires it); until
it does, ``WithRequestReports`` adds them to each snapshot the scaler sees, built from the workload's own arrivals, as
a frontend would report them: one report per pull of the requests that arrived since the previous one, each counted
as finished with its output (the SLA loop reads rate, prompt length and output length; no latency, so no correction).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import pytest

from components.fleet.model import FleetSnapshot, RequestRecord
from components.planner.config import PlannerConfig
from components.planner.controller import PlannerController
from components.planner.simulated import SimulatedPlanner
from components.planner.sla import replicas
from components.planner.sla.config import SlaPlannerConfig
from components.planner.sla.controller import SlaController
from components.protocol.messages import RequestStatsReport
from components.sim import FleetSpec, SimRequest, Workload, replay
from components.sim.dynamics import DECODE, PREFILL, PoolState, Resize
from components.sim.replay import MODEL
from components.workers.simulated import MockEngineConfig

pytestmark = pytest.mark.unit

ENGINE = MockEngineConfig(enable_prefix_caching=False)  # every prompt computed in full
ISL, OSL = 1000, 50


def load(phases: Sequence[tuple[float, float, float]], isl: int = ISL) -> tuple[SimRequest, ...]:
    """Evenly spaced arrivals: (start_s, end_s, requests/s) per phase."""
    out = []
    for start, end, rate in phases:
        n = round((end - start) * rate)
        out += [start + k / rate for k in range(n)]
    return tuple(SimRequest(t, tuple((7 * i + j) % 100_000 for j in range(isl)), OSL) for i, t in enumerate(out))


@dataclasses.dataclass
class WithRequestReports:
    """The scaler ``planner``, seeing the workload's arrivals as request reports (module docstring)."""

    planner: SimulatedPlanner
    requests: tuple[SimRequest, ...]
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    last_s: float = -math.inf

    @property
    def interval_s(self) -> float:
        return self.planner.interval_s

    @property
    def start_s(self) -> float:
        return self.planner.start_s

    @property
    def until_s(self) -> float:
        return self.planner.until_s

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]:
        arrived = [r for r in self.requests if self.last_s < r.arrival_s <= now_s]
        n = len(arrived)
        if self.last_s > -math.inf:
            report = RequestStatsReport(
                model=MODEL,
                interval_s=now_s - self.last_s,
                requests=n,
                prompt_tokens=sum(len(r.prompt) for r in arrived),
                finished=n,
                output_tokens=n * OSL,
            )
            self.records.append(RequestRecord(now_s, "trace", report))
        self.last_s = now_s
        snap = dataclasses.replace(fleet, requests={MODEL: tuple(self.records)})
        return self.planner.pull(now_s, snap, pools)

    def resize_done(self, pool: str, now_s: float) -> None:
        self.planner.resize_done(pool, now_s)


def test_the_sla_planner_on_the_simulator_follows_a_step_up_and_down():
    # 2 requests/s for 20 s, 60 requests/s for 20 s, 2 requests/s for 50 s; 1000-token prompts, 50-token outputs, on
    # the simulated engine's defaults. Decisions every 5 s, a 2 s start-up (lead 1 interval), constant predictor.
    cfg = SlaPlannerConfig(
        adjustment_interval=5.0,
        metric_pulling_interval=1.0,
        worker_startup_s=2.0,
        load_predictor="constant",
        no_correction=True,
    )
    # What 60 and 2 requests/s need by the replica formulas (aggregated: both demands' worker fractions added).
    model = ENGINE.step_time_model

    def need(rate: float) -> int:
        _, p = replicas.prefill_workers(rate, ISL, model, cfg.ttft_s, queue_wait=True)
        _, d = replicas.decode_workers(rate, ISL, OSL, model, cfg.itl_s)
        share = p.metrics["demand_tokens_per_s"] / (p.metrics["max_utilisation"] * p.metrics["worker_tokens_per_s"])
        return math.ceil(share + d.metrics["demand_tokens_per_s"] / d.metrics["worker_tokens_per_s"])

    high, low = need(60), need(2)
    assert (high, low) == (3, 1)
    requests = load([(0.0, 20.0, 2.0), (20.0, 40.0, 60.0), (40.0, 90.0, 2.0)])
    planner = SimulatedPlanner(cfg, until_s=90.0)
    assert isinstance(planner.controller, SlaController)
    scaler = WithRequestReports(planner, requests)
    res = replay(Workload("step", requests), FleetSpec(workers=1, engine=ENGINE, startup_s=2.0), scaler=scaler)

    def size_at(t: float) -> int:
        return sum(1 for start, end in res.spans[DECODE] if start <= t and (end is None or end > t))

    ups = [a for a in res.actions if a.direction == "up"]
    downs = [a for a in res.actions if a.direction == "down"]
    # Nothing moves before the step. Within seconds of it the one worker's queue breaks the TTFT target, and the
    # fast loop sizes the pool on the last seconds' rate: the high pool at once (several workers in one step),
    # before the first throughput decision after the step (25 s) would. The pool comes back down after the step.
    assert all(a.decided_s > 20.0 for a in res.actions)
    assert ups and 20.0 < ups[0].decided_s < 25.0 and (ups[0].before, ups[0].target) == (1, high)
    assert "fast loop" in ups[0].reason
    # At most one more: the one worker holding the step's first seconds' queue (it keeps it: the router does not
    # move a queue) is counted as busy with it for part of the next interval, which the rate's 3 do not cover
    # (components/planner/sla/controller.py, "Fast loop").
    assert high <= max(size_at(t) for t in range(20, 41)) <= high + 1
    # Before the step ends a removal only takes back that one (not below the rate's 3).
    assert downs and all(a.decided_s > 40.0 or a.target >= high for a in downs)
    assert size_at(89.0) == low
    # The decisions the replay carried out are the controller's own, with its SLA figures on every pull.
    assert all(p.outcome.sla is not None for p in planner.pulls)
    assert res.ttft_s and len(res.ttft_s) == len(requests)


def test_disaggregated_the_prefill_pool_follows_the_step_and_the_ttft_stays_low():
    # 3000-token prompts (over the decode workers' 1000-token local limit: prefilled remotely while the shared queue
    # has room), 2 -> 30 -> 2 requests/s; 1 prefill + 1 decode worker to start. Prefill needs
    # 30 x 3000 tokens/s over one worker's throughput at that length within the TTFT target: 3 workers at the step,
    # 1 before and after; decode, 1 throughout by the throughput loop.
    cfg = SlaPlannerConfig(
        adjustment_interval=5.0,
        metric_pulling_interval=1.0,
        worker_startup_s=2.0,
        load_predictor="constant",
        no_correction=True,
        itl=20.0,
    )
    model = ENGINE.step_time_model
    assert replicas.prefill_workers(30, 3000, model, cfg.ttft_s, queue_wait=True)[0] == 3
    assert replicas.prefill_workers(2, 3000, model, cfg.ttft_s, queue_wait=True)[0] == 1
    requests = load([(0.0, 20.0, 2.0), (20.0, 40.0, 30.0), (40.0, 90.0, 2.0)], isl=3000)
    planner = SimulatedPlanner(cfg, until_s=90.0)
    scaler = WithRequestReports(planner, requests)
    fleet = FleetSpec(workers=1, prefill=1, engine=ENGINE, startup_s=2.0)
    res = replay(Workload("step", requests), fleet, scaler=scaler)

    def size_at(pool: str, t: float) -> int:
        return sum(1 for start, end in res.spans[pool] if start <= t and (end is None or end > t))

    assert all(a.decided_s > 20.0 for a in res.actions)
    assert max(size_at(PREFILL, t) for t in range(20, 41)) == 3
    assert (size_at(PREFILL, 89.0), size_at(DECODE, 89.0)) == (1, 1)
    assert res.remote > 0 and len(res.ttft_s) == len(requests)
    # The mean TTFT over the whole run stays under the 500 ms target (seen: 0.28 s; the burst's first seconds, before
    # any new worker serves, reach ~2 s).
    assert sum(res.ttft_s) / len(res.ttft_s) < cfg.ttft_s
    # The pools' sizes never passed the default 8-GPU budget.
    assert max(size_at(PREFILL, t / 2) + size_at(DECODE, t / 2) for t in range(180)) <= cfg.max_gpu_budget


def test_the_load_planner_is_still_the_default_for_its_config():
    planner = SimulatedPlanner(PlannerConfig())
    assert isinstance(planner.controller, PlannerController) and planner.interval_s == 1.0
    cfg = SlaPlannerConfig(metric_pulling_interval=2.0)
    ctl = SlaController(cfg, MODEL)
    assert SimulatedPlanner(cfg, controller=ctl).controller is ctl
    with pytest.raises(ValueError, match="the controller's own config"):
        SimulatedPlanner(SlaPlannerConfig(), controller=ctl)


def test_the_simulated_sla_planner_reads_the_profile_its_config_names(tmp_path):
    from tests.unit.planner.sla.test_sla_profile import profile

    profile().save(tmp_path / "p.json")
    planner = SimulatedPlanner(SlaPlannerConfig(profile_results_dir=str(tmp_path)))
    assert isinstance(planner.controller, SlaController) and planner.controller.perf is not None
    assert planner.controller.perf.prefill_ms(1024) == pytest.approx(50.96)  # 10 + 0.04 x 1024: the profile's


def test_the_simulated_sla_planner_warm_starts_from_its_configs_trace_as_the_live_one_does(tmp_path):
    # Two seasons of 4 intervals (30 s each) at 10, 40, 10, 40 requests/s, as an Azure trace: the simulator's
    # planner warm-starts its predictors from the config's load_predictor_warmup_trace before any pull (as
    # components/planner/main.py's make_controller does), so its first forecast is the season's, not nothing.
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    t = 0.0
    for k in range(8):
        rate = 10 if k % 2 == 0 else 40
        for i in range(30 * rate):
            s = 30.0 * k + i / rate
            lines.append(f"2023-11-16 18:{int(s // 60):02d}:{s % 60:09.6f},1000,200")
            t = s
    lines.append(f"2023-11-16 18:{int((t + 1) // 60):02d}:{(t + 1) % 60:09.6f},1000,200")  # closes the 8th interval
    path = tmp_path / "yesterday.csv"
    path.write_text("\n".join(lines) + "\n")
    cfg = SlaPlannerConfig(
        load_predictor="holt-winters", load_predictor_season=4, load_predictor_warmup_trace=str(path)
    )
    planner = SimulatedPlanner(cfg)
    assert isinstance(planner.controller, SlaController)
    assert planner.controller.rate.ready and planner.controller.isl.ready
    assert planner.controller.rate.predict_ahead(2) == pytest.approx([10, 40], rel=0.05)
    cold = SimulatedPlanner(SlaPlannerConfig(load_predictor="holt-winters", load_predictor_season=4))
    assert isinstance(cold.controller, SlaController) and not cold.controller.rate.ready
