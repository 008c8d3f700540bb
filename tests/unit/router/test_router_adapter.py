"""The ``Router`` adapter's bookkeeping (no I/O: time is passed in), and ``RouterFeed`` over the in-memory twins:
KV events with a gap trigger a ``kv_state`` fetch from that very instance, a joining worker's cache is fetched, a
leaving one takes its blocks, and replicas share their assignments.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_KV_STATE, TOPIC_KV_EVENTS, TOPIC_LOAD_METRICS
from components.protocol.kv_hashing import block_hashes, packed_prompt
from components.protocol.messages import KvEvent, KvEventKind, KvStateSnapshot, LoadSnapshot
from components.router import Router, RouterConfig, RouteRequest, RouterProtocolError
from components.router.feed import RouterFeed
from components.router.protocol import TOPIC_ROUTER_SYNC
from components.router.types import StepTime, WorkerSnapshot
from components.runtime import RequestContext, Runtime, RuntimeConfig
from components.runtime.memory import MemoryBus, MemoryDiscovery, MemoryStore
from tests.support.waiting import wait_until

pytestmark = pytest.mark.unit

BS = 16
NS = "rt"
PROMPT = list(range(1, 257))  # 256 tokens = 16 full blocks
H = block_hashes(PROMPT, BS)


def meta(model: str = "m") -> dict[str, Any]:
    return {"model": model, "block_size": BS}


def load(kv_usage: float = 0.1, running: int = 0, waiting: int = 0) -> LoadSnapshot:
    return LoadSnapshot(0.0, kv_usage, 1000, int(kv_usage * 1000), running, waiting, 0, 0, running, 0)


def stored(eid: int, hashes: list[int]) -> KvEvent:
    return KvEvent(eid, KvEventKind.BLOCK_STORED, list(hashes), None, BS)


def kv_router(**cfg: Any) -> Router:
    return Router(RouterConfig(router_policy="kv", router_seed=0, **cfg))


# --- bookkeeping ----------------------------------------------------------------------------------------------------


def test_a_request_adds_prefill_and_blocks_first_token_ends_prefill_finish_frees_the_rest():
    r = kv_router()
    r.set_workers("m", [(1, meta()), (2, meta())])
    r.apply_kv_events(1, [stored(0, H[:10])])
    req = r.prepare(RouteRequest(PROMPT + [7] * 8, "m", 0.0))  # 264 tokens: 16 full blocks + 8 tokens
    d = r.select(req)
    # Worker 1 caches 10 blocks: cost 264/16 - 10 = 6.5 vs worker 2's 16.5.
    assert (d.instance_id, d.overlap_blocks) == (1, 10)
    r.on_routed("a", d, req)
    w1 = r.workers("m")[0]
    # Prefill: 264 - 10 * 16 = 104 tokens; blocks: ceil(264 / 16) = 17.
    assert (w1.active_requests, w1.active_prompt_tokens, w1.active_prefill_tokens, w1.active_blocks) == (
        1,
        264,
        104,
        17,
    )
    r.on_first_token("a")
    w1 = r.workers("m")[0]
    assert (w1.active_prefill_tokens, w1.active_blocks) == (0, 17)
    r.on_finished("a")
    r.on_finished("a")  # idempotent
    w1 = r.workers("m")[0]
    assert (w1.active_requests, w1.active_prompt_tokens, w1.active_prefill_tokens, w1.active_blocks) == (0, 0, 0, 0)
    assert r.stats.num_decisions == 1 and (r.stats.num_prompt_blocks, r.stats.num_cached_blocks) == (16, 10)


def test_bookkeeping_rebuilds_the_workers_it_changes_so_a_decision_rebuilds_none():
    r = kv_router()
    r.set_workers("m", [(1, meta()), (2, meta())])
    rebuilt: list[int] = []
    snapshot = r._snapshot

    def counting(iid: int, metadata: Any) -> WorkerSnapshot:
        rebuilt.append(iid)
        return snapshot(iid, metadata)

    r._snapshot = counting  # type: ignore[method-assign]
    req = r.prepare(RouteRequest(PROMPT, "m", 0.0))
    r.select(req)
    assert rebuilt == []
    r.apply_load(2, load(0.5, running=3, waiting=1), 0.1)
    assert rebuilt == [2]
    d = r.select(req)
    assert rebuilt == [2]  # nothing left for the decision
    r.on_routed("a", d, req)
    r.on_first_token("a")
    r.on_finished("a")
    assert rebuilt == [2, d.instance_id, d.instance_id, d.instance_id]
    r.select(req)
    assert len(rebuilt) == 4
    # The table the policy reads holds what the bookkeeping left: the report, and no request in flight.
    w2 = r.workers("m")[1]
    assert (w2.kv_usage, w2.num_running, w2.num_waiting, w2.active_requests) == (0.5, 3, 1, 0)


def test_snapshots_carry_the_queue_and_the_prefill_rate_the_kv_cost_compares():
    # Worker 2 announces an engine twice as fast at prefill; worker 1 announces none (the defaults).
    fast = {"prefill_base_ms": 8.0, "prefill_ms_per_token": 0.0076, "max_num_batched_tokens": 4096}
    r = kv_router()
    r.set_workers("m", [(1, meta()), (2, {**meta(), "step_time": fast})])
    step1, step2 = StepTime(), StepTime.from_mapping(fast)
    assert step2.max_num_batched_tokens == 4096 and step2.prefill_ms_per_token == 0.0076
    w1, w2 = r.workers("m")
    assert w1.prefill_ms_per_token == step1.prefill_ms_per_prompt_token(0, 0)
    assert w2.prefill_ms_per_token == step2.prefill_ms_per_prompt_token(0, 0) < w1.prefill_ms_per_token
    req = r.prepare(RouteRequest(PROMPT, "m", 0.0))
    r.on_routed("a", r.select(req), req)  # the faster worker
    w2 = r.workers("m")[1]
    assert w2.queued_prefill_tokens == 256 and w2.active_requests == 1
    assert w2.prefill_ms_per_token == step2.prefill_ms_per_prompt_token(1, 256)
    assert w2.decode_step_ms == step2.decode_ms(2, 512)
    # A report of more waiting prefill (other routers' requests) raises the queue; less does not lower it.
    r.apply_load(2, LoadSnapshot(0.0, 0.1, 1000, 100, 0, 3, 5000, 0, 0, 0), 0.1)
    assert r.workers("m")[1].queued_prefill_tokens == 5000
    r.apply_load(2, LoadSnapshot(0.0, 0.1, 1000, 100, 0, 1, 10, 0, 0, 0), 0.2)
    assert r.workers("m")[1].queued_prefill_tokens == 256
    r.on_first_token("a")
    assert r.workers("m")[1].queued_prefill_tokens == 10
    # Garbage in the announcement keeps the defaults for the fields it spoils.
    assert StepTime.from_mapping(
        {"prefill_ms_per_token": "fast", "decode_base_ms": -1, "max_num_batched_tokens": 0}
    ) == (StepTime())


def test_a_snapshot_puts_every_count_report_and_rate_in_its_own_field():
    # Router._snapshot builds WorkerSnapshot positionally and keeps the report's fields and the step-time rates
    # between changes: every field is given a distinct value here, so a field order that drifted, or a cached value
    # kept past its change, shows up as a mismatch.
    r = Router(RouterConfig(router_policy="round_robin", metrics_stale_intervals=5, metrics_stale_min_s=0.5))
    md = meta()
    r.set_workers("m", [(1, md)])
    r.apply_load(1, LoadSnapshot(0.0, 0.25, 1000, 250, 3, 2, 7000, 0, 3, 0), 1.0)
    r.apply_load(1, LoadSnapshot(0.0, 0.5, 1000, 500, 4, 1, 9000, 0, 4, 0), 1.25)
    req = RouteRequest(PROMPT, "m", 1.3)
    r.on_routed("a", r.select(req), req)
    r.on_routed("b", r.select(req), req)
    r.on_first_token("b")
    step = StepTime()
    expected = WorkerSnapshot(
        instance_id=1,
        metadata=md,
        active_requests=2,
        active_prompt_tokens=512,
        active_prefill_tokens=256,
        active_blocks=32,
        kv_usage=0.5,
        num_running=4,
        num_waiting=1,
        num_waiting_prefill_tokens=9000,
        metrics_received_s=1.25,
        metrics_interval_s=0.25,
        metrics_stale_after_s=2.5,  # 1.25 + max(0.5, 5 * 0.25)
        queued_prefill_tokens=9000,  # the report's 9000 > this router's 256
        prefill_ms_per_token=step.prefill_ms_per_prompt_token(2, 512),
        decode_step_ms=step.decode_ms(3, 512 + 256),
    )
    assert r.workers("m") == [expected]
    # A new announcement with the same counts changes the rates (they are kept per StepTime, not per worker).
    fast = {"prefill_ms_per_token": 0.0076}
    r.set_workers("m", [(1, {**md, "step_time": fast})])
    w = r.workers("m")[0]
    assert w.prefill_ms_per_token == StepTime.from_mapping(fast).prefill_ms_per_prompt_token(2, 512)
    # A worker that leaves loses its report with it; its counts stay while its requests run.
    r.set_workers("m", [])
    r.set_workers("m", [(1, md)])
    w = r.workers("m")[0]
    assert (w.active_requests, w.kv_usage, w.metrics_received_s, w.metrics_stale_after_s) == (2, None, None, math.inf)
    assert w.queued_prefill_tokens == 256


def test_prepare_and_select_copy_every_field_of_the_request():
    r = kv_router()
    r.set_workers("m", [(1, meta()), (2, meta())])
    r.apply_kv_events(1, [stored(0, H[:4])])
    req = RouteRequest(
        PROMPT, "m", 3.0, program_id="p", ends_program=True, pinned_instance_id=9, excluded_instance_ids=frozenset({2})
    )
    prepared = r.prepare(req)
    assert prepared == dataclasses.replace(req, block_size=BS, block_hashes=H)
    d = r.select(prepared)
    # Worker 2 excluded, pin unknown: worker 1, with the 4 blocks it caches.
    assert (d.instance_id, d.overlap_blocks) == (1, 4) and "pinned worker gone" in d.reason


def test_host_tier_events_feed_a_second_index_and_a_host_hit_is_counted_as_loaded_not_prefilled():
    from components.protocol.messages import KV_MEDIUM_HOST

    r = kv_router()
    r.set_workers("m", [(1, meta()), (2, meta())])
    assert r.host_index is None  # no engine has announced a host tier
    # Worker 1 caches 2 blocks on its device and all 16 in host memory; worker 2 caches 6 on its device.
    host = KvEvent(1, KvEventKind.BLOCK_STORED, list(H), None, BS, medium=KV_MEDIUM_HOST)
    assert r.apply_kv_events(1, [stored(0, H[:2]), host])
    assert r.apply_kv_events(2, [stored(0, H[:6])])
    assert r.host_index is not None
    req = r.prepare(RouteRequest(PROMPT + [7] * 8, "m", 0.0))  # 264 tokens
    d = r.select(req)
    # Worker 1 loads 14 blocks (~2.6 us a token) and computes 8 tokens; worker 2 computes 264 - 96 = 168.
    assert (d.instance_id, d.overlap_blocks, d.host_overlap_blocks) == (1, 2, 14)
    r.on_routed("a", d, req)
    assert r.workers("m")[0].active_prefill_tokens == 264 - 16 * BS  # only what is neither cached nor loaded
    assert (r.stats.num_cached_blocks, r.stats.num_host_cached_blocks) == (2, 14)
    # A gap in the worker's events (whatever their medium) asks for a resync; its snapshot replaces both tiers.
    assert not r.apply_kv_events(1, [stored(3, H[2:3])])
    r.begin_resync(1)
    snap = KvStateSnapshot(last_event_id=3, block_size=BS, block_hashes=list(H[:8]), host_block_hashes=list(H[:4]))
    assert r.load_kv_state(1, snap)
    assert r.index.overlaps(H)[1] == 8 and r.host_index.overlaps(H)[1] == 4
    # A worker that leaves takes its host blocks with it.
    r.set_workers("m", [(2, meta())])
    assert 1 not in r.host_index.overlaps(H)


def test_a_router_hashes_a_prefix_it_has_seen_from_its_memo_and_not_with_the_memo_off():
    history = list(range(1, 16 * 130 + 1))  # 130 blocks: chunks 0 and 1 whole, chunk 2 of 2 blocks
    turn = history + list(range(5000, 5000 + 16 * 70))  # the next turn: 200 blocks
    for blocks, expect_hits in ((262_144, 2), (0, 0)):
        r = kv_router(prompt_hash_cache_blocks=blocks)
        r.set_workers("m", [(1, meta()), (2, meta())])
        r.apply_kv_events(1, [stored(0, block_hashes(history, BS))])
        r.select(r.prepare(RouteRequest(history, "m", 0.0)))
        d = r.select(r.prepare(RouteRequest(turn, "m", 1.0)))
        assert (d.instance_id, d.overlap_blocks) == (1, 130)  # the same decision either way
        memo = r.hash_memo(BS)
        assert memo is not None and memo.hits == expect_hits  # the turn's first two chunks, from the history's


@pytest.mark.parametrize(
    ("policy", "cfg"),
    [
        ("kv", {}),
        ("kv", {"prompt_hash_cache_blocks": 0}),
        ("kv", {"router_kv_events": False}),  # approximate: on_routed records the prompt's hashes itself
        ("kv+autellix", {}),
        ("kv_dynamo", {}),
    ],
)
def test_a_packed_prompt_is_routed_exactly_as_the_list(policy: str, cfg: dict[str, Any]):
    # Two routers fed the same workers, events and requests, one handed each prompt as a list, the other packed
    # (an array('I'), as the frontend hands it over): every decision, overlap and count the same. Prompts of 1 to
    # 600 blocks plus a partial one, sharing prefixes (a conversation's turns: the memo's chunks) with cached ones.
    rng = random.Random(11)
    docs = [[rng.randrange(2**17) for _ in range(BS * rng.randint(1, 600))] for _ in range(6)]
    routers = [Router(RouterConfig(router_policy=policy, router_seed=0, **cfg)) for _ in range(2)]
    workers = [(i, meta()) for i in range(1, 9)]
    seen: list[list[tuple[Any, ...]]] = [[], []]
    for r in routers:
        r.set_workers("m", workers)
        for w, d in enumerate(docs[:4], start=1):
            r.apply_kv_events(w, [stored(0, block_hashes(d[: len(d) * 2 // 3], BS))])
    for i in range(40):
        doc = rng.choice(docs)
        prompt = doc[: rng.randint(1, len(doc))] + [rng.randrange(2**17) for _ in range(rng.randint(0, 3 * BS))]
        for r, given, out in zip(routers, (prompt, packed_prompt(prompt)), seen, strict=True):
            req = r.prepare(RouteRequest(given, "m", float(i), program_id=f"p{i % 3}"))
            d = r.select(req)
            r.on_routed(f"r{i}", d, req)
            if i % 4 == 3:
                r.on_finished(f"r{i - 2}")
            wk = r.workers("m")
            out.append((d.instance_id, d.overlap_blocks, d.kind, d.reason, [x.active_prefill_tokens for x in wk]))
    assert seen[0] == seen[1]
    assert len({o[0] for o in seen[0]}) > 1 and any(o[1] for o in seen[0])  # spread, and some prefixes found


def test_a_request_that_fails_before_its_first_token_frees_its_prefill_too():
    r = Router("least_loaded")
    r.set_workers("m", [(1, meta())])
    req = RouteRequest(PROMPT, "m", 0.0)
    r.on_routed("a", r.select(req), req)
    assert r.workers("m")[0].active_prefill_tokens == 256
    r.on_finished("a")
    assert r.workers("m")[0].active_prefill_tokens == 0


def test_prepare_hashes_once_with_the_models_block_size_and_only_for_kv_policies():
    r = kv_router()
    r.set_workers("m", [(1, {"model": "m", "block_size": 32})])
    req = r.prepare(RouteRequest(PROMPT, "m", 0.0))
    assert req.block_size == 32 and req.block_hashes == block_hashes(PROMPT, 32)
    assert r.prepare(req) is req  # already hashed: untouched
    plain = Router("round_robin")
    plain.set_workers("m", [(1, meta())])
    assert plain.prepare(RouteRequest(PROMPT, "m", 0.0)).block_hashes is None


def test_a_worker_that_leaves_takes_its_blocks_and_its_late_events_are_ignored_until_it_returns():
    r = kv_router()
    r.set_workers("m", [(1, meta()), (2, meta())])
    r.apply_kv_events(1, [stored(0, H)])
    assert r.index.overlaps(H) == {1: 16}
    seen: list[tuple[set[int], set[int]]] = []
    r.membership_listeners.append(lambda added, removed: seen.append((added, removed)))
    r.set_workers("m", [(2, meta())])
    assert seen == [(set(), {1})]
    assert r.index.overlaps(H) == {}
    assert r.apply_kv_events(1, [stored(1, H)]) and r.index.overlaps(H) == {}  # a draining worker's last events
    r.apply_load(1, load(), 1.0)
    assert r.workers("m")[0].instance_id == 2
    r.set_workers("m", [(1, meta()), (2, meta())])  # it registers again (a lost lease re-acquired)
    assert seen[-1] == ({1}, set())
    r.apply_kv_events(1, [stored(5, H[:4])])
    assert r.index.overlaps(H) == {1: 4}


def test_a_worker_hashing_with_another_scheme_is_not_indexed(caplog):
    # A worker of another kvmesh version announces another kv_hash_scheme: its hashes could never match this
    # router's, so its events and snapshots are ignored (and said so); it still gets requests by load.
    r = kv_router()
    with caplog.at_level("WARNING"):
        r.set_workers("m", [(1, {**meta(), "kv_hash_scheme": 1}), (2, meta()), (3, {**meta(), "kv_hash_scheme": 2})])
    assert "worker 1 hashes KV blocks with scheme 1" in caplog.text
    for w in (1, 2, 3):
        assert r.apply_kv_events(w, [stored(0, H)])
    assert r.load_kv_state(1, KvStateSnapshot(last_event_id=3, block_size=BS, block_hashes=H))
    assert r.index.overlaps(H) == {2: 16, 3: 16}
    assert {w.instance_id for w in r.workers("m")} == {1, 2, 3}


def test_a_prefix_every_worker_caches_is_reported_per_worker_through_the_floor():
    # Every worker of the model caches the first 4 blocks; worker 2 the whole prompt. A pinned worker's reported
    # overlap is its own (4 via the common floor), and a worker with no KV event yet (no index bit) caches nothing.
    r = kv_router()
    r.set_workers("m", [(1, meta()), (2, meta()), (3, meta())])
    for w in (1, 3):
        r.apply_kv_events(w, [stored(0, H[:4])])
    r.apply_kv_events(2, [stored(0, H)])
    d = r.select(r.prepare(RouteRequest(PROMPT, "m", 0.0)))
    assert (d.instance_id, d.overlap_blocks) == (2, 16)
    assert r.select(r.prepare(RouteRequest(PROMPT, "m", 0.0, pinned_instance_id=3))).overlap_blocks == 4
    r.set_workers("m", [(1, meta()), (2, meta()), (3, meta()), (4, meta())])
    assert r.select(r.prepare(RouteRequest(PROMPT, "m", 0.0, pinned_instance_id=4))).overlap_blocks == 0
    assert r.select(r.prepare(RouteRequest(PROMPT, "m", 0.0, pinned_instance_id=1))).overlap_blocks == 4


def test_counts_of_a_worker_that_left_survive_until_its_requests_finish():
    r = Router("least_loaded")
    r.set_workers("m", [(1, meta())])
    req = RouteRequest(PROMPT, "m", 0.0)
    r.on_routed("a", r.select(req), req)
    r.set_workers("m", [])
    r.set_workers("m", [(1, meta())])
    assert r.active_requests(1) == 1
    r.on_finished("a")
    assert r.active_requests(1) == 0


def test_load_reports_fill_snapshots_and_their_silence_makes_the_worker_stale():
    r = Router(RouterConfig(router_policy="round_robin", metrics_stale_intervals=5, metrics_stale_min_s=0.5))
    r.set_workers("m", [(1, meta()), (2, meta())])
    for t in (0.0, 0.1, 0.2):
        r.apply_load(1, load(kv_usage=0.25, running=3, waiting=1), t)
        r.apply_load(2, load(), t)
    w1 = r.workers("m")[0]
    assert (w1.kv_usage, w1.num_running, w1.num_waiting) == (0.25, 3, 1)
    assert w1.metrics_interval_s == pytest.approx(0.1)
    assert w1.metrics_stale_after_s == pytest.approx(0.7)  # 0.2 + max(0.5, 5 * 0.1)
    # Worker 2 keeps reporting, worker 1 falls silent after 0.2 s: routable until 0.7 s, then not.
    for t in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        r.apply_load(2, load(), t)
    assert r.routable("m", 0.69) == [1, 2]
    assert r.routable("m", 0.71) == [2]
    assert {r.select(RouteRequest([1], "m", 0.8)).instance_id for _ in range(4)} == {2}


def test_the_interval_estimate_shrugs_off_one_long_pause():
    r = Router("round_robin")
    r.set_workers("m", [(1, meta())])
    t = 0.0
    for _ in range(20):
        r.apply_load(1, load(), t)
        t += 0.1
    r.apply_load(1, load(), t + 3.0)  # one 3 s pause (a GC, a reconnect): counted as 0.2 s, moving the average 10%
    assert r.workers("m")[0].metrics_interval_s == pytest.approx(0.11, abs=0.005)


def test_approximate_mode_predicts_the_cache_from_assignments_until_the_ttl():
    r = kv_router(router_kv_events=False, router_ttl_s=30)
    r.set_workers("m", [(1, meta()), (2, meta())])
    req = r.prepare(RouteRequest(PROMPT, "m", 0.0))
    first = r.select(req)
    r.on_routed("a", first, req)
    r.on_finished("a")
    again = r.select(r.prepare(RouteRequest(PROMPT + [5] * 16, "m", 10.0)))
    assert again.instance_id == first.instance_id and again.overlap_blocks == 16
    later = r.select(r.prepare(RouteRequest(PROMPT, "m", 31.0)))  # 31 s > 30 s TTL: forgotten
    assert later.overlap_blocks == 0


def test_end_program_reaches_an_affinity_policy_only():
    r = Router(RouterConfig(router_policy="autellix"))
    r.set_workers("m", [(1, meta()), (2, meta())])
    r.select(RouteRequest(list(range(3000)), "m", 0.0, program_id="p"))
    assert "p" in r.policy_state("m").programs
    assert r.end_program("m", "p") and "p" not in r.policy_state("m").programs
    assert not Router("kv").end_program("m", "p")


# --- replicas -------------------------------------------------------------------------------------------------------


def linked(n: int, **cfg: Any) -> list[Router]:
    """Routers whose sync messages reach each other directly (the bus's job in production)."""
    routers = [
        Router(RouterConfig(router_policy="least_loaded", router_seed=i, **cfg), replica_id=i + 1) for i in range(n)
    ]
    for src in routers:
        for dst in routers:
            if dst is not src:
                src.sync_listeners.append(lambda msg, s=src, d=dst: d.apply_sync(s.replica_id, msg, 0.0))
    for r in routers:
        r.set_workers("m", [(10, meta()), (20, meta())])
    return routers


def test_replicas_count_each_others_assignments():
    a, b = linked(2)
    req = RouteRequest(PROMPT, "m", 0.0)
    da = a.select(req)
    a.on_routed("x", da, req)
    # b sees x on da's worker, so it places its own request on the other one.
    db = b.select(req)
    assert db.instance_id != da.instance_id
    b.on_routed("y", db, req)
    assert [a.active_requests(10), a.active_requests(20)] == [1, 1] == [b.active_requests(10), b.active_requests(20)]
    a.on_first_token("x")
    assert b.workers("m")[[10, 20].index(da.instance_id)].active_prefill_tokens == 0
    a.on_finished("x")
    assert b.active_requests(da.instance_id) == 0


def test_a_request_routed_by_one_replica_may_be_reported_to_another():
    # A standalone router's caller reports to whichever replica its call reaches.
    a, b = linked(2)
    req = RouteRequest(PROMPT, "m", 0.0)
    d = a.select(req)
    a.on_routed("x", d, req)
    assert b.is_inflight("x")
    b.on_first_token("x")
    assert a.workers("m")[[10, 20].index(d.instance_id)].active_prefill_tokens == 0
    b.on_finished("x")
    assert not a.is_inflight("x") and not b.is_inflight("x")
    b.apply_sync(a.replica_id, a.sync_state(), 0.0)  # a's next state no longer holds x: nothing comes back
    assert a.active_requests(d.instance_id) == 0 == b.active_requests(d.instance_id)


def test_a_state_message_replaces_a_replicas_view_and_bye_forgets_it():
    a, b = linked(2)
    req = RouteRequest(PROMPT, "m", 0.0)
    a.on_routed("x", a.select(req), req)
    assert b.active_requests(10) + b.active_requests(20) == 1
    # Messages get lost: b never hears that x finished nor that z and w were routed (a holds z and w).
    a.sync_listeners.clear()
    a.on_finished("x")
    for rid in ("z", "w"):
        a.on_routed(rid, a.select(req), req)
    assert b.active_requests(10) + b.active_requests(20) == 1
    # a's periodic state heals b, and teaches a replica that joined late everything at once.
    c = Router("least_loaded", replica_id=99)
    c.set_workers("m", [(10, meta()), (20, meta())])
    for r in (b, c):
        r.apply_sync(a.replica_id, a.sync_state(), 0.0)
        assert [r.active_requests(10), r.active_requests(20)] == [a.active_requests(10), a.active_requests(20)]
        assert r.active_requests(10) + r.active_requests(20) == 2
    b.apply_sync(a.replica_id, {"op": "bye"}, 0.0)
    assert b.active_requests(10) + b.active_requests(20) == 0 and b.replicas() == []


def test_a_silent_replica_is_forgotten_with_its_requests():
    a, b = linked(2)
    req = RouteRequest(PROMPT, "m", 0.0)
    a.on_routed("x", a.select(req), req)
    assert b.replicas() == [a.replica_id]
    assert b.expire_replicas(now_s=4.0, timeout_s=5.0) == []
    assert b.expire_replicas(now_s=5.5, timeout_s=5.0) == [a.replica_id]
    assert b.active_requests(10) + b.active_requests(20) == 0


def test_own_and_unknown_sync_messages_are_ignored_and_malformed_ones_raise():
    r = Router("least_loaded", replica_id=7)
    r.set_workers("m", [(10, meta())])
    r.apply_sync(7, {"op": "routed", "a": ["x", 10, 1, 1, 1, False]}, 0.0)  # its own echo
    r.apply_sync(8, {"op": "future-op"}, 0.0)
    assert r.active_requests(10) == 0
    with pytest.raises(RouterProtocolError):
        r.apply_sync(8, {"op": "routed", "a": ["x", "not-an-id"]}, 0.0)
    with pytest.raises(RouterProtocolError):
        r.apply_sync(8, {"no": "op"}, 0.0)


# --- RouterFeed over the memory twins -------------------------------------------------------------------------------


class FakeWorker:
    """Serves ``generate`` and ``kv_state`` under one instance id and publishes hand-made KV events: the test decides
    which event ids go missing and what the snapshot says."""

    def __init__(self, rt: Runtime, iid: int) -> None:
        self.rt = rt
        self.iid = iid
        self.snapshot = KvStateSnapshot(-1, BS, [])
        self.num_kv_state_calls = 0
        self.failures_left = 0  # kv_state calls to fail before answering
        self.served: list[Any] = []

    async def start(self) -> None:
        comp = self.rt.namespace(NS).component("backend")
        self.served.append(await comp.endpoint(ENDPOINT_KV_STATE).serve(self._kv_state, meta(), instance_id=self.iid))
        self.served.append(await comp.endpoint(ENDPOINT_GENERATE).serve(self._generate, meta(), instance_id=self.iid))

    async def stop(self) -> None:
        for s in reversed(self.served):
            await s.stop(drain_timeout_s=0.1)

    async def _kv_state(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        self.num_kv_state_calls += 1
        if self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("engine busy")
        yield self.snapshot.to_dict()

    async def _generate(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        yield {}

    async def publish(self, *events: KvEvent) -> None:
        await self.rt.namespace(NS).events.publish(TOPIC_KV_EVENTS, [e.to_dict() for e in events], source_id=self.iid)


@pytest.fixture
async def mesh() -> AsyncIterator[Callable[[], Any]]:
    store, bus = MemoryStore(), MemoryBus()
    made: list[Runtime] = []

    async def runtime() -> Runtime:
        rt = await Runtime.from_parts(RuntimeConfig(), MemoryDiscovery(store), bus)
        made.append(rt)
        return rt

    yield runtime
    for rt in made:
        await rt.shutdown(drain_timeout_s=0.1)


async def test_feed_fetches_a_joining_workers_cache_and_resyncs_after_a_gap(mesh):
    wrt, rrt = await mesh(), await mesh()
    w = FakeWorker(wrt, 0xA1)
    w.snapshot = KvStateSnapshot(4, BS, H[:6])  # its cache before the router existed: 6 blocks as of event 4
    await w.start()
    router = kv_router()
    feed = RouterFeed(rrt, router, NS, ["backend"], watch_workers=True)
    await feed.start()
    try:
        # Joined: its snapshot is fetched at once, without waiting for an event.
        await wait_until(lambda: router.index.overlaps(H) == {0xA1: 6})
        assert w.num_kv_state_calls == 1 and router.models() == ["m"]
        # Events continue from 5; then 6 is lost and 7 arrives: a gap. The worker's snapshot now says 9 blocks as of
        # event 7, and event 8 (a tenth block) arrives while the fetch is under way: replayed after the snapshot.
        await w.publish(stored(5, H[6:7]))
        await wait_until(lambda: router.index.overlaps(H) == {0xA1: 7})
        w.snapshot = KvStateSnapshot(7, BS, H[:9])
        await w.publish(stored(7, H[8:9]))
        await w.publish(stored(8, H[9:10]))
        await wait_until(lambda: router.index.overlaps(H) == {0xA1: 10})
        assert w.num_kv_state_calls == 2 and router.index.stats.num_gaps == 1
        assert feed.num_resyncs == 2
    finally:
        await feed.stop()


async def test_feed_drops_a_leaving_workers_blocks_and_follows_load_metrics(mesh):
    wrt, rrt = await mesh(), await mesh()
    workers = [FakeWorker(wrt, 0xB1), FakeWorker(wrt, 0xB2)]
    for w in workers:
        await w.start()
    router = kv_router()
    feed = RouterFeed(rrt, router, NS, ["backend"], watch_workers=True)
    await feed.start()
    try:
        await wait_until(lambda: router.members() == [0xB1, 0xB2])
        await workers[0].publish(stored(0, H))
        await wait_until(lambda: router.index.overlaps(H) == {0xB1: 16})
        await wrt.namespace(NS).events.publish(TOPIC_LOAD_METRICS, load(kv_usage=0.5).to_dict(), source_id=0xB2)
        await wait_until(lambda: router.workers("m")[1].kv_usage == 0.5)
        await workers[0].stop()
        await wait_until(lambda: router.members() == [0xB2])
        assert router.index.overlaps(H) == {}
        req = router.prepare(RouteRequest(PROMPT, "m", time.monotonic()))
        assert router.select(req).instance_id == 0xB2
    finally:
        await feed.stop()


async def test_feed_retries_a_fetch_that_fails_while_the_worker_stays(mesh):
    wrt, rrt = await mesh(), await mesh()
    w = FakeWorker(wrt, 0xC1)
    w.snapshot = KvStateSnapshot(3, BS, H[:5])
    w.failures_left = 2
    await w.start()
    router = kv_router()
    feed = RouterFeed(rrt, router, NS, ["backend"], watch_workers=True)
    await feed.start()
    try:
        # Fails twice (the worker answers with an error), then answers: back-off 0.1 s, then 0.2 s.
        await wait_until(lambda: router.index.overlaps(H) == {0xC1: 5})
        assert w.num_kv_state_calls == 3 and feed.num_resync_failures == 2
    finally:
        await feed.stop()


async def test_feeds_share_assignments_over_the_sync_topic(mesh):
    rts = [await mesh(), await mesh()]
    routers = [
        Router(RouterConfig(router_policy="least_loaded", router_replica_sync=True, router_sync_interval_s=0.05))
        for _ in rts
    ]
    feeds = [RouterFeed(rt, r, NS, ["backend"]) for rt, r in zip(rts, routers, strict=True)]
    for r in routers:
        r.set_workers("m", [(1, meta()), (2, meta())])
    for f in feeds:
        await f.start()
    try:
        a, b = routers
        req = RouteRequest(PROMPT, "m", 0.0)
        a.on_routed("x", a.select(req), req)
        await wait_until(lambda: b.active_requests(1) + b.active_requests(2) == 1)
        a.on_finished("x")
        await wait_until(lambda: b.active_requests(1) + b.active_requests(2) == 0)
        await wait_until(lambda: b.replicas() == [a.replica_id] and a.replicas() == [b.replica_id])
        # A stopping feed says bye: its assignments vanish from the other at once.
        a.on_routed("y", a.select(req), req)
        await wait_until(lambda: b.active_requests(1) + b.active_requests(2) == 1)
        await feeds[0].stop()
        await wait_until(lambda: b.active_requests(1) + b.active_requests(2) == 0 and b.replicas() == [])
        # Its periodic state (every 50 ms) is on the topic too: a raw subscriber sees it.
        sub = await rts[1].namespace(NS).events.subscribe(TOPIC_ROUTER_SYNC)
        ev = await sub.get(timeout_s=1.0)
        assert ev.source_id == b.replica_id and ev.payload["op"] in ("state", "routed", "finished", "first_token")
        await sub.close()
    finally:
        await feeds[1].stop()
