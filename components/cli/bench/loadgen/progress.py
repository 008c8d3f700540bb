"""A progress bar on stderr: tqdm when it is installed, else one line redrawn at most 5 times a second; nothing at all
when disabled or when the stream is not a terminal (CI logs and pipes stay clean)."""

from __future__ import annotations

import time
from typing import IO, Any, Protocol


class Progress(Protocol):
    def update(self, failed: bool) -> None: ...
    def close(self) -> None: ...


class NoProgress:
    def update(self, failed: bool) -> None:
        pass

    def close(self) -> None:
        pass


class LineProgress:
    """``load  120/1000 req  38.2 req/s  failed 3``, redrawn in place with a carriage return."""

    def __init__(self, total: int | None, stream: IO[str], min_interval_s: float = 0.2) -> None:
        self.total = total
        self.stream = stream
        self.min_interval_s = min_interval_s
        self.done = 0
        self.failed = 0
        self._t0 = time.monotonic()
        self._last = 0.0

    def update(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        now = time.monotonic()
        if now - self._last >= self.min_interval_s or self.done == self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        total = f"/{self.total}" if self.total else ""
        rate = self.done / max(now - self._t0, 1e-9)
        self.stream.write(f"\rload {self.done:>6}{total} req  {rate:8.1f} req/s  failed {self.failed}")
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()


class TqdmProgress:
    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.failed = 0

    def update(self, failed: bool) -> None:
        if failed:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def make_progress(enabled: bool, total: int | None, stream: IO[str]) -> Progress:
    if not enabled or not stream.isatty():
        return NoProgress()
    try:
        from tqdm import tqdm  # optional: not a dependency of kvmesh
    except ImportError:
        return LineProgress(total, stream)
    return TqdmProgress(tqdm(total=total, file=stream, unit="req", desc="load", dynamic_ncols=True))
