"""The tier's own checks against the real kube-apiserver and kube-controller-manager (tests/k8s/conftest.py): a
Deployment becomes a ReplicaSet and Pending Pods, the ``scale`` subresource moves them, and RBAC, enforced by the API
server, lets a planner-like ServiceAccount scale and nothing more."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from tests.support.k8s import KubeApi
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.k8s

# The controller manager reacts within milliseconds on an idle machine; 30 s leaves room for a loaded 2-core one.
WAIT_S = 30.0


def deployment(name: str, replicas: int) -> client.V1Deployment:
    labels = {"app": name}
    container = client.V1Container(name="worker", image="kvmesh.invalid/worker:test")  # never pulled: no kubelet
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels), spec=client.V1PodSpec(containers=[container])
            ),
        ),
    )


async def wait_for_replicas(api: client.ApiClient, namespace: str, name: str, n: int) -> dict[str, Any]:
    """Until deployment ``name`` has one ReplicaSet wanting and having ``n`` Pods and exactly ``n`` Pod objects exist,
    all Pending; returns what was seen. A Pod never scheduled to a node is deleted at once (no kubelet has to confirm
    it), so a scale-down leaves exactly ``n`` objects, not ``n`` plus terminating ones."""
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    seen: dict[str, Any] = {}

    async def check() -> bool:
        rs = (await apps.list_namespaced_replica_set(namespace, label_selector=f"app={name}")).items
        pods = (await core.list_namespaced_pod(namespace, label_selector=f"app={name}")).items
        seen.clear()
        seen.update(
            replicasets=[(r.metadata.name, r.spec.replicas, r.status.replicas) for r in rs],
            pods=sorted((p.metadata.name, p.status.phase) for p in pods),
            rs=rs,
            pod_objects=pods,
        )
        return (
            len(rs) == 1
            and rs[0].spec.replicas == n
            and rs[0].status.replicas == n
            and len(pods) == n
            and all(p.status.phase == "Pending" for p in pods)
        )

    try:
        await wait_until_async(check, timeout_s=WAIT_S, step_s=0.1)
    except AssertionError:
        raise AssertionError(
            f"{namespace}/{name}: not {n} replicas within {WAIT_S} s; last seen ReplicaSets {seen.get('replicasets')},"
            f" Pods {seen.get('pods')}"
        ) from None
    return seen


async def test_deployment_gets_a_replicaset_and_pending_pods(kube_api: KubeApi, kube_namespace: str) -> None:
    # Through the fixture's kubeconfig, as `kvmesh k8s` and the planner's connector load it.
    api = await config.new_client_from_config(config_file=str(kube_api.kubeconfig_path))
    async with api:
        created = await client.AppsV1Api(api).create_namespaced_deployment(kube_namespace, deployment("web", 2))
        seen = await wait_for_replicas(api, kube_namespace, "web", 2)
    # The chain of owners a cluster builds: Deployment -> ReplicaSet -> Pods.
    (rs,) = seen["rs"]
    assert [(o.kind, o.uid) for o in rs.metadata.owner_references] == [("Deployment", created.metadata.uid)]
    for pod in seen["pod_objects"]:
        assert [(o.kind, o.uid) for o in pod.metadata.owner_references] == [("ReplicaSet", rs.metadata.uid)]
        assert pod.spec.node_name is None  # no scheduler here: Pending because unscheduled


async def test_scale_subresource_moves_replicaset_and_pods(kube_api: KubeApi, kube_namespace: str) -> None:
    async with kube_api.client() as api:
        apps = client.AppsV1Api(api)
        await apps.create_namespaced_deployment(kube_namespace, deployment("decode", 1))
        await wait_for_replicas(api, kube_namespace, "decode", 1)
        for n in (3, 1):
            scale = await apps.patch_namespaced_deployment_scale("decode", kube_namespace, {"spec": {"replicas": n}})
            assert scale.spec.replicas == n
            seen = await wait_for_replicas(api, kube_namespace, "decode", n)
            assert len(seen["pods"]) == n
            # The Deployment's own status follows: n Pods of the current template, none available (never started).
            dep = await apps.read_namespaced_deployment_status("decode", kube_namespace)

            async def status_caught_up(n: int = n) -> bool:
                nonlocal dep
                dep = await apps.read_namespaced_deployment_status("decode", kube_namespace)
                return dep.status.replicas == n and dep.status.updated_replicas == n

            await wait_until_async(status_caught_up, timeout_s=WAIT_S, step_s=0.1)
            assert dep.status.available_replicas in (None, 0)
            assert (await apps.read_namespaced_deployment_scale("decode", kube_namespace)).status.replicas == n


async def planner_role(api: client.ApiClient, namespace: str, account: str) -> None:
    """The planner's permissions as issue 27 sets them: read Deployments, read and set their scale, in one
    namespace, bound to ServiceAccount ``account``."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    await core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata={"name": account}))
    rules = [
        client.V1PolicyRule(api_groups=["apps"], resources=["deployments"], verbs=["get", "list", "watch"]),
        client.V1PolicyRule(api_groups=["apps"], resources=["deployments/scale"], verbs=["get", "patch", "update"]),
    ]
    await rbac.create_namespaced_role(namespace, client.V1Role(metadata={"name": "planner"}, rules=rules))
    binding = client.V1RoleBinding(
        metadata={"name": "planner"},
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="planner"),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name=account, namespace=namespace)],
    )
    await rbac.create_namespaced_role_binding(namespace, binding)


async def forbidden(call: Any) -> int:
    try:
        await call
    except ApiException as e:
        return int(e.status)
    return 200


async def test_rbac_lets_the_planner_scale_and_nothing_more(kube_api: KubeApi, kube_namespace: str) -> None:
    async with kube_api.client() as admin:
        await planner_role(admin, kube_namespace, "planner")
        await client.AppsV1Api(admin).create_namespaced_deployment(kube_namespace, deployment("prefill", 1))
        await client.CoreV1Api(admin).create_namespaced_secret(
            kube_namespace, client.V1Secret(metadata={"name": "nats-credentials"}, string_data={"token": "x"})
        )
        user = KubeApi.service_account_user(kube_namespace, "planner")
        async with kube_api.client(as_user=user) as planner:
            apps, core = client.AppsV1Api(planner), client.CoreV1Api(planner)
            # Allowed by the Role: list Deployments, read and set the scale.
            names = [d.metadata.name for d in (await apps.list_namespaced_deployment(kube_namespace)).items]
            assert names == ["prefill"]
            await apps.patch_namespaced_deployment_scale("prefill", kube_namespace, {"spec": {"replicas": 2}})
            assert (await apps.read_namespaced_deployment_scale("prefill", kube_namespace)).spec.replicas == 2
            # Not in the Role, so 403 from the API server's RBAC: deleting or editing the Deployment itself,
            # Secrets, and anything in another namespace.
            assert await forbidden(apps.delete_namespaced_deployment("prefill", kube_namespace)) == 403
            patch = {"spec": {"template": {"metadata": {"labels": {"app": "prefill", "x": "y"}}}}}
            assert await forbidden(apps.patch_namespaced_deployment("prefill", kube_namespace, patch)) == 403
            assert await forbidden(core.read_namespaced_secret("nats-credentials", kube_namespace)) == 403
            assert await forbidden(core.list_namespaced_secret(kube_namespace)) == 403
            assert await forbidden(apps.list_namespaced_deployment("default")) == 403
        # The refused delete changed nothing: the Deployment is still there, at the scale the planner set.
        dep = await client.AppsV1Api(admin).read_namespaced_deployment("prefill", kube_namespace)
        assert dep.spec.replicas == 2
        await wait_for_replicas(admin, kube_namespace, "prefill", 2)
