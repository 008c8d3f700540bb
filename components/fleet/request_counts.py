"""``RequestCounts``: what one producer of request reports (a frontend process, the simulator's frontend) counts of
one model's requests between two ``RequestStatsReport``s, in place, and the report it makes of them. The meaning of
each count is ``RequestStatsReport``'s (components/protocol/messages.py); the frontend (components/frontend/
request_stats.py) and the simulator (components/sim/replay.py) count with this one class, so a simulated planner
reads what a live one would.

Imports: the standard library and ``components.protocol``.
"""

from __future__ import annotations

from collections.abc import Sequence

from components.protocol.messages import PrefixCount, RequestStatsReport


class _Prefix:
    __slots__ = ("block_hashes", "requests")

    def __init__(self, block_hashes: tuple[int, ...]) -> None:
        self.block_hashes = block_hashes
        self.requests = 1


class RequestCounts:
    """One model's requests since its last report: the counts of ``RequestStatsReport`` (each field's meaning is
    there), plus ``inflight`` (requests arrived and not ended, across intervals). Mutated in place; not
    thread-safe. Per token, a producer adds to the latency fields itself (``add_tokens`` says how), so that its hot
    path pays a few float operations and no call."""

    __slots__ = (
        "failed",
        "finished",
        "inflight",
        "itl_count",
        "itl_max_s",
        "itl_sum_s",
        "output_tokens",
        "prefixes",
        "prompt_tokens",
        "requests",
        "ttft_count",
        "ttft_max_s",
        "ttft_sum_s",
    )

    def __init__(self) -> None:
        self.inflight = 0
        self.prefixes: dict[int, _Prefix] = {}  # by first block hash: ``carried``, for the report's prefixes
        self.reset()

    def reset(self) -> None:
        self.prefixes = {}
        self.requests = 0
        self.prompt_tokens = 0
        self.finished = 0
        self.failed = 0
        self.output_tokens = 0
        self.ttft_count = 0
        self.ttft_sum_s = 0.0
        self.ttft_max_s = 0.0
        self.itl_count = 0
        self.itl_sum_s = 0.0
        self.itl_max_s = 0.0

    def arrived(self, prompt_tokens: int) -> None:
        """A request handed to the router."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.inflight += 1

    def carried(self, block_hashes: Sequence[int]) -> None:
        """A request that ``arrived`` carries these chained block hashes (its prompt's full blocks, from the start):
        counted under its first block, whose chain shortens to the run every such request of the interval shared."""
        if not block_hashes:
            return
        entry = self.prefixes.get(block_hashes[0])
        if entry is None:
            self.prefixes[block_hashes[0]] = _Prefix(tuple(block_hashes))
            return
        known = entry.block_hashes
        n = 0
        for a, b in zip(known, block_hashes, strict=False):
            if a != b:
                break
            n += 1
        if n < len(known):
            entry.block_hashes = known[:n]
        entry.requests += 1

    def top_prefixes(self, max_prefixes: int) -> tuple[PrefixCount, ...]:
        """The ``max_prefixes`` prefixes most requests carried (ties: lowest first hash)."""
        if max_prefixes <= 0 or not self.prefixes:
            return ()
        ranked = sorted(self.prefixes.items(), key=lambda kv: (-kv[1].requests, kv[0]))
        return tuple(PrefixCount(v.block_hashes, v.requests) for _, v in ranked[:max_prefixes])

    def ended(self, output_tokens: int, failed: bool) -> None:
        """A request that ``arrived`` ended, after generating ``output_tokens`` (once per request)."""
        self.finished += 1
        self.output_tokens += output_tokens
        if failed:
            self.failed += 1
        self.inflight -= 1

    def add_tokens(self, n: int, now_s: float, arrival_s: float, last_token_s: float) -> None:
        """``n`` tokens of one request sent together at ``now_s``: the first of the request (``last_token_s`` < 0)
        adds its TTFT from ``arrival_s``; each token after the first adds a gap, the chunk's first token the wait
        since ``last_token_s`` and the others none (they leave together), so a request's gaps sum to its last
        token's time less its first's. The reference for the inlined copies (frontend, simulator)."""
        if last_token_s < 0:
            gap = now_s - arrival_s
            self.ttft_count += 1
            self.ttft_sum_s += gap
            if gap > self.ttft_max_s:
                self.ttft_max_s = gap
            self.itl_count += n - 1
        else:
            gap = now_s - last_token_s
            self.itl_count += n
            self.itl_sum_s += gap
            if gap > self.itl_max_s:
                self.itl_max_s = gap

    def report(self, model: str, interval_s: float, max_prefixes: int = 0) -> RequestStatsReport:
        """The interval's report, with its ``max_prefixes`` most carried prefixes (``carried``; 0: none)."""
        return RequestStatsReport(
            model=model,
            interval_s=interval_s,
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            finished=self.finished,
            failed=self.failed,
            output_tokens=self.output_tokens,
            ttft_count=self.ttft_count,
            ttft_sum_s=self.ttft_sum_s,
            ttft_max_s=self.ttft_max_s,
            itl_count=self.itl_count,
            itl_sum_s=self.itl_sum_s,
            itl_max_s=self.itl_max_s,
            prefixes=self.top_prefixes(max_prefixes),
        )
