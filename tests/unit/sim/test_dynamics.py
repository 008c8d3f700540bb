"""The replay loop's hooks (components/sim/dynamics.py): a scaler resizing either pool through the modelled connector
(start-up time, connector delay, a removed worker drained before it exits), a rescheduler moving a running request
(every token once, in order, the KV transfer as one longer gap), and the live planner's controller as the scaler.

Expected times come from the engine's step-time model, as in test_replay.py: with no prefix caching and
``prefill_ms_per_token_sq`` 0, a step computing ``n`` prompt tokens takes ``prefill_ms(n)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest

from components.fleet.model import FleetSnapshot
from components.planner.config import PlannerConfig
from components.planner.simulated import SimulatedPlanner
from components.sim import FleetSpec, SimRequest, Workload, replay
from components.sim.dynamics import DECODE, PREFILL, Migration, PoolState, Resize, RunningRequest
from components.workers.simulated import MockEngineConfig

pytestmark = pytest.mark.unit

P = 400
ENGINE = MockEngineConfig(
    prefill_ms_per_token_sq=0.0,
    max_num_batched_tokens=P,
    num_gpu_blocks=1024,
    enable_prefix_caching=False,
)
MODEL = ENGINE.step_time_model
STEP_S = MODEL.prefill_ms(P) / 1e3  # one prompt's prefill step (~0.2 s at the defaults)


def prompt(tag: int, n: int = P) -> tuple[int, ...]:
    return tuple(10_000 * tag + i for i in range(n))


@dataclasses.dataclass
class Scripted:
    """A scaler that returns the resizes scripted for each pull time, and records what it saw."""

    script: dict[float, list[Resize]]
    interval_s: float = 1.0
    start_s: float = 1.0
    until_s: float = 10.0
    seen: list[tuple[float, dict[str, PoolState], int]] = dataclasses.field(default_factory=list)
    done: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]:
        self.seen.append((now_s, dict(pools), len(fleet.serving("sim"))))
        return self.script.get(round(now_s, 6), [])

    def resize_done(self, pool: str, now_s: float) -> None:
        self.done.append((pool, now_s))


def test_an_added_worker_takes_requests_once_its_start_up_has_passed():
    # One worker; at the pull at t = 1 the scaler asks for 2; start-up 2 s, so the new worker (id 2) registers at
    # 3.0. Round robin over the registered workers: the requests at 2.5 (before) go to worker 1, those after 3.0
    # alternate between the two.
    scaler = Scripted({1.0: [Resize(DECODE, 1, 2, "more")]})
    reqs = [SimRequest(2.5, prompt(1), 1), SimRequest(3.5, prompt(2), 1), SimRequest(3.6, prompt(3), 1)]
    res = replay(Workload("w", tuple(reqs)), FleetSpec(workers=1, engine=ENGINE, startup_s=2.0), scaler=scaler)
    assert res.worker_by_request[0] == 1 and sorted(res.worker_by_request[1:]) == [1, 2]
    [action] = res.actions
    assert (action.pool, action.decided_s, action.done_s, action.direction, action.reason) == (
        DECODE,
        1.0,
        3.0,
        "up",
        "more",
    )
    assert scaler.done == [(DECODE, 3.0)]
    assert res.spans[DECODE] == [(0.0, None), (1.0, None)]  # the new worker holds its GPU from the decision
    # The pull at 2.0 sees one worker starting (registers at 3.0), not settled; the one at 3.0 sees it registered.
    at = {t: (p, n) for t, p, n in scaler.seen}
    assert at[2.0][0][DECODE] == PoolState(active=2, registered=1, held=2, starting_ready_s=(3.0,), settled=False)
    assert at[2.0][1] == 1 and at[3.0][1] == 2 and at[3.0][0][DECODE].settled


def test_the_connector_delay_postpones_the_request_for_a_worker():
    scaler = Scripted({1.0: [Resize(DECODE, 1, 2, "more")]})
    fleet = FleetSpec(workers=1, engine=ENGINE, startup_s=2.0, connector_delay_s=0.5)
    res = replay(Workload("w", (SimRequest(0.0, prompt(1), 1),)), fleet, scaler=scaler)
    assert res.spans[DECODE] == [(0.0, None), (1.5, None)]
    assert res.actions[0].decided_s == 1.5 and res.actions[0].done_s == 3.5
    # While the connector has not acted, the pool counts as changing.
    at = {t: p for t, p, _ in scaler.seen}
    assert not at[2.0][DECODE].settled and at[4.0][DECODE].settled


def test_a_removed_busy_worker_leaves_routing_at_once_and_exits_when_drained():
    # Two workers; request 1 (1000 output tokens, a few ms each: past t = 1) runs on worker 2 (round robin: r0 -> 1,
    # r1 -> 2). At t = 1 the scaler asks for one worker: worker 2 (the last added) leaves routing then, finishes
    # r1, and exits at r1's end.
    scaler = Scripted({1.0: [Resize(DECODE, 2, 1, "fewer")]})
    reqs = (SimRequest(0.0, prompt(1), 1), SimRequest(0.0, prompt(2), 1000), SimRequest(1.5, prompt(3), 1))
    res = replay(Workload("w", reqs), FleetSpec(workers=2, engine=ENGINE), "round_robin", scaler=scaler)
    assert res.worker_by_request == [1, 2, 1]  # the request after the decision goes to the remaining worker
    r1_end = res.first_arrival_s + res.ttft_by_request_s[1] + 999 * res.mean_itl_by_request_s[1]
    assert r1_end > 1.5
    assert res.spans[DECODE][1] == (0.0, pytest.approx(r1_end, rel=1e-9))
    assert res.actions[0].done_s == pytest.approx(r1_end, rel=1e-9) and scaler.done[0][1] == res.actions[0].done_s


def test_a_new_prefill_worker_pops_the_queue_once_registered():
    # Disaggregated: one decode worker, one prefill worker; four long prompts (over the 1000-token local limit) at
    # t = 0 queue for the one prefill worker. The scaler adds a prefill worker at t = 0.1 with no start-up: the
    # queue is then worked by two, so the last prompt is delivered sooner than with one.
    engine = ENGINE.model_copy(update={"max_num_batched_tokens": 2048, "max_model_len": 8192, "num_gpu_blocks": 4096})
    reqs = tuple(SimRequest(0.0, prompt(k, 1500), 1) for k in range(4))
    fleet = FleetSpec(workers=1, engine=engine, prefill=1, startup_s=0.0)
    alone = replay(Workload("w", reqs), fleet)
    scaler = Scripted({0.1: [Resize(PREFILL, 1, 2, "queue")]}, interval_s=0.1, start_s=0.1, until_s=0.15)
    helped = replay(Workload("w", reqs), fleet, scaler=scaler)
    assert helped.remote == alone.remote == 4
    assert len(helped.prefill_busy_s) == 2 and all(b > 0 for b in helped.prefill_busy_s)
    assert max(helped.ttft_by_request_s) < max(alone.ttft_by_request_s)


@dataclasses.dataclass
class MoveOnce:
    """A rescheduler that moves the first running request it sees on worker 1 to worker 2, once."""

    interval_s: float = 1.0
    moved: list[RunningRequest] = dataclasses.field(default_factory=list)

    def cycle(
        self, now_s: float, fleet: FleetSnapshot, running: Mapping[int, Sequence[RunningRequest]]
    ) -> Sequence[Migration]:
        if self.moved or not running.get(1):
            return ()
        r = running[1][0]
        self.moved.append(r)
        return (Migration(r.request_id, 1, 2),)


def test_a_migrated_request_finishes_on_its_destination_with_every_token_once():
    # Request 0 (200 output tokens) on worker 1, request 1 on worker 2 (one token, done early). At the cycle at
    # t = 1 the rescheduler moves request 0 to worker 2: it stops at worker 1's next step end, its KV (prompt and
    # tokens so far) is transferred, and it decodes on at worker 2.
    reqs = (SimRequest(0.0, prompt(1), 200), SimRequest(0.0, prompt(2), 1))
    moving = MoveOnce()
    res = replay(Workload("w", reqs), FleetSpec(workers=2, engine=ENGINE), "round_robin", rescheduler=moving)
    [moved] = moving.moved
    assert moved.request_id == "r0" and moved.worker == 1 and 0 < moved.output_tokens < 200
    assert res.migrations == 1 and res.worker_by_request == [2, 2]
    assert res.output_tokens == 201  # 200 + 1: every token once
    # The longest gap of request 0 holds the KV transfer of its context, so it exceeds a plain decode step.
    engine_transfer_s = ENGINE.kv_transfer_latency_ms / 1e3
    assert max(res.itl_s) > engine_transfer_s
    static = replay(Workload("w", reqs), FleetSpec(workers=2, engine=ENGINE), "round_robin")
    assert static.migrations == 0 and static.worker_by_request == [1, 2]


def test_the_planner_controller_scales_a_saturated_fleet_up_with_its_reason():
    # One worker with a small KV cache, a burst of long requests: KV use stays above the 0.9 up-threshold, so the
    # first adjustment (after adjustment_interval) scales decode up 1 -> 2, and the replay adds the worker.
    engine = ENGINE.model_copy(update={"num_gpu_blocks": 64, "max_model_len": 1024})
    reqs = tuple(SimRequest(0.01 * k, prompt(k, 300), 300) for k in range(12))
    cfg = PlannerConfig(metric_pulling_interval=0.5, adjustment_interval=2.0)
    planner = SimulatedPlanner(cfg, until_s=6.0)
    res = replay(Workload("w", reqs), FleetSpec(workers=1, engine=engine, startup_s=1.0), scaler=planner)
    up = [a for a in res.actions if a.direction == "up"]
    assert up and up[0].before == 1 and up[0].target == 2 and "up-threshold" in up[0].reason
    assert up[0].done_s == pytest.approx(up[0].decided_s + 1.0)
    # The adjustment that scaled up is the controller's own (the same object the replay carried out).
    [first_up] = [a for a in planner.adjustments if a.changes()][:1]
    assert first_up.now_s == up[0].decided_s and first_up.decisions[0].reason == up[0].reason
    assert all(p.outcome.figures.kv_usage is not None for p in planner.pulls[1:4])


def test_the_planner_grows_the_prefill_pool_when_the_queue_backs_up():
    # Disaggregated: one decode and one prefill worker; 60 prompts of 1,500 tokens (over the decode worker's
    # 1,000-token local limit, and a queue cap of 100 instead of the default 3: all queued) within 0.3 s, far
    # faster than one prefill worker empties the queue (a prefill step and a KV transfer per prompt), so items
    # wait for seconds: the queue per prefill worker averages far above the 0.5 up-threshold over the first 2 s
    # interval, and the planner adds a prefill worker. The decision reads the queue the replay reports into the
    # fleet view, as prefill workers do.
    engine = ENGINE.model_copy(update={"max_num_batched_tokens": 2048, "max_model_len": 8192, "num_gpu_blocks": 8192})
    reqs = tuple(SimRequest(0.005 * k, prompt(k % 12, 1500), 2) for k in range(60))
    cfg = PlannerConfig(metric_pulling_interval=0.5, adjustment_interval=2.0)
    planner = SimulatedPlanner(cfg, until_s=8.0)
    fleet = FleetSpec(workers=1, engine=engine, prefill=1, startup_s=0.5, max_prefill_queue_size=100)
    res = replay(Workload("w", reqs), fleet, scaler=planner)
    up = [a for a in res.actions if a.pool == PREFILL and a.direction == "up"]
    assert up and (up[0].before, up[0].target) == (1, 2) and "prefill queue" in up[0].reason
    assert planner.pulls[3].outcome.figures.queue_waiting is not None  # the queue was read from the fleet view
    assert len(res.spans[PREFILL]) >= 2 and res.remote == 60
