"""The chained block hash shared by engines and the router (components.protocol.kv_hashing)."""

from __future__ import annotations

import gc
import random
import struct
from array import array

import pytest
import xxhash

from components.protocol import kv_hashing
from components.protocol.kv_hashing import (
    HASH_SCHEME_VERSION,
    ROOT_PARENT_MARKER,
    HashMemo,
    PromptHashes,
    block_hashes,
    num_full_blocks,
    pack_token_ids,
    packed_prompt,
)

pytestmark = pytest.mark.unit


def reference_block_hashes(tokens: list[int], bs: int, parent: int | None = None) -> list[int]:
    """The scheme written out the slow, obvious way: one struct.pack per block, per the module docstring."""
    out = []
    seed = struct.unpack("<Q", ROOT_PARENT_MARKER)[0] if parent is None else parent
    for i in range(len(tokens) // bs):
        block = tokens[i * bs : (i + 1) * bs]
        seed = xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *block), seed=seed)
        out.append(seed)
    return out


def test_golden_values_pin_the_wire_scheme():
    # Computed once from the scheme; a change here breaks every router/engine pair of mixed versions.
    # Scheme version 2 (xxh3 seeded with the parent); version 1 gave 10174726997572222408, 16060873115077743493.
    assert HASH_SCHEME_VERSION == 2
    assert block_hashes(list(range(32)), 16) == [4098244195692114, 13239350195574388577]
    assert block_hashes([1, 2, 3, 4], 4, parent_hash=0) == [8052976908588476977]


def test_matches_reference_implementation_on_random_prompts():
    rng = random.Random(7)
    for _ in range(20):
        bs = rng.choice([1, 4, 16, 64])
        tokens = [rng.randrange(2**17) for _ in range(rng.randrange(0, 700))]
        assert block_hashes(tokens, bs) == reference_block_hashes(tokens, bs)


@pytest.mark.parametrize("memo_blocks", [None, 0, 262_144])
def test_a_packed_prompt_hashes_exactly_as_the_list(memo_blocks: int | None):
    # Lists and packed prompts (an array('I') whose buffer is hashed as it is), through block_hashes and
    # PromptHashes with the memo off, empty and warm: partial last blocks, prompts past the cached slices and past
    # PACK_BLOCKS, ids up to 2**32 - 1, a continued chain.
    rng = random.Random(8)
    memo = None if memo_blocks is None else HashMemo(16, memo_blocks)
    sizes = [0, 1, 15, 16, 17, 16 * 64, 16 * 64 + 5, 16 * 700 + 3, 16 * (kv_hashing._MAX_CACHED_SLICES + 9) + 1]
    for n in sizes:
        tokens = [rng.randrange(2**17) for _ in range(n)]
        if n:
            tokens[-1] = 2**32 - 1
        packed = packed_prompt(tokens)
        assert type(packed) is array and kv_hashing.is_packed(packed) and list(packed) == tokens
        assert pack_token_ids(packed) == pack_token_ids(tokens)
        expected = block_hashes(tokens, 16)
        assert block_hashes(packed, 16) == expected
        assert block_hashes(packed, 16, parent_hash=12345) == block_hashes(tokens, 16, parent_hash=12345)
        for _ in range(2):  # the second time, with a memo: every chunk from it
            for given in (packed, tokens):
                lazy = PromptHashes(given, 16, memo if memo_blocks is not None else None)
                if len(lazy) > 3:
                    assert lazy[3] == expected[3]  # part first (lazily), then the rest
                assert lazy.computed(len(lazy)) == expected
        assert list(packed) == tokens  # the caller's buffer is read, never changed
    assert packed_prompt(array("I", [1, 2])) == array("I", [1, 2])  # an array copied, not shared
    with pytest.raises(ValueError):
        packed_prompt([1, -1])
    with pytest.raises(ValueError):
        packed_prompt([2**32])


def test_only_an_array_of_u32_is_hashed_as_packed():
    # Other arrays and sequences are packed from their ints, as before: same hashes as the list.
    tokens = list(range(100, 148))
    expected = block_hashes(tokens, 16)
    for given in (array("L", tokens), array("H", tokens), tuple(tokens), range(100, 148)):
        assert not kv_hashing.is_packed(given)
        assert block_hashes(given, 16) == expected and list(PromptHashes(given, 16)) == expected


def test_one_hash_per_full_block_and_none_for_a_partial_one():
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(16)), 16)) == 1
    assert len(block_hashes(list(range(47)), 16)) == 2 == num_full_blocks(47, 16)
    # The partial tail does not influence the full blocks' hashes.
    assert block_hashes(list(range(40)), 16) == block_hashes(list(range(32)) + [999] * 8, 16)


def test_hashes_are_chained_over_the_whole_prefix():
    a = list(range(64))
    b = a.copy()
    b[3] = 12345  # differs in block 0 only
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    # Blocks 1..3 have identical tokens but different prefixes, so every hash differs.
    assert all(x != y for x, y in zip(ha, hb, strict=True))
    c = a.copy()
    c[40] = 7  # differs in block 2
    hc = block_hashes(c, 16)
    assert hc[:2] == ha[:2] and hc[2] != ha[2] and hc[3] != ha[3]


def test_parent_hash_continues_a_chain():
    tokens = list(range(1000, 1100))
    full = block_hashes(tokens, 16)
    for k in range(1, len(full)):
        assert block_hashes(tokens[k * 16 :], 16, parent_hash=full[k - 1]) == full[k:]
    assert block_hashes(tokens, 16, parent_hash=full[0]) != full  # a parent is not the same as no parent


def test_hashes_are_unsigned_64_bit_ints():
    hashes = block_hashes(list(range(4096)), 16)
    assert len(hashes) == 256
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
    assert len(set(hashes)) == 256


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([1, -1, 2, 3], 2)
    with pytest.raises(ValueError, match="token ids"):
        pack_token_ids([2**32])
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="parent_hash"):
        block_hashes([1, 2], 2, parent_hash=2**64)


def test_pack_token_ids_is_little_endian_u32():
    assert pack_token_ids([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


def test_prompt_hashes_are_block_hashes_computed_on_demand():
    rng = random.Random(3)
    tokens = [rng.randrange(2**17) for _ in range(16 * 200 + 5)]
    full = block_hashes(tokens, 16)
    lazy = PromptHashes(tokens, 16)
    assert len(lazy) == 200 and lazy.num_computed == 0
    assert lazy[0] == full[0]
    assert 0 < lazy.num_computed < 200  # one chunk, not the whole prompt
    assert lazy[70] == full[70] and lazy[-1] == full[-1] and lazy.num_computed == 200
    assert lazy[5:9] == full[5:9] and list(lazy) == full and lazy == full
    with pytest.raises(IndexError):
        lazy[200]
    assert list(PromptHashes(tokens[:15], 16)) == [] and len(PromptHashes([], 4)) == 0
    with pytest.raises(ValueError, match="block_size"):
        PromptHashes(tokens, 0)


def test_prompt_hashes_grow_in_chunks_in_order():
    tokens = list(range(16 * 300))
    lazy = PromptHashes(tokens, 16)
    assert lazy.computed(3) == block_hashes(tokens, 16)[:3]
    first = lazy.num_computed
    assert first == PromptHashes.MIN_CHUNK_BLOCKS == 64
    lazy[first]  # one past the chunk: one more chunk
    assert lazy.num_computed == 128
    lazy.ensure(130)  # past it: a chunk more, not twice what is there (a search reads at most a chunk ahead)
    assert lazy.num_computed == 192
    lazy[299]
    assert lazy.num_computed == 300  # never past the last full block
    assert lazy.computed(300) == block_hashes(tokens, 16)


def test_hashes_past_the_cached_slices_are_the_same():
    # _chain slices blocks with cached slice objects up to _MAX_CACHED_SLICES blocks, then builds them: a longer
    # prompt hashes the same, lazily or not.
    rng = random.Random(4)
    n = kv_hashing._MAX_CACHED_SLICES + 37
    tokens = [rng.randrange(2**17) for _ in range(4 * n + 3)]
    expected = reference_block_hashes(tokens, 4)
    assert len(expected) == n and block_hashes(tokens, 4) == expected
    lazy = PromptHashes(tokens, 4)
    assert lazy[n - 1] == expected[-1] and lazy.computed(n) == expected


def test_a_memo_gives_the_chains_hashes_and_reuses_the_chunks_a_prompt_shares_with_an_earlier_one():
    rng = random.Random(5)
    memo = HashMemo(16, 10_000)
    history = [rng.randrange(2**17) for _ in range(16 * 200 + 7)]  # 200 full blocks: chunks 0-2 whole, 3 of 8 blocks
    first = PromptHashes(history, 16, memo)
    assert list(first) == reference_block_hashes(history, 16)
    assert (memo.hits, memo.misses, len(memo), memo.num_blocks) == (0, 4, 4, 200)
    # The next turn: the history then a new message. Chunks 0-2 (blocks 0-191) are the history's, reused; chunk 3
    # (blocks 192-255) holds the history's last 8 blocks and the new text, so it is new; chunk 4 too.
    turn = history + [rng.randrange(2**17) for _ in range(16 * 100)]
    second = PromptHashes(turn, 16, memo)
    assert list(second) == reference_block_hashes(turn, 16)
    assert (memo.hits, memo.misses, memo.blocks_reused) == (3, 4 + 2, 3 * 64)
    # The same prompt again (a retry): every chunk from the memo, the same values.
    assert PromptHashes(turn, 16, memo).computed(len(second)) == list(second) and memo.hits == 3 + 5


def test_a_memo_is_keyed_by_the_chunks_bytes_and_the_hash_before_them():
    # The same 64 blocks after different prefixes chain to different hashes: each gets its own entry.
    rng = random.Random(6)
    body = [rng.randrange(2**17) for _ in range(64 * 4)]
    a, b = [1] * (64 * 4) + body, [2] * (64 * 4) + body
    memo = HashMemo(4, 10_000)
    assert list(PromptHashes(a, 4, memo)) == reference_block_hashes(a, 4)
    assert list(PromptHashes(b, 4, memo)) == reference_block_hashes(b, 4)
    assert memo.hits == 0 and memo.misses == 4
    # A memo of another block size is not used (its chunks are cut elsewhere).
    other = HashMemo(16, 10_000)
    assert list(PromptHashes(a, 4, other)) == reference_block_hashes(a, 4) and len(other) == 0


def test_a_memo_holds_at_most_max_blocks_least_recently_used_out():
    rng = random.Random(7)
    prompts = [[rng.randrange(2**17) for _ in range(16 * 64)] for _ in range(4)]  # one chunk each
    memo = HashMemo(16, 3 * 64)
    for p in prompts[:3]:
        list(PromptHashes(p, 16, memo))
    list(PromptHashes(prompts[0], 16, memo))  # a hit: prompts[0] is now the most recent
    list(PromptHashes(prompts[3], 16, memo))  # full: the least recently used (prompts[1]) goes
    assert memo.num_blocks == 3 * 64 and len(memo) == 3 and memo.hits == 1
    hits = memo.hits
    list(PromptHashes(prompts[0], 16, memo))
    list(PromptHashes(prompts[1], 16, memo))
    assert memo.hits == hits + 1  # prompts[0] still there, prompts[1] was evicted
    off = HashMemo(16, 0)  # 0: nothing kept, hashes as without a memo
    assert list(PromptHashes(prompts[2], 16, off)) == reference_block_hashes(prompts[2], 16) and len(off) == 0
    with pytest.raises(ValueError, match="max_blocks"):
        HashMemo(16, -1)


def test_a_memo_backed_prompt_is_hashed_lazily_in_aligned_chunks():
    tokens = list(range(16 * 300))
    memo = HashMemo(16, 10_000)
    lazy = PromptHashes(tokens, 16, memo)
    assert lazy[3] == block_hashes(tokens, 16)[3] and lazy.num_computed == 64
    lazy.ensure(130)  # chunks end at multiples of 64 blocks: 192, not 130 + 64
    assert lazy.num_computed == 192
    assert lazy.computed(300) == block_hashes(tokens, 16) and lazy.num_computed == 300
    # A prompt longer than the first packed piece (PACK_BLOCKS) packs the rest as it goes, to the same values.
    long_tokens = [(i * 7919) % 2**17 for i in range(16 * (PromptHashes.PACK_BLOCKS * 3 + 5) + 9)]
    long_lazy = PromptHashes(long_tokens, 16, memo)
    assert long_lazy[10] == block_hashes(long_tokens, 16)[10]
    assert list(long_lazy) == block_hashes(long_tokens, 16)


def test_a_read_takes_the_following_chunks_the_memo_holds_and_leaves_the_first_it_lacks():
    rng = random.Random(8)
    memo = HashMemo(16, 10_000)
    history = [rng.randrange(2**17) for _ in range(16 * 256)]  # chunks 0-3
    list(PromptHashes(history, 16, memo))
    assert (memo.hits, memo.misses) == (0, 4)
    turn = history + [rng.randrange(2**17) for _ in range(16 * 100)]  # chunks 4 (64 blocks) and 5 (36) are new
    lazy = PromptHashes(turn, 16, memo)
    assert lazy[3] == reference_block_hashes(turn, 16)[3]
    # One read took the four chunks the memo holds; chunk 4 was looked up and left (not counted, not chained).
    assert lazy.num_computed == 256 and (memo.hits, memo.misses) == (4, 4)
    assert lazy[300] == reference_block_hashes(turn, 16)[300]
    assert lazy.num_computed == 320 and (memo.hits, memo.misses) == (4, 5)  # chunk 4, chained; chunk 5 left
    assert list(lazy) == reference_block_hashes(turn, 16) and (memo.hits, memo.misses) == (4, 6)
    # Without a memo entry for chunk 0, a read computes that chunk and stops at the next one the memo lacks.
    fresh = PromptHashes([rng.randrange(2**17) for _ in range(16 * 200)], 16, memo)
    assert fresh[0] is not None and fresh.num_computed == 64


def test_a_memo_keeps_its_chunks_unboxed_and_out_of_the_garbage_collectors_reach():
    # Each chunk's hashes are the bytes of an array('Q') (no int objects, nothing the cyclic collector tracks); a
    # prompt's hashes are an array('Q') too. Reading them gives the chain's ints, and computed() a plain list.
    rng = random.Random(9)
    memo = HashMemo(16, 10_000)
    history = [rng.randrange(2**17) for _ in range(16 * 130)]
    expected = reference_block_hashes(history, 16)
    first = PromptHashes(history, 16, memo)
    assert first.computed(130) == expected and type(first.computed(130)) is list
    assert len(memo) == 3 and all(type(v) is bytes and not gc.is_tracked(v) for v in memo._chunks.values())
    again = PromptHashes(history, 16, memo)
    hs = again.ensure(130)
    assert list(hs) == expected and hs[129] == expected[129] == again[129]
    assert memo.hits == 3 and again == expected and list(again) == expected
    # A chunk put as any sequence of ints is kept as the same bytes, and read back as an array of the same values.
    memo.put(12345, tuple(expected[:64]))
    got = memo.get(12345)
    assert got is not None and list(got) == expected[:64] and type(memo._chunks[12345]) is bytes
