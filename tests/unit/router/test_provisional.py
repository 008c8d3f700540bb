"""Provisional blocks (KV events on): the blocks a routed request's worker will compute count as held there, at the
router that placed it and, through replica sync, at the others, until the worker's events confirm them or their TTL
passes (``KvIndex.record_routed``, ``Router.on_routed``)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import KvEvent, KvEventKind, KvStateSnapshot
from components.router import Router, RouterConfig, RouteRequest
from components.router.adapter import MAX_PROVISIONAL_BLOCKS

pytestmark = pytest.mark.unit

BS = 16
PREFIX = list(range(1, 2049))  # 2,048 tokens = 128 full blocks, shared
N = len(PREFIX) // BS
H = block_hashes(PREFIX, BS)


def meta() -> dict[str, Any]:
    return {"model": "m", "block_size": BS}


def prompt(tail: int) -> list[int]:
    """The shared prefix, then 8 tokens of its own (no full block past the prefix)."""
    return PREFIX + [1000 + tail] * 8


def stored(eid: int, hashes: list[int], parent: int | None = None) -> KvEvent:
    return KvEvent(eid, KvEventKind.BLOCK_STORED, list(hashes), parent, BS)


def removed(eid: int, hashes: list[int]) -> KvEvent:
    return KvEvent(eid, KvEventKind.BLOCK_REMOVED, list(hashes), None, BS)


def kv(seed: int = 0, replica_id: int | None = None, **cfg: Any) -> Router:
    r = Router(RouterConfig(router_policy="kv", router_seed=seed, **cfg), replica_id=replica_id)
    r.set_workers("m", [(10, meta()), (20, meta())])
    return r


def linked(n: int, **cfg: Any) -> tuple[list[Router], list[int]]:
    """kv routers whose sync messages reach each other directly (the bus's job), and the msgpack size of each
    message sent."""
    routers = [kv(seed=i, replica_id=i + 1, **cfg) for i in range(n)]
    sizes: list[int] = []
    for src in routers:
        src.sync_listeners.append(lambda msg: sizes.append(len(msgpack.packb(msg))))
        for dst in routers:
            if dst is not src:
                src.sync_listeners.append(lambda msg, s=src, d=dst: d.apply_sync(s.replica_id, msg, 0.0))
    return routers, sizes


def route(r: Router, rid: str, tokens: list[int], now_s: float = 0.0) -> int:
    req = r.prepare(RouteRequest(tokens, "m", now_s))
    d = r.select(req)
    r.on_routed(rid, d, req)
    assert d.instance_id is not None
    return d.instance_id


def test_a_prefix_routed_by_one_replica_goes_to_its_worker_at_another_before_any_kv_event():
    (a, b), sizes = linked(2)
    first = route(a, "x", prompt(1))
    # b counts x as queued prefill on `first` (replica sync) and, through x's provisional blocks, the 128 prefix
    # blocks there. kv's cost in ms (~0.021 ms a prefill token, 8.25 ms for a step behind a queue, ~5 ms decode):
    # at `first` 2,056 queued + 2 x 8 uncached tokens -> ~43.6 + 8.25 + 5 = ~57; at the other worker 2 x 2,056 ->
    # ~85 + 5 = ~90. Without the provisional blocks b sees no holder: ~43 + 8.25 + 87 + 5 = ~143 at `first`, so
    # the other worker (as on main).
    d = b.select(b.prepare(RouteRequest(prompt(2), "m", 0.0)))
    assert (d.instance_id, d.overlap_blocks) == (first, N)
    # The routed message carries the 128 hashes (9 bytes each in msgpack) and the assignment.
    assert sizes and max(sizes) < N * 9 + 80


def test_one_router_sees_its_own_earlier_decision_before_the_workers_events():
    r = kv()
    first = route(r, "x", prompt(1))
    second = route(r, "y", prompt(2))
    assert second == first
    assert r.stats.num_cached_blocks == N  # the second request's prefix, predicted


def test_a_confirmed_block_outlives_the_ttl_and_an_unconfirmed_one_leaves_without_counting_as_a_removal():
    r = kv(router_provisional_ttl_s=2.0)
    w = route(r, "x", prompt(1), now_s=0.0)
    assert r.index.is_routed(w, H[0]) and r.index.stats.num_routed == N
    # The worker stores the first 100 blocks 50 ms later: those are real now.
    r.apply_kv_events(w, [stored(0, H[:100])], now_s=0.05)
    assert not r.index.is_routed(w, H[0]) and r.index.is_routed(w, H[100])
    assert r.index.stats.num_routed_confirmed == 100
    assert list(r.index.stats.confirm_latency_s) == pytest.approx([0.05] * 100)
    assert r.index.overlaps(H) == {w: N}
    assert r.index.expire(1.99) == 0
    # At 2 s the 28 unconfirmed ones leave; the 100 confirmed stay; no block counts as one the worker removed.
    d = r.select(r.prepare(RouteRequest(prompt(3), "m", 2.0)))
    assert (d.instance_id, d.overlap_blocks) == (w, 100)
    assert r.index.overlaps(H) == {w: 100}
    assert (r.index.stats.num_routed_expired, r.index.stats.num_blocks_removed) == (N - 100, 0)


def test_a_removal_ends_a_prediction_for_good_and_a_repeated_decision_extends_it():
    r = kv(router_provisional_ttl_s=2.0)
    w = route(r, "x", prompt(1), now_s=0.0)
    # The worker stored the blocks and evicted the last 4 before the router saw either event: both arrive now.
    r.apply_kv_events(w, [stored(0, H), removed(1, H[N - 4 :])], now_s=0.3)
    assert r.index.overlaps(H) == {w: N - 4}
    # A decision at 1.5 s predicts the 4 again (the worker computes them again), until 3.5 s.
    assert route(r, "y", prompt(2), now_s=1.5) == w
    assert r.index.overlaps(H) == {w: N} and r.index.is_routed(w, H[N - 4])
    assert r.index.expire(2.5) == 0  # the first decision's expiry: nothing of it is a prediction any more
    assert r.index.expire(3.5) == 4
    assert r.index.overlaps(H) == {w: N - 4}
    # A removal of blocks still predicted takes them at once; their expiry finds nothing later.
    assert route(r, "z", prompt(3), now_s=4.0) == w
    r.apply_kv_events(w, [removed(2, H[N - 4 :])], now_s=4.1)
    assert r.index.overlaps(H) == {w: N - 4} and not r.index.is_routed(w, H[N - 4])
    assert r.index.expire(10.0) == 0
    assert r.index.stats.num_routed_dropped == 4


def test_a_snapshot_replaces_predictions_with_what_the_worker_holds():
    r = kv()
    w = route(r, "x", prompt(1), now_s=0.0)
    r.begin_resync(w)
    assert r.load_kv_state(w, KvStateSnapshot(w, 5, list(H[:3])))
    assert r.index.overlaps(H) == {w: 3} and not r.index.is_routed(w, H[0])
    assert r.index.expire(100.0) == 0 and r.index.overlaps(H) == {w: 3}


def test_provisional_blocks_off_and_their_message_capped():
    r = kv(router_provisional_ttl_s=0)
    first = route(r, "x", prompt(1))
    assert route(r, "y", prompt(2)) != first  # by load: the first worker has x's prefill queued
    # A long prompt that misses: at most MAX_PROVISIONAL_BLOCKS are predicted and sent.
    (a, _), sizes = linked(2)
    long_prompt = list(range(5000, 5000 + BS * (MAX_PROVISIONAL_BLOCKS + 100)))
    w = route(a, "x", long_prompt)
    assert a.index.num_blocks(w) == MAX_PROVISIONAL_BLOCKS
    assert max(sizes) < MAX_PROVISIONAL_BLOCKS * 9 + 80


def test_the_routed_message_carries_plain_ints_and_a_router_without_replicas_builds_none():
    # The prompt comes packed (as the frontend hands it over), so its hashes are an array('Q'): the message's parent
    # and hashes are ints all the same (msgpack packs ints; ``to_compute`` reads the array's slice with tolist()).
    from array import array

    sent: list[dict[str, Any]] = []
    r = kv()
    w = route(r, "x", prompt(1))
    assert r.index.num_blocks(w) == N  # no sync listener: the predictions all the same, no message
    r.sync_listeners.append(sent.append)
    req = r.prepare(RouteRequest(array("I", PREFIX + list(range(5000, 5000 + 2 * BS))), "m", 0.0))
    d = r.select(req)
    r.on_routed("y", d, req)
    assert d.instance_id == w and d.overlap_blocks == N
    (msg,) = sent
    parent, todo = msg["pv"]
    assert parent == H[N - 1] and type(parent) is int
    assert todo == block_hashes(PREFIX + list(range(5000, 5000 + 2 * BS)), BS)[N:]
    assert all(type(h) is int for h in todo)
    assert msg["op"] == "routed" and msg["a"][:2] == ["y", w]
