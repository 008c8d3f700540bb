"""The perf package's errors: one root, carrying what went wrong where."""

from __future__ import annotations

__all__ = ["PerfError", "ProfileFormatError"]


class PerfError(Exception):
    """Root of the errors ``components.perf`` raises."""


class ProfileFormatError(PerfError, ValueError):
    """A profile's JSON is not one: ``where`` names the field (``decode.median_ms[1][2]``), the message says why."""

    def __init__(self, where: str, why: str, source: str = "") -> None:
        self.where = where
        self.why = why
        self.source = source
        at = f"{source}: " if source else ""
        super().__init__(f"{at}bad profile field {where!r}: {why}")
