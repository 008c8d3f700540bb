"""The planner's pure parts: the controller's conversions from the fleet view (a ``MemoryFleet`` fed with explicit
times) to the policy's observation, the controller's pull and its changes in progress, the TensorBoard writer (its
files read back with tensorboard's own event reader), the Prometheus exposition of the same figures, the status
``kvmesh status`` reads, and the command line (every flag's help states its unit)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.fleet import MemoryFleet
from components.fleet.model import FleetSnapshot
from components.planner.config import PlannerConfig
from components.planner.controller import (
    PendingChange,
    PlannerController,
    build_observation,
    pool_view,
    queue_reading,
    request_totals,
)
from components.planner.loop import PlannerBoard, adjustment_to_dict, status_payload
from components.planner.policy import (
    Adjustment,
    Direction,
    Pool,
    PoolView,
    QueueReading,
    ScalingDecision,
    WorkerLoad,
    pull_figures,
)
from components.protocol.messages import LoadSnapshot, PrefillQueueReport
from components.protocol.metadata import WorkerMetadata, WorkerRole

pytestmark = pytest.mark.unit
MODEL = "m"


def load(kv: float, running: int = 0, waiting: int = 0) -> LoadSnapshot:
    return LoadSnapshot(
        now_s=0.0,
        kv_usage=kv,
        num_total_blocks=100,
        num_active_blocks=int(kv * 100),
        num_running=running,
        num_waiting=waiting,
        num_waiting_prefill_tokens=0,
        num_preemptions=0,
        batch_size=running,
        num_kv_tokens=0,
    )


def report(waiting: int, in_flight: int = 0, model: str = MODEL, error: str = "") -> PrefillQueueReport:
    return PrefillQueueReport(model, waiting, in_flight, 0.0, 1, 0, False, stats_error=error)


def fleet(
    workers: dict[int, WorkerRole],
    loads: dict[int, tuple[LoadSnapshot, float]] | None = None,
    queues: dict[int, tuple[PrefillQueueReport, float]] | None = None,
    other_model: dict[int, WorkerRole] | None = None,
) -> MemoryFleet:
    """A fleet view as the live one would hold it: ``workers`` of MODEL (and ``other_model``'s of "other")
    registered, each load report applied at its time (one report each: stale 10 s after it, by the rule)."""
    f = MemoryFleet()
    for iid, role in workers.items():
        f.add_instance(iid, WorkerMetadata(model=MODEL, role=role).to_dict())
    for iid, role in (other_model or {}).items():
        f.add_instance(iid, WorkerMetadata(model="other", role=role).to_dict())
    for iid, (snap, t) in (loads or {}).items():
        f.apply_load(iid, snap, t)
    for iid, (rep, t) in (queues or {}).items():
        f.apply_queue(iid, rep, t)
    return f


def snap(f: MemoryFleet, now: float) -> FleetSnapshot:
    return f.snapshot(now)


# --- fleet view -> pools ----------------------------------------------------------------------------------------------


def test_aggregated_workers_are_the_decode_pool():
    f = fleet({1: WorkerRole.AGGREGATED, 2: WorkerRole.AGGREGATED})
    obs = build_observation(snap(f, 0.0), MODEL, {})
    assert obs.decode == PoolView(workers=2) and obs.prefill is None and obs.aggregated


def test_disaggregated_pools_by_role_and_other_models_ignored():
    f = fleet(
        {1: WorkerRole.DECODE, 2: WorkerRole.DECODE, 3: WorkerRole.PREFILL},
        other_model={4: WorkerRole.AGGREGATED, 5: WorkerRole.PREFILL},
    )
    obs = build_observation(snap(f, 0.0), MODEL, {})
    assert (obs.decode, obs.prefill) == (PoolView(workers=2), PoolView(workers=1))


def test_decode_workers_without_prefill_workers_still_make_a_disaggregated_fleet():
    # The prefill pool exists with 0 workers: the policy holds it ("no prefill worker registered"), not aggregated.
    obs = build_observation(snap(fleet({1: WorkerRole.DECODE}), 0.0), MODEL, {})
    assert obs.prefill == PoolView(workers=0)


def test_no_workers_at_all():
    obs = build_observation(snap(fleet({}), 0.0), MODEL, {})
    assert obs.decode == PoolView(workers=0) and obs.aggregated and obs.loads == ()


# --- changes in progress ----------------------------------------------------------------------------------------------


def test_pool_view_settled_and_in_progress():
    assert pool_view(2, None) == PoolView(workers=2)
    assert pool_view(2, PendingChange(before=2, target=2)) == PoolView(workers=2)
    # Asked 2 -> 3, not registered yet: one starting.
    assert pool_view(2, PendingChange(before=2, target=3)) == PoolView(workers=2, starting=1)
    # Registered already, but the connector has not returned: still counts as one starting.
    assert pool_view(3, PendingChange(before=2, target=3)) == PoolView(workers=3, starting=1)
    # Asked 3 -> 2: one leaving until it is gone, and while the connector runs.
    assert pool_view(3, PendingChange(before=3, target=2)) == PoolView(workers=3, leaving=1)
    assert pool_view(2, PendingChange(before=3, target=2)) == PoolView(workers=2, leaving=1)
    assert pool_view(2, PendingChange(before=2, target=3)).changing


# --- reports -> observation -------------------------------------------------------------------------------------------


def test_queue_reading_takes_the_freshest_readable_report_of_the_alive_reporters():
    f = fleet(
        {1: WorkerRole.DECODE, 11: WorkerRole.PREFILL, 12: WorkerRole.PREFILL, 13: WorkerRole.PREFILL},
        queues={
            11: (report(4, 1), 10.0),
            12: (report(7, 2), 10.5),
            13: (report(0, error="stream gone"), 10.8),  # newest, but its counts are not a measurement
            14: (report(99, model="other"), 10.9),
        },
    )
    # At 11.0 every reporter heard is alive (one report each: the queue rule's first-report window is 1 s); the
    # freshest readable one (12, 0.5 s old) gives the reading.
    assert queue_reading(snap(f, 11.0), MODEL) == QueueReading(waiting=7, in_flight=2, received_s=10.5)
    # At 11.6 only 13's report (10.8 + 1 s) is alive, and it read nothing.
    assert queue_reading(snap(f, 11.6), MODEL) is None


def test_observation_keeps_only_decode_pool_loads_with_their_receive_and_stale_times():
    f = fleet(
        {1: WorkerRole.DECODE, 2: WorkerRole.DECODE, 3: WorkerRole.PREFILL},
        loads={1: (load(0.5), 9.0), 2: (load(0.7), 9.5), 3: (load(0.9), 9.5), 8: (load(1.0), 9.5)},
        queues={3: (report(3), 9.8)},
    )
    obs = build_observation(snap(f, 10.0), MODEL, {Pool.DECODE: PendingChange(2, 3)})
    # One report each: stale 10 s after it (the fleet's first-report window).
    assert obs.loads == (WorkerLoad(1, 0.5, 9.0, 19.0), WorkerLoad(2, 0.7, 9.5, 19.5))
    assert obs.decode == PoolView(workers=2, starting=1)
    assert obs.prefill == PoolView(workers=1)
    assert obs.queue == QueueReading(3, 0, 9.8)
    # Pull figures as the policy computes them: mean KV (0.5 + 0.7) / 2 = 0.6; queue 3 items over 1 prefill worker.
    figures = pull_figures(obs, PlannerConfig())
    assert figures.kv_usage == pytest.approx(0.6)
    assert figures.queue_waiting == 3 and figures.queue_utilisation == 3.0


def test_a_worker_stale_by_the_fleet_rule_is_left_out_and_named():
    # Worker 1 reports every 0.1 s until 5.0 (stale from 5.0 + max(0.5, 5 x 0.1) = 5.5); worker 2 until 6.0.
    f = fleet({1: WorkerRole.AGGREGATED, 2: WorkerRole.AGGREGATED})
    for k in range(41):
        f.apply_load(1, load(0.9), 1.0 + k * 0.1)
    for k in range(51):
        f.apply_load(2, load(0.3), 1.0 + k * 0.1)
    fresh = pull_figures(build_observation(snap(f, 5.499), MODEL, {}), PlannerConfig())
    assert fresh.kv_usage == pytest.approx(0.6) and fresh.left_out == ()  # (0.9 + 0.3) / 2
    stale = pull_figures(build_observation(snap(f, 5.5), MODEL, {}), PlannerConfig())
    assert stale.kv_usage == pytest.approx(0.3) and stale.left_out == (1,)


def test_aggregated_observation_has_no_prefill_pool_and_no_queue():
    f = fleet({1: WorkerRole.AGGREGATED}, loads={1: (load(0.2), 1.0)}, queues={9: (report(5), 1.0)})
    obs = build_observation(snap(f, 1.0), MODEL, {})
    assert obs.aggregated and obs.queue is None


def test_request_totals_count_fresh_decode_workers_only():
    f = fleet(
        {1: WorkerRole.DECODE, 2: WorkerRole.DECODE, 3: WorkerRole.DECODE, 4: WorkerRole.PREFILL},
        loads={
            1: (load(0.1, running=3, waiting=1), 9.0),
            2: (load(0.1, running=5, waiting=2), 0.5),  # one report: stale from 10.5, fresh at 10.0
            3: (load(0.1, running=100, waiting=100), -0.5),  # stale from 9.5
            4: (load(0.1, running=50, waiting=50), 9.0),  # a prefill worker
        },
    )
    assert request_totals(snap(f, 10.0), MODEL) == (8, 3)


def test_the_controller_counts_a_change_in_progress_until_it_ends():
    cfg = PlannerConfig(metric_pulling_interval=1.0, adjustment_interval=2.0)
    ctl = PlannerController(cfg, MODEL)
    f = fleet({1: WorkerRole.AGGREGATED})
    for t in (0.0, 0.5, 1.0, 1.5, 2.0):
        f.apply_load(1, load(0.95), t)
    assert ctl.pull(snap(f, 0.0)).adjustment is None  # the interval starts
    assert ctl.pull(snap(f, 1.0)).adjustment is None
    adj = ctl.pull(snap(f, 2.0)).adjustment  # 2 s later: due; KV 0.95 > 0.9 up-threshold
    assert adj is not None and [(d.direction, d.target) for d in adj.changes()] == [(Direction.UP, 2)]
    ctl.change_started(Pool.DECODE, 1, 2)
    out = ctl.pull(snap(f, 3.0))
    assert out.observation.decode == PoolView(workers=1, starting=1) and ctl.num_pulls == 4
    ctl.change_ended(Pool.DECODE)
    assert ctl.in_progress() == {} and ctl.num_adjustments == 1


# --- TensorBoard ------------------------------------------------------------------------------------------------------


def two_decode_one_prefill() -> MemoryFleet:
    return fleet(
        {1: WorkerRole.DECODE, 2: WorkerRole.DECODE, 3: WorkerRole.PREFILL},
        loads={1: (load(0.8, running=4, waiting=1), 1.0), 2: (load(0.6, running=2, waiting=0), 1.0)},
        queues={3: (report(2, 1), 1.0)},
    )


def adjustment(no_operation: bool = False) -> Adjustment:
    decode = ScalingDecision(
        Pool.DECODE, Direction.UP, 1, 2, "average KV-cache use 0.95 > 0.9", {"kv_usage": 0.95}, no_operation
    )
    prefill = ScalingDecision(
        Pool.PREFILL,
        Direction.HOLD,
        1,
        1,
        "prefill queue utilisation 0.3 within [0.2, 0.5]",
        {"queue_waiting": 0.3, "queue_utilisation": 0.3},
        no_operation,
    )
    return Adjustment(30.0, (decode, prefill), gpus_before=2, gpus_after=3, no_operation=no_operation)


def read_events(log_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_board_writes_pull_and_adjustment_scalars_and_decision_text(tmp_path):
    s = snap(two_decode_one_prefill(), 1.0)
    obs = build_observation(s, MODEL, {})
    cfg = PlannerConfig()
    board = PlannerBoard(str(tmp_path))
    board.pull(1, obs, pull_figures(obs, cfg), *request_totals(s, MODEL), walltime=100.0)
    board.adjustment(1, adjustment(), walltime=100.0)
    board.close()

    acc = read_events(str(tmp_path))
    tags = set(acc.Tags()["scalars"])
    expected = {
        "pull/kv_usage": 0.7,  # (0.8 + 0.6) / 2
        "pull/prefill_queue_size": 2,
        "pull/prefill_queue_utilisation": 2.0,  # 2 waiting / 1 prefill worker
        "pull/running_requests": 6,
        "pull/waiting_requests": 1,
        "pull/decode_workers": 2,
        "pull/prefill_workers": 1,
        "pull/gpus": 3,
        "adjustment/kv_usage": 0.95,
        "adjustment/prefill_queue_size": 0.3,
        "adjustment/prefill_queue_utilisation": 0.3,
        "adjustment/decode_workers": 2,
        "adjustment/prefill_workers": 1,
        "adjustment/gpus": 3,
    }
    assert set(expected) <= tags
    for tag, value in expected.items():
        [event] = acc.Scalars(tag)
        assert event.step == 1
        assert event.value == pytest.approx(value), tag
    text = acc.Tensors("adjustment/decisions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "decode: scale up 1 -> 2 (average KV-cache use 0.95 > 0.9)" in text
    assert "prefill: hold at 1" in text and "GPUs 2 -> 3" in text


def test_board_leaves_out_unknown_figures_and_marks_no_operation(tmp_path):
    obs = build_observation(snap(fleet({1: WorkerRole.AGGREGATED}), 1.0), MODEL, {})  # no report yet: KV unknown
    board = PlannerBoard(str(tmp_path))
    board.pull(1, obs, pull_figures(obs, PlannerConfig()), 0, 0, walltime=100.0)
    board.adjustment(2, adjustment(no_operation=True), walltime=101.0)
    board.close()
    acc = read_events(str(tmp_path))
    tags = set(acc.Tags()["scalars"])
    assert "pull/decode_workers" in tags
    assert not {"pull/kv_usage", "pull/prefill_queue_size", "pull/prefill_workers"} & tags
    text = acc.Tensors("adjustment/decisions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "[no-operation] decode: would scale up 1 -> 2" in text


# Made in a fresh interpreter: whether tensorboardX imported torch is only visible in a process that has not loaded it.
_BOARD_ALONE = """
import importlib.util, json, sys
from components.planner.board import PlannerBoard
board = PlannerBoard(sys.argv[1])
board._writer.add_scalar("pull/decode_workers", 2, 1, walltime=100.0)
board.close()
importable = importlib.util.find_spec("torch") is not None
print(json.dumps({"torch_loaded": "torch" in sys.modules, "torch_importable": importable}))
"""


def test_the_board_writes_without_importing_torch_and_leaves_torch_importable(tmp_path):
    """tensorboardX tries ``import torch`` when imported (2-9 s of a planner's start-up with vLLM's torch installed);
    the board keeps it out while tensorboardX loads, then lifts the block."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: there is nothing to keep out")
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", _BOARD_ALONE, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch_loaded": False, "torch_importable": True}
    [event] = read_events(str(tmp_path)).Scalars("pull/decode_workers")
    assert (event.step, event.value, event.wall_time) == (1, 2.0, 100.0)


def test_adjustment_to_dict_is_json_ready():
    import json

    d = json.loads(json.dumps(adjustment_to_dict(adjustment())))
    assert [x["pool"] for x in d["decisions"]] == ["decode", "prefill"]
    assert d["decisions"][0]["target"] == 2 and d["gpus_after"] == 3


def test_the_deployments_gpus_per_worker_reach_the_pool_views():
    f = fleet({1: WorkerRole.DECODE, 2: WorkerRole.DECODE, 3: WorkerRole.PREFILL})
    obs = build_observation(snap(f, 1.0), MODEL, {}, {Pool.DECODE: 2, Pool.PREFILL: None})
    assert (obs.decode.gpus_per_worker, obs.prefill and obs.prefill.gpus_per_worker) == (2, None)
    # 2 decode workers x 2 GPUs + 1 prefill worker x prefill_engine_num_gpu (1) = 5
    assert pull_figures(obs, PlannerConfig()).gpus == 5


# --- Prometheus ------------------------------------------------------------------------------------------------------


def samples(text: str) -> dict[str, float]:
    """Exposition lines 'name{labels} value' -> {name{labels}: value} (comments and _created left out)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_metrics_show_the_tensorboard_figures_and_count_decisions_by_pool_and_direction():
    from components.planner.metrics import PlannerMetrics

    m = PlannerMetrics(MODEL)
    before = samples(m.render().decode())
    assert before['kvmesh_planner_no_operation{model="m"}'] == 0.0
    assert not any(k.startswith("kvmesh_planner_kv_usage") for k in before)  # no pull yet: absent, not 0
    s = snap(two_decode_one_prefill(), 1.0)
    obs = build_observation(s, MODEL, {})
    m.pull(obs, pull_figures(obs, PlannerConfig()), *request_totals(s, MODEL))
    m.adjustment(adjustment())
    m.adjustment(adjustment())
    m.change(Pool.DECODE, "up", ok=True)
    m.change(Pool.DECODE, "up", ok=False)
    got = samples(m.render().decode())
    expected = {  # the same figures as test_board_writes_pull_and_adjustment_scalars_and_decision_text
        'kvmesh_planner_kv_usage{model="m"}': 0.7,
        'kvmesh_planner_prefill_queue_size{model="m"}': 2,
        'kvmesh_planner_prefill_queue_utilisation{model="m"}': 2.0,
        'kvmesh_planner_running_requests{model="m"}': 6,
        'kvmesh_planner_waiting_requests{model="m"}': 1,
        'kvmesh_planner_workers{model="m",pool="decode"}': 2,
        'kvmesh_planner_workers{model="m",pool="prefill"}': 1,
        'kvmesh_planner_gpus{model="m"}': 3,
        'kvmesh_planner_adjustment_kv_usage{model="m"}': 0.95,
        'kvmesh_planner_adjustment_prefill_queue_size{model="m"}': 0.3,
        'kvmesh_planner_adjustment_prefill_queue_utilisation{model="m"}': 0.3,
        'kvmesh_planner_adjustment_target_workers{model="m",pool="decode"}': 2,
        'kvmesh_planner_adjustment_target_workers{model="m",pool="prefill"}': 1,
        'kvmesh_planner_adjustment_gpus{model="m"}': 3,
        'kvmesh_planner_decisions_total{direction="up",model="m",pool="decode"}': 2,
        'kvmesh_planner_decisions_total{direction="hold",model="m",pool="prefill"}': 2,
        'kvmesh_planner_changes_total{direction="up",model="m",outcome="done",pool="decode"}': 1,
        'kvmesh_planner_changes_total{direction="up",model="m",outcome="failed",pool="decode"}': 1,
        'kvmesh_planner_pulls_total{model="m"}': 1,
        'kvmesh_planner_adjustments_total{model="m"}': 2,
    }
    for key, value in expected.items():
        assert got.get(key) == pytest.approx(value), key


async def test_the_metrics_server_answers_on_a_free_loopback_port():
    import aiohttp

    from components.planner.metrics import PlannerMetrics
    from components.runtime.metrics_http import MetricsServer

    server = MetricsServer(PlannerMetrics(MODEL, no_operation=True), "127.0.0.1", 0)
    url = await server.start()
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics") and ":0/" not in url
        async with aiohttp.ClientSession() as session, session.get(url) as r:
            body = await r.text()
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        assert samples(body)['kvmesh_planner_no_operation{model="m"}'] == 1.0
    finally:
        await server.stop()


# --- status for kvmesh status ----------------------------------------------------------------------------------------


def test_status_payload_says_pools_last_decision_changes_and_failures():
    import json

    f = fleet({1: WorkerRole.AGGREGATED, 2: WorkerRole.AGGREGATED})
    obs = build_observation(snap(f, 1.0), MODEL, {Pool.DECODE: PendingChange(2, 3)})
    payload = status_payload(
        model=MODEL,
        connector="local",
        walltime=123.0,
        no_operation=False,
        observation=obs,
        adjustment=adjustment(),
        adjustment_walltime=120.0,
        pending={Pool.DECODE: PendingChange(2, 3)},
        changes_applied=4,
        change_failures=1,
        last_change_error="local connector: setting decode pool to 3 workers: no free GPU",
        metrics_url="http://127.0.0.1:9/metrics",
    )
    back = json.loads(json.dumps(payload))
    assert back["pools"] == {"decode": 2, "prefill": None}
    assert back["last_decision"]["walltime"] == 120.0
    assert back["last_decision"]["decisions"][0]["summary"].startswith("decode: scale up 1 -> 2")
    assert back["changes_in_progress"] == {"decode": {"from": 2, "to": 3}}
    assert (back["changes_applied"], back["change_failures"]) == (4, 1)
    empty = status_payload(
        model=MODEL, connector="virtual", walltime=1.0, no_operation=True, observation=None, adjustment=None,
        adjustment_walltime=None, pending={}, changes_applied=0, change_failures=0, last_change_error="",
        metrics_url="",
    )  # fmt: skip
    assert (empty["pools"], empty["last_decision"], empty["changes_in_progress"]) == (None, None, {})


# --- command line ----------------------------------------------------------------------------------------------------


# Flags whose value has no unit (names, addresses, paths, switches, choices).
UNITLESS = {
    "--etcd-endpoints",
    "--nats-url",
    "--response-transport",
    "--response-host",
    "--namespace",
    "--served-model-name",
    "--environment",
    "--mode",
    "--load-predictor",  # a choice
    "--no-correction",  # switches
    "--queue-wait",
    "--profile-results-dir",  # a path
    "--state-dir",
    "--log-dir",
    "--metrics-host",
    "--no-operation",
    "--k8s-namespace",
    "--kubeconfig",
}
UNIT_WORDS = ("seconds", "milliseconds", "fraction", "items", "gpus", "port", "workers", "intervals")


def test_every_flag_of_kvmesh_planner_states_its_unit_in_help():
    import argparse

    from components.planner.main import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    flags = [a for a in ap._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 25  # runtime, run and policy flags
    missing = []
    for action in flags:
        flag = action.option_strings[0]
        text = " ".join((action.help or "").split()).lower()
        if flag not in UNITLESS and not any(word in text for word in UNIT_WORDS):
            missing.append(f"{flag}: {text}")
    assert missing == []


def parse(*argv: str):
    import argparse

    from components.planner.main import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(list(argv))


def test_cli_flags_keep_dynamo_names_and_defaults():
    from components.planner.main import Environment, configs_from_args

    run, cfg = configs_from_args(
        parse("--namespace", "ns", "--served-model-name", "m", "--environment", "virtual", "--no-operation")
    )
    assert (run.namespace, run.served_model_name, run.environment, run.log_dir) == (
        "ns",
        "m",
        Environment.VIRTUAL,
        None,
    )
    assert cfg.no_operation and cfg.adjustment_interval == 30.0 and cfg.metric_pulling_interval == 1.0
    _, cfg = configs_from_args(parse("--adjustment-interval", "10", "--decode-kv-scale-up-threshold", "0.8"))
    assert cfg.adjustment_interval == 10.0 and cfg.decode_kv_scale_up_threshold == 0.8


def test_cli_kubernetes_takes_its_namespace_and_kubeconfig():
    from components.planner.main import Environment, configs_from_args

    run, _ = configs_from_args(
        parse("--environment", "kubernetes", "--k8s-namespace", "serving", "--kubeconfig", "/tmp/kc")
    )
    assert (run.environment, run.k8s_namespace, run.kubeconfig) == (Environment.KUBERNETES, "serving", "/tmp/kc")
    run, _ = configs_from_args(parse("--environment", "kubernetes"))
    assert (run.k8s_namespace, run.kubeconfig) == ("default", None)


def test_cli_local_without_a_served_namespace_says_so_before_connecting(tmp_path, capsys):
    from components.planner.main import main

    assert main(parse("--environment", "local", "--namespace", "nope", "--state-dir", str(tmp_path))) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path}/nope.json: no such state file" in err, err


def test_cli_refuses_inconsistent_policy_flags():
    from components.planner.main import configs_from_args

    with pytest.raises(SystemExit, match="must be below"):
        configs_from_args(parse("--decode-kv-scale-down-threshold", "0.95"))


# --- the SLA planner's mode (kvmesh planner --mode sla) -------------------------------------------------------------


def test_mode_sla_takes_the_sla_planners_flags_and_defaults_and_refuses_the_load_planners():
    from components.planner.config import SlaPlannerConfig
    from components.planner.main import configs_from_args

    run, cfg = configs_from_args(parse("--mode", "sla", "--ttft", "300", "--itl", "40", "--adjustment-interval", "12"))
    assert str(run.mode) == "sla" and isinstance(cfg, SlaPlannerConfig)
    assert (cfg.ttft, cfg.itl, cfg.adjustment_interval) == (300.0, 40.0, 12.0)
    assert cfg.min_endpoint == SlaPlannerConfig().min_endpoint  # not given: the SLA planner's default
    _, load_cfg = configs_from_args(parse("--adjustment-interval", "12"))
    assert isinstance(load_cfg, PlannerConfig) and load_cfg.adjustment_interval == 12.0
    with pytest.raises(SystemExit, match="decode-kv-scale-up-threshold: only for mode load"):
        configs_from_args(parse("--mode", "sla", "--decode-kv-scale-up-threshold", "0.8"))
    with pytest.raises(SystemExit, match="ttft: only for mode sla"):
        configs_from_args(parse("--ttft", "300"))
    with pytest.raises(SystemExit, match="--ttft: Input should be greater than 0"):
        configs_from_args(parse("--mode", "sla", "--ttft", "0"))


def test_mode_sla_builds_the_sla_controller_with_a_profile_when_one_is_named(tmp_path):
    from components.perf.profile import Profile
    from components.planner.config import SlaPlannerConfig
    from components.planner.main import make_controller
    from components.planner.sla.controller import SlaController

    assert isinstance(make_controller(PlannerConfig(), MODEL), PlannerController)
    ctl = make_controller(SlaPlannerConfig(), MODEL)
    assert isinstance(ctl, SlaController) and ctl.perf is None  # the workers' announced models
    from components.perf.profile import Point

    profile = Profile.from_points(  # the smallest profile: two prompt lengths, a 2 x 2 decode grid
        prompt_tokens=[16, 64],
        prefill=[Point.of([2.0]), Point.of([5.0])],
        batch_sizes=[1, 2],
        context_tokens=[16, 64],
        decode=[[Point.of([1.0]), Point.of([1.2])], [Point.of([1.1]), Point.of([1.3])]],
        max_num_batched_tokens=256,
    )
    (tmp_path / "p.json").write_text(profile.to_json())
    ctl = make_controller(SlaPlannerConfig(profile_results_dir=str(tmp_path)), MODEL)
    assert isinstance(ctl, SlaController) and ctl.perf is not None
    assert ctl.perf.prefill_ms(64) == pytest.approx(profile.prefill_ms(64))
    (tmp_path / "q.json").write_text(profile.to_json())
    with pytest.raises(ValueError, match="holds several profiles"):
        make_controller(SlaPlannerConfig(profile_results_dir=str(tmp_path)), MODEL)


def sla_figures(**kw):
    from components.planner.sla.figures import SlaFigures

    base = dict(now_s=30.0, interval=True, observed_request_rate=4.0, predicted_request_rate=3.5)
    base |= dict(observed_ttft_s=0.2, predicted_ttft_s=0.25, ttft_correction=0.8, target_decode=3, decode=2)
    return SlaFigures(**(base | kw))


def test_the_sla_figures_reach_tensorboard_metrics_and_the_status(tmp_path):
    from components.planner.metrics import PlannerMetrics

    board = PlannerBoard(str(tmp_path))
    board.sla(1, sla_figures(), walltime=100.0)
    board.close()
    tags = set(read_events(str(tmp_path)).Tags()["scalars"])
    assert {"sla/observed_request_rate", "sla/predicted_ttft_s", "sla/ttft_correction", "sla/target_decode"} <= tags
    assert "sla/next_request_rate" not in tags  # unknown: left out, not 0
    m = PlannerMetrics(MODEL)
    m.sla(sla_figures())
    m.sla(sla_figures(interval=False, observed_request_rate=None, predicted_ttft_s=0.3))  # a fast-loop pull
    got = samples(m.render().decode())
    assert got['kvmesh_planner_sla_observed_request_rate{model="m"}'] == 4.0  # the last decision's, kept
    assert got['kvmesh_planner_sla_predicted_ttft_s{model="m"}'] == 0.3  # the latest pull's
    status = status_payload(
        model=MODEL,
        connector="virtual",
        walltime=1.0,
        no_operation=False,
        observation=None,
        adjustment=None,
        adjustment_walltime=None,
        pending={},
        changes_applied=0,
        change_failures=0,
        last_change_error="",
        metrics_url="",
        mode="sla",
        sla=m.sla_figures,
    )
    assert status["mode"] == "sla" and status["sla"]["target_decode"] == 3
