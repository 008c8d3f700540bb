"""The simulator runs a graph's engines at their ``speedup_ratio``, as the served mock engine sleeps them: every step
and KV transfer lasts its modelled time divided by the ratio (an infinitely fast engine, whose time is the host's CPU,
is refused), and the floors and the capacity search are priced in the same time."""

from __future__ import annotations

import pytest

from components.sim import FleetSpec, SimRequest, Workload, replay
from components.sim.analysis import isolated_service_s, model_estimate, ttft_floor_s
from components.workers.simulated import MockEngineConfig, VirtualEngine

pytestmark = pytest.mark.unit

P = 400
BASE = MockEngineConfig(prefill_ms_per_token_sq=0.0, max_num_batched_tokens=P, enable_prefix_caching=False)
MODEL = BASE.step_time_model


def prompt(tag: int, n: int = P) -> tuple[int, ...]:
    return tuple(10_000 * tag + i for i in range(n))


def test_an_infinitely_fast_engine_has_no_modelled_time_and_is_refused():
    with pytest.raises(ValueError, match="speedup_ratio inf has no modelled time"):
        VirtualEngine(BASE.model_copy(update={"speedup_ratio": float("inf")}))


@pytest.mark.parametrize("speedup", [0.1, 0.25, 2.0])
def test_one_request_alone_takes_its_modelled_times_over_the_speedup(speedup):
    engine = BASE.model_copy(update={"speedup_ratio": speedup})
    res = replay(Workload("w", (SimRequest(0.0, prompt(1), 5),)), FleetSpec(workers=1, engine=engine))
    # The same request as at speedup 1 (tests/unit/sim/test_replay.py), every time divided by the speedup.
    assert res.ttft_s == [pytest.approx(MODEL.prefill_ms(P) / 1e3 / speedup, rel=1e-12)]
    assert res.itl_s == [pytest.approx(MODEL.decode_ms(1, P + i) / 1e3 / speedup, rel=1e-12) for i in range(1, 5)]


def test_kv_transfer_is_scaled_like_the_served_engines():
    fast, slow = VirtualEngine(BASE), VirtualEngine(BASE.model_copy(update={"speedup_ratio": 0.5}))
    assert slow.kv_transfer_time_s(3000) == pytest.approx(2 * fast.kv_transfer_time_s(3000), rel=1e-12)
    assert fast.kv_transfer_time_s(3000) > 0


def test_floors_and_the_capacity_guess_are_in_the_replays_time():
    w = Workload("w", (SimRequest(0.0, prompt(1), 5), SimRequest(1.0, prompt(2), 3)))
    at1, at_quarter = (
        FleetSpec(workers=2, engine=BASE),
        FleetSpec(workers=2, engine=BASE.model_copy(update={"speedup_ratio": 0.25})),
    )
    assert ttft_floor_s(w, at_quarter, [0, 0]) == pytest.approx([4 * x for x in ttft_floor_s(w, at1, [0, 0])])
    assert isolated_service_s(w, at_quarter) == pytest.approx(4 * isolated_service_s(w, at1), rel=1e-12)
    assert model_estimate(w, at_quarter) == pytest.approx(model_estimate(w, at1) / 4, rel=1e-12)
    # A lone request's replayed TTFT is exactly its floor at both speeds.
    lone = Workload("w", (SimRequest(0.0, prompt(1), 5),))
    for fleet in (at1, at_quarter):
        assert replay(lone, fleet).ttft_s == [pytest.approx(ttft_floor_s(lone, fleet, [0])[0], rel=1e-12)]
