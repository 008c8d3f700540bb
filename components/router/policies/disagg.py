"""Conditional disaggregation: does a decode worker prefill a prompt itself or hand it to the prefill queue?

Not a routing policy (it places no request on a worker and is not registered in ``POLICIES``): the decode worker a
request was routed to asks ``decide_prefill`` once, before it starts the prompt. It lives beside the policies because
it is the same kind of thing, a pure decision over numbers the caller gathered (STYLE.md habit 1): the prompt's
length, how much of it the decode worker's prefix cache already holds, the prefill queue's depth and how many prefill
workers pull from it. It reads no clock, no queue and no config object; the adapter that calls it does the I/O.

The rule (Dynamo's conditional disaggregation): prefill remotely only when

* the prompt's *uncached* part, ``prompt_tokens - cached_tokens``, is longer than ``max_local_prefill_length``
  (a short prefill costs a decode step little more than its fixed cost, not worth a queue hop and a KV transfer), and
* the prefill queue holds fewer than ``max_prefill_queue_size`` items (past that a remote prefill waits behind the
  others longer than the decode worker would take to do it), and
* at least one prefill worker pulls from the queue, and its depth is known (a queue nobody reads, or one the worker
  cannot see, is not a place to send work: "no data" decides local, habit 3).

Both comparisons are strict, as Dynamo's are: an uncached part of exactly ``max_local_prefill_length`` tokens is
prefilled locally, and a queue holding exactly ``max_prefill_queue_size`` items is full. So
``max_prefill_queue_size = 0`` turns remote prefill off, and ``max_local_prefill_length = 0`` sends every prompt with
an uncached token to the queue while it has room.

The conditions are checked in that order and the decision names the first that keeps the prompt local, so a short
prompt's decision never depends on the queue (the caller may skip asking for its depth: pass ``queue_size=None``).

Defaults (``WorkerConfig`` takes its defaults from the constants below, so they live here once):

* ``max_local_prefill_length = 1000`` tokens: Dynamo's. It is the default of the ``--max-local-prefill-length`` flag
  of Dynamo's vLLM example workers (``examples/llm/utils/vllm.py`` in ai-dynamo/dynamo) and of ``DisaggRouterConf``
  in its Rust disaggregated router (``lib/llm/src/disagg_router.rs``). kvmesh keeps it (STYLE.md habit 8) because it
  also falls where the mock engine's step-time model says it should: a step that prefills ``n`` tokens costs
  ``16.5 ms + 0.0152 ms * n``, so the prompt's own work passes the step's fixed cost at ``16.5 / 0.0152 ~ 1090``
  tokens. Below that, moving the prompt away saves the decode batch less than half of the stall (the fixed part
  stays with any prefill), while it still pays a queue round trip and a KV transfer; above it the saving grows with
  the prompt (an 8k-token prompt stalls a decode step by ~170 ms).
* ``max_prefill_queue_size = 3`` items: the default of Dynamo's ``--max-prefill-queue-size`` flag (same file).
  Dynamo's Python ``PyDisaggregatedRouter`` constructor and its example graphs (``examples/llm/configs/``) use 2;
  kvmesh keeps the flag's value, the one a user who does not set it gets there. It bounds what a remote prefill may
  cost in time to first token: with one prefill worker, a new item waits behind at most 2 others, ~2 x 85 ms for
  4k-token prompts on the mock model, before the decode worker would rather take the stall itself. Like Dynamo's,
  it counts items, not their tokens, and does not grow with the number of prefill workers: the planner adds prefill
  workers when the queue stays deep, which is what drains it.

Imports: the standard library and ``components.router.types``.
"""

from __future__ import annotations

import dataclasses
import enum

from components.router.types import Reason, lazy_reason, reason_text

__all__ = [
    "DEFAULT_MAX_LOCAL_PREFILL_LENGTH",
    "DEFAULT_MAX_PREFILL_QUEUE_SIZE",
    "PrefillDecision",
    "PrefillKind",
    "decide_prefill",
]

DEFAULT_MAX_LOCAL_PREFILL_LENGTH = 1000  # tokens (module docstring: Dynamo's default, and why it fits)
DEFAULT_MAX_PREFILL_QUEUE_SIZE = 3  # queue items (module docstring)


class PrefillKind(enum.StrEnum):
    """What decided where a prompt is prefilled, in a word (a Prometheus label value; the reason is the free text)."""

    REMOTE = "remote"  # long uncached part, prefill workers present, room in the queue
    SHORT = "short"  # uncached part <= max_local_prefill_length
    NO_PREFILL_WORKERS = "no_prefill_workers"  # nobody pulls from the queue
    QUEUE_UNKNOWN = "queue_unknown"  # the queue's depth is not known (unreachable, not reported yet)
    QUEUE_FULL = "queue_full"  # the queue holds >= max_prefill_queue_size items


@dataclasses.dataclass(slots=True, frozen=True)
class PrefillDecision:
    """Where to prefill one prompt, and why. ``remote`` follows from ``kind``; ``uncached_tokens`` is the part of
    the prompt someone has to compute (the prompt less what the decode worker caches).

    ``reason`` is formatted on first read (``why`` is the text or a function returning it, as in ``RouteDecision``):
    most decisions are only counted by ``kind``. Equality ignores the wording.
    """

    kind: PrefillKind
    uncached_tokens: int
    why: Reason = dataclasses.field(compare=False)

    @property
    def remote(self) -> bool:
        return self.kind is PrefillKind.REMOTE

    @property
    def reason(self) -> str:
        why = self.why
        if isinstance(why, str):
            return why
        text = reason_text(why)
        object.__setattr__(self, "why", text)  # formatted once; the decision is otherwise immutable
        return text

    def __repr__(self) -> str:
        return f"PrefillDecision(kind={self.kind!r}, uncached_tokens={self.uncached_tokens!r}, reason={self.reason!r})"


def decide_prefill(
    prompt_tokens: int,
    cached_tokens: int,
    *,
    queue_size: int | None,
    prefill_workers: int,
    max_local_prefill_length: int,
    max_prefill_queue_size: int,
) -> PrefillDecision:
    """Prefill this prompt remotely or locally (module docstring: the rule, its order, its defaults).

    ``prompt_tokens``: the prompt's length. ``cached_tokens``: its leading tokens the decode worker's prefix cache
    holds (whole blocks); more than the prompt counts as all of it. ``queue_size``: items waiting in the prefill
    queue, None when unknown. ``prefill_workers``: prefill workers pulling from that queue. The two thresholds are
    the decode worker's ``WorkerConfig`` fields of the same names. A negative count is a caller's bug: ValueError.
    """
    if prompt_tokens < 0 or cached_tokens < 0:
        raise ValueError(f"token counts cannot be negative (prompt {prompt_tokens}, cached {cached_tokens})")
    uncached = prompt_tokens - min(cached_tokens, prompt_tokens)
    if uncached <= max_local_prefill_length:
        why = lazy_reason(
            "{} uncached prompt tokens ({} - {} cached) <= max_local_prefill_length {}: prefill locally",
            uncached,
            prompt_tokens,
            cached_tokens,
            max_local_prefill_length,
        )
        return PrefillDecision(PrefillKind.SHORT, uncached, why)
    if prefill_workers <= 0:
        why = lazy_reason("no prefill worker pulls from the prefill queue: prefill {} tokens locally", uncached)
        return PrefillDecision(PrefillKind.NO_PREFILL_WORKERS, uncached, why)
    if queue_size is None:
        why = lazy_reason("the prefill queue's depth is unknown: prefill {} tokens locally", uncached)
        return PrefillDecision(PrefillKind.QUEUE_UNKNOWN, uncached, why)
    if queue_size >= max_prefill_queue_size:
        why = lazy_reason(
            "the prefill queue holds {} items >= max_prefill_queue_size {}: prefill {} tokens locally",
            queue_size,
            max_prefill_queue_size,
            uncached,
        )
        return PrefillDecision(PrefillKind.QUEUE_FULL, uncached, why)
    why = lazy_reason(
        "{} uncached prompt tokens > max_local_prefill_length {} and the prefill queue holds {} < {} items "
        "({} prefill workers): prefill remotely",
        uncached,
        max_local_prefill_length,
        queue_size,
        max_prefill_queue_size,
        prefill_workers,
    )
    return PrefillDecision(PrefillKind.REMOTE, uncached, why)
