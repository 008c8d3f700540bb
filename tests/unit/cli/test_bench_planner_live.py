"""``kvmesh bench planner-live``'s pure parts: the trace it writes, reading a planner's decisions back from their
TensorBoard text, the start-up measured from the pool's pulls, and the pairing of live and simulated actions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from components.cli.bench.planner_live import (
    ROOT,
    add_arguments,
    align,
    compare,
    jittered,
    log_time,
    one_worker_capacity,
    overrides,
    parse_decisions,
    planner_phase_s,
    report_phase_s,
    request_lives,
    resolve_mode_defaults,
    scale_down_overlap,
    scale_down_windows,
    sim_inputs_of,
    simulated_inputs,
    spread,
    startup_delays,
    write_trace,
)
from components.deploy.graph import load_graph
from components.sim.traces import read_trace

pytestmark = pytest.mark.unit


def test_the_trace_starts_at_zero_with_unique_blocks_and_reads_back(tmp_path):
    path = tmp_path / "t.jsonl"
    n = write_trace(path, [2.5, 3.0, 4.25], prompt_tokens=700, output_tokens=100)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert n == 3 and [r["timestamp"] for r in rows] == [0, 500, 1750]
    # 700 tokens are two 512-token blocks; no block is shared between rows.
    assert [r["hash_ids"] for r in rows] == [[0, 1], [2, 3], [4, 5]]
    back = list(read_trace(path))
    assert [(r.input_length, r.output_length) for r in back] == [(700, 100)] * 3


def test_decisions_are_read_from_the_planners_text_and_holds_are_not_actions():
    texts = [
        (105.0, "decode: hold at 1 (average KV-cache use 0.4 within [0.5, 0.9])  \nGPUs 1 -> 1"),
        (115.0, "decode: scale up 1 -> 2 (average KV-cache use 0.95 > up-threshold 0.9)  \nGPUs 1 -> 2"),
        (125.0, "[no-operation] decode: would scale down 2 -> 1 (x)  \nGPUs 2 -> 1"),
        (135.0, "decode: scale down 2 -> 1 (average KV-cache use 0.2 < down-threshold 0.5)  \nGPUs 2 -> 1"),
    ]
    actions = parse_decisions(texts, t0=100.0)
    assert [(a["direction"], a["from"], a["to"], a["decided_s"]) for a in actions] == [
        ("up", 1, 2, 15.0),
        ("down", 2, 1, 35.0),
    ]
    assert actions[0]["reason"] == "average KV-cache use 0.95 > up-threshold 0.9"


def test_start_up_is_the_time_to_the_first_pull_counting_the_new_worker():
    actions = [{"direction": "up", "to": 2, "decided_s": 10.0}, {"direction": "down", "to": 1, "decided_s": 30.0}]
    pools = [(9.0, 1), (10.0, 1), (11.0, 1), (12.0, 1), (13.0, 2), (14.0, 2)]
    assert startup_delays(actions, pools) == [3.0]


def act(direction: str, before: int, after: int, t: float) -> dict[str, object]:
    return {"pool": "decode", "direction": direction, "from": before, "to": after, "decided_s": t}


def test_sequences_match_pair_by_pair_within_one_interval():
    live = [act("up", 1, 2, 31.5), act("down", 2, 1, 54.5)]
    assert compare(live, [act("up", 1, 2, 35.0), act("down", 2, 1, 60.0)], 10.0)["same_sequence"]
    late = compare(live, [act("up", 1, 2, 42.0), act("down", 2, 1, 60.0)], 10.0)  # 10.5 s apart
    assert not late["same_sequence"] and late["matched"] == 1 and late["pairs"][0]["dt_s"] == 10.5
    missing = compare(live, [act("up", 1, 2, 35.0)], 10.0)
    assert not missing["same_sequence"] and missing["pairs"][1]["sim"] is None
    wrong = compare(live, [act("up", 1, 2, 35.0), act("up", 2, 3, 55.0)], 10.0)
    assert not wrong["same_sequence"] and [p["match"] for p in wrong["pairs"]] == [True, False]


def test_alignment_skips_an_action_one_side_has_and_the_other_not():
    # Live took one more step up (2 -> 3) and so came down 3 -> 1 where the simulation came down 2 -> 1; after that
    # both went up 1 -> 2 within a second. In order, pairing stops agreeing at the second action; aligned, the first
    # and the last pair (2 of 4 live, 2 of 3 simulated), and 3 -> 1 vs 2 -> 1 are different actions.
    live = [act("up", 1, 2, 8.8), act("up", 2, 3, 9.8), act("down", 3, 1, 18.8), act("up", 1, 2, 25.8)]
    sim = [act("up", 1, 2, 8.8), act("down", 2, 1, 18.8), act("up", 1, 2, 26.8)]
    assert compare(live, sim, 10.0)["matched"] == 1
    a = align(live, sim, 10.0)
    assert (a["matched"], a["pairs"], a["live_unmatched"], a["sim_unmatched"]) == (2, [[0, 0], [3, 2]], [1, 2], [1])
    # The same action too far apart in time is no pair: the last one 10.5 s apart.
    late = [*sim[:2], act("up", 1, 2, 36.3)]
    assert align(live, late, 10.0)["matched"] == 1


def test_the_live_planners_phase_is_its_first_adjustment_modulo_the_interval():
    # First adjustment 23.4 s before the load started: later ones fall at -23.4 + 10 k, i.e. 6.6 s past each 10 s.
    assert planner_phase_s([-23.4, -13.4], 10.0) == pytest.approx(6.6)
    assert planner_phase_s([], 10.0) == 0.0


def test_the_simulated_side_is_fed_the_live_runs_inputs():
    # Seed 0's run of 2026-11-29 17:40 UTC, its numbers: the load generator started at t0 = 1000 (here), its sends
    # 4 ms late or so (and out of order by a millisecond), the live planner's decisions at 8.382 + 10 k s after t0
    # (its first pull at -1.62, with the deployment), the frontend's reports received at 0.135 + whole seconds.
    lives = [{"index": 0, "start_s": 0.004}, {"index": 1, "start_s": 1.503}, {"index": 2, "start_s": 1.502}]
    wall = report_phase_s([1001.135, 1002.137, 1003.134])  # one 2 ms late: the median of the offsets is 0
    assert wall == pytest.approx(1001.135)
    got = simulated_inputs(lives, 1000.0, 8.382, 10.0, wall)
    # The simulation's clock starts at the first send: a trace of the sends, sorted.
    assert got["arrivals_s"] == [0.004, 1.502, 1.503] and got["first_send_s"] == 0.004
    # Its planner one interval before the live one's first decision (8.382 - 10 = -1.618 after t0, -1.622 after
    # the first send), so that it makes that decision too, on the window (-1.622, 8.378] of its clock.
    assert got["planner_start_s"] == pytest.approx(-1.622)
    # The reports at 1.135 - 0.004 s past each second of the simulation's clock.
    assert got["request_stats_offset_s"] == pytest.approx(0.131)
    # Reports around a whole second: the median offset from the first's grid, across the wrap.
    assert report_phase_s([1000.999, 1002.001, 1003.0]) == pytest.approx(1001.0)
    # None heard: the simulator's default phase.
    assert report_phase_s([]) is None
    assert simulated_inputs(lives, 1000.0, 8.382, 10.0, None)["request_stats_offset_s"] == 0.0
    # The sla mode's default is these inputs; the load mode keeps the scheduled ones; either can be chosen.
    assert sim_inputs_of(parsed("--mode", "sla")) == "live" and sim_inputs_of(parsed()) == "scheduled"
    assert sim_inputs_of(parsed("--mode", "sla", "--sim-inputs", "scheduled")) == "scheduled"


def test_the_arrivals_move_within_the_jitter_and_stay_a_trace():
    import random

    base = [0.0, 0.001, 0.5, 2.0]
    moved = jittered(base, 0.002, random.Random(1))
    assert moved == sorted(moved) and all(round(t, 3) == t for t in moved)
    # Each within 2 ms of an arrival (0.0 and 0.001 may swap places: sorted again, as a trace is).
    assert len(moved) == len(base) and all(min(abs(m - b) for b in base) <= 0.002 + 1e-9 for m in moved)
    assert jittered(base, 0.002, random.Random(1)) == moved  # seeded
    assert jittered(base, 0.0, random.Random(1)) == base


def test_the_simulated_sides_spread_counts_each_sequence_and_which_match_the_live_one():
    def a(before: int, after: int, t: float) -> dict:
        return {"pool": "decode", "direction": "up" if after > before else "down", "from": before, "to": after,
                "decided_s": t}  # fmt: skip

    live = [a(1, 2, 8.4), a(2, 3, 37.4), a(3, 4, 74.4)]
    same = [a(1, 2, 8.4), a(2, 3, 37.4), a(3, 4, 74.4)]
    within = [a(1, 2, 8.4), a(2, 3, 38.4), a(3, 4, 78.4)]  # the same actions, each within one interval
    extra = [a(1, 2, 8.4), a(2, 3, 37.4), a(3, 4, 40.4), a(4, 3, 58.4), a(3, 4, 74.4)]
    got = spread(live, [same, extra, within, same], 10.0)
    assert got["draws"] == 4 and got["matching_live"] == 3
    assert got["distinct_sequences"] == 3 and got["distinct_without_times"] == 2
    first = got["sequences"][0]
    assert first == {"actions": "decode:1->2@8.4 decode:2->3@37.4 decode:3->4@74.4", "draws": 2, "matches_live": True}
    assert [x["matches_live"] for x in got["sequences"]] == [True, False, True]
    # Draw against draw by the same rule: of the 6 pairs, the two sames with each other and each with `within`
    # match; the 3 with `extra` do not: 3 of 6.
    assert got["draw_pairs_matching"] == 0.5
    assert spread(live, [same], 10.0)["draw_pairs_matching"] is None  # one draw: no pair


# -- the sla mode ------------------------------------------------------------------------------------------------------


def parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve_mode_defaults(p.parse_args(list(argv)))


def test_the_load_modes_overrides_are_what_they_were():
    args = parsed()
    assert (args.period_s, args.duration_s, args.peak_rps, args.speedup_ratio) == (120.0, 240.0, 8.0, 0.2)
    assert overrides(args, None)[1::2] == [
        "frontend.port=0",
        "workers[0].num_gpu_blocks=1024",
        "workers[0].speedup_ratio=0.2",
        "planner.adjustment_interval=10.0",
        "planner.metric_pulling_interval=1.0",
        "planner.max_gpu_budget=4",
    ]


def test_the_sla_mode_sets_the_planners_mode_targets_lead_and_the_engines_step_times():
    args = parsed("--mode", "sla")
    sets = overrides(args, Path("/tmp/tb"))[1::2]
    # Both sides get the same --set flags; only the live one writes TensorBoard files through the graph.
    assert sets[-1] == "planner.log_dir=/tmp/tb" and "planner.log_dir=/tmp/tb" not in overrides(args, None)
    assert set(sets[:-1]) == {
        "frontend.port=0",
        "workers[0].num_gpu_blocks=1024",
        "workers[0].speedup_ratio=1.0",  # real time: the planner sizes with the announced (modelled) step times
        "planner.adjustment_interval=10.0",
        "planner.metric_pulling_interval=1.0",
        "planner.max_gpu_budget=4",
        "planner.mode=sla",
        "planner.ttft=500.0",
        "planner.itl=50.0",
        "planner.load_predictor=constant",
        "planner.worker_startup_s=5.0",
        "workers[0].decode_base_ms=20.0",
        "workers[0].decode_ms_per_seq=3.0",
        "workers[0].prefill_base_ms=10.0",
        "workers[0].prefill_ms_per_token=0.1",
    }
    assert (args.period_s, args.duration_s) == (120.0, 120.0)
    # The graph these flags build is one the planner section and the engines accept.
    graph = load_graph(ROOT / args.graph, sets)
    assert str(graph.planner.mode) == "sla" and graph.planner.worker_startup_s == 5.0


def test_one_workers_capacity_is_the_sla_planners_aggregated_sizing_by_hand():
    args = parsed("--mode", "sla")
    c = one_worker_capacity(args)
    # Prefill: a 700-token prompt alone, 10 + 0.1 x 700 + 4.21e-7 x 700^2 = 80.2063 ms; the M/D/1 utilisation that
    # keeps the mean TTFT within 500 ms: 2 (500 - 80.2063) / (1000 - 80.2063) = 0.91280; one request/s costs
    # 0.0802063 / 0.91280 = 0.087869 of a worker.
    assert c["prefill_ms"] == pytest.approx(80.2063, abs=1e-3)
    assert c["prefill_share"] == pytest.approx(0.0879, abs=1e-4)
    # Decode: each sequence attends to 700 + 100 / 2 = 750 tokens; batch 9 steps in 20 + 3 x 9 + 3e-5 x 6750 =
    # 47.2025 ms (<= 50), batch 10 in 50.225 (> 50): 9 / 0.0472025 = 190.67 tokens/s, and 100 tokens a request
    # costs 100 / 190.67 = 0.52447 of a worker.
    assert (c["decode_batch"], c["decode_step_ms"]) == (9.0, pytest.approx(47.2025, abs=1e-3))
    assert c["decode_share"] == pytest.approx(0.5245, abs=1e-4)
    # One worker: 1 / (0.087869 + 0.52447) = 1.6331 requests/s; the peak, 2.5 workers' worth: 4.083 requests/s.
    assert c["requests_per_s"] == pytest.approx(1.6331, abs=1e-4)
    assert args.peak_rps == pytest.approx(4.083, abs=1e-3)
    assert parsed("--mode", "sla", "--peak-rps", "3").peak_rps == 3.0  # given: kept


LOG = [
    "2026-11-28 14:00:10,100 INFO planner adjustment 3: decode: scale down 3 -> 2 (x); GPUs 3 -> 2",
    "2026-11-28 14:00:10,101 INFO decode pool: 3 -> 2 workers: removing mock-planner-mock-2",
    "2026-11-28 14:00:10,150 INFO decode pool: retiring mock-planner-mock-2: SIGTERM to pid 7 ...",
    "2026-11-28 14:00:13,600 INFO decode pool: mock-planner-mock-2 drained, exited and removed in 3.5 s",
    "2026-11-28 14:00:20,000 INFO decode pool: 2 -> 3 workers: adding 1 watcher(s) like mock-planner-mock-0",
    "2026-11-28 14:00:30,000 INFO decode pool: 3 -> 1 workers: removing mock-planner-mock-2, mock-planner-mock-1",
    "2026-11-28 14:00:30,500 INFO decode pool: mock-planner-mock-2 drained, exited and removed in 0.5 s",
    "  a continuation line without a time",
]


def test_a_scale_downs_window_runs_from_its_decision_to_the_last_removed_workers_exit():
    t0 = log_time(LOG[0])
    assert t0 is not None and log_time(LOG[-1]) is None
    actions = [
        act("up", 1, 3, -20.0),
        act("down", 3, 2, 0.0995),  # TensorBoard's wall time, a moment before the log line (ms, truncated) at 0.1
        act("up", 2, 3, 9.9),
        act("down", 3, 1, 19.9),
    ]
    w = scale_down_windows(actions, LOG, t0 - 0.1, end_s=40.0)
    # Times relative to t0 - 0.1 (the first log line is at 0.1): the first removal's line at 0.101 follows the
    # decision at 0.0995; its worker exited at 13.6 - 10.1 + 0.1 = 3.6 s. The second removes mock-2 again (the
    # scale-up brought the name back: its earlier exit at 3.6 s is not this one's, its own is at 20.5) and mock-1,
    # whose exit the log does not show: the window ends at the run's end, 40 s. The scale-ups have no window.
    assert [(x["decided_s"], x["workers"], x["exited_s"], x["end_s"], x["exit_seen"]) for x in w] == [
        (0.0995, ["mock-planner-mock-2"], pytest.approx(3.6, abs=1e-3), pytest.approx(3.6, abs=1e-3), True),
        (19.9, ["mock-planner-mock-2", "mock-planner-mock-1"], None, 40.0, False),
    ]
    # Had mock-1 exited too, the window would end at the later exit.
    done = [*LOG, "2026-11-28 14:00:31,250 INFO decode pool: mock-planner-mock-1 drained, exited and removed in 1.2 s"]
    assert scale_down_windows(actions, done, t0 - 0.1, end_s=40.0)[1]["end_s"] == pytest.approx(21.25, abs=1e-3)


def test_requests_that_failed_or_ended_short_while_a_worker_left_are_counted():
    t0 = 1000.0
    sends = [0.0, 1.0, 2.0, 5.0, 9.0]
    results = [
        # (index, ended at wall time, error, e2e, tokens): lives relative to t0
        {"index": 0, "ended": 1003.0, "error": None, "e2e_s": 3.0, "output_tokens": 100},  # [0, 3]: before
        {"index": 1, "ended": 1006.0, "error": None, "e2e_s": 5.0, "output_tokens": 100},  # [1, 6]: overlaps, ok
        {"index": 2, "ended": 1004.5, "error": "http_503", "e2e_s": None, "output_tokens": 0},  # [2, 4.5]: overlaps
        {"index": 3, "ended": 1007.0, "error": None, "e2e_s": 2.0, "output_tokens": 60},  # [5, 7]: short, after
        {"index": 4, "ended": 1012.0, "error": None, "e2e_s": 3.0, "output_tokens": 99},  # [9, 12]: short, overlaps
    ]
    lives = request_lives(results, sends, t0, output_tokens=100)
    assert [(x["start_s"], x["end_s"], x["failed"], x["short"]) for x in lives] == [
        (0.0, 3.0, False, False),
        (1.0, 6.0, False, False),
        (2.0, 4.5, True, False),  # failed: its life from its scheduled send
        (5.0, 7.0, False, True),
        (9.0, 12.0, False, True),
    ]
    windows = [{"decided_s": 4.0, "end_s": 4.8}, {"decided_s": 10.0, "end_s": 11.0}]
    r = scale_down_overlap(lives, windows)
    # [4, 4.8] meets requests 1 and 2 (0 ended at 3, 3 started at 5); [10, 11] meets request 4: three in flight, of
    # which 2 (failed) and 4 (short) count; request 3 is short but outside every window.
    assert (r["requests"], r["failed"], r["ended_short"]) == (5, 1, 2)
    assert (r["in_flight_during_scale_down"], r["failed_during_scale_down"]) == (3, 2)
    assert [x["index"] for x in r["failed_examples"]] == [2, 3, 4]
    # Touching is not overlapping: request 0 ended exactly at a decision at 3 s and was not in flight during it;
    # requests 1 ([1, 6]) and 2 ([2, 4.5]) were.
    assert scale_down_overlap(lives, [{"decided_s": 3.0, "end_s": 3.0}])["in_flight_during_scale_down"] == 2
