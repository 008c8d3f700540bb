"""Warm-starting the SLA planner's predictors from a trace (``--load-predictor-warmup-trace``)."""

from __future__ import annotations

import json

import pytest

from components.planner.config import SlaPlannerConfig
from components.planner.main import make_controller
from components.planner.sla.warmup import interval_series

pytestmark = pytest.mark.unit


def test_a_trace_cut_into_intervals_gives_the_rate_and_mean_lengths_of_each_whole_one():
    # Interval 10 s from the first arrival (t = 5): [5, 15) holds 3 arrivals, [15, 25) none, [25, 35) 2; the arrival
    # at 36 is in the partial interval [35, 45) and is left out.
    rows = [(5.0, 100, 10), (6.0, 200, 20), (14.9, 300, 30), (25.0, 50, 5), (30.0, 150, 15), (36.0, 999, 99)]
    s = interval_series(reversed(rows), 10.0)  # any order
    assert s.rates == (0.3, 0.0, 0.2)
    assert s.isls == (200.0, 100.0) and s.osls == (20.0, 10.0)  # the empty interval has no length
    with pytest.raises(ValueError, match="less than one adjustment interval"):
        interval_series([(0.0, 1, 1), (5.0, 1, 1)], 10.0)
    with pytest.raises(ValueError, match="no request"):
        interval_series([], 10.0)


def test_the_controller_starts_from_the_warm_up_trace(tmp_path):
    # A Mooncake trace of 2 requests/s (one every 500 ms) for 120 s, 300-token prompts, 40-token outputs: with a 30 s
    # interval, 3 whole intervals of rate 2.0 (the 4th is cut short at the last arrival).
    path = tmp_path / "yesterday.jsonl"
    with path.open("w") as f:
        for i in range(240):
            f.write(json.dumps({"timestamp": i * 500, "input_length": 300, "output_length": 40, "hash_ids": [i]}))
            f.write("\n")
    cfg = SlaPlannerConfig(load_predictor="constant", load_predictor_warmup_trace=str(path))
    ctl = make_controller(cfg, "m")
    assert ctl.rate.predict() == pytest.approx(2.0)
    assert (ctl.isl.predict(), ctl.osl.predict()) == (pytest.approx(300.0), pytest.approx(40.0))
    cold = make_controller(SlaPlannerConfig(load_predictor="constant"), "m")
    assert not cold.rate.ready  # without it, nothing to predict from before the first interval
    bad = tmp_path / "short.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}) + "\n")
    with pytest.raises(ValueError, match=r"short\.jsonl: the warm-up trace spans 0\.0 s"):
        make_controller(SlaPlannerConfig(load_predictor_warmup_trace=str(bad)), "m")
