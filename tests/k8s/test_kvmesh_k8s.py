"""``kvmesh k8s`` and the planner's ``kubernetes`` connector against a real kube-apiserver and kube-controller-manager
(tests/k8s/conftest.py): rendered manifests of every graph accepted and applied idempotently, the planner's Role
enforced by the API server itself (RBAC), the connector scaling a Deployment through its ``scale`` subresource with
the ReplicaSet and Pods following, a count changed by hand read back, and the pod that leaves marked before the
count drops. No kubelet runs: ``KubeletShim`` reports the Pods Running and Ready, as a kubelet would."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from components.cli.main import main as kvmesh
from components.deploy.graph import graph_base_dir, load_graph
from components.deploy.k8s import DELETION_COST, RenderOptions, deployment_name, planner_name, render_manifests
from components.deploy.k8s_api import apply_objects, delete_objects
from components.fleet import MemoryFleet
from components.planner.connectors.base import ScalingTimeoutError
from components.planner.connectors.kubernetes import LEAVE_FIRST_COST, KubernetesConnector
from components.planner.policy import Pool
from components.protocol.messages import LoadSnapshot
from components.protocol.metadata import WorkerMetadata, WorkerRole
from tests.support.k8s import KubeApi
from tests.support.kubelet_shim import KubeletShim
from tests.support.planner_stubs import ApplyOnlyRuntime, swap
from tests.support.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted((ROOT / "graphs").glob("*.yaml"))
WAIT_S = 30.0


def rendered(graph_file: Path, k8s_namespace: str, *overrides: str) -> list[dict[str, Any]]:
    graph = load_graph(graph_file, list(overrides))
    options = RenderOptions(
        k8s_namespace=k8s_namespace, etcd_endpoints=("http://etcd.invalid:2379",), nats_url="nats://nats.invalid:4222"
    )
    return render_manifests(graph, graph_file.read_text(), graph_base_dir(graph_file, graph), options)


async def pods_of(api: client.ApiClient, namespace: str, deployment: str) -> list[Any]:
    dep = await client.AppsV1Api(api).read_namespaced_deployment(deployment, namespace)
    sel = ",".join(f"{k}={v}" for k, v in sorted(dep.spec.selector.match_labels.items()))
    return (await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=sel)).items


@pytest.mark.parametrize("graph_file", GRAPHS, ids=lambda p: p.name)
async def test_every_graph_is_accepted_applied_idempotently_and_deleted(kube_api: KubeApi, kube_namespace, graph_file):
    objects = rendered(graph_file, kube_namespace)
    async with kube_api.client() as api:
        first = await apply_objects(api, objects)
        assert [r["action"] for r in first] == ["created"] * len(objects)
        again = await apply_objects(api, objects)
        assert [r["action"] for r in again] == ["unchanged"] * len(objects), again
        # Each worker Deployment's pods exist, one per replica (Pending: no kubelet).
        graph = load_graph(graph_file)
        for g in graph.workers:
            name = deployment_name(graph.namespace, g.name)

            async def have(name: str = name, n: int = g.replicas) -> bool:
                return len(await pods_of(api, kube_namespace, name)) == n

            await wait_until_async(have, timeout_s=WAIT_S, step_s=0.1)
        gone = await delete_objects(api, objects)
        assert [r["action"] for r in gone] == ["deleted"] * len(objects)
        assert [r["action"] for r in await delete_objects(api, objects)] == ["absent"] * len(objects)


async def test_apply_keeps_a_live_replica_count_unless_told_to_reset(kube_api: KubeApi, kube_namespace):
    objects = rendered(ROOT / "graphs" / "mock_planner.yaml", kube_namespace)
    name = deployment_name("mock-planner", "mock")
    async with kube_api.client() as api:
        apps = client.AppsV1Api(api)
        await apply_objects(api, objects)
        await apps.patch_namespaced_deployment_scale(name, kube_namespace, {"spec": {"replicas": 3}})
        results = await apply_objects(api, objects)  # the planner scaled to 3: re-applying the graph keeps 3
        assert (await apps.read_namespaced_deployment_scale(name, kube_namespace)).spec.replicas == 3
        assert {r["action"] for r in results} == {"unchanged"}
        await apply_objects(api, objects, reset_replicas=True)
        assert (await apps.read_namespaced_deployment_scale(name, kube_namespace)).spec.replicas == 1


async def test_the_command_applies_through_a_kubeconfig_and_refuses_an_embedded_graph(
    kube_api: KubeApi, kube_namespace, capsys
):
    argv = ["k8s", "apply", str(ROOT / "graphs/mock_rescheduler.yaml"), "--k8s-namespace", kube_namespace,
            "--kubeconfig", str(kube_api.kubeconfig_path), "--etcd-endpoints", "http://e:2379",
            "--nats-url", "nats://n:4222"]  # fmt: skip
    assert await asyncio.to_thread(kvmesh, argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["k8s"] == "apply" and {o["action"] for o in out["objects"]} == {"created"}
    kinds = sorted(o["object"].split()[0] for o in out["objects"])
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Deployment", "Service"]  # frontend, worker, rescheduler
    embedded = ["k8s", "apply", str(ROOT / "graphs/mock_agg.yaml"), "--kubeconfig", str(kube_api.kubeconfig_path)]
    assert await asyncio.to_thread(kvmesh, embedded) == 2
    assert "embedded" in capsys.readouterr().err
    down = ["k8s", "delete", *argv[2:]]
    assert await asyncio.to_thread(kvmesh, down) == 0


async def test_the_planners_role_lets_it_scale_and_mark_pods_and_nothing_more(kube_api: KubeApi, kube_namespace):
    objects = rendered(ROOT / "graphs" / "mock_planner.yaml", kube_namespace)
    worker = deployment_name("mock-planner", "mock")
    async with kube_api.client() as admin:
        await apply_objects(admin, objects)
        await client.CoreV1Api(admin).create_namespaced_secret(
            kube_namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="etcd-creds"), string_data={"p": "x"})
        )
        await wait_until_async(lambda: _has_pods(admin, kube_namespace, worker, 1), timeout_s=WAIT_S, step_s=0.1)
    planner = kube_api.service_account_user(kube_namespace, planner_name("mock-planner"))
    async with kube_api.client(as_user=planner) as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        # What it must do: read Deployments, read and set their scale, annotate its pods.
        assert [d.metadata.name for d in (await apps.list_namespaced_deployment(kube_namespace)).items]
        await apps.patch_namespaced_deployment_scale(worker, kube_namespace, {"spec": {"replicas": 2}})
        (pod, *_) = await pods_of(api, kube_namespace, worker)
        body = {"metadata": {"annotations": {DELETION_COST: "-1"}}}
        await core.patch_namespaced_pod(pod.metadata.name, kube_namespace, body)
        # What it must not: delete or create a Deployment, change one's template, read Secrets; nor act elsewhere.
        forbidden = [
            apps.delete_namespaced_deployment(worker, kube_namespace),
            apps.patch_namespaced_deployment(worker, kube_namespace, {"spec": {"paused": True}}),
            apps.create_namespaced_deployment(kube_namespace, {"metadata": {"name": "x"}, "spec": {}}),
            core.read_namespaced_secret("etcd-creds", kube_namespace),
            core.list_namespaced_secret(kube_namespace),
            core.delete_namespaced_pod(pod.metadata.name, kube_namespace),
            apps.list_namespaced_deployment("default"),
        ]
        for call in forbidden:
            with pytest.raises(ApiException) as refused:
                await call
            assert refused.value.status == 403, refused.value


async def _has_pods(api: client.ApiClient, namespace: str, deployment: str, n: int) -> bool:
    return len(await pods_of(api, namespace, deployment)) == n


def _fleet_of(pods: dict[str, int]) -> MemoryFleet:
    """Workers registered with these pod names, each with ``pods[name]`` requests running."""
    f = MemoryFleet()
    for iid, (pod, running) in enumerate(sorted(pods.items()), start=1):
        f.add_instance(iid, WorkerMetadata(model="tiny-llama", role=WorkerRole.AGGREGATED, pod=pod).to_dict())
        load = LoadSnapshot(
            now_s=0.0, kv_usage=0.1 * running, num_total_blocks=100, num_active_blocks=10 * running,
            num_running=running, num_waiting=0, num_waiting_prefill_tokens=0, num_preemptions=0,
            batch_size=running, num_kv_tokens=0,
        )  # fmt: skip
        f.apply_load(iid, load, 1.0)
    return f


async def test_the_connector_scales_up_and_down_marking_the_least_loaded_pod_before_the_count_drops(
    kube_api: KubeApi, kube_namespace
):
    objects = rendered(ROOT / "graphs" / "mock_planner.yaml", kube_namespace)
    worker = deployment_name("mock-planner", "mock")
    planner = kube_api.service_account_user(kube_namespace, planner_name("mock-planner"))
    async with kube_api.client() as admin:
        await apply_objects(admin, objects)
        async with KubeletShim(admin, kube_namespace, label_selector="kvmesh.io/component=worker") as kubelet:
            fleet = MemoryFleet()

            async def as_planner() -> client.ApiClient:  # the connector runs with the planner's Role only
                return kube_api.client(as_user=planner)

            conn = KubernetesConnector(
                as_planner, kube_namespace, "mock-planner", "tiny-llama", timeout_s=WAIT_S, poll_s=0.1,
                fleet=lambda: fleet.snapshot(1.5),
            )  # fmt: skip
            try:
                assert await conn.pool_size(Pool.DECODE) == 1
                assert await conn.pool_size(Pool.PREFILL) is None  # no prefill Deployment in this graph
                assert conn.gpus_per_worker(Pool.DECODE) == 0
                await conn.set_pool_size(Pool.DECODE, 3)  # returns once 3 are updated and available
                dep = await client.AppsV1Api(admin).read_namespaced_deployment(worker, kube_namespace)
                assert (dep.spec.replicas, dep.status.available_replicas, dep.status.updated_replicas) == (3, 3, 3)
                pods = sorted(p.metadata.name for p in await pods_of(admin, kube_namespace, worker))
                assert len(pods) == 3 and set(pods) <= kubelet.ready
                # A person scales to 4 by hand: the connector reads 4 (the planner goes on from there).
                await client.AppsV1Api(admin).patch_namespaced_deployment_scale(
                    worker, kube_namespace, {"spec": {"replicas": 4}}
                )
                assert await conn.pool_size(Pool.DECODE) == 4
                await wait_until_async(lambda: _has_pods(admin, kube_namespace, worker, 4), timeout_s=WAIT_S)
                pods = sorted(p.metadata.name for p in await pods_of(admin, kube_namespace, worker))
                # The fleet: the third pod runs nothing, the others 2-5 requests: it is the one to leave.
                idle = pods[2]
                fleet = _fleet_of({p: (0 if p == idle else 2 + i) for i, p in enumerate(pods)})
                events = await _record(admin, kube_namespace, worker, conn.set_pool_size(Pool.DECODE, 3))
                marked = [e for e in events if e[1] == "pod" and e[2] == idle and e[3] == str(LEAVE_FIRST_COST)]
                dropped = [e for e in events if e[1] == "deployment" and e[3] == 3]
                assert marked and dropped and marked[0][0] < dropped[0][0], events  # by etcd revision
                others = [e for e in events if e[1] == "pod" and e[2] != idle and e[3] is not None]
                assert others == []  # no other pod was marked
                # The same count again: nothing changes (and it returns, the Deployment settled).
                before = (await client.AppsV1Api(admin).read_namespaced_deployment(worker, kube_namespace)).metadata
                await conn.set_pool_size(Pool.DECODE, 3)
                after = (await client.AppsV1Api(admin).read_namespaced_deployment(worker, kube_namespace)).metadata
                assert after.generation == before.generation
            finally:
                await conn.close()


async def _record(
    api: client.ApiClient, namespace: str, deployment: str, change: Any
) -> list[tuple[int, str, str, Any]]:
    """Run ``change`` while watching the namespace's Pods and the Deployment: (resourceVersion, "pod"/"deployment",
    name, the pod's deletion cost annotation / the Deployment's spec.replicas), in etcd's order."""
    events: list[tuple[int, str, str, Any]] = []
    rv_pods = (await client.CoreV1Api(api).list_namespaced_pod(namespace)).metadata.resource_version
    rv_deps = (await client.AppsV1Api(api).list_namespaced_deployment(namespace)).metadata.resource_version

    async def follow(kind: str, fn: Any, rv: str) -> None:
        w = watch.Watch()
        async with w.stream(fn, namespace, resource_version=rv, timeout_seconds=60) as stream:
            async for ev in stream:
                o = ev["object"]
                if kind == "pod":
                    value = (o.metadata.annotations or {}).get(DELETION_COST)
                elif o.metadata.name == deployment:
                    value = o.spec.replicas
                else:
                    continue
                events.append((int(o.metadata.resource_version), kind, o.metadata.name, value))

    followers = [
        asyncio.ensure_future(follow("pod", client.CoreV1Api(api).list_namespaced_pod, rv_pods)),
        asyncio.ensure_future(follow("deployment", client.AppsV1Api(api).list_namespaced_deployment, rv_deps)),
    ]
    try:
        await change
        await asyncio.sleep(0)  # let the watches deliver what they already received
        await wait_until(lambda: any(e[1] == "deployment" and e[3] == 3 for e in events), timeout_s=WAIT_S, step_s=0.05)
    finally:
        for f in followers:
            f.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
    return sorted(events)


async def test_a_change_that_cannot_complete_times_out_with_the_count_set(kube_api: KubeApi, kube_namespace):
    # No kubelet shim: the new Pods never become available, so the change cannot be confirmed; the connector
    # reports it within its bound instead of waiting for ever, and the count stays set (the Pods exist, Pending).
    objects = rendered(ROOT / "graphs" / "mock_planner.yaml", kube_namespace)
    async with kube_api.client() as admin:
        await apply_objects(admin, objects)

        async def factory() -> client.ApiClient:
            return kube_api.client()

        conn = KubernetesConnector(factory, kube_namespace, "mock-planner", "tiny-llama", timeout_s=1.0, poll_s=0.1)
        try:
            with pytest.raises(ScalingTimeoutError, match="not done within 1 s"):
                await conn.set_pool_size(Pool.DECODE, 2)
            assert await conn.pool_size(Pool.DECODE) == 2
        finally:
            await conn.close()


async def test_a_swap_at_full_budget_never_asks_the_cluster_for_more_than_the_budget(kube_api: KubeApi, kube_namespace):
    # graphs/mock_disagg.yaml: 2 prefill + 1 decode pods, a budget of 3. The planner swaps one prefill worker for a
    # decode one (prefill 2 -> 1, decode 1 -> 2, one adjustment) through the real loop and connector; every change of
    # either Deployment's spec.replicas is watched: their sum never exceeds 3 (the removal lands first).
    from components.planner.config import PlannerConfig
    from components.planner.loop import Planner

    objects = rendered(ROOT / "graphs" / "mock_disagg.yaml", kube_namespace)
    prefill, decode = deployment_name("mock-disagg", "prefill"), deployment_name("mock-disagg", "decode")
    async with kube_api.client() as admin:
        await apply_objects(admin, objects)
        async with KubeletShim(admin, kube_namespace, label_selector="kvmesh.io/component=worker"):

            async def factory() -> client.ApiClient:
                return kube_api.client()

            conn = KubernetesConnector(
                factory, kube_namespace, "mock-disagg", "tiny-llama", timeout_s=WAIT_S, poll_s=0.1
            )
            try:
                assert (await conn.pool_size(Pool.PREFILL), await conn.pool_size(Pool.DECODE)) == (2, 1)
                planner = Planner(
                    ApplyOnlyRuntime(), PlannerConfig(max_gpu_budget=3), "mock-disagg", "tiny-llama", conn
                )  # type: ignore[arg-type]

                async def run_swap() -> None:
                    planner.apply(swap(decode=1, prefill=2, budget=3))
                    await asyncio.gather(*list(planner._change_tasks.values()))

                events = await _record_many(
                    admin, kube_namespace, {prefill, decode}, run_swap(), {prefill: 1, decode: 2}
                )
                assert planner.num_change_failures == 0 and planner.num_changes_applied == 2
            finally:
                await conn.close()
    live = {prefill: 2, decode: 1}
    sums = []
    for _, name, replicas in events:
        live[name] = replicas
        sums.append(sum(live.values()))
    assert live == {prefill: 1, decode: 2} and max(sums) <= 3, events


async def _record_many(
    api: client.ApiClient, namespace: str, names: set[str], change: Any, final: dict[str, int]
) -> list[tuple[int, str, int]]:
    """Run ``change`` while watching the namespace's Deployments: (resourceVersion, name, spec.replicas) of each of
    ``names``, in etcd's order, until each shows its ``final`` count."""
    events: list[tuple[int, str, int]] = []
    rv = (await client.AppsV1Api(api).list_namespaced_deployment(namespace)).metadata.resource_version

    async def follow() -> None:
        w = watch.Watch()
        async with w.stream(
            client.AppsV1Api(api).list_namespaced_deployment, namespace, resource_version=rv, timeout_seconds=60
        ) as stream:
            async for ev in stream:
                o = ev["object"]
                if o.metadata.name in names:
                    events.append((int(o.metadata.resource_version), o.metadata.name, o.spec.replicas))

    follower = asyncio.ensure_future(follow())
    try:
        await change

        def done() -> bool:
            last = {n: r for _, n, r in sorted(events)}
            return all(last.get(n) == c for n, c in final.items())

        await wait_until(done, timeout_s=WAIT_S, step_s=0.05)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    return sorted(events)
