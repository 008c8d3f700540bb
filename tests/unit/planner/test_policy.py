"""The planner's decision policy on its own: every rule of issue 14's "Decisions" with its numbers derived here.

Builders: ``obs(t, ...)`` makes one pull's observation, ``interval(...)`` feeds pulls every metric_pulling_interval
until ``decide`` returns an adjustment. With the default 30 s interval and 1 s pulls, the first interval holds the
pulls at t = 0..30 (31 pulls: the first pull starts it, the one at 30 s ends it); every later one holds 30 pulls.
Values at a threshold are binary fractions (0.5, 0.75, 0.25, ...) so that a mean of equal samples is exactly the
threshold and the boundary is tested, not float noise.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from components.planner.config import PlannerConfig
from components.planner.policy import (
    NEW_DECODE_WORKER_GRACE_PERIOD,
    NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD,
    Adjustment,
    Direction,
    Observation,
    PlannerState,
    Pool,
    PoolView,
    QueueReading,
    WorkerLoad,
    adjust,
    decide,
    observe,
    pull_figures,
)
from components.runtime.flags import add_model_arguments, model_from_args

pytestmark = pytest.mark.unit

CFG = PlannerConfig()
# Binary-exact thresholds for boundary tests: 0.75 up, 0.25 down on both pools.
EXACT = PlannerConfig(
    decode_kv_scale_up_threshold=0.75,
    decode_kv_scale_down_threshold=0.25,
    prefill_queue_scale_up_threshold=1.0,
    prefill_queue_scale_down_threshold=0.25,
)

Value = float | Callable[[float], float] | None


def _at(v: Value, t: float) -> float | None:
    return v(t) if callable(v) else v


def obs(
    t: float,
    *,
    decode: int = 2,
    prefill: int | None = None,
    kv: Value = 0.625,
    waiting: Value = None,
    loads: tuple[WorkerLoad, ...] | None = None,
    decode_starting: int = 0,
    decode_leaving: int = 0,
    prefill_starting: int = 0,
    decode_gpus: int | None = None,
    prefill_gpus: int | None = None,
) -> Observation:
    """One pull at ``t``: every decode worker reports ``kv`` fresh (received now, stale 0.5 s later as the fleet's
    rule has it for a worker reporting every 100 ms) unless ``loads`` is given."""
    k = _at(kv, t)
    if loads is None:
        loads = () if k is None else tuple(WorkerLoad(i, k, t, t + 0.5) for i in range(decode))
    q = _at(waiting, t)
    return Observation(
        now_s=t,
        decode=PoolView(decode, decode_starting, decode_leaving, decode_gpus),
        prefill=None if prefill is None else PoolView(prefill, prefill_starting, 0, prefill_gpus),
        loads=loads,
        queue=None if q is None else QueueReading(int(q), 0, t),
    )


def interval(
    state: PlannerState, start: float, config: PlannerConfig = CFG, **kw: object
) -> tuple[Adjustment, PlannerState, float]:
    """Pulls from ``start`` until an adjustment comes: (adjustment, state, its time)."""
    t = start
    for _ in range(10_000):
        adj, state = decide(state, obs(t, **kw), config)  # type: ignore[arg-type]
        if adj is not None:
            return adj, state, t
        t += config.metric_pulling_interval
    raise AssertionError("no adjustment")


def first(config: PlannerConfig = CFG, **kw: object) -> Adjustment:
    return interval(PlannerState(), 0.0, config, **kw)[0]


def pool(adj: Adjustment, which: Pool):
    d = adj.decision(which)
    assert d is not None
    return d


# ---------------------------------------------------------------------------------------------------------------------
# Config


def test_defaults_are_dynamos_load_planner_flags():
    assert CFG.model_dump() == {
        "adjustment_interval": 30.0,
        "metric_pulling_interval": 1.0,
        "max_gpu_budget": 8,
        "min_gpu_budget": 1,
        "decode_kv_scale_up_threshold": 0.9,
        "decode_kv_scale_down_threshold": 0.5,
        "prefill_queue_scale_up_threshold": 0.5,
        "prefill_queue_scale_down_threshold": 0.2,
        "decode_engine_num_gpu": 1,
        "prefill_engine_num_gpu": 1,
        "no_operation": False,
    }
    assert NEW_DECODE_WORKER_GRACE_PERIOD == 3 and NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD == 3


def test_flags_are_derived_with_their_units_and_parse_back():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, PlannerConfig)
    help_text = " ".join(parser.format_help().split())
    for flag in ("--adjustment-interval", "--metric-pulling-interval", "--max-gpu-budget", "--no-operation"):
        assert flag in help_text
    assert "Seconds between scaling decisions" in help_text and "fraction 0..1" in help_text
    args = parser.parse_args(["--adjustment-interval", "7.5", "--max-gpu-budget", "4"])
    cfg = model_from_args(PlannerConfig, args)
    assert (cfg.adjustment_interval, cfg.no_operation, cfg.max_gpu_budget, cfg.min_gpu_budget) == (7.5, False, 4, 1)


def test_dynamos_no_operation_flag_turns_no_operation_on():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, PlannerConfig)
    assert model_from_args(PlannerConfig, parser.parse_args(["--no-operation"])).no_operation is True
    assert model_from_args(PlannerConfig, parser.parse_args([])).no_operation is False


@pytest.mark.parametrize(
    "bad",
    [
        {"decode_kv_scale_down_threshold": 0.9},  # equal to the up-threshold
        {"prefill_queue_scale_down_threshold": 0.6},  # above it
        {"min_gpu_budget": 9},
        {"metric_pulling_interval": 31},
        {"adjustment_interval": 0},
        {"max_gpu_budget": 0},
        {"surprise": 1},
    ],
)
def test_config_refuses_inconsistent_values(bad):
    with pytest.raises(ValidationError):
        PlannerConfig(**bad)


# ---------------------------------------------------------------------------------------------------------------------
# Decode thresholds


@pytest.mark.parametrize(
    ("kv", "direction", "target"),
    [
        (0.75, Direction.HOLD, 2),  # at the up-threshold: strict, holds
        (0.75 + 2**-10, Direction.UP, 3),  # just above
        (0.5, Direction.HOLD, 2),  # between
        (0.25, Direction.HOLD, 2),  # at the down-threshold
        (0.25 - 2**-10, Direction.DOWN, 1),  # just below
    ],
)
def test_decode_thresholds_at_and_around_the_boundary(kv, direction, target):
    d = pool(first(EXACT, decode=2, kv=kv), Pool.DECODE)
    assert (d.direction, d.current, d.target) == (direction, 2, target)
    assert d.metrics["kv_usage"] == kv and d.metrics["pulls"] == 31 and d.metrics["pulls_with_kv"] == 31


def test_default_thresholds_on_an_interval_average():
    # KV 1.0 for the pulls at t = 0..15 (16 pulls), 0.75 for t = 16..30 (15): mean (16 + 11.25) / 31 = 0.879 < 0.9.
    d = pool(first(kv=lambda t: 1.0 if t <= 15 else 0.75), Pool.DECODE)
    assert d.metrics["kv_usage"] == pytest.approx((16 * 1.0 + 15 * 0.75) / 31)
    assert d.direction == Direction.HOLD and "within [0.5, 0.9]" in d.reason
    # 1.0 for 20 pulls, 0.75 for 11: (20 + 8.25) / 31 = 0.911 > 0.9.
    d = pool(first(kv=lambda t: 1.0 if t < 20 else 0.75), Pool.DECODE)
    assert d.direction == Direction.UP and d.target == 3 and "> up-threshold 0.9" in d.reason


def test_the_per_pull_average_is_over_the_workers_of_that_pull():
    loads = (WorkerLoad(1, 1.0, 0.0, 0.5), WorkerLoad(2, 0.5, 0.0, 0.5))
    assert pull_figures(obs(0.0, loads=loads), CFG).kv_usage == 0.75


# ---------------------------------------------------------------------------------------------------------------------
# Prefill queue utilisation: mean waiting items / prefill workers


@pytest.mark.parametrize(
    ("workers", "waiting", "utilisation", "direction", "target"),
    [
        (2, 2, 1.0, Direction.HOLD, 2),  # 2 items / 2 workers = 1.0: at the up-threshold
        (2, 3, 1.5, Direction.UP, 3),  # above, flat trend: predicted 1.5 too
        (4, 1, 0.25, Direction.HOLD, 4),  # at the down-threshold
        (8, 1, 0.125, Direction.DOWN, 7),  # below
        (2, 0, 0.0, Direction.DOWN, 1),
        (1, 0, 0.0, Direction.HOLD, 1),  # below, but at the one-worker floor
    ],
)
def test_prefill_utilisation_is_waiting_items_per_worker(workers, waiting, utilisation, direction, target):
    adj = first(EXACT, decode=1, prefill=workers, kv=0.5, waiting=waiting)
    d = pool(adj, Pool.PREFILL)
    assert d.metrics["queue_utilisation"] == utilisation
    assert (d.direction, d.current, d.target) == (direction, workers, target)


def test_default_prefill_thresholds():
    # One worker, one item waiting at every pull: 1.0 > 0.5 (up); 5 workers, 1 item: 0.2, at the down-threshold.
    assert pool(first(decode=1, prefill=1, kv=0.625, waiting=1), Pool.PREFILL).direction == Direction.UP
    assert pool(first(decode=1, prefill=5, kv=0.625, waiting=1), Pool.PREFILL).direction == Direction.HOLD


def test_in_flight_items_are_not_queue_size():
    o = dataclasses.replace(obs(0.0, prefill=2, waiting=0), queue=QueueReading(waiting=0, in_flight=2, received_s=0))
    figures = pull_figures(o, CFG)
    assert (figures.queue_waiting, figures.queue_utilisation) == (0, 0.0)


# ---------------------------------------------------------------------------------------------------------------------
# Prefill trend buffer. A 32 s interval keeps the arithmetic exact: the first interval's samples span t = 0..32, so a
# queue going q0 -> q1 has slope (q1 - q0) / 32 per second, projected 3 x 32 = 96 s past the last sample.

TREND = EXACT.model_copy(update={"adjustment_interval": 32.0})


def trend(q0: int, q1: int) -> Callable[[float], float]:
    return lambda t: q0 if t == 0 else q1


@pytest.mark.parametrize(
    ("workers", "q0", "q1", "predicted", "direction"),
    [
        (1, 5, 4, 4 - 3 * 1, Direction.HOLD),  # slope -1/32: 4 - 96/32 = 1.0 = threshold: falls to it -> no worker
        (1, 6, 5, 5 - 3 * 1, Direction.UP),  # 2.0 > 1.0: stays above
        (1, 8, 4, 0, Direction.HOLD),  # 4 - 12 = -8, floored at 0
        (1, 4, 6, 6 + 3 * 2, Direction.UP),  # rising
        # Where kvmesh differs from Dynamo: per worker. Raw 5 - 3 = 2 > 1 would scale up there; 2 / 4 = 0.5 here.
        (4, 6, 5, (5 - 3) / 4, Direction.HOLD),
    ],
)
def test_no_prefill_scale_up_when_the_trend_brings_the_queue_under_the_threshold(workers, q0, q1, predicted, direction):
    d = pool(first(TREND, decode=1, prefill=workers, kv=0.5, waiting=trend(q0, q1)), Pool.PREFILL)
    mean = (q0 + 32 * q1) / 33
    assert d.metrics["queue_utilisation"] == pytest.approx(mean / workers) and mean / workers > 1.0
    assert d.metrics["queue_trend_per_s"] == (q1 - q0) / 32
    assert d.metrics["predicted_utilisation"] == predicted
    assert d.direction == direction
    if direction == Direction.HOLD:
        assert "trend" in d.reason and f"within {NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD} intervals" in d.reason


def test_a_single_queue_sample_has_a_flat_trend():
    # Only the pull at t = 30 saw a report: no slope, predicted = 2 items / 1 worker.
    d = pool(first(decode=1, prefill=1, kv=0.625, waiting=lambda t: 2 if t == 30 else None), Pool.PREFILL)
    assert d.metrics["pulls_with_queue"] == 1 and d.metrics["queue_trend_per_s"] == 0.0
    assert d.metrics["predicted_utilisation"] == 2.0 and d.direction == Direction.UP


# ---------------------------------------------------------------------------------------------------------------------
# Decode grace period


def test_no_decode_scale_down_for_three_intervals_after_one_is_added():
    adj, state, t = interval(PlannerState(), 0.0, decode=2, kv=0.95)
    assert pool(adj, Pool.DECODE).direction == Direction.UP and state.decode_grace == NEW_DECODE_WORKER_GRACE_PERIOD
    # The connector starts it: pulls see it starting, then registered. Nothing in between counts.
    _, state = decide(state, obs(t + 1, decode=2, kv=0.95, decode_starting=1), CFG)
    # From here KV is low (the new worker's cache is empty): 3 adjustments hold, the 4th scales down.
    t += 1
    for left in (3, 2, 1):
        adj, state, t = interval(state, t + 1, decode=3, kv=0.125)
        d = pool(adj, Pool.DECODE)
        assert d.direction == Direction.HOLD and d.target == 3 and d.metrics["grace_left"] == left
        assert "no decode scale-down for 3 intervals" in d.reason and f"({left} left" in d.reason
    adj, state, _ = interval(state, t + 1, decode=3, kv=0.125)
    assert (pool(adj, Pool.DECODE).direction, pool(adj, Pool.DECODE).target) == (Direction.DOWN, 2)


def test_grace_does_not_stop_a_scale_up_or_the_prefill_pool():
    state = PlannerState(decode_grace=2)
    adj, _, _ = interval(state, 0.0, decode=2, prefill=2, kv=0.95, waiting=0)
    assert pool(adj, Pool.DECODE).direction == Direction.UP
    assert pool(adj, Pool.PREFILL).direction == Direction.DOWN


# ---------------------------------------------------------------------------------------------------------------------
# GPU budget and the floor


def test_max_gpu_budget_refuses_a_scale_up():
    # 8 decode workers x 1 GPU = 8 = max: one more would be 9.
    d = pool(first(decode=8, kv=0.95), Pool.DECODE)
    assert d.direction == Direction.HOLD and "would use 9 GPUs > max_gpu_budget 8" in d.reason
    # 7 workers: 8 GPUs after, allowed (<=).
    assert pool(first(decode=7, kv=0.95), Pool.DECODE).target == 8


def test_budget_counts_each_pools_gpus_per_worker_and_zero_counts_as_one():
    # Decode 3 x 2 GPUs + prefill 1 x 1 = 7; one more decode worker needs 2: 9 > 8.
    adj = first(decode=3, prefill=1, kv=0.95, waiting=0, decode_gpus=2)
    assert adj.gpus_before == 7 and pool(adj, Pool.DECODE).direction == Direction.HOLD
    # A simulated worker on 0 GPUs counts as 1: 7 x 1 + 1 = 8 = max, so no room.
    adj = first(decode=7, prefill=1, kv=0.95, waiting=0, decode_gpus=0, prefill_gpus=0)
    assert adj.gpus_before == 8 and pool(adj, Pool.DECODE).direction == Direction.HOLD
    # The config's engine GPUs apply where the deployment gives none: 2 x 4 = 8.
    adj = first(PlannerConfig(decode_engine_num_gpu=4), decode=2, kv=0.95)
    assert adj.gpus_before == 8 and pool(adj, Pool.DECODE).direction == Direction.HOLD


def test_a_scale_down_frees_budget_for_a_scale_up_in_the_same_interval():
    # 4 + 4 = 8 GPUs. Prefill queue empty (down), KV high (up): prefill 4 -> 3 first, then decode 4 -> 5, 8 GPUs.
    adj = first(decode=4, prefill=4, kv=0.95, waiting=0)
    assert [(d.pool, d.direction, d.target) for d in adj.decisions] == [
        (Pool.DECODE, Direction.UP, 5),
        (Pool.PREFILL, Direction.DOWN, 3),
    ]
    assert (adj.gpus_before, adj.gpus_after) == (8, 8)


def test_prefill_takes_the_last_gpu_before_decode():
    # 4 + 3 = 7 GPUs, both pools want one more, one GPU left: prefill (checked first, as Dynamo) gets it.
    adj = first(decode=4, prefill=3, kv=0.95, waiting=6)
    assert pool(adj, Pool.PREFILL).direction == Direction.UP
    d = pool(adj, Pool.DECODE)
    assert d.direction == Direction.HOLD and "would use 9 GPUs" in d.reason
    assert adj.gpus_after == 8


def test_min_gpu_budget_is_per_pool():
    cfg = PlannerConfig(min_gpu_budget=2)
    # 2 decode workers x 1 GPU: down to 1 worker = 1 GPU < 2.
    d = pool(first(cfg, decode=2, kv=0.125), Pool.DECODE)
    assert d.direction == Direction.HOLD and "1 GPUs < min_gpu_budget 2" in d.reason
    # x 2 GPUs: 1 worker = 2 GPUs, allowed.
    assert pool(first(cfg, decode=2, kv=0.125, decode_gpus=2), Pool.DECODE).target == 1


@pytest.mark.parametrize("min_gpu_budget", [0, 1])
def test_a_pool_never_goes_below_one_worker(min_gpu_budget):
    cfg = PlannerConfig(min_gpu_budget=min_gpu_budget)
    d = pool(first(cfg, decode=1, kv=0.0), Pool.DECODE)
    assert (d.direction, d.target) == (Direction.HOLD, 1) and "one worker, its floor" in d.reason


# ---------------------------------------------------------------------------------------------------------------------
# At most one per pool per interval, absolute targets


def test_at_most_one_worker_per_pool_per_interval():
    adj = first(decode=1, prefill=1, kv=1.0, waiting=500)
    assert [(d.current, d.target) for d in adj.decisions] == [(1, 2), (1, 2)]
    assert len(adj.decisions) == len({d.pool for d in adj.decisions}) == 2


# ---------------------------------------------------------------------------------------------------------------------
# No-operation


def test_no_operation_reports_what_it_would_do_and_applies_nothing():
    cfg = PlannerConfig(no_operation=True)
    adj, state, _ = interval(PlannerState(), 0.0, cfg, decode=2, kv=0.95)
    d = pool(adj, Pool.DECODE)
    assert (d.direction, d.target, d.no_operation, d.apply) == (Direction.UP, 3, True, False)
    assert adj.changes() == () and adj.no_operation and adj.gpus_after == 3
    assert d.summary().startswith("decode: would scale up 2 -> 3")
    assert state.decode_grace == 0  # nothing was added
    # Without the flag the same interval is a change to apply.
    real = first(decode=2, kv=0.95)
    assert real.changes() == (pool(real, Pool.DECODE),) and pool(real, Pool.DECODE).summary().startswith(
        "decode: scale up 2 -> 3"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Missing and stale metrics


def test_missing_metrics_hold_with_a_reason():
    adj = first(decode=2, prefill=2, kv=None, waiting=None)
    for d in adj.decisions:
        assert d.direction == Direction.HOLD and d.reason.startswith("missing metrics")
    assert "31 pulls" in pool(adj, Pool.DECODE).reason


def test_a_stale_worker_is_left_out_and_named():
    limit = 0.5  # worker 2's last report arrived at 0 and, by the fleet's rule, goes stale at 0.5 s

    def loads(t: float) -> tuple[WorkerLoad, ...]:
        # Worker 1 fresh at 0.375; worker 2's last snapshot arrived at t = 0 at 1.0, stale from 0.5 s.
        return (WorkerLoad(1, 0.375, t, t + 0.5), WorkerLoad(2, 1.0, 0.0, limit))

    state = PlannerState()
    for t in range(30):
        adj, state = decide(state, obs(float(t), loads=loads(float(t))), CFG)
        assert adj is None
    adj, _ = decide(state, obs(30.0, loads=loads(30.0)), CFG)
    assert adj is not None
    d = pool(adj, Pool.DECODE)
    # The pull at t = 0 averages both: 0.6875; the 30 pulls at t = 1..30 have worker 1 only: 0.375.
    expected = ((0.375 + 1.0) / 2 + 30 * 0.375) / 31
    assert d.metrics["kv_usage"] == pytest.approx(expected)
    assert d.metrics["workers_left_out"] == 1 and "workers [2]" in d.reason
    assert d.direction == Direction.DOWN  # 0.385 < 0.5
    # Fresh strictly before its stale_at_s, stale from that instant on.
    assert pull_figures(obs(limit - 0.001, loads=loads(limit - 0.001)), CFG).left_out == ()
    assert pull_figures(obs(limit, loads=loads(limit)), CFG).left_out == (2,)


def test_non_finite_kv_is_left_out_and_no_queue_reading_is_missing():
    # Which queue report still counts is the fleet view's rule (tests/unit/planner/test_loop.py): no reading, no size.
    o = obs(10.0, prefill=1, loads=(WorkerLoad(1, float("nan"), 10.0, 10.5), WorkerLoad(2, 0.5, 10.0, 10.5)))
    o = dataclasses.replace(o, queue=None)
    figures = pull_figures(o, CFG)
    assert (figures.kv_usage, figures.left_out, figures.queue_waiting) == (0.5, (1,), None)


def test_no_prefill_worker_registered_holds():
    d = pool(first(decode=1, prefill=0, kv=0.625, waiting=3), Pool.PREFILL)
    assert d.direction == Direction.HOLD and "no prefill worker" in d.reason


# ---------------------------------------------------------------------------------------------------------------------
# Change in progress


def test_a_change_in_progress_pauses_pulling_and_adjusting():
    state = observe(PlannerState(), obs(0.0, kv=0.95), CFG)
    # A decode worker is starting: the pulls at 1..40 are not recorded, and the adjustment due at 30 holds.
    holds = []
    for t in range(1, 41):
        adj, state = decide(state, obs(float(t), kv=0.95, decode_starting=1), CFG)
        if adj is not None:
            holds.append(adj)
    assert len(holds) == 1 and holds[0].now_s == 31.0  # one interval after the pause began at t = 1
    assert all(d.direction == Direction.HOLD for d in holds[0].decisions)
    assert pool(holds[0], Pool.DECODE).reason == "change in progress: decode 1 starting, 0 leaving"
    assert state.paused and state.kv == ()
    # Registered at t = 41: a fresh interval starts there; only its pulls (low KV) count, the high ones before do not.
    adj, state, t = interval(state, 41.0, decode=3, kv=0.125)
    assert t == 71.0 and adj.note.startswith("interval started at 41 s")
    d = pool(adj, Pool.DECODE)
    assert d.metrics["kv_usage"] == 0.125 and d.metrics["pulls"] == 31


def test_adjust_holds_while_a_worker_is_leaving():
    adj, _ = adjust(PlannerState(interval_start_s=0.0), obs(30.0, prefill=2, waiting=0, decode_leaving=1), CFG)
    assert [d.direction for d in adj.decisions] == [Direction.HOLD, Direction.HOLD]
    assert adj.decisions[0].reason.startswith("change in progress")


def test_a_fleet_that_changes_size_by_itself_restarts_the_interval():
    state = PlannerState()
    for t in range(20):
        _, state = decide(state, obs(float(t), decode=2, kv=0.95), CFG)
    # A worker died at t = 20 (2 -> 1): the high-KV samples described the old fleet.
    adj, state, t = interval(state, 20.0, decode=1, kv=0.625)
    assert t == 50.0 and "(2, None) -> (1, None)" in adj.note
    assert pool(adj, Pool.DECODE).metrics["kv_usage"] == 0.625


# ---------------------------------------------------------------------------------------------------------------------
# Aggregated deployments and purity


def test_aggregated_deployment_scales_only_its_workers_on_kv():
    adj = first(decode=2, prefill=None, kv=0.95, waiting=100)
    assert [d.pool for d in adj.decisions] == [Pool.DECODE]
    d = pool(adj, Pool.DECODE)
    assert d.direction == Direction.UP and "aggregated workers" in d.reason
    assert adj.decision(Pool.PREFILL) is None


def test_state_is_immutable_and_inputs_are_not_changed():
    state = PlannerState()
    o = obs(0.0)
    new = observe(state, o, CFG)
    assert state == PlannerState() and new is not state
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.pulls = 5  # type: ignore[misc]
    # Same inputs, same outputs: no clock, no randomness.
    assert interval(PlannerState(), 0.0, kv=0.95)[0] == interval(PlannerState(), 0.0, kv=0.95)[0]


def test_a_decision_is_due_at_the_pull_one_interval_on_even_when_its_clock_reading_is_a_few_ms_early():
    from components.planner.policy import adjustment_due

    cfg = PlannerConfig(adjustment_interval=10.0, metric_pulling_interval=1.0)
    state = PlannerState(interval_start_s=100.004)  # the interval's first pull read its clock 4 ms late
    assert adjustment_due(state, 109.998, cfg)  # the pull at 110 s read 2 ms early: due, not one pull later
    assert not adjustment_due(state, 109.004, cfg)  # the pull before it (9 s on) is not
