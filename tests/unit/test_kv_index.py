"""KvIndex against event sequences: stores, removals, clears, gaps and resyncs, departures, approximate mode."""

import pytest

from components.router.kv_index import KvIndex
from components.runtime.kv_hashing import block_hashes
from components.workers.engines.base import KvEvent, KvEventKind, KvStateSnapshot

pytestmark = pytest.mark.unit

BS = 16


def stored(eid, hashes, parent=None):
    return KvEvent(eid, KvEventKind.BLOCK_STORED, list(hashes), parent, BS)


def removed(eid, hashes):
    return KvEvent(eid, KvEventKind.BLOCK_REMOVED, list(hashes))


def cleared(eid):
    return KvEvent(eid, KvEventKind.ALL_CLEARED)


PROMPT = list(range(1, 129))  # 8 full blocks
H = block_hashes(PROMPT, BS)


def test_overlap_counts_leading_blocks_per_worker():
    idx = KvIndex()
    assert idx.apply(1, [stored(0, H[:8])])
    assert idx.apply(2, [stored(0, H[:3])])
    assert idx.apply(3, [stored(0, H[5:])])  # holds later blocks only: no leading overlap
    assert idx.overlaps(H) == {1: 8, 2: 3}
    other = block_hashes([999] * 64, BS)
    assert idx.overlaps(other) == {}
    assert idx.overlaps([]) == {}


def test_removal_and_clear():
    idx = KvIndex()
    idx.apply(1, [stored(0, H)])
    idx.apply(1, [removed(1, H[4:5])])
    assert idx.overlaps(H) == {1: 4}
    idx.apply(1, [cleared(2)])
    assert idx.overlaps(H) == {}
    assert idx.num_blocks() == 0 and idx.num_blocks(1) == 0


def test_shared_block_survives_one_workers_removal():
    idx = KvIndex()
    idx.apply(1, [stored(0, H[:4])])
    idx.apply(2, [stored(0, H[:4])])
    idx.apply(1, [removed(1, H[:4])])
    assert idx.overlaps(H) == {2: 4}
    assert idx.num_blocks() == 4


def test_gap_marks_stale_buffers_and_resync_replays_newer_events():
    idx = KvIndex()
    assert idx.apply(1, [stored(0, H[:2])])
    # Event 1 is lost; 2 and 3 arrive.
    assert not idx.apply(1, [stored(2, H[2:4]), removed(3, H[:1])])
    assert idx.is_stale(1)
    assert idx.stats.num_gaps == 1
    # Until the snapshot arrives, the old blocks still count; buffered events are not applied.
    assert idx.overlaps(H) == {1: 2}
    # The snapshot reflects events up to 2 (blocks 0..3); event 3 (remove block 0) is replayed after it.
    idx.load_snapshot(1, KvStateSnapshot(last_event_id=2, block_size=BS, block_hashes=H[:4]))
    assert not idx.is_stale(1)
    assert idx.overlaps(H) == {}  # block 0 removed: no leading overlap
    assert idx.overlaps(H[1:]) == {1: 3}
    assert idx.apply(1, [stored(4, H[4:5])])  # ids continue from 3
    assert idx.stats.num_resyncs == 1


def test_duplicate_events_are_ignored():
    idx = KvIndex()
    idx.apply(1, [stored(0, H[:2]), stored(1, H[2:3])])
    assert idx.apply(1, [stored(1, H[2:3])])
    assert idx.stats.num_events == 2


def test_worker_leaving_takes_its_blocks_and_bit_is_reused():
    idx = KvIndex()
    idx.apply(1, [stored(0, H)])
    idx.apply(2, [stored(0, H[:2])])
    idx.remove_worker(1)
    assert idx.overlaps(H) == {2: 2}
    assert idx.num_blocks() == 2
    idx.apply(3, [stored(0, H[:5])])  # takes worker 1's freed bit
    assert idx.overlaps(H) == {2: 2, 3: 5}
    idx.remove_worker(42)  # unknown: no-op
    assert sorted(idx.worker_ids) == [2, 3]


def test_approximate_mode_predicts_and_expires():
    idx = KvIndex(approx_ttl_s=10)
    idx.record_routed(7, H[:6], now_s=0.0)
    assert idx.overlaps(H) == {7: 6}
    idx.record_routed(7, H[:2], now_s=5.0)  # routed again: these two live until 15 s
    assert idx.expire(now_s=9.9) == 0
    assert idx.expire(now_s=10.0) == 4
    assert idx.overlaps(H) == {7: 2}
    assert idx.expire(now_s=15.0) == 2
    assert idx.overlaps(H) == {}
