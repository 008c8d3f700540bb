"""Chained block hashes of token ids: the one definition of "the same KV block" shared by engines and the router.

An engine announces the blocks its prefix cache holds as these hashes (``KvEvent.block_hashes``); the router hashes an
incoming prompt the same way and counts how many leading hashes a worker already holds. Both sides must therefore call
this module and nothing else.

The scheme (version 2; changing any byte of it is a protocol change for every engine and router in a fleet, which is
why workers announce ``HASH_SCHEME_VERSION`` in their metadata):

* A prompt of ``n`` tokens has ``n // block_size`` full blocks. Only full blocks are hashed: a partial trailing block
  is still being written by its owner and cannot be shared, exactly as in vLLM's prefix cache.
* ``hash_0 = xxh3_64(le_u32(tokens[0:bs]), seed=ROOT_SEED)`` and
  ``hash_i = xxh3_64(le_u32(tokens[i*bs:(i+1)*bs]), seed=hash_{i-1})``: each hash covers the whole prefix up to and
  including its block, so equal hashes mean equal prefixes (up to 64-bit collisions: with 10^7 distinct blocks in a
  fleet the birthday bound is about 10^14 / 2^65, i.e. 3e-6).
* ``le_u32`` packs token ids as little-endian unsigned 32-bit integers (vocabularies are < 2^18 today);
  ``ROOT_SEED`` (the 8 bytes ``ROOT_PARENT_MARKER`` read as a little-endian integer) stands in for the missing parent
  of the first block.
* Hashes are Python ints in ``[0, 2**64)``; msgpack carries them as uint64.

Version 1 hashed ``le_u64(parent) + block`` with no seed; seeding xxh3 with the parent saves a concatenation and an
``int.to_bytes`` per block (~30% of the hashing time).

Speed matters: the router hashes prompts on its hot path. The tokens are packed with ``array('I').fromlist`` (a C loop,
~5 ns a token; ``struct.pack`` and numpy are slower from a list of ints) and each block costs one slice, with a cached
slice object, and one seeded xxh3 call: ~115 us for an 8192-token prompt with 16-token blocks (512 blocks), ~43 us of
it packing, on one core of the 2-core EPYC dev VM (~140 us building a slice object per block). ``PromptHashes``
computes them on demand, so a router that finds no cached prefix past block 40 hashes 64 blocks, not 512.

Imports: the standard library and ``xxhash`` only (the runtime imports no other component).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import overload

import xxhash

__all__ = [
    "HASH_SCHEME_VERSION",
    "ROOT_PARENT_MARKER",
    "ROOT_SEED",
    "PromptHashes",
    "block_hashes",
    "num_full_blocks",
    "pack_token_ids",
]

HASH_SCHEME_VERSION = 2
# The parent of a sequence's first block: eight bytes, read as the xxh3 seed of block 0.
ROOT_PARENT_MARKER = b"kvmesh\x00\x01"
ROOT_SEED = int.from_bytes(ROOT_PARENT_MARKER, "little")

_xxh3_64 = xxhash.xxh3_64_intdigest
_U32_MAX = 2**32 - 1

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports today has a 4-byte C unsigned int
    raise ImportError("kv_hashing needs array('I') to be 4 bytes wide")


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes. Raises ``ValueError`` for an id outside ``[0, 2**32)``."""
    try:
        if type(token_ids) is list:
            packed = array("I")
            packed.fromlist(token_ids)  # ~30% faster than array("I", list), which goes through the iterator protocol
        else:
            packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_U32_MAX}]: {exc}") from exc
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI machine; kept so hashes agree across hosts
        packed.byteswap()
    return packed.tobytes()


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """How many hashes ``block_hashes`` returns for ``num_tokens`` tokens."""
    return num_tokens // block_size


def _check_parent(parent_hash: int | None) -> int:
    if parent_hash is None:
        return ROOT_SEED
    if not 0 <= parent_hash <= 2**64 - 1:
        raise ValueError(f"parent_hash must be an unsigned 64-bit int, got {parent_hash}")
    return parent_hash


# Per block size in bytes, the slices of a packed prompt's first blocks, built once: slicing with a ready slice object
# instead of ``buf[off : off + stride]`` saves building one per block, ~25% of chaining a 16-token block (~40 of
# ~160 ns). Kept up to _MAX_CACHED_SLICES blocks (~1 MB at 16 tokens a block: 128k-token prompts); longer prompts
# build the rest as they go.
_block_slices: dict[int, list[slice]] = {}
_MAX_CACHED_SLICES = 8192


def _slices(stride: int, n: int) -> list[slice]:
    """At least ``min(n, _MAX_CACHED_SLICES)`` slices of consecutive ``stride``-byte blocks from offset 0."""
    cached = _block_slices.get(stride)
    if cached is None or (len(cached) < n and len(cached) < _MAX_CACHED_SLICES):
        m = min(_MAX_CACHED_SLICES, max(n, 512))
        cached = _block_slices[stride] = [slice(off, off + stride) for off in range(0, m * stride, stride)]
    return cached


def _chain(buf: bytes, stride: int, seed: int, out: list[int]) -> int:
    """Append the chained hashes of the ``stride``-byte blocks of ``buf`` to ``out``; returns the last one."""
    h = seed
    append = out.append
    n = len(buf) // stride
    slices = _slices(stride, n)
    for s in slices[:n] if n < len(slices) else slices:
        h = _xxh3_64(buf[s], h)
        append(h)
    for off in range(len(slices) * stride, n * stride, stride):  # past the cached slices (very long prompts)
        h = _xxh3_64(buf[off : off + stride], h)
        append(h)
    return h


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int | None = None) -> list[int]:
    """One chained hash per full block of ``token_ids``; a partial trailing block gets none.

    ``parent_hash`` continues a chain: the hashes of ``tokens[k*bs:]`` with ``parent_hash=hashes[k-1]`` equal
    ``hashes[k:]`` of the whole sequence, which is how an engine hashes one more block during decode without
    rehashing the prompt.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    seed = _check_parent(parent_hash)
    out: list[int] = []
    if n_blocks:
        _chain(pack_token_ids(token_ids[: n_blocks * block_size]), block_size * 4, seed, out)
    return out


class PromptHashes(Sequence[int]):
    """``block_hashes(token_ids, block_size)`` as a lazy sequence: a hash is computed when it, or one after it, is
    first read. ``len()`` is the number of full blocks and costs nothing.

    A router walking its KV index reads the hashes in order and stops at the first block no worker holds, so a
    prompt that shares only a system prompt with the fleet costs a few dozen hashes instead of hundreds. A read past
    the computed hashes computes up to the block read, and at least ``MIN_CHUNK_BLOCKS`` more. The index's search
    reads ahead at most that many blocks past the deepest block it knows is held (``KvIndex._search``), so a prompt
    is hashed at most one chunk past its longest cached prefix; with chunks that doubled, a conversation cached to
    block 349 was hashed to 512.

    64 blocks a chunk: a chunk costs ~2 us besides its blocks (~230 ns each: slicing and packing its tokens, calls),
    and reading ahead costs blocks hashed in vain, so fewer, larger chunks win up to a point. On ``kvmesh bench
    router``'s workload (256 workers, conversations cached 64..480 blocks deep) a ``kv`` decision took ~249 us at p50
    with 32-block chunks, ~231 us with 64 and ~230 us with 128 (hashing 370, 381 and 411 blocks on average).
    """

    __slots__ = ("_bs", "_last", "_n", "_out", "_tokens")

    MIN_CHUNK_BLOCKS = 64

    def __init__(self, token_ids: Sequence[int], block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._tokens = token_ids
        self._bs = block_size
        self._n = len(token_ids) // block_size
        self._out: list[int] = []
        self._last = ROOT_SEED

    def __len__(self) -> int:
        return self._n

    @property
    def num_computed(self) -> int:
        """How many hashes have been computed so far."""
        return len(self._out)

    def _extend(self, k: int) -> None:
        done = len(self._out)
        k = min(self._n, max(k, done + self.MIN_CHUNK_BLOCKS))
        bs = self._bs
        buf = pack_token_ids(self._tokens[done * bs : k * bs])
        self._last = _chain(buf, bs * 4, self._last, self._out)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self.computed(self._n)[i]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"block {i} of a prompt with {self._n} full blocks")
        out = self._out
        if i >= len(out):
            self._extend(i + 1)
        return out[i]

    def ensure(self, k: int) -> list[int]:
        """The list of hashes computed so far, holding at least the first ``min(k, len(self))``. The same list object
        grows as more are computed (read it, do not modify it): a hot loop indexes it directly, without a method call
        per hash."""
        if k > len(self._out):
            self._extend(k)
        return self._out

    def computed(self, k: int) -> list[int]:
        """The first ``min(k, len(self))`` hashes, computing what is missing (the list is shared: do not modify)."""
        if k > len(self._out):
            self._extend(k)
        return self._out if k >= self._n else self._out[:k]

    def __iter__(self) -> Iterator[int]:
        return iter(self.computed(self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptHashes):
            other = other.computed(len(other))
        if not isinstance(other, Sequence):
            return NotImplemented
        return self.computed(self._n) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable cache: equal by value, unhashable like a list

    def __repr__(self) -> str:
        return f"PromptHashes({len(self._out)}/{self._n} computed, block_size={self._bs})"
