"""What one pull of the SLA planner saw and predicted, as numbers: ``SlaFigures``, carried on
``components.planner.controller.PullOutcome.sla`` so that TensorBoard, ``/metrics`` and ``kvmesh status`` show
predicted against observed load and latency, target against actual pool sizes and the correction factors.

Standard library only (the SLA core's rule, tests/unit/planner/sla/test_purity.py).
"""

from __future__ import annotations

import dataclasses

__all__ = ["SlaFigures"]


@dataclasses.dataclass(frozen=True, slots=True)
class SlaFigures:
    """One pull's SLA numbers. ``interval`` True: this pull ran the throughput loop, and the ``observed_*`` load and
    latency fields are the interval's (None where nothing was heard); at other pulls they are None. Latencies in
    seconds; ``*_request_rate`` in requests/s; ``*_isl``/``*_osl`` in tokens."""

    now_s: float
    interval: bool
    # The interval just ended: what the frontends reported, and what the planner had predicted for it.
    observed_request_rate: float | None = None
    predicted_request_rate: float | None = None
    observed_isl: float | None = None
    predicted_isl: float | None = None
    observed_osl: float | None = None
    predicted_osl: float | None = None
    observed_ttft_s: float | None = None
    observed_itl_s: float | None = None
    # The interval starting now, as predicted (None: no prediction, e.g. nothing heard yet).
    next_request_rate: float | None = None
    next_isl: float | None = None
    next_osl: float | None = None
    # The fast loop at this pull: the pools' mean predicted TTFT (queue wait included) and ITL from the workers' load
    # reports, corrected (None: no fresh report, or no prompt length known yet).
    predicted_ttft_s: float | None = None
    predicted_itl_s: float | None = None
    ttft_correction: float = 1.0
    itl_correction: float = 1.0
    # Pool sizes: the throughput loop's (the floor; None before its first decision), what the planner steers to, and
    # the registered workers (prefill None: an aggregated deployment).
    throughput_prefill: int | None = None
    throughput_decode: int | None = None
    target_prefill: int | None = None
    target_decode: int | None = None
    prefill: int | None = None
    decode: int = 0
    lead_intervals: int = 0

    def scalars(self) -> dict[str, float]:
        """Every field that has a number, by name (for TensorBoard and Prometheus)."""
        out: dict[str, float] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("now_s", "interval") or v is None:
                continue
            out[f.name] = float(v)
        return out
