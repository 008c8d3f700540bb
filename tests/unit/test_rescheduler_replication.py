"""Hot-prefix replication's pure policy (components/rescheduler/policies/replication.py), with worked examples."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from components.rescheduler.config import ReplicationConfig
from components.rescheduler.policies.replication import (
    ActionKind,
    PrefixLoad,
    Replica,
    ReplicationState,
    WorkerLoad,
    copy_finished,
    drop_failed,
    holders_needed,
    plan_replication,
)

CFG = ReplicationConfig()  # target 500 ms, hot from 0.5 req/s, 16 blocks, 4 holders, 2 copies a cycle
DOC = 0xD0C  # a 512-block (8k-token) document


def fleet(*ttft_ms: float, free: int = 10_000) -> list[WorkerLoad]:
    return [WorkerLoad(i, t, free) for i, t in enumerate(ttft_ms)]


def test_holders_needed_scales_with_the_holders_wait() -> None:
    # 2 holders at a mean of 800 ms against 500 ms: 2 x 800 / 500 = 3.2 -> 4.
    assert holders_needed(2, 800.0, CFG) == 4
    # 1 holder at 1,000 ms: exactly 2.
    assert holders_needed(1, 1000.0, CFG) == 2
    # 1 holder at 3,000 ms would need 6; the cap is 4.
    assert holders_needed(1, 3000.0, CFG) == 4
    # Below the target no more than it has.
    assert holders_needed(3, 100.0, CFG) == 3


def test_worked_example_hot_document_gets_one_copy_on_the_least_loaded_non_holder() -> None:
    # Workers 0 and 1 hold the document at 900 and 700 ms (mean 800 >= 500: hot, needs 4 holders); workers 2, 3, 4
    # are at 300, 100 and 600 ms. Destination: the lowest below 500 ms, worker 3 (100 ms); source: the holder
    # predicted lower, worker 1. One copy per prefix per cycle, so 1 copy although it needs 2 more.
    doc = PrefixLoad(DOC, 512, (0, 1), requests_per_s=2.0)
    plan, state = plan_replication([doc], fleet(900, 700, 300, 100, 600), ReplicationState(), CFG, now_s=0.0)
    [copy] = plan.actions
    assert (copy.kind, copy.source_id, copy.destination_id, copy.num_blocks) == (ActionKind.COPY, 1, 3, 512)
    assert "need 4" in copy.reason
    assert state.in_flight == frozenset({(DOC, 3)})
    # Next cycle, with the copy still running: no second copy of that prefix.
    plan2, _ = plan_replication([doc], fleet(900, 700, 300, 100, 600), state, CFG, now_s=0.5)
    assert plan2.actions == ()
    assert any("already running" in s for s in plan2.skipped)


def test_the_source_is_a_holder_that_can_hand_the_prefix_over() -> None:
    # Holders 0 (300 ms) and 1 (900 ms): mean 600 >= 500, hot. 0 is predicted lower but cannot hand its KV over (a
    # vLLM engine without the NIXL connector): the source is 1. Neither can: no copy, and the plan says why.
    doc = PrefixLoad(DOC, 512, (0, 1), 2.0)
    workers = [WorkerLoad(0, 300, 10_000, can_export=False), WorkerLoad(1, 900, 10_000), WorkerLoad(2, 100, 10_000)]
    [copy] = plan_replication([doc], workers, ReplicationState(), CFG, 0)[0].actions
    assert (copy.source_id, copy.destination_id) == (1, 2)
    workers[1] = WorkerLoad(1, 900, 10_000, can_export=False)
    plan, _ = plan_replication([doc], workers, ReplicationState(), CFG, 0)
    assert plan.actions == () and plan.skipped == (f"prefix {DOC:x}: no holder that can hand it over",)


def test_not_hot_below_the_target_the_rate_or_the_length() -> None:
    workers = fleet(900, 100)
    assert (
        plan_replication([PrefixLoad(1, 512, (0,), 2.0)], fleet(400, 100), ReplicationState(), CFG, 0)[0].actions == ()
    )
    assert plan_replication([PrefixLoad(1, 512, (0,), 0.4)], workers, ReplicationState(), CFG, 0)[0].actions == ()
    assert plan_replication([PrefixLoad(1, 15, (0,), 2.0)], workers, ReplicationState(), CFG, 0)[0].actions == ()
    # All three at the bar: hot (1 holder at 900 ms needs ceil(1.8) = 2).
    [copy] = plan_replication([PrefixLoad(1, 16, (0,), 0.5)], workers, ReplicationState(), CFG, 0)[0].actions
    assert (copy.source_id, copy.destination_id) == (0, 1)


def test_destination_needs_room_eligibility_and_a_wait_below_target() -> None:
    doc = PrefixLoad(DOC, 512, (0,), 2.0)
    workers = [
        WorkerLoad(0, 900, 10_000),
        WorkerLoad(1, 50, 511),  # one block short
        WorkerLoad(2, 60, 10_000, eligible=False),  # unschedulable or stale
        WorkerLoad(3, 500, 10_000),  # at the target, not below
        WorkerLoad(4, 450, 512),  # the only fit
    ]
    [copy] = plan_replication([doc], workers, ReplicationState(), CFG, 0)[0].actions
    assert copy.destination_id == 4
    plan, _ = plan_replication([doc], workers[:4], ReplicationState(), CFG, 0)
    assert plan.actions == () and plan.skipped == (f"prefix {DOC:x}: no destination",)


def test_hottest_first_one_destination_each_and_the_cycle_cap() -> None:
    # Three hot prefixes on worker 0 (1,000 ms); free workers 1 (100 ms) and 2 (200 ms). Cap 2 copies: the two
    # hottest (rates 3 and 2) get workers 1 and 2, in that order; the third (rate 1) waits.
    prefixes = [PrefixLoad(0xA, 64, (0,), 1.0), PrefixLoad(0xB, 64, (0,), 3.0), PrefixLoad(0xC, 64, (0,), 2.0)]
    plan, state = plan_replication(prefixes, fleet(1000, 100, 200), ReplicationState(), CFG, 0)
    assert [(a.prefix_hash, a.destination_id) for a in plan.actions] == [(0xB, 1), (0xC, 2)]
    assert plan.skipped == ("prefix a: the cycle's 2 copies are taken",)
    assert state.in_flight == frozenset({(0xB, 1), (0xC, 2)})


def test_at_the_holder_cap_nothing_is_copied() -> None:
    doc = PrefixLoad(DOC, 512, (0, 1, 2, 3), 8.0)
    plan, _ = plan_replication([doc], fleet(900, 900, 900, 900, 0), ReplicationState(), CFG, 0)
    assert plan.actions == ()
    assert plan.skipped == (f"prefix {DOC:x}: 4 holders, at the cap of 4",)


def test_cold_replica_is_dropped_only_when_old_enough_and_ours() -> None:
    # Document held by 0 (the original) and 1, 2 (our replicas, made at t=0); 0.2 req/s over 3 holders = 0.067 per
    # holder < 0.1, holders at 100-300 ms < 500: cold. At t=10 (< 30 s) nothing; at t=30 one drop, on the replica
    # whose worker is predicted slowest (2, 300 ms); worker 0's copy is never ours to drop.
    doc = PrefixLoad(DOC, 512, (0, 1, 2), 0.2)
    state = ReplicationState((Replica(DOC, 1, 0.0), Replica(DOC, 2, 0.0)))
    workers = fleet(100, 200, 300)
    assert plan_replication([doc], workers, state, CFG, 10.0)[0].actions == ()
    plan, after = plan_replication([doc], workers, state, CFG, 30.0)
    [drop] = plan.actions
    assert (drop.kind, drop.destination_id, drop.source_id) == (ActionKind.DROP, 2, None)
    assert after.replicas == (Replica(DOC, 1, 0.0),)


def test_warm_replica_is_kept_and_an_evicted_one_forgotten() -> None:
    # 0.9 req/s over 3 holders = 0.3 per holder >= 0.1: kept. Worker 2 no longer holds the document: forgotten.
    state = ReplicationState((Replica(DOC, 1, 0.0), Replica(DOC, 2, 0.0)))
    plan, after = plan_replication([PrefixLoad(DOC, 512, (0, 1), 0.9)], fleet(100, 200, 300), state, CFG, 100.0)
    assert plan.actions == ()
    assert after.replicas == (Replica(DOC, 1, 0.0),)


def test_cold_by_rate_but_holders_saturated_is_kept() -> None:
    # Few requests but long queues (mean 700 ms >= 500): not cold.
    state = ReplicationState((Replica(DOC, 1, 0.0),))
    plan, after = plan_replication([PrefixLoad(DOC, 512, (0, 1), 0.1)], fleet(700, 700), state, CFG, 100.0)
    assert plan.drops() == [] and after.replicas == state.replicas


def test_copy_finished_records_a_replica_or_forgets_a_failure() -> None:
    state = ReplicationState((), frozenset({(DOC, 3)}))
    assert copy_finished(state, DOC, 3, 5.0, ok=True) == ReplicationState((Replica(DOC, 3, 5.0),), frozenset())
    assert copy_finished(state, DOC, 3, 5.0, ok=False) == ReplicationState((), frozenset())


def test_drop_failed_makes_the_replica_ours_again_once() -> None:
    other = Replica(0xBEEF, 1, 2.0)
    state = ReplicationState((other,), frozenset({(DOC, 5)}))
    restored = drop_failed(state, Replica(DOC, 3, 1.0))
    assert restored == ReplicationState((other, Replica(DOC, 3, 1.0)), frozenset({(DOC, 5)}))
    assert drop_failed(restored, Replica(DOC, 3, 9.0)) == restored  # already ours: unchanged


async def test_a_drop_that_fails_is_tried_again_next_cycle_and_one_that_succeeds_is_not(monkeypatch) -> None:
    # The live loop over a made-up fleet view: DOC (4 blocks) is held by worker 1 and by our replica on 3, and no
    # request carries it any more, so the policy drops the replica every cycle it still owns it. The first drop
    # times out: the replica must stay ours (before the fix it was forgotten and never dropped again); the second
    # succeeds and the third cycle has nothing to drop.
    from types import SimpleNamespace

    import components.rescheduler.replicator as live
    from components.protocol.replication import DropPrefixReply

    chain = (11, 12, 13, DOC)
    monkeypatch.setattr(live, "prefix_loads", lambda *a: ([PrefixLoad(DOC, 4, (1, 3), 0.0)], {DOC: chain}))
    monkeypatch.setattr(live, "worker_loads", lambda *a: [WorkerLoad(1, 10.0, 100), WorkerLoad(3, 10.0, 100)])
    calls: list[tuple[int, tuple[int, ...]]] = []

    async def drop(client: object, iid: int, hashes: tuple[int, ...], timeout_s: float) -> DropPrefixReply:
        calls.append((iid, tuple(hashes)))
        if len(calls) == 1:
            raise TimeoutError
        return DropPrefixReply(dropped=4)

    monkeypatch.setattr(live, "drop_prefix", drop)
    rep = live.LiveReplicator(object(), "ns", "backend", CFG, call_timeout_s=1.0)  # type: ignore[arg-type]
    rep.fleet.snapshot = lambda now_s: SimpleNamespace(instances={1: SimpleNamespace(model="m")})  # type: ignore[method-assign]
    rep._drop = object()  # type: ignore[assignment]
    rep.states["m"] = ReplicationState((Replica(DOC, 3, 0.0),))
    rep._chains[("m", DOC)] = chain
    first = await rep.cycle(1_000.0)
    assert [(r.action.kind, r.outcome) for r in first.results] == [(ActionKind.DROP, "timed_out")]
    assert rep.states["m"].replicas == (Replica(DOC, 3, 0.0),)
    second = await rep.cycle(1_001.0)
    assert [(r.action.kind, r.outcome) for r in second.results] == [(ActionKind.DROP, "succeeded")]
    assert calls == [(3, chain), (3, chain)]
    assert rep.states["m"].replicas == ()
    third = await rep.cycle(1_002.0)
    assert third.results == () and len(calls) == 2


def test_config_rejects_a_cold_rate_at_or_above_the_hot_rate() -> None:
    with pytest.raises(ValidationError, match="cold_rate"):
        ReplicationConfig(prefix_replication_cold_rate_per_s=0.5, prefix_replication_min_rate_per_s=0.5)
    with pytest.raises(ValidationError):
        ReplicationConfig(prefix_replication_max_holders=1)


def test_prefix_rates_keep_the_shared_run_and_count_the_window() -> None:
    # Three requests on one document (blocks 1, 2, 3) with different questions (blocks 40, 50, 60), at 0, 10 and
    # 20 s; one on another (blocks 7, 8) at 25 s. At 25 s with a 30 s window: the document is blocks (1, 2, 3) at
    # 3 / 30 = 0.1 req/s, the other (7, 8) at 1 / 30. At 31 s the request at 0 has left: 2 / 30.
    from components.rescheduler.policies.prefix_rates import PrefixRates

    rates = PrefixRates(window_s=30.0)
    for t, q in ((0.0, 40), (10.0, 50), (20.0, 60)):
        rates.observe([1, 2, 3, q], t)
    rates.observe([7, 8], 25.0)
    holders = {(1, 2, 3): [4, 2], (7, 8): []}
    loads = rates.loads(25.0, lambda hs: holders[tuple(hs)])
    assert loads == [PrefixLoad(3, 3, (2, 4), pytest.approx(0.1)), PrefixLoad(8, 2, (), pytest.approx(1 / 30))]
    assert rates.block_hashes(3) == (1, 2, 3)
    assert rates.loads(31.0, lambda hs: holders[tuple(hs)])[0].requests_per_s == pytest.approx(2 / 30)
    # All gone after the window: forgotten.
    assert rates.loads(100.0, lambda hs: ()) == [] and rates.block_hashes(3) == ()
