"""``kvmesh bench planner --load`` (components/cli/bench/planner_loads.py): the verdicts against issue 25's targets,
and how a load's requests and arrivals are put together (the trace load pairs each arrival with its own row); the
expected numbers are derived in each test."""

from __future__ import annotations

import argparse

import pytest

from components.cli.bench import planner
from components.cli.bench.loads import Step, TraceLoad
from components.cli.bench.planner_loads import LoadRun, OrderedSource, build_load, verdict, warmup_arrivals

pytestmark = pytest.mark.unit


def side(both: float, ws: float, goodput: float = 1.0) -> dict:
    return {"slo_attainment_pct": {"both": both}, "worker_seconds": ws, "goodput_rps": goodput}


FIXED = side(99.5, 4800.0, 10.0)
# A clairvoyant schedule saving 30% of the fixed fleet's 4,800 worker-seconds (3,360), the bound 35%.
CLAIR = {"saving_vs_fixed_peak": 0.30, "bound_most_saving": 0.35}


def test_a_side_within_two_points_with_80_percent_of_the_clairvoyant_saving_meets_the_targets():
    # 1.5 points below; 3,600 worker-seconds = 25% saved = 0.833 of the clairvoyant's 30%.
    v = verdict("sinusoid", side(98.0, 3600.0), FIXED, CLAIR)
    assert v["attainment"]["points_below_fixed_peak"] == 1.5 and v["attainment"]["met"]
    w = v["worker_seconds"]
    assert w["saving_vs_fixed_peak"] == 0.25 and w["share_of_clairvoyant_saving"] == pytest.approx(0.8333, abs=1e-4)
    assert w["clairvoyant_saving_vs_fixed_peak"] == 0.30 and w["bound_most_saving_vs_fixed_peak"] == 0.35
    assert w["met"] and v["met"]


def test_a_side_short_of_either_target_is_not_met_with_its_numbers():
    # 3,700 worker-seconds: 22.9% saved, 0.764 of the clairvoyant's 30%, under 0.8.
    v = verdict("trace", side(99.0, 3700.0), FIXED, CLAIR)
    assert v["attainment"]["met"] and not v["worker_seconds"]["met"] and not v["met"]
    assert v["worker_seconds"]["share_of_clairvoyant_saving"] == pytest.approx(0.7639, abs=1e-4)
    # 2.5 points below the fixed fleet: the attainment target fails even with the whole saving.
    v = verdict("slow", side(97.0, 3360.0), FIXED, CLAIR)
    assert v["attainment"]["points_below_fixed_peak"] == 2.5 and not v["attainment"]["met"]
    assert v["worker_seconds"]["met"] and not v["met"]
    # Exactly 2 points below is within the target.
    assert verdict("slow", side(97.5, 3360.0), FIXED, CLAIR)["attainment"]["met"]


def test_the_step_load_is_judged_on_goodput_not_on_the_saving():
    # 9 of the fixed fleet's 10 good requests a second is 90%: met; 8.9 is not.
    v = verdict("step", side(99.5, 4700.0, 9.0), FIXED, None)
    assert v["goodput"]["share_of_fixed_peak"] == 0.9 and v["goodput"]["met"] and v["met"]
    assert v["worker_seconds"]["target"] is None and v["worker_seconds"]["saving_vs_fixed_peak"] == pytest.approx(
        1 - 4700 / 4800, abs=1e-4
    )
    v = verdict("step", side(99.5, 2000.0, 8.9), FIXED, None)
    assert not v["goodput"]["met"] and not v["met"]


def test_when_the_clairvoyant_schedule_saves_nothing_the_target_is_said_to_be_empty():
    v = verdict("sinusoid", side(99.5, 4800.0), FIXED, {"saving_vs_fixed_peak": 0.0, "bound_most_saving": 0.07})
    assert v["worker_seconds"]["met"] and "saves nothing" in v["worker_seconds"]["note"]


def args_for(trace: str, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    planner.add_arguments(p)
    a = p.parse_args(["--trace", trace, "--png", ""])
    for key, value in kw.items():
        setattr(a, key, value)
    return a


def azure_trace(path, rows: list[tuple[float, int, int]]) -> str:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, inp, out in rows:
        s = 46 + t
        lines.append(f"2023-11-16 18:15:{int(s):02d}.{round((s % 1) * 1e7):07d},{inp},{out}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_trace_load_replays_each_row_at_its_scaled_time_after_a_warm_up_of_fresh_prompts(tmp_path):
    # 8 rows a second apart, each with its own prompt length (100 + i): 8 s of trace over 7 s of span.
    rows = [(float(i), 100 + i, 5) for i in range(8)]
    trace = azure_trace(tmp_path / "t.csv", rows)
    # Capacity 4 req/s (given, not measured), mean 0.5 of it: 2 req/s, every gap halved; a 2 s warm-up at the first
    # 10 s window's rate: all 8 arrivals in 4 s of load, 2 req/s = 0.5 of capacity.
    a = args_for(trace, trace_mean=0.5, warmup_s=2.0)
    caps = {"t": (4.0, {"given": True})}
    run = build_load("trace", a, caps)
    assert isinstance(run.shape, TraceLoad) and run.shape.duration_s == pytest.approx(4.0)
    assert run.shape.start == pytest.approx(0.5) and run.capacity_rps == 4.0
    n_warm = sum(1 for t in run.arrivals if t < 2.0)
    assert list(run.arrivals[n_warm:]) == pytest.approx([2.0 + i / 2 for i in range(8)])
    # The warm-up takes rows of a second pass (indices 8, 9, ...: fresh prompts); each load arrival its own row.
    assert list(run.order) == [8 + i for i in range(n_warm)] + list(range(8))
    src = OrderedSource(run.source, run.order)
    assert [len(src.request(n_warm + i)[0]) for i in range(8)] == [100 + i for i in range(8)]
    # A warm-up request has its row's length but not the same prompt as that row's measured request.
    if n_warm:
        assert src.request(0)[0] != src.request(n_warm)[0] and len(src.request(0)[0]) == 100


def test_the_step_load_uses_its_own_lengths_and_the_capacity_at_that_mix(tmp_path):
    trace = azure_trace(tmp_path / "t.csv", [(0.0, 10, 5), (1.0, 10, 5)])
    a = args_for(trace, step_lengths=(800, 100), duration_s=240.0, warmup_s=0.0)
    caps = {"fixed_800_100": (24.0, {"given": True})}  # 24 req/s: the step runs at 1 and 24 req/s
    run = build_load("step", a, caps)
    assert isinstance(run.shape, Step) and (run.shape.up_s, run.shape.down_s) == (60.0, 180.0)
    assert run.source.request(0)[1] == 100 and len(run.source.request(0)[0]) == 800
    # 120 s at 24 req/s (2,880) and 120 s at 1 req/s (120): 3,000 expected.
    assert abs(len(run.arrivals) - 3000) < 4 * 3000**0.5
    assert sum(1 for t in run.arrivals if 60 <= t < 180) > 20 * sum(1 for t in run.arrivals if t < 60)


def test_the_warm_up_runs_at_the_loads_start():
    # 1/24 of 24 req/s = 1 req/s for 600 s: about 600 arrivals.
    arr = warmup_arrivals(Step.issue_10528(600.0), 600.0, 24.0, seed=1)
    assert abs(len(arr) - 600) < 4 * 600**0.5 and all(0 <= t < 600 for t in arr)
    assert warmup_arrivals(Step(), 0.0, 24.0, seed=1) == []


def test_a_load_run_is_picklable_for_the_worker_processes(tmp_path):
    import pickle

    trace = azure_trace(tmp_path / "t.csv", [(float(i), 50, 5) for i in range(4)])
    run = build_load("sinusoid", args_for(trace, duration_s=30.0, warmup_s=0.0), {"t": (2.0, {})})
    assert isinstance(pickle.loads(pickle.dumps(run)), LoadRun)


def test_load_flags_that_make_no_sense_are_refused(tmp_path):
    from components.cli.bench.planner_loads import problems

    trace = azure_trace(tmp_path / "t.csv", [(0.0, 10, 5), (1.0, 10, 5)])
    assert problems(args_for(trace)) == []  # no --load: nothing of this module's to check
    assert problems(args_for(trace, load="all")) == []
    # The default start-ups are 1.23 s and 30 s: a slow period under 20 x 30 s = 600 s is refused.
    assert problems(args_for(trace, load="slow", slow_period_s=599.0)) == [
        "--slow-period-s must be at least 20 start-ups (600 s)"
    ]
    assert problems(args_for(trace, load="slow", slow_period_s=100.0, startups_s=(5.0,))) == []
    assert problems(args_for(trace, load="trace", trace_rows=1)) == ["--trace-rows must be >= 2"]
    assert "not --lengths" in problems(args_for(trace, load="step", lengths=(3000, 150)))[0]


def action(t: float, direction: str, before: int, to: int) -> dict:
    return {"decided_s": t, "direction": direction, "from": before, "to": to}


def test_oscillations_are_counted_within_three_intervals_and_judged_at_constant_load():
    from components.cli.bench.planner_loads import oscillations

    step = Step(600.0, 0.05, 1.0, 150.0, 450.0)
    assert step.constant_spans() == ((0.0, 150.0), (150.0, 450.0), (450.0, 600.0))
    # Up at 153 s (the step's reaction), down at 180 s, up at 210 s: 57 s <= 3 x 30 s, all on the step's plateau.
    acts = [
        action(151.0, "up", 1, 6),
        action(153.0, "up", 6, 8),
        action(180.0, "down", 8, 6),
        action(210.0, "up", 6, 8),
    ]
    o = oscillations(acts, 30.0, step)
    assert (o["count"], o["at_constant_load"], o["within_s"]) == (1, 1, 90.0)
    assert o["found"][0]["sizes"] == [6, 8, 6, 8] and o["found"][0]["decided_s"] == [153.0, 180.0, 210.0]
    # The same turns spread over more than three intervals are not an oscillation; across the step they are
    # counted, but not at constant load (the offered load changed between them).
    assert oscillations([action(100.0, "up", 1, 2), action(150.0, "down", 2, 1), action(191.0, "up", 1, 2)], 30.0,
                        step)["count"] == 0  # fmt: skip
    across = oscillations([action(120.0, "down", 2, 1), action(140.0, "up", 1, 2), action(160.0, "down", 2, 1)], 30.0,
                          step)  # fmt: skip
    assert (across["count"], across["at_constant_load"]) == (1, 0)
    # A sinusoid has no stretch of constant load: counted, never judged.
    from components.cli.bench.scaling import Sinusoid

    acts = [action(10.0, "up", 1, 2), action(20.0, "down", 2, 1), action(30.0, "up", 1, 2)]
    assert oscillations(acts, 30.0, Sinusoid())["at_constant_load"] == 0


def test_the_sla_side_takes_the_predictor_its_season_and_a_warm_start_from_the_loads_previous_periods(tmp_path):
    from components.cli.bench.planner_loads import sla_config, warm_start_trace
    from components.planner.sla_warmup import warmup_series

    trace = azure_trace(tmp_path / "t.csv", [(float(i), 100 + i, 5) for i in range(4)])
    a = args_for(trace, load="sinusoid", duration_s=150.0, warmup_s=0.0, time_compression=2.0)
    run = build_load("sinusoid", a, {"t": (20.0, {})})  # capacity 20 req/s given
    # Cold and with the SLA planner's own predictor by default.
    cfg = sla_config(a, 15.0, run, None)
    assert cfg.load_predictor.value == "kalman" and cfg.load_predictor_warmup_trace is None
    assert cfg.adjustment_interval == 15.0  # 30 s / 2
    # Holt-Winters with the load's period as its season: 75 s (150 s / 2) over 15 s intervals = 5.
    a.sla_load_predictor, a.sla_season = "holt-winters", "period"
    path, info = warm_start_trace(run, 2.0, tmp_path)
    cfg = sla_config(a, 15.0, run, path)
    assert cfg.load_predictor.value == "holt-winters" and cfg.load_predictor_season == 5
    assert cfg.load_predictor_warmup_trace == path
    # Two periods of "yesterday" (150 s on the compressed clock) at 25-100% of 20 req/s: 0.625 x 20 x 150 = 1,875
    # arrivals expected, cut into 10 intervals of 15 s.
    assert info["periods"] == 2.0 and info["duration_s"] == 150.0
    assert abs(info["requests"] - 1875) < 4 * 1875**0.5
    series = warmup_series(path, cfg.adjustment_interval)
    assert len(series.rates) == 10  # every interval of the two periods, the last closed by the end row
    # The season shows: the trough's interval (the first) well under the peak's (the third: 30-45 s of 75 s).
    assert series.rates[0] < 0.6 * series.rates[2]
    assert warm_start_trace(run, 0.0, tmp_path) is None


def test_the_step_recurs_once_per_run_and_the_trace_never(tmp_path):
    from components.cli.bench.planner_loads import recurrence_s, sla_config, warm_start_trace
    from components.planner.sla_warmup import warmup_series

    trace = azure_trace(tmp_path / "t.csv", [(float(i), 100 + i, 5) for i in range(4)])
    a = args_for(trace, step_lengths=(800, 100), duration_s=240.0, warmup_s=0.0, sla_load_predictor="holt-winters",
                 sla_season="period")  # fmt: skip
    step = build_load("step", a, {"fixed_800_100": (24.0, {})})
    # The step is a day: it recurs with the run's length, 240 s, so its season is 240 / 30 = 8 intervals.
    assert recurrence_s(step.shape) == 240.0
    path, info = warm_start_trace(step, 1.5, tmp_path)
    assert sla_config(a, 30.0, step, path).load_predictor_season == 8
    # 1.5 "days": the second half of one and a whole one, 360 s. The step is at 1/24 of 24 req/s (1 req/s) outside
    # [60, 180) s of each day and at 24 req/s on it: 1 x 240 + 24 x 120 = 3,120 a day; half a day from its middle
    # (120-240 s) has 24 x 60 + 1 x 60 = 1,500. Each within four standard deviations.
    assert info["duration_s"] == 360.0
    assert abs(info["requests"] - 4620) < 4 * 4620**0.5
    series = warmup_series(path, 30.0)
    assert len(series.rates) == 12
    # Intervals 0-1 are the first day's 120-180 s (on the step), 2-3 its 180-240 s, 4-5 the second day's 0-60 s,
    # 6-9 its step (60-180 s), 10-11 its end, which the run continues: ~24 req/s against ~1.
    on, off = [0, 1, 6, 7, 8, 9], [2, 3, 4, 5, 10, 11]
    assert min(series.rates[i] for i in on) > 10 * max(series.rates[i] for i in off)
    # The trace does not repeat: no season and no warm start.
    t = build_load("trace", args_for(trace, trace_rows=4), {"t": (20.0, {})})
    assert recurrence_s(t.shape) is None and warm_start_trace(t, 2.0, tmp_path) is None


def test_the_reactive_bound_sees_the_load_a_start_up_late():
    from components.cli.bench.planner_loads import Delayed

    step = Step(600.0, 0.05, 1.0, 150.0, 450.0)
    late = Delayed(step, 30.0)
    # Before the delay: the load's start; after: the load 30 s earlier. The step is seen at 180 s, not 150 s.
    assert [late.fraction(t) for t in (0.0, 29.0, 179.9, 180.0, 479.9, 480.0)] == [0.05, 0.05, 0.05, 1.0, 1.0, 0.05]
    assert (late.duration_s, late.high, late.start, late.mean) == (600.0, 1.0, 0.05, step.mean)
    # A clairvoyant schedule on it asks a start-up ahead of 180 s: at 150 s, the moment the real step comes, and
    # its workers serve from 180 s, a start-up after the step (where the clairvoyant one's serve from 150 s).
    from components.cli.bench.clairvoyant import Oracle

    kw = dict(load_start_s=0.0, peak_workers=8, utilisation=1.0, interval_s=1.0, startup_s=30.0, max_workers=8,
              step_workers=None)  # fmt: skip
    ahead, reactive = Oracle(sinusoid=step, **kw), Oracle(sinusoid=late, **kw)
    assert ahead.need(150.0) == 8 and reactive.need(150.0) == 1 and reactive.need(180.0) == 8


def test_the_sla_flags_of_the_load_bench_are_checked(tmp_path):
    from components.cli.bench.planner_loads import problems

    trace = azure_trace(tmp_path / "t.csv", [(0.0, 10, 5), (1.0, 10, 5)])
    assert problems(args_for(trace, load="sinusoid", sla_season=1)) == [
        "--sla-season must be at least 2 intervals (or 'period')"
    ]
    assert problems(args_for(trace, load="sinusoid", sla_warm_start_periods=-1.0)) == [
        "--sla-warm-start-periods must be >= 0"
    ]
    assert problems(args_for(trace, load="sinusoid", sla_season="period", sla_warm_start_periods=2.0)) == []


def test_the_rescheduler_flags_add_an_sla_side_whose_rescheduler_moves_the_start_up_backlog(tmp_path, monkeypatch):
    """``--enable-rescheduling --rescheduling-policies waiting_fit`` (kvmesh rescheduler's own flags) adds the
    ``sla+resched`` side: the SLA planner's side with the rescheduler beside it. A small step: 2 peak workers with
    1,024 KV blocks each (16,384 tokens: 7 requests of 2,200), 1 worker at the start; the step to 6 req/s (the
    capacity given, more than the 2 workers drain) puts about 60 requests on it during the 10 s start-up of the
    second, more than its KV admits: waiting_fit moves waiting ones to the new worker once it registers; the ``sla``
    side, without a rescheduler, moves none."""
    from components.cli.bench import planner_loads

    trace = azure_trace(tmp_path / "t.csv", [(0.0, 10, 5), (1.0, 10, 5)])
    flags = ["--load", "step", "--peak-workers", "2", "--duration-s", "40", "--warmup-s", "5", "--startups-s", "10",
             "--step-lengths", "2000:200", "--num-gpu-blocks", "1024", "--jobs", "2", "--trace", trace, "--png", "",
             "--enable-rescheduling", "--rescheduling-policies", "waiting_fit", "--rescheduling-interval-ms", "400",
             "--time-compression", "2"]  # fmt: skip
    p = argparse.ArgumentParser()
    planner.add_arguments(p)
    a = p.parse_args(flags)
    assert planner_loads.problems(a) == []
    cfg = planner_loads.rescheduler_config(a)
    # The flags as `kvmesh rescheduler` reads them, the interval divided by the compression as the planners' are.
    assert cfg is not None and [str(x) for x in cfg.rescheduling_policies] == ["waiting_fit"]
    assert cfg.rescheduling_interval_ms == 200
    assert planner_loads.rescheduler_config(p.parse_args(["--load", "step"])) is None
    assert planner_loads.problems(p.parse_args(["--enable-rescheduling"])) == [
        "--enable-rescheduling runs the sla+resched side of --load: give --load"
    ]
    assert (
        "rescheduler flags: --rescheduling-policies"
        in planner_loads.problems(
            p.parse_args(["--load", "step", "--enable-rescheduling", "--rescheduling-policies", "nope"])
        )[0]
    )
    # The capacity given, not searched: 6 req/s for the 2 workers, above what they drain (the step overloads them).
    monkeypatch.setattr(planner_loads, "measure_capacity", lambda *args: (6.0, {"given": True}))
    a = p.parse_args([*flags, "--time-compression", "1", "--rescheduling-interval-ms", "200"])
    report = planner_loads.run(a)
    sides = report["loads"]["step"]["runs"]["startup_10s"]["sides"]
    assert list(sides) == list(planner_loads.SIDES)
    moved = sides["sla+resched"]["rescheduler"]
    assert moved["migrations"] > 0 and moved["migrations_by_policy"]["waiting_fit"] == moved["migrations"]
    assert moved["config"]["rescheduling_interval_ms"] == 200
    assert "rescheduler" not in sides["sla"]
    # Both SLA sides judged alike: same requests, their own verdicts with the reactive bound beside them.
    verdicts = report["loads"]["step"]["runs"]["startup_10s"]["verdict"]
    assert sides["sla+resched"]["requests"] == sides["sla"]["requests"] > 0
    for side in ("sla", "sla+resched"):
        assert "reactive_bound_share_of_fixed_peak" in verdicts[side]["goodput"]
        assert sides[side]["oscillations"]["count"] >= 0
