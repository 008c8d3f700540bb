"""The shipped disaggregated graphs (graphs/mock_disagg.yaml, graphs/disagg.yaml): they load, their roles and
thresholds are what their comments say, and every command serve would run parses as a kvmesh command."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.cli.main import build_parser
from components.deploy.graph import load_graph
from components.deploy.plan import plan_watchers
from components.protocol.metadata import WorkerRole
from components.workers.config import DECODE_ONLY_FIELDS, EngineKind

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "models" / "tiny-llama"


def test_mock_disagg_is_a_frontend_two_prefill_and_two_decode_simulated_workers():
    g = load_graph(ROOT / "graphs" / "mock_disagg.yaml")
    assert g.frontend.enabled and g.frontend.host == "127.0.0.1"
    assert [(w.name, w.role, w.replicas, w.num_workers) for w in g.workers] == [
        ("prefill", WorkerRole.PREFILL, 2, 1),
        ("decode", WorkerRole.DECODE, 1, 2),
    ]
    assert g.num_workers_expected() == 4
    decode = g.workers[1]
    for w in g.workers:
        assert w.engine == EngineKind.MOCK and w.model == "tiny-llama" and Path(w.model_path) == TINY
        assert (w.vocab_size, w.eos_token_id, w.max_model_len, w.seed) == (384, 257, 2048, 0)  # same tokens both sides
    assert (decode.max_local_prefill_length, decode.max_prefill_queue_size, decode.remote_prefill_timeout_s) == (
        1000,
        3,
        30.0,
    )
    assert g.watcher_names() == [
        "mock-disagg-frontend",
        "mock-disagg-prefill-0",
        "mock-disagg-prefill-1",
        "mock-disagg-decode-0",
    ]


def test_disagg_is_a_frontend_one_vllm_prefill_and_one_vllm_decode_worker_like_agg():
    g = load_graph(ROOT / "graphs" / "disagg.yaml")
    agg = load_graph(ROOT / "graphs" / "agg.yaml")
    assert [(w.name, w.engine, w.role, w.replicas) for w in g.workers] == [
        ("prefill", EngineKind.VLLM, WorkerRole.PREFILL, 1),
        ("decode", EngineKind.VLLM, WorkerRole.DECODE, 1),
    ]
    # The engine's options are agg.yaml's (the same greedy tokens), whatever the role.
    engine_fields = set(type(agg.workers[0]).model_fields) - {"name", "role", "replicas", *DECODE_ONLY_FIELDS}
    for w in g.workers:
        assert {f: getattr(w, f) for f in engine_fields} == {f: getattr(agg.workers[0], f) for f in engine_fields}
    assert g.namespace != agg.namespace  # both can be served side by side
    assert g.watcher_names() == ["disagg-frontend", "disagg-prefill-0", "disagg-decode-0"]


@pytest.mark.parametrize("graph", ["mock_disagg.yaml", "disagg.yaml"])
def test_the_planned_commands_parse_as_kvmesh_commands(graph, tmp_path):
    g = load_graph(ROOT / "graphs" / graph)
    plans = plan_watchers(
        g,
        etcd_endpoints=["http://127.0.0.1:1"],
        nats_url="nats://127.0.0.1:2",
        frontend_port=8000,
        gpus={},
        log_dir=tmp_path,
    )
    parser = build_parser()
    roles = []
    for plan in plans:
        args = parser.parse_args(plan.cmd[3:])
        assert args.command == plan.kind and args.namespace == g.namespace
        if plan.kind == "worker":
            roles.append(str(args.role))
    assert sorted(set(roles)) == ["decode", "prefill"]


def test_every_shipped_graph_loads():
    graphs = sorted((ROOT / "graphs").glob("*.yaml"))
    assert {p.name for p in graphs} >= {"agg.yaml", "mock_agg.yaml", "disagg.yaml", "mock_disagg.yaml"}
    for path in graphs:
        load_graph(path)
