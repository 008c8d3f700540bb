"""Typed errors of the simulator library: a bad input (a trace file, a workload, a fleet), raised before a replay."""

from __future__ import annotations


class SimError(Exception):
    """Root of every error raised by ``components.sim``."""


class TraceFormatError(SimError, ValueError):
    """A trace file could not be read: unknown format, a missing column, a malformed row."""

    def __init__(self, path: str, reason: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason
