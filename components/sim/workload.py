"""What the simulator replays: a ``Workload`` of ``SimRequest``s (token-id prompts, output lengths, arrival times,
program ids), built from a trace or a synthetic shape by ``components.sim.workloads``.

Imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload: its arrival in trace seconds (relative to the first), prompt and output length."""

    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    program_id: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    name: str
    # A tuple, or any sequence that builds its requests when read (a long replay's prompts are not all kept).
    requests: Sequence[SimRequest]

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests per trace second."""
        n = len(self.requests)
        return (n - 1) / self.span_s if n > 1 and self.span_s > 0 else math.inf

    def at_rate(self, rate: float) -> Workload:
        """The same requests, inter-arrival times scaled so that the mean rate is ``rate`` (the burst shape kept)."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        scale = self.rate / rate if math.isfinite(self.rate) else 0.0
        t0 = self.requests[0].arrival_s if self.requests else 0.0
        return Workload(
            self.name,
            tuple(dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * scale) for r in self.requests),
        )
