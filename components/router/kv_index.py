"""The KV index: which worker holds which prefix blocks, built from the workers' KV events.

Pure data structure (no I/O, no clock of its own: time comes in as ``now_s``). The adapter feeds it events from the
event plane and snapshots from the workers' ``kv_state`` endpoint; policies read ``overlaps()``.

Representation, chosen for the routing hot path (8k-token requests = 512 blocks of 16, 1M indexed blocks):
- every worker gets a bit; ``block hash -> int bitmask`` of the workers holding the block;
- per worker, ``block hash -> parent hash`` (from the chained runs of ``BLOCK_STORED``) and how many held blocks
  each held block is the parent of. From these the index keeps, exactly and in O(1) per event, how many of the
  worker's blocks are *orphans* (held while their parent is not) and how many have an *unknown* parent (loaded from
  a snapshot, which lists hashes only). A worker with neither is **prefix-closed**: holding block ``i`` of a chain
  means holding blocks ``0..i``. vLLM and the mock engine keep their caches that way (a request releases its blocks
  tail first and a prefix hit touches every ancestor, so an LRU evicts descendants before ancestors), so in a
  healthy fleet every worker is;
- ``overlaps(hashes)`` answers "how many leading blocks of this prompt does each worker hold". For prefix-closed
  workers that count is monotone along the chain, so it is found by galloping then bisecting between the depths
  where the set of holders changes: ~10 probes per distinct depth instead of one dict lookup per block (a dict of
  1M 64-bit keys misses the CPU cache on nearly every lookup, ~100 ns each). Workers that are not prefix-closed
  are walked block by block, as exactly as before. Both read ``hashes`` lazily (``kv_hashing.PromptHashes``), so a
  prompt that shares only a system prompt with the fleet is hashed only a little past it;
- ``worker -> blocks`` makes a worker's departure or a resync O(its blocks).

Event ids: each worker's events must arrive with consecutive ids. A gap (a lost NATS message, a late subscriber)
marks the worker *stale*: ``apply`` returns False, later events are buffered, and the adapter fetches a
``KvStateSnapshot`` and calls ``load_snapshot``, which replaces the worker's blocks and replays buffered events newer
than the snapshot. Until then the stale worker's old blocks still count (better than forgetting a warm cache).

Media: an engine with a host-memory tier announces that tier's blocks with the same events, ``medium`` host
(``KvEvent.is_host``), in the same sequence of event ids as its device's. A router keeps one index per medium
(``KvIndex(host=True)`` for the host tier's): each applies its own medium's events and only counts the others' ids,
so that a gap in either shows in both.

Routed blocks (``record_routed(worker, hashes, now_s, parent)``): the router predicts that the worker will hold a
request's blocks as soon as it places the request, for ``approx_ttl_s``; ``expire(now_s)`` drops predictions past
their TTL. Two uses:

- approximate mode, for engines without KV events: the predictions are the whole index (TTL ``router_ttl_s``, 120 s);
- *provisional* blocks, with KV events on: the blocks a request's worker is about to compute count as held from the
  decision on, so a request sharing the prefix that arrives before the worker's ``BLOCK_STORED`` (its prefill, the
  worker's 10 ms event batch, NATS; on any router replica, which records them from the sync message) sees the holder
  (TTL ``router_provisional_ttl_s``). A prediction is *confirmed* by the worker's ``BLOCK_STORED`` of the block (from
  then on it is an ordinary block: its TTL no longer applies), and ends with the block at a ``BLOCK_REMOVED``, an
  ``ALL_CLEARED``, a snapshot (which lists what the worker really holds) or the worker's departure. An expired
  prediction leaves the index like a removal but is counted apart (``KvIndexStats.num_routed_expired``), never as a
  block the worker removed.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from typing import Any

from components.protocol.kv_hashing import PromptHashes
from components.protocol.messages import KV_MEDIUM_HOST, KvEvent, KvEventKind, KvStateSnapshot


@dataclasses.dataclass
class _WorkerState:
    bit: int
    # hash -> parent hash (None: the first block of a sequence; _UNKNOWN: loaded from a snapshot)
    blocks: dict[int, int | None] = dataclasses.field(default_factory=dict)
    children: dict[int, int] = dataclasses.field(default_factory=dict)  # held hash -> held blocks it is parent of
    orphans: int = 0  # held blocks whose (known) parent is not held
    unknown: int = 0  # held blocks whose parent is unknown
    last_event_id: int = -1  # -1: nothing seen yet; the first event is accepted whatever its id
    stale: bool = False
    buffered: list[KvEvent] = dataclasses.field(default_factory=list)
    # Predicted blocks not confirmed by an event yet (``record_routed``): hash -> when the prediction expires.
    routed: dict[int, float] = dataclasses.field(default_factory=dict)


# The parent of a block loaded from a snapshot (``KvStateSnapshot`` lists hashes, not their chain). Never a real hash:
# hashes are non-negative.
_UNKNOWN = -1
# ``dict.pop``'s default for a block not held (``_drop_blocks``): no parent is ever this object.
_ABSENT: Any = object()

# b"0" -> 0 and b"1" -> 1: a mask's bin() digits as compress() selectors.
_BIN_DIGITS = bytes.maketrans(b"01", b"\x00\x01")
# Up to this many bits, ``_expand`` takes a mask's bits one by one (~0.2 us each) rather than through its binary
# digits (~3-4 us at 256 workers, whatever the number of bits: a 258-character string made, reversed, translated
# and walked by ``compress``).
_FEW_BITS = 16


def _have(k: int) -> None:
    """``need`` for a sequence whose hashes are all there already."""


@dataclasses.dataclass(slots=True)
class KvIndexStats:
    num_events: int = 0
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_gaps: int = 0
    num_resyncs: int = 0
    num_routed: int = 0  # blocks predicted by ``record_routed`` (not held before)
    num_routed_confirmed: int = 0  # of which the worker's BLOCK_STORED confirmed
    num_routed_expired: int = 0  # of which the TTL ended, unconfirmed
    num_routed_dropped: int = 0  # of which a removal, a clear, a snapshot or the worker's departure ended first
    # Seconds from the prediction to its confirmation, the latest ``CONFIRM_SAMPLES`` (``apply`` given ``now_s``).
    confirm_latency_s: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=CONFIRM_SAMPLES))


CONFIRM_SAMPLES = 10_000


class KvIndex:
    # A stale worker buffers at most this many events while its snapshot is fetched; beyond, the oldest go (the
    # snapshot will be newer than them anyway if the fetch succeeds).
    MAX_BUFFERED_EVENTS = 100_000
    # At most this many search hints are kept (``_search``); when full they are all dropped (~1.5 MB at ~100 bytes
    # an entry; a hint is one prefix the router has searched, e.g. a conversation in progress).
    MAX_SEARCH_HINTS = 16_384

    def __init__(self, approx_ttl_s: float = 120.0, *, host: bool = False) -> None:
        self.host = host  # which medium's events this index applies (module docstring)
        self._masks: dict[int, int] = {}
        self._workers: dict[int, _WorkerState] = {}
        self._bit_owner: dict[int, int] = {}
        self._pos_owner: list[int] = []  # bit position -> worker id (stale entries for free positions are never read)
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._closed = 0  # bits of the prefix-closed workers
        # Where the last search of prefix-closed workers saw the first of them stop: the next search probes there
        # first (``_search``). Any depth is correct; a good one saves the probes that would find it again.
        self._first_stop = 0
        # Search hints (``_search``): the hash of a prompt's block where the gallop starts -> the probes that found,
        # in the last search from that block, where each worker stops past it. Any probes are correct; these save
        # the gallop and the bisections when the next prompt with that prefix finds the same depths.
        self._hints: dict[int, tuple[int, ...]] = {}
        self.bits_version = 0  # changes whenever a worker gets or gives back its bit (``bits_of`` may differ)
        self.approx_ttl_s = approx_ttl_s
        # (expiry, worker id, hashes) of every record_routed call, oldest first; the per-worker ``routed`` maps say
        # which of those hashes are still predictions and until when.
        self._approx: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self.stats = KvIndexStats()
        self._now_s: float | None = None  # the current ``apply`` call's arrival time

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
            self._closed |= bit
            self.bits_version += 1
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
        """A worker left: its blocks (and predictions) leave with it."""
        st = self._workers.pop(worker_id, None)
        if st is None:
            return
        self._clear(st)
        del self._bit_owner[st.bit]
        self._free_bits.append(st.bit)
        self._closed &= ~st.bit
        self.bits_version += 1

    def is_prefix_closed(self, worker_id: int) -> bool:
        """Whether every block the worker holds has its whole prefix held too (see the module docstring)."""
        st = self._workers.get(worker_id)
        return st is None or not (st.orphans or st.unknown)

    def _update_closed(self, st: _WorkerState) -> None:
        if st.orphans or st.unknown:
            self._closed &= ~st.bit
        else:
            self._closed |= st.bit

    def _clear(self, st: _WorkerState) -> None:
        masks = self._masks
        keep = ~st.bit
        for h in st.blocks:
            m = masks.get(h)
            if m is None:
                continue
            m &= keep
            if m:
                masks[h] = m
            else:
                del masks[h]
        st.blocks = {}
        st.children = {}
        st.orphans = st.unknown = 0
        if st.routed:
            self.stats.num_routed_dropped += len(st.routed)
            st.routed = {}

    def _drop_blocks(self, st: _WorkerState, hashes: Iterable[int]) -> None:
        masks = self._masks
        keep = ~st.bit
        blocks = st.blocks
        children = st.children
        pop = blocks.pop
        unknown = _UNKNOWN
        absent = _ABSENT
        for h in hashes:
            p = pop(h, absent)
            if p is absent:
                continue  # not held
            m = masks.get(h, 0) & keep
            if m:
                masks[h] = m
            else:
                masks.pop(h, None)
            if p is not None:
                if p == unknown:
                    st.unknown -= 1
                else:
                    n = children[p] - 1
                    if n:
                        children[p] = n
                    else:
                        del children[p]
                    if p not in blocks:
                        st.orphans -= 1  # it was an orphan
            if children:
                c = children.get(h)
                if c:
                    st.orphans += c  # its held children lose their parent
        self._update_closed(st)

    def _store(self, st: _WorkerState, hashes: Sequence[int], parent: int | None) -> None:
        """``hashes`` are a chain: ``parent`` is the parent of ``hashes[0]``, each later one's parent the one before."""
        masks = self._masks
        bit = st.bit
        get = masks.get
        blocks = st.blocks
        children = st.children
        p = parent
        for h in hashes:
            if h not in blocks:
                masks[h] = get(h, 0) | bit
                blocks[h] = p
                if p == _UNKNOWN:
                    st.unknown += 1
                elif p is not None:
                    children[p] = children.get(p, 0) + 1
                    if p not in blocks:
                        st.orphans += 1
                if st.orphans:
                    c = children.get(h)
                    if c:
                        st.orphans -= c  # its held children were orphans until now
            if parent != _UNKNOWN:
                p = h
        self._update_closed(st)

    # -- events ----------------------------------------------------------------------------------------------------

    def apply(self, worker_id: int, events: Sequence[KvEvent], now_s: float | None = None) -> bool:
        """Apply a batch in order; returns False when a gap made the worker stale (the caller should resync).
        ``now_s`` (the caller's clock, the one ``record_routed`` was given): when the batch arrived, for the
        confirmation latency of predicted blocks (``KvIndexStats.confirm_latency_s``)."""
        st = self._worker(worker_id)
        self._now_s = now_s
        stats = self.stats
        host = self.host
        # The checks of an event inline: a worker's decode blocks come one event each, so a method call and the
        # ``is_host`` property per event were a good part of applying them.
        for ev in events:
            if st.stale:
                if len(st.buffered) >= self.MAX_BUFFERED_EVENTS:
                    del st.buffered[0]
                st.buffered.append(ev)
                continue
            eid = ev.event_id
            last = st.last_event_id
            if last >= 0 and eid != last + 1:
                if eid <= last:
                    continue  # a duplicate (redelivery after a resync): already reflected
                st.stale = True
                stats.num_gaps += 1
                st.buffered.append(ev)
                continue
            st.last_event_id = eid
            if (ev.medium == KV_MEDIUM_HOST) is not host:
                continue  # the other medium's: its id counted, its blocks not ours
            stats.num_events += 1
            kind = ev.kind
            hashes = ev.block_hashes
            if kind == KvEventKind.BLOCK_STORED:
                routed = st.routed
                if routed and not routed.keys().isdisjoint(hashes):
                    if self._confirm(st, hashes) == len(hashes):
                        # Every block was a prediction (a routed request's prefill, confirmed), so the worker holds
                        # them all already (a prediction is a held block): nothing to store, where ``_store``'s loop
                        # would look each one up in the worker's blocks to find that out.
                        stats.num_blocks_stored += len(hashes)
                        continue
                self._store(st, hashes, ev.parent_hash)
                stats.num_blocks_stored += len(hashes)
            elif kind == KvEventKind.BLOCK_REMOVED:
                if st.routed:
                    routed = st.routed
                    for h in hashes:
                        if routed.pop(h, None) is not None:
                            stats.num_routed_dropped += 1
                self._drop_blocks(st, hashes)
                stats.num_blocks_removed += len(hashes)
            elif kind == KvEventKind.ALL_CLEARED:
                self._clear(st)
                self._update_closed(st)
        return not st.stale

    def load_snapshot(self, worker_id: int, snap: KvStateSnapshot) -> None:
        """Replace the worker's blocks with a snapshot (its medium's list), then replay buffered events newer than
        it."""
        st = self._worker(worker_id)
        self._clear(st)
        self._store(st, snap.host_block_hashes if self.host else snap.block_hashes, _UNKNOWN)
        st.last_event_id = snap.last_event_id
        st.stale = False
        buffered, st.buffered = st.buffered, []
        self.stats.num_resyncs += 1
        self.apply(worker_id, [e for e in buffered if e.event_id > snap.last_event_id])

    def _confirm(self, st: _WorkerState, hashes: Sequence[int]) -> int:
        """The worker stored these blocks: predictions of them are real blocks now (their TTL no longer applies).
        Returns how many of them were predictions."""
        pop = st.routed.pop
        expiries = [t for t in map(pop, hashes, repeat(None)) if t is not None]
        if expiries:
            self.stats.num_routed_confirmed += len(expiries)
            now = self._now_s
            if now is not None:
                ttl = self.approx_ttl_s
                self.stats.confirm_latency_s.extend([now - (t - ttl) for t in expiries])
        return len(expiries)

    # -- routed blocks: approximate mode, provisional blocks --------------------------------------------------------

    def record_routed(self, worker_id: int, hashes: Sequence[int], now_s: float, parent: int | None = None) -> None:
        """Predict that ``worker_id`` holds ``hashes`` (a chain: ``parent`` is the parent of ``hashes[0]``, the
        block before them that the worker holds; None: they start the prompt) until ``now_s + approx_ttl_s``, unless
        an event confirms or removes them first (module docstring). Blocks the worker already holds for real are
        left as they are; a prediction repeated keeps the later expiry."""
        if not hashes:
            return
        st = self._worker(worker_id)
        blocks = st.blocks
        routed = st.routed
        t = now_s + self.approx_ttl_s
        if blocks.keys().isdisjoint(hashes):
            # The usual case (on_routed's blocks past what the worker holds): every hash is new, bar repeats.
            before = len(routed)
            routed.update(zip(hashes, repeat(t)))
            new = len(routed) - before
        else:
            new = 0
            for h in hashes:
                if h in routed:
                    routed[h] = t
                elif h not in blocks:
                    routed[h] = t
                    new += 1
        self.stats.num_routed += new
        self._store(st, hashes, parent)
        self._approx.append((t, worker_id, tuple(hashes)))

    def expire(self, now_s: float) -> int:
        """Drop predictions whose TTL passed (a block routed again since keeps its newer expiry; one confirmed by an
        event is not a prediction any more); returns how many blocks left."""
        dropped = 0
        approx = self._approx
        while approx and approx[0][0] <= now_s:
            _, wid, hashes = approx.popleft()
            st = self._workers.get(wid)
            if st is None or not st.routed:
                continue
            routed = st.routed
            if routed.keys().isdisjoint(hashes):
                continue  # all confirmed or gone (the usual end of a provisional record): a C loop over them
            gone = [h for h in hashes if routed.get(h, math.inf) <= now_s]
            for h in gone:
                routed.pop(h, None)
            if gone:
                self._drop_blocks(st, gone)
                dropped += len(gone)
        self.stats.num_routed_expired += dropped
        return dropped

    def none_routed(self, worker_id: int, hashes: Iterable[int]) -> bool:
        """Whether none of ``hashes`` is a prediction for the worker (those it holds, it holds for real: a copy's
        source must, where a router's provisional holder need only be about to)."""
        st = self._workers.get(worker_id)
        return st is None or not st.routed or st.routed.keys().isdisjoint(hashes)

    def is_routed(self, worker_id: int, block_hash: int) -> bool:
        """Whether the worker's ``block_hash`` is a prediction still (not confirmed by an event)."""
        st = self._workers.get(worker_id)
        return st is not None and block_hash in st.routed

    # -- queries ---------------------------------------------------------------------------------------------------

    def overlaps(self, hashes: Sequence[int]) -> dict[int, int]:
        """Leading blocks of ``hashes`` each worker holds; workers holding none are absent.

        ``hashes`` may be a lazy ``PromptHashes``: only the blocks the search reads are hashed."""
        return self.overlaps_with_floor(hashes, 0)[0]

    def overlaps_with_floor(self, hashes: Sequence[int], group: int) -> tuple[dict[int, int], int]:
        """``overlaps(hashes)`` for a group of workers (``group``: their bits, ``bits_of``) that may all hold a
        common prefix: returns ``(overlaps, floor)`` where every worker of the group holds at least ``floor``
        leading blocks and the group's workers holding exactly ``floor`` are left out of ``overlaps``.

        A system prompt every worker caches would otherwise put every worker in the answer (256 entries to build,
        then to look up per candidate) although it cannot tell them apart; with the floor, only the workers that
        hold more are listed. ``group`` 0, or a group where some worker lacks block 0: floor 0, the plain answer.
        """
        n = len(hashes)
        result: dict[int, int] = {}
        if not n:
            return result, 0
        need: Callable[[int], object]
        if isinstance(hashes, PromptHashes):
            need = hashes.ensure
            hs: Sequence[int] = hashes.ensure(1)
            max_step = PromptHashes.MIN_CHUNK_BLOCKS
        else:
            need = _have
            hs = hashes
            max_step = n
        first = self._masks.get(hs[0], 0)
        if not first:
            return result, 0
        groups: list[tuple[int, int]] = []  # (workers, the leading blocks they hold)
        closed = first & self._closed
        if closed:
            self._search(hs, need, n, closed, groups, max_step)
        if closed != first:
            self._walk(hs, need, n, first & ~closed, groups)
        floor = 0
        if group and first & group == group:
            floor = min(d for m, d in groups if m & group)
        expand = self._expand
        for m, d in groups:
            if d == floor:
                m &= ~group
                if not m:
                    continue
            expand(m, d, result)
        return result, floor

    def bits_of(self, worker_ids: Iterable[int]) -> int:
        """The bits of these workers (for ``overlaps_with_floor``); 0 if one of them has none yet (no event)."""
        workers = self._workers
        mask = 0
        for w in worker_ids:
            st = workers.get(w)
            if st is None:
                return 0
            mask |= st.bit
        return mask

    def _search(
        self,
        hs: Sequence[int],
        need: Callable[[int], object],
        n: int,
        active: int,
        groups: list[tuple[int, int]],
        max_step: int,
    ) -> None:
        """Prefix-closed workers holding block 0 (``active``): gallop (blocks 1, 3, 7, 15, ...) to bracket the depths
        where holders drop out, then bisect each bracket. The holders of block ``i``, among these workers, shrink as
        ``i`` grows, so a bracket whose ends have the same holders has no drop-out inside, wherever its ends are: any
        sequence of probes finds the same depths, and the choice of probes only decides how many dict lookups that
        takes (in a 1M-entry dict nearly every one misses the CPU caches: ~0.3-0.8 us each on the dev VM, the cost of
        the whole search). ``need(k)`` makes the first ``k`` hashes readable in ``hs`` (a lazy prompt computes them).

        The step stops doubling at ``max_step``: reading block ``hi`` of a lazy prompt hashes every block up to it,
        so a free-running gallop past a worker holding 300 blocks would hash to block 511; with steps of at most 64
        (``PromptHashes.MIN_CHUNK_BLOCKS``, 1, 3, ..., 63, 127, 191, 255, 319) it hashes to 319. The probes this
        adds, one dict lookup per 64 blocks (~0.1-0.2 us), cost under 2% of hashing those blocks (~64 x 0.2 us).

        Before galloping, the depth where the last search saw its first worker stop (``_first_stop``: a system
        prompt every worker caches, typically) is probed, just before and at it: where the prefix is the same as
        last time that brackets the drop-out in two probes instead of ~10 (gallop to 63, bisect down to 32). Only
        within the first ``max_step`` blocks, so it hashes nothing the gallop would not.

        Past the first stop, the probes the last search from the same block made (``_hints``: keyed by the hash of
        the block where this search's first group stops, e.g. a conversation's first block past the system prompt)
        come first: block ``d - 1`` and ``d`` for every depth ``d`` it found. A conversation's next turns search the
        same prefix, so each stop is confirmed with two probes instead of found by the gallop (a probe per 64
        blocks) and a bisection (~6 probes per worker): on ``kvmesh bench router``'s requests ~12 probes a decision
        instead of ~25. A hinted probe is taken only where the hashes are at hand or the gallop's next probe would
        read that far (else the probe goes as far as those allow), so a stale hint hashes nothing the gallop would
        not; the answer is the same for any probes (above)."""
        get = self._masks.get
        split = self._split
        lo, m_lo = 0, active
        first = self._first_stop
        start = len(groups)
        # The two probes at the last first stop, taken first (-1: none left).
        p0, p1 = (first - 1, first) if 1 < first < min(n, max_step) else (-1, -1)
        hint_key = -1  # the hash of the block where this search's first group stops (-1: none found yet)
        hints: tuple[int, ...] = ()  # what the last search from that block probed to find the stops past it
        nh = 0  # len(hints)
        j = 0  # the next of ``hints`` to consider
        h = 0
        have = len(hs)  # hashes readable in ``hs`` (it grows in place, only at ``need``: kept, not asked per probe)
        while m_lo:
            if lo + 1 < max_step:
                hi = (1 << (lo + 1).bit_length()) - 1  # the gallop: 1, 3, 7, ..., the first 2**k - 1 past lo
            else:
                hi = lo + max_step - (lo + 1) % max_step  # then the next max_step - 1 + j * max_step
            if p0 >= 0:
                hi, p0, p1 = p0, p1, -1
            elif j < nh:
                while j < nh and hints[j] <= lo:
                    j += 1
                if j < nh:
                    p = hints[j]
                    if p <= hi or p < have:
                        hi = p  # a hinted probe, reading no further than the gallop's next probe or the hashes at hand
                    elif have - 1 > hi:
                        hi = have - 1  # towards it, as far as the hashes at hand go
            if hi >= n:
                hi, m_hi = n, 0  # past the end: nobody holds block n
                if n > have:
                    need(n)
                    have = len(hs)
            else:
                if hi >= have:  # (most probes find their hash there already)
                    need(hi + 1)
                    have = len(hs)
                h = hs[hi]
                m_hi = get(h, 0) & m_lo
            if m_hi != m_lo:
                split(hs, lo, m_lo, hi, m_hi, groups)
                if hint_key < 0 and m_hi:
                    stop = groups[start][1]
                    hint_key = h if stop == hi else hs[stop]
                    hints = self._hints.get(hint_key, ())
                    nh = len(hints)
            lo, m_lo = hi, m_hi
        if len(groups) > start:
            self._first_stop = groups[start][1]  # the least: groups are appended in ascending depth (``_split``)
        if hint_key >= 0:
            found = tuple(p for _, d in groups[start + 1 :] for p in (d - 1, d))
            if found != hints:
                if len(self._hints) >= self.MAX_SEARCH_HINTS:
                    self._hints.clear()
                self._hints[hint_key] = found

    def _split(self, hs: Sequence[int], lo: int, m_lo: int, hi: int, m_hi: int, groups: list[tuple[int, int]]) -> None:
        """Workers in ``m_lo`` but not ``m_hi`` hold block ``lo`` but not block ``hi`` (``hs`` is readable up to
        ``hi - 1``): find where each stops.

        Where one worker stops in the bracket (the usual case past a common prefix), it is bisected in that worker's
        own ``blocks`` (a few thousand entries, ~3x faster to probe than the index's 1M-entry masks, and the same
        answer: a worker's blocks are exactly the hashes whose mask has its bit)."""
        get = self._masks.get
        while hi - lo > 1:
            stops = m_lo & ~m_hi
            if not stops & (stops - 1):
                blocks = self._workers[self._pos_owner[stops.bit_length() - 1]].blocks
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if hs[mid] in blocks:
                        lo = mid
                    else:
                        hi = mid
                break
            mid = (lo + hi) >> 1
            m_mid = get(hs[mid], 0) & m_lo
            if m_mid == m_lo:
                lo = mid  # nobody stops in [lo, mid)
            elif m_mid == m_hi:
                hi = mid  # everybody who stops does so in [lo, mid)
            else:
                self._split(hs, lo, m_lo, mid, m_mid, groups)
                lo, m_lo = mid, m_mid
        groups.append((m_lo & ~m_hi, hi))

    def _walk(
        self, hs: Sequence[int], need: Callable[[int], object], n: int, active: int, groups: list[tuple[int, int]]
    ) -> None:
        """Workers holding block 0 (``active``) that may have holes: one lookup per block while any of them remains."""
        masks = self._masks
        i = 1
        while i < n:
            if i >= len(hs):
                need(i + 1)
            nxt = active & masks.get(hs[i], 0)
            if nxt != active:
                groups.append((active & ~nxt, i))
                active = nxt
                if not active:
                    return
            i += 1
        groups.append((active, n))

    def _expand(self, mask: int, depth: int, result: dict[int, int]) -> None:
        """``result[worker] = depth`` for every worker whose bit is set in ``mask``."""
        pos_owner = self._pos_owner
        if not mask & (mask - 1):  # one bit: the usual case deep in a prompt
            result[pos_owner[mask.bit_length() - 1]] = depth
            return
        if mask.bit_count() <= _FEW_BITS:  # a few workers stopping together (replicas of a conversation): bit by bit
            while mask:
                low = mask & -mask
                result[pos_owner[low.bit_length() - 1]] = depth
                mask ^= low
            return
        # The mask's binary digits, lowest first, as 0/1 bytes select the owners in C: ~4 us for the 256 workers
        # that drop out together at the end of a system prompt, against ~15 us expanding byte by byte in Python.
        result.update(zip(compress(pos_owner, bin(mask)[:1:-1].encode().translate(_BIN_DIGITS)), repeat(depth)))
