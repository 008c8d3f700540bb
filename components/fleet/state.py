"""``FleetState``: the fleet's bookkeeping, with no I/O and no clock (every event comes with its ``now_s``).

It is the in-memory twin (``MemoryFleet``, fed by explicit calls: the simulator, unit tests, a router benchmark) and
the core of the live view (``components.fleet.live.LiveFleet`` feeds one from the mesh), so both answer the same
questions the same way (tests/unit/fleet/test_view_behaviour.py runs one set of behaviour tests against both).

What it keeps, and the rules it applies (``rules``):

- membership: each instance's registration metadata and the model it serves (``add_instance``/``remove_instance``,
  or ``set_members(model, ...)``: a model's whole set at once, as a discovery listing gives it). An instance that
  leaves is *departed*: its late load reports and statuses are ignored until it registers again (the last 4,096
  departed ids are remembered); a model with no instance left is forgotten;
- load: each instance's latest ``LoadSnapshot`` as a ``LoadRecord`` (receive time, the sender's interval as
  observed, when it goes stale by the one rule). Reports of an instance not (yet) registered are kept too: its load
  report may overtake its registration, and it is fresh as soon as it joins;
- schedulability: the latest ``WorkerStatus`` (a False one is kept with its reason until a True one), and owners'
  ``mark_down`` (kept until a load report received ``DOWN_HOLD_S`` after the mark, or the instance leaves);
- each model's prefill queue (``queues.PrefillQueues``, the queue reports' rule);
- each model's request reports from the frontends (``apply_request_stats``), for ``REQUEST_HORIZON_S``;

and tells its listeners (``FleetListener``: the router keeps its per-decision tables current from them) of every
change as it happens, synchronously: a listener sees the state already changed.

Single-threaded: one event loop owns it; none of its methods awaits.

Imports: the standard library, ``components.protocol`` and this package.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from components.fleet.model import FleetInstance, FleetSnapshot, LoadRecord, RequestRecord, make_instance
from components.fleet.queues import PrefillQueues
from components.fleet.rules import LOAD_REPORTS, StaleRule, is_schedulable, next_interval, report_clears_down, stale_at
from components.protocol.messages import LoadSnapshot, PrefillQueueReport, RequestStatsReport
from components.protocol.migration import WorkerStatus

logger = logging.getLogger(__name__)

# Instances that left are remembered (so their late reports are ignored) up to this many; the oldest are forgotten
# first. A few hundred bytes each.
MAX_DEPARTED = 4096

# Request reports are kept this long after receipt: the SLA planner reads at most one adjustment interval back (its
# default 60 s; a predictor's history is its own), and ten minutes covers any interval a user sets without the list
# growing past ~600 reports per frontend (one a second).
REQUEST_HORIZON_S = 600.0

_new_record = tuple.__new__


class FleetListener(Protocol):
    """What the fleet tells a reader that keeps derived tables (the router). Called synchronously, after the change."""

    def fleet_members(self, model: str, joined: set[int], left: set[int]) -> None:
        """``model``'s set of instances (or one's metadata) changed; ``joined``: instances new to the fleet,
        ``left``: instances gone from it (an instance that moved to another model is in neither)."""

    def fleet_load(self, instance_id: int, record: LoadRecord | None) -> None:
        """An instance's load record changed (None: it left, its report is dropped)."""

    def fleet_schedulability(self, instance_id: int) -> None:
        """Whether an instance is schedulable changed (``FleetState.blocked`` is current)."""


class FleetView(Protocol):
    """The read side of the fleet, live or in memory: what router, planner and rescheduler take as input."""

    def snapshot(self, now_s: float) -> FleetSnapshot: ...

    def instance(self, instance_id: int) -> FleetInstance | None: ...

    def add_listener(self, listener: FleetListener) -> None: ...

    def remove_listener(self, listener: FleetListener) -> None: ...


class FleetState:
    """The fleet's bookkeeping (module docstring). ``rule``: the staleness numbers of load reports (the router's
    config may set its own; the default is ``rules.LOAD_REPORTS``)."""

    def __init__(self, rule: StaleRule = LOAD_REPORTS) -> None:
        self.rule = rule
        self.queues = PrefillQueues()
        self._listeners: list[FleetListener] = []
        self._base: dict[int, FleetInstance] = {}  # members, as registered (schedulable, no load)
        self._by_model: dict[str, dict[int, Mapping[str, Any]]] = {}  # model -> {instance id: metadata}
        self._loads: dict[int, LoadRecord] = {}
        self._refused: dict[int, str] = {}  # a WorkerStatus said no: its reason
        self._down: dict[int, tuple[float, str]] = {}  # marked down: when, why
        self._blocked: frozenset[int] = frozenset()
        self._departed: dict[int, None] = {}  # an insertion-ordered set
        self._requests: dict[str, collections.deque[RequestRecord]] = {}  # model -> reports, oldest first

    # --- listeners --------------------------------------------------------------------------------------------------

    def add_listener(self, listener: FleetListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: FleetListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # --- membership -------------------------------------------------------------------------------------------------

    def add_instance(self, instance_id: int, metadata: Mapping[str, Any] | None, model: str | None = None) -> None:
        """Register (or update) an instance; ``model`` overrides its metadata's ``model``."""
        inst = make_instance(instance_id, metadata, model=model)
        old = self._base.get(instance_id)
        self._base[instance_id] = inst
        self._by_model.setdefault(inst.model, {})[instance_id] = inst.metadata
        changed = {inst.model}
        if old is not None and old.model != inst.model:
            self._leave_model(old.model, instance_id)
            changed.add(old.model)
        joined = set() if old is not None else {instance_id}
        if joined:
            self._departed.pop(instance_id, None)
        for model in sorted(changed):
            self._notify_members(model, joined if model == inst.model else set(), set())

    def remove_instance(self, instance_id: int) -> None:
        """An instance left (deregistered, its lease expired). Unknown ids are ignored."""
        inst = self._base.pop(instance_id, None)
        if inst is None:
            return
        self._leave_model(inst.model, instance_id)
        self._depart(instance_id)
        self._notify_members(inst.model, set(), {instance_id})

    def set_members(self, model: str, members: Iterable[tuple[int, Mapping[str, Any] | None]]) -> None:
        """Replace ``model``'s instances ((instance id, metadata) pairs; empty: the model has none). An instance now
        listed under another model moves here; one no longer listed leaves the fleet."""
        new = {iid: make_instance(iid, md, model=model) for iid, md in members}
        before = self._by_model.get(model, {})
        left = {iid for iid in before if iid not in new}
        joined: set[int] = set()
        moved_from: set[str] = set()
        for iid, inst in new.items():
            old = self._base.get(iid)
            if old is None:
                joined.add(iid)
                self._departed.pop(iid, None)
            elif old.model != model:
                self._leave_model(old.model, iid)
                moved_from.add(old.model)
            self._base[iid] = inst
        for iid in left:
            del self._base[iid]
            self._depart(iid)
        if new:
            self._by_model[model] = {iid: inst.metadata for iid, inst in new.items()}
        else:
            self._by_model.pop(model, None)
        self._notify_members(model, joined, left)  # always: metadata may have changed with the same ids
        for other in sorted(moved_from):
            self._notify_members(other, set(), set())

    def _leave_model(self, model: str, instance_id: int) -> None:
        members = self._by_model.get(model)
        if members is not None:
            members.pop(instance_id, None)
            if not members:
                del self._by_model[model]

    def _depart(self, instance_id: int) -> None:
        """What leaving the fleet drops: its report, its status and mark, remembered as departed."""
        blocked = self._refused.pop(instance_id, None) is not None
        blocked = self._down.pop(instance_id, None) is not None or blocked
        if self._loads.pop(instance_id, None) is not None:
            for cb in self._listeners:
                cb.fleet_load(instance_id, None)
        self._departed[instance_id] = None
        if len(self._departed) > MAX_DEPARTED:
            del self._departed[next(iter(self._departed))]
        if blocked:
            self._update_blocked(instance_id)

    def _notify_members(self, model: str, joined: set[int], left: set[int]) -> None:
        if joined or left:
            logger.debug(
                "model %s: %d instances (joined: %s; left: %s)",
                model or "-",
                len(self._by_model.get(model, ())),
                ", ".join(f"{i:x}" for i in sorted(joined)) or "-",
                ", ".join(f"{i:x}" for i in sorted(left)) or "-",
            )
        for cb in self._listeners:
            cb.fleet_members(model, joined, left)

    def registration(self, instance_id: int) -> FleetInstance | None:
        """The instance as registered (its metadata, role, domains), without its current load and schedulability:
        cheaper than ``instance`` for a reader that keeps those itself (the router, from the listener calls)."""
        return self._base.get(instance_id)

    def members(self, model: str) -> Mapping[int, Mapping[str, Any]]:
        """``model``'s instances and their registration metadata (read-only)."""
        return MappingProxyType(self._by_model.get(model, {}))

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def is_member(self, instance_id: int) -> bool:
        return instance_id in self._base

    def has_departed(self, instance_id: int) -> bool:
        """It was registered and left (and has not registered again)."""
        return instance_id in self._departed

    # --- load -------------------------------------------------------------------------------------------------------

    def apply_load(self, instance_id: int, snapshot: LoadSnapshot, now_s: float) -> None:
        """An instance's load report arrived at ``now_s``. It also takes back an owner's mark made ``DOWN_HOLD_S``
        or more before (``rules``)."""
        if instance_id in self._departed:
            return
        down = self._down.get(instance_id) if self._down else None
        if down is not None and report_clears_down(down[0], now_s):
            logger.info(
                "worker %x reports again %.1f s after it was marked down: routable", instance_id, now_s - down[0]
            )
            del self._down[instance_id]
            self._update_blocked(instance_id)
        prev = self._loads.get(instance_id)
        rule = self.rule
        if prev is None:
            interval = None
        else:
            interval = next_interval(prev[1], prev[2], now_s, rule)  # received_s, interval_s
        # tuple.__new__: LoadRecord's own __new__ is one more Python call, for every load report (~2,560/s at 256).
        record = _new_record(LoadRecord, (snapshot, now_s, interval, stale_at(now_s, interval, rule)))
        self._loads[instance_id] = record
        for cb in self._listeners:
            cb.fleet_load(instance_id, record)

    def load(self, instance_id: int) -> LoadRecord | None:
        return self._loads.get(instance_id)

    def loads(self) -> Mapping[int, LoadRecord]:
        """Every load record kept (members' and not-yet-registered instances'), read-only."""
        return MappingProxyType(self._loads)

    # --- schedulability ---------------------------------------------------------------------------------------------

    def apply_status(self, instance_id: int, status: WorkerStatus, now_s: float | None = None) -> None:
        """An instance says whether it takes new requests (``WorkerStatus``, received at ``now_s``: kept for
        nothing yet, taken for the twin's and the live view's one signature)."""
        if status.schedulable:
            if self._refused.pop(instance_id, None) is not None:
                logger.info("worker %x takes requests again", instance_id)
                self._update_blocked(instance_id)
        elif instance_id not in self._refused and instance_id not in self._departed:
            logger.info("worker %x takes no new requests: %s", instance_id, status.reason or "(no reason given)")
            self._refused[instance_id] = status.reason
            self._update_blocked(instance_id)

    def mark_down(self, instance_id: int, now_s: float, reason: str = "") -> bool:
        """An owner saw the instance's process gone (no responders, a stream cut): unschedulable until a load report
        received ``DOWN_HOLD_S`` later, or it leaves. True when newly marked."""
        if instance_id in self._down or instance_id in self._departed:
            return False
        logger.warning("worker %x marked down: %s", instance_id, reason or "(no reason given)")
        self._down[instance_id] = (now_s, reason)
        self._update_blocked(instance_id)
        return True

    def down_since(self, instance_id: int) -> float | None:
        """When an owner marked the instance down (its ``now_s``), None if it is not marked."""
        down = self._down.get(instance_id)
        return None if down is None else down[0]

    @property
    def blocked(self) -> frozenset[int]:
        """Instances that take no new requests now (a status said so, or marked down); members or not yet."""
        return self._blocked

    def is_schedulable(self, instance_id: int) -> bool:
        """Not blocked, and not departed (a worker that left takes no requests, whatever it said before)."""
        return instance_id not in self._blocked and instance_id not in self._departed

    def unschedulable(self) -> dict[int, str]:
        """The blocked instances and why: the ``WorkerStatus`` reason, or "down"."""
        out = {iid: "down" for iid in self._down}
        out.update(self._refused)
        return out

    def _update_blocked(self, instance_id: int) -> None:
        self._blocked = frozenset(self._refused) | frozenset(self._down)
        for cb in self._listeners:
            cb.fleet_schedulability(instance_id)

    # --- prefill queues ---------------------------------------------------------------------------------------------

    def apply_queue(self, instance_id: int, report: PrefillQueueReport, now_s: float) -> None:
        """A prefill worker's queue report (``queues``' rule decides who is alive and which reading counts)."""
        self.queues.apply(instance_id, report, now_s)

    # --- request reports --------------------------------------------------------------------------------------------

    def apply_request_stats(self, source: str, report: RequestStatsReport, now_s: float) -> None:
        """A frontend's request report, received at ``now_s``; reports older than ``REQUEST_HORIZON_S`` are dropped."""
        q = self._requests.setdefault(report.model, collections.deque())
        q.append(RequestRecord(now_s, source, report))
        while q and q[0].received_s < now_s - REQUEST_HORIZON_S:
            q.popleft()

    # --- reading ----------------------------------------------------------------------------------------------------

    def instance(self, instance_id: int) -> FleetInstance | None:
        base = self._base.get(instance_id)
        return None if base is None else self._current(base)

    def _current(self, base: FleetInstance) -> FleetInstance:
        iid = base.instance_id
        refused = self._refused.get(iid)
        down = self._down.get(iid)
        reason = refused if refused is not None else ""
        if down is not None and refused is None:
            reason = f"down: {down[1]}" if down[1] else "down"
        return FleetInstance(
            iid,
            base.model,
            base.role,
            base.domains,
            base.meta,
            base.metadata,
            base.perf,
            is_schedulable(refused is None, None if down is None else down[0]),
            reason,
            self._loads.get(iid),
        )

    def snapshot(self, now_s: float) -> FleetSnapshot:
        """Every member and every model's queue at ``now_s``, immutable."""
        instances = {iid: self._current(base) for iid, base in self._base.items()}
        queues = {v.model: v for v in self.queues.views(now_s)}
        requests = {m: tuple(q) for m, q in self._requests.items()}
        return FleetSnapshot(now_s, MappingProxyType(instances), MappingProxyType(queues), MappingProxyType(requests))


# The in-memory twin is the state itself, fed by explicit calls with the time given (the simulator, unit tests).
MemoryFleet = FleetState
