"""Which prefixes requests carry, and how often: ``PrefixRates``, the input side of hot-prefix replication's policy
(replication.py) for whoever sees the routed requests' block hashes (a router's adapter, the simulator).

A prefix is keyed by its first block's chained hash; its blocks are the longest run of hashes every request with
that first block shared (the first request's, shortened by each later one). On the documents shape a request is a
document plus a question, so two requests on one document leave the document's full blocks: the block where the
question starts differs. Its rate is the requests seen in the last ``window_s`` over ``window_s``.

Pure: time is an argument (STYLE.md habit 2); the standard library and this package only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from components.rescheduler.policies.replication import PrefixLoad


class PrefixRates:
    def __init__(self, window_s: float = 30.0, max_blocks: int = 4096) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.max_blocks = max_blocks
        self._blocks: dict[int, tuple[int, ...]] = {}
        self._seen: dict[int, collections.deque[float]] = {}

    def observe(self, block_hashes: Sequence[int], now_s: float, count: int = 1) -> None:
        """``count`` requests with these chained block hashes arrived at ``now_s`` (a frontend's report of them)."""
        if not block_hashes or count <= 0:
            return
        key = block_hashes[0]
        known = self._blocks.get(key)
        if known is None:
            self._blocks[key] = tuple(block_hashes[: self.max_blocks])
            self._seen[key] = collections.deque()
        else:
            n = 0
            for a, b in zip(known, block_hashes, strict=False):
                if a != b:
                    break
                n += 1
            if n < len(known):
                self._blocks[key] = known[:n]
        self._seen[key].extend([now_s] * count)

    def _expire(self, now_s: float) -> None:
        for key in list(self._seen):
            seen = self._seen[key]
            while seen and seen[0] <= now_s - self.window_s:
                seen.popleft()
            if not seen:
                del self._seen[key], self._blocks[key]

    def block_hashes(self, prefix_hash: int) -> tuple[int, ...]:
        """The chained hashes of the prefix whose last block hash is ``prefix_hash`` (empty when unknown)."""
        for blocks in self._blocks.values():
            if blocks and blocks[-1] == prefix_hash:
                return blocks
        return ()

    def loads(self, now_s: float, holders_of: Callable[[Sequence[int]], Sequence[int]]) -> list[PrefixLoad]:
        """Every prefix seen in the window, with its rate and its holders (``holders_of(hashes)``: the workers
        holding all of them, e.g. from a KV index's overlaps), by first-block hash."""
        self._expire(now_s)
        out = []
        for key in sorted(self._blocks):
            blocks = self._blocks[key]
            rate = len(self._seen[key]) / self.window_s
            out.append(PrefixLoad(blocks[-1], len(blocks), tuple(sorted(holders_of(blocks))), rate))
        return out
