"""The chained block hash shared by engines and the router (components.runtime.kv_hashing)."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from components.runtime.kv_hashing import ROOT_PARENT_MARKER, block_hashes, num_full_blocks, pack_token_ids

pytestmark = pytest.mark.unit


def reference_block_hashes(tokens: list[int], bs: int, parent: int | None = None) -> list[int]:
    """The scheme written out the slow, obvious way: one struct.pack per block, per the module docstring."""
    out = []
    prev = ROOT_PARENT_MARKER if parent is None else struct.pack("<Q", parent)
    for i in range(len(tokens) // bs):
        block = tokens[i * bs : (i + 1) * bs]
        h = xxhash.xxh3_64_intdigest(prev + struct.pack(f"<{bs}I", *block))
        out.append(h)
        prev = struct.pack("<Q", h)
    return out


def test_golden_values_pin_the_wire_scheme():
    # Computed once from the scheme; a change here breaks every router/engine pair of mixed versions.
    assert block_hashes(list(range(32)), 16) == [10174726997572222408, 16060873115077743493]
    assert block_hashes([1, 2, 3, 4], 4, parent_hash=0) == [3753813699206364683]


def test_matches_reference_implementation_on_random_prompts():
    rng = random.Random(7)
    for _ in range(20):
        bs = rng.choice([1, 4, 16, 64])
        tokens = [rng.randrange(2**17) for _ in range(rng.randrange(0, 700))]
        assert block_hashes(tokens, bs) == reference_block_hashes(tokens, bs)


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
