"""A paged KV block pool with prefix caching, the bookkeeping half of vLLM V1's ``BlockPool``/``KVCacheManager``.

The pool owns ``num_blocks`` physical blocks, numbered ``0..num_blocks-1``. Each block is in exactly one of three
states:

* **active**: ``ref_cnt > 0``; one or more requests use it (requests that share a cached prefix share its blocks);
* **cached free**: ``ref_cnt == 0`` but it still holds a full block of KV whose chained hash
  (``components.protocol.kv_hashing``) is in the prefix cache; a later request with the same prefix can take it back
  (``touch``) without recomputing, and it is evicted, least recently freed first, only when a fresh block is needed;
* **empty free**: ``ref_cnt == 0`` and no hash (never filled, or a partial block, or cleared by a reset).

``allocate`` hands out empty blocks before evicting cached ones, so the cache keeps every block it can. This differs
from vLLM V1, whose single free queue can evict a cached block while an empty one waits further down the queue; the
router-visible difference is fewer ``BLOCK_REMOVED`` events.

With ``num_host_blocks`` the pool also keeps a **host-memory tier**: an LRU cache of block hashes in host DRAM. Every
block that gets its hash on the device is written there too (write-through: the tier holds what the device holds,
and what the device evicted, up to its size), ``host_lookup`` says how far a prefix continues there past what the
device caches (the scheduler loads those blocks back instead of recomputing them), and ``host_touch`` marks a
sequence's blocks as used, tail first so that the tier, like the device, evicts a sequence's last blocks before its
first ones. It holds hashes only: the simulated KV is just its bookkeeping.

The pool records every change to the set of cached hashes as a ``KvEvent``: ``BLOCK_STORED`` when full blocks get
their hashes (one event per run of consecutive blocks of one request), ``BLOCK_REMOVED`` when cached blocks are
evicted (one event per ``allocate`` call that evicts), ``ALL_CLEARED`` on ``reset_prefix_cache``; the host tier's
changes as the same kinds with ``medium=KV_MEDIUM_HOST``. Event ids (both media, one sequence) start at 1 and
increase by one per event; ``last_event_id`` is 0 before the first.

Pure bookkeeping: no asyncio, no clock, no I/O. Imports the engine contract (``..base``) and the standard library.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from components.protocol.messages import KV_MEDIUM_HOST, KvEvent, KvEventKind, KvStateSnapshot

from ..base import EngineError

__all__ = ["BlockPool", "NoFreeBlocksError"]


class NoFreeBlocksError(EngineError):
    """``allocate`` was asked for more blocks than are free. The scheduler checks first; this means a bug there."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} KV blocks, only {free} free")
        self.requested = requested
        self.free = free


class BlockPool:
    """Reference-counted KV blocks plus a prefix cache keyed by chained block hash."""

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_caching: bool = True, num_host_blocks: int = 0
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Empty free blocks, used as a stack: the order among them does not matter.
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached free blocks in eviction order: first key = least recently freed = evicted first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # hash -> block id, for every block (active or cached free) whose hash is in the prefix cache.
        self._cached: dict[int, int] = {}
        self._events: list[KvEvent] = []
        self._last_event_id = 0
        # The host tier: hashes in LRU order (first key = least recently used = evicted first).
        self.num_host_blocks = num_host_blocks if enable_caching else 0
        self._host: OrderedDict[int, None] = OrderedDict()

    # --- counts -----------------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: empty ones plus cached ones it may evict."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_active_blocks(self) -> int:
        return self.num_blocks - len(self._empty) - len(self._evictable)  # all blocks but the free ones

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is in the prefix cache, active or not."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Active blocks over all blocks, 0..1 (vLLM's ``kv_cache_usage``: cached free blocks count as free)."""
        return self.num_active_blocks / self.num_blocks

    @property
    def last_event_id(self) -> int:
        return self._last_event_id

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    # --- prefix cache -----------------------------------------------------------------------------------------------

    def lookup_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``; changes nothing (call ``touch`` to take them)."""
        if not self.enable_caching:
            return []
        found: list[int] = []
        cached = self._cached
        for h in hashes:
            block_id = cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def num_reactivated(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are cached free, i.e. would leave the free count if touched."""
        ref = self._ref_cnt
        return sum(1 for b in block_ids if ref[b] == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block (a prefix-cache hit); cached free blocks become active again."""
        ref = self._ref_cnt
        for b in block_ids:
            if ref[b] == 0:
                if self._hash[b] is None:
                    raise ValueError(f"block {b} is free and holds nothing; allocate it instead of touching it")
                del self._evictable[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with one reference each, empty ones first, then evicting least recently freed cached ones."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(n, self.num_free_blocks)
        out: list[int] = []
        removed: list[int] = []
        empty = self._empty
        while len(out) < n and empty:
            out.append(empty.pop())
        if len(out) < n:
            # Locals, not attributes: a full cache evicts one block per block allocated (millions in an hour's replay).
            pop = self._evictable.popitem
            hashes = self._hash
            cached = self._cached
            for _ in range(n - len(out)):
                b = pop(last=False)[0]
                h = hashes[b]
                assert h is not None  # only hashed blocks are evictable
                hashes[b] = None
                del cached[h]
                removed.append(h)
                out.append(b)
        ref = self._ref_cnt
        for b in out:
            ref[b] = 1
        if removed:
            self._emit(KvEventKind.BLOCK_REMOVED, block_hashes=removed)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each of a request's blocks, given in sequence order.

        Blocks are released tail first, so when they end up evictable a sequence's last blocks go before its first
        ones: the first blocks are the ones most likely shared (a system prompt), as in vLLM.
        """
        ref = self._ref_cnt
        hashes = self._hash
        empty = self._empty
        evictable = self._evictable
        for b in reversed(block_ids):
            r = ref[b]
            if r <= 0:
                raise ValueError(f"block {b} freed more often than taken")
            ref[b] = r - 1
            if r == 1:
                if hashes[b] is None:
                    empty.append(b)
                else:
                    evictable[b] = None

    def cache_full_blocks(self, block_ids: Sequence[int], hashes: Sequence[int], parent_hash: int | None) -> None:
        """Give full, active blocks their chained hashes and announce them with ``BLOCK_STORED``.

        ``block_ids[i]`` holds the block whose hash is ``hashes[i]``; ``parent_hash`` is the hash before
        ``hashes[0]`` (None at the start of a sequence). A hash already cached in another block (two requests with
        the same prefix prefilled in the same step) is not cached twice: that block stays anonymous and the run of
        stored hashes is split around it, as the router already knows that hash.
        """
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} blocks for {len(hashes)} hashes")
        if not self.enable_caching:
            return
        run: list[int] = []
        run_parent = parent_hash  # the hash before run[0]
        prev = parent_hash  # the hash before the current block
        ref = self._ref_cnt
        block_hash = self._hash
        cached = self._cached
        for b, h in zip(block_ids, hashes, strict=True):
            if ref[b] <= 0:
                raise ValueError(f"block {b} must be active to be cached")
            if block_hash[b] is not None or h in cached:
                # Already cached (by this block or another): close the current run.
                if run:
                    self._emit(KvEventKind.BLOCK_STORED, block_hashes=run, parent_hash=run_parent)
                    run = []
            else:
                block_hash[b] = h
                cached[h] = b
                if not run:
                    run_parent = prev
                run.append(h)
            prev = h
        if run:
            self._emit(KvEventKind.BLOCK_STORED, block_hashes=run, parent_hash=run_parent)
        if self.num_host_blocks:
            self._host_store(hashes, parent_hash)

    def import_prefix(self, hashes: Sequence[int], parent_hash: int | None = None) -> int:
        """Cache a prefix whose KV arrives from another engine, with no request: hot-prefix replication's copy
        (components/rescheduler/policies/replication.py). ``hashes`` is the prefix's chained block hashes from its
        start (``parent_hash`` None) or after ``parent_hash``.

        The blocks already cached are kept (taken while the rest are allocated, so the allocation cannot evict the
        prefix's own head); the missing tail is allocated, announced with ``BLOCK_STORED`` like a prefill's blocks,
        and freed at once: the copy is cached free KV, evicted by the same LRU as any other (tail first). Returns the
        blocks imported (0 with caching off or when all were cached). ``NoFreeBlocksError`` when the free blocks
        (cached free ones included) are too few for the missing tail.
        """
        if not self.enable_caching or not hashes:
            return 0
        have = self.lookup_prefix(hashes)
        missing = list(hashes[len(have) :])
        if not missing:
            return 0
        self.touch(have)
        try:
            new = self.allocate(len(missing))
        except NoFreeBlocksError:
            self.free(have)
            raise
        self.cache_full_blocks(new, missing, hashes[len(have) - 1] if have else parent_hash)
        self.free([*have, *new])
        return len(new)

    def drop_prefix(self, hashes: Sequence[int]) -> tuple[int, int]:
        """Evict a prefix's cached free blocks at once, with no request: hot-prefix replication's drop of a cold
        replica (components/workers/replication.py). Each of ``hashes`` cached in a block no request uses loses its
        hash and becomes an empty free block, announced in one ``BLOCK_REMOVED`` so routers forget this holder;
        blocks in use stay (their requests need them). The host tier keeps its copies (it is an LRU of its own).
        Returns (blocks dropped, blocks of the prefix kept because in use)."""
        if not self.enable_caching:
            return 0, 0
        removed: list[int] = []
        in_use = 0
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                continue
            if self._ref_cnt[b] > 0:
                in_use += 1
                continue
            del self._evictable[b]
            del self._cached[h]
            self._hash[b] = None
            self._empty.append(b)
            removed.append(h)
        if removed:
            self._emit(KvEventKind.BLOCK_REMOVED, block_hashes=removed)
        return len(removed), in_use

    # --- host-memory tier -------------------------------------------------------------------------------------------

    @property
    def num_host_cached_blocks(self) -> int:
        return len(self._host)

    def host_lookup(self, hashes: Sequence[int], start: int) -> int:
        """How many of ``hashes[start:]``, consecutively from ``start``, the host tier holds; changes nothing."""
        host = self._host
        n = start
        for h in hashes[start:] if start else hashes:
            if h not in host:
                break
            n += 1
        return n - start

    def host_touch(self, hashes: Sequence[int]) -> None:
        """Mark the held ones of a sequence's ``hashes`` as just used, its first blocks most recently (evicted last)."""
        host = self._host
        if not host:
            return
        move = host.move_to_end
        for h in reversed(hashes):
            if h in host:
                move(h)

    def _host_store(self, hashes: Sequence[int], parent_hash: int | None) -> None:
        """Write a chain's blocks through to the host tier (``parent_hash``: the hash before ``hashes[0]``): new ones
        are announced with ``BLOCK_STORED`` (medium host), then the tier evicts least recently used ones beyond its
        size (``BLOCK_REMOVED``)."""
        host = self._host
        run: list[int] = []
        run_parent = parent_hash
        prev = parent_hash
        for h in hashes:
            if h in host:
                if run:
                    self._emit(
                        KvEventKind.BLOCK_STORED, block_hashes=run, parent_hash=run_parent, medium=KV_MEDIUM_HOST
                    )
                    run = []
            else:
                host[h] = None
                if not run:
                    run_parent = prev
                run.append(h)
            prev = h
        if run:
            self._emit(KvEventKind.BLOCK_STORED, block_hashes=run, parent_hash=run_parent, medium=KV_MEDIUM_HOST)
        self.host_touch(hashes)
        if len(host) > self.num_host_blocks:
            removed = []
            while len(host) > self.num_host_blocks:
                h, _ = host.popitem(last=False)
                removed.append(h)
            self._emit(KvEventKind.BLOCK_REMOVED, block_hashes=removed, medium=KV_MEDIUM_HOST)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash, active blocks' included, and emit ``ALL_CLEARED``.

        Active blocks keep their KV and their requests carry on; they simply cannot be shared any more and become
        empty when freed. vLLM refuses a reset while requests run; clearing everything instead keeps "what the
        router believes" and "what the pool holds" equal (both empty) at every instant.
        """
        self._empty.extend(self._evictable)
        self._evictable.clear()
        for b in self._cached.values():
            self._hash[b] = None
        self._cached.clear()
        self._emit(KvEventKind.ALL_CLEARED)
        if self.num_host_blocks:
            self._host.clear()
            self._emit(KvEventKind.ALL_CLEARED, medium=KV_MEDIUM_HOST)

    # --- events and state -------------------------------------------------------------------------------------------

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def kv_state(self) -> KvStateSnapshot:
        """Every cached hash (in the order the blocks were stored), the host tier's, and the id of the last event
        reflected in them."""
        return KvStateSnapshot(
            last_event_id=self._last_event_id,
            block_size=self.block_size,
            block_hashes=list(self._cached),
            host_block_hashes=list(self._host),
        )

    def _emit(
        self,
        kind: KvEventKind,
        *,
        block_hashes: list[int] | None = None,
        parent_hash: int | None = None,
        medium: str | None = None,
    ) -> None:
        self._last_event_id += 1
        self._events.append(
            KvEvent(
                event_id=self._last_event_id,
                kind=kind,
                block_hashes=list(block_hashes or []),
                parent_hash=parent_hash,
                num_tokens_per_block=self.block_size if kind is KvEventKind.BLOCK_STORED else 0,
                medium=medium,
            )
        )
