"""Watcher plans: a graph becomes one ``WatcherPlan`` per process (pure: no process, no file, no clock).

- ``assign_gpus`` gives each worker replica ``gpus_per_replica`` consecutive GPUs, groups in file order;
- ``plan_watchers`` turns a graph into the plans of every watcher: ``<namespace>-frontend`` and
  ``<namespace>-<group>-<i>``, each with its argv (``python -m components.cli.main ... worker|frontend``), the
  environment kvmesh adds, its GPUs, its log;
- ``plan_replica`` plans one more replica of a group (the planner's scale-up), from the same inputs.

Used by ``kvmesh serve`` (``components.deploy.local``) and by the planner's circus connector alike.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from components.deploy.errors import GpuAssignmentError
from components.deploy.graph import FRONTEND_WATCHER, Graph, WorkerGroup

REDACTED = "<redacted>"
SECRET_ENV = frozenset({"KVMESH_API_KEY"})


@dataclasses.dataclass(frozen=True, slots=True)
class WatcherPlan:
    """One watcher to start: what it runs, with which environment and GPUs, where its output goes."""

    name: str
    kind: Literal["frontend", "worker"]
    cmd: list[str]
    env: dict[str, str]  # on top of kvmesh serve's own environment
    log: Path
    graceful_timeout_s: float
    gpus: list[str] = dataclasses.field(default_factory=list)
    group: str | None = None
    replica: int | None = None
    component: str | None = None
    num_workers: int = 0

    def redacted_env(self) -> dict[str, str]:
        """``env`` as it may be written down (the state file): secrets replaced."""
        return {k: REDACTED if k in SECRET_ENV else v for k, v in self.env.items()}


# ---------------------------------------------------------------------------------------------------------------------
# GPUs


def assign_gpus(groups: Sequence[WorkerGroup], available: Sequence[str]) -> dict[str, list[str]]:
    """Watcher name -> its GPUs: consecutive blocks of ``gpus_per_replica``, groups and replicas in order.

    Example: groups a (2 replicas x 1 GPU) and b (1 x 2) over GPUs 0-3 give a-0: [0], a-1: [1], b-0: [2, 3].
    """
    needed = sum(g.replicas * g.gpus_per_replica for g in groups)
    if needed > len(available):
        detail = ", ".join(f"{g.name}: {g.replicas} x {g.gpus_per_replica}" for g in groups if g.gpus_per_replica)
        raise GpuAssignmentError(needed, list(available), detail)
    out: dict[str, list[str]] = {}
    next_gpu = 0
    for g in groups:
        for name in g.watcher_names():
            out[name] = list(available[next_gpu : next_gpu + g.gpus_per_replica])
            next_gpu += g.gpus_per_replica
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Plans


def flag_args(args: Mapping[str, Any]) -> list[str]:
    """engine_args as ``kvmesh worker`` flags, the convention of components/runtime/flags.py.

    ``speedup_ratio: .inf`` -> ``--speedup-ratio inf``; ``enable_prefix_caching: false`` ->
    ``--no-enable-prefix-caching``; a list -> comma-separated.
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            out += [flag, ",".join(_scalar(v) for v in value)]
        else:
            out += [flag, _scalar(value)]
    return out


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return str(v)


def kvmesh_argv(python: str, log_level: str, *args: str) -> list[str]:
    return [python, "-m", "components.cli.main", "--log-level", log_level, *args]


def plan_watchers(
    graph: Graph,
    *,
    etcd_endpoints: Sequence[str],
    nats_url: str,
    frontend_port: int,
    gpus: Mapping[str, list[str]],
    log_dir: Path,
    python: str = sys.executable,
) -> list[WatcherPlan]:
    """Every watcher of ``graph``: the frontend first, then each group's replicas in order."""
    base_env = {
        "KVMESH_ETCD_ENDPOINTS": ",".join(etcd_endpoints),
        "KVMESH_NATS_URL": nats_url,
        "PYTHONUNBUFFERED": "1",  # a log line reaches state/logs/ when it is written, not when a buffer fills
    }
    plans: list[WatcherPlan] = []
    fe = graph.frontend
    if fe.enabled:
        fe_args = ["frontend", "--namespace", graph.namespace, "--host", fe.host, "--port", str(frontend_port)]
        fe_args += ["--router-policy", fe.router]
        if "components" not in fe.args:  # the frontend routes to every component the graph's workers register under
            fe_args += ["--components", ",".join(dict.fromkeys(g.component for g in graph.workers))]
        fe_args += flag_args(fe.args)
        fe_env = dict(base_env)
        if fe.api_key:
            # The environment, not argv: argv is world-readable in the process list (the frontend reads both).
            fe_env["KVMESH_API_KEY"] = fe.api_key
        plans.append(
            WatcherPlan(
                name=FRONTEND_WATCHER,
                kind="frontend",
                cmd=kvmesh_argv(python, graph.log_level, *fe_args),
                env=fe_env,
                log=log_dir / f"{FRONTEND_WATCHER}.log",
                graceful_timeout_s=fe.graceful_timeout_s,
            )
        )
    for g in graph.workers:
        worker_args = ["worker", "--engine", str(g.engine), "--namespace", graph.namespace]
        worker_args += ["--component", g.component, "--model", g.model, "--model-path", g.model_path]
        worker_args += ["--num-workers", str(g.num_workers), *flag_args(g.engine_args)]
        for i, name in enumerate(g.watcher_names()):
            env = base_env | g.env
            if g.gpus_per_replica:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[name])
            plans.append(
                WatcherPlan(
                    name=name,
                    kind="worker",
                    cmd=kvmesh_argv(python, graph.log_level, *worker_args),
                    env=env,
                    log=log_dir / f"{name}.log",
                    graceful_timeout_s=g.graceful_timeout_s,
                    gpus=list(gpus.get(name, [])),
                    group=g.name,
                    replica=i,
                    component=g.component,
                    num_workers=g.num_workers,
                )
            )
    return plans
