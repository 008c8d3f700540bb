"""The simulated engine's paged KV block pool: reference counts, prefix cache, LRU eviction, KV events."""

from __future__ import annotations

import pytest

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import KV_MEDIUM_HOST, KvEventKind
from components.workers.engines.mock.block_pool import BlockPool, NoFreeBlocksError

pytestmark = pytest.mark.unit

BS = 4


def make_pool(num_blocks: int = 8, *, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, BS, enable_caching=enable_caching)


def store_sequence(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate and cache the full blocks of ``tokens`` as one request would; returns (block ids, hashes)."""
    hashes = block_hashes(tokens, BS)
    blocks = pool.allocate(len(hashes))
    pool.cache_full_blocks(blocks, hashes, None)
    return blocks, hashes


def check_counts(pool: BlockPool) -> None:
    refs = [pool.ref_cnt(b) for b in range(pool.num_blocks)]
    assert pool.num_active_blocks == sum(1 for r in refs if r > 0)
    assert pool.num_active_blocks + pool.num_free_blocks == pool.num_blocks


def test_allocate_and_free_track_active_blocks():
    pool = make_pool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_active_blocks == 3 and pool.usage == 3 / 8
    pool.free(a)
    assert pool.num_active_blocks == 0 and pool.num_free_blocks == 8
    check_counts(pool)
    with pytest.raises(NoFreeBlocksError) as exc_info:
        pool.allocate(9)
    assert exc_info.value.requested == 9 and exc_info.value.free == 8


def test_refcounts_are_shared_between_requests():
    pool = make_pool(8)
    blocks, hashes = store_sequence(pool, list(range(8)))  # request A holds 2 blocks
    hit = pool.lookup_prefix(hashes)
    assert hit == blocks
    pool.touch(hit)  # request B shares them
    assert [pool.ref_cnt(b) for b in blocks] == [2, 2]
    assert pool.num_active_blocks == 2  # shared blocks count once
    pool.free(blocks)  # A finishes
    assert [pool.ref_cnt(b) for b in blocks] == [1, 1] and pool.num_active_blocks == 2
    pool.free(hit)  # B finishes: the blocks stay cached but are free
    assert pool.num_active_blocks == 0 and pool.num_cached_blocks == 2
    assert pool.lookup_prefix(hashes) == blocks
    check_counts(pool)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(blocks)


def test_touch_takes_a_cached_free_block_back_out_of_the_free_count():
    pool = make_pool(4)
    blocks, hashes = store_sequence(pool, list(range(8)))
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.num_reactivated(blocks) == 2
    pool.touch(blocks)
    assert pool.num_free_blocks == 2 and pool.num_reactivated(blocks) == 0
    # Only two blocks remain allocatable, and allocating them must not evict the touched ones.
    pool.allocate(2)
    assert pool.lookup_prefix(hashes) == blocks
    assert pool.take_events()[-1].kind is KvEventKind.BLOCK_STORED  # no BLOCK_REMOVED


def test_lookup_stops_at_the_first_miss():
    pool = make_pool(8)
    _, hashes = store_sequence(pool, list(range(12)))
    other = block_hashes([99] * 4 + list(range(4, 12)), BS)
    assert pool.lookup_prefix(hashes + other) == pool.lookup_prefix(hashes)
    assert len(pool.lookup_prefix(hashes)) == 3
    assert pool.lookup_prefix(other) == []


def test_empty_blocks_are_used_before_cached_ones_are_evicted():
    pool = make_pool(4)
    blocks, hashes = store_sequence(pool, list(range(8)))
    pool.free(blocks)
    pool.take_events()
    pool.allocate(2)  # the 2 empty blocks
    assert pool.take_events() == [] and pool.num_cached_blocks == 2
    pool.allocate(1)  # now one cached block must go
    (removed,) = pool.take_events()
    assert removed.kind is KvEventKind.BLOCK_REMOVED and removed.block_hashes == [hashes[1]]


def test_eviction_is_least_recently_freed_first_and_tail_blocks_first():
    pool = make_pool(4)
    a_blocks, a_hashes = store_sequence(pool, list(range(8)))
    b_blocks, b_hashes = store_sequence(pool, list(range(100, 108)))
    pool.free(a_blocks)  # A freed first: its blocks are the least recently used
    pool.free(b_blocks)
    pool.take_events()
    pool.allocate(3)
    (removed,) = pool.take_events()
    # A's tail block, then A's head block (freed in reverse), then B's tail; B's head survives.
    assert removed.block_hashes == [a_hashes[1], a_hashes[0], b_hashes[1]]
    assert pool.lookup_prefix(b_hashes) == [b_blocks[0]]
    assert pool.kv_state().block_hashes == [b_hashes[0]]


def test_a_prefix_hit_refreshes_recency():
    pool = make_pool(4)
    a_blocks, a_hashes = store_sequence(pool, list(range(8)))
    b_blocks, b_hashes = store_sequence(pool, list(range(100, 108)))
    pool.free(a_blocks)
    pool.free(b_blocks)
    pool.touch(pool.lookup_prefix(a_hashes))  # A's prefix is reused: now B is the LRU
    pool.free(a_blocks)
    pool.take_events()
    pool.allocate(2)
    (removed,) = pool.take_events()
    assert removed.block_hashes == [b_hashes[1], b_hashes[0]]


def test_stored_events_carry_chain_parent_and_block_size_with_contiguous_ids():
    pool = make_pool(8)
    tokens = list(range(20))  # 5 full blocks
    hashes = block_hashes(tokens, BS)
    blocks = pool.allocate(5)
    pool.cache_full_blocks(blocks[:2], hashes[:2], None)  # a first prefill chunk
    pool.cache_full_blocks(blocks[2:5], hashes[2:5], hashes[1])  # the second chunk
    events = pool.take_events()
    assert [e.event_id for e in events] == [1, 2] and pool.last_event_id == 2
    assert [e.kind for e in events] == [KvEventKind.BLOCK_STORED] * 2
    assert events[0].block_hashes == hashes[:2] and events[0].parent_hash is None
    assert events[1].block_hashes == hashes[2:] and events[1].parent_hash == hashes[1]
    assert all(e.num_tokens_per_block == BS for e in events)
    assert pool.kv_state().block_hashes == hashes and pool.kv_state().last_event_id == 2


def test_a_hash_cached_elsewhere_is_not_stored_twice_and_splits_the_run():
    pool = make_pool(8)
    hashes = block_hashes(list(range(12)), BS)
    first = pool.allocate(1)
    pool.cache_full_blocks(first, hashes[:1], None)  # another request already cached block 0
    pool.take_events()
    mine = pool.allocate(3)
    pool.cache_full_blocks(mine, hashes, None)
    (event,) = pool.take_events()
    assert event.block_hashes == hashes[1:] and event.parent_hash == hashes[0]
    assert pool.block_hash(mine[0]) is None  # stays anonymous
    pool.free(mine)
    assert pool.lookup_prefix(hashes) == [first[0], mine[1], mine[2]]
    check_counts(pool)


def test_reset_clears_everything_and_emits_all_cleared():
    pool = make_pool(8)
    cached, _ = store_sequence(pool, list(range(8)))
    pool.free(cached)
    active, active_hashes = store_sequence(pool, list(range(50, 58)))
    pool.take_events()
    pool.reset_prefix_cache()
    (event,) = pool.take_events()
    assert event.kind is KvEventKind.ALL_CLEARED and event.event_id == 3
    assert pool.kv_state().block_hashes == [] and pool.lookup_prefix(active_hashes) == []
    assert pool.num_active_blocks == 2  # the running request keeps its blocks
    pool.free(active)
    pool.allocate(8)  # every block is empty now: nothing to evict, no BLOCK_REMOVED
    assert pool.take_events() == []


def test_caching_disabled_stores_nothing_and_emits_no_events():
    pool = make_pool(4, enable_caching=False)
    blocks, hashes = store_sequence(pool, list(range(8)))
    pool.free(blocks)
    assert pool.lookup_prefix(hashes) == [] and pool.num_cached_blocks == 0
    pool.allocate(4)
    assert pool.take_events() == [] and pool.last_event_id == 0


# --- host-memory tier -----------------------------------------------------------------------------------------------


def test_the_host_tier_is_written_through_and_announced_with_its_medium():
    pool = BlockPool(8, BS, num_host_blocks=6)
    tokens = list(range(12))  # 3 blocks
    _, hashes = store_sequence(pool, tokens)
    events = pool.take_events()
    # One stored run on the device, then the same run in host memory; ids in one sequence.
    assert [(e.event_id, e.kind, e.medium, e.block_hashes, e.parent_hash) for e in events] == [
        (1, KvEventKind.BLOCK_STORED, None, hashes, None),
        (2, KvEventKind.BLOCK_STORED, KV_MEDIUM_HOST, hashes, None),
    ]
    assert pool.num_host_cached_blocks == 3 and pool.host_lookup(hashes, 0) == 3 and pool.host_lookup(hashes, 1) == 2
    snap = pool.kv_state()
    assert snap.host_block_hashes and set(snap.host_block_hashes) == set(hashes) and snap.last_event_id == 2


def test_the_host_tier_keeps_what_the_device_evicted_and_evicts_a_sequence_tail_first():
    pool = BlockPool(3, BS, num_host_blocks=5)
    a_blocks, a = store_sequence(pool, list(range(12)))  # 3 blocks: the whole device
    pool.free(a_blocks)
    b_blocks, b = store_sequence(pool, list(range(100, 112)))  # evicts a's 3 blocks from the device
    # a lives on in host memory, less one block: the tier holds 5 and b's 3 pushed out 1 of a's. a's blocks were
    # touched first-block-last (its first block most recent), so the one evicted is a's last block, and a's first
    # two still make a prefix.
    assert pool.lookup_prefix(a) == [] and pool.host_lookup(a, 0) == 2 and pool.num_host_cached_blocks == 5
    host_removed = [e for e in pool.take_events() if e.kind == KvEventKind.BLOCK_REMOVED and e.medium]
    assert [e.block_hashes for e in host_removed] == [[a[2]]]
    pool.free(b_blocks)
    pool.host_touch(a)  # a used again: now b's tail goes first
    store_sequence(pool, list(range(200, 204)))  # one more block
    removed = [e for e in pool.take_events() if e.kind == KvEventKind.BLOCK_REMOVED and e.medium == KV_MEDIUM_HOST]
    assert [e.block_hashes for e in removed] == [[b[2]]]
    assert pool.host_lookup(a, 0) == 2 and pool.host_lookup(b, 0) == 2


def test_a_reset_clears_the_host_tier_too_and_without_one_nothing_is_written():
    pool = BlockPool(8, BS, num_host_blocks=6)
    store_sequence(pool, list(range(8)))
    pool.take_events()
    pool.reset_prefix_cache()
    assert [(e.kind, e.medium) for e in pool.take_events()] == [
        (KvEventKind.ALL_CLEARED, None),
        (KvEventKind.ALL_CLEARED, KV_MEDIUM_HOST),
    ]
    assert pool.num_host_cached_blocks == 0
    plain = make_pool(8)
    _, hashes = store_sequence(plain, list(range(8)))
    assert plain.host_lookup(hashes, 0) == 0 and all(e.medium is None for e in plain.take_events())
    assert plain.kv_state().host_block_hashes == []
    with pytest.raises(ValueError, match="num_host_blocks"):
        BlockPool(8, BS, num_host_blocks=-1)


def test_import_prefix_caches_the_missing_tail_free_and_announces_it():
    # A 3-block prefix; the pool already holds its first block (a request stored then freed it). Importing caches
    # blocks 2 and 3 under one BLOCK_STORED whose parent is block 1's hash, and leaves all three cached free.
    pool = make_pool(8)
    tokens = list(range(12))
    hashes = block_hashes(tokens, BS)
    head, _ = store_sequence(pool, tokens[:4])
    pool.free(head)
    pool.take_events()
    assert pool.import_prefix(hashes) == 2
    [ev] = pool.take_events()
    assert (ev.kind, ev.block_hashes, ev.parent_hash) == (KvEventKind.BLOCK_STORED, hashes[1:], hashes[0])
    assert len(pool.lookup_prefix(hashes)) == 3
    assert pool.num_active_blocks == 0 and pool.num_free_blocks == 8
    # Again: all cached, nothing imported, no event.
    assert pool.import_prefix(hashes) == 0 and pool.take_events() == []
    check_counts(pool)


def test_import_prefix_never_evicts_its_own_head_and_fails_whole_when_full():
    # 4 blocks, all cached free: the prefix's first block and 3 others. Importing the 3-block prefix needs 2 more
    # blocks; the LRU order would evict the head first (freed first), but it is taken during the allocation.
    pool = make_pool(4)
    hashes = block_hashes(list(range(12)), BS)
    head, _ = store_sequence(pool, list(range(4)))
    pool.free(head)
    others, _ = store_sequence(pool, list(range(100, 112)))
    pool.free(others)
    assert pool.import_prefix(hashes) == 2
    assert len(pool.lookup_prefix(hashes)) == 3
    # With every block active, the import is refused and changes nothing.
    busy = make_pool(2)
    taken = busy.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        busy.import_prefix(hashes)
    assert busy.lookup_prefix(hashes) == [] and [busy.ref_cnt(b) for b in taken] == [1, 1]
    check_counts(pool)


def test_drop_prefix_evicts_the_unused_blocks_and_keeps_those_in_use():
    # A 3-block prefix imported (cached free) on an 8-block pool; a request then takes its first block again. Dropping
    # the prefix evicts blocks 2 and 3 (one BLOCK_REMOVED with both hashes) and keeps block 1, which the request uses:
    # 2 dropped, 1 in use. The freed blocks are empty (no hash), so the free count stays 8 - 1 active = 7.
    pool = make_pool(8)
    hashes = block_hashes(list(range(12)), BS)
    assert pool.import_prefix(hashes) == 3
    pool.take_events()
    [first] = pool.lookup_prefix(hashes[:1])
    pool.touch([first])
    assert pool.drop_prefix(hashes) == (2, 1)
    [ev] = pool.take_events()
    assert (ev.kind, ev.block_hashes) == (KvEventKind.BLOCK_REMOVED, hashes[1:])
    assert len(pool.lookup_prefix(hashes)) == 1 and pool.num_cached_blocks == 1
    assert pool.num_free_blocks == 7 and pool.num_active_blocks == 1
    # Again: nothing left to drop, no event; a hash the pool never held is ignored.
    assert pool.drop_prefix([*hashes, 12345]) == (0, 1) and pool.take_events() == []
    # The dropped blocks are handed out before any cached one: allocating 7 evicts nothing (no BLOCK_REMOVED).
    pool.allocate(7)
    assert pool.take_events() == []
    check_counts(pool)
