"""What the load generator measures: per-request results, their aggregation, percentiles, and CPU time from /proc.

Pure computation except ``read_cpu_ticks`` (reads /proc) and nothing asynchronous.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class ErrorKind(StrEnum):
    """How a request failed; an HTTP status is reported as ``http_<code>`` next to these."""

    TIMEOUT = "timeout"  # no end of stream within request_timeout_s
    CONNECTION = "connection"  # could not connect, or the connection was lost
    STREAM_ERROR = "stream_error"  # the server sent an error event inside a 200 stream
    PROTOCOL = "protocol"  # unparsable SSE data, or a stream that ended without [DONE]


def http_error_kind(status: int) -> str:
    return f"http_{status}"


@dataclass(slots=True)
class RequestResult:
    """One finished request: ``error`` is None when it completed, else its kind (``ErrorKind`` or ``http_<code>``)."""

    index: int
    error: str | None = None
    error_message: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one per token-bearing chunk after the first, per token
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the server's prefix cache (usage.prompt_tokens_details)
    usage_reported: bool = False


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) of already sorted values, interpolating linearly between the closest ranks
    (numpy's default 'linear' method); None for no values."""
    if not sorted_values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must lie in [0, 100], got {p}")
    rank = (len(sorted_values) - 1) * p / 100
    lo = int(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean in milliseconds of values in seconds (None when there are none)."""
    v = sorted(values_s)
    out: dict[str, float | None] = {f"p{p}": _ms(percentile(v, p)) for p in (50, 90, 99)}
    out["mean"] = _ms(sum(v) / len(v)) if v else None
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


@dataclass
class Aggregate:
    """Results folded as they arrive, so a long run keeps O(samples) floats, not every result object."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    usage_missing: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)

    def add(self, r: RequestResult) -> None:
        if r.error is not None:
            kind = str(r.error)  # a plain str key, so that JSON shows "timeout", not an enum
            self.failed += 1
            self.errors[kind] += 1
            self.error_examples.setdefault(kind, r.error_message[:300])
            return
        self.completed += 1
        self.output_tokens += r.output_tokens
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.usage_missing += not r.usage_reported
        if r.ttft_s is not None:
            self.ttft_s.append(r.ttft_s)
        if r.e2e_s is not None:
            self.e2e_s.append(r.e2e_s)
        self.itl_s.extend(r.itl_s)


# --- CPU time ---------------------------------------------------------------------------------------------------------

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int, proc: Path) -> list[str]:
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def _children_map(proc: Path) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(d.name), proc)[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(d.name))
    return children


def read_cpu_ticks(pid: int, include_children: bool = False, proc: Path = Path("/proc")) -> int | None:
    """utime + stime of ``pid`` in clock ticks; None when it does not exist.

    With ``include_children``: the same summed over the process and its live descendants, each adding its reaped
    children's time (cutime + cstime). A descendant that exits between two readings is counted while alive and, once
    its parent reaps it, through the parent's cutime, so a difference of two readings stays right; one re-parented to
    init (a double fork) is lost.
    """
    try:
        f = _stat_fields(pid, proc)
    except (OSError, IndexError):
        return None
    # After the name: state=0 ppid=1 ... utime=11 stime=12 cutime=13 cstime=14 (proc(5) fields 14-17).
    if not include_children:
        return int(f[11]) + int(f[12])
    total = 0
    children = _children_map(proc)
    todo = [pid]
    seen: set[int] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            g = f if p == pid else _stat_fields(p, proc)
        except (OSError, IndexError):
            continue
        total += int(g[11]) + int(g[12]) + int(g[13]) + int(g[14])
        todo += children.get(p, [])
    return total


class CpuMeter:
    """CPU milliseconds spent by given processes, and by this one, between ``start()`` and ``stop()``."""

    def __init__(self, pids: Sequence[int], include_children: bool = False) -> None:
        self.pids = list(pids)
        self.include_children = include_children
        self._start: dict[int, int | None] = {}
        self._own_start = 0.0

    def start(self) -> None:
        self._start = {p: read_cpu_ticks(p, self.include_children) for p in self.pids}
        self._own_start = time.process_time()

    def stop(self) -> tuple[dict[int, float | None], float]:
        """(cpu ms per pid — None if it did not exist at start or end —, this process's cpu ms)."""
        own_ms = 1000 * (time.process_time() - self._own_start)
        out: dict[int, float | None] = {}
        for p in self.pids:
            end, begin = read_cpu_ticks(p, self.include_children), self._start.get(p)
            out[p] = None if end is None or begin is None else 1000 * (end - begin) / _TICKS_PER_S
        return out, own_ms
