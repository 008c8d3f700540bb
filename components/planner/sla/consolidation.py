"""The scale-down check that cannot oscillate: before a pool goes from N to N - 1 workers, re-predict each survivor
carrying N / (N - 1) of its load, and refuse when any would break a target x ``sensitivity``.

Why: a flat check ("each worker is under 80% of target, so remove one") lets 2 -> 1 through whenever each worker is
under 80%, and the survivor, now carrying both workers' load, breaks the target at once, so the next interval adds
the worker back: 2 <-> 1 under constant load (ai-dynamo/dynamo PR 9294, at 2 decode workers at ~0.7 KV use and
23 ms ITL under a 32 ms threshold). Re-predicting the survivors closes that loop: a removal is allowed only when the
fleet after it would itself not want a worker back. Pure: numbers and a ``PerfModel`` in, a ``Verdict`` out.

The load model: a router spreads a pool's load evenly, so removing one of N workers moves 1/N of the load onto the
N - 1 others and each survivor's load grows by ``f = N / (N - 1)`` (2 -> 1: x2; 10 -> 9: x1.11). Which worker
leaves is the caller's choice:

* not named (``leaving_id`` None): every worker is checked with its own load x ``f`` (any of them may stay). This is
  the issue's formula, exact for a balanced pool (what the router's even spread aims at).
* named: the others are the survivors, and each carries its own load plus an even share of the leaver's,
  ``own + leaving / (N - 1)`` for each quantity (KV use, sequences, KV tokens, queued tokens). For a balanced pool
  this is again ``own x f``; removing a worker heavier than the others is charged for what it really hands over.

The three constraints, for each survivor (``sensitivity`` default 0.8, Dynamo's ``load_scaling_down_sensitivity``;
refused at ``>=``, as Dynamo's check, so a survivor exactly at the threshold is refused):

* KV capacity (worker reports ``kv_usage``): ``kv_usage x f >= kv_limit x sensitivity`` (``kv_limit`` 1.0: the
  cache full). Checked on the input side, as PR 9294 does for decode: past capacity the engine preempts and
  recomputes, which no latency model predicts.
* ITL (``decode_seqs`` > 0 and an ITL target): the decode step at ``ceil(decode_seqs x f)`` sequences and
  ``kv_tokens x f`` KV tokens (or the leaver's share added, as above), from the perf model, times the worker's
  correction: ``observed_itl_s`` over the model's step at its current load when the worker reports it, else
  ``itl_correction`` (the pool's factor). Refused when that is ``>= itl_target_s x sensitivity``.
* TTFT (a TTFT target and a prompt length ``isl``, for prefill and aggregated workers): a new prompt waits for the
  prompt tokens queued ahead of it, then computes its own; only the queue grows with ``f``, not the new prompt's
  own compute (a prompt does not get longer because there are fewer workers). The router's model, once, in
  ``components.perf.queueing.predicted_ttft_ms`` (re-exported here): the queue at the worker's prefill rate under its
  concurrent decode, ``(prefill_ms(chunk) + decode_ms(seqs, kv)) / chunk`` per token with ``chunk =
  max_num_batched_tokens - seqs``, plus half a prefill step's fixed cost while anything is queued; then
  ``chunked_prefill_ms(isl)``; times ``ttft_correction``. Refused when ``>= ttft_target_s x sensitivity``.

No data is a decision (STYLE.md habit 3): a pool of one worker, or any worker without a load report, refuses
scale-down and says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from components.perf.profile import PerfModel
from components.perf.queueing import predicted_ttft_ms

__all__ = [
    "DEFAULT_SENSITIVITY",
    "Verdict",
    "Violation",
    "WorkerLoad",
    "consolidation_check",
    "predicted_ttft_ms",
]

DEFAULT_SENSITIVITY = 0.8  # Dynamo's load_scaling_down_sensitivity default


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's load as last reported; None or 0 where it does not apply (a prefill worker decodes nothing)."""

    worker_id: int
    kv_usage: float | None = None  # active KV blocks / total blocks, 0..1
    decode_seqs: int = 0  # sequences decoding
    kv_tokens: float = 0.0  # KV tokens those sequences attend to, in all
    queued_prefill_tokens: float = 0.0  # prompt tokens waiting ahead of a new prompt
    observed_itl_s: float | None = None  # its measured inter-token latency at this load, if reported


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    """One survivor that would break one constraint after the removal."""

    worker_id: int
    constraint: str  # "kv", "itl" or "ttft"
    current: float  # now (fraction for kv, seconds for itl/ttft)
    predicted: float  # with N / (N - 1) of its load
    threshold: float  # limit x sensitivity

    def describe(self) -> str:
        if self.constraint == "kv":
            return f"worker {self.worker_id}: KV use {self.current:.2f} -> {self.predicted:.2f} >= {self.threshold:.2f}"
        return (
            f"worker {self.worker_id}: {self.constraint.upper()} {self.current * 1e3:.1f} -> "
            f"{self.predicted * 1e3:.1f} ms >= {self.threshold * 1e3:.1f} ms"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the pool may go from N to N - 1, why, and the numbers (``metrics``: per survivor and constraint)."""

    allowed: bool
    reason: str
    workers: int  # N
    factor: float  # N / (N - 1); inf when N <= 1
    violations: tuple[Violation, ...] = ()
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


def consolidation_check(
    workers: Sequence[WorkerLoad],
    perf: PerfModel,
    *,
    itl_target_s: float | None = None,
    ttft_target_s: float | None = None,
    isl: float | None = None,
    sensitivity: float = DEFAULT_SENSITIVITY,
    kv_limit: float = 1.0,
    itl_correction: float = 1.0,
    ttft_correction: float = 1.0,
    leaving_id: int | None = None,
) -> Verdict:
    """May this pool lose one worker? (module docstring). ``workers`` is the whole pool (N = its length)."""
    if not 0 < sensitivity <= 1:
        raise ValueError(f"sensitivity must be within (0, 1], got {sensitivity}")
    n = len(workers)
    if n <= 1:
        return Verdict(False, f"{n} worker(s): a pool keeps at least one", n, math.inf)
    f = n / (n - 1)
    survivors = [w for w in workers if w.worker_id != leaving_id] if leaving_id is not None else list(workers)
    if leaving_id is not None and len(survivors) == n:
        raise ValueError(f"leaving_id {leaving_id} is not one of the pool's workers")
    violations: list[Violation] = []
    metrics: dict[str, float] = {"workers": float(n), "factor": f, "sensitivity": sensitivity}
    missing = [w.worker_id for w in workers if w.kv_usage is None]  # the leaver's load is handed over too
    if missing:
        return Verdict(
            False,
            f"no load report from worker(s) {', '.join(map(str, missing))}: cannot re-predict, keeping {n}",
            n,
            f,
            (),
            metrics,
        )
    leaver = next((w for w in workers if w.worker_id == leaving_id), None)

    def after(own: float, leaving: float) -> float:
        return own + leaving / (n - 1) if leaver is not None else own * f

    for w in survivors:
        wid = w.worker_id
        seqs_after = math.ceil(after(w.decode_seqs, leaver.decode_seqs if leaver else 0) - 1e-9)
        kv_tokens_after = after(w.kv_tokens, leaver.kv_tokens if leaver else 0.0)
        queue_after = after(w.queued_prefill_tokens, leaver.queued_prefill_tokens if leaver else 0.0)
        # KV capacity.
        assert w.kv_usage is not None
        kv_after = after(w.kv_usage, (leaver.kv_usage or 0.0) if leaver else 0.0)
        metrics[f"w{wid}.kv"], metrics[f"w{wid}.kv_after"] = w.kv_usage, kv_after
        if kv_after >= kv_limit * sensitivity:
            violations.append(Violation(wid, "kv", w.kv_usage, kv_after, kv_limit * sensitivity))
        # ITL.
        if itl_target_s is not None and seqs_after > 0:
            model_now_s = perf.decode_ms(w.decode_seqs, w.kv_tokens) / 1e3
            model_after_s = perf.decode_ms(seqs_after, kv_tokens_after) / 1e3
            if w.observed_itl_s is not None and model_now_s > 0:
                corr, now_s = w.observed_itl_s / model_now_s, w.observed_itl_s
            else:
                corr, now_s = itl_correction, itl_correction * model_now_s
            itl_after = corr * model_after_s
            metrics[f"w{wid}.itl_s"], metrics[f"w{wid}.itl_after_s"] = now_s, itl_after
            metrics[f"w{wid}.itl_correction"] = corr
            if itl_after >= itl_target_s * sensitivity:
                violations.append(Violation(wid, "itl", now_s, itl_after, itl_target_s * sensitivity))
        # TTFT.
        if ttft_target_s is not None and isl is not None:
            n_isl = max(1, round(isl))
            ms_now = predicted_ttft_ms(perf, n_isl, w.queued_prefill_tokens, w.decode_seqs, w.kv_tokens)
            ms_after = predicted_ttft_ms(perf, n_isl, queue_after, seqs_after, kv_tokens_after)
            now_s, ttft_after = ttft_correction * ms_now / 1e3, ttft_correction * ms_after / 1e3
            metrics[f"w{wid}.ttft_s"], metrics[f"w{wid}.ttft_after_s"] = now_s, ttft_after
            if ttft_after >= ttft_target_s * sensitivity:
                violations.append(Violation(wid, "ttft", now_s, ttft_after, ttft_target_s * sensitivity))
    if violations:
        constraints = list(dict.fromkeys(v.constraint for v in violations))  # in the order checked
        reason = (
            f"keep {n}: with {n - 1} the survivors would carry x{f:.2f} the load and break "
            f"{', '.join(c.upper() for c in constraints)} ({'; '.join(v.describe() for v in violations)})"
        )
        return Verdict(False, reason, n, f, tuple(violations), metrics)
    return Verdict(
        True,
        f"{n} -> {n - 1}: every survivor stays under target x {sensitivity:g} carrying x{f:.2f} the load",
        n,
        f,
        (),
        metrics,
    )
