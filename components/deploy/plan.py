"""Watcher plans: a graph becomes one ``WatcherPlan`` per process (pure: no process, no file, no clock).

- ``assign_gpus`` gives each worker replica ``gpus_per_replica`` consecutive GPUs, groups in file order;
- ``plan_watchers`` turns a graph into the plans of every watcher: ``<namespace>-frontend`` and
  ``<namespace>-<group>-<i>``, each with its argv (``python -m components.cli.main ... worker|frontend``, every
  option derived from the graph section through ``components.runtime.flags.argv_for``), the environment kvmesh
  adds, its GPUs, its log;
- ``plan_frontend``, ``plan_replica``, ``plan_planner`` and ``plan_rescheduler`` plan one watcher each (the
  planner's is ``<namespace>-planner``, when the graph has a ``planner:`` section: ``kvmesh planner --environment
  local`` on serve's state directory; the rescheduler's ``<namespace>-rescheduler``, when the graph has a
  ``rescheduler:`` section that is not colocated: ``kvmesh rescheduler`` on serve's state directory; a colocated one
  adds its flags to the frontend's command instead).

Used by ``kvmesh serve`` (``components.deploy.local``) and by the planner's circus connector alike.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from components.deploy.errors import GpuAssignmentError
from components.deploy.graph import Graph, frontend_watcher, planner_watcher, replica_watcher, rescheduler_watcher
from components.rescheduler.config import REPORTED_PREFIXES, Policy
from components.runtime.flags import argv_for

REDACTED = "<redacted>"
SECRET_ENV = frozenset({"KVMESH_API_KEY"})


@dataclasses.dataclass(frozen=True, slots=True)
class WatcherPlan:
    """One watcher to start: what it runs, with which environment and GPUs, where its output goes."""

    name: str
    kind: Literal["frontend", "worker", "planner", "rescheduler"]
    cmd: list[str]
    env: dict[str, str]  # on top of kvmesh serve's own environment
    log: Path
    graceful_timeout_s: float
    gpus: list[str] = dataclasses.field(default_factory=list)
    group: str | None = None
    replica: int | None = None
    component: str | None = None
    model: str | None = None
    role: str | None = None
    num_workers: int = 0

    def redacted_env(self) -> dict[str, str]:
        """``env`` as it may be written down (the state file): secrets replaced."""
        return {k: REDACTED if k in SECRET_ENV else v for k, v in self.env.items()}


# ---------------------------------------------------------------------------------------------------------------------
# GPUs


def assign_gpus(namespace: str, groups: Sequence[Any], available: Sequence[str]) -> dict[str, list[str]]:
    """Watcher name -> its GPUs: consecutive blocks of ``gpus_per_replica``, groups and replicas in order.

    Example: groups a (2 replicas x 1 GPU) and b (1 x 2) over GPUs 0-3 give ns-a-0: [0], ns-a-1: [1], ns-b-0: [2, 3].
    """
    needed = sum(g.replicas * g.gpus_per_replica for g in groups)
    if needed > len(available):
        detail = ", ".join(f"{g.name}: {g.replicas} x {g.gpus_per_replica}" for g in groups if g.gpus_per_replica)
        raise GpuAssignmentError(needed, list(available), detail)
    out: dict[str, list[str]] = {}
    next_gpu = 0
    for g in groups:
        for name in g.watcher_names(namespace):
            out[name] = list(available[next_gpu : next_gpu + g.gpus_per_replica])
            next_gpu += g.gpus_per_replica
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Plans


def kvmesh_argv(python: str, log_level: str, *args: str) -> list[str]:
    return [python, "-m", "components.cli.main", "--log-level", log_level, *args]


def base_env(etcd_endpoints: Sequence[str], nats_url: str) -> dict[str, str]:
    return {
        "KVMESH_ETCD_ENDPOINTS": ",".join(etcd_endpoints),
        "KVMESH_NATS_URL": nats_url,
        "PYTHONUNBUFFERED": "1",  # a log line reaches state/logs/ when it is written, not when a buffer fills
    }


def runtime_argv(graph: Graph) -> list[str]:
    """The graph's runtime section as flags of any component (only the settings it gives)."""
    rt = graph.runtime
    return argv_for({k: getattr(rt, k) for k in sorted(rt.model_fields_set)})


def plan_frontend(
    graph: Graph,
    *,
    etcd_endpoints: Sequence[str],
    nats_url: str,
    frontend_port: int,
    log_dir: Path,
    python: str = sys.executable,
) -> WatcherPlan:
    """The frontend's watcher: ``kvmesh frontend`` with the section's FrontendConfig fields as flags."""
    fe = graph.frontend
    values = fe.component_values()
    api_key = values.pop("api_key", None)
    values["port"] = frontend_port  # the port chosen at start (a free one when the graph says 0)
    # The frontend routes to every component the graph's workers register under, unless told otherwise.
    values.setdefault("components", list(dict.fromkeys(g.component for g in graph.workers)))
    resched = graph.rescheduler
    if resched is not None and resched.runs and not resched.colocated:
        if Policy.PREFIX_REPLICATION in resched.rescheduling_policies:
            # The standalone rescheduler's replication reads the frontend's request reports' prefixes (a colocated
            # one turns them on in the frontend process itself: components/cli/frontend.py).
            values.setdefault("request_stats_prefixes", REPORTED_PREFIXES)
    args = ["frontend", "--namespace", graph.namespace, *runtime_argv(graph), *argv_for(values)]
    if graph.rescheduler is not None and graph.rescheduler.colocated:
        args += argv_for(graph.rescheduler.colocated_values())
    env = base_env(etcd_endpoints, nats_url)
    if api_key:
        # The environment, not argv: argv is world-readable in the process list (the frontend reads both).
        env["KVMESH_API_KEY"] = api_key
    name = frontend_watcher(graph.namespace)
    return WatcherPlan(
        name=name,
        kind="frontend",
        cmd=kvmesh_argv(python, graph.log_level, *args),
        env=env,
        log=log_dir / f"{name}.log",
        graceful_timeout_s=fe.graceful_timeout_s,
    )


def plan_replica(
    graph: Graph,
    group_name: str,
    replica: int,
    *,
    etcd_endpoints: Sequence[str],
    nats_url: str,
    gpus: Sequence[str] = (),
    log_dir: Path,
    python: str = sys.executable,
) -> WatcherPlan:
    """Replica ``replica`` of worker group ``group_name``: ``kvmesh worker`` with the group's WorkerConfig and engine
    fields as flags. (The planner adds replicas by copying a running one's watcher, from the state file.)"""
    g = graph.group(group_name)
    if len(gpus) != g.gpus_per_replica:
        raise GpuAssignmentError(g.gpus_per_replica, list(gpus), f"{g.name}: 1 x {g.gpus_per_replica}")
    args = ["worker", "--namespace", graph.namespace, *runtime_argv(graph), *argv_for(g.component_values())]
    env = base_env(etcd_endpoints, nats_url) | g.env
    if g.gpus_per_replica:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    name = replica_watcher(graph.namespace, g.name, replica)
    return WatcherPlan(
        name=name,
        kind="worker",
        cmd=kvmesh_argv(python, graph.log_level, *args),
        env=env,
        log=log_dir / f"{name}.log",
        graceful_timeout_s=g.graceful_timeout_s,
        gpus=list(gpus),
        group=g.name,
        replica=replica,
        component=g.component,
        model=g.model,
        role=str(g.role),
        num_workers=g.num_workers,
    )


def plan_planner(
    graph: Graph,
    *,
    etcd_endpoints: Sequence[str],
    nats_url: str,
    state_dir: Path,
    log_dir: Path,
    python: str = sys.executable,
) -> WatcherPlan:
    """The planner's watcher: ``kvmesh planner --environment local`` on this deployment (its state file in
    ``state_dir``), with the graph's ``planner:`` fields as flags."""
    if graph.planner is None:
        raise ValueError(f"graph {graph.namespace!r} has no planner section")
    args = ["planner", "--namespace", graph.namespace, "--environment", "local", "--state-dir", str(state_dir)]
    args += [*runtime_argv(graph), *argv_for(graph.planner.component_values())]
    name = planner_watcher(graph.namespace)
    return WatcherPlan(
        name=name,
        kind="planner",
        cmd=kvmesh_argv(python, graph.log_level, *args),
        env=base_env(etcd_endpoints, nats_url),
        log=log_dir / f"{name}.log",
        graceful_timeout_s=graph.planner.graceful_timeout_s,
        model=graph.planner.served_model_name,
    )


def plan_rescheduler(
    graph: Graph,
    *,
    etcd_endpoints: Sequence[str],
    nats_url: str,
    state_dir: Path,
    log_dir: Path,
    python: str = sys.executable,
) -> WatcherPlan:
    """The rescheduler's watcher: ``kvmesh rescheduler`` on this deployment (its state file in ``state_dir``), with
    the graph's ``rescheduler:`` fields as flags."""
    if graph.rescheduler is None:
        raise ValueError(f"graph {graph.namespace!r} has no rescheduler section")
    args = ["rescheduler", "--namespace", graph.namespace, "--state-dir", str(state_dir)]
    args += [*runtime_argv(graph), *argv_for(graph.rescheduler.component_values())]
    name = rescheduler_watcher(graph.namespace)
    return WatcherPlan(
        name=name,
        kind="rescheduler",
        cmd=kvmesh_argv(python, graph.log_level, *args),
        env=base_env(etcd_endpoints, nats_url),
        log=log_dir / f"{name}.log",
        graceful_timeout_s=graph.rescheduler.graceful_timeout_s,
        component=graph.rescheduler.component,
    )


def plan_watchers(
    graph: Graph,
    *,
    etcd_endpoints: Sequence[str],
    nats_url: str,
    frontend_port: int,
    gpus: Mapping[str, list[str]],
    log_dir: Path,
    state_dir: Path | None = None,
    python: str = sys.executable,
) -> list[WatcherPlan]:
    """Every watcher of ``graph``: the frontend first, then each group's replicas in order, then the planner and the
    rescheduler (they need ``state_dir``). Circus stops them all at once; the planner changes nothing once the state
    file says the deployment is no longer ``ready`` (components/planner/connectors/local.py)."""
    where = {"etcd_endpoints": etcd_endpoints, "nats_url": nats_url, "log_dir": log_dir, "python": python}
    plans: list[WatcherPlan] = []
    if graph.frontend.enabled:
        plans.append(plan_frontend(graph, frontend_port=frontend_port, **where))  # type: ignore[arg-type]
    for g in graph.workers:
        for i, name in enumerate(g.watcher_names(graph.namespace)):
            plans.append(plan_replica(graph, g.name, i, gpus=gpus.get(name, []), **where))  # type: ignore[arg-type]
    if graph.planner is not None:
        if state_dir is None:
            raise ValueError("a graph with a planner section needs the state directory its planner reads")
        plans.append(plan_planner(graph, state_dir=state_dir, **where))  # type: ignore[arg-type]
    if graph.rescheduler_watcher_runs():
        if state_dir is None:
            raise ValueError("a graph with a rescheduler section needs the state directory its rescheduler reads")
        plans.append(plan_rescheduler(graph, state_dir=state_dir, **where))  # type: ignore[arg-type]
    return plans
