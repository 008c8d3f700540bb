"""``kvmesh bench rescheduling``: its pure parts (the imbalance metric, each target's verdict, median and spread)
and one tiny end-to-end run of the command."""

from __future__ import annotations

import json

import pytest

from components.cli.bench import rescheduling as rb
from components.cli.main import main as cli_main
from components.sim.workloads import short_long_mix

pytestmark = pytest.mark.unit


def test_kv_imbalance_is_the_p95_of_max_minus_min_per_instant():
    assert rb.kv_spread([0.9, 0.3, 0.5]) == pytest.approx(0.6)
    assert rb.kv_spread([]) == 0.0
    # 20 instants: spreads 0.00, 0.05, ..., 0.95 (worker 1 at k/20, worker 2 at 0). Nearest rank P95 of 20 values is
    # the 19th smallest (ceil(0.95 x 20) = 19): 18/20 = 0.90.
    samples = [(k / 20, 0.0) for k in range(20)]
    assert rb.kv_imbalance(samples) == pytest.approx(0.90)
    assert rb.kv_imbalance([]) is None


def test_ttft_target_by_speedup_or_by_the_way_to_the_causal_floor():
    # 1.5x: off 300 ms needs on <= 200.
    assert rb.judge_ttft(300.0, 200.0, None).status == rb.MET
    assert rb.judge_ttft(300.0, 201.0, 100.0).status == rb.NOT_MET  # floor 100 < 200: the 1.5x rule holds
    # Floor 250 above off / 1.5 = 200: 80% of the way from 300 to 250 is 300 - 0.8 x 50 = 260.
    assert rb.judge_ttft(300.0, 260.0, 250.0).status == rb.MET
    assert rb.judge_ttft(300.0, 261.0, 250.0).status == rb.NOT_MET
    assert rb.judge_ttft(None, 10.0, None).status == rb.NOT_JUDGED


def test_the_pooled_reference_says_whether_the_ttft_goal_is_in_reach():
    # Off 12,000 ms, floor 51.5: the goal is 12,000 / 1.5 = 8,000 ms.
    assert rb.reachable_by_pooled(12_000.0, 51.5, 9_000.0) is False
    assert rb.reachable_by_pooled(12_000.0, 51.5, 8_000.0) is True
    # Off 100, floor 80: 100 / 1.5 = 66.7 is below the floor, so 80% of the way: 100 - 0.8 x 20 = 84 ms.
    assert rb.reachable_by_pooled(100.0, 80.0, 84.0) is True
    assert rb.reachable_by_pooled(100.0, 80.0, 85.0) is False
    assert rb.reachable_by_pooled(None, 80.0, 50.0) is None and rb.reachable_by_pooled(100.0, 80.0, None) is None
    # In judge: on the medians (off 12,000 against pooled 9,000: out of reach) and per seed (off 12,000 / 9,000:
    # goals 8,000 / 6,000 against pooled 9,000 / 5,000: out, in); the verdict itself is the one without --pooled.
    off, on = {"ttft_p99_ms": 12_000.0}, {"ttft_p99_ms": 7_000.0}
    pooled = {"median": 9_000.0, "per_seed": [9_000.0, 5_000.0], "off_per_seed": [12_000.0, 9_000.0]}
    t = rb.judge("llumnix", 1.0, off, on, 51.5, pooled)["ttft_p99"]
    assert t["status"] == rb.MET == rb.judge("llumnix", 1.0, off, on, 51.5)["ttft_p99"]["status"]
    assert t["pooled_p99_ms"] == 9_000.0 and t["reachable_by_pooled"] is False
    assert t["reachable_by_pooled_per_seed"] == [False, True]
    assert "reachable_by_pooled" not in rb.judge("llumnix", 1.0, off, on, 51.5)["ttft_p99"]
    assert "reachable_by_pooled" not in rb.judge("trace", 1.0, off, on, 51.5, pooled)["ttft_p99"]


def test_cuts_throughput_and_hit_rate_and_what_is_not_judged():
    assert rb.judge_at_most("preemptions", 10, 5, rb.PREEMPTION_CUT).status == rb.MET
    assert rb.judge_at_most("preemptions", 10, 6, rb.PREEMPTION_CUT).status == rb.NOT_MET
    # No preemption to halve: not judged, never met.
    v = rb.judge_at_most("preemptions", 0, 0, rb.PREEMPTION_CUT)
    assert v.status == rb.NOT_JUDGED and "nothing to cut" in v.why
    assert rb.judge_at_most("imbalance", 0.5, 0.4, rb.IMBALANCE_CUT).status == rb.MET  # 0.4 = 0.8 x 0.5
    assert rb.judge_at_most("imbalance", 0.5, 0.41, rb.IMBALANCE_CUT).status == rb.NOT_MET
    assert rb.judge_throughput(1000.0, 980.0).status == rb.MET
    assert rb.judge_throughput(1000.0, 979.0).status == rb.NOT_MET
    assert rb.judge_hit_rate(0.50, 0.48).status == rb.MET  # 2 points down: the limit
    assert rb.judge_hit_rate(0.50, 0.479).status == rb.NOT_MET


def test_judge_judges_ttft_only_on_llumnixs_setting_at_08_and_10():
    off = {"ttft_p99_ms": 300.0, "preemptions": 0, "output_tokens_per_s": 100.0, "kv_imbalance_p95": 0.5,
           "hit_rate": 0.1}  # fmt: skip
    on = dict(off, ttft_p99_ms=150.0)
    assert rb.judge("llumnix", 0.8, off, on, None)["ttft_p99"]["status"] == rb.MET
    assert rb.judge("llumnix", 0.6, off, on, None)["ttft_p99"]["status"] == rb.NOT_JUDGED
    assert rb.judge("trace", 1.0, off, on, None)["ttft_p99"]["status"] == rb.NOT_JUDGED
    verdicts = rb.judge("llumnix", 1.0, off, on, None)
    assert verdicts["preemptions"]["status"] == rb.NOT_JUDGED
    assert verdicts["kv_imbalance_p95"]["status"] == rb.NOT_MET  # 0.5 -> 0.5: not 20% lower


def test_spread_is_median_min_max_without_missing_values():
    assert rb.spread([3.0, 1.0, None, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert rb.spread([None]) == {"median": None, "min": None, "max": None}


def test_the_short_long_mix_is_mostly_short_with_a_tenth_very_long():
    w = short_long_mix(2000, vocab_size=32_000, seed=0)
    outs = [r.max_tokens for r in w.requests]
    long = sum(1 for x in outs if x >= 512)
    # 10% long (at least 512 tokens by their bounds); a short one reaches 512 only at its cap (log-normal around 64,
    # sigma 0.6: 512 is 3.5 sigma up): about 200 of 2,000, binomial sd ~13.
    assert 150 < long < 250
    assert max(outs) <= 6144 and sorted(outs)[len(outs) // 2] < 100
    assert w.requests == short_long_mix(2000, vocab_size=32_000, seed=0).requests  # seeded


def test_the_command_runs_a_tiny_sweep_and_reports_every_cell_and_verdict(tmp_path, capsys):
    png = tmp_path / "r.png"
    code = cli_main(["bench", "rescheduling", "--workloads", "llumnix", "--requests", "40", "--seeds", "2",
                     "--workers", "1", "--loads", "1.0", "--jobs", "1", "--png", str(png), "--pooled"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    entry = report["workloads"]["llumnix"]
    assert report["seeds"] == [0, 1] and entry["requests"] == 40 and entry["capacity_rps"] > 0
    for d in ("least_loaded", "kv"):
        cell = entry["points"][d]["1"]
        for side in ("off", "on"):
            assert len(cell[side]["per_seed"]) == 2
            s = cell[side]["spread"]["ttft_p99_ms"]
            assert s["min"] <= s["median"] <= s["max"]
        assert cell["off"]["per_seed"][0]["rescheduler"] is None
        assert cell["on"]["per_seed"][0]["rescheduler"]["cycles"] > 0
        assert set(entry["targets"][d]["1"]) == {
            "ttft_p99",
            "preemptions",
            "throughput",
            "kv_imbalance_p95",
            "hit_rate",
        }
        ttft = entry["targets"][d]["1"]["ttft_p99"]
        assert len(ttft["reachable_by_pooled_per_seed"]) == 2 and ttft["pooled_p99_ms"] is not None
    # --pooled: the pooled fleet's TTFT p99 per seed beside the causal floor.
    pooled = entry["ttft_pooled_p99_ms"]["1"]
    assert len(pooled["per_seed"]) == 2 and pooled["min"] <= pooled["median"] <= pooled["max"]
    assert "pooled" in report["rules"]
    counts = report["target_counts"]
    assert sum(counts.values()) == 2 * 5
    assert png.stat().st_size > 10_000
    assert "== llumnix" in err
    # The steady-state capacity rule (the default): each probe with its backlog growth, the found rate's within 2%.
    assert entry["capacity_rule"] == "steady"
    found = [p for p in entry["capacity_probe_detail"] if p["rate_rps"] == entry["capacity_rps"]]
    assert found and found[0]["drained"] and found[0]["growth"] <= 0.02
    # 40 requests of the short/long mix last far less than four times the longest alone: the warning.
    assert entry["capacity_span_s"] / 4 < entry["longest_alone_s"] and "too short for a steady state" in err


def test_the_drain_rule_reproduces_the_older_capacity(capsys):
    """``--capacity-rule drain`` is the search before the growth test: on 400 requests of the short/long mix it
    passed a burst (58.9 req/s, docs/rescheduler.md), which the steady rule refuses (its backlog grows by 11% of the
    arrivals there). The search alone (the bench's capacity step on its default fleet) and one probe, no cell."""
    from components import sim
    from components.workers.simulated import MockEngineConfig

    vocab = MockEngineConfig().vocab_size
    spec = rb.Spec("llumnix", 400, 0, vocab)
    fleet = rb.fleet_for([rb.build(rb.Spec("llumnix", 400, s, vocab)) for s in (0, 1, 2)], 4, 1280)
    drain = rb._capacity(spec, fleet, "drain")
    assert round(drain["capacity_rps"], 1) == 58.9
    at_old = sim.probe(rb.build(spec), fleet, drain["capacity_rps"], 0, growth_slack=sim.GROWTH_SLACK)
    assert at_old.drained_by_time and not at_old.drained and at_old.growth is not None and at_old.growth > 0.1


def test_the_fleet_holds_the_longest_request_of_every_seed():
    # Regression: the fleet was sized on the first seed's workload, and another seed's longer document was refused
    # by the engines (PromptTooLongError) in the middle of the sweep.
    from components.sim import SimRequest, Workload

    short = Workload("a", (SimRequest(0.0, tuple(range(100)), 10),))
    long = Workload("b", (SimRequest(0.0, tuple(range(9000)), 100),))
    fleet = rb.fleet_for([short, long], workers=2, num_gpu_blocks=64)
    # 9,100 tokens round up to 9,216 (9 x 1,024); the cache holds one such sequence: 9,216 / 16 + 1 = 577 blocks.
    assert fleet.engine.max_model_len == 9_216 and fleet.engine.num_gpu_blocks == 577


def test_set_takes_a_rescheduler_config_field_and_refuses_another():
    import argparse

    from components.cli.bench.rescheduling import _config_field

    assert _config_field("rescheduling_req_select_value=1") == ("rescheduling_req_select_value", "1")
    for bad in ("rescheduling_req_select_value", "no_such_field=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="FIELD=VALUE"):
            _config_field(bad)
