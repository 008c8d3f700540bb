"""A graph as Kubernetes manifests (pure: no API call, no process, no clock): ``render_manifests``.

What a graph becomes (``kvmesh k8s render``; docs/kubernetes.md):

- one **Deployment per worker group** (``<namespace>-<group>``, lower-cased, '_' as '-'): one pod = one replica,
  ``replicas`` of them; the container runs ``kvmesh worker`` with the flags ``kvmesh serve`` would give the group's
  watcher (``plan_replica``), GPUs as ``nvidia.com/gpu`` limits (``gpus_per_replica``; the device plugin, not
  kvmesh, picks them), readiness from the worker having registered (the worker writes ``KVMESH_READY_FILE`` once
  every engine of the process is registered, and removes it when it starts draining), a ``preStop`` that sends the
  worker SIGTERM and waits for it to exit (it leaves etcd at once, finishes or hands on its requests, exits), within
  ``terminationGracePeriodSeconds`` = the group's ``graceful_timeout_s``;
- the **frontend** (Deployment + ClusterIP Service on its port; it binds 0.0.0.0 inside the pod, the one place
  kvmesh does not bind loopback: the Service must reach it), readiness on ``/health``;
- a **ConfigMap** with the graph file as given (mounted read-only at /etc/kvmesh/graph.yaml in every pod);
- the **planner** when the graph has one (``kvmesh planner --environment kubernetes``), with its ServiceAccount,
  Role (get/list/watch deployments; get/patch/update deployments/scale; get/list/watch/patch pods, for the
  ``controller.kubernetes.io/pod-deletion-cost`` annotation on the pod that leaves) and RoleBinding, in its
  namespace only;
- the **rescheduler** when the graph runs one as its own process.

Every pod gets, from the downward API, ``KVMESH_RESPONSE_HOST`` (the pod IP: loopback does not cross pods),
``KVMESH_POD_NAME`` and ``KVMESH_NODE_NAME`` (a worker's failure domains: the node it runs on, the pod its process).
etcd and NATS must be external: ``embedded`` in the graph is refused (``EmbeddedInfrastructureError``) unless
``etcd_endpoints`` and ``nats_url`` are given here. Credentials come from a Secret (``credentials_secret``): its
optional keys ``etcd-username``, ``etcd-password``, ``nats-user``, ``nats-password`` and ``nats-token`` become the
environment variables the runtime reads them from (``components.runtime.credentials``; never flags, which any
process on the node can read).

Labels: ``app.kubernetes.io/managed-by: kvmesh``, ``kvmesh.io/namespace``, ``kvmesh.io/component`` (frontend,
worker, planner, rescheduler); a worker Deployment also ``kvmesh.io/group`` and ``kvmesh.io/pool`` (decode or
prefill: which planner pool it is), and the model it serves in the annotation ``kvmesh.io/model`` (a model name may
hold '/', which a label value may not). The planner's connector finds its pools by these.

Imports only ``components.deploy`` (graph, plan, errors) and the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from components.deploy.errors import DeployError
from components.deploy.graph import Graph
from components.deploy.plan import WatcherPlan, plan_frontend, plan_planner, plan_replica, plan_rescheduler

MANAGED_BY = "app.kubernetes.io/managed-by"
NAMESPACE_LABEL = "kvmesh.io/namespace"
COMPONENT_LABEL = "kvmesh.io/component"
GROUP_LABEL = "kvmesh.io/group"
POOL_LABEL = "kvmesh.io/pool"
MODEL_ANNOTATION = "kvmesh.io/model"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
GPU_RESOURCE = "nvidia.com/gpu"
READY_FILE = "/tmp/kvmesh-ready"
GRAPH_MOUNT = "/etc/kvmesh"
DEFAULT_FRONTEND_PORT = 8000
# The credentials Secret's keys, by the environment variable each becomes (components/runtime/credentials.py).
SECRET_KEYS = {
    "KVMESH_ETCD_USERNAME": "etcd-username",
    "KVMESH_ETCD_PASSWORD": "etcd-password",
    "KVMESH_NATS_USER": "nats-user",
    "KVMESH_NATS_PASSWORD": "nats-password",
    "KVMESH_NATS_TOKEN": "nats-token",
}
# The preStop hook: SIGTERM to the worker (PID 1: the image's entrypoint is kvmesh itself), then wait while it drains,
# so the kubelet's own SIGTERM after the hook finds it gone or going. The grace period bounds the whole of it.
PRE_STOP = ["/bin/sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 0.5; done"]


class EmbeddedInfrastructureError(DeployError):
    """A graph whose etcd or NATS is ``embedded``: a cluster needs external ones."""

    exit_code = 2

    def __init__(self, which: Sequence[str]) -> None:
        names = " and ".join(which)
        super().__init__(
            f"the graph's {names} {'is' if len(which) == 1 else 'are'} embedded: on Kubernetes kvmesh starts no etcd "
            "or NATS; give external ones in the graph's infrastructure section (etcd: {endpoints: [...]}, nats: "
            "{url: ...}) or with --etcd-endpoints and --nats-url"
        )
        self.which = list(which)


@dataclasses.dataclass(frozen=True, slots=True)
class RenderOptions:
    """How a graph is rendered beyond what the graph says."""

    image: str = "kvmesh:latest"  # an image with kvmesh installed (the ``kvmesh`` command) and the models
    k8s_namespace: str = "default"
    image_pull_policy: str = "IfNotPresent"
    # Where the graph's base directory (what its relative paths resolve against) is inside the image: model paths
    # under it are rewritten to be under this.
    image_root: str = "/opt/kvmesh"
    etcd_endpoints: tuple[str, ...] = ()  # replace the graph's etcd (needed when it is embedded)
    nats_url: str | None = None  # replace the graph's NATS (needed when it is embedded)
    credentials_secret: str | None = None
    frontend_port: int = DEFAULT_FRONTEND_PORT  # when the graph's frontend port is 0 (a free one: no use in a pod)


def k8s_name(*parts: str) -> str:
    """A DNS-1123 label from kvmesh names ('_' and upper case are not allowed there): at most 63 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    if not name:
        raise ValueError(f"no Kubernetes name can be made of {parts!r}")
    if not name[0].isalpha():
        name = f"k-{name}"
    return name[:63].rstrip("-")


def deployment_name(namespace: str, group: str) -> str:
    return k8s_name(namespace, group)


def frontend_name(namespace: str) -> str:
    return k8s_name(namespace, "frontend")


def planner_name(namespace: str) -> str:
    return k8s_name(namespace, "planner")


def rescheduler_name(namespace: str) -> str:
    return k8s_name(namespace, "rescheduler")


def graph_config_name(namespace: str) -> str:
    return k8s_name(namespace, "graph")


def labels(namespace: str, component: str, **more: str) -> dict[str, str]:
    return {MANAGED_BY: "kvmesh", NAMESPACE_LABEL: namespace, COMPONENT_LABEL: component, **more}


def selector(namespace: str, component: str, **more: str) -> dict[str, str]:
    """The labels that pick a component's pods (``kvmesh.io/group`` too for a worker group)."""
    return {NAMESPACE_LABEL: namespace, COMPONENT_LABEL: component, **more}


def pool_of_role(role: str) -> str:
    """The planner pool a worker role belongs to (components.planner.policy.Pool's values)."""
    return "prefill" if role == "prefill" else "decode"


def _endpoints(graph: Graph, options: RenderOptions) -> tuple[list[str], str]:
    infra = graph.infrastructure
    etcd = list(options.etcd_endpoints) or ([] if infra.etcd.embedded else list(infra.etcd.endpoints or []))
    nats = options.nats_url or (None if infra.nats.embedded else infra.nats.url)
    missing = [name for name, ok in (("etcd", bool(etcd)), ("NATS", bool(nats))) if not ok]
    if missing:
        raise EmbeddedInfrastructureError(missing)
    assert nats is not None
    return etcd, nats


def _container_args(plan: WatcherPlan) -> list[str]:
    """A watcher's command as the image runs it: ``kvmesh ...`` (the plan's is ``python -m components.cli.main``)."""
    assert plan.cmd[1:3] == ["-m", "components.cli.main"], plan.cmd
    return ["kvmesh", *plan.cmd[3:]]


def _env(plan: WatcherPlan, options: RenderOptions, extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    values = {k: v for k, v in plan.env.items() if k != "CUDA_VISIBLE_DEVICES"} | (extra or {})
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(values.items())]
    for name, path in (
        ("KVMESH_RESPONSE_HOST", "status.podIP"),
        ("KVMESH_POD_NAME", "metadata.name"),
        ("KVMESH_NODE_NAME", "spec.nodeName"),
    ):
        env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    if options.credentials_secret:
        for name, key in SECRET_KEYS.items():
            ref = {"name": options.credentials_secret, "key": key, "optional": True}
            env.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
    return env


def _pod_spec(
    plan: WatcherPlan,
    options: RenderOptions,
    graph_config: str,
    *,
    extra_env: dict[str, str] | None = None,
    ports: Sequence[int] = (),
    readiness: dict[str, Any] | None = None,
    gpus: int = 0,
    pre_stop: bool = False,
    service_account: str | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": plan.kind,
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": _container_args(plan),
        "env": _env(plan, options, extra_env),
        "volumeMounts": [{"name": "graph", "mountPath": GRAPH_MOUNT, "readOnly": True}],
    }
    if ports:
        # "protocol" spelled out: server-side apply keys these lists by (port, protocol) and refuses one without it.
        container["ports"] = [
            {"containerPort": p, "name": "http" if i == 0 else f"p{i}", "protocol": "TCP"} for i, p in enumerate(ports)
        ]
    if readiness is not None:
        container["readinessProbe"] = readiness
    if gpus:
        container["resources"] = {"limits": {GPU_RESOURCE: gpus}}
    if pre_stop:
        container["lifecycle"] = {"preStop": {"exec": {"command": PRE_STOP}}}
    spec: dict[str, Any] = {
        "containers": [container],
        # The kubelet waits this long after the preStop hook began before it kills the container.
        "terminationGracePeriodSeconds": math.ceil(plan.graceful_timeout_s),
        "volumes": [{"name": "graph", "configMap": {"name": graph_config}}],
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return spec


def _deployment(
    name: str, namespace: str, meta_labels: dict[str, str], sel: dict[str, str], replicas: int, pod: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": meta_labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": sel},
            "template": {"metadata": {"labels": meta_labels}, "spec": pod},
        },
    }


def _in_image(cmd: list[str], base: Path, options: RenderOptions) -> list[str]:
    """``cmd`` with every path of this machine under the graph's base directory (a model path, the planner's
    TensorBoard directory: the graph resolved them there) rewritten to where it is inside the image. Paths outside
    the base directory stay: the image must have them at the same place."""
    out = []
    for a in cmd:
        if a.startswith("/"):
            try:
                a = str(Path(options.image_root) / Path(a).relative_to(base))
            except ValueError:
                pass
        out.append(a)
    return out


def render_manifests(graph: Graph, graph_text: str, base_dir: Path, options: RenderOptions) -> list[dict[str, Any]]:
    """Every object of the graph's deployment on Kubernetes (module docstring), in the order to create them."""
    etcd, nats = _endpoints(graph, options)
    ns, k8s_ns = graph.namespace, options.k8s_namespace
    config = graph_config_name(ns)
    where = {"etcd_endpoints": etcd, "nats_url": nats, "log_dir": Path("/tmp"), "python": "python"}
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config, "namespace": k8s_ns, "labels": labels(ns, "graph")},
            "data": {"graph.yaml": graph_text},
        }
    ]
    if graph.frontend.enabled:
        port = graph.frontend.port or options.frontend_port
        plan = plan_frontend(graph, frontend_port=port, **where)  # type: ignore[arg-type]
        # The Service reaches it at the pod's IP: it binds every address of the pod, not the graph's loopback.
        plan = dataclasses.replace(plan, cmd=[*_without_option(plan.cmd, "--host"), "--host", "0.0.0.0"])
        name = frontend_name(ns)
        readiness = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 2, "failureThreshold": 3}
        pod = _pod_spec(plan, options, config, ports=[port], readiness=readiness)
        replicas = 1  # the frontend's own replicas (processes on one port) run inside the one pod
        objects.append(_deployment(name, k8s_ns, labels(ns, "frontend"), selector(ns, "frontend"), replicas, pod))
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": k8s_ns, "labels": labels(ns, "frontend")},
                "spec": {
                    "type": "ClusterIP",
                    "selector": selector(ns, "frontend"),
                    "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}],
                },
            }
        )
    for g in graph.workers:
        gpus = [str(i) for i in range(g.gpus_per_replica)]  # placeholders: the device plugin assigns real ones
        plan = plan_replica(graph, g.name, 0, gpus=gpus, **where)  # type: ignore[arg-type]
        plan = dataclasses.replace(plan, cmd=_in_image(plan.cmd, base_dir, options))
        name = deployment_name(ns, g.name)
        pool = pool_of_role(str(g.role))
        meta = labels(ns, "worker", **{GROUP_LABEL: k8s_name(g.name), POOL_LABEL: pool})
        readiness = {"exec": {"command": ["test", "-f", READY_FILE]}, "periodSeconds": 2, "failureThreshold": 1}
        pod = _pod_spec(
            plan,
            options,
            config,
            extra_env={"KVMESH_READY_FILE": READY_FILE},
            readiness=readiness,
            gpus=g.gpus_per_replica,
            pre_stop=True,
        )
        sel = selector(ns, "worker", **{GROUP_LABEL: k8s_name(g.name)})
        dep = _deployment(name, k8s_ns, meta, sel, g.replicas, pod)
        dep["metadata"]["annotations"] = {MODEL_ANNOTATION: g.model}
        objects.append(dep)
    if graph.planner is not None:
        objects += _planner_objects(graph, options, config, where, base_dir)
    if graph.rescheduler_watcher_runs():
        plan = plan_rescheduler(graph, state_dir=Path("/tmp"), **where)  # type: ignore[arg-type]
        plan = dataclasses.replace(plan, cmd=_without_option(plan.cmd, "--state-dir"))
        pod = _pod_spec(plan, options, config)
        name = rescheduler_name(ns)
        objects.append(_deployment(name, k8s_ns, labels(ns, "rescheduler"), selector(ns, "rescheduler"), 1, pod))
    return objects


def planner_rules() -> list[dict[str, Any]]:
    """What the planner may do, in its namespace only: read Deployments, set their scale, mark the pod that leaves."""
    return [
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch", "update"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
    ]


def _planner_objects(
    graph: Graph, options: RenderOptions, config: str, where: dict[str, Any], base_dir: Path
) -> list[dict[str, Any]]:
    ns, k8s_ns = graph.namespace, options.k8s_namespace
    name = planner_name(ns)
    plan = plan_planner(graph, state_dir=Path("/tmp"), **where)
    cmd = _without_option(plan.cmd, "--state-dir")
    i = cmd.index("--environment")
    cmd[i + 1] = "kubernetes"
    cmd[i + 2 : i + 2] = ["--k8s-namespace", k8s_ns]
    plan = dataclasses.replace(plan, cmd=_in_image(cmd, base_dir, options))
    meta = {"name": name, "namespace": k8s_ns, "labels": labels(ns, "planner")}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": planner_rules()},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": k8s_ns}],
        },
        _deployment(
            name,
            k8s_ns,
            labels(ns, "planner"),
            selector(ns, "planner"),
            1,
            _pod_spec(plan, options, config, service_account=name),
        ),
    ]


def _without_option(cmd: list[str], option: str) -> list[str]:
    """``cmd`` without ``option`` and its value."""
    if option not in cmd:
        return list(cmd)
    i = cmd.index(option)
    return cmd[:i] + cmd[i + 2 :]


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # no &id001 anchors: a manifest reads as written, each object whole


def to_yaml(objects: Sequence[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML stream, as ``kubectl apply -f`` reads it."""
    return "---\n".join(yaml.dump(o, Dumper=_Dumper, sort_keys=False) for o in objects)
