"""Typed errors of the load generator: a bad configuration or input file, raised before any request is sent.

Errors of single requests are never raised: they are counted by kind in the result (``stats.ErrorKind``), because
a benchmark keeps going.
"""

from __future__ import annotations

# A trace file that cannot be read: raised by the trace readers, which the simulator library owns
# (components.sim.traces).
from components.sim.errors import TraceFormatError

__all__ = ["LoadgenError", "RemoteTargetError", "TraceFormatError"]


class LoadgenError(Exception):
    """Root of every error raised by ``components.cli.bench.loadgen``."""


class RemoteTargetError(LoadgenError):
    """The target URL's host is not a loopback address and remote targets were not allowed."""

    def __init__(self, url: str, host: str) -> None:
        super().__init__(
            f"refusing to send load to {url}: host {host!r} is not a loopback address "
            "(127.0.0.0/8, ::1 or 'localhost'); pass --allow-remote (allow_remote=True) to load a remote endpoint"
        )
        self.url = url
        self.host = host
