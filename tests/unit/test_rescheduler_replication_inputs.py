"""Hot-prefix replication's snapshot from the fleet view (components/rescheduler/replication_inputs.py): the policy's
``WorkerLoad``s from the workers' load reports (predicted TTFT by the perf package's queueing wait) and its
``PrefixLoad``s from the frontends' request reports; and the frontend side's tally of the prefixes requests carried
(``RequestCounts.carried``), whose reports are those inputs."""

from __future__ import annotations

import pytest

from components.fleet.request_counts import RequestCounts
from components.fleet.state import FleetState
from components.protocol.messages import LoadSnapshot, PrefixCount, RequestStatsReport
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.protocol.migration import WorkerStatus
from components.rescheduler.config import ReplicationConfig
from components.rescheduler.policies.replication import ActionKind, PrefixLoad, ReplicationState, plan_replication
from components.rescheduler.replication_inputs import predicted_wait_ms, prefix_loads, worker_loads

pytestmark = pytest.mark.unit

MODEL = "m"
# A step-time model with round numbers: a prefill step of n tokens costs 10 + 0.01 n ms, a decode step of s
# sequences 5 + 0.1 s ms; a step takes at most 1,000 tokens.
STEP = {
    "prefill_base_ms": 10.0,
    "prefill_ms_per_token": 0.01,
    "prefill_ms_per_token_sq": 0.0,
    "decode_base_ms": 5.0,
    "decode_ms_per_seq": 0.1,
    "decode_ms_per_kv_token": 0.0,
    "max_num_batched_tokens": 1000,
}


def meta(role: WorkerRole = WorkerRole.AGGREGATED, copy_mode: str = "simulated") -> dict:
    d = WorkerMetadata(model=MODEL, role=role, node="n", pid=1, block_size=16, step_time=STEP).to_dict()
    return {**d, "prefix_copy_mode": copy_mode}  # as a worker announces it (workers/replication.py)


def load(running: int, waiting_tokens: int, total: int = 1000, active: int = 0) -> LoadSnapshot:
    return LoadSnapshot(
        now_s=0.0,
        kv_usage=active / total,
        num_total_blocks=total,
        num_active_blocks=active,
        num_running=running,
        num_waiting=1 if waiting_tokens else 0,
        num_waiting_prefill_tokens=waiting_tokens,
        num_preemptions=0,
        batch_size=running,
        num_kv_tokens=0,
    )


def fleet() -> FleetState:
    f = FleetState()
    f.set_members(MODEL, [(1, meta()), (2, meta()), (3, meta()), (4, meta(WorkerRole.PREFILL)), (5, meta())])
    f.apply_load(1, load(running=0, waiting_tokens=2000, active=100), 100.0)
    f.apply_load(2, load(running=100, waiting_tokens=900, active=400), 100.0)
    f.apply_load(3, load(running=0, waiting_tokens=0), 100.0)
    f.apply_load(4, load(running=0, waiting_tokens=0), 100.0)
    # 5: no load report yet
    return f


def test_worker_loads_predict_the_queueing_wait_from_each_load_report():
    snap = fleet().snapshot(100.5)
    # Worker 1: nothing decoding, 2,000 tokens queued. A step prefills 1,000 tokens in 10 + 10 = 20 ms: 0.02 ms a
    # token; 2,000 tokens = 40 ms, plus half a step's fixed 10 ms while anything is queued: 45 ms.
    # Worker 2: 100 decoding, 900 queued. A step prefills 1,000 - 100 = 900 tokens (19 ms) beside a 5 + 10 = 15 ms
    # decode: 34 ms per 900 tokens; the 900 queued: 34 + 5 = 39 ms.
    # Worker 3: nothing queued: no wait. Worker 4 is a prefill worker, 5 has no report: left out.
    got = worker_loads(snap, MODEL)
    assert [(w.instance_id, round(w.predicted_ttft_ms, 9), w.num_free_blocks, w.eligible) for w in got] == [
        (1, 45.0, 900, True),
        (2, 39.0, 600, True),
        (3, 0.0, 1000, True),
    ]
    assert predicted_wait_ms(snap.instances[5]) is None
    # Unschedulable (draining) or stale: still a worker (a holder's TTFT counts), no destination.
    f = fleet()
    f.apply_status(3, WorkerStatus(schedulable=False, reason="draining"), 100.0)
    assert [w.eligible for w in worker_loads(f.snapshot(100.5), MODEL)] == [True, True, False]
    # A single report is stale 10 s after it arrived (the fleet's first-report rule, LOAD_REPORTS.first_report_s).
    assert [w.eligible for w in worker_loads(fleet().snapshot(110.0), MODEL)] == [False, False, False]
    assert worker_loads(snap, "other") == []


def test_a_worker_that_announces_no_prefix_copy_is_neither_a_destination_nor_a_source():
    """Regression: a vLLM worker without the NIXL connector (or prefix caching) refuses every copy at once
    (test_vllm_migration.py), but it was eligible, so a hot prefix's copy went to it whenever it was predicted
    lowest, failed, and went to it again the next cycle: no other worker ever got the copy. Its metadata now says it
    cannot (``prefix_copy_mode`` ""), so the copy goes to the next worker, from a holder that can hand it over."""
    f = fleet()
    # Worker 3 (0 ms, the lowest) cannot copy: the document goes to worker 5 (a report now; 10 ms).
    f.set_members(
        MODEL, [(1, meta()), (2, meta()), (3, meta(copy_mode="")), (4, meta(WorkerRole.PREFILL)), (5, meta())]
    )
    f.apply_load(5, load(running=0, waiting_tokens=0, active=0), 100.0)
    doc = tuple(range(100, 120))
    f.apply_request_stats("a", report([(doc, 5)]), 99.0)
    snap = f.snapshot(100.0)
    workers = worker_loads(snap, MODEL)
    assert [(w.instance_id, w.eligible, w.can_export) for w in workers] == [
        (1, True, True),
        (2, True, True),
        (3, False, False),
        (5, True, True),
    ]
    cfg = ReplicationConfig(
        prefix_replication_target_ttft_ms=38.0, prefix_replication_min_blocks=16, prefix_replication_min_rate_per_s=1.0
    )
    # Held by 1 and 2 (45 and 39 ms: a mean of 42 ms, at or above 38): hot. 3 would be the destination by its 0 ms;
    # it cannot copy, so 5 (0 ms too; ties by id), from 2, the holder predicted lower.
    loads, _ = prefix_loads(snap, MODEL, 5.0, lambda h: [1, 2])
    [copy] = plan_replication(loads, workers, ReplicationState(), cfg, snap.now_s)[0].actions
    assert (copy.source_id, copy.destination_id) == (2, 5)
    # Held by 3 and 1 (0 and 45 ms: 22.5 ms, hot against a 1 ms target): 3 is predicted lower but cannot hand it
    # over, so the source is 1.
    loads, _ = prefix_loads(snap, MODEL, 5.0, lambda h: [1, 3])
    hot = cfg.model_copy(update={"prefix_replication_target_ttft_ms": 1.0})
    [copy] = plan_replication(loads, workers, ReplicationState(), hot, snap.now_s)[0].actions
    assert (copy.source_id, copy.destination_id) == (1, 5)


def report(at_prefixes: list[tuple[tuple[int, ...], int]]) -> RequestStatsReport:
    return RequestStatsReport(MODEL, 1.0, requests=sum(n for _, n in at_prefixes), prefixes=tuple(
        PrefixCount(h, n) for h, n in at_prefixes
    ))  # fmt: skip


def test_prefix_loads_merge_the_reports_of_the_window_with_their_holders():
    f = fleet()
    doc = (11, 12, 13, 14)
    # Two frontends over three seconds. The document's requests carry it plus a question block of their own; each
    # report's chain is the run its requests shared (one request: its whole prompt). Merged by first block: the
    # document's four blocks, 3 + 2 + 1 = 6 requests. One report at 94.0 is outside a 5 s window ending at 100.
    f.apply_request_stats("a", report([((*doc, 21), 1), ((31, 32), 1)]), 94.0)
    f.apply_request_stats("a", report([((*doc, 22), 1), ((*doc, 23), 1)]), 98.0)
    f.apply_request_stats("b", report([((*doc, 24, 25), 2)]), 99.0)
    f.apply_request_stats("b", report([((*doc, 26), 1), ((41, 42, 43), 1)]), 99.5)
    holders = {doc: [1, 3]}
    asked: list[tuple[int, ...]] = []

    def holders_of(hashes):
        asked.append(tuple(hashes))
        return holders.get(tuple(hashes), [])

    loads, chains = prefix_loads(f.snapshot(100.0), MODEL, 5.0, holders_of)
    # 5 requests of the document in the window (2 at 98.0, 2 at 99.0, 1 at 99.5): 5 / 5 s = 1 a second. The (41, 42,
    # 43) prefix: one request, 0.2 a second, no holder. (31, 32) was only at 94.0: gone.
    assert loads == [PrefixLoad(14, 4, (1, 3), 1.0), PrefixLoad(43, 3, (), 0.2)]
    assert chains == {14: doc, 43: (41, 42, 43)}
    assert asked == [doc, (41, 42, 43)]
    assert prefix_loads(f.snapshot(100.0), "other", 5.0, holders_of) == ([], {})


def test_the_inputs_drive_the_policy_to_copy_from_the_saturated_holder():
    # Worker 1 (45 ms) holds the document, carried 1 request a second; target 40 ms, so it is hot: 1 holder at 45 ms
    # needs ceil(45 / 40) = 2. The copy goes to the eligible non-holder predicted lowest below the target: worker 3
    # (0 ms; worker 2 is at 39 ms), from worker 1.
    f = fleet()
    doc = tuple(range(100, 120))
    f.apply_request_stats("a", report([(doc, 5)]), 99.0)
    snap = f.snapshot(100.0)
    loads, chains = prefix_loads(snap, MODEL, 5.0, lambda h: [1] if tuple(h) == doc else [])
    cfg = ReplicationConfig(
        prefix_replication_target_ttft_ms=40.0, prefix_replication_min_blocks=16, prefix_replication_min_rate_per_s=1.0
    )
    plan, state = plan_replication(loads, worker_loads(snap, MODEL), ReplicationState(), cfg, snap.now_s)
    [copy] = plan.actions
    assert (copy.kind, copy.prefix_hash, copy.source_id, copy.destination_id, copy.num_blocks) == (
        ActionKind.COPY,
        119,
        1,
        3,
        20,
    )
    assert chains[copy.prefix_hash] == doc and state.in_flight == {(119, 3)}


def test_request_counts_tally_the_prefixes_requests_carried():
    c = RequestCounts()
    c.carried((1, 2, 3, 4))
    c.carried((1, 2, 3, 9))  # shares 3 blocks with the first: the prefix shortens to (1, 2, 3)
    c.carried((1, 2, 3, 4, 5))
    c.carried((7, 8))
    c.carried(())  # no full block: not counted
    # Most requests first; ties by first hash.
    assert c.top_prefixes(5) == (PrefixCount((1, 2, 3), 3), PrefixCount((7, 8), 1))
    assert c.top_prefixes(1) == (PrefixCount((1, 2, 3), 3),)
    assert c.report(MODEL, 1.0).prefixes == () and c.report(MODEL, 1.0, 1).prefixes == (PrefixCount((1, 2, 3), 3),)
    c.reset()
    assert c.top_prefixes(5) == ()
    # The report's round trip keeps them.
    r = RequestStatsReport(MODEL, 1.0, requests=2, prefixes=(PrefixCount((1, 2), 2),))
    assert RequestStatsReport.from_dict(r.to_dict()) == r
    assert RequestStatsReport.from_dict({"model": MODEL, "interval_s": 1.0}).prefixes == ()
