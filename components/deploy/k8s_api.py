"""Rendered manifests (components/deploy/k8s.py) through the Kubernetes API: ``apply_objects`` and ``delete_objects``,
and ``connect`` (a kubeconfig, or the pod's own service account in a cluster). kubernetes-asyncio is the client
(asyncio, like the rest of kvmesh; its generated typed APIs cover every object used here, and its ``call_api`` takes
a server-side apply patch).

Apply is server-side apply (``PATCH`` with ``application/apply-patch+yaml``, field manager ``kvmesh``, ``force``):
one request per object whether it exists or not, and applying the same manifests twice changes nothing (the
object's ``resourceVersion`` stays). A worker Deployment that already exists keeps its replica count (the planner's,
or a person's) unless ``reset_replicas``: re-applying a graph must not undo a scale-up. Delete removes each object,
a missing one counting as deleted (idempotent too), Deployments' pods with them (foreground propagation is not
waited for: the API server's garbage collector removes the ReplicaSets and Pods).

Errors: ``KubernetesApiError`` (the API server answered with an error: its status and message) and
``KubernetesUnreachableError`` (no answer, no kubeconfig).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from components.deploy.errors import DeployError

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kvmesh"
_PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Secret": "secrets",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "Deployment": "deployments",
}


class KubernetesApiError(DeployError):
    """The API server refused a request: ``status`` (HTTP) and its message."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API: {what}: {status} {message}")
        self.status = status
        self.what = what


class KubernetesUnreachableError(DeployError):
    """No API server to talk to: no kubeconfig and not in a pod, or no answer."""


def object_path(obj: dict[str, Any], *, named: bool = True) -> str:
    """The REST path of ``obj`` (namespaced kinds only: every object kvmesh renders is)."""
    kind = obj["kind"]
    if kind not in _PLURALS:
        raise ValueError(f"kvmesh does not apply {kind} objects")
    api = obj["apiVersion"]
    ns = obj["metadata"]["namespace"]
    base = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    path = f"{base}/namespaces/{ns}/{_PLURALS[kind]}"
    return f"{path}/{obj['metadata']['name']}" if named else path


def _message(e: ApiException) -> str:
    import json

    try:
        return str(json.loads(e.body or b"{}").get("message") or e.reason)
    except (ValueError, TypeError, AttributeError):
        return str(e.reason)


async def connect(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """An API client: ``kubeconfig`` (or ``$KUBECONFIG``, ``~/.kube/config``), else the pod's own service account
    when running in a cluster."""
    configuration = k8s.Configuration()
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            await k8s_config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
    except (k8s_config.ConfigException, OSError) as e:
        raise KubernetesUnreachableError(f"no Kubernetes configuration: {e}") from None
    return k8s.ApiClient(configuration)


async def _call(api: k8s.ApiClient, what: str, path: str, method: str, **kwargs: Any) -> Any:
    try:
        return await api.call_api(
            path,
            method,
            auth_settings=["BearerToken"],
            response_types_map={200: "object", 201: "object", 202: "object"},
            _return_http_data_only=True,
            **kwargs,
        )
    except ApiException as e:
        raise KubernetesApiError(what, e.status, _message(e)) from None
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise KubernetesUnreachableError(f"Kubernetes API: {what}: {e}") from None


async def get_object(api: k8s.ApiClient, obj: dict[str, Any]) -> dict[str, Any] | None:
    """The live object of ``obj``'s kind, namespace and name; None when there is none."""
    try:
        out: dict[str, Any] = await _call(api, f"get {describe(obj)}", object_path(obj), "GET")
        return out
    except KubernetesApiError as e:
        if e.status == 404:
            return None
        raise


def describe(obj: dict[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"


async def apply_objects(
    api: k8s.ApiClient, objects: Sequence[dict[str, Any]], *, reset_replicas: bool = False
) -> list[dict[str, Any]]:
    """Server-side apply each object in order; returns ``{"object", "action"}`` per object (``created``,
    ``configured`` when it changed: its generation, or for kinds without one its resourceVersion; ``unchanged``)."""
    out = []
    for obj in objects:
        live = await get_object(api, obj)
        body = obj
        if live is not None and obj["kind"] == "Deployment" and not reset_replicas:
            # Keep the live count: the planner's (or a person's) scale, not the graph's starting one. Applied as
            # the live value rather than left out: a field this manager applied before and leaves out now would be
            # removed, and the default (1) would take its place.
            body = {**obj, "spec": {**obj["spec"], "replicas": live["spec"].get("replicas", obj["spec"]["replicas"])}}
        applied = await _call(
            api,
            f"apply {describe(obj)}",
            object_path(obj),
            "PATCH",
            query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
            body=body,
        )
        if live is None:
            action = "created"
        else:
            # A Deployment's generation moves only with its spec; its resourceVersion also with the status the
            # controllers keep writing. Other kinds have no status: their resourceVersion says it.
            key = "generation" if "generation" in live["metadata"] else "resourceVersion"
            action = "unchanged" if applied["metadata"].get(key) == live["metadata"].get(key) else "configured"
        out.append({"object": describe(obj), "action": action})
    return out


async def delete_objects(api: k8s.ApiClient, objects: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Delete each object (in reverse order: the Deployments before what they use); a missing one is ``absent``."""
    out = []
    for obj in reversed(objects):
        try:
            await _call(
                api,
                f"delete {describe(obj)}",
                object_path(obj),
                "DELETE",
                header_params={"Content-Type": "application/json", "Accept": "application/json"},
                body={"propagationPolicy": "Background"},
            )
            out.append({"object": describe(obj), "action": "deleted"})
        except KubernetesApiError as e:
            if e.status != 404:
                raise
            out.append({"object": describe(obj), "action": "absent"})
    return out
