"""The atomic GPU budget across the prefill and decode pools: from the current counts and the wanted ones, the counts
that fit the budget and an ordered plan of steps that reaches them without ever passing it.

Why: Dynamo's SLA planner at full budget (ai-dynamo/dynamo issue 12428) asked for a prefill <-> decode swap as two
independent changes; the addition was applied first, the fleet went over its GPU budget (or the addition waited for
GPUs the removal had not freed), and the planner stayed stuck waiting for a change that could not complete.

The plan (``plan_budget``)
--------------------------
1. Bounds: each target at least its pool's minimum (``min_prefill``, ``min_decode``; 1 each: a pool at 0 cannot
   serve; 0 for an aggregated deployment's missing prefill pool).
2. Over the maximum budget (``target_prefill x gpus_per_prefill + target_decode x gpus_per_decode >
   max_gpu_budget``): both targets are cut by the same fraction, ``max / wanted`` (floored to whole workers, not
   below the minimums); if the minimums push the total back over, the pool serving the larger share of its target
   gives up a worker, repeatedly; then the GPUs left are handed one worker at a time to the pool serving the smaller
   share of its target (decode first on a tie) while a worker still fits. Why proportional: every request passes
   through both pools, so the fleet serves what its scarcer pool can; cutting both by one fraction keeps them in the
   ratio the load asked for, where cutting one pool first (say prefill) would leave decode GPUs idle behind it.
   The reason says what was wanted, the budget and what was kept.
3. Under the minimum budget (``min_gpu_budget``): whole workers are added, each to the pool with fewer GPUs (decode on
   a tie: it holds every sequence's KV for its whole output), while a worker fits under the maximum, until the
   minimum is reached.
4. Steps: removals first (each frees GPUs), then additions, each step one pool's absolute count (STYLE.md habit 4: a
   repeated step is idempotent). A caller applies a step and waits until it is done (the leaving workers gone)
   before the next. Then:
   * no addition ever takes the fleet past ``max_gpu_budget``: the additions start from the total after every
     removal and end at the final total, which fits;
   * every step can complete on its own: a removal needs no GPU, and an addition needs only GPUs the budget has
     free once the removals before it are done; there is nothing to wait for that the plan does not itself do.
   A fleet already over the budget (a worker added by hand) only shrinks until it is back within it.
   Between a swap's removal and its addition the fleet is one worker short, and may dip under ``min_gpu_budget``:
   the minimum bounds where the plan ends, not its steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

__all__ = ["BudgetPlan", "Step", "plan_budget"]

PREFILL, DECODE = "prefill", "decode"


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """Set ``pool`` from ``workers_from`` to ``workers_to`` workers; ``gpus_after``: the fleet's GPUs once done."""

    pool: str
    workers_from: int
    workers_to: int
    gpus_after: int

    @property
    def is_removal(self) -> bool:
        return self.workers_to < self.workers_from


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetPlan:
    """The counts to reach, the steps to reach them in order, and why."""

    prefill: int
    decode: int
    steps: tuple[Step, ...]
    clamped: bool  # the wanted counts did not fit the budget (or were raised to its minimum)
    reason: str
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


def _gpus(p: int, d: int, gp: int, gd: int) -> int:
    return p * gp + d * gd


def _share(count: int, target: int) -> float:
    return count / target if target > 0 else math.inf


def plan_budget(
    current_prefill: int,
    current_decode: int,
    target_prefill: int,
    target_decode: int,
    *,
    gpus_per_prefill: int = 1,
    gpus_per_decode: int = 1,
    max_gpu_budget: int | None = None,
    min_gpu_budget: int = 0,
    min_prefill: int = 1,
    min_decode: int = 1,
) -> BudgetPlan:
    """The counts within budget and the steps to reach them (module docstring). ``max_gpu_budget`` None: no
    maximum. Raises ``ValueError`` when the minimums alone do not fit the maximum budget (a configuration that no
    plan can satisfy)."""
    for name, v in (
        ("current_prefill", current_prefill),
        ("current_decode", current_decode),
        ("target_prefill", target_prefill),
        ("target_decode", target_decode),
        ("min_gpu_budget", min_gpu_budget),
        ("min_prefill", min_prefill),
        ("min_decode", min_decode),
    ):
        if v < 0:
            raise ValueError(f"{name} cannot be negative, got {v}")
    gp, gd = gpus_per_prefill, gpus_per_decode
    if gp < 1 or gd < 1:
        raise ValueError(f"GPUs per worker must be >= 1, got prefill {gp}, decode {gd}")
    hi = math.inf if max_gpu_budget is None else max_gpu_budget
    floor_gpus = _gpus(min_prefill, min_decode, gp, gd)
    if floor_gpus > hi:
        raise ValueError(
            f"max_gpu_budget {max_gpu_budget} cannot hold the minimum pools ({min_prefill} prefill x {gp} + "
            f"{min_decode} decode x {gd} = {floor_gpus} GPUs)"
        )
    if min_gpu_budget > hi:
        raise ValueError(f"min_gpu_budget {min_gpu_budget} is over max_gpu_budget {max_gpu_budget}")

    want_p, want_d = max(min_prefill, target_prefill), max(min_decode, target_decode)
    p, d = want_p, want_d
    wanted_gpus = _gpus(p, d, gp, gd)
    notes: list[str] = []
    if wanted_gpus > hi:
        frac = hi / wanted_gpus
        p, d = max(min_prefill, math.floor(p * frac)), max(min_decode, math.floor(d * frac))
        while _gpus(p, d, gp, gd) > hi:  # a minimum pushed it back over: the better-served pool gives one up
            can_p, can_d = p > min_prefill, d > min_decode
            if can_p and (not can_d or _share(p, want_p) > _share(d, want_d)):
                p -= 1
            else:
                d -= 1
        while True:  # hand out what is left, to the worse-served pool (decode on a tie)
            total = _gpus(p, d, gp, gd)
            fits_d = d < want_d and total + gd <= hi
            fits_p = p < want_p and total + gp <= hi
            if fits_d and (not fits_p or _share(d, want_d) <= _share(p, want_p)):
                d += 1
            elif fits_p:
                p += 1
            else:
                break
        notes.append(
            f"wanted {want_p} prefill x {gp} + {want_d} decode x {gd} = {wanted_gpus} GPUs, over the "
            f"{max_gpu_budget}-GPU budget: both cut to ~{frac:.0%} ({p} prefill, {d} decode, "
            f"{_gpus(p, d, gp, gd)} GPUs)"
        )
    elif wanted_gpus < min_gpu_budget:
        while _gpus(p, d, gp, gd) < min_gpu_budget:
            total = _gpus(p, d, gp, gd)
            if p * gp < d * gd and total + gp <= hi:
                p += 1
            elif total + gd <= hi:
                d += 1
            elif total + gp <= hi:
                p += 1
            else:
                break
        notes.append(
            f"wanted {want_p} prefill + {want_d} decode = {wanted_gpus} GPUs, under the {min_gpu_budget}-GPU minimum: "
            f"raised to {p} prefill, {d} decode ({_gpus(p, d, gp, gd)} GPUs)"
        )
    clamped = (p, d) != (want_p, want_d)

    # Removals first, then additions.
    steps: list[Step] = []
    cp, cd = current_prefill, current_decode
    for pool in (PREFILL, DECODE):
        if pool == PREFILL and p < cp:
            cp = p
            steps.append(Step(PREFILL, current_prefill, p, _gpus(cp, cd, gp, gd)))
        elif pool == DECODE and d < cd:
            cd = d
            steps.append(Step(DECODE, current_decode, d, _gpus(cp, cd, gp, gd)))
    for pool in (DECODE, PREFILL):
        if pool == DECODE and d > cd:
            cd = d
            steps.append(Step(DECODE, current_decode, d, _gpus(cp, cd, gp, gd)))
        elif pool == PREFILL and p > cp:
            cp = p
            steps.append(Step(PREFILL, current_prefill, p, _gpus(cp, cd, gp, gd)))
    for s in steps:  # the invariant the module promises; a failure here is a bug in this function
        assert s.is_removal or s.gpus_after <= hi, s

    current_gpus = _gpus(current_prefill, current_decode, gp, gd)
    if not steps:
        head = f"no change: {p} prefill, {d} decode ({current_gpus} GPUs)"
    else:
        head = "; then ".join(f"{s.pool} {s.workers_from} -> {s.workers_to} ({s.gpus_after} GPUs)" for s in steps)
    if current_gpus > hi:
        notes.append(f"the fleet was over the budget ({current_gpus} > {max_gpu_budget} GPUs)")
    metrics: dict[str, float] = {
        "current_prefill": float(current_prefill),
        "current_decode": float(current_decode),
        "wanted_prefill": float(want_p),
        "wanted_decode": float(want_d),
        "prefill": float(p),
        "decode": float(d),
        "current_gpus": float(current_gpus),
        "wanted_gpus": float(wanted_gpus),
        "gpus": float(_gpus(p, d, gp, gd)),
        "max_gpu_budget": float(hi),
        "min_gpu_budget": float(min_gpu_budget),
    }
    return BudgetPlan(p, d, tuple(steps), clamped, "; ".join([head, *notes]), metrics)
