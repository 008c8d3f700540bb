"""A graph's ``planner:`` section (components/deploy/graph.py: the planner's own configs, less what the graph
decides), the planner's watcher plan, and how serve records a watcher added through the circus controller
(``added_watcher_state``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.cli.main import build_parser
from components.deploy.circus import WatcherInfo
from components.deploy.errors import GraphError
from components.deploy.graph import load_graph
from components.deploy.local import added_watcher_state
from components.deploy.plan import plan_watchers
from components.planner.config import PlannerConfig, PlannerRunConfig
from components.planner.main import configs_from_args

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "models" / "tiny-llama"


def graph_text(planner: str, models: tuple[str, ...] = ("m",)) -> str:
    groups = "".join(
        f"  - {{name: g{i}, engine: mock, model: {m}, model_path: {TINY}}}\n" for i, m in enumerate(models)
    )
    return f"namespace: t\nworkers:\n{groups}{planner}"


def load(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()):
    d = tmp_path / "graphs"
    d.mkdir(exist_ok=True)
    path = d / "g.yaml"
    path.write_text(text)
    return load_graph(path, overrides)


def errors(tmp_path: Path, text: str) -> str:
    with pytest.raises(GraphError) as exc:
        load(tmp_path, text)
    return str(exc.value)


def test_no_section_no_planner_and_an_empty_one_is_the_defaults_for_the_only_model(tmp_path):
    assert load(tmp_path, graph_text("")).planner is None
    g = load(tmp_path, graph_text("planner:\n"))
    assert g.planner is not None and g.planner.served_model_name == "m"
    assert g.planner.adjustment_interval == PlannerConfig().adjustment_interval
    assert g.planner.metrics_port == PlannerRunConfig().metrics_port
    assert g.watcher_names() == ["t-frontend", "t-g0-0", "t-planner"]


def test_the_section_takes_every_planner_flag_but_those_the_graph_decides(tmp_path):
    g = load(
        tmp_path,
        graph_text("planner:\n  adjustment_interval: 5\n  no_operation: true\n  log_dir: runs/p\n  metrics_port: 9\n"),
    )
    assert g.planner is not None
    assert (g.planner.adjustment_interval, g.planner.no_operation, g.planner.metrics_port) == (5.0, True, 9)
    assert g.planner.log_dir == str((tmp_path / "runs" / "p").resolve())  # against the base dir, as model_path
    for key, says in (
        ("namespace", "the graph's top-level namespace"),
        ("environment", "always drives the deployment's own circus arbiter"),
        ("state_dir", "kvmesh serve's own state directory"),
    ):
        assert says in errors(tmp_path, graph_text(f"planner:\n  {key}: x\n")), key


def test_the_model_must_be_one_the_graph_serves_and_is_required_when_it_serves_several(tmp_path):
    text = errors(tmp_path, graph_text("planner:\n  served_model_name: nope\n"))
    assert "planner.served_model_name: 'nope' is served by no worker group of this graph (models: m)" in text
    text = errors(tmp_path, graph_text("planner: {}\n", models=("a", "b")))
    assert "planner.served_model_name: required: this graph serves 2 models (a, b)" in text
    g = load(tmp_path, graph_text("planner: {served_model_name: b}\n", models=("a", "b")))
    assert g.planner is not None and g.planner.served_model_name == "b"


def test_bad_values_are_refused_with_the_policys_own_rules(tmp_path):
    assert "min_gpu_budget (3) must not exceed max_gpu_budget (2)" in errors(
        tmp_path, graph_text("planner: {max_gpu_budget: 2, min_gpu_budget: 3}\n")
    )
    assert "metric_pulling_interval (5.0 s) must not exceed adjustment_interval (1.0 s)" in errors(
        tmp_path, graph_text("planner: {adjustment_interval: 1, metric_pulling_interval: 5}\n")
    )
    assert "planner.adjustment_interval: Input should be greater than 0 (got 0)" in errors(
        tmp_path, graph_text("planner: {adjustment_interval: 0}\n")
    )


def test_the_planner_watcher_is_kvmesh_planner_local_with_the_sections_values(tmp_path):
    """The planned command parses as `kvmesh planner` and gives back the section's configs (flags round trip)."""
    g = load(tmp_path, graph_text("planner:\n  adjustment_interval: 4\n  decode_kv_scale_up_threshold: 0.7\n"))
    plans = plan_watchers(
        g,
        etcd_endpoints=["http://127.0.0.1:1"],
        nats_url="nats://127.0.0.1:2",
        frontend_port=8000,
        gpus={},
        log_dir=tmp_path / "logs",
        state_dir=tmp_path / "state",
    )
    planner = plans[-1]
    assert (planner.name, planner.kind, planner.model) == ("t-planner", "planner", "m")
    assert planner.log == tmp_path / "logs" / "t-planner.log"
    args = build_parser().parse_args(planner.cmd[3:])
    assert args.command == "planner"
    run, cfg = configs_from_args(args)
    assert (run.namespace, run.environment, run.state_dir, run.served_model_name) == (
        "t",
        "local",
        str(tmp_path / "state"),
        "m",
    )
    assert (cfg.adjustment_interval, cfg.decode_kv_scale_up_threshold) == (4.0, 0.7)
    assert cfg.decode_kv_scale_down_threshold == PlannerConfig().decode_kv_scale_down_threshold
    with pytest.raises(ValueError, match="needs the state directory"):
        plan_watchers(g, etcd_endpoints=[], nats_url="", frontend_port=1, gpus={}, log_dir=tmp_path)


def info(name: str, cmd: list[str], env: dict[str, str] | None = None) -> WatcherInfo:
    return WatcherInfo(name=name, cmd=cmd, env=env or {}, log=f"/logs/{name}.log", graceful_timeout_s=12.0)


def test_an_added_watcher_named_as_a_replica_is_recorded_as_one_of_its_group(tmp_path):
    text = (
        f"namespace: t\nworkers:\n  - {{name: a, engine: mock, model: ma, model_path: {TINY}}}\n"
        f"  - {{name: a-b, engine: mock, model: mb, model_path: {TINY}, num_workers: 2, role: aggregated}}\n"
    )
    g = load(tmp_path, text)
    w = added_watcher_state(g, info("t-a-b-3", ["python", "x"], {"CUDA_VISIBLE_DEVICES": "2,3", "K": "v"}))
    # "t-a-b-3" is replica 3 of group "a-b", not of group "a" (whose replicas are t-a-<digits>).
    assert (w.kind, w.group, w.replica, w.model, w.role, w.num_workers) == ("worker", "a-b", 3, "mb", "aggregated", 2)
    assert (w.gpus, w.env["K"], w.log, w.graceful_timeout_s, w.added) == (
        ["2", "3"],
        "v",
        "/logs/t-a-b-3.log",
        12.0,
        True,
    )
    w = added_watcher_state(g, info("t-a-1", ["python"]))
    assert (w.group, w.replica, w.model) == ("a", 1, "ma")


def test_an_added_watcher_of_another_name_is_read_from_its_command_line(tmp_path):
    g = load(tmp_path, graph_text(""))
    cmd = ["python", "-m", "components.cli.main", "--log-level", "INFO", "worker", "--model", "m", "--role", "decode"]
    w = added_watcher_state(g, info("extra", [*cmd, "--num-workers=3"]))
    assert (w.kind, w.group, w.model, w.role, w.num_workers, w.component) == (
        "worker",
        None,
        "m",
        "decode",
        3,
        "backend",
    )
    w = added_watcher_state(g, info("mine", ["python", "-m", "components.cli.main", "frontend", "--port", "1"]))
    assert (w.kind, w.model) == ("frontend", None)
    w = added_watcher_state(g, info("t-planner", ["python", "-m", "components.cli.main", "planner"]))
    assert w.kind == "planner"


def test_mode_sla_takes_the_sla_planners_fields_refuses_the_load_planners_and_round_trips_to_its_flags(tmp_path):
    from components.planner.config import SlaPlannerConfig

    g = load(tmp_path, graph_text("planner:\n  mode: sla\n  ttft: 300\n  load_predictor: constant\n"))
    assert g.planner is not None and str(g.planner.mode) == "sla"
    plans = plan_watchers(
        g,
        etcd_endpoints=["http://127.0.0.1:1"],
        nats_url="nats://127.0.0.1:2",
        frontend_port=8000,
        gpus={},
        log_dir=tmp_path / "logs",
        state_dir=tmp_path / "state",
    )
    run, cfg = configs_from_args(build_parser().parse_args(plans[-1].cmd[3:]))
    assert str(run.mode) == "sla" and isinstance(cfg, SlaPlannerConfig)
    assert (cfg.ttft, str(cfg.load_predictor)) == (300.0, "constant")
    assert cfg.itl == SlaPlannerConfig().itl  # not given: the SLA planner's default
    text = errors(tmp_path, graph_text("planner:\n  mode: sla\n  prefill_queue_scale_up_threshold: 2\n"))
    assert "prefill-queue-scale-up-threshold: only for mode load" in text, text
    assert "ttft: only for mode sla" in errors(tmp_path, graph_text("planner:\n  ttft: 300\n"))
