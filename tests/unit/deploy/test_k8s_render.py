"""``kvmesh k8s render``: a graph as Kubernetes manifests (components/deploy/k8s.py), pure. That the API server
accepts them is tests/k8s's (a real kube-apiserver); here, what each object says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from components.cli.main import main as kvmesh
from components.deploy.graph import graph_base_dir, load_graph
from components.deploy.k8s import (
    DELETION_COST,
    GPU_RESOURCE,
    POOL_LABEL,
    PRE_STOP,
    READY_FILE,
    EmbeddedInfrastructureError,
    RenderOptions,
    k8s_name,
    planner_rules,
    render_manifests,
    to_yaml,
)

ROOT = Path(__file__).resolve().parents[3]
GRAPHS = sorted((ROOT / "graphs").glob("*.yaml"))
EXTERNAL = RenderOptions(etcd_endpoints=("http://etcd-0.etcd:2379",), nats_url="nats://nats:4222")


def render(name: str, *overrides: str, options: RenderOptions = EXTERNAL) -> list[dict]:
    path = ROOT / "graphs" / name
    graph = load_graph(path, list(overrides))
    return render_manifests(graph, path.read_text(), graph_base_dir(path, graph), options)


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def env_of(dep: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(dep)["env"]}


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: p.name)
def test_every_graph_renders_one_deployment_per_group_and_the_parts_it_has(path):
    graph = load_graph(path)
    objects = render(path.name)
    deps = {d["metadata"]["name"]: d for d in by_kind(objects, "Deployment")}
    ns = graph.namespace
    for g in graph.workers:
        dep = deps[k8s_name(ns, g.name)]
        assert dep["spec"]["replicas"] == g.replicas  # one pod = one replica
        assert dep["metadata"]["labels"][POOL_LABEL] == ("prefill" if str(g.role) == "prefill" else "decode")
        assert dep["metadata"]["annotations"]["kvmesh.io/model"] == g.model
        cmd = container(dep)["command"]
        assert cmd[:4] == ["kvmesh", "--log-level", graph.log_level, "worker"]
        # The model path as it is inside the image: the graph's base directory at /opt/kvmesh.
        rel = Path(g.model_path).relative_to(graph_base_dir(path, graph))
        assert cmd[cmd.index("--model-path") + 1] == f"/opt/kvmesh/{rel}"
        # The dep's selector picks its own pods only (its template carries the labels).
        sel = dep["spec"]["selector"]["matchLabels"]
        assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert (k8s_name(ns, "frontend") in deps) == graph.frontend.enabled
    assert len(by_kind(objects, "Service")) == int(graph.frontend.enabled)
    has_planner = graph.planner is not None
    assert (k8s_name(ns, "planner") in deps) == has_planner
    assert len(by_kind(objects, "Role")) == len(by_kind(objects, "RoleBinding")) == int(has_planner)
    assert (k8s_name(ns, "rescheduler") in deps) == graph.rescheduler_watcher_runs()
    (cm,) = by_kind(objects, "ConfigMap")
    assert cm["data"]["graph.yaml"] == path.read_text()
    assert len(deps) == len(graph.workers) + graph.frontend.enabled + has_planner + graph.rescheduler_watcher_runs()
    # Every object in the one namespace, and the YAML stream reads back as the objects (no anchors).
    assert {o["metadata"]["namespace"] for o in objects} == {"default"}
    text = to_yaml(objects)
    assert "&id" not in text and list(yaml.safe_load_all(text)) == objects


def test_embedded_infrastructure_is_refused_naming_what_is_embedded():
    with pytest.raises(EmbeddedInfrastructureError, match="etcd and NATS are embedded") as e:
        render("mock_agg.yaml", options=RenderOptions())
    assert e.value.which == ["etcd", "NATS"] and "--etcd-endpoints" in str(e.value)
    with pytest.raises(EmbeddedInfrastructureError, match="the graph's NATS is embedded"):
        render("mock_agg.yaml", options=RenderOptions(etcd_endpoints=("http://e:2379",)))
    # A graph with external endpoints renders without flags, and the pods get them.
    objects = render(
        "mock_agg.yaml",
        "infrastructure.etcd={endpoints: [http://e1:2379, http://e2:2379]}",
        "infrastructure.nats={url: nats://n:4222}",
        options=RenderOptions(),
    )
    env = env_of(by_kind(objects, "Deployment")[1])
    assert env["KVMESH_ETCD_ENDPOINTS"]["value"] == "http://e1:2379,http://e2:2379"
    assert env["KVMESH_NATS_URL"]["value"] == "nats://n:4222"


def test_a_worker_pod_drains_within_its_grace_period_and_is_ready_once_registered():
    objects = render("mock_agg.yaml", "workers[0].graceful_timeout_s=90.5")
    dep = next(d for d in by_kind(objects, "Deployment") if d["metadata"]["labels"]["kvmesh.io/component"] == "worker")
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert pod["terminationGracePeriodSeconds"] == 91  # the group's graceful_timeout_s, whole seconds up
    assert c["lifecycle"]["preStop"]["exec"]["command"] == PRE_STOP
    assert c["readinessProbe"]["exec"]["command"] == ["test", "-f", READY_FILE]
    env = env_of(dep)
    assert env["KVMESH_READY_FILE"]["value"] == READY_FILE
    # Loopback does not cross pods: the response address, pod and node names from the downward API.
    assert env["KVMESH_RESPONSE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["KVMESH_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["KVMESH_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "resources" not in c  # no GPU asked for


def test_gpus_per_replica_becomes_a_gpu_limit_and_no_cuda_visible_devices():
    objects = render("agg.yaml", "workers[0].gpus_per_replica=2")
    (dep,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["labels"]["kvmesh.io/component"] == "worker"]
    assert container(dep)["resources"] == {"limits": {GPU_RESOURCE: 2}}
    assert "CUDA_VISIBLE_DEVICES" not in env_of(dep)  # the device plugin picks the GPUs


def test_the_frontend_binds_the_pod_and_its_service_reaches_it():
    objects = render("mock_agg.yaml", "frontend.port=0")
    (svc,) = by_kind(objects, "Service")
    fe = next(d for d in by_kind(objects, "Deployment") if d["metadata"]["labels"]["kvmesh.io/component"] == "frontend")
    cmd = container(fe)["command"]
    assert cmd.count("--host") == 1 and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--port") + 1] == "8000"  # port 0 (a free one) means nothing behind a Service
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": 8000, "protocol": "TCP"}]
    assert svc["spec"]["selector"].items() <= fe["spec"]["template"]["metadata"]["labels"].items()
    assert container(fe)["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}


def test_the_planner_runs_the_kubernetes_connector_with_a_role_that_only_scales():
    objects = render("mock_planner.yaml")
    (role,) = by_kind(objects, "Role")
    assert role["rules"] == planner_rules()
    allowed = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    assert ("apps", "deployments/scale", "patch") in allowed and ("", "pods", "patch") in allowed
    assert not any(v in {"delete", "create", "deletecollection"} for _, _, v in allowed)
    assert not any(r in {"secrets", "deployments/status"} for _, r, _ in allowed)
    (binding,) = by_kind(objects, "RoleBinding")
    (sa,) = by_kind(objects, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "default"}]
    planner = next(
        d for d in by_kind(objects, "Deployment") if d["metadata"]["labels"]["kvmesh.io/component"] == "planner"
    )
    assert planner["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    cmd = container(planner)["command"]
    assert cmd[cmd.index("--environment") + 1] == "kubernetes"
    assert cmd[cmd.index("--k8s-namespace") + 1] == "default"
    assert "--state-dir" not in cmd
    assert cmd[cmd.index("--log-dir") + 1] == "/opt/kvmesh/runs/planner"
    assert DELETION_COST == "controller.kubernetes.io/pod-deletion-cost"


def test_credentials_come_from_the_secret_never_from_a_value():
    options = RenderOptions(etcd_endpoints=("http://e:2379",), nats_url="nats://n:4222", credentials_secret="kv-creds")
    for dep in by_kind(render("mock_rescheduler.yaml", options=options), "Deployment"):
        env = env_of(dep)
        for name, key in (("KVMESH_ETCD_PASSWORD", "etcd-password"), ("KVMESH_NATS_TOKEN", "nats-token")):
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "kv-creds", "key": key, "optional": True}
            assert "value" not in env[name]


def test_names_are_kubernetes_names():
    assert k8s_name("My_NS", "mock_0") == "my-ns-mock-0"
    assert k8s_name("9lives", "x") == "k-9lives-x"  # a DNS-1035 label starts with a letter
    assert len(k8s_name("a" * 80, "b")) <= 63
    with pytest.raises(ValueError):
        k8s_name("__")


def test_the_command_writes_one_file_per_object_and_refuses_an_embedded_graph(tmp_path, capsys):
    out = tmp_path / "manifests"
    argv = ["k8s", "render", str(ROOT / "graphs/mock_planner.yaml"), "--etcd-endpoints", "http://e:2379",
            "--nats-url", "nats://n:4222", "-o", str(out)]  # fmt: skip
    assert kvmesh(argv) == 0
    files = sorted(p.name for p in out.iterdir())
    # ConfigMap, frontend Deployment and Service, worker Deployment, the planner's account, Role, binding, Deployment
    assert files[0] == "00-configmap-mock-planner-graph.yaml" and len(files) == 8
    assert kvmesh(["k8s", "render", str(ROOT / "graphs/mock_agg.yaml")]) == 2
    assert "embedded" in capsys.readouterr().err
