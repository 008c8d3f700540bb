"""``PrefillQueues``: a namespace's prefill queues as their prefill workers report them, per model (pure).

Every prefill worker publishes a ``PrefillQueueReport`` every ``metrics_interval_ms`` on ``TOPIC_PREFILL_QUEUE``
(source id: its instance id): the queue's ``QueueStats`` as it read them, and whether it is prefilling. Readers that
are not workers (the frontend's ``/metrics``, ``kvmesh status``, later the planner) want two things per model from
that stream: how many prefill workers are alive, and how deep the queue is now. This module answers both from the
reports alone, with the time passed in (STYLE.md habits 1 and 2); the caller subscribes and calls ``apply``.

Alive: the fleet's one staleness rule with the queue stream's numbers (``components.fleet.rules.QUEUE_REPORTS``),
which decode workers use to count prefill workers (``components.workers.disagg.PrefillWorkers``) too. A reporter
counts until 3 of its own observed intervals have passed without a report, and never less than 1 s after its last
one; a reporter heard once has no interval yet and gets the 1 s. The interval is smoothed (a step of 0.3 towards each
new gap, a gap counted at most twice the current estimate), so one late report does not stretch the window, and a
worker that stops reporting is dropped within ~3 intervals.

Depth: the freshest report among the model's alive reporters that read the queue (``stats_error`` empty): every
prefill worker of a model reads the same JetStream stream, so the newest reading is the best one, and adding or
averaging them would count one queue several times. "No data" is a value, not an exception (habit 3): with no alive
reporter, or only ones that could not read the queue, the numbers are ``None`` and ``prefill_workers`` still says
how many are alive (0, or the ones reporting errors).

A model stays known once heard (a few strings per namespace), so a model whose prefill workers all died shows 0 of
them rather than vanishing; a reporter silent for ``FORGET_AFTER_S`` is dropped, which bounds memory over a long
life of churning instance ids.

Moved here from ``components/fleet/queues.py`` (the fleet owns the queue's state; the router never read it).

Imports: the standard library, ``components.protocol`` and this package's ``rules``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from components.fleet.rules import QUEUE_REPORTS, is_fresh, next_interval, stale_at
from components.protocol.messages import PrefillQueueReport

__all__ = [
    "FORGET_AFTER_S",
    "PrefillQueueView",
    "PrefillQueues",
    "parse_report",
]

# A reporter silent this long is forgotten (bounded memory). Long after it stopped counting: 300 s is 3,000 of the
# default 100 ms intervals.
FORGET_AFTER_S = 300.0
# How often silent reporters are looked for (one pass over the reporters).
_SWEEP_EVERY_S = 10.0


def parse_report(payload: Any) -> PrefillQueueReport | None:
    """An event's payload as a ``PrefillQueueReport``; None when it is not one (a peer of another version, noise)."""
    if not isinstance(payload, Mapping):
        return None
    try:
        report = PrefillQueueReport.from_dict(dict(payload))
    except (KeyError, TypeError, ValueError):
        return None
    return report if isinstance(report.model, str) and report.model else None


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillQueueView:
    """One model's prefill queue at one instant. The queue's numbers are those of the freshest report that read it,
    ``None`` when no alive reporter did."""

    model: str
    prefill_workers: int  # reporters alive now (module docstring)
    waiting: int | None = None  # items never delivered
    in_flight: int | None = None  # items delivered and not settled
    oldest_age_s: float | None = None  # age of the oldest never-delivered item, as of that report
    redelivered: int | None = None  # unsettled items delivered more than once
    pullers: int | None = None  # pops waiting for an item
    busy: int = 0  # alive reporters prefilling an item as of their last report
    report_age_s: float | None = None  # how old the report the numbers come from is
    stats_error: str = ""  # the freshest alive report's error when no alive reporter could read the queue

    @property
    def known(self) -> bool:
        return self.waiting is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class _Reporter:
    received_s: float
    interval_s: float | None
    report: PrefillQueueReport
    seq: int  # order of arrival: of two reports received at the same instant, the later one is the fresher


class PrefillQueues:
    """What a namespace's prefill workers report, per model. Not thread-safe; one event loop owns it."""

    def __init__(self) -> None:
        self._reporters: dict[int, _Reporter] = {}
        self._models: set[str] = set()
        self._next_sweep_s = -math.inf
        self._seq = 0

    def apply(self, source_id: int, report: PrefillQueueReport, now_s: float) -> None:
        """A report from prefill worker ``source_id``, received at ``now_s`` (a monotonic clock)."""
        self._models.add(report.model)
        prev = self._reporters.get(source_id)
        interval = None if prev is None else next_interval(prev.received_s, prev.interval_s, now_s, QUEUE_REPORTS)
        self._seq += 1
        self._reporters[source_id] = _Reporter(now_s, interval, report, self._seq)
        self._forget_silent(now_s)

    def forget(self, source_id: int) -> None:
        self._reporters.pop(source_id, None)

    def models(self) -> list[str]:
        return sorted(self._models)

    def sources(self) -> list[int]:
        """The instance ids heard from and not forgotten (alive or not)."""
        return sorted(self._reporters)

    def is_alive(self, source_id: int, now_s: float) -> bool:
        r = self._reporters.get(source_id)
        return r is not None and _alive(r, now_s)

    def latest(self, source_id: int) -> PrefillQueueReport | None:
        """The last report heard from ``source_id`` (alive or not; None once forgotten)."""
        r = self._reporters.get(source_id)
        return None if r is None else r.report

    def count(self, model: str, now_s: float) -> int:
        """Prefill workers of ``model`` alive at ``now_s``."""
        return sum(1 for r in self._reporters.values() if r.report.model == model and _alive(r, now_s))

    def view(self, model: str, now_s: float) -> PrefillQueueView:
        alive = [r for r in self._reporters.values() if r.report.model == model and _alive(r, now_s)]
        busy = sum(1 for r in alive if r.report.busy)
        read = [r for r in alive if not r.report.stats_error]
        if not read:
            errors = sorted(alive, key=_freshness)
            return PrefillQueueView(
                model, len(alive), busy=busy, stats_error=errors[-1].report.stats_error if errors else ""
            )
        best = max(read, key=_freshness)
        rep = best.report
        return PrefillQueueView(
            model=model,
            prefill_workers=len(alive),
            waiting=rep.waiting,
            in_flight=rep.in_flight,
            oldest_age_s=rep.oldest_age_s,
            redelivered=rep.redelivered,
            pullers=rep.pullers,
            busy=busy,
            report_age_s=max(0.0, now_s - best.received_s),
        )

    def views(self, now_s: float) -> list[PrefillQueueView]:
        """Every model heard of, by name."""
        return [self.view(m, now_s) for m in self.models()]

    def _forget_silent(self, now_s: float) -> None:
        # A sweep costs one pass over the reporters: once every _SWEEP_EVERY_S, not on every report.
        if now_s < self._next_sweep_s:
            return
        self._next_sweep_s = now_s + _SWEEP_EVERY_S
        silent = [iid for iid, r in self._reporters.items() if now_s - r.received_s > FORGET_AFTER_S]
        for iid in silent:
            del self._reporters[iid]


def _freshness(r: _Reporter) -> tuple[float, int]:
    return (r.received_s, r.seq)


def _alive(r: _Reporter, now_s: float) -> bool:
    return is_fresh(now_s, stale_at(r.received_s, r.interval_s, QUEUE_REPORTS))
