"""``kvmesh bench router``'s workload: what its decisions are timed on must not flatter the router's prompt memo."""

from __future__ import annotations

import argparse
import random
from array import array

import pytest

from components.cli.bench import router as bench
from components.router.adapter import MAX_PROVISIONAL_BLOCKS

pytestmark = pytest.mark.unit


def args(**over: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    ns = p.parse_args(["--indexed-blocks", "4000", "--families", "8", "--request-pool", "4", "--prompt-tokens", "2048"])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def test_every_prompt_is_new_and_a_conversations_turn_extends_its_previous_turn():
    a = args()
    fleet = bench.build_fleet(16, a, random.Random(0))
    rng = random.Random(1)
    prompts = [bench.next_prompt(fleet.shared, fleet.families, a, rng) for _ in range(200)]
    assert len({tuple(p) for p in prompts}) == 200  # no prompt is sent twice: a memo cannot serve a whole one
    assert all(len(p) == a.prompt_tokens and max(p) < bench.VOCAB for p in prompts)
    cut = slice(a.shared_prefix_tokens, a.shared_prefix_tokens + 64)  # past the system prompt every prompt shares
    assert all(p[: a.shared_prefix_tokens] == fleet.shared for p in prompts)
    hits = [p for p in prompts if any(p[cut] == f[cut] for f in fleet.families)]
    assert 0.6 < len(hits) / len(prompts) < 0.95  # --hit-fraction 0.8 of them continue a cached conversation
    for p in hits:
        family = next(f for f in fleet.families if f[cut] == p[cut])
        # The turn carries the conversation's history; the previous turn (what the router saw) is a prefix of it.
        history = len(p) - bench.NEW_TURN_TOKENS
        assert p[:history] == family[:history] and p[history:] != family[history : len(p)]
        prev = bench.previous_turn(family)
        assert p[: len(prev)] == prev and len(prev) == history - bench.NEW_TURN_TOKENS


def test_the_previous_turns_warm_the_memo_and_a_decision_reuses_them_but_hashes_its_new_turn():
    a = args()
    fleet = bench.build_fleet(16, a, random.Random(0))
    router = bench.new_router("kv", fleet, 0, a.block_size)
    bench.load_index(router, fleet, a.block_size)
    bench.replay_previous_turns(router, fleet)
    memo = router.hash_memo(a.block_size)
    assert memo is not None and len(memo) > 0
    out = bench.measure_decisions(router, fleet, args(decisions=60, warmup=0), random.Random(0))
    m = out["hash_memo"]
    # 2048-token prompts are 2 chunks: a conversation's first chunk comes from the memo, its second (history and
    # new turn) is new; a new conversation's are both new.
    assert m["chunk_hits"] > 0 and m["chunk_misses"] >= 60
    assert 0 < out["routed_cached_fraction"] <= 1
    off = bench.new_router("kv", fleet, 0, a.block_size, memo_blocks=0)
    bench.load_index(off, fleet, a.block_size)
    bench.replay_previous_turns(off, fleet)
    cold = bench.measure_decisions(off, fleet, args(decisions=60, warmup=0), random.Random(0))
    assert cold["hash_memo"]["chunk_hits"] == 0


def test_a_kv_decision_is_handed_its_prompt_packed_and_the_packing_is_reported_apart():
    # As the frontend does: the prompt packed once per request (untimed for the decision), its cost in pack_us.
    a = args()
    fleet = bench.build_fleet(16, a, random.Random(0))
    router = bench.new_router("kv", fleet, 0, a.block_size)
    seen: list[object] = []
    prepare = router.prepare
    router.prepare = lambda request: seen.append(request.token_ids) or prepare(request)  # type: ignore[method-assign]
    out = bench.measure_decisions(router, fleet, args(decisions=20, warmup=0), random.Random(0))
    assert len(seen) == 20 and all(type(t) is array and t.typecode == "I" for t in seen)
    assert out["pack_us"]["p50"] > 0 and out["pack_cpu_us"]["p50"] is not None
    plain = bench.new_router("round_robin", fleet, 0, a.block_size)
    assert "pack_us" not in bench.measure_decisions(plain, fleet, args(decisions=5, warmup=0), random.Random(0))


def test_the_gc_threshold_is_the_frontend_process_s():
    from components.frontend.main import GC_YOUNG_THRESHOLD

    assert bench.GC_YOUNG_THRESHOLD == GC_YOUNG_THRESHOLD
    assert args().gc_young_threshold == GC_YOUNG_THRESHOLD


def test_predicted_blocks_are_confirmed_and_as_many_unread_ones_evicted_so_the_index_keeps_its_size():
    # 20 decisions later at 1,000 requests/s; each worker has ~2,300 blocks no request reads, enough to evict
    a = args(decisions=120, warmup=0, confirm_after_ms=20.0, indexed_blocks=40_000)
    fleet = bench.build_fleet(16, a, random.Random(0))
    router = bench.new_router("kv", fleet, 0, a.block_size)
    next_id = bench.load_index(router, fleet, a.block_size)
    assert router.provisional
    held_before = {w: len(h) for w, h in fleet.held.items()}
    ids_before = dict(next_id)
    bench.replay_previous_turns(router, fleet)
    per_worker = {w: router.index.num_blocks(w) for w in fleet.worker_ids}
    out = bench.measure_decisions(router, fleet, a, random.Random(0), next_id, update_held=True)
    pv = out["provisional"]
    assert pv["confirm_after_decisions"] == 20
    assert pv["blocks_confirmed"] > 0 and pv["blocks_evicted"] == pv["blocks_confirmed"]
    assert router.index.stats.num_routed_confirmed > 0  # the stored events confirmed the predictions
    assert sum(next_id.values()) > sum(ids_before.values())
    # Every worker evicted as many blocks as it stored: a worker's count grows only by what is predicted and not yet
    # confirmed (the last 20 decisions' blocks, at most MAX_PROVISIONAL_BLOCKS each).
    grown = sum(router.index.num_blocks(w) - per_worker[w] for w in fleet.worker_ids)
    assert 0 <= grown <= 20 * MAX_PROVISIONAL_BLOCKS
    # fleet.held follows the events (the ingest measurement evicts from it next).
    assert sum(len(h) for h in fleet.held.values()) == sum(held_before.values())
    for w in fleet.worker_ids:
        assert set(fleet.held[w]) <= set(router.index._workers[w].blocks)


def test_without_provisional_blocks_nothing_is_confirmed():
    a = args(decisions=30, warmup=0)
    fleet = bench.build_fleet(16, a, random.Random(0))
    router = bench.new_router("kv", fleet, 0, a.block_size)
    next_id = bench.load_index(router, fleet, a.block_size)
    router.provisional = False
    ids = dict(next_id)
    out = bench.measure_decisions(router, fleet, a, random.Random(0), next_id)
    assert "provisional" not in out and next_id == ids


def test_evictions_leave_every_worker_prefix_closed():
    a = args(decisions=120, warmup=0, confirm_after_ms=20.0, indexed_blocks=40_000)
    fleet = bench.build_fleet(16, a, random.Random(0))
    router = bench.new_router("kv", fleet, 0, a.block_size)
    next_id = bench.load_index(router, fleet, a.block_size)
    index = router.index
    assert all(index.is_prefix_closed(w) for w in fleet.worker_ids)
    out = bench.measure_decisions(router, fleet, a, random.Random(0), next_id)
    assert out["provisional"]["blocks_evicted"] > 0
    assert all(index.is_prefix_closed(w) for w in fleet.worker_ids)
