"""The planner inside the simulator: ``PlannerController`` (controller.py, the function the live planner's loop calls)
or the SLA planner's ``SlaController`` (sla/controller.py, the same surface) as a ``components.sim.dynamics.Scaler``.
Which one: the config's type (``PlannerConfig``: the load planner, ``SlaPlannerConfig``: the SLA planner), or a
controller built by the caller (``controller=``, e.g. an ``SlaController`` with a measured profile as its model).
An SLA planner built from its config is warm-started from the config's ``load_predictor_warmup_trace``, as the live
planner is (sla_warmup.py).
``components.sim.replay`` calls ``pull`` every ``metric_pulling_interval`` with its fleet view's snapshot (fed on the
virtual clock by the same calls the live view makes) and carries out the pool sizes it returns through its modelled
connector, which says when a change is done (``resize_done``), as a live connector's ``set_pool_size`` returns.

Every pull is kept (``pulls``: the figures a live planner writes to TensorBoard at every pull), and every adjustment
with its wall of reasons (``adjustments``), so that ``kvmesh simulate`` and ``kvmesh bench planner`` report what the
planner saw and decided. Imports the simulator (rank 6) and this package's controller: its imports point down.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from components.fleet.model import FleetSnapshot
from components.planner.config import PlannerConfig
from components.planner.controller import PlannerController, PullOutcome
from components.planner.policy import Adjustment, Direction, Pool
from components.planner.sla.config import SlaPlannerConfig
from components.planner.sla.controller import SlaController
from components.planner.sla_profile import load_profile_results
from components.planner.sla_warmup import warmup_series
from components.sim.dynamics import DECODE, PoolState, Resize
from components.sim.replay import MODEL


@dataclasses.dataclass(frozen=True, slots=True)
class PlannerPull:
    """One simulated pull: what the controller saw and decided, and the pools as the connector counted them."""

    now_s: float
    outcome: PullOutcome
    pools: Mapping[str, PoolState]


class SimulatedPlanner:
    """A planner as the simulator's scaler (module docstring). ``start_s``/``until_s``: the pulls' span on the
    simulation's clock; ``gpus_per_worker``: what the deployment says a pool's worker uses (None: the config's);
    ``controller``: the controller to drive (None: one built from ``config`` for ``model``, the SLA planner's with the
    profile its ``profile_results_dir`` names, read here; given, ``config`` must be its config)."""

    def __init__(
        self,
        config: PlannerConfig | SlaPlannerConfig,
        *,
        start_s: float = 0.0,
        until_s: float = math.inf,
        model: str = MODEL,
        gpus_per_worker: Mapping[Pool, int | None] | None = None,
        controller: PlannerController | SlaController | None = None,
    ) -> None:
        self.config = config
        if controller is None:
            if isinstance(config, SlaPlannerConfig):
                perf = load_profile_results(config.profile_results_dir) if config.profile_results_dir else None
                controller = SlaController(config, model, perf)
                if config.load_predictor_warmup_trace:
                    series = warmup_series(config.load_predictor_warmup_trace, config.adjustment_interval)
                    controller.warm_start(series.rates, series.isls, series.osls)
            else:
                controller = PlannerController(config, model)
        elif controller.config is not config:
            raise ValueError("SimulatedPlanner: config must be the controller's own config")
        self.controller: PlannerController | SlaController = controller
        # The Scaler's cadence (components.sim.dynamics): a pull every interval_s from start_s until before until_s.
        self.interval_s = config.metric_pulling_interval
        self.start_s = start_s
        self.until_s = until_s
        self.gpus_per_worker = dict(gpus_per_worker or {})
        self.pulls: list[PlannerPull] = []
        self.adjustments: list[Adjustment] = []
        self.would: dict[str, int] = {"up": 0, "down": 0}  # under no_operation: changes it would have made

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]:
        out = self.controller.pull(fleet, self.gpus_per_worker)
        self.pulls.append(PlannerPull(now_s, out, dict(pools)))
        adj = out.adjustment
        if adj is None:
            return ()
        self.adjustments.append(adj)
        for d in adj.decisions:
            if d.direction != Direction.HOLD and d.no_operation:
                self.would[str(d.direction)] += 1
        resizes = []
        for d in adj.changes():
            self.controller.change_started(d.pool, d.current, d.target)
            resizes.append(Resize(str(d.pool), d.current, d.target, d.reason))
        return resizes

    def resize_done(self, pool: str, now_s: float) -> None:
        self.controller.change_ended(Pool(pool))


__all__ = ["DECODE", "PlannerPull", "SimulatedPlanner"]
