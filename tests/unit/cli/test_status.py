"""``kvmesh status``'s pure parts (components/cli/status.py): instance rows from discovery and what the event plane
said, prefill queue rows, and their rendering. No mesh: the listening is the adapter's, tested end to end."""

from __future__ import annotations

import json

import pytest

from components.cli.status import (
    attach_planners,
    attach_queues,
    format_planner,
    format_queue,
    format_role,
    planner_rows_of,
    pool_lines,
    queue_rows_of,
    render_table,
    rows_of,
)
from components.fleet.queues import PrefillQueues, PrefillQueueView
from components.protocol.messages import PrefillQueueReport
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.runtime import InstanceInfo

pytestmark = pytest.mark.unit

NOW = 1_000_000.0


def info(iid: int, endpoint: str, role: WorkerRole | None, model: str = "m", ns: str = "ns") -> InstanceInfo:
    meta = {} if role is None else WorkerMetadata(model=model, role=role, pid=iid, started_at=NOW - 65).to_dict()
    if role is not None and role != WorkerRole.AGGREGATED:
        meta["remote_prefill_mode"] = "kv_transfer"
    return InstanceInfo(ns, "backend" if role else "frontend", endpoint, iid, f"subj.{iid}", meta)


def fleet() -> list[InstanceInfo]:
    """Two prefill workers (0xa, 0xb: kv_state only), one decode worker (0xc), a frontend (0xf, no role)."""
    return [
        info(0xA, "kv_state", WorkerRole.PREFILL),
        info(0xB, "kv_state", WorkerRole.PREFILL),
        info(0xC, "generate", WorkerRole.DECODE),
        info(0xC, "kv_state", WorkerRole.DECODE),
        info(0xC, "prefill_result", WorkerRole.DECODE),
        info(0xF, "http", None),
    ]


def report(waiting: int, busy: bool = False, items_done: int = 0) -> PrefillQueueReport:
    return PrefillQueueReport("m", waiting, 1, 0.42, 1, 0, busy, items_done=items_done)


def test_rows_gather_endpoints_and_a_prefill_worker_carries_its_own_report():
    reports = {("ns", 0xA): report(2, busy=True, items_done=7).to_dict()}
    rows = rows_of(fleet(), {}, NOW, reports)
    by_id = {r["instance_id"]: r for r in rows}
    assert sorted(by_id) == ["a", "b", "c", "f"]
    assert sorted(by_id["c"]["endpoints"]) == ["generate", "kv_state", "prefill_result"]
    assert by_id["a"]["prefill_report"]["items_done"] == 7 and by_id["a"]["prefill_report"]["busy"] is True
    assert by_id["b"]["prefill_report"] is None  # a prefill worker not heard from
    assert "prefill_report" not in by_id["c"] and "prefill_report" not in by_id["f"]  # not prefill workers
    assert (by_id["a"]["role"], by_id["c"]["role"], by_id["f"]["role"]) == ("prefill", "decode", None)
    assert by_id["a"]["age_s"] == 65.0
    # Without reports (as before this change), rows_of still works.
    assert rows_of(fleet(), {}, NOW)[0]["prefill_report"] is None


def test_queue_rows_come_from_the_reports_and_name_silent_prefill_workers():
    q = PrefillQueues()
    for t in (0.0, 0.1):
        q.apply(0xA, report(3), t)
    q.apply(0xB, report(2), 0.15)
    rows = rows_of(fleet(), {}, NOW)
    queues = queue_rows_of(rows, {"ns": q.views(0.2)}, listened=True)
    assert queues == [
        {
            "namespace": "ns",
            "heard": True,
            "model": "m",
            "prefill_workers": 2,
            "waiting": 2,  # 0xb's report is the freshest
            "in_flight": 1,
            "oldest_age_s": 0.42,
            "redelivered": 0,
            "pullers": 1,
            "busy": 0,
            "report_age_s": pytest.approx(0.05),
            "stats_error": "",
        }
    ]
    # Prefill workers registered and nothing heard from them: a row that says so (only when we listened at all).
    silent = queue_rows_of(rows, {}, listened=True)
    assert [(s["model"], s["heard"], s["prefill_workers"], s["waiting"]) for s in silent] == [("m", False, 0, None)]
    assert queue_rows_of(rows, {}, listened=False) == []
    # An aggregated fleet has no prefill queue row.
    agg = [info(1, "generate", WorkerRole.AGGREGATED)]
    assert queue_rows_of(rows_of(agg, {}, NOW), {}, listened=True) == []


def test_worker_rows_of_a_disaggregated_model_carry_its_queue_for_json():
    rows = rows_of(fleet(), {}, NOW)
    queues = queue_rows_of(rows, {"ns": [PrefillQueueView("m", 2, 0, 0, 0.0, 0, 2)]}, listened=True)
    attach_queues(rows, queues)
    by_id = {r["instance_id"]: r for r in rows}
    assert by_id["c"]["prefill_queue"]["prefill_workers"] == 2 and by_id["a"]["prefill_queue"]["waiting"] == 0
    assert "prefill_queue" not in by_id["f"]  # the frontend serves no model's queue
    json.dumps(rows)  # --json prints them as they are


def test_a_queue_line_says_depth_workers_and_what_is_unknown():
    def line(**over: object) -> str:
        row = {"namespace": "ns", "heard": True, **PrefillQueueView("tiny-llama", 2, 3, 1, 0.42, 0, 1).to_dict()}
        return format_queue(row | over)

    assert line() == (
        "ns: prefill queue tiny-llama: 3 waiting, 1 in flight, oldest 0.4 s, 2 prefill workers, 0 redelivered"
    )
    assert line(prefill_workers=1).endswith("1 prefill worker, 0 redelivered")
    unknown = {"waiting": None, "in_flight": None, "oldest_age_s": None, "redelivered": None}
    assert line(**unknown, prefill_workers=0) == "ns: prefill queue tiny-llama: depth unknown, 0 prefill workers"
    assert line(**unknown, stats_error="nats: timeout").endswith("depth unknown (nats: timeout), 2 prefill workers")
    assert line(heard=False) == "ns: prefill queue tiny-llama: no report heard from its prefill workers"


def test_the_table_shows_roles_and_keeps_its_first_six_columns():
    rows = rows_of(fleet(), {}, NOW)
    lines = render_table(rows).splitlines()
    assert lines[0].split()[:7] == ["NAMESPACE", "COMPONENT", "INSTANCE", "MODEL", "WATCHER", "PID", "ROLE"]
    roles = {line.split()[2]: line.split()[6] for line in lines[1:]}
    assert roles == {"a": "prefill", "b": "prefill", "c": "decode", "f": "-"}
    assert format_role("decode", "recompute") == "decode:recompute" and format_role("prefill", "kv_transfer") == (
        "prefill"
    )


# -- pools and the planner ------------------------------------------------------------------------------------------


def test_pool_lines_count_each_models_workers_by_role():
    rows = rows_of([*fleet(), info(0xD, "generate", WorkerRole.AGGREGATED, model="other")], {}, NOW)
    assert pool_lines(rows) == [
        "ns: pools m: decode 1 worker, prefill 2 workers",
        "ns: pools other: aggregated 1 worker",
    ]


def planner_status(**over: object) -> dict:
    decision = {
        "pool": "decode",
        "direction": "up",
        "current": 1,
        "target": 2,
        "reason": "average KV-cache use 0.95 > up-threshold 0.9",
        "summary": "decode: scale up 1 -> 2 (average KV-cache use 0.95 > up-threshold 0.9)",
        "metrics": {"kv_usage": 0.95},
    }
    status = {
        "model": "m",
        "connector": "local",
        "walltime": NOW,
        "no_operation": False,
        "pools": {"decode": 1, "prefill": None},
        "last_decision": {"decisions": [decision], "note": "", "walltime": NOW - 75},
        "changes_in_progress": {"decode": {"from": 1, "to": 2}},
        "changes_applied": 0,
        "change_failures": 0,
        "last_change_error": "",
        "metrics_url": "http://127.0.0.1:9/metrics",
    }
    return status | over


def test_a_planner_line_says_its_last_decision_with_the_reason_and_what_is_changing():
    [row] = planner_rows_of("ns", [json.dumps(planner_status()).encode(), b"not json", b'{"no": "model"}'])
    assert format_planner(row, NOW) == (
        "ns: planner m (load mode, local connector, metrics http://127.0.0.1:9/metrics): last decision 1m15s ago: "
        "decode: scale up 1 -> 2 (average KV-cache use 0.95 > up-threshold 0.9); changing decode 1 -> 2"
    )
    [idle] = planner_rows_of(
        "ns",
        [
            json.dumps(
                planner_status(
                    last_decision=None, changes_in_progress={}, no_operation=True, metrics_url="",
                    last_change_error="local connector: setting decode pool to 2 workers: no free GPU",
                )
            )
        ],
    )  # fmt: skip
    assert format_planner(idle, NOW) == (
        "ns: planner m (load mode, local connector, no-operation): no decision yet (the first comes one adjustment "
        "interval after it started); last failed change: local connector: setting decode pool to 2 workers: no free GPU"
    )


def test_an_sla_planner_line_gives_its_mode_and_the_numbers_behind_its_decision():
    sla = {"observed_request_rate": 4.0, "predicted_request_rate": 3.5, "next_request_rate": 4.5}
    sla |= {"observed_ttft_s": 0.2, "predicted_ttft_s": 0.25, "ttft_correction": 0.8, "itl_correction": 1.0}
    sla |= {"throughput_decode": 2, "target_decode": 3}
    [row] = planner_rows_of("ns", [json.dumps(planner_status(mode="sla", sla=sla)).encode()])
    line = format_planner(row, NOW)
    assert line.startswith("ns: planner m (sla mode, local connector,")
    assert (
        "load 4 req/s (predicted 3.5, next 4.5), TTFT 200 ms observed / 250 ms predicted, ITL - / - ms, corrections "
        "TTFT x0.8 ITL x1, decode 2 -> target 3, prefill - -> target -" in line
    ), line


def test_worker_rows_of_a_planned_model_carry_the_planner_status_for_json():
    rows = rows_of(fleet(), {}, NOW)
    attach_planners(rows, planner_rows_of("ns", [json.dumps(planner_status())]))
    by_id = {r["instance_id"]: r for r in rows}
    assert by_id["c"]["planner"]["connector"] == "local" and by_id["a"]["planner"]["model"] == "m"
    assert "planner" not in by_id["f"]
    json.dumps(rows)


# -- reschedulers ----------------------------------------------------------------------------------------------------


def test_a_rescheduler_line_says_its_last_cycle_with_each_pair_and_refusal_and_its_totals():
    from components.cli.status import format_rescheduler, rescheduler_rows_of
    from components.protocol.migration import MigrationReport
    from components.rescheduler.executor import CallOutcome, ExecutionCounts, MigrationOrder, PairResult, totals_to_dict
    from components.rescheduler.loop import CycleRecord, RejectedPair

    # A cycle as the loop records it (its own to_dict), 75 s before NOW: one pair committed one of two requests.
    order = MigrationOrder(0xA1, 0xB2, "decode_failover", reason="unschedulable: draining")
    reports = [MigrationReport("r1", "committed", mode="live"), MigrationReport("r2", "aborted_by_source")]
    result = PairResult(order, CallOutcome.DONE, reports)
    refused = (RejectedPair(0xB2, 0xA1, "decode_load", "reverse pair"), RejectedPair(0xC3, None, "decode_load", "none"))
    record = CycleRecord(7, NOW - 75, 0.0, 3, [result], refused, [])
    status = {
        "where": "standalone",
        "interval_ms": 500.0,
        "policies": ["decode_failover", "decode_load"],
        "num_cycles": 40,
        "totals": totals_to_dict({"decode_failover": ExecutionCounts(pairs=2, attempted=3, committed=1, failed=1)}),
        "last_cycle": record.to_dict(),
        "metrics_url": "",
    }
    [row] = rescheduler_rows_of("ns", [json.dumps(status).encode(), b"not json", b'{"no": "cycles"}'])
    assert format_rescheduler(row, NOW) == (
        "ns: rescheduler (standalone, every 500 ms, policies decode_failover, decode_load): 40 cycles; "
        "last cycle #7 1m15s ago: decode_failover a1 -> b2 done (1 committed, 1 aborted) [unschedulable: draining]; "
        "refused decode_load b2 -> a1: reverse pair; decode_load c3 -> -: none; "
        "totals decode_failover 1 committed/3 attempted (1 failed)"
    )
    # A later cycle that only refused: the last one that ran pairs is shown too.
    later = CycleRecord(9, NOW - 5, 0.0, 3, [], refused[1:], []).to_dict()
    [row] = rescheduler_rows_of(
        "ns", [json.dumps(status | {"last_cycle": later, "last_pairs_cycle": record.to_dict()})]
    )
    assert format_rescheduler(row, NOW) == (
        "ns: rescheduler (standalone, every 500 ms, policies decode_failover, decode_load): 40 cycles; "
        "last cycle #9 5s ago: no pair; refused decode_load c3 -> -: none; "
        "last pairs #7 1m15s ago: decode_failover a1 -> b2 done (1 committed, 1 aborted) [unschedulable: draining]; "
        "refused decode_load b2 -> a1: reverse pair; decode_load c3 -> -: none; "
        "totals decode_failover 1 committed/3 attempted (1 failed)"
    )
    idle = {**status, "last_cycle": None, "totals": {}}
    [row] = rescheduler_rows_of("ns", [json.dumps(idle).encode()])
    assert format_rescheduler(row, NOW) == (
        "ns: rescheduler (standalone, every 500 ms, policies decode_failover, decode_load): 40 cycles; "
        "no pair chosen yet"
    )


def test_a_rescheduler_line_ends_with_its_prefix_copies_and_drops():
    from components.cli.status import format_rescheduler, rescheduler_rows_of
    from components.rescheduler.loop import CycleRecord
    from components.rescheduler.policies.replication import ActionKind, ReplicationAction
    from components.rescheduler.replicator import ActionOutcome, ActionResult

    # A cycle that copied a 64-block prefix from a1 to b2 (its record's own to_dict), and the loop's totals.
    copy = ReplicationAction(ActionKind.COPY, 0xF00D, 0xB2, 0xA1, 64, "hot")
    result = ActionResult("m", copy, ActionOutcome.SUCCEEDED, "64 imported of 64 the source held", 64, 0.01)
    record = CycleRecord(3, NOW - 2, 0.0, 2, [], (), [], prefix_actions=[result])
    status = {
        "where": "colocated",
        "interval_ms": 500.0,
        "policies": ["prefix_replication"],
        "num_cycles": 5,
        "totals": {},
        "last_cycle": record.to_dict(),
        "prefix_replication": {"totals": {"copy": {"succeeded": 1}, "drop": {}}, "last_cycle": record.to_dict()},
    }
    [row] = rescheduler_rows_of("ns", [json.dumps(status).encode()])
    assert format_rescheduler(row, NOW) == (
        "ns: rescheduler (colocated, every 500 ms, policies prefix_replication): 5 cycles; last cycle #3 2s ago: "
        "no pair; prefix replication: copy 1 succeeded, drop none; last #3: copy f00d (64 blocks) a1 -> b2 succeeded "
        "(64 imported of 64 the source held)"
    )
