"""Correction factors: how far the perf model's latency is from what the fleet measures, so the replica formulas
(``replicas``) size pools on the engine as it runs, not as it was profiled.

Each adjustment interval, for TTFT and ITL separately::

    raw  = observed / predicted          (the interval's mean observed latency over the model's prediction for it)
    new  = smoothing x raw + (1 - smoothing) x previous
    new  = clamp(new, lo, hi)

``replicas`` multiplies the model's times by the factor (> 1: the engine is slower than its profile, so more
workers). What "predicted" means is the caller's: for ITL the mean step the interval's tokens saw, from the workers'
reports of their steps in progress weighted by the tokens each sends (``itl``); for TTFT, the model's TTFT including
queue wait (``consolidation.predicted_ttft_ms``), so that the factor corrects the engine's speed and not the
queueing the model already counts (a TTFT factor that also absorbed queue wait would scale the pool for a queue that
more workers have already drained: a feedback loop).

Defaults, and why:

* ``smoothing`` 0.5: one interval's ratio rests on a few hundred requests and jumps with their mix; half-weight
  halves a one-interval outlier's effect, and still follows a lasting change (a profile 2x off) to within 12.5% in
  three intervals (``0.5 ** 3``). 1.0 is Dynamo's behaviour (each interval's ratio as it is).
* ``lo`` 0.25, ``hi`` 4.0: a model more than 4x off is a wrong profile (another GPU, another model), which the
  factor should not quietly absorb: it is held at the bound and the reason says so.

No sample (no request finished in the interval, or no prediction) keeps the previous factor, with the reason
(STYLE.md habit 3). ``--no-correction`` is the caller not calling this (factor 1.0).

``deadband`` is what a factor is *applied* as: within ``width`` of 1 as 1, beyond it by its excess (continuous, so
no new threshold at the band's edge). The SLA controller applies it to the ITL factor (``itl_correction_deadband``):
its prediction samples the steps in progress at a few pulls, so two runs that differ by 2 ms of arrival jitter read
factors a few percent apart, and the decode sizing's batch, the largest whose corrected step meets the target, is a
step function of the factor (20 + 3 ms a sequence against 50 ms: a batch of 9 up to 1.059, 10 up to 0.996, 11 up
to 0.940), so a 3% difference moved a pool's size by 8% of a worker's capacity and decided a removal (kvmesh bench
planner-live --resimulate, docs/sla-planner.md "Robust to small input noise"). The smoothed factor (the state the
next interval updates) is kept as measured; only what sizes with it is banded.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Correction", "deadband", "update_correction"]


@dataclasses.dataclass(frozen=True, slots=True)
class Correction:
    """The factor to use from now on, the interval's raw ratio (None: no sample) and why."""

    factor: float
    raw: float | None
    reason: str


def update_correction(
    previous: float,
    observed_s: float | None,
    predicted_s: float | None,
    *,
    smoothing: float = 0.5,
    lo: float = 0.25,
    hi: float = 4.0,
) -> Correction:
    """The next correction factor from the interval's observed and predicted latency (module docstring)."""
    if not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must be within (0, 1], got {smoothing}")
    if not 0 < lo <= 1 <= hi:
        raise ValueError(f"bounds must satisfy 0 < lo <= 1 <= hi, got lo {lo}, hi {hi}")
    if not (math.isfinite(previous) and previous > 0):
        raise ValueError(f"previous factor must be a finite number > 0, got {previous}")
    if observed_s is None or predicted_s is None or not math.isfinite(observed_s) or observed_s < 0:
        return Correction(previous, None, f"no observation this interval: keeping {previous:.3f}")
    if not math.isfinite(predicted_s) or predicted_s <= 0:
        return Correction(previous, None, f"no usable prediction ({predicted_s!r}): keeping {previous:.3f}")
    raw = observed_s / predicted_s
    new = smoothing * raw + (1 - smoothing) * previous
    clamped = min(hi, max(lo, new))
    reason = (
        f"observed {observed_s * 1e3:.1f} ms / predicted {predicted_s * 1e3:.1f} ms = {raw:.3f}; "
        f"{smoothing:g} x {raw:.3f} + {1 - smoothing:g} x {previous:.3f} = {new:.3f}"
    )
    if clamped != new:
        off = hi if new > hi else 1 / lo
        reason += f", held at {clamped:g} (the model is more than {off:g}x off: check the profile)"
    return Correction(clamped, raw, reason)


def deadband(factor: float, width: float) -> float:
    """``factor`` as applied: 1 within ``width`` of 1, else moved towards 1 by ``width`` (module docstring)."""
    if not 0 <= width < 1:
        raise ValueError(f"width must be within [0, 1), got {width}")
    if factor > 1 + width:
        return factor - width
    if factor < 1 - width:
        return factor + width
    return 1.0
