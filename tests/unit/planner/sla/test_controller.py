"""The SLA controller's throughput loop, fed through the in-memory fleet view (tests/unit/planner/sla/support.py).

Numbers used throughout (ROUND: prefill 10 ms + 0.04 ms/token; decode 5 ms + 0.02 ms/sequence + 3e-5 ms/KV token):

* prefill, isl 1000, TTFT target 500 ms, queue wait on: a prompt alone takes S = 50 ms; the M/D/1 cap on a worker's
  utilisation is rho = 2 (T - S) / (2T - S) = 0.9 / 0.95; one worker serves rho x 20000 prompt tokens/s.
* decode, isl 1000, osl 200: a sequence holds 1000 + 200 / 2 = 1100 KV tokens on average, so a batch of b steps in
  5 + (0.02 + 1100 x 3e-5) b = 5 + 0.053 b ms; within an ITL target of 20 ms the largest batch is
  floor(15 / 0.053) = 283, stepping in 5 + 0.053 x 283 = 19.999 ms: 283 / 0.019999 output tokens/s a worker.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from pydantic import ValidationError

from components.planner.policy import Direction, Pool
from components.planner.sla.config import SlaPlannerConfig
from components.planner.sla.controller import SlaController
from tests.unit.planner.sla.support import MODEL, Fleet, pull

pytestmark = pytest.mark.unit

RHO = 0.9 / 0.95
PREFILL_TOKENS_PER_S = RHO * 20000  # one prefill worker, isl 1000, TTFT 500 ms with queue wait
DECODE_TOKENS_PER_S = 283 / (5 + 0.053 * 283) * 1e3  # one decode worker, ITL 20 ms


def prefill_need(rate: float) -> float:
    return rate * 1000 / PREFILL_TOKENS_PER_S


def decode_need(rate: float) -> float:
    return rate * 200 / DECODE_TOKENS_PER_S


def config(**kw) -> SlaPlannerConfig:
    base = dict(
        itl=20.0,
        load_predictor="constant",
        worker_startup_s=0.0,
        adjustment_interval=30.0,
        metric_pulling_interval=1.0,
        max_gpu_budget=16,
        no_correction=True,
    )
    return SlaPlannerConfig(**(base | kw))


# --------------------------------------------------------------------------------------------------------------------
# Config


def test_config_defaults_are_dynamos_where_it_has_them():
    c = SlaPlannerConfig()
    assert (c.ttft, c.itl, c.max_gpu_budget, c.min_endpoint) == (500.0, 50.0, 8, 1)
    assert (c.prefill_engine_num_gpu, c.decode_engine_num_gpu, c.no_correction, c.no_operation) == (1, 1, False, False)
    assert (c.adjustment_interval, c.load_predictor, c.worker_startup_s) == (30.0, "kalman", 30.0)
    assert (c.scale_down_sensitivity, c.queue_wait, c.profile_results_dir) == (0.8, True, None)
    assert (c.ttft_s, c.itl_s) == (0.5, 0.05)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"metric_pulling_interval": 60.0}, "must not exceed adjustment_interval"),
        ({"min_gpu_budget": 9}, "must not exceed max_gpu_budget"),
        ({"min_endpoint": 5, "decode_engine_num_gpu": 2}, "do not fit max_gpu_budget"),
        ({"load_predictor_season": 5}, "for load_predictor holt-winters, not kalman"),
        ({"load_predictor": "arima"}, "load_predictor"),
        ({"ttft": 0}, "ttft"),
        ({"scale_down_sensitivity": 1.5}, "scale_down_sensitivity"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_config_refuses_what_cannot_work_and_says_why(kw, message):
    with pytest.raises(ValidationError, match=message):
        SlaPlannerConfig(**kw)


def test_a_season_is_accepted_for_holt_winters():
    c = SlaPlannerConfig(load_predictor="holt-winters", load_predictor_season=5)
    ctl = SlaController(c, MODEL)
    assert ctl.rate.season_length == 5  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------------------------
# Throughput loop


def test_replica_formulas_through_the_controller_disaggregated():
    # 100 requests/s, isl 1000, osl 200:
    # prefill 100000 tokens/s over RHO x 20000 = 5.28 -> 6; decode 20000 tokens/s over 14151 = 1.41 -> 2.
    assert math.ceil(prefill_need(100)) == 6 and math.ceil(decode_need(100)) == 2
    fleet = Fleet(decode=1, prefill=1)
    ctl = SlaController(config(), MODEL)
    assert pull(ctl, fleet, 0.0).adjustment is None  # the first pull starts the interval
    fleet.requests(30.0, 30.0, rate=100, isl=1000, osl=200)
    out = pull(ctl, fleet, 30.0)
    adj = out.adjustment
    assert adj is not None
    # One step at a time, additions decode first (budget.plan_budget's order): decode 1 -> 2 now, prefill after.
    decode, prefill = adj.decision(Pool.DECODE), adj.decision(Pool.PREFILL)
    assert decode is not None and prefill is not None
    assert (decode.direction, decode.current, decode.target) == (Direction.UP, 1, 2)
    assert (prefill.direction, prefill.current, prefill.target) == (Direction.HOLD, 1, 1)
    assert "prefill 1 -> 6 after decode 1 -> 2" in prefill.reason
    assert ctl.floor == {Pool.DECODE: 2, Pool.PREFILL: 6}
    assert out.sla is not None and out.sla.interval
    assert out.sla.observed_request_rate == pytest.approx(100)
    assert (out.sla.observed_isl, out.sla.observed_osl) == (1000, 200)
    assert out.sla.next_request_rate == pytest.approx(100)
    assert (out.sla.throughput_prefill, out.sla.throughput_decode) == (6, 2)
    # The next pull (decode's change ended) issues the waiting prefill step, several workers at once.
    out = pull(ctl, fleet, 31.0)
    assert out.adjustment is not None
    prefill = out.adjustment.decision(Pool.PREFILL)
    assert prefill is not None and (prefill.direction, prefill.current, prefill.target) == (Direction.UP, 1, 6)
    assert (fleet.count(Pool.PREFILL), fleet.count(Pool.DECODE)) == (6, 2)
    assert pull(ctl, fleet, 32.0).adjustment is None  # nothing left to do between decisions


def test_an_aggregated_pool_is_sized_on_the_sum_of_both_demands():
    # One pool does both: 5.28 + 1.41 = 6.69 workers' worth -> 7 (sized separately and added: 6 + 2 = 8).
    need = prefill_need(100) + decode_need(100)
    assert math.ceil(need) == 7
    fleet = Fleet(decode=1)
    ctl = SlaController(config(), MODEL)
    pull(ctl, fleet, 0.0)
    fleet.requests(30.0, 30.0, rate=100, isl=1000, osl=200)
    out = pull(ctl, fleet, 30.0)
    assert out.adjustment is not None and [d.pool for d in out.adjustment.decisions] == [Pool.DECODE]
    d = out.adjustment.decisions[0]
    assert (d.direction, d.current, d.target) == (Direction.UP, 1, 7)
    assert "aggregated: prefill 5.28 + decode 1.41" in d.reason
    assert fleet.count(Pool.DECODE) == 7


def test_no_request_reports_is_a_hold_not_zero_load():
    fleet = Fleet(decode=3, prefill=2)
    ctl = SlaController(config(), MODEL)
    pull(ctl, fleet, 0.0)
    out = pull(ctl, fleet, 30.0)
    assert out.adjustment is not None
    assert [d.direction for d in out.adjustment.decisions] == [Direction.HOLD, Direction.HOLD]
    assert all("no request reports heard in (0, 30] s" in d.reason for d in out.adjustment.decisions)
    assert not ctl.rate.ready and ctl.floor == {}
    assert out.sla is not None and out.sla.observed_request_rate is None
    assert (fleet.count(Pool.PREFILL), fleet.count(Pool.DECODE)) == (2, 3)


def test_a_burst_grows_the_pool_and_quiet_shrinks_it_to_min_endpoint():
    fleet = Fleet(decode=2)
    ctl = SlaController(config(min_endpoint=2), MODEL)
    pull(ctl, fleet, 0.0)
    fleet.requests(30.0, 30.0, rate=100, isl=1000, osl=200)
    pull(ctl, fleet, 30.0)
    assert fleet.count(Pool.DECODE) == 7  # as in the aggregated sizing test
    # Quiet: the frontend reports, and no request arrives; the workers idle (KV 2%, nothing running or queued), so
    # every survivor of every step stays under target x 0.8 and the pool goes to min_endpoint in one decision.
    fleet.set_load(Pool.DECODE, kv_usage=0.02)
    fleet.requests(60.0, 30.0, rate=0, isl=1000, osl=200)
    out = pull(ctl, fleet, 60.0)
    assert out.adjustment is not None
    d = out.adjustment.decisions[0]
    assert (d.direction, d.current, d.target) == (Direction.DOWN, 7, 2)
    assert "no requests predicted" in d.reason and "consolidation check: 7 -> 2 allowed" in d.reason
    assert fleet.count(Pool.DECODE) == 2


def test_start_up_lead_asks_for_what_the_rising_load_needs_when_the_workers_arrive():
    # Rates 10, 20, 30 requests/s: the Kalman filter follows a straight line, predicting 40, 50, 60 for the next
    # three intervals. Without start-up (lead 0) the pool is sized for 40: 2.11 + 0.57 = 2.68 -> 3 workers. With a
    # 60 s start-up at 30 s intervals (lead 2) it is sized for 60, the rate when a worker asked now serves:
    # 3.17 + 0.85 = 4.02 -> 5.
    assert math.ceil(prefill_need(40) + decode_need(40)) == 3
    assert math.ceil(prefill_need(60) + decode_need(60)) == 5

    def run(startup_s: float) -> tuple[SlaController, Fleet]:
        fleet = Fleet(decode=1)
        ctl = SlaController(config(load_predictor="kalman", worker_startup_s=startup_s), MODEL)
        pull(ctl, fleet, 0.0)
        for k, rate in enumerate((10, 20, 30), start=1):
            fleet.requests(30.0 * k, 30.0, rate=rate, isl=1000, osl=200)
            out = pull(ctl, fleet, 30.0 * k)
        assert out.sla is not None and out.sla.next_request_rate == pytest.approx(40, rel=1e-3)
        return ctl, fleet

    ctl, fleet = run(0.0)
    assert ctl.lead == 0 and fleet.count(Pool.DECODE) == 3
    ctl, fleet = run(60.0)
    assert ctl.lead == 2 and fleet.count(Pool.DECODE) == 5


def test_no_oscillation_at_constant_load():
    # 100 requests/s with +-5% noise (seeded) for 40 intervals; the workers' reports follow the pool (the load spread
    # over n workers: 280 / n sequences of 1100 KV tokens, KV use 2.8 / n). The pool never goes up, down and up again
    # (nor down, up, down) within three intervals.
    rng = random.Random(7)
    fleet = Fleet(decode=1)
    ctl = SlaController(config(load_predictor="kalman", worker_startup_s=30.0), MODEL)
    pull(ctl, fleet, 0.0)
    sizes = []
    for k in range(1, 41):
        n = fleet.count(Pool.DECODE)
        fleet.set_load(
            Pool.DECODE,
            kv_usage=min(1.0, 2.8 / n),
            num_running=280 // n,
            batch_size=280 // n,
            num_kv_tokens=280 // n * 1100,
        )
        fleet.requests(30.0 * k, 30.0, rate=100 * rng.uniform(0.95, 1.05), isl=1000, osl=200)
        pull(ctl, fleet, 30.0 * k)
        sizes.append(fleet.count(Pool.DECODE))
    moves = [b - a for a, b in itertools.pairwise(sizes)]
    for a, b, c in zip(moves, moves[1:], moves[2:], strict=False):  # three consecutive intervals' moves
        assert not (a * b < 0 and b * c < 0), sizes
    assert 7 <= sizes[-1] <= 8, sizes


# --------------------------------------------------------------------------------------------------------------------
# Scale-down, budget, fast loop, correction


def test_pr_9294_two_decode_workers_at_0_7_kv_do_not_become_one():
    # Two decode workers each decoding 150 sequences over 500000 KV tokens at 0.7 KV use: the decode model's step is
    # 5 + 0.02 x 150 + 3e-5 x 500000 = 23 ms, under the ITL target 40 ms x sensitivity 0.8 = 32 ms (the PR's
    # threshold). The load falls to 1 request/s, which one decode worker would carry; but one survivor would hold
    # both workers' load: KV 1.4 >= 0.8 and ITL 5 + 6 + 30 = 41 ms >= 32 ms. Refused, and the reason says both.
    fleet = Fleet(decode=2, prefill=1)
    fleet.set_load(Pool.DECODE, kv_usage=0.7, num_running=150, batch_size=150, num_kv_tokens=500_000)
    ctl = SlaController(config(itl=40.0), MODEL)
    pull(ctl, fleet, 0.0)
    fleet.requests(30.0, 30.0, rate=1, isl=1000, osl=200)
    out = pull(ctl, fleet, 30.0)
    assert ctl.floor[Pool.DECODE] == 1  # the throughput loop alone would go to one
    assert out.adjustment is not None
    d = out.adjustment.decision(Pool.DECODE)
    assert d is not None and (d.direction, d.current, d.target) == (Direction.HOLD, 2, 2)
    assert "scale-down to 1 refused" in d.reason and "break KV, ITL" in d.reason
    assert "KV use 0.70 -> 1.40 >= 0.80" in d.reason and "ITL 23.0 -> 41.0 ms >= 32.0 ms" in d.reason
    assert fleet.count(Pool.DECODE) == 2
    # At the same constant load, every later decision refuses again: no 2 -> 1 -> 2.
    for k in range(2, 6):
        fleet.requests(30.0 * k, 30.0, rate=1, isl=1000, osl=200)
        pull(ctl, fleet, 30.0 * k)
        assert fleet.count(Pool.DECODE) == 2


def swap_fleet() -> tuple[Fleet, SlaController]:
    # Budget 4 GPUs, full: 2 prefill + 2 decode. The load turns decode-heavy: 50 requests/s of 100-token prompts and
    # 1000-token outputs. Prefill: a prompt takes 10 + 4 = 14 ms, rho = 2 (0.5 - 0.014) / (1 - 0.014), one worker
    # rho x 100 / 0.014 tokens/s; 5000 tokens/s need 0.71 -> 1. Decode: a sequence holds 100 + 500 = 600 KV tokens,
    # a batch of b steps in 5 + 0.038 b ms, within 20 ms b = floor(15 / 0.038) = 394; 50000 tokens/s over
    # 394 / 19.972 ms = 19727 a worker: 2.53 -> 3. Wanted (1, 3): a swap at full budget.
    rho = 2 * (0.5 - 0.014) / (1 - 0.014)
    assert math.ceil(5000 / (rho * 100 / 0.014)) == 1
    assert math.ceil(50000 / (394 / (5 + 0.038 * 394) * 1e3)) == 3
    fleet = Fleet(decode=2, prefill=2)
    fleet.set_load(Pool.PREFILL, kv_usage=0.05)  # idle prefill workers: the check lets one go
    fleet.set_load(Pool.DECODE, kv_usage=0.3, num_running=40, batch_size=40, num_kv_tokens=24_000)
    ctl = SlaController(config(max_gpu_budget=4), MODEL)
    pull(ctl, fleet, 0.0)
    fleet.requests(30.0, 30.0, rate=50, isl=100, osl=1000)
    return fleet, ctl


def test_a_swap_at_full_budget_removes_first_and_adds_only_after_the_removal_ended():
    fleet, ctl = swap_fleet()
    gpus = []
    out = pull(ctl, fleet, 30.0, apply=False)
    adj = out.adjustment
    assert adj is not None
    assert [(d.pool, d.current, d.target) for d in adj.changes()] == [(Pool.PREFILL, 2, 1)]
    decode = adj.decision(Pool.DECODE)
    assert decode is not None and decode.direction == Direction.HOLD
    assert "decode 2 -> 3 after prefill 2 -> 1" in decode.reason
    assert (adj.gpus_before, adj.gpus_after) == (4, 3)
    ctl.change_started(Pool.PREFILL, 2, 1)
    # The removal is slow (a worker draining): pulls meanwhile issue nothing, the budget is never passed.
    for t in (31.0, 32.0, 33.0):
        assert pull(ctl, fleet, t, apply=False).adjustment is None
        gpus.append(fleet.count(Pool.PREFILL) + fleet.count(Pool.DECODE))
    fleet.resize(Pool.PREFILL, 1)
    gpus.append(fleet.count(Pool.PREFILL) + fleet.count(Pool.DECODE))
    ctl.change_ended(Pool.PREFILL)
    out = pull(ctl, fleet, 34.0, apply=False)
    assert out.adjustment is not None
    assert [(d.pool, d.current, d.target) for d in out.adjustment.changes()] == [(Pool.DECODE, 2, 3)]
    assert out.adjustment.gpus_after == 4
    ctl.change_started(Pool.DECODE, 2, 3)
    fleet.resize(Pool.DECODE, 3)
    ctl.change_ended(Pool.DECODE)
    gpus.append(fleet.count(Pool.PREFILL) + fleet.count(Pool.DECODE))
    assert max(gpus) <= 4 and (fleet.count(Pool.PREFILL), fleet.count(Pool.DECODE)) == (1, 3)
    assert pull(ctl, fleet, 35.0).adjustment is None


def test_at_full_budget_a_refused_removal_holds_the_addition_instead_of_waiting_for_it():
    # The same load, but the prefill workers are busy (8000 prompt tokens queued each: one survivor would queue
    # 16000, 16000 x (10 + 0.04 x 8192) / 8192 + 5 + 14 = 678 ms >= 400 ms): prefill keeps 2, and the decode
    # addition, which has no GPU, is held with the budget's reason, not issued to wait for a GPU that never frees.
    fleet, ctl = swap_fleet()
    fleet.set_load(Pool.PREFILL, kv_usage=0.05, num_waiting_prefill_tokens=8000)
    out = pull(ctl, fleet, 30.0, apply=False)
    adj = out.adjustment
    assert adj is not None and adj.changes() == ()
    prefill, decode = adj.decision(Pool.PREFILL), adj.decision(Pool.DECODE)
    assert prefill is not None and "scale-down to 1 refused" in prefill.reason and "TTFT" in prefill.reason
    assert decode is not None and decode.direction == Direction.HOLD
    assert "over the 4-GPU budget" in decode.reason
    assert ctl.target == {Pool.PREFILL: 2, Pool.DECODE: 2}
    assert pull(ctl, fleet, 31.0, apply=False).adjustment is None


def test_the_fast_loop_raises_the_pool_above_the_floor_when_queues_build():
    # Aggregated, min_endpoint 2; 10 requests/s need 0.53 + 0.14 workers: the throughput floor is 2.
    fleet = Fleet(decode=2)
    ctl = SlaController(config(min_endpoint=2), MODEL)
    pull(ctl, fleet, 0.0)
    fleet.requests(30.0, 30.0, rate=10, isl=1000, osl=200)
    out = pull(ctl, fleet, 30.0)
    assert ctl.floor == {Pool.DECODE: 2} and fleet.count(Pool.DECODE) == 2
    # Queues build: 20000 prompt tokens waiting on each worker, nothing decoding. A new 1000-token prompt waits
    # 20000 x (10 + 0.04 x 8192) / 8192 + 5 = 829.1 ms, then computes 50 ms: 879 ms > 500 ms. Spreading that wait
    # within 500 - 50 ms: ceil(2 x 829.1 / 450) = 4 workers.
    wait = 20000 * (10 + 0.04 * 8192) / 8192 + 5
    assert math.ceil(2 * wait / 450) == 4
    fleet.set_load(Pool.DECODE, num_waiting_prefill_tokens=20000)
    out = pull(ctl, fleet, 31.0)
    assert out.sla is not None and out.sla.predicted_ttft_s == pytest.approx((wait + 50) / 1e3)
    assert out.adjustment is not None
    d = out.adjustment.decisions[0]
    assert (d.direction, d.current, d.target) == (Direction.UP, 2, 4) and "fast loop: predicted TTFT 879" in d.reason
    assert fleet.count(Pool.DECODE) == 4
    # The queues drain; the next throughput decision finds the workers idle and goes back to its floor of 2 through
    # the consolidation check; a fast loop reading under target never takes the pool below the floor.
    fleet.set_load(Pool.DECODE)
    assert pull(ctl, fleet, 32.0).adjustment is None
    fleet.requests(60.0, 30.0, rate=10, isl=1000, osl=200)
    out = pull(ctl, fleet, 60.0)
    assert out.adjustment is not None and out.adjustment.decisions[0].target == 2
    assert fleet.count(Pool.DECODE) == 2


def test_the_correction_factors_move_the_sizing():
    # Aggregated, 100 requests/s (7 workers uncorrected). The workers report batch 40 over 44000 KV tokens each: the
    # model's step is 5 + 0.8 + 1.32 = 7.12 ms, and the frontends observe 14.24 ms (2x). A new prompt's predicted
    # TTFT is 50 ms (nothing queued); observed 100 ms (2x). Smoothing 0.5: each interval's factor is
    # 0.5 x 2 + 0.5 x the previous one. Interval 1 has no TTFT prediction (no prompt length known before its end):
    # at 30 s ITL goes 1.0 -> 1.5 and TTFT stays 1.0; at 60 s ITL 1.5 -> 1.75, TTFT 1.0 -> 1.5.
    # Sizing at 60 s: a prompt takes 1.5 x 50 = 75 ms, rho = 2 (0.5 - 0.075) / (1 - 0.075), one worker
    # rho x 1000 / 0.075 tokens/s, 100000 tokens/s need 8.16; decode steps in 1.75 (5 + 0.053 b) <= 20 ms up to
    # b = floor((20 / 1.75 - 5) / 0.053) = 121, 20000 tokens/s over 121 / (1.75 x (5 + 0.053 x 121)) ms: 3.30.
    # 8.16 + 3.30 = 11.46 -> 12 workers, against 7 uncorrected.
    rho = 2 * (0.5 - 0.075) / (1 - 0.075)
    prefill = 100000 / (rho * 1000 / 0.075)
    assert math.floor((20 / 1.75 - 5) / 0.053) == 121
    decode = 20000 / (121 / (1.75 * (5 + 0.053 * 121)) * 1e3)
    assert math.ceil(prefill + decode) == 12
    fleet = Fleet(decode=1)
    fleet.set_load(Pool.DECODE, num_running=40, batch_size=40, num_kv_tokens=44_000)
    ctl = SlaController(config(no_correction=False), MODEL)
    for t in (0.0, 10.0, 20.0):
        pull(ctl, fleet, t)
    fleet.requests(30.0, 30.0, rate=100, isl=1000, osl=200, ttft_s=0.1, itl_s=0.01424)
    out = pull(ctl, fleet, 30.0)
    assert (ctl.ttft_correction, ctl.itl_correction) == (1.0, pytest.approx(1.5))
    assert out.sla is not None and out.sla.observed_itl_s == pytest.approx(0.01424)
    for t in (40.0, 50.0):
        pull(ctl, fleet, t)
    fleet.requests(60.0, 30.0, rate=100, isl=1000, osl=200, ttft_s=0.1, itl_s=0.01424)
    out = pull(ctl, fleet, 60.0)
    assert (ctl.ttft_correction, ctl.itl_correction) == (pytest.approx(1.5), pytest.approx(1.75))
    assert fleet.count(Pool.DECODE) == 12
    assert out.sla is not None and (out.sla.ttft_correction, out.sla.itl_correction) == pytest.approx((1.5, 1.75))


def test_no_operation_reports_what_it_would_do_and_changes_nothing():
    fleet = Fleet(decode=1)
    ctl = SlaController(config(no_operation=True), MODEL)
    pull(ctl, fleet, 0.0)
    fleet.requests(30.0, 30.0, rate=100, isl=1000, osl=200)
    out = pull(ctl, fleet, 30.0)
    assert out.adjustment is not None and out.adjustment.no_operation and out.adjustment.changes() == ()
    d = out.adjustment.decisions[0]
    assert (d.direction, d.target, d.no_operation) == (Direction.UP, 7, True)
    assert "would scale up 1 -> 7" in d.summary()
    assert fleet.count(Pool.DECODE) == 1
    assert pull(ctl, fleet, 31.0).adjustment is None  # not re-issued at every pull
