"""How long a new prompt waits on a worker, and its predicted time to first token: the one model the router (its
``kv`` cost, ``components.router.types``) and the SLA planner (fast loop, consolidation check, TTFT correction)
predict with, so that the planner scales on the same TTFT the router places requests by.

A new prompt on a worker with ``q`` prompt tokens queued ahead of it and ``seqs`` sequences decoding alongside:

* the queue drains at the worker's prefill rate under its concurrent decode: each step carries the rest of the
  token budget as prefill, ``chunk = max_num_batched_tokens - seqs`` tokens, and costs that prefill plus the decode
  step, so ``(prefill_ms(chunk) + decode_ms(seqs, kv_tokens)) / chunk`` ms a prompt token
  (``prefill_ms_per_prompt_token``);
* while anything is queued, the prompt also waits out the rest of the step in progress: ``STEP_RESIDUAL_SHARE`` (0.5:
  arriving at a random moment of it) of a prefill step's fixed cost (``step_residual_ms``); the per-token rate spreads
  that fixed cost over a full chunk and misses it for the short queues of a fleet below capacity (the router's
  tuning notes, components/router/types.py);
* then computes its own ``isl`` tokens: ``chunked_prefill_ms(isl)``.

``queued_wait_ms`` is the first two, ``predicted_ttft_ms`` all three. A prefill step's fixed cost is the analytic
model's ``prefill_base_ms``; for a measured ``Profile``, its fitted model's; for any other ``PerfModel``, a one-token
step (``prefill_ms(1)``: the fixed cost plus one token).

Standard library and this package only.
"""

from __future__ import annotations

from .model import StepTimeModel
from .profile import PerfModel, Profile

__all__ = [
    "STEP_RESIDUAL_SHARE",
    "predicted_ttft_ms",
    "prefill_fixed_ms",
    "prefill_ms_per_prompt_token",
    "queued_wait_ms",
    "step_residual_ms",
]

# The share of a prefill step's fixed cost a new prompt waits out on a worker with prefill in progress: it cannot
# join the step already running and, arriving at a random moment of it, waits half of it on average (the expected
# residual, not a fitted value; the router's tuning of it is in components/router/types.py).
STEP_RESIDUAL_SHARE = 0.5


def prefill_fixed_ms(perf: PerfModel) -> float:
    """A prefill step's fixed cost in ms (module docstring)."""
    if isinstance(perf, StepTimeModel):
        return perf.prefill_base_ms
    if isinstance(perf, Profile):
        return perf.fit.prefill_base_ms
    return perf.prefill_ms(1)


def step_residual_ms(perf: PerfModel) -> float:
    """What a new prompt waits out of the prefill step in progress: ``STEP_RESIDUAL_SHARE`` of its fixed cost."""
    return STEP_RESIDUAL_SHARE * prefill_fixed_ms(perf)


def prefill_ms_per_prompt_token(perf: PerfModel, decoding_seqs: int, kv_tokens: float) -> float:
    """ms per queued prompt token while ``decoding_seqs`` sequences (``kv_tokens`` KV in all) decode alongside."""
    chunk = max(1, perf.max_num_batched_tokens - max(0, decoding_seqs))
    return (perf.prefill_ms(chunk) + perf.decode_ms(decoding_seqs, kv_tokens)) / chunk


def queued_wait_ms(queued_prefill_tokens: float, ms_per_token: float, residual_ms: float) -> float:
    """The wait before a new prompt's own prefill: the queued tokens at ``ms_per_token``, plus ``residual_ms`` of
    the step in progress while any are queued; 0 with nothing queued. Takes the two rates rather than a model so the
    router can pass the ones it keeps per worker."""
    return ms_per_token * queued_prefill_tokens + residual_ms if queued_prefill_tokens else 0.0


def predicted_ttft_ms(
    perf: PerfModel, isl: int, queued_prefill_tokens: float, decode_seqs: int = 0, kv_tokens: float = 0.0
) -> float:
    """A new ``isl``-token prompt's time to first token in ms on a worker with ``queued_prefill_tokens`` ahead of it
    and ``decode_seqs`` sequences (``kv_tokens`` KV) decoding alongside, uncorrected (module docstring)."""
    wait = queued_wait_ms(
        queued_prefill_tokens,
        prefill_ms_per_prompt_token(perf, decode_seqs, kv_tokens),
        step_residual_ms(perf),
    )
    return wait + perf.chunked_prefill_ms(isl)
