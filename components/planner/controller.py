"""The planner's controller: one pull of the load planner as a function of the fleet view, with no I/O. The live
planner (``loop.Planner``) and the simulator (``components.sim``, through ``kvmesh simulate`` and ``kvmesh bench
planner``) call the same ``PlannerController.pull`` with a ``FleetSnapshot``; they differ only in where the snapshot
comes from (``components.fleet.live.LiveFleet`` on the monotonic clock, the simulator's ``FleetState`` on its virtual
clock) and in who carries out a change (a connector's ``set_pool_size``, or the simulator's modelled connector).

One pull:

* pools from the fleet view: the decode pool is the model's serving instances (decode or aggregated), the prefill
  pool its prefill instances; the model is disaggregated when any of its instances is a prefill or decode worker
  (``FleetSnapshot.disaggregated``);
* loads: every serving instance's latest load report with the instant it goes stale (the fleet's one staleness
  rule), fresh or not, so that a stale one is named in the decision;
* queue: the model's prefill queue as the fleet view reads it from its alive reporters (none read it: no reading);
* changes in progress: a pool whose change was started (``change_started``) and has not ended (``change_ended``)
  counts the difference asked for as starting or leaving, which pauses the policy (policy.py);
* ``decide`` (policy.py) with the controller's ``PlannerState``; an adjustment's changes are the caller's to carry
  out, each begun with ``change_started`` and closed with ``change_ended`` when the connector returns.

Pure functions (``pool_view``, ``build_observation``, ``request_totals``) and a small class holding the policy's
state and the changes in progress. Imports ``components.fleet.model`` (rank 3) and this package's policy and config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from components.fleet.model import FleetSnapshot
from components.planner.config import PlannerConfig
from components.planner.policy import (
    Adjustment,
    Observation,
    PlannerState,
    Pool,
    PoolView,
    PullFigures,
    QueueReading,
    WorkerLoad,
    decide,
    pull_figures,
)
from components.planner.sla.figures import SlaFigures


@dataclasses.dataclass(frozen=True, slots=True)
class PendingChange:
    """A pool change that has not finished: the pool had ``before`` workers when ``target`` was asked for."""

    before: int
    target: int


def pool_view(workers: int, pending: PendingChange | None) -> PoolView:
    """A pool as the policy sees it: registered workers, and the change asked for that has not finished (at least
    one starting or leaving while it runs, even when discovery already shows the new count: the connector has not
    said it is done)."""
    if pending is None or pending.target == pending.before:
        return PoolView(workers=workers)
    if pending.target > pending.before:
        return PoolView(workers=workers, starting=max(1, pending.target - workers))
    return PoolView(workers=workers, leaving=max(1, workers - pending.target))


def queue_reading(snap: FleetSnapshot, model: str) -> QueueReading | None:
    """``model``'s prefill queue as the fleet view reads it (its freshest alive reporter that could read the queue),
    None when no alive reporter did."""
    view = snap.queue(model)
    if view is None or view.waiting is None:
        return None
    age = view.report_age_s if view.report_age_s is not None else 0.0
    return QueueReading(waiting=view.waiting, in_flight=view.in_flight or 0, received_s=snap.now_s - age)


def build_observation(
    snap: FleetSnapshot,
    model: str,
    pending: Mapping[Pool, PendingChange],
    gpus_per_worker: Mapping[Pool, int | None] | None = None,
) -> Observation:
    """One pull's ``Observation`` of ``model`` from the fleet at ``snap.now_s``. Only the decode pool's loads count
    (a prefill worker's KV use is not the decode pool's). ``gpus_per_worker``: what the deployment says a pool's
    worker uses (None or absent: the config's figure)."""
    serving = snap.serving(model)
    loads = tuple(
        WorkerLoad(
            worker_id=i.instance_id,
            kv_usage=i.load.snapshot.kv_usage,
            received_s=i.load.received_s,
            stale_at_s=i.load.stale_at_s,
        )
        for i in serving
        if i.load is not None
    )
    gpus = gpus_per_worker or {}

    def view(pool: Pool, workers: int) -> PoolView:
        return dataclasses.replace(pool_view(workers, pending.get(pool)), gpus_per_worker=gpus.get(pool))

    disaggregated = snap.disaggregated(model)
    return Observation(
        now_s=snap.now_s,
        decode=view(Pool.DECODE, len(serving)),
        prefill=view(Pool.PREFILL, len(snap.prefill(model))) if disaggregated else None,
        loads=loads,
        queue=queue_reading(snap, model) if disaggregated else None,
    )


def request_totals(snap: FleetSnapshot, model: str) -> tuple[int, int]:
    """(running, waiting) requests over the decode pool's workers with a fresh load report (the fleet's rule)."""
    fresh = snap.fresh_loads(model).values()
    return sum(r.snapshot.num_running for r in fresh), sum(r.snapshot.num_waiting for r in fresh)


@dataclasses.dataclass(frozen=True, slots=True)
class PullOutcome:
    """What one pull saw and decided."""

    observation: Observation
    figures: PullFigures
    running: int
    waiting: int
    adjustment: Adjustment | None  # None: no adjustment was due at this pull
    sla: SlaFigures | None = None  # the SLA planner's numbers (components.planner.sla.controller); None: load planner


class PlannerController:
    """The load planner for one model, without I/O (module docstring). Not thread-safe: one loop owns it."""

    def __init__(self, config: PlannerConfig, model: str) -> None:
        self.config = config
        self.model = model
        self.state = PlannerState()
        self.pending: dict[Pool, PendingChange] = {}
        self.num_pulls = 0
        self.num_adjustments = 0

    def pull(self, snap: FleetSnapshot, gpus_per_worker: Mapping[Pool, int | None] | None = None) -> PullOutcome:
        """One pull at ``snap.now_s``: observe, and decide when an adjustment is due. The adjustment's changes
        (``Adjustment.changes()``) are the caller's to carry out, each announced with ``change_started``."""
        obs = build_observation(snap, self.model, self.pending, gpus_per_worker)
        figures = pull_figures(obs, self.config)
        running, waiting = request_totals(snap, self.model)
        self.num_pulls += 1
        adj, self.state = decide(self.state, obs, self.config)
        if adj is not None:
            self.num_adjustments += 1
        return PullOutcome(obs, figures, running, waiting, adj)

    def change_started(self, pool: Pool, before: int, target: int) -> None:
        """A pool change was handed to whoever carries it out: the pool counts as changing until ``change_ended``."""
        self.pending[pool] = PendingChange(before=before, target=target)

    def change_ended(self, pool: Pool) -> None:
        """The pool's change finished (or failed): the pool is settled again."""
        self.pending.pop(pool, None)

    def in_progress(self) -> dict[Pool, PendingChange]:
        return dict(self.pending)
