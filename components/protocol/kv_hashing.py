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

A prompt can come packed already (``packed_prompt``: an ``array('I')``, a ``Sequence[int]`` whose buffer is the
bytes above on a little-endian host): ``PromptHashes`` and ``block_hashes`` then read its buffer as it is, with no
pass over int objects. The frontend packs the tokenizer's ids once per request and hands the router that, so a
``kv`` decision no longer pays the ~38 us of packing 8k ids (a third of it on the dev VM); lists hash exactly as
before, to the same values.

A router sees the same prefixes again and again (a conversation's next turn repeats its whole history; a document or
system prompt comes back with every question), and the chain makes every repeat cost as much as the first: ~110 ns a
block in ``xxh3`` calls alone. ``HashMemo`` remembers the hashes of recently hashed 64-block chunks under a 128-bit
digest of the chunk's bytes and the hash before it (one ``xxh3_128`` call over 4 KiB, ~0.3 us, instead of 64 chained
calls, ~7 us), so a prompt pays the chain only for chunks no recent prompt had. Packing the tokens (~4.5 ns a token)
is still paid where the prompt comes as a list (the digest needs the bytes), and not at all where it comes packed.
The memo returns exactly the hashes the chain gives (same scheme, same values): a hit is a chunk whose bytes and
preceding hash equal an earlier one's, up to a 128-bit digest collision (~2^-128 per pair), which could only misroute
a request, never change what an engine computes.

Imports: the standard library and ``xxhash`` only (the runtime imports no other component).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import overload

import xxhash

__all__ = [
    "HASH_SCHEME_VERSION",
    "ROOT_PARENT_MARKER",
    "ROOT_SEED",
    "HashMemo",
    "PromptHashes",
    "block_hashes",
    "is_packed",
    "num_full_blocks",
    "pack_token_ids",
    "packed_prompt",
]

HASH_SCHEME_VERSION = 2
# The parent of a sequence's first block: eight bytes, read as the xxh3 seed of block 0.
ROOT_PARENT_MARKER = b"kvmesh\x00\x01"
ROOT_SEED = int.from_bytes(ROOT_PARENT_MARKER, "little")

_xxh3_64 = xxhash.xxh3_64_intdigest
_xxh3_128 = xxhash.xxh3_128_intdigest
_U32_MAX = 2**32 - 1

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports today has a 4-byte C unsigned int
    raise ImportError("kv_hashing needs array('I') to be 4 bytes wide")


# A prompt handed over packed (``packed_prompt``): an ``array('I')`` whose buffer already is the scheme's bytes, which
# holds on a little-endian host (on a big-endian one its buffer is byte-swapped, so it is packed again like a list).
_NATIVE_IS_LE = sys.byteorder == "little"


def packed_prompt(token_ids: Sequence[int]) -> array[int]:
    """The token ids as an ``array('I')``: a ``Sequence[int]`` (indexing, ``len``, slicing give the same ids) whose
    buffer is the little-endian uint32 bytes this module hashes. ``PromptHashes`` and ``block_hashes`` hash such a
    prompt's buffer as it is, without reading an int object per token (packing 8k ids from a list costs ~38 us, a
    third of a ``kv`` decision): a caller that packs a prompt once (the frontend, right after tokenizing it) saves
    that on every hashing of it. Hashes are the same as for the list. Raises ``ValueError`` for an id outside
    ``[0, 2**32)``."""
    try:
        if type(token_ids) is list:
            packed = array("I")
            packed.fromlist(token_ids)  # ~30% faster than array("I", list), which goes through the iterator protocol
            return packed
        return array("I", token_ids)  # an array('I') too: a copy, which the caller may then change at will
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_U32_MAX}]: {exc}") from exc


def is_packed(token_ids: Sequence[int]) -> bool:
    """Whether ``token_ids`` is a packed prompt whose buffer is hashed as it is (``packed_prompt``)."""
    return type(token_ids) is array and token_ids.typecode == "I" and _NATIVE_IS_LE


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes. Raises ``ValueError`` for an id outside ``[0, 2**32)``."""
    return _pack(token_ids).tobytes()


def _packed_bytes(token_ids: Sequence[int], start: int, stop: int) -> bytes:
    """``pack_token_ids(token_ids[start:stop])``; from a packed prompt, one copy of its buffer's slice."""
    if is_packed(token_ids):
        with memoryview(token_ids) as view:  # type: ignore[arg-type]  # is_packed: an array('I')
            return view[start:stop].tobytes()
    return _pack(token_ids[start:stop]).tobytes()


def _pack(token_ids: Sequence[int]) -> array[int]:
    """``pack_token_ids`` as an ``array('I')`` (its buffer is those bytes), without copying them out. A packed prompt
    (``is_packed``) is returned as it is: read it, never change it (it is the caller's)."""
    if is_packed(token_ids):
        return token_ids  # type: ignore[return-value]  # is_packed: an array('I')
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
    return packed


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


def _chain(buf: bytes, stride: int, seed: int, out: list[int] | array[int]) -> int:
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
        _chain(_packed_bytes(token_ids, 0, n_blocks * block_size), block_size * 4, seed, out)
    return out


class HashMemo:
    """The chained hashes of recently hashed 64-block chunks of prompts, for ``PromptHashes`` (module docstring).

    Keyed by ``xxh3_128(chunk bytes, seed=hash of the block before the chunk)``: a chunk's hashes depend on exactly
    these two things, so equal keys mean equal hashes (up to a 128-bit collision). Chunks start at multiples of
    ``CHUNK_BLOCKS`` blocks from the prompt's start, so two prompts sharing a prefix share its whole chunks; the chunk
    where they part (and a prompt's shorter last chunk) is keyed by its own bytes and hashed when new. One memo
    serves one block size. At most ``max_blocks`` hashes are kept, least recently used first out, each chunk's as the
    bytes of an ``array('Q')`` of them (native byte order: the memo never leaves the process): ~14 bytes a block (8
    for the hash, the rest the bytes object's header, the 128-bit key and the entry; ``tracemalloc``, where tuples of
    ints took ~50), ~3.6 MB for the default 262,144 blocks (4M tokens of distinct prefixes at 16 tokens a block).
    ``max_blocks`` 0 keeps nothing (every chunk is hashed).

    Unboxed on purpose (a tuple of ints until main at b9b476f): a hit copies the chunk's 512 bytes into the prompt's
    array of hashes (``PromptHashes``) instead of touching 64 int objects scattered over the heap (taking a reference
    to each: a cache miss apiece in a router whose other work has evicted them, ~7 chunks per conversation turn); and
    a bytes object is nothing the cyclic garbage collector tracks, where each new tuple was traversed, its 64 ints
    read, by the next collection (most of the young generation's work in ``kvmesh bench router``: ~0.5-0.8 ms a
    collection, docs/router.md, "Cost").

    ``hits`` and ``misses`` count chunks; ``blocks_reused`` the hashes that came from the memo.
    """

    __slots__ = ("_chunks", "block_size", "blocks_reused", "hits", "max_blocks", "misses", "num_blocks")

    CHUNK_BLOCKS = 64

    def __init__(self, block_size: int, max_blocks: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._chunks: OrderedDict[int, bytes] = OrderedDict()  # key -> the chunk's hashes, array('Q').tobytes()
        self.num_blocks = 0
        self.hits = self.misses = self.blocks_reused = 0

    def __len__(self) -> int:
        """Chunks held."""
        return len(self._chunks)

    def get(self, key: int) -> array[int] | None:
        """The chunk's hashes (a new ``array('Q')``), None if the memo lacks it."""
        packed = self._chunks.get(key)
        if packed is None:
            self.misses += 1
            return None
        self._chunks.move_to_end(key)
        hashes = array("Q")
        hashes.frombytes(packed)
        self.hits += 1
        self.blocks_reused += len(hashes)
        return hashes

    def put(self, key: int, hashes: Sequence[int]) -> None:
        """Keep a chunk's hashes (an ``array('Q')`` or any sequence of ints), evicting the least recently used."""
        n = len(hashes)
        if n > self.max_blocks:
            return
        if not isinstance(hashes, array) or hashes.typecode != "Q":
            hashes = array("Q", hashes)
        chunks = self._chunks
        old = chunks.pop(key, None)
        if old is not None:
            self.num_blocks -= len(old) >> 3
        chunks[key] = hashes.tobytes()
        self.num_blocks += n
        while self.num_blocks > self.max_blocks:
            _, gone = chunks.popitem(last=False)
            self.num_blocks -= len(gone) >> 3

    def clear(self) -> None:
        self._chunks.clear()
        self.num_blocks = 0


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

    With a ``memo`` (``HashMemo`` of the same block size) the chunks are aligned to multiples of 64 blocks and each
    is looked up there before it is chained, and stored after (same values either way). A read also takes the
    chunks after the one it needs while the memo holds them (a memo hit costs ~0.5 us a chunk, where a call per
    chunk read, as the search's gallop reads them, costs ~1-2 us more), so ``num_computed`` may exceed what was read.

    The hashes are kept in an ``array('Q')`` (``ensure``), not a list of ints: a memo hit appends a chunk's 512 bytes
    (``HashMemo``), and the index search makes an int only of the few dozen hashes it probes (~20 ns each); freeing
    the prompt frees one buffer instead of 512 ints.
    """

    __slots__ = ("_bs", "_buf", "_last", "_memo", "_n", "_out", "_peek", "_tokens")

    MIN_CHUNK_BLOCKS = HashMemo.CHUNK_BLOCKS
    PACK_BLOCKS = 512  # with a memo, the first packed piece (``_packed``)

    def __init__(self, token_ids: Sequence[int], block_size: int, memo: HashMemo | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._tokens = token_ids
        self._bs = block_size
        self._n = len(token_ids) // block_size
        self._out: array[int] = array("Q")  # the hashes so far, unboxed (class docstring)
        self._last = ROOT_SEED
        self._memo = memo if memo is not None and memo.block_size == block_size and memo.max_blocks else None
        # The packed tokens so far (with a memo: ``_packed``); a packed prompt's own array, all of it, read only.
        self._buf: array[int] = token_ids if is_packed(token_ids) else array("I")  # type: ignore[assignment]
        self._peek: tuple[int, int] | None = None  # (byte offset, memo key) of a chunk looked up ahead, not found

    def __len__(self) -> int:
        return self._n

    @property
    def num_computed(self) -> int:
        """How many hashes have been computed so far."""
        return len(self._out)

    def _extend(self, k: int) -> None:
        done = len(self._out)
        chunk = self.MIN_CHUNK_BLOCKS
        k = min(self._n, max(k, done + chunk))
        bs = self._bs
        memo = self._memo
        if memo is None:
            packed = _packed_bytes(self._tokens, done * bs, k * bs)
            self._last = _chain(packed, bs * 4, self._last, self._out)
            return
        # Whole chunks from a multiple of ``chunk`` (``done`` always is one here), so that prompts sharing a prefix
        # cut it into the same chunks. Past ``k``, the chunks that follow are taken too while the memo holds them and
        # they are packed already (a conversation's history: one call instead of one per chunk the search reads); the
        # first one it lacks is left for a later call, its key kept (``_peek``) so that it is not digested twice.
        k = min(self._n, -(-k // chunk) * chunk)
        stride = bs * 4
        size = chunk * stride
        out = self._out
        last = self._last
        chunks = memo._chunks
        get = chunks.get
        move_to_end = chunks.move_to_end
        frombytes = out.frombytes
        peek_off, peek_key = self._peek or (-1, 0)
        self._peek = None
        hits = reused = 0
        with memoryview(self._packed(k * bs)).cast("B") as view:
            n_bytes = self._n * stride
            avail_bytes = min(n_bytes, len(view) // stride * stride)  # whole blocks packed
            off = done * stride
            asked = k * stride
            # Ahead, a chunk is taken while it is packed whole: ``min(off + size, n_bytes) <= avail_bytes``, which
            # (``avail_bytes <= n_bytes``) is ``off + size <= avail_bytes`` unless the whole prompt is packed.
            whole = avail_bytes >= n_bytes
            # A chunk per pass: those asked for, then those ahead while they are packed whole. A hit is a digest, a
            # lookup and a copy (~1 us warm); the loop's own steps are kept small (locals, counters added at the end).
            while off < asked or (off < avail_bytes and (whole or off + size <= avail_bytes)):  # asked or ahead
                piece = view[off : off + size]  # a view: no copy (xxh3 reads any buffer)
                key = peek_key if off == peek_off else _xxh3_128(piece, last)
                hashes = get(key)
                if hashes is None:
                    if off >= asked:
                        self._peek = (off, key)  # ahead: left for the read that needs it, digested once
                        break
                    memo.misses += 1
                    start = len(out)
                    last = _chain(piece.tobytes(), stride, last, out)  # 64-byte bytes slices beat view slices
                    memo.put(key, out[start:])
                else:
                    move_to_end(key)
                    hits += 1
                    reused += len(hashes)
                    frombytes(hashes)  # the chunk's 8-byte hashes, copied
                    last = out[-1]
                off += size
        memo.hits += hits
        memo.blocks_reused += reused >> 3
        self._last = last

    def _packed(self, num_tokens: int) -> array[int]:
        """The packed tokens, at least their first ``num_tokens``. Packed in growing pieces: the first ``PACK_BLOCKS``
        blocks (or the whole prompt if shorter, without copying the list), then twice what is there. Packing costs
        ~4.5 ns a token, in a C loop that reads every int object, and slicing the list first ~1.7 ns more, so one
        piece for an 8k-token prompt beats eight chunk-sized ones (~37 vs ~53 us); doubling bounds what a long prompt
        of which only a system prompt is cached packs in vain. A packed prompt (``packed_prompt``) is its own buffer
        from the start (``__init__``): nothing is packed, and the caller's array is never changed."""
        buf = self._buf
        have = len(buf)
        if have >= num_tokens:
            return buf
        tokens = self._tokens
        want = max(num_tokens, 2 * have, self.PACK_BLOCKS * self._bs)
        if not have and want >= len(tokens):
            buf = self._buf = _pack(tokens)  # the whole prompt, partial last block included: harmless
        else:
            buf.extend(_pack(tokens[have:want]))
        return buf

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

    def ensure(self, k: int) -> array[int]:
        """The hashes computed so far (an ``array('Q')``: indexing it gives ints), holding at least the first
        ``min(k, len(self))``. The same array grows as more are computed (read it, do not modify it): a hot loop
        indexes it directly, without a method call per hash."""
        if k > len(self._out):
            self._extend(k)
        return self._out

    def computed(self, k: int) -> list[int]:
        """The first ``min(k, len(self))`` hashes as a new list, computing what is missing."""
        if k > len(self._out):
            self._extend(k)
        return self._out.tolist() if k >= self._n else self._out[:k].tolist()

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
