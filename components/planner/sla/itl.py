"""The inter-token latency the tokens see, predicted from the workers' load reports: what the ITL correction
(``correction``) compares the frontends' observed mean ITL with, and the fast loop's ``predicted_itl_s`` figure.

A decode token's gap is the step it came out of, so the frontends' mean ITL over an interval is the mean step time
weighted by the tokens each step sent (its decoding sequences): ``sum(b x t) / sum(b)`` over the engines' steps.
The planner sees the engines only through load reports taken at its pulls, and a report describes the step in
progress when it was taken (the simulated engine records a step's shape when it schedules it). A pull lands in a
step with a chance in proportion to the step's time, so a mean over pulls weighs each step by its time: a 170 ms
chunk step of an 8,000-token prompt counts 17 times a 10 ms decode step that sent as many tokens. Weighting each
sample by the tokens per second it stands for, ``b / t``, undoes that::

    predicted ITL = sum(b) / sum(b / t)        over every worker decoding at every pull of the interval

(``ItlSum``), each ``t`` the modelled time of the step the report describes (``step_ms``): its decode part
(``batch_size`` sequences attending ``num_kv_tokens``) plus its prefill chunk, the report's ``num_prefill_tokens``.

Not the queue: ``num_waiting_prefill_tokens`` is what is left once the step in progress took its chunk, so it shows
the next step's chunk only for prompts that arrived during this step. Read as the step's own chunk it missed most
chunk steps where prompts come one by one and are prefilled at once (Dynamo's sinusoid, ~1,000-token prompts: 16-80%
of the workers' time in chunk steps, the queue empty at nearly every report) and counted one at every report where a
backlog waits (the step load's plateau): kvmesh bench planner --load sinusoid / step, seed 3, per interval in
docs/sla-planner.md, "The ITL the tokens see". A report without ``num_prefill_tokens`` (an engine that does not say)
falls back to that queue reading, bounded by the step's token budget and the worker's free KV.

In expectation (``expected_step_ms``): the interval's correction takes the decode part from the reports, as above,
but the chunk part from the prompts the interval prefilled. An interval holds one report per worker per pull (14-20
in the live check's 10 s intervals), and whether 1 or 5 of them landed in a 700-token chunk step (+80 ms) moved the
prediction 3.5-8% between re-simulated draws whose observed ITL agreed to 0.5 ms (docs/sla-planner.md, "The chunk
part in expectation"); the decode part alone moved under 1%. The expectation draws the prompts a step prefills as
Poisson over the mean step (the mean field); an engine stepping so is within 1% of it at the live check's, the step
load's and a sinusoid's peak rates, and over it near saturation with short decode steps, where chunk steps bunch
(tests/unit/planner/sla/test_itl.py).

Standard library and the perf model's types only (a policy module: STYLE.md habit 1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from components.perf.profile import PerfModel

__all__ = ["ItlSum", "expected_step_ms", "step_ms"]


def step_ms(
    perf: PerfModel,
    batch_size: int,
    kv_tokens: float,
    prefill_tokens: int | None,
    *,
    waiting_prefill_tokens: int = 0,
    free_kv_tokens: float | None = None,
) -> float:
    """The modelled time, in ms, of the step a worker's load report describes (module docstring): ``batch_size``
    sequences, ``kv_tokens`` attended by its decodes, ``prefill_tokens`` computed (the report's
    ``num_prefill_tokens``); 0 for an empty step.

    ``prefill_tokens`` None (an engine that does not say): the chunk is read from the queue,
    ``waiting_prefill_tokens``, at most the step's token budget left by its batch and at most ``free_kv_tokens``
    (None: unknown; a full cache prefills nothing: its prompts wait for memory, not for the budget)."""
    chunk = prefill_tokens
    if chunk is None:
        chunk = min(waiting_prefill_tokens, max(0, perf.max_num_batched_tokens - batch_size))
        if free_kv_tokens is not None:
            chunk = min(chunk, int(max(0.0, free_kv_tokens)))
    return perf.step_ms(max(0, chunk), batch_size, round(kv_tokens))


@dataclasses.dataclass(frozen=True, slots=True)
class ItlSum:
    """Token-weighted step samples (module docstring): ``tokens`` = sum of the samples' batches, ``rate`` = sum of
    batch / step ms (tokens per ms). Sums add, so one per pull and one per interval are the same thing."""

    tokens: float = 0.0
    rate: float = 0.0
    samples: int = 0  # how many reports were added (``tokens / samples``: their mean batch)

    def add(self, batch: float, ms: float) -> ItlSum:
        """With one more report: ``batch`` sequences stepping in ``ms``; a sample with no batch or no time adds
        nothing (no token came out of it)."""
        if batch <= 0 or ms <= 0:
            return self
        return ItlSum(self.tokens + batch, self.rate + batch / ms, self.samples + 1)

    def __add__(self, other: ItlSum) -> ItlSum:
        return ItlSum(self.tokens + other.tokens, self.rate + other.rate, self.samples + other.samples)

    @property
    def mean_batch(self) -> float | None:
        """The reports' mean batch; None without a sample."""
        return self.tokens / self.samples if self.samples else None

    @property
    def mean_ms(self) -> float | None:
        """The mean gap a token saw, ms; None without a sample."""
        return self.tokens / self.rate if self.rate > 0 else None


def _poisson_mean(mu: float, cost: Callable[[int], float]) -> float:
    """``E[cost(K)]`` for ``K ~ Poisson(mu)``, ``cost(0)`` taken as 0; the sum stops where the tail is negligible
    (past ``mu + 12 sqrt(mu) + 12`` arrivals: below 1e-12 of the mass for any ``mu`` a worker sees)."""
    if mu <= 0:
        return 0.0
    total, p = 0.0, math.exp(-mu)
    for k in range(1, math.ceil(mu + 12 * math.sqrt(mu) + 12) + 1):
        p *= mu / k
        total += p * cost(k)
    return total


def expected_step_ms(
    perf: PerfModel, decode_ms: float, batch: float, prompts_per_s: float, mean_prompt_tokens: float
) -> float:
    """The mean step a token sees, ms, on a worker whose decode part steps in ``decode_ms`` with ``batch`` sequences
    while ``prompts_per_s`` prompts of ``mean_prompt_tokens`` tokens each arrive for it to prefill: the chunk part in
    expectation, not from the few reports that happened to land in a chunk step (module docstring, "In expectation").

    The engine prefills, in the step after they arrive, the prompts that arrived during the step before, up to its
    token budget (``max_num_batched_tokens`` less the step's decodes); a longer group takes further chunks of that
    budget. With Poisson arrivals the group is ``K ~ Poisson(prompts_per_s x t)`` prompts for a mean step ``t``, and
    its chunk steps add ``G(K)`` ms to the decode steps (``G(k)``: ``k x mean_prompt_tokens`` tokens in full chunks of
    the budget and the rest, each ``perf.prefill_ms``; the model's mixed step is its decode part plus its prefill
    part). A token's mean gap is the mean step: ``t = decode_ms + E[G(K_t)]`` per step that takes a group, solved
    for ``t`` by bisection. One group per step counts a prompt's base cost once per step it shares, as the engine
    does: per prompt, ``t`` would count ~16.5 ms (the analytic model's base) for each of a burst's prompts.

    Bounded by a chunk of the whole budget in every step (``decode_ms + prefill_ms(budget)``): a worker whose
    prompts need more prefill time than it has steps the budget at every step and queues the rest (the TTFT rule's
    business). No prompts (or no decode part): ``decode_ms``."""
    if decode_ms <= 0 or prompts_per_s <= 0 or mean_prompt_tokens <= 0:
        return max(0.0, decode_ms)
    budget = max(1, perf.max_num_batched_tokens - math.ceil(batch))
    full_ms = perf.prefill_ms(budget)

    def group_ms(k: int) -> float:
        full, rest = divmod(round(k * mean_prompt_tokens), budget)
        return full * full_ms + (perf.prefill_ms(rest) if rest else 0.0)

    def excess(t_ms: float) -> float:  # > 0: the steps' chunks take more than t leaves beside the decode part
        return decode_ms + _poisson_mean(prompts_per_s * t_ms / 1e3, group_ms) - t_ms

    lo, hi = decode_ms, decode_ms + full_ms
    if excess(hi) >= 0:
        return hi
    for _ in range(60):  # the bracket halves to ~1e-18 of itself: far below a step's microsecond
        mid = (lo + hi) / 2
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
