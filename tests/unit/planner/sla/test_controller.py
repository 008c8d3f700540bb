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
