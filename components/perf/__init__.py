"""The engine performance model, once (STYLE.md: rank 1, just above ``protocol``; standard library only).

- ``model``: the analytic step-time model of the simulated engine (prefill chunks, decode, mixed steps, the token
  budget, KV transfer and host-tier load times) and its default coefficients with their sources;
- ``profile``: a measured profile (prefill time by prompt length, decode step time by batch size and KV tokens),
  interpolated, serialisable to JSON with its fit error, and the least-squares fit of the analytic model to it;
- ``PerfModel``: what both answer, so planners and simulators predict with either.
"""

from __future__ import annotations

from .errors import PerfError, ProfileFormatError
from .model import DEFAULT_MODEL, STEP_TIME_FIELDS, StepTimeModel, transfer_time_s
from .profile import PerfModel, Point, Profile

__all__ = [
    "DEFAULT_MODEL",
    "STEP_TIME_FIELDS",
    "PerfError",
    "PerfModel",
    "Point",
    "Profile",
    "ProfileFormatError",
    "StepTimeModel",
    "transfer_time_s",
]
