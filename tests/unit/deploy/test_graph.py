"""Graph files: the schema, its error messages (file, line, field path, what is allowed), --set, path resolution,
and the watcher plans a graph becomes (commands, environment, GPUs)."""

from __future__ import annotations

import enum
import math
import types
import typing
from pathlib import Path

import pytest

from components.cli.main import build_parser
from components.deploy.circus import detect_gpus
from components.deploy.errors import GpuAssignmentError, GraphError, OverrideError
from components.deploy.graph import WORKER_GROUP_MODELS, Graph, apply_overrides, load_graph
from components.deploy.plan import REDACTED, assign_gpus, plan_replica, plan_watchers
from components.frontend.config import FrontendConfig
from components.protocol.metadata import WorkerRole
from components.runtime.config import RuntimeConfig
from components.runtime.flags import argv_for
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.mock import MockEngineConfig
from components.workers.engines.vllm.config import VllmEngineConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "models" / "tiny-llama"

MINIMAL = f"""\
namespace: t
workers:
  - name: mock
    engine: mock
    model: m
    model_path: {TINY}
"""


def write_graph(tmp_path: Path, text: str, name: str = "g.yaml") -> Path:
    d = tmp_path / "graphs"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text(text)
    return p


def problems_of(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(GraphError) as exc:
        load_graph(path, overrides)
    assert exc.value.path == path
    lines = str(exc.value).splitlines()[1:]
    assert len(lines) == len(exc.value.problems)
    for line in lines:  # every problem names the file
        assert line.strip().startswith(str(path))
    return [line.strip() for line in lines]


# -- the shipped graphs -----------------------------------------------------------------------------------------


def test_mock_agg_is_a_frontend_and_16_simulated_workers_on_the_tiny_llama_tokenizer():
    g = load_graph(ROOT / "graphs" / "mock_agg.yaml")
    assert g.frontend.enabled and g.frontend.host == "127.0.0.1"
    assert g.infrastructure.etcd.embedded and g.infrastructure.nats.embedded
    assert g.num_workers_expected() == 16
    [group] = g.workers
    assert group.engine == EngineKind.MOCK and group.model == "tiny-llama"
    assert Path(group.model_path) == TINY  # relative to the repository root, not to graphs/
    assert group.vocab_size == 384 and group.eos_token_id == 257
    assert group.max_model_len == 2048
    assert g.watcher_names() == ["mock-frontend", "mock-mock-0", "mock-mock-1"]


def test_agg_is_a_frontend_and_two_vllm_workers_on_the_tiny_model():
    g = load_graph(ROOT / "graphs" / "agg.yaml")
    assert [(w.engine, w.replicas, w.num_workers) for w in g.workers] == [(EngineKind.VLLM, 2, 1)]
    assert Path(g.workers[0].model_path) == TINY
    assert g.watcher_names() == ["kvmesh-frontend", "kvmesh-vllm-0", "kvmesh-vllm-1"]


@pytest.mark.parametrize("graph", ["mock_agg.yaml", "agg.yaml", "mock_planner.yaml"])
def test_the_planned_commands_parse_as_kvmesh_commands(graph, tmp_path):
    """Every flag serve will pass exists in `kvmesh worker` / `kvmesh frontend` / `kvmesh planner` (an unknown flag
    would only show up as a crash-looping watcher)."""
    g = load_graph(ROOT / "graphs" / graph)
    plans = plan_watchers(
        g,
        etcd_endpoints=["http://127.0.0.1:1"],
        nats_url="nats://127.0.0.1:2",
        frontend_port=8000,
        gpus={},
        log_dir=tmp_path,
        state_dir=tmp_path,
    )
    assert ("planner" in [p.kind for p in plans]) == (graph == "mock_planner.yaml")
    parser = build_parser()
    for plan in plans:
        assert plan.cmd[1:3] == ["-m", "components.cli.main"]
        args = parser.parse_args(plan.cmd[3:])
        assert args.command == plan.kind
        assert args.namespace == g.namespace


# -- error messages ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        ("namespace: 'a b'\n", ":1: namespace:", "1-64 letters, digits, '_' or '-' (got 'a b')"),
        ("namespace: t\n", ":1: workers:", "required field is missing"),
        (
            "namespace: t\nworkerz: []\n",
            ":2: workerz:",
            "unknown field 'workerz'; did you mean 'workers'?; allowed here: namespace, base_dir",
        ),
        (
            "namespace: t\nrescheduler: {rescheduling_intervl_ms: 3}\n",
            ":2: rescheduler.rescheduling_intervl_ms:",
            "unknown field 'rescheduling_intervl_ms'; did you mean 'rescheduling_interval_ms'?",
        ),
        (
            "namespace: t\nplanner: {adjustment_intervl: 3}\n",
            ":2: planner.adjustment_intervl:",
            "unknown field 'adjustment_intervl'; did you mean 'adjustment_interval'?",
        ),
        ("namespace: t\nplanner:\n  environment: virtual\n", ":2: planner:", "environment is not set here"),
        (
            "namespace: t\nplanner:\n  decode_kv_scale_up_threshold: 0.4\n",
            ":2: planner:",
            "decode_kv_scale_down_threshold (0.5) must be below decode_kv_scale_up_threshold (0.4)",
        ),
        ("namespace: t\ninfrastructure: {etcd: embeded}\n", ":2: infrastructure.etcd:", "expected 'embedded' or"),
        (
            "namespace: t\ninfrastructure:\n  nats: {url: 'nats://h:4222', port: 5}\n",
            ":3: infrastructure.nats:",
            "port applies to an embedded nats-server only",
        ),
        (
            "namespace: t\ninfrastructure:\n  etcd: {endpoints: ['http://h:x']}\n",
            ":3: infrastructure.etcd.endpoints:",
            "does not parse",
        ),
        ("namespace: t\nfrontend:\n  port: 70000\n", ":3: frontend.port:", "less than or equal to 65535 (got 70000)"),
        ("namespace: t\nfrontend: {hots: x}\n", ":2: frontend.hots:", "unknown field 'hots'; did you mean 'host'?"),
        ("namespace: t\nlog_level: LOUD\n", ":2: log_level:", "'DEBUG', 'INFO', 'WARNING' or 'ERROR' (got 'LOUD')"),
    ],
)
def test_each_schema_error_names_file_line_field_and_what_is_allowed(tmp_path, text, where, says):
    path = write_graph(tmp_path, text)
    found = [p for p in problems_of(path) if where in p]
    assert found, problems_of(path)
    assert says in found[0]


def test_worker_group_errors_are_located_in_the_list(tmp_path):
    text = MINIMAL + "    replicas: -1\n  - {name: Big, engine: mock, model: m, model_path: x}\n"
    text += "  - {name: s, engine: sglang, model: m, model_path: nowhere}\n"
    problems = problems_of(write_graph(tmp_path, text))
    assert any(":7: workers[0].replicas: Input should be greater than or equal to 0 (got -1)" in p for p in problems)
    assert any(":8: workers[1].name: must be 1-48 lower-case letters" in p and "(got 'Big')" in p for p in problems)
    assert any(":9: workers[2].engine: must be one of mock, vllm (got 'sglang')" in p for p in problems)


def test_engine_options_are_checked_against_the_engine_config_by_name_and_value(tmp_path):
    text = MINIMAL + "    speedup: 2\n    vocab_size: big\n    block-size: 4\n"
    problems = problems_of(write_graph(tmp_path, text))
    assert any(":7: workers[0].speedup: unknown field 'speedup'" in p and "speedup_ratio" in p for p in problems)
    assert any(":8: workers[0].vocab_size: Input should be a valid integer" in p for p in problems)
    assert any(":9: workers[0].block-size: unknown field 'block-size'" in p and "block_size" in p for p in problems)
    # A vLLM group takes vLLM's options, not the simulator's.
    text = MINIMAL.replace("engine: mock", "engine: vllm") + "    speedup_ratio: 2\n"
    [problem] = problems_of(write_graph(tmp_path, text, "v.yaml"))
    assert ":7: workers[0].speedup_ratio: unknown field" in problem and "kv_cache_memory_bytes" in problem


def test_cross_field_errors_of_the_engine_config_are_reported(tmp_path):
    text = MINIMAL + "    vocab_size: 100\n    eos_token_id: 500\n"
    [problem] = problems_of(write_graph(tmp_path, text))
    assert ":2: workers[0]: eos_token_id 500 is outside the vocabulary of 100" in problem or (
        "workers[0]: eos_token_id 500 is outside the vocabulary of 100" in problem
    )


def test_env_values_must_be_strings_numbers_are_converted_and_kvmesh_variables_are_reserved(tmp_path):
    ok = load_graph(write_graph(tmp_path, MINIMAL + "    env: {OMP_NUM_THREADS: 1}\n"))
    assert ok.workers[0].env == {"OMP_NUM_THREADS": "1"}
    [problem] = problems_of(write_graph(tmp_path, MINIMAL + "    env: {FLAG: true}\n", "b.yaml"))
    assert "workers[0].env.FLAG: Input should be a valid string; quote it" in problem
    [problem] = problems_of(write_graph(tmp_path, MINIMAL + "    env: {KVMESH_NATS_URL: x}\n", "c.yaml"))
    assert "workers[0].env: KVMESH_NATS_URL is set by kvmesh" in problem


def test_num_workers_is_for_the_mock_engine_and_group_names_are_unique(tmp_path):
    text = MINIMAL + "    num_workers: 4\n  - {name: v, engine: vllm, model: m, model_path: x, num_workers: 2}\n"
    [problem] = problems_of(write_graph(tmp_path, text))
    assert "workers[1]: num_workers > 1 is for engine mock only" in problem
    text = MINIMAL + f"  - {{name: mock, engine: mock, model: m, model_path: {TINY}}}\n"
    [problem] = problems_of(write_graph(tmp_path, text, "d.yaml"))
    assert "two worker groups are named 'mock'" in problem


def test_a_missing_model_directory_is_named_with_what_it_resolved_to(tmp_path):
    text = MINIMAL.replace(str(TINY), "models/none")
    [problem] = problems_of(write_graph(tmp_path, text))
    assert f":6: workers[0].model_path: {tmp_path}/models/none is not a directory (relative to {tmp_path})" in problem


def test_a_yaml_syntax_error_names_its_line(tmp_path):
    path = write_graph(tmp_path, "namespace: t\nworkers:\n  - name: a\n    engine: mock\n  model: m\n")
    [problem] = problems_of(path)
    assert problem.startswith(f"{path}:5: YAML syntax error (column 3)")


def test_not_a_mapping_and_unreadable_files_are_graph_errors(tmp_path):
    [problem] = problems_of(write_graph(tmp_path, "- a\n- b\n"))
    assert "a graph is a mapping of fields, got list" in problem
    [problem] = problems_of(tmp_path / "missing.yaml")
    assert "cannot read the file" in problem


# -- paths ------------------------------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_parent_of_the_graphs_directory(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    g = load_graph(write_graph(tmp_path, MINIMAL.replace(str(TINY), "models/m")))
    assert g.workers[0].model_path == str(tmp_path / "models" / "m")


def test_base_dir_moves_the_resolution_relative_to_the_graph_file(tmp_path):
    (tmp_path / "graphs" / "local").mkdir(parents=True)
    g = load_graph(write_graph(tmp_path, "base_dir: .\n" + MINIMAL.replace(str(TINY), "local")))
    assert g.workers[0].model_path == str(tmp_path / "graphs" / "local")


# -- --set ------------------------------------------------------------------------------------------------------


def test_overrides_reach_lists_and_nested_mappings_and_parse_values_as_yaml(tmp_path):
    path = write_graph(tmp_path, MINIMAL + "infrastructure: {etcd: embedded}\n")
    g = load_graph(
        path,
        [
            "frontend.port=0",
            "workers[0].replicas=3",
            "workers.0.speedup_ratio=.inf",
            "workers[0].enable_prefix_caching=false",
            "infrastructure.etcd.port=23790",
        ],
    )
    assert g.frontend.port == 0 and g.workers[0].replicas == 3
    assert math.isinf(g.workers[0].speedup_ratio)
    assert g.workers[0].enable_prefix_caching is False
    assert g.infrastructure.etcd.embedded and g.infrastructure.etcd.port == 23790


def test_an_invalid_override_is_reported_as_coming_from_set(tmp_path):
    path = write_graph(tmp_path, MINIMAL)
    [problem] = problems_of(path, ("frontend.port=-1",))
    assert problem == f"{path}: frontend.port: Input should be greater than or equal to 0 (got -1) (from --set)"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("frontend.port", "expected PATH=VALUE"),
        ("workers[3].replicas=1", "workers has 1 entries"),
        ("a..b=1", "PATH is"),
    ],
)
def test_malformed_overrides_are_rejected(override, says):
    with pytest.raises(OverrideError) as exc:
        apply_overrides({"workers": [{}]}, [override])
    assert says in str(exc.value)


# -- plans: flags, GPUs, environment ----------------------------------------------------------------------------


def test_argv_for_follows_the_kvmesh_flag_conventions():
    args = {"speedup_ratio": math.inf, "enable_prefix_caching": False, "enforce_eager": True, "components": ["a", "b"]}
    assert argv_for(args | {"eos_token_id": None}) == [
        "--speedup-ratio",
        "inf",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--components",
        "a,b",
    ]


def graph_with(groups: list[dict]) -> Graph:
    return Graph.model_validate({"namespace": "t", "workers": groups})


def test_gpus_are_assigned_in_consecutive_blocks_in_group_and_replica_order():
    g = graph_with(
        [
            {"name": "a", "engine": "vllm", "model": "m", "model_path": "x", "replicas": 2, "gpus_per_replica": 1},
            {"name": "c", "engine": "mock", "model": "m", "model_path": "x", "replicas": 1},
            {"name": "b", "engine": "vllm", "model": "m", "model_path": "x", "replicas": 1, "gpus_per_replica": 2},
        ]
    )
    assert assign_gpus("t", g.workers, ["0", "1", "2", "3"]) == {
        "t-a-0": ["0"],
        "t-a-1": ["1"],
        "t-c-0": [],
        "t-b-0": ["2", "3"],
    }
    with pytest.raises(GpuAssignmentError) as exc:
        assign_gpus("t", g.workers, ["0", "1"])
    assert exc.value.needed == 4 and "a: 2 x 1, b: 1 x 2" in str(exc.value)


def test_gpus_come_from_cuda_visible_devices_when_kvmesh_runs_under_one():
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_plans_set_endpoints_gpus_and_keep_the_api_key_out_of_argv(tmp_path):
    g = Graph.model_validate(
        {
            "namespace": "t",
            "frontend": {"api_key": "sekrit", "router_policy": "kv"},
            "workers": [
                {"name": "v", "engine": "vllm", "model": "m", "model_path": "/x", "replicas": 2, "gpus_per_replica": 1},
                {"name": "p", "engine": "mock", "component": "prefill", "model": "m", "model_path": "/x"},
            ],
        }
    )
    plans = plan_watchers(
        g,
        etcd_endpoints=["http://127.0.0.1:1", "http://127.0.0.1:2"],
        nats_url="nats://127.0.0.1:3",
        frontend_port=8123,
        gpus=assign_gpus("t", g.workers, ["0", "1"]),
        log_dir=tmp_path,
        python="/py",
    )
    fe, v0, v1, p0 = plans
    assert [p.name for p in plans] == ["t-frontend", "t-v-0", "t-v-1", "t-p-0"]
    assert all(p.env["KVMESH_ETCD_ENDPOINTS"] == "http://127.0.0.1:1,http://127.0.0.1:2" for p in plans)
    assert all(p.env["KVMESH_NATS_URL"] == "nats://127.0.0.1:3" for p in plans)
    assert "sekrit" not in fe.cmd and fe.env["KVMESH_API_KEY"] == "sekrit"
    assert fe.redacted_env()["KVMESH_API_KEY"] == REDACTED
    assert fe.cmd[fe.cmd.index("--port") + 1] == "8123"
    assert fe.cmd[fe.cmd.index("--router-policy") + 1] == "kv"
    assert fe.cmd[fe.cmd.index("--components") + 1] == "backend,prefill"
    assert (v0.env["CUDA_VISIBLE_DEVICES"], v1.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert (v0.gpus, v1.gpus, p0.gpus) == (["0"], ["1"], [])
    assert "CUDA_VISIBLE_DEVICES" not in p0.env
    assert p0.log == tmp_path / "t-p-0.log" and p0.num_workers == 1 and p0.component == "prefill"


# -- sections derived from the component configs ----------------------------------------------------------------


def test_every_component_option_is_a_graph_field_without_being_declared_in_the_graph():
    """A field added to FrontendConfig, RuntimeConfig, WorkerConfig or an engine's config is a graph field at once."""
    from components.deploy.graph import FrontendSpec, RuntimeSpec

    assert set(FrontendConfig.model_fields) <= set(FrontendSpec.model_fields)
    assert set(RuntimeConfig.model_fields) <= set(RuntimeSpec.model_fields)
    for kind, engine in ((EngineKind.MOCK, MockEngineConfig), (EngineKind.VLLM, VllmEngineConfig)):
        group = WORKER_GROUP_MODELS[kind]
        assert set(WorkerConfig.model_fields) | set(engine.model_fields) <= set(group.model_fields)
        # ... with the component's own default and description, not a copy that could drift.
        for name, field in engine.model_fields.items():
            if name != "model_path":
                assert group.model_fields[name].description == field.description


@pytest.mark.parametrize("engine", ["mock", "vllm"])
def test_a_group_s_options_reach_kvmesh_worker_unchanged(tmp_path, engine):
    """Round trip: graph section -> argv (argv_for) -> kvmesh worker's own parser -> the same config values."""
    options = (
        {"speedup_ratio": math.inf, "enable_prefix_caching": False, "vocab_size": 384, "eos_token_id": 257}
        if engine == "mock"
        else {"kv_cache_memory_bytes": 1 << 26, "enforce_eager": False, "max_model_len": 1024, "dtype": "float32"}
    )
    g = graph_with([{"name": "g", "engine": engine, "model": "m", "model_path": str(TINY), **options}])
    plan = plan_replica(
        g, "g", 0, etcd_endpoints=["http://127.0.0.1:1"], nats_url="nats://127.0.0.1:2", log_dir=tmp_path
    )
    args = build_parser().parse_args(plan.cmd[3:])
    from components.runtime.flags import model_from_args

    engine_model = MockEngineConfig if engine == "mock" else VllmEngineConfig
    parsed = model_from_args(engine_model, args, **({"model_path": str(TINY)} if engine == "vllm" else {}))
    for key, value in options.items():
        assert getattr(parsed, key) == value, key
    worker = model_from_args(WorkerConfig, args)
    assert (worker.namespace, worker.engine, worker.model, worker.model_path) == ("t", engine, "m", str(TINY))


def test_frontend_options_and_runtime_settings_reach_every_process(tmp_path):
    g = Graph.model_validate(
        {
            "namespace": "t",
            "runtime": {"lease_ttl_s": 4, "response_transport": "bus"},
            "frontend": {"router_policy": "kv+autellix", "max_retries": 5, "router_temperature": 0.25},
            "workers": [{"name": "w", "engine": "mock", "model": "m", "model_path": "/x"}],
        }
    )
    fe, w0 = plan_watchers(
        g, etcd_endpoints=["http://h:1"], nats_url="nats://h:2", frontend_port=0, gpus={}, log_dir=tmp_path
    )
    parser = build_parser()
    from components.frontend.main import config_from_args
    from components.runtime.process import runtime_config_from_args

    fe_args = parser.parse_args(fe.cmd[3:])
    cfg = config_from_args(fe_args)
    assert (cfg.router_policy, cfg.max_retries, cfg.router_temperature) == ("kv+autellix", 5, 0.25)
    for plan in (fe, w0):
        rt = runtime_config_from_args(parser.parse_args(plan.cmd[3:]))
        assert (rt.lease_ttl_s, rt.response_transport) == (4, "bus")
    # Only what the graph gives is passed: every other option keeps the component's own default.
    assert "--request-ack-timeout-s" not in w0.cmd and "--shutdown-timeout-s" not in fe.cmd


def test_sections_refuse_what_the_graph_sets_elsewhere(tmp_path):
    text = MINIMAL.replace("namespace: t", "namespace: t\nruntime: {etcd_endpoints: [x]}\nfrontend: {namespace: u}")
    problems = problems_of(write_graph(tmp_path, text))
    assert any("runtime: etcd_endpoints is not set here: every component gets the endpoints" in p for p in problems)
    assert any("frontend: namespace is not set here: the graph's top-level namespace" in p for p in problems)


def test_a_null_that_no_flag_can_carry_is_refused(tmp_path):
    [problem] = problems_of(write_graph(tmp_path, MINIMAL + "    eos_token_id: null\n"))
    assert "workers[0].eos_token_id: null cannot be passed" in problem


def test_a_graph_in_the_old_schema_gets_an_error_at_each_old_key_saying_what_to_write(tmp_path):
    text = (
        "namespace: t\nfrontend:\n  router: kv\n  args: {max-retries: 5}\nworkers:\n"
        f"  - name: m\n    engine: mock\n    model: m\n    model_path: {TINY}\n    engine_args: {{speedup_ratio: 10}}\n"
    )
    problems = problems_of(write_graph(tmp_path, text))
    assert len(problems) == 3
    assert ":3: frontend.router: renamed router_policy" in problems[0] and "router_policy: kv" in problems[0]
    assert ":4: frontend.args:" in problems[1] and "max_retries: 5" in problems[1]  # the field name, not the flag
    assert ":10: workers[0].engine_args:" in problems[2] and "speedup_ratio: 10" in problems[2]


def test_plan_replica_plans_one_more_replica_as_the_graph_would(tmp_path):
    g = graph_with([{"name": "v", "engine": "vllm", "model": "m", "model_path": "/x", "gpus_per_replica": 1}])
    where = {"etcd_endpoints": ["http://h:1"], "nats_url": "nats://h:2", "log_dir": tmp_path, "python": "/py"}
    [first] = plan_watchers(g, frontend_port=0, gpus={"t-v-0": ["3"]}, **where)[1:]
    assert plan_replica(g, "v", 0, gpus=["3"], **where) == first
    extra = plan_replica(g, "v", 1, gpus=["5"], **where)
    assert (extra.name, extra.replica, extra.gpus, extra.env["CUDA_VISIBLE_DEVICES"]) == ("t-v-1", 1, ["5"], "5")
    assert extra.cmd == first.cmd and extra.log == tmp_path / "t-v-1.log"
    with pytest.raises(GpuAssignmentError):
        plan_replica(g, "v", 2, gpus=[], **where)
    with pytest.raises(KeyError):
        plan_replica(g, "nope", 0, **where)


def test_watcher_names_carry_the_namespace_so_two_graphs_can_share_a_state_dir():
    a = Graph.model_validate(
        {"namespace": "a", "workers": [{"name": "w", "engine": "mock", "model": "m", "model_path": "x"}]}
    )
    b = Graph.model_validate(
        {"namespace": "b", "workers": [{"name": "w", "engine": "mock", "model": "m", "model_path": "x"}]}
    )
    assert set(a.watcher_names()).isdisjoint(b.watcher_names())


# -- disaggregated serving: roles and thresholds -----------------------------------------------------------------


def disagg_graph(*groups: str, frontend: str = "") -> str:
    """A graph of mock groups, each written as ``name:model:role`` (role empty: left out, the default)."""
    text = f"namespace: t\n{frontend}workers:\n"
    for spec in groups:
        name, model, role = spec.split(":")
        text += f"  - {{name: {name}, engine: mock, model: {model}, model_path: {TINY}"
        text += f", role: {role}}}\n" if role else "}\n"
    return text


def test_a_disaggregated_graph_loads_and_each_group_s_role_and_thresholds_reach_kvmesh_worker(tmp_path):
    text = disagg_graph("pre:m:prefill", "dec:m:decode", "agg:other:")
    text = text.replace("role: decode}", "role: decode, max_local_prefill_length: 512, max_prefill_queue_size: 8}")
    g = load_graph(write_graph(tmp_path, text))
    assert [(w.name, w.role) for w in g.workers] == [
        ("pre", WorkerRole.PREFILL), ("dec", WorkerRole.DECODE), ("agg", WorkerRole.AGGREGATED)
    ]  # fmt: skip
    parser = build_parser()
    from components.runtime.flags import model_from_args

    where = {"etcd_endpoints": ["http://h:1"], "nats_url": "nats://h:2", "log_dir": tmp_path}
    cmds = {w.name: plan_replica(g, w.name, 0, **where).cmd for w in g.workers}
    configs = {name: model_from_args(WorkerConfig, parser.parse_args(cmd[3:])) for name, cmd in cmds.items()}
    assert (configs["pre"].role, configs["dec"].role, configs["agg"].role) == ("prefill", "decode", "aggregated")
    assert (configs["dec"].max_local_prefill_length, configs["dec"].max_prefill_queue_size) == (512, 8)
    assert (configs["pre"].max_local_prefill_length, configs["pre"].max_prefill_queue_size) == (1000, 3)
    assert "--role" not in cmds["agg"]  # the default is the worker's own: nothing is passed


def test_decode_workers_without_prefill_workers_of_their_model_are_an_error(tmp_path):
    # 'm' has decode groups only (a typo in the prefill group's model makes 'mm' prefill-only, reported too).
    text = disagg_graph("dec:m:decode", "dec2:m:decode", "pre:mm:prefill")
    problems = problems_of(write_graph(tmp_path, text))
    assert len(problems) == 2, problems
    said = ":3: workers[0].role: model 'm' has decode workers (groups 'dec', 'dec2') but no prefill workers"
    assert said in problems[0]
    assert "add a group with role: prefill and model: m" in problems[0]
    assert ":5: workers[2].role: model 'mm' has prefill workers (group 'pre') but no decode workers" in problems[1]
    assert "add a group with role: decode and model: mm" in problems[1]


def test_prefill_workers_without_decode_workers_of_their_model_are_an_error(tmp_path):
    [problem] = problems_of(write_graph(tmp_path, disagg_graph("agg:m:", "pre:m:prefill")))
    assert "workers[1].role: model 'm' has prefill workers (group 'pre') but no decode workers" in problem
    assert "clients are never routed to prefill workers" in problem


def test_aggregated_and_decode_workers_of_one_model_are_an_error(tmp_path):
    text = disagg_graph("agg:m:aggregated", "pre:m:prefill", "dec:m:decode")
    [problem] = problems_of(write_graph(tmp_path, text))
    assert ":5: workers[2].role: model 'm' has aggregated (group 'agg') and decode (group 'dec') workers" in problem
    assert "under another model name or in another graph" in problem
    # Two models side by side, one served each way, is the way to have both.
    load_graph(write_graph(tmp_path, disagg_graph("agg:m:", "pre:m2:prefill", "dec:m2:decode"), "ok.yaml"))


def test_a_graph_without_a_frontend_may_add_one_role_to_another_deployment(tmp_path):
    text = disagg_graph("pre:m:prefill", frontend="frontend: {enabled: false}\n")
    assert load_graph(write_graph(tmp_path, text)).workers[0].role == WorkerRole.PREFILL
    # ... but what it says about one model must still fit together.
    text = disagg_graph("agg:m:", "dec:m:decode", frontend="frontend: {enabled: false}\n")
    [problem] = problems_of(write_graph(tmp_path, text, "b.yaml"))
    assert "model 'm' has aggregated (group 'agg') and decode (group 'dec') workers" in problem


def test_a_threshold_on_a_group_that_is_not_decode_and_an_unknown_role_are_located(tmp_path):
    text = disagg_graph("pre:m:prefill", "dec:m:decode")
    text = text.replace("role: prefill}", "role: prefill, max_local_prefill_length: 64}")
    [problem] = problems_of(write_graph(tmp_path, text))
    said = "workers[0]: max_local_prefill_length = 64: only decode workers read it (this worker's role is prefill"
    assert said in problem
    text = disagg_graph("pre:m:prefill", "dec:m:decoder")
    [problem] = problems_of(write_graph(tmp_path, text, "b.yaml"))
    assert ":4: workers[1].role: Input should be 'aggregated', 'prefill' or 'decode' (got 'decoder')" in problem


# -- every option survives the trip to its process --------------------------------------------------------------


def _other_values(field) -> list:
    """Values of ``field``'s type other than its default, most likely valid first (a candidate the config refuses is
    skipped by the caller)."""
    default = field.get_default(call_default_factory=True)
    ann = field.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    if ann is bool:
        return [True if default is None else not default]
    if typing.get_origin(ann) is typing.Literal:
        return [a for a in typing.get_args(ann) if a != default]
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return [m for m in ann if m != default]
    if ann is int:
        return [7, 1] if default is None else [default + 1, default - 1]
    if ann is float:
        return (
            [0.75, 2.5]
            if default is None or not math.isfinite(default)
            else [default * 1.5 + 0.25, default / 2, math.inf]
        )
    if ann is str:
        return ["-x", "tiny", "127.0.0.2", "kv"]
    if typing.get_origin(ann) is list:
        return [["a", "b"], [0.5, 2.0]]
    return []


def _round_trip_cases():
    """(component config, the extra fields it needs, kvmesh subcommand that takes its flags)."""
    return [
        (FrontendConfig, {}, "frontend"),
        (RuntimeConfig, {}, "frontend"),
        (RuntimeConfig, {}, "worker"),
        # As a decode worker: the only role that takes the prefill thresholds, so each of them can be set too.
        (WorkerConfig, {"role": "decode"}, "worker"),
        (MockEngineConfig, {}, "worker"),
        (VllmEngineConfig, {"model_path": str(TINY)}, "worker"),
    ]


@pytest.mark.parametrize(("model", "required", "command"), _round_trip_cases())
def test_every_field_of_every_component_config_survives_argv_for_and_the_component_s_own_parser(
    model, required, command
):
    """argv_for is add_model_arguments' inverse for every field, at its default and at another value: what a graph
    section says is what the process runs with, for options added later too."""
    from pydantic import ValidationError

    from components.runtime.errors import ConfigError
    from components.runtime.flags import given_values

    parser = build_parser()

    def round_trip(values: dict) -> object:
        args = parser.parse_args([command, *argv_for(values)])
        return model.model_validate(required | given_values(model, args))

    everything = model.model_validate(required)
    assert round_trip(everything.model_dump()) == everything  # every field given, at its default
    skipped = []
    for name, field in model.model_fields.items():
        for value in _other_values(field):
            try:
                expected = model.model_validate({**required, name: value})
            except (ValidationError, ConfigError):
                continue
            assert round_trip({name: getattr(expected, name)}) == expected, name
            break
        else:
            skipped.append(name)
    # A str the config checks against a list of its own (an address, a policy name) may have no candidate above.
    assert all(model.model_fields[n].annotation is str for n in skipped), skipped


def test_a_value_that_looks_like_a_flag_is_passed_attached_and_one_no_flag_can_carry_is_refused(tmp_path):
    assert argv_for({"model": "-m", "speedup_ratio": -math.inf}) == ["--model=-m", "--speedup-ratio=-inf"]
    text = MINIMAL.replace("namespace: t", "namespace: t\nfrontend: {components: ['a,b']}")
    [problem] = problems_of(write_graph(tmp_path, text))
    assert ":2: frontend.components: a list item cannot contain ','" in problem


def test_a_group_tightens_the_worker_s_own_fields_without_redeclaring_them(tmp_path):
    """model and model_path are required in a graph and component must be a mesh name; type and description stay
    WorkerConfig's, so a change there reaches graphs."""
    for group in WORKER_GROUP_MODELS.values():
        for name in ("model", "model_path", "component"):
            assert group.model_fields[name].description.startswith(WorkerConfig.model_fields[name].description)
        assert group.model_fields["model"].is_required() and group.model_fields["model_path"].is_required()
        assert group.model_fields["component"].default == WorkerConfig.model_fields["component"].default
    text = MINIMAL.replace("model: m\n", "component: 'a b'\n")
    problems = problems_of(write_graph(tmp_path, text))
    assert any(":5: workers[0].component: must be 1-64 letters, digits" in p for p in problems), problems
    assert any("workers[0].model: required field is missing (Served model name" in p for p in problems), problems


def test_an_unknown_field_names_the_one_it_most_likely_meant_and_lists_only_what_may_be_written_there(tmp_path):
    text = MINIMAL.replace("namespace: t", "namespace: t\nruntime: {lease_ttl: 3}\nfrontend: {hots: x}")
    problems = problems_of(write_graph(tmp_path, text + "    speedup: 3\n    block-size: 4\n    replicaz: 2\n"))
    said = {p.split(": ", 2)[1]: p.split(": ", 2)[2] for p in problems}
    assert said["runtime.lease_ttl"].startswith("unknown field 'lease_ttl'; did you mean 'lease_ttl_s'?")
    assert said["frontend.hots"].startswith("unknown field 'hots'; did you mean 'host'?")
    assert "did you mean 'speedup_ratio'?" in said["workers[0].speedup"]  # not 'seed': a prefix beats a spelling
    assert "did you mean 'block_size'?" in said["workers[0].block-size"]
    assert "did you mean 'replicas'?" in said["workers[0].replicaz"]
    # What the graph sets elsewhere is not offered; a group lists its own fields first, then the worker's.
    assert "etcd_endpoints" not in said["runtime.lease_ttl"] and "namespace" not in said["frontend.hots"]
    assert said["workers[0].replicaz"].split("allowed here: ")[1].startswith("name, replicas, gpus_per_replica")
