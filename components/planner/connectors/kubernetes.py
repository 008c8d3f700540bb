"""The ``kubernetes`` environment: the planner scales the worker Deployments that ``kvmesh k8s apply`` created
(components/deploy/k8s.py), through the API server (kubernetes-asyncio: in-cluster config in a pod, a kubeconfig
elsewhere).

What a pool is, here
--------------------
The Deployments in ``k8s_namespace`` labelled ``kvmesh.io/namespace=<namespace>``, ``kvmesh.io/component=worker``
and ``kvmesh.io/pool=<decode|prefill>`` whose ``kvmesh.io/model`` annotation is the planner's model, by name. Its
size is the sum of their ``scale`` subresources' ``spec.replicas`` (one pod = one worker process; ``num_workers``
per pod counts as one, as the planner's pools are of processes). A change moves the first Deployment's count by the
difference (the others keep theirs, as the local connector's template does).

``set_pool_size(pool, n)``
--------------------------
1. Read the scale; the same count again changes nothing (but still waits for the Deployment to settle).
2. Going down: the pods that should leave get the lowest ``controller.kubernetes.io/pod-deletion-cost`` (an int32;
   the ReplicaSet controller deletes the lowest first, best effort): the worker the rescheduler is emptying or the
   one the planner would pick (``victims``: the least loaded, from the fleet view, by the ``pod`` the worker
   registers), before the count drops. Their in-flight requests drain (or migrate, with a rescheduler) within the
   pod's grace period: the rendered preStop hook.
3. Patch ``spec.replicas`` of the scale subresource (absolute: the same patch twice is one change).
4. Wait until the Deployment agrees: ``status.observedGeneration`` has seen the change and ``replicas``,
   ``updatedReplicas`` and ``availableReplicas`` all equal the count (as Dynamo's connector waits), polling every
   ``poll_s`` up to ``timeout_s``: ``ScalingTimeoutError`` then, with what the Deployment said.

Budget: the planner decides a swap at full budget as a removal first and an addition only once it is done
(components/planner/sla/controller.py), so pods never sit Pending over budget; the connector applies one change at a
time per pool, in the order the loop hands them over.

Errors: every failure is a ``ConnectorError``: ``KubernetesConnectorError`` (the API refused: forbidden by RBAC, no
such Deployment), ``NothingToScaleError`` (no worker Deployment of the model in the pool), ``ScalingTimeoutError``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from components.deploy.k8s import (
    COMPONENT_LABEL,
    DELETION_COST,
    GPU_RESOURCE,
    MODEL_ANNOTATION,
    NAMESPACE_LABEL,
    POOL_LABEL,
)
from components.fleet.model import FleetSnapshot
from components.planner.config import DEFAULT_SCALING_TIMEOUT_S
from components.planner.connectors.base import ConnectorError, ScalingTimeoutError
from components.planner.policy import Pool

logger = logging.getLogger(__name__)
NAME = "kubernetes"
# The cost given to a pod chosen to leave; pods without the annotation count as 0. Lowest is deleted first.
LEAVE_FIRST_COST = -1000

ApiFactory = Callable[[], Awaitable[Any]]  # returns a kubernetes_asyncio ApiClient


class KubernetesConnectorError(ConnectorError):
    """The API server refused or failed a request."""


class NothingToScaleError(ConnectorError):
    """No worker Deployment of the model in the pool."""


def victim_pods(snapshot: FleetSnapshot, model: str, pool: Pool, n: int) -> list[str]:
    """The pods of ``pool``'s workers to leave first, ``n`` of them: a worker already leaving (unschedulable: draining,
    the rescheduler emptying it) first, then the fewest requests (running + waiting), then the lowest KV use. Pure.
    Workers that did not register a pod (not on Kubernetes) are left out."""
    members = snapshot.prefill(model) if pool == Pool.PREFILL else snapshot.serving(model)

    def key(i: Any) -> tuple[int, int, float, str]:
        ld = i.load.snapshot if i.load is not None else None
        requests = (ld.num_running + ld.num_waiting) if ld is not None else 0
        return (int(i.schedulable), requests, ld.kv_usage if ld is not None else 0.0, i.meta.pod)

    pods: list[str] = []
    for i in sorted((i for i in members if i.meta.pod), key=key):
        if i.meta.pod not in pods:
            pods.append(i.meta.pod)
    return pods[:n]


class KubernetesConnector:
    name = NAME

    def __init__(
        self,
        api_factory: ApiFactory,
        k8s_namespace: str,
        namespace: str,
        model: str,
        *,
        timeout_s: float = DEFAULT_SCALING_TIMEOUT_S,
        poll_s: float = 0.5,
        fleet: Callable[[], FleetSnapshot] | None = None,
    ) -> None:
        self.api_factory = api_factory
        self.k8s_namespace = k8s_namespace
        self.namespace = namespace
        self.model = model
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.fleet = fleet  # the planner's fleet view: which pods leave first (victim_pods)
        self._api: Any = None
        self._lock = asyncio.Lock()
        self._gpus: dict[Pool, int | None] = {}
        self.last_wait_s: float | None = None  # how long the last change took to settle

    # --- the API ----------------------------------------------------------------------------------------------------

    async def _client(self) -> Any:
        if self._api is None:
            self._api = await self.api_factory()
        return self._api

    async def _call(self, pool: Pool, count: int | None, what: str, op: Callable[[Any], Awaitable[Any]]) -> Any:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await op(await self._client())
        except ApiException as e:
            raise KubernetesConnectorError(NAME, pool, count, f"{what}: {e.status} {e.reason}") from e
        except (OSError, TimeoutError) as e:
            raise KubernetesConnectorError(NAME, pool, count, f"{what}: {e}") from e

    async def _deployments(self, pool: Pool, count: int | None) -> list[Any]:
        from kubernetes_asyncio import client as k8s

        selector = f"{NAMESPACE_LABEL}={self.namespace},{COMPONENT_LABEL}=worker,{POOL_LABEL}={pool}"
        listed = await self._call(
            pool,
            count,
            f"listing Deployments ({selector})",
            lambda api: k8s.AppsV1Api(api).list_namespaced_deployment(self.k8s_namespace, label_selector=selector),
        )
        mine = [d for d in listed.items if (d.metadata.annotations or {}).get(MODEL_ANNOTATION) == self.model]
        mine.sort(key=lambda d: d.metadata.name)
        if mine:
            c = mine[0].spec.template.spec.containers[0]
            limits = (c.resources.limits if c.resources is not None else None) or {}
            self._gpus[pool] = int(limits.get(GPU_RESOURCE, 0))
        return mine

    async def _scale(self, pool: Pool, count: int | None, name: str) -> int:
        from kubernetes_asyncio import client as k8s

        scale = await self._call(
            pool,
            count,
            f"reading the scale of Deployment {name}",
            lambda api: k8s.AppsV1Api(api).read_namespaced_deployment_scale(name, self.k8s_namespace),
        )
        return int(scale.spec.replicas or 0)

    # --- the protocol -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Nothing to pick up: the Deployments hold their counts; a pod of an earlier scale-down drains by itself."""

    async def pool_size(self, pool: Pool) -> int | None:
        deps = await self._deployments(pool, None)
        if not deps:
            return None
        sizes = [await self._scale(pool, None, d.metadata.name) for d in deps]
        return sum(sizes)

    def gpus_per_worker(self, pool: Pool) -> int | None:
        """The first worker Deployment's ``nvidia.com/gpu`` limit as last read (None before any read)."""
        return self._gpus.get(pool)

    async def set_pool_size(self, pool: Pool, count: int) -> None:
        async with self._lock:
            deps = await self._deployments(pool, count)
            if not deps:
                raise NothingToScaleError(
                    NAME,
                    pool,
                    count,
                    f"no worker Deployment of {self.model} in {self.k8s_namespace} (kvmesh k8s apply)",
                )
            sizes = [await self._scale(pool, count, d.metadata.name) for d in deps]
            first, first_size = deps[0].metadata.name, sizes[0]
            target = first_size + count - sum(sizes)
            if target < 0:
                raise NothingToScaleError(
                    NAME, pool, count, f"the other Deployments of the pool hold {sum(sizes[1:])} workers already"
                )
            if target < first_size:
                await self._mark_leavers(pool, count, deps[0], first_size - target)
            if target != first_size:
                await self._set_replicas(pool, count, first, target)
                logger.info("kubernetes: %s pool, Deployment %s: %d -> %d", pool, first, first_size, target)
            await self._wait_settled(pool, count, first, target)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    # --- one change -------------------------------------------------------------------------------------------------

    async def _set_replicas(self, pool: Pool, count: int, name: str, replicas: int) -> None:
        from kubernetes_asyncio import client as k8s

        await self._call(
            pool,
            count,
            f"scaling Deployment {name} to {replicas}",
            lambda api: k8s.AppsV1Api(api).patch_namespaced_deployment_scale(
                name, self.k8s_namespace, {"spec": {"replicas": replicas}}
            ),
        )

    async def _mark_leavers(self, pool: Pool, count: int, dep: Any, n: int) -> list[str]:
        """Give the ``n`` pods chosen to leave the lowest deletion cost, before the count drops."""
        from kubernetes_asyncio import client as k8s

        labels = dep.spec.selector.match_labels or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        listed = await self._call(
            pool,
            count,
            f"listing the pods of {dep.metadata.name}",
            lambda api: k8s.CoreV1Api(api).list_namespaced_pod(self.k8s_namespace, label_selector=selector),
        )
        names = {p.metadata.name for p in listed.items if p.metadata.deletion_timestamp is None}
        chosen = (
            [p for p in victim_pods(self.fleet(), self.model, pool, len(names)) if p in names] if self.fleet else []
        )
        chosen = chosen[:n]
        for pod in chosen:
            await self._annotate(pool, count, pod)
        if chosen:
            logger.info(
                "kubernetes: %s pool: %s leave first (%s %d)", pool, ", ".join(chosen), DELETION_COST, LEAVE_FIRST_COST
            )
        return chosen

    async def _annotate(self, pool: Pool, count: int, pod: str) -> None:
        from kubernetes_asyncio import client as k8s

        body = {"metadata": {"annotations": {DELETION_COST: str(LEAVE_FIRST_COST)}}}
        await self._call(
            pool,
            count,
            f"marking pod {pod} to leave first",
            lambda api: k8s.CoreV1Api(api).patch_namespaced_pod(pod, self.k8s_namespace, body),
        )

    async def _wait_settled(self, pool: Pool, count: int, name: str, replicas: int) -> None:
        from kubernetes_asyncio import client as k8s

        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        last: Sequence[Any] = ()
        while True:
            dep = await self._call(
                pool,
                count,
                f"reading Deployment {name}",
                lambda api: k8s.AppsV1Api(api).read_namespaced_deployment(name, self.k8s_namespace),
            )
            st = dep.status
            last = (
                dep.spec.replicas,
                st.observed_generation,
                dep.metadata.generation,
                st.replicas or 0,
                st.updated_replicas or 0,
                st.available_replicas or 0,
            )
            settled = (
                dep.spec.replicas == replicas
                and (st.observed_generation or 0) >= (dep.metadata.generation or 0)
                and (st.replicas or 0) == (st.updated_replicas or 0) == (st.available_replicas or 0) == replicas
            )
            if settled:
                self.last_wait_s = time.monotonic() - t0
                return
            if time.monotonic() + self.poll_s > deadline:
                logger.warning(
                    "kubernetes: Deployment %s not settled at %d within %g s (spec, observed/generation, replicas, "
                    "updated, available: %s)",
                    name,
                    replicas,
                    self.timeout_s,
                    last,
                )
                raise ScalingTimeoutError(NAME, pool, count, self.timeout_s)
            await asyncio.sleep(self.poll_s)


__all__ = [
    "LEAVE_FIRST_COST",
    "KubernetesConnector",
    "KubernetesConnectorError",
    "NothingToScaleError",
    "victim_pods",
]
