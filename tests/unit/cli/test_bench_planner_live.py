"""``kvmesh bench planner-live``'s pure parts: the trace it writes, reading a planner's decisions back from their
TensorBoard text, the start-up measured from the pool's pulls, and the pairing of live and simulated actions."""

from __future__ import annotations

import json

import pytest

from components.cli.bench.planner_live import (
    compare,
    parse_decisions,
    planner_phase_s,
    startup_delays,
    write_trace,
)
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


def test_the_live_planners_phase_is_its_first_adjustment_modulo_the_interval():
    # First adjustment 23.4 s before the load started: later ones fall at -23.4 + 10 k, i.e. 6.6 s past each 10 s.
    assert planner_phase_s([-23.4, -13.4], 10.0) == pytest.approx(6.6)
    assert planner_phase_s([], 10.0) == 0.0
