"""The KV index: which worker holds which prefix blocks, built from the workers' KV events.

Pure data structure (no I/O, no clock of its own: time comes in as ``now_s``). The adapter feeds it events from the
event plane and snapshots from the workers' ``kv_state`` endpoint; policies read ``overlaps()``.

Representation, chosen for the routing hot path (8k-token requests = 512 blocks of 16, 1M indexed blocks):
- every worker gets a bit; ``block hash -> int bitmask`` of the workers holding the block;
- ``overlaps(hashes)`` walks the request's chained hashes once, AND-ing masks: the number of leading blocks a worker
  holds is the position where its bit drops out. Because hashes are chained (a block's hash covers its whole prefix),
  "worker holds block i" implies it held the prefix when the event was emitted, so the walk stops at the first block
  nobody holds;
- ``worker -> set of hashes`` makes a worker's departure or a resync O(its blocks).

Event ids: each worker's events must arrive with consecutive ids. A gap (a lost NATS message, a late subscriber)
marks the worker *stale*: ``apply`` returns False, later events are buffered, and the adapter fetches a
``KvStateSnapshot`` and calls ``load_snapshot``, which replaces the worker's blocks and replays buffered events newer
than the snapshot. Until then the stale worker's old blocks still count (better than forgetting a warm cache).

Approximate mode, for engines without KV events: ``record_routed(worker, hashes, now_s)`` predicts that the worker
now holds the request's blocks, for ``approx_ttl_s``; ``expire(now_s)`` drops predictions past their TTL.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence

from components.workers.engines.base import KvEvent, KvEventKind, KvStateSnapshot


@dataclasses.dataclass
class _WorkerState:
    bit: int
    blocks: set[int] = dataclasses.field(default_factory=set)
    last_event_id: int = -1  # -1: nothing seen yet; the first event is accepted whatever its id
    stale: bool = False
    buffered: list[KvEvent] = dataclasses.field(default_factory=list)


# Bit positions set in each byte value: expanding a mask of 256 workers that drop out together (the end of a system
# prompt every worker caches) byte by byte costs ~15 us, against ~75 us peeling one bit at a time off a 256-bit int.
_BYTE_BITS = tuple(tuple(p for p in range(8) if b >> p & 1) for b in range(256))


@dataclasses.dataclass(slots=True)
class KvIndexStats:
    num_events: int = 0
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_gaps: int = 0
    num_resyncs: int = 0


class KvIndex:
    # A stale worker buffers at most this many events while its snapshot is fetched; beyond, the oldest go (the
    # snapshot will be newer than them anyway if the fetch succeeds).
    MAX_BUFFERED_EVENTS = 100_000

    def __init__(self, approx_ttl_s: float = 120.0) -> None:
        self._masks: dict[int, int] = {}
        self._workers: dict[int, _WorkerState] = {}
        self._bit_owner: dict[int, int] = {}
        self._pos_owner: list[int] = []  # bit position -> worker id (stale entries for free positions are never read)
        self._free_bits: list[int] = []
        self._next_bit = 0
        self.approx_ttl_s = approx_ttl_s
        self._approx: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self._approx_expiry: dict[tuple[int, int], float] = {}
        self.stats = KvIndexStats()

    # -- workers ---------------------------------------------------------------------------------------------------

    def _worker(self, worker_id: int) -> _WorkerState:
        st = self._workers.get(worker_id)
        if st is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = 1 << self._next_bit
                self._next_bit += 1
            st = _WorkerState(bit=bit)
            self._workers[worker_id] = st
            self._bit_owner[bit] = worker_id
            pos = bit.bit_length() - 1
            if pos == len(self._pos_owner):
                self._pos_owner.append(worker_id)
            else:
                self._pos_owner[pos] = worker_id
        return st

    @property
    def worker_ids(self) -> list[int]:
        return list(self._workers)

    def num_blocks(self, worker_id: int | None = None) -> int:
        if worker_id is None:
            return len(self._masks)
        st = self._workers.get(worker_id)
        return len(st.blocks) if st else 0

    def is_stale(self, worker_id: int) -> bool:
        st = self._workers.get(worker_id)
        return bool(st and st.stale)

    def mark_stale(self, worker_id: int) -> None:
        """Buffer the worker's events from now on until ``load_snapshot``: a resync the caller starts on its own (a
        worker it has just discovered, whose earlier events it never saw), so events that race the snapshot are
        replayed after it rather than wiped by it."""
        self._worker(worker_id).stale = True

    def remove_worker(self, worker_id: int) -> None:
        """A worker left: its blocks leave with it."""
        st = self._workers.pop(worker_id, None)
        if st is None:
            return
        self._drop_blocks(st, st.blocks)
        del self._bit_owner[st.bit]
        self._free_bits.append(st.bit)

    def _drop_blocks(self, st: _WorkerState, hashes: Iterable[int]) -> None:
        masks = self._masks
        keep = ~st.bit
        dropping = list(hashes)
        for h in dropping:
            m = masks.get(h)
            if m is None:
                continue
            m &= keep
            if m:
                masks[h] = m
            else:
                del masks[h]
        st.blocks.difference_update(dropping)

    def _store(self, st: _WorkerState, hashes: Sequence[int]) -> None:
        masks = self._masks
        bit = st.bit
        get = masks.get
        for h in hashes:
            masks[h] = get(h, 0) | bit
        st.blocks.update(hashes)

    # -- events ----------------------------------------------------------------------------------------------------

    def apply(self, worker_id: int, events: Sequence[KvEvent]) -> bool:
        """Apply a batch in order; returns False when a gap made the worker stale (the caller should resync)."""
        st = self._worker(worker_id)
        for ev in events:
            if st.stale:
                if len(st.buffered) >= self.MAX_BUFFERED_EVENTS:
                    del st.buffered[0]
                st.buffered.append(ev)
                continue
            if st.last_event_id >= 0 and ev.event_id != st.last_event_id + 1:
                if ev.event_id <= st.last_event_id:
                    continue  # a duplicate (redelivery after a resync): already reflected
                st.stale = True
                self.stats.num_gaps += 1
                st.buffered.append(ev)
                continue
            self._apply_one(st, ev)
        return not st.stale

    def _apply_one(self, st: _WorkerState, ev: KvEvent) -> None:
        self.stats.num_events += 1
        st.last_event_id = ev.event_id
        if ev.kind == KvEventKind.BLOCK_STORED:
            self._store(st, ev.block_hashes)
            self.stats.num_blocks_stored += len(ev.block_hashes)
        elif ev.kind == KvEventKind.BLOCK_REMOVED:
            self._drop_blocks(st, ev.block_hashes)
            self.stats.num_blocks_removed += len(ev.block_hashes)
        elif ev.kind == KvEventKind.ALL_CLEARED:
            self._drop_blocks(st, st.blocks)

    def load_snapshot(self, worker_id: int, snap: KvStateSnapshot) -> None:
        """Replace the worker's blocks with a snapshot, then replay buffered events newer than it."""
        st = self._worker(worker_id)
        self._drop_blocks(st, st.blocks)
        self._store(st, snap.block_hashes)
        st.last_event_id = snap.last_event_id
        st.stale = False
        buffered, st.buffered = st.buffered, []
        self.stats.num_resyncs += 1
        self.apply(worker_id, [e for e in buffered if e.event_id > snap.last_event_id])

    # -- approximate mode ------------------------------------------------------------------------------------------

    def record_routed(self, worker_id: int, hashes: Sequence[int], now_s: float) -> None:
        """Predict that ``worker_id`` now caches ``hashes`` (engines without KV events)."""
        st = self._worker(worker_id)
        self._store(st, hashes)
        t = now_s + self.approx_ttl_s
        for h in hashes:
            self._approx_expiry[(worker_id, h)] = t
        self._approx.append((t, worker_id, tuple(hashes)))

    def expire(self, now_s: float) -> int:
        """Drop predictions whose TTL passed (a block routed again since keeps its newer expiry)."""
        dropped = 0
        while self._approx and self._approx[0][0] <= now_s:
            _, wid, hashes = self._approx.popleft()
            st = self._workers.get(wid)
            gone = [h for h in hashes if self._approx_expiry.get((wid, h), 0.0) <= now_s]
            for h in gone:
                self._approx_expiry.pop((wid, h), None)
            if st is not None and gone:
                self._drop_blocks(st, gone)
                dropped += len(gone)
        return dropped

    # -- queries ---------------------------------------------------------------------------------------------------

    def overlaps(self, hashes: Sequence[int]) -> dict[int, int]:
        """Leading blocks of ``hashes`` each worker holds; workers holding none are absent."""
        masks = self._masks
        result: dict[int, int] = {}
        if not hashes:
            return result
        active = masks.get(hashes[0], 0)
        if not active:
            return result
        expand = self._expand
        i = 1
        n = len(hashes)
        while i < n:
            nxt = active & masks.get(hashes[i], 0)
            if nxt != active:
                expand(active & ~nxt, i, result)
                active = nxt
                if not active:
                    return result
            i += 1
        expand(active, n, result)
        return result

    def _expand(self, mask: int, depth: int, result: dict[int, int]) -> None:
        """``result[worker] = depth`` for every worker whose bit is set in ``mask``."""
        pos_owner = self._pos_owner
        if not mask & (mask - 1):  # one bit: the usual case deep in a prompt
            result[pos_owner[mask.bit_length() - 1]] = depth
            return
        for i, byte in enumerate(mask.to_bytes((mask.bit_length() + 7) >> 3, "little")):
            if byte:
                base = i << 3
                for p in _BYTE_BITS[byte]:
                    result[pos_owner[base + p]] = depth
