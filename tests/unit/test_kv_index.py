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


def test_overlaps_of_hundreds_of_workers_match_a_brute_force_count():
    # 300 workers (bits span 38 bytes), each caching a random-length prefix of one long prompt; some leave and their
    # bits are reused. Expected: for each worker, the leading blocks of the prompt it holds, counted one by one.
    import random

    rng = random.Random(5)
    prompt = list(range(1, 16 * 64 + 1))
    hashes = block_hashes(prompt, BS)  # 64 blocks
    idx = KvIndex()
    held: dict[int, int] = {}
    for w in range(300):
        k = rng.choice([0, 8, 8, 8, 31, 64, rng.randrange(65)])  # many share a depth: they drop out together
        idx.apply(w, [stored(0, hashes[:k])] if k else [])
        held[w] = k
    for w in range(0, 300, 7):
        idx.remove_worker(w)
        del held[w]
    for w in range(1000, 1030):  # take the freed bits
        k = rng.randrange(65)
        idx.apply(w, [stored(0, hashes[:k])])
        held[w] = k
    expected = {w: k for w, k in held.items() if k}
    assert idx.overlaps(hashes) == expected


def test_long_runs_of_a_few_workers_past_a_shared_prefix_are_exact():
    # 40 workers hold a 32-block system prompt, 5 of them a conversation of up to 512 blocks, two with a hole (a block
    # evicted mid-run: the run ends there, whatever follows).
    import random

    rng = random.Random(9)
    hashes = block_hashes(list(range(1, 16 * 512 + 1)), BS)
    idx = KvIndex()
    held: dict[int, set[int]] = {}
    for w in range(40):
        k = 32 if w >= 5 else rng.randrange(33, 513)
        held[w] = set(hashes[:k])
        idx.apply(w, [stored(0, hashes[:k])])
    for w, hole in ((1, 100), (3, 40)):
        if hashes[hole] in held[w]:
            held[w].discard(hashes[hole])
            idx.apply(w, [removed(1, [hashes[hole]])])

    def run(s: set[int]) -> int:
        return next((i for i, h in enumerate(hashes) if h not in s), len(hashes))

    assert idx.overlaps(hashes) == {w: run(s) for w, s in held.items()}
    for cut in (33, 64, 200, 511):  # shorter prompts end the walk elsewhere
        assert idx.overlaps(hashes[:cut]) == {w: min(run(s), cut) for w, s in held.items()}
