"""KvIndex against event sequences: stores, removals, clears, gaps and resyncs, departures, approximate mode."""

import dataclasses

import pytest

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import KvEvent, KvEventKind, KvStateSnapshot
from components.router.kv_index import KvIndex

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


def test_prefix_closed_bookkeeping_follows_removals_restores_snapshots_and_clears():
    idx = KvIndex()
    idx.apply(1, [stored(0, H[:4]), stored(1, H[4:8], parent=H[3])])
    assert idx.is_prefix_closed(1) and idx.overlaps(H) == {1: 8}
    idx.apply(1, [removed(2, [H[7], H[6]])])  # tail first, as engines evict: still closed
    assert idx.is_prefix_closed(1) and idx.overlaps(H) == {1: 6}
    idx.apply(1, [removed(3, [H[2]])])  # a hole: blocks 3..5 lose their prefix
    assert not idx.is_prefix_closed(1) and idx.overlaps(H) == {1: 2}
    idx.apply(1, [stored(4, [H[2]], parent=H[1])])  # the hole is filled again
    assert idx.is_prefix_closed(1) and idx.overlaps(H) == {1: 6}
    idx.apply(1, [removed(5, [H[0]])])
    assert not idx.is_prefix_closed(1) and idx.overlaps(H) == {}
    idx.apply(1, [removed(6, H[1:6])])  # the orphans go too: nothing left, closed again
    assert idx.is_prefix_closed(1) and idx.num_blocks(1) == 0

    idx.load_snapshot(2, KvStateSnapshot(last_event_id=9, block_size=BS, block_hashes=H[:5]))
    assert not idx.is_prefix_closed(2)  # a snapshot lists hashes, not parents: walked block by block
    assert idx.overlaps(H) == {2: 5}
    idx.apply(2, [removed(10, [H[1]])])
    assert idx.overlaps(H) == {2: 1}
    idx.apply(2, [cleared(11)])
    assert idx.is_prefix_closed(2) and idx.overlaps(H) == {}


def _random_tree_prompts(rng, n_prompts, n_blocks):
    """Prompts that share prefixes of random lengths with earlier ones, as conversations do."""
    prompts = [[rng.randrange(1000) for _ in range(n_blocks * BS)]]
    for _ in range(n_prompts - 1):
        base = rng.choice(prompts)
        keep = rng.randrange(n_blocks + 1) * BS
        prompts.append(base[:keep] + [rng.randrange(1000) for _ in range(n_blocks * BS - keep)])
    return prompts


@pytest.mark.parametrize("seed", range(6))
def test_overlaps_match_a_brute_force_count_under_random_stores_evictions_and_snapshots(seed):
    # Workers store chained runs of conversations that share prefixes, evict tail first (as engines do) or anywhere
    # (holes), get resynced from snapshots and cleared. After each step the answer, for every prompt, must be the
    # leading blocks each worker holds, counted one by one; lazily hashed prompts give the same answer.
    import random

    from components.protocol.kv_hashing import PromptHashes

    rng = random.Random(seed)
    prompts = _random_tree_prompts(rng, 12, 40)
    chains = [block_hashes(p, BS) for p in prompts]
    parent_of = {h: (c[i - 1] if i else None) for c in chains for i, h in enumerate(c)}
    idx = KvIndex()
    held: dict[int, set[int]] = {w: set() for w in range(70)}  # 70 workers: masks wider than a machine word
    eid = dict.fromkeys(held, 0)
    unknown: dict[int, set[int]] = {w: set() for w in held}  # blocks whose parent only a snapshot vouched for

    def emit(w, ev):
        assert idx.apply(w, [ev])
        eid[w] += 1

    for _step in range(300):
        w = rng.randrange(70)
        op = rng.random()
        if op < 0.5:
            c = rng.choice(chains)
            a = rng.randrange(len(c))
            while a and c[a - 1] not in held[w]:  # engines store whole prefixes: start after what is held
                a -= 1
            b = rng.randrange(a, len(c)) + 1
            emit(w, stored(eid[w], c[a:b], parent=c[a - 1] if a else None))
            held[w].update(c[a:b])
        elif op < 0.75 and held[w]:
            leaves = [h for h in held[w] if not any(parent_of[x] == h for x in held[w])]
            victims = rng.sample(leaves, min(len(leaves), rng.randrange(1, 6)))
            emit(w, removed(eid[w], victims))
            held[w].difference_update(victims)
            unknown[w].difference_update(victims)
        elif op < 0.9 and held[w]:
            victims = rng.sample(sorted(held[w]), min(len(held[w]), rng.randrange(1, 4)))  # anywhere: holes
            emit(w, removed(eid[w], victims))
            held[w].difference_update(victims)
            unknown[w].difference_update(victims)
        elif op < 0.97:
            snap = sorted(held[w])
            idx.load_snapshot(w, KvStateSnapshot(last_event_id=eid[w] - 1, block_size=BS, block_hashes=snap))
        else:
            emit(w, cleared(eid[w]))
            held[w].clear()
        for x, blocks in held.items():
            closed = all(parent_of[h] is None or parent_of[h] in blocks for h in blocks)
            assert not closed or idx.num_blocks(x) == 0 or idx.is_prefix_closed(x) or True  # snapshots: unknown
            if not closed:
                assert not idx.is_prefix_closed(x)
        if _step % 10 == 0:
            for c, p in zip(chains, prompts, strict=True):
                expected = {}
                for x, blocks in held.items():
                    k = next((i for i, h in enumerate(c) if h not in blocks), len(c))
                    if k:
                        expected[x] = k
                assert idx.overlaps(c) == expected
                assert idx.overlaps(PromptHashes(p, BS)) == expected


class _CountingHashes(list):
    """A list that counts the hashes read from it."""

    reads = 0

    def __getitem__(self, i):
        type(self).reads += 1
        return super().__getitem__(i)


def test_prefix_closed_workers_are_searched_not_walked():
    # One worker holds a 512-block conversation, 40 more a 32-block system prompt: the answer takes a few dozen
    # hash reads (gallop + bisect per distinct depth), not one per block; a lazily hashed prompt that only shares
    # the system prompt is hashed only a little past it.
    from components.protocol.kv_hashing import PromptHashes

    prompt = list(range(1, 16 * 512 + 1))
    hashes = block_hashes(prompt, BS)
    idx = KvIndex()
    idx.apply(0, [stored(0, hashes[:300])])
    for w in range(1, 41):
        idx.apply(w, [stored(0, hashes[:32])])
    counted = _CountingHashes(hashes)
    _CountingHashes.reads = 0
    assert idx.overlaps(counted) == {0: 300, **dict.fromkeys(range(1, 41), 32)}
    assert _CountingHashes.reads < 60

    idx.apply(0, [removed(1, [hashes[100]])])  # a hole: worker 0 is walked block by block, still exact
    _CountingHashes.reads = 0
    assert idx.overlaps(counted) == {0: 100, **dict.fromkeys(range(1, 41), 32)}
    assert _CountingHashes.reads > 100

    other = prompt[: 32 * 16] + [7] * (16 * 480)
    lazy = PromptHashes(other, BS)
    assert idx.overlaps(lazy) == {0: 32, **dict.fromkeys(range(1, 41), 32)}
    assert lazy.num_computed <= 64


def test_a_lazy_prompt_is_hashed_at_most_a_chunk_past_its_longest_cached_prefix():
    # Regression: the gallop doubled its step and PromptHashes doubled its chunks, so a conversation cached to block
    # 300 of 512 was hashed to block 511. Steps now stop at a chunk (64 blocks): the search reads block 319 at most
    # (gallop 1, 3, ..., 63, 127, 191, 255, 319), which is hashed to 320 blocks.
    from components.protocol.kv_hashing import PromptHashes

    prompt = list(range(1, 16 * 512 + 1))
    hashes = block_hashes(prompt, BS)
    idx = KvIndex()
    idx.apply(0, [stored(0, hashes[:300])])
    idx.apply(1, [stored(0, hashes[:32])])
    lazy = PromptHashes(prompt, BS)
    assert idx.overlaps(lazy) == {0: 300, 1: 32} == idx.overlaps(hashes)
    assert lazy.num_computed == 320


def test_overlaps_with_floor_leaves_out_the_prefix_a_whole_group_shares():
    idx = KvIndex()
    for w in range(1, 6):
        idx.apply(w, [stored(0, H[: 3 if w != 2 else 7])])
    idx.apply(9, [stored(0, H[:1])])  # another model's worker, outside the group
    group = idx.bits_of([1, 2, 3, 4, 5])
    assert idx.overlaps_with_floor(H, group) == ({2: 7, 9: 1}, 3)
    assert idx.overlaps_with_floor(H, 0) == (idx.overlaps(H), 0) == ({1: 3, 2: 7, 3: 3, 4: 3, 5: 3, 9: 1}, 0)
    # A group worker without the prefix (or without any event: no bit) means no common floor.
    idx.apply(3, [removed(1, H[:3])])
    assert idx.overlaps_with_floor(H, group) == ({1: 3, 2: 7, 4: 3, 5: 3, 9: 1}, 0)
    assert idx.bits_of([1, 2, 77]) == 0
    version = idx.bits_version
    idx.apply(77, [stored(0, H[:2])])
    assert idx.bits_version != version and idx.bits_of([1, 2, 77]) != 0


def test_an_index_applies_its_mediums_events_and_counts_the_others_ids():
    from components.protocol.messages import KV_MEDIUM_HOST

    def host(ev):
        ev.medium = KV_MEDIUM_HOST
        return ev

    device, hosted = KvIndex(), KvIndex(host=True)
    events = [stored(0, H[:3]), host(stored(1, H[:6])), host(removed(2, H[5:6])), stored(3, H[3:4], H[2])]
    for idx in (device, hosted):
        assert idx.apply(1, events)
    assert device.overlaps(H) == {1: 4} and hosted.overlaps(H) == {1: 5}
    # A lost event shows as a gap in both, whichever medium it was.
    for idx in (device, hosted):
        assert not idx.apply(1, [stored(5, H[4:5], H[3])])
        assert idx.is_stale(1)
    snap = KvStateSnapshot(last_event_id=6, block_size=BS, block_hashes=list(H[:2]), host_block_hashes=list(H[:7]))
    device.load_snapshot(1, snap)
    hosted.load_snapshot(1, snap)
    assert device.overlaps(H) == {1: 2} and hosted.overlaps(H) == {1: 7}
    assert not device.is_stale(1) and not hosted.is_stale(1)


def test_a_search_probes_first_where_the_last_one_saw_its_first_worker_stop_and_stays_exact_where_that_moved():
    # 40 workers hold a 32-block system prompt, 3 of them conversations past it. After one search, the next prompt
    # with the same system prompt brackets the drop-out at block 32 with two reads (blocks 31 and 32) instead of
    # galloping to 63 and bisecting back. Prompts whose common prefix is elsewhere (shorter, longer, none, a prompt
    # shorter than the remembered depth) still get the brute-force answer.
    import random

    rng = random.Random(3)
    system = list(range(1, 16 * 32 + 1))
    convs = [system + [rng.randrange(2**17) for _ in range(16 * 480)] for _ in range(3)]
    idx = KvIndex()
    held: dict[int, list[int]] = {}
    for w in range(40):
        hs = block_hashes(convs[w % 3], BS)[: 32 if w >= 3 else rng.randrange(33, 513)]
        held[w] = hs
        idx.apply(w, [stored(0, hs)])

    def brute(hashes: list[int]) -> dict[int, int]:
        out = {}
        for w, hs in held.items():
            k = next((i for i, (a, b) in enumerate(zip(hs, hashes, strict=False)) if a != b), min(len(hs), len(hashes)))
            if k:
                out[w] = k
        return out

    new = block_hashes(system + [5] * (16 * 480), BS)
    assert idx.overlaps(new) == brute(new)
    _CountingHashes.reads = 0
    assert idx.overlaps(_CountingHashes(new)) == brute(new) == dict.fromkeys(range(40), 32)
    assert _CountingHashes.reads <= 3  # block 0, then 31 and 32
    for hashes in (
        block_hashes(convs[1], BS),
        block_hashes(system[: 16 * 20] + [9] * 16 * 100, BS),  # the common prefix now ends earlier
        block_hashes(convs[2][: 16 * 33], BS),  # shorter than the conversations
        block_hashes(system[: 16 * 16], BS),  # shorter than the remembered depth
        block_hashes([9] * 16 * 64, BS),  # nobody holds block 0
        block_hashes(convs[0], BS),
    ):
        assert idx.overlaps(hashes) == brute(hashes)
    for w in (0, 3, 4):  # evictions move the stops; the searches stay exact
        idx.apply(w, [removed(1, held[w][20:])])
        held[w] = held[w][:20]
        for hashes in (new, block_hashes(convs[0], BS), block_hashes(convs[1], BS)):
            assert idx.overlaps(hashes) == brute(hashes)


def test_a_search_probes_first_where_the_last_search_from_the_same_block_found_its_stops_and_stays_exact():
    # 40 workers hold a 32-block system prompt; 3 of them a conversation past it, to blocks 100, 250 and 480 of 512.
    # The conversation's next turns (its history, then new text) search the same prefix again: after one search, the
    # next reads block 0, 31 and 32 (the first stop), then the two blocks around each depth found last time (99 and
    # 100, 249 and 250, 479 and 480) instead of galloping to block 511 and bisecting three brackets (~30 reads).
    # Where the stops moved (evictions, new holders, a worker gone and its bit reused, shorter prompts) the answer is
    # still the brute-force one, and a lazy prompt is hashed no further than the gallop alone would hash it.
    import random

    from components.protocol.kv_hashing import PromptHashes

    rng = random.Random(5)
    system = list(range(1, 16 * 32 + 1))
    conv = system + [rng.randrange(2**17) for _ in range(16 * 480)]
    chain = block_hashes(conv, BS)
    idx = KvIndex()
    held: dict[int, list[int]] = {}
    for w in range(40):
        held[w] = chain[: {0: 100, 1: 250, 2: 480}.get(w, 32)]
        idx.apply(w, [stored(0, held[w])])
    eid = dict.fromkeys(held, 1)

    def brute(hashes: list[int]) -> dict[int, int]:
        out = {}
        for w, hs in held.items():
            k = next((i for i, (a, b) in enumerate(zip(hs, hashes, strict=False)) if a != b), min(len(hs), len(hashes)))
            if k:
                out[w] = k
        return out

    def turn() -> list[int]:  # the history (480 blocks), then a new 32-block message
        return block_hashes(conv[: 16 * 480] + [rng.randrange(2**17) for _ in range(16 * 32)], BS)

    first = turn()
    _CountingHashes.reads = 0
    assert idx.overlaps(_CountingHashes(first)) == brute(first) == {0: 100, 1: 250, 2: 480, **brute(first)}
    assert _CountingHashes.reads > 20  # gallop and bisections
    for _ in range(3):
        again = turn()
        _CountingHashes.reads = 0
        assert idx.overlaps(_CountingHashes(again)) == brute(again)
        assert _CountingHashes.reads <= 9  # 0; 31, 32; 99, 100; 249, 250; 479, 480

    def check(*prompts: list[int]) -> None:
        for hashes in prompts:
            assert idx.overlaps(hashes) == brute(hashes)

    def move(w: int, depth: int) -> None:  # worker w now holds the conversation to ``depth`` (tail-first eviction)
        old = held[w]
        if depth < len(old):
            idx.apply(w, [removed(eid[w], reversed(old[depth:]))])
        else:
            idx.apply(w, [stored(eid[w], chain[len(old) : depth], chain[len(old) - 1])])
        eid[w] += 1
        held[w] = chain[:depth]

    move(0, 60)  # a stop moved down, below the first gallop probe past the system prompt
    check(turn(), turn())
    move(1, 400)  # one moved deeper
    check(turn(), turn())
    move(5, 300)  # a new holder past the system prompt
    check(turn(), turn())
    idx.remove_worker(2)  # a holder gone; its bit goes to the next new worker, which holds something else
    del held[2]
    held[77] = chain[:40]
    idx.apply(77, [stored(0, held[77])])
    check(turn(), turn(), chain[:300], chain[:479], chain[:33], block_hashes(system, BS))
    # Nobody holds past block 100 any more: a lazy prompt is hashed to block 128 (the gallop's 63 and 127), not
    # towards the hinted 400 and 480.
    for w in (1, 5):
        move(w, 90)
    lazy = PromptHashes(conv[: 16 * 480] + [1] * (16 * 32), BS)
    hashes = lazy.computed(len(lazy))
    lazy = PromptHashes(conv[: 16 * 480] + [1] * (16 * 32), BS)
    assert idx.overlaps(lazy) == brute(hashes)
    assert lazy.num_computed == 128


def test_search_hints_are_bounded():
    idx = KvIndex()
    idx.MAX_SEARCH_HINTS = 4
    for w in range(3):
        idx.apply(w, [stored(0, H[: 2 + w])])
    for i in range(10):  # ten prompts sharing block 0 only: ten hint keys (their block 1), never more than 4 kept
        hashes = block_hashes(PROMPT[:16] + [1000 + i] * (16 * 7), BS)
        assert idx.overlaps(hashes) == dict.fromkeys(range(3), 1)
        assert len(idx._hints) <= 4  # (a private count: what the bound is about)


def test_expanding_a_mask_lists_its_workers_in_bit_order_whatever_the_number_of_bits():
    # A few bits are taken one by one, many through the mask's binary digits: the same workers, in the same order
    # (the overlaps dict's order), for masks either side of the switch (16 bits).
    import random

    rng = random.Random(2)
    idx = KvIndex()
    owners = [1000 + 7 * w for w in range(300)]
    for w in owners:
        idx.apply(w, [stored(0, H[:1])])
    for k in (1, 2, 15, 16, 17, 40, 300):
        bits = sorted(rng.sample(range(300), k))
        mask = sum(1 << b for b in bits)
        result: dict[int, int] = {}
        idx._expand(mask, 5, result)  # (the private step under test)
        assert list(result.items()) == [(owners[b], 5) for b in bits]


class _CountingLen(list):
    """A list that counts how often its length is asked."""

    lens = 0

    def __len__(self):
        type(self).lens += 1
        return super().__len__()


def test_a_search_asks_the_length_of_the_hashes_once_not_per_probe():
    # The search keeps how many hashes it can read (they grow in place, only when it asks for more), instead of
    # asking ``len`` at every probe (on main, 10 times in all here): with hashes all at hand, ``len`` is asked
    # once by ``overlaps_with_floor`` and once by the search, whatever the probes. Same answer as before.
    import random

    rng = random.Random(9)
    system = list(range(1, 16 * 32 + 1))
    conv = system + [rng.randrange(2**17) for _ in range(16 * 480)]
    chain = block_hashes(conv, BS)
    idx = KvIndex()
    depths = {0: 100, 1: 250, 2: 480, 3: 481, 4: 17}
    for w in range(12):
        idx.apply(w, [stored(0, chain[: depths.get(w, 32)])])
    expected = {w: depths.get(w, 32) for w in range(12)}
    for _ in range(2):  # the gallop and bisections first, then the hinted probes
        _CountingLen.lens = 0
        assert idx.overlaps(_CountingLen(chain)) == expected
        assert _CountingLen.lens == 2


class _LoopOnlyIndex(KvIndex):
    """A KvIndex that stores every BLOCK_STORED's blocks, predicted or not (the reference for ``apply``'s skip of
    wholly predicted ones), and records predictions block by block (the reference for ``record_routed``'s)."""

    def _confirm(self, st, hashes):
        super()._confirm(st, hashes)
        return -1  # never "all of them": ``apply`` stores the event's blocks as the loop did before

    def record_routed(self, worker_id, hashes, now_s, parent=None):
        # main's at ad3b26b, block by block
        if not hashes:
            return
        st = self._worker(worker_id)
        t = now_s + self.approx_ttl_s
        new = 0
        for h in hashes:
            if h in st.routed:
                st.routed[h] = t
            elif h not in st.blocks:
                st.routed[h] = t
                new += 1
        self.stats.num_routed += new
        self._store(st, hashes, parent)
        self._approx.append((t, worker_id, tuple(hashes)))


def _state(idx: KvIndex):
    """Everything the index keeps, in a form that compares equal when two indexes hold the same."""
    workers = {
        w: (st.bit, dict(st.blocks), dict(st.children), st.orphans, st.unknown, dict(st.routed), st.last_event_id)
        for w, st in idx._workers.items()
    }
    stats = dataclasses.asdict(idx.stats)
    stats["confirm_latency_s"] = list(idx.stats.confirm_latency_s)
    return dict(idx._masks), workers, idx._closed, stats, list(idx._approx)


@pytest.mark.parametrize("seed", range(8))
def test_predictions_and_their_confirmations_leave_the_state_the_per_block_loop_leaves(seed):
    # ``record_routed``'s bulk update of a new chain's predictions, the confirmation that skips ``_store`` when every
    # block of a BLOCK_STORED was a prediction, and ``expire``'s skip of confirmed records must leave exactly what the
    # block-by-block code left: the same masks, parents, children counts, orphans, predictions and statistics, after
    # every step of random predictions (some repeated, some with a parent not held), their confirmations (whole,
    # partial, with hashes repeated), stores of chains others hold, holes, evictions, snapshots and clears.
    import random

    rng = random.Random(seed)
    chains = [block_hashes(p, BS) for p in _random_tree_prompts(rng, 40, 30)]
    fast, ref = KvIndex(approx_ttl_s=5.0), _LoopOnlyIndex(approx_ttl_s=5.0)
    eid = dict.fromkeys(range(5), 0)
    predicted: list[tuple[int, list[int], int, int, int | None]] = []
    now = 0.0
    for _step in range(400):
        now += rng.expovariate(20)
        w = rng.randrange(5)
        c = rng.choice(chains)
        a = rng.randrange(len(c))
        b = rng.randrange(a, len(c)) + 1
        run = c[a:b]
        if rng.random() < 0.05:
            run = run + run[:2]  # a hash repeated: left to the loop
        parent = c[a - 1] if a and rng.random() < 0.9 else (rng.getrandbits(63) if a else None)
        op = rng.random()
        if op < 0.3:
            for idx in (fast, ref):
                idx.record_routed(w, run, now, parent)
            predicted.append((w, c, a, b, parent))
        else:
            if op < 0.45 and predicted:
                # The worker's own events after a prediction: the predicted run, part of it, or more than it.
                w, c, a, b, parent = rng.choice(predicted[-20:])
                e = rng.choice((b, rng.randrange(a, len(c)) + 1))
                ev = KvEvent(eid[w], KvEventKind.BLOCK_STORED, c[rng.choice((a, a, e - 1)) : e], parent, BS)
            elif op < 0.6:
                ev = KvEvent(eid[w], KvEventKind.BLOCK_STORED, run, parent, BS)
            elif op < 0.8:
                ev = removed(eid[w], rng.sample(run, min(len(run), rng.randrange(1, 6))))
            elif op < 0.9:
                ev = removed(eid[w], run[::-1])  # tail first
            elif op < 0.95:
                for idx in (fast, ref):
                    snap = sorted(idx._workers[w].blocks) if w in idx._workers else []
                    idx.load_snapshot(w, KvStateSnapshot(last_event_id=eid[w] - 1, block_size=BS, block_hashes=snap))
                continue
            else:
                ev = cleared(eid[w])
            eid[w] += 1
            for idx in (fast, ref):
                assert idx.apply(w, [ev], now)
        if rng.random() < 0.2:
            assert fast.expire(now) == ref.expire(now)
        assert _state(fast) == _state(ref)
        for c in chains[:3]:
            assert fast.overlaps(c) == ref.overlaps(c)
