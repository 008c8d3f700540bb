"""What the fleet view says about the fleet: immutable records a pure policy can take as input.

- ``FleetInstance``: one worker as the fleet knows it: id, model, role, failure domains, schedulability, its latest
  load report (``LoadRecord``: the snapshot with its receive time, the sender's interval as observed and when it goes
  stale), and its announced performance model (``step_time`` metadata, ``profile_id``);
- ``FleetSnapshot``: every instance and every model's prefill queue at one instant ``now_s``, with the questions
  router, planner and rescheduler ask of it (pools by model and role, fresh loads by the one rule, schedulable
  counts, the queue's reading), and the frontends' recent request reports (``request_window``: a
  ``RequestWindow``, what the SLA planner predicts from and corrects with).

Failure domains (``FailureDomains``): workers that share one fail together.

- ``process``: (node, pid): one process (a crash takes every worker in it);
- ``node``: the host name (a machine, its GPUs, its power);
- ``unit``: a group of nodes that fail together, as the deployment labels it: the ``failure_unit`` key of the
  worker's registration metadata (a rack, a switch, a zone: any string) when it announces one, else its node (the
  largest domain known). Read tolerantly: a non-string value is ignored. Not ``WorkerMetadata.unit``, which is the
  worker's index inside its process.

Imports: the standard library, ``components.protocol``, ``components.perf`` and this package's ``rules``/``queues``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from components.fleet.queues import PrefillQueueView
from components.fleet.rules import is_fresh
from components.perf.model import StepTimeModel
from components.protocol.messages import LoadSnapshot, RequestStatsReport
from components.protocol.metadata import WorkerMetadata, WorkerRole

# The registration metadata key a deployment may set to name a worker's failure unit (a rack, a zone).
FAILURE_UNIT_KEY = "failure_unit"

# Roles that take clients' requests (decode or aggregated): the decode pool of a model.
SERVING_ROLES = frozenset({WorkerRole.AGGREGATED, WorkerRole.DECODE})

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_NO_REQUESTS: Mapping[str, tuple[Any, ...]] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class FailureDomains:
    node: str
    process: tuple[str, int]
    unit: str

    @classmethod
    def of(cls, meta: WorkerMetadata, raw: Mapping[str, Any]) -> FailureDomains:
        label = raw.get(FAILURE_UNIT_KEY)
        unit = label if isinstance(label, str) and label else meta.node
        return cls(meta.node, meta.process_key, unit)


class LoadRecord(NamedTuple):
    """A worker's latest load report as received: ``received_s`` on the receiver's clock (a sender's own
    ``LoadSnapshot.now_s`` is another process's monotonic clock and cannot be compared), the sender's interval as
    observed (None after a single report) and the instant it goes stale (``rules.stale_at``).

    A named tuple, not a frozen dataclass: one is made per load report (2,560 a second at 256 workers), and a frozen
    dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs ~4 times as much."""

    snapshot: LoadSnapshot
    received_s: float
    interval_s: float | None
    stale_at_s: float

    def fresh(self, now_s: float) -> bool:
        return is_fresh(now_s, self.stale_at_s)


@dataclasses.dataclass(frozen=True, slots=True)
class FleetInstance:
    """One worker. ``metadata`` is its registration as it wrote it (read-only; keys this version does not know are
    kept there), ``meta`` the same parsed."""

    instance_id: int
    model: str
    role: WorkerRole
    domains: FailureDomains
    meta: WorkerMetadata
    metadata: Mapping[str, Any]
    perf: StepTimeModel  # its announced step-time model (``step_time``), the defaults where it announced none
    schedulable: bool
    unschedulable_reason: str  # the worker's WorkerStatus reason, or "down: <what its owner saw>"; "" if schedulable
    load: LoadRecord | None

    @property
    def profile_id(self) -> str:
        """The measured profile its ``step_time`` was fitted to ("" for the engine's own model or the defaults)."""
        return self.meta.profile_id

    @property
    def serving(self) -> bool:
        """Takes clients' requests (decode or aggregated), as opposed to a prefill worker."""
        return self.role in SERVING_ROLES

    def fresh(self, now_s: float) -> bool:
        """Its load report is fresh at ``now_s`` (the one staleness rule)."""
        return self.load is not None and self.load.fresh(now_s)


def make_instance(
    instance_id: int,
    metadata: Mapping[str, Any] | None,
    *,
    model: str | None = None,
    schedulable: bool = True,
    unschedulable_reason: str = "",
    load: LoadRecord | None = None,
) -> FleetInstance:
    """A ``FleetInstance`` from a registration's metadata (``model`` given: it overrides the metadata's)."""
    raw: Mapping[str, Any] = MappingProxyType(dict(metadata)) if metadata else _EMPTY
    meta = WorkerMetadata.from_dict(raw)
    return FleetInstance(
        instance_id=instance_id,
        model=meta.model if model is None else model,
        role=meta.role,
        domains=FailureDomains.of(meta, raw),
        meta=meta,
        metadata=raw,
        perf=StepTimeModel.from_mapping(meta.step_time),
        schedulable=schedulable,
        unschedulable_reason=unschedulable_reason,
        load=load,
    )


class RequestRecord(NamedTuple):
    """A frontend's ``RequestStatsReport`` as received: when (the fleet view's clock) and from which frontend."""

    received_s: float
    source: str
    report: RequestStatsReport


@dataclasses.dataclass(frozen=True, slots=True)
class RequestWindow:
    """Every frontend's request reports for one model received in ``(start_s, end_s]``, summed. ``reports`` 0: none
    heard (no frontend reported, or none serves the model): a caller must not read that as "no load" unless
    frontends are known to report (STYLE.md habit 3). Means are None where nothing was counted."""

    start_s: float
    end_s: float
    reports: int = 0
    sources: int = 0  # distinct frontends heard
    requests: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    failed: int = 0
    output_tokens: int = 0
    ttft_count: int = 0
    ttft_sum_s: float = 0.0
    ttft_max_s: float = 0.0
    itl_count: int = 0
    itl_sum_s: float = 0.0
    itl_max_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def request_rate(self) -> float | None:
        """Requests admitted per second over the window (None: nothing heard or an empty window)."""
        return self.requests / self.duration_s if self.reports and self.duration_s > 0 else None

    @property
    def mean_isl(self) -> float | None:
        return self.prompt_tokens / self.requests if self.requests else None

    @property
    def mean_osl(self) -> float | None:
        return self.output_tokens / self.finished if self.finished else None

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_sum_s / self.ttft_count if self.ttft_count else None

    @property
    def mean_itl_s(self) -> float | None:
        return self.itl_sum_s / self.itl_count if self.itl_count else None


def request_window(records: Iterable[RequestRecord], start_s: float, end_s: float) -> RequestWindow:
    """The records received in ``(start_s, end_s]``, summed (``RequestWindow``)."""
    picked = [r for r in records if start_s < r.received_s <= end_s]
    reps = [r.report for r in picked]
    return RequestWindow(
        start_s=start_s,
        end_s=end_s,
        reports=len(picked),
        sources=len({r.source for r in picked}),
        requests=sum(r.requests for r in reps),
        prompt_tokens=sum(r.prompt_tokens for r in reps),
        finished=sum(r.finished for r in reps),
        failed=sum(r.failed for r in reps),
        output_tokens=sum(r.output_tokens for r in reps),
        ttft_count=sum(r.ttft_count for r in reps),
        ttft_sum_s=sum(r.ttft_sum_s for r in reps),
        ttft_max_s=max((r.ttft_max_s for r in reps), default=0.0),
        itl_count=sum(r.itl_count for r in reps),
        itl_sum_s=sum(r.itl_sum_s for r in reps),
        itl_max_s=max((r.itl_max_s for r in reps), default=0.0),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """The fleet at ``now_s``: instances by id (read-only) and each known model's prefill queue. Immutable: a policy
    may keep it, compare two, or read it from another thread."""

    now_s: float
    instances: Mapping[int, FleetInstance]
    queues: Mapping[str, PrefillQueueView]
    # model -> the request reports received over the state's horizon (``state.REQUEST_HORIZON_S``), oldest first
    requests: Mapping[str, tuple[RequestRecord, ...]] = dataclasses.field(default_factory=lambda: _NO_REQUESTS)

    def models(self) -> list[str]:
        """Models some instance serves, by name."""
        return sorted({i.model for i in self.instances.values() if i.model})

    def of_model(self, model: str) -> list[FleetInstance]:
        return sorted((i for i in self.instances.values() if i.model == model), key=_by_id)

    def pool(self, model: str, roles: Iterable[WorkerRole]) -> list[FleetInstance]:
        """``model``'s instances of these roles, by id."""
        wanted = frozenset(roles)
        return [i for i in self.of_model(model) if i.role in wanted]

    def serving(self, model: str) -> list[FleetInstance]:
        """The decode pool: decode and aggregated instances (those clients' requests go to)."""
        return self.pool(model, SERVING_ROLES)

    def prefill(self, model: str) -> list[FleetInstance]:
        return self.pool(model, (WorkerRole.PREFILL,))

    def disaggregated(self, model: str) -> bool:
        """Whether ``model`` is served disaggregated: any of its instances is a prefill or a decode worker (then its
        prefill pool exists, maybe empty)."""
        return any(i.role != WorkerRole.AGGREGATED for i in self.of_model(model))

    def schedulable(self, model: str, roles: Iterable[WorkerRole] = SERVING_ROLES) -> list[FleetInstance]:
        return [i for i in self.pool(model, roles) if i.schedulable]

    def schedulable_count(self, model: str, roles: Iterable[WorkerRole] = SERVING_ROLES) -> int:
        return len(self.schedulable(model, roles))

    def fresh_loads(self, model: str, roles: Iterable[WorkerRole] = SERVING_ROLES) -> dict[int, LoadRecord]:
        """The load reports of ``model``'s instances of these roles that are fresh at ``now_s`` (the one rule)."""
        return {
            i.instance_id: i.load for i in self.pool(model, roles) if i.load is not None and i.load.fresh(self.now_s)
        }

    def stale(self, model: str, roles: Iterable[WorkerRole] = SERVING_ROLES) -> list[int]:
        """Instances of these roles whose last report went stale by ``now_s`` (never-reported ones are not stale:
        they have nothing to go stale; see ``rules``)."""
        return [i.instance_id for i in self.pool(model, roles) if i.load is not None and not i.load.fresh(self.now_s)]

    def queue(self, model: str) -> PrefillQueueView | None:
        """``model``'s prefill queue as its prefill workers report it (None: never heard of)."""
        return self.queues.get(model)

    def request_window(self, model: str, start_s: float, end_s: float | None = None) -> RequestWindow:
        """``model``'s request reports received in ``(start_s, end_s]`` (default end: ``now_s``), summed."""
        return request_window(self.requests.get(model, ()), start_s, self.now_s if end_s is None else end_s)


def _by_id(i: FleetInstance) -> int:
    return i.instance_id
