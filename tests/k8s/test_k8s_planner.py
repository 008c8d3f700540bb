"""``kvmesh planner --environment kubernetes`` end to end against the tier's real API server: graphs/mock_planner.yaml
rendered and its worker Deployment applied; a kubelet shim starts a simulated ``kvmesh worker`` for each Pod the
controller manager creates (the rendered container's command and environment, the pod's name, a readiness file it
waits for) and SIGTERMs it when the Pod is deleted; a local ``kvmesh frontend``; the planner as its own process with
the fixture's kubeconfig. Under load that fills the one worker's KV cache the planner scales the Deployment to 2
(the ReplicaSet and a second Pod follow, its worker registers and serves); when the load turns to a trickle it scales
back to 1, the leaving pod's worker drains and exits 0; no request fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from components.deploy.graph import graph_base_dir, load_graph
from components.deploy.k8s import RenderOptions, deployment_name, render_manifests
from components.deploy.k8s_api import apply_objects
from components.runtime.servers import free_port
from tests.e2e.test_planner_local import Streams, long_prompt
from tests.support.k8s import KubeApi
from tests.support.kubelet_shim import KubeletShim
from tests.support.waiting import wait_until, wait_until_async

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "graphs" / "mock_planner.yaml"
IMAGE_ROOT = "/opt/kvmesh"
# As tests/e2e/test_planner_local.py's graph planner test: 64 blocks of 16 tokens per worker; four ~700-token requests
# at a time keep one worker's KV use over 0.6, one short request at a time keeps it near 0.05 (under 0.2); a budget
# of 2 workers.
OVERRIDES = ["workers[0].num_gpu_blocks=64", "workers[0].max_model_len=1024"]
PLANNER_FLAGS = ["--adjustment-interval", "2", "--metric-pulling-interval", "0.25",
                 "--decode-kv-scale-up-threshold", "0.6", "--decode-kv-scale-down-threshold", "0.2",
                 "--max-gpu-budget", "2", "--scaling-timeout-s", "60"]  # fmt: skip


def kvmesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "components.cli.main", *args]


async def serves_model(url: str, model: str) -> bool:
    """The frontend answers and lists ``model`` (it is started before any worker, so it learns of the model later)."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                return any(m.get("id") == model for m in json.load(r).get("data", []))
        except OSError:
            return False

    return await asyncio.to_thread(probe)


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A process with its output in ``log`` (the file is the child's; this process keeps no handle)."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)


async def test_the_planner_scales_a_deployment_up_under_load_and_down_in_quiet_losing_nothing(
    kube_api: KubeApi, kube_namespace, session_etcd, session_nats, tmp_path
):
    ns = f"k8sp{os.getpid()}"
    graph = load_graph(GRAPH, [*OVERRIDES, f"namespace={ns}"])
    options = RenderOptions(
        k8s_namespace=kube_namespace,
        image_root=IMAGE_ROOT,
        etcd_endpoints=(session_etcd.endpoint,),
        nats_url=session_nats.url,
    )
    objects = render_manifests(graph, GRAPH.read_text(), graph_base_dir(GRAPH, graph), options)
    # The worker Deployment and the graph's ConfigMap: the frontend and the planner run here as processes (the shim
    # starts workers only).
    worker_dep = deployment_name(ns, "mock")
    (dep,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == worker_dep]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    base_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    worker_args = [a.replace(IMAGE_ROOT, str(ROOT)) for a in container["command"][1:]]  # the image's paths, here
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    async def start_worker(pod: str) -> None:
        ready = tmp_path / f"{pod}.ready"
        env = os.environ | base_env | {
            "KVMESH_POD_NAME": pod,
            "KVMESH_NODE_NAME": "node-1",
            "KVMESH_READY_FILE": str(ready),
            "KVMESH_RESPONSE_HOST": "127.0.0.1",
        }  # fmt: skip
        procs[pod] = spawn(kvmesh_cmd(*worker_args), env, logs / f"{pod}.log")
        await wait_until(ready.is_file, timeout_s=60, step_s=0.05)  # the rendered readiness probe's condition

    async def stop_worker(pod: str) -> None:
        proc = procs.get(pod)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # as the preStop hook does: drain, leave etcd, exit

    port = free_port()
    env = os.environ | {"KVMESH_ETCD_ENDPOINTS": session_etcd.endpoint, "KVMESH_NATS_URL": session_nats.url}
    planner_log_path = logs / "planner.log"
    frontend = spawn(
        kvmesh_cmd("frontend", "--namespace", ns, "--port", str(port), "--router-policy", "round_robin"),
        env,
        logs / "frontend.log",
    )
    planner: subprocess.Popen[bytes] | None = None
    try:
        async with kube_api.client() as admin:
            apps = client.AppsV1Api(admin)
            await apply_objects(admin, [o for o in objects if o["kind"] == "ConfigMap"] + [dep])
            async with KubeletShim(
                admin, kube_namespace, label_selector="kvmesh.io/component=worker", on_start=start_worker,
                on_stop=stop_worker,
            ) as kubelet:  # fmt: skip
                await wait_until(lambda: len(kubelet.ready) == 1, timeout_s=60, step_s=0.05)
                planner = spawn(
                    kvmesh_cmd("--log-level", "INFO", "planner", "--namespace", ns, "--served-model-name",
                               "tiny-llama", "--environment", "kubernetes", "--k8s-namespace", kube_namespace,
                               "--kubeconfig", str(kube_api.kubeconfig_path), *PLANNER_FLAGS),
                    env,
                    planner_log_path,
                )  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                # The load starts once the frontend listens and knows the worker's model (a CI run sent its first
                # streams while the frontend was still starting: every one failed to connect).
                await wait_until_async(lambda: serves_model(url, "tiny-llama"), timeout_s=60, step_s=0.1)
                streams = Streams(url)

                async def replicas() -> int:
                    return int((await apps.read_namespaced_deployment_scale(worker_dep, kube_namespace)).spec.replicas)

                state: dict[str, Any] = {"up": False, "down": False}

                async def follow() -> None:
                    while True:
                        n = await replicas()
                        state["up"] = state["up"] or (n == 2 and len(kubelet.ready) == 2)
                        state["down"] = state["up"] and n == 1 and len(kubelet.stopped) == 1
                        await asyncio.sleep(0.1)

                follower = asyncio.ensure_future(follow())
                try:
                    # Phase 1: fill the KV cache until the second pod's worker is ready, and a little beyond.
                    await streams.run(4, long_prompt, 400, lambda: state["up"], max_requests=80, max_s=120)
                    assert state["up"], _tail(planner_log_path)
                    await streams.run(4, long_prompt, 400, lambda: False, max_requests=streams.sent + 8, max_s=60)
                    # Phase 2: a trickle until the Deployment is back at 1 and the shim stopped one pod.
                    await streams.run(1, lambda i: f"short {i}", 20, lambda: state["down"], max_requests=2000,
                                      max_s=120)  # fmt: skip
                    assert state["down"], _tail(planner_log_path)
                finally:
                    follower.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await follower
                (gone,) = kubelet.stopped
                rc = await asyncio.to_thread(procs[gone].wait, 60)
                assert rc == 0, (logs / f"{gone}.log").read_text()[-2000:]
        assert streams.failures() == [], streams.failures()[:3]
        assert len(streams.outcomes) >= 8
        text = planner_log_path.read_text()
        assert "kubernetes: decode pool" in text and "-> 2" in text and "-> 1" in text, text[-3000:]
    finally:
        for p in [planner, frontend, *procs.values()]:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [planner, frontend, *procs.values()]:
            if p is not None:
                try:
                    await asyncio.to_thread(p.wait, 30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]
