"""A graph file as the simulator's fleet: what ``kvmesh simulate`` replays a trace on (``simulated_deployment``).

Lives in ``deploy`` because it reads a ``Graph`` (the schema ``kvmesh serve`` validates), and hands ``components.sim``
(below it) a ``FleetSpec`` and the frontend's ``RouterConfig``:

* the groups whose role is ``aggregated`` or ``decode`` are the engines the router places requests on, the
  ``prefill`` groups the prefill engines behind the prefill queue; each group counts ``replicas x num_workers``
  engines, as ``kvmesh serve`` starts them;
* each engine's config is the group's own ``MockEngineConfig`` fields (its step-time model included: the same
  ``components.perf`` model the served mock engine sleeps), and the decode groups' ``max_local_prefill_length`` and
  ``max_prefill_queue_size`` are the disaggregation rule's thresholds;
* the router is the frontend section's (``FrontendConfig`` is a ``RouterConfig``): policy, seed and every knob.

What cannot be simulated is refused with the reason (``WhatIfError``): a group whose engine is not ``mock`` (the
simulator runs the mock engine's scheduler; its step times can come from ``kvmesh profile``'s fit of a real engine
set on a mock group), groups of one role with different engine configs, several models.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from components.deploy.errors import DeployError
from components.deploy.graph import Graph
from components.protocol.metadata import WorkerRole
from components.router.config import RouterConfig
from components.sim import FleetSpec
from components.workers.simulated import MockEngineConfig


class WhatIfError(DeployError):
    """A graph that the simulator cannot replay, with the reason."""


@dataclasses.dataclass(frozen=True)
class SimulatedDeployment:
    """A graph as the simulator runs it."""

    fleet: FleetSpec
    router: RouterConfig
    model: str
    groups: dict[str, dict[str, Any]]  # group name -> role, engines (for the report)

    @property
    def vocab_size(self) -> int:
        return self.fleet.engine.vocab_size


def _engine_config(group: Any) -> MockEngineConfig:
    values = group.component_values()
    config = MockEngineConfig.model_validate({k: v for k, v in values.items() if k in MockEngineConfig.model_fields})
    if config.is_infinitely_fast:
        raise WhatIfError(
            f"worker group {group.name!r} runs at speedup_ratio inf: its engines never sleep, so their time is the "
            "host's CPU, not a model the simulator can replay; set a finite speedup_ratio (1 = the modelled GPU in "
            "real time) to simulate it"
        )
    return config


def _one(configs: dict[str, Any], what: str) -> Any:
    distinct = {repr(c) for c in configs.values()}
    if len(distinct) > 1:
        raise WhatIfError(
            f"the {what} groups {sorted(configs)} have different engine settings; the simulator replays one engine "
            f"configuration per role: give them the same settings"
        )
    return next(iter(configs.values()))


def simulated_deployment(graph: Graph) -> SimulatedDeployment:
    """``graph``'s fleet and router for ``components.sim.replay`` (module docstring)."""
    routed: dict[str, MockEngineConfig] = {}
    prefill: dict[str, MockEngineConfig] = {}
    thresholds: dict[str, tuple[int, int]] = {}
    counts = {"routed": 0, "prefill": 0}
    groups: dict[str, dict[str, Any]] = {}
    models = set()
    for g in graph.workers:
        engine = getattr(g, "engine", None)
        if str(engine) != "mock":
            raise WhatIfError(
                f"worker group {g.name!r} runs the {engine} engine; kvmesh simulate replays simulated (mock) engines "
                "only: set engine: mock with the step-time coefficients of a profile (kvmesh profile) to simulate it"
            )
        n = g.replicas * g.num_workers
        role = WorkerRole(getattr(g, "role", WorkerRole.AGGREGATED))
        models.add(g.model)
        groups[g.name] = {"role": str(role), "engines": n}
        if n == 0:
            continue
        if role is WorkerRole.PREFILL:
            prefill[g.name] = _engine_config(g)
            counts["prefill"] += n
        else:
            routed[g.name] = _engine_config(g)
            counts["routed"] += n
            if role is WorkerRole.DECODE:
                thresholds[g.name] = (g.max_local_prefill_length, g.max_prefill_queue_size)
    if len(models) > 1:
        raise WhatIfError(f"the graph serves several models ({sorted(models)}); kvmesh simulate replays one")
    if not routed:
        raise WhatIfError("the graph has no aggregated or decode worker to route requests to")
    if prefill and not thresholds:
        raise WhatIfError("the graph has prefill workers but no decode worker to hand their prompts to")
    decode_engine = _one(routed, "aggregated/decode")
    prefill_engine = _one(prefill, "prefill") if prefill else decode_engine
    local, queue = _one(thresholds, "decode") if thresholds else (FleetSpec.max_local_prefill_length, 0)
    fleet = FleetSpec(
        workers=counts["routed"],
        engine=prefill_engine,
        prefill=counts["prefill"],
        decode_engine=decode_engine if decode_engine != prefill_engine else None,
        max_local_prefill_length=local,
        max_prefill_queue_size=queue if prefill else FleetSpec.max_prefill_queue_size,
    )
    front = graph.frontend
    router = RouterConfig.model_validate({k: getattr(front, k) for k in RouterConfig.model_fields})
    return SimulatedDeployment(fleet=fleet, router=router, model=next(iter(models)), groups=groups)
