"""``kvmesh simulate``: a graph's fleet and router replayed on a trace, and what it refuses (with the reason)."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest

from components.cli.main import main as cli_main
from components.deploy.graph import load_graph
from components.deploy.whatif import WhatIfError, simulated_deployment
from components.sim import replay
from components.sim.report import percentile
from components.sim.workloads import from_trace

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
GRAPHS = ROOT / "graphs"
# Small engines so the short trace below loads them: 16 mock engines of the default graph, speed irrelevant here.
SMALL = ["--set", "workers[0].replicas=1", "--set", "workers[0].num_workers=2"]


def mooncake(path: Path, rows: int, input_length: int = 700, gap_ms: int = 250) -> Path:
    """``rows`` Mooncake rows, every other one sharing its first block with the row before it."""
    with path.open("w") as f:
        for i in range(rows):
            first = i // 2
            f.write(
                json.dumps(
                    {
                        "timestamp": i * gap_ms,
                        "input_length": input_length,
                        "output_length": 20 + i % 7,
                        "hash_ids": [first, 10_000 + i],
                    }
                )
                + "\n"
            )
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_writes_the_summary_png_and_tensorboard_of_the_graphs_fleet(tmp_path, capsys):
    trace = mooncake(tmp_path / "t.jsonl", 40)
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                            "--out", str(out), "--no-progress")  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report == json.loads((out / "summary.json").read_text())
    assert report["requests"] == 40 and report["refused_too_long"] == 0
    assert report["workers"] == {"routed": 2, "prefill": 0} and report["router_policy"] == "round_robin"
    assert report["groups"] == {"mock": {"role": "aggregated", "engines": 2}}
    for k in ("ttft", "itl", "both"):
        assert 0.0 <= report["slo_attainment"][k] <= 1.0
    assert report["slo"] == {"ttft_ms": 500.0, "itl_ms": 50.0}
    # Worker-seconds of a static fleet: every engine held over the makespan.
    assert report["worker_seconds"] == pytest.approx(2 * report["makespan_s"], abs=0.2)
    assert (out / "simulate.png").stat().st_size > 10_000
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())

    # The command replays exactly what the library does with the graph's fleet and router on the same trace.
    deployment = simulated_deployment(load_graph(GRAPHS / "mock_agg.yaml", SMALL[1::2]))
    w = from_trace(trace, 10**9, vocab_size=deployment.vocab_size)
    res = replay(w, deployment.fleet, deployment.router, 0)
    assert report["ttft_ms"]["p50"] == pytest.approx(1000 * percentile(res.ttft_s, 0.5), abs=1e-3)
    assert report["output_tokens_per_s"] == pytest.approx(res.output_tokens / res.makespan_s, abs=0.1)


def test_time_scale_compresses_the_arrivals(tmp_path, capsys):
    trace = mooncake(tmp_path / "t.jsonl", 20)
    rates = []
    for scale in ("1", "0.5"):
        code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                                "--out", str(tmp_path / scale), "--time-scale", scale, "--no-png", "--no-tensorboard",
                                "--no-progress")  # fmt: skip
        assert code == 0, err
        rates.append(json.loads(stdout.strip().splitlines()[-1])["offered_rps"])
    # 20 rows 250 ms apart: 19 gaps over 4.75 s, 4 requests/s; at half the time scale, 8.
    assert rates == [pytest.approx(4.0), pytest.approx(8.0)]


def test_prompts_longer_than_the_engines_take_are_refused_and_counted(tmp_path, capsys):
    trace = mooncake(tmp_path / "t.jsonl", 10, input_length=900)
    code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                            "--set", "workers[0].max_model_len=800", "--out", str(tmp_path / "o"), "--no-png",
                            "--no-tensorboard", "--no-progress")  # fmt: skip
    assert code == 1 and "longer than the engines' max_model_len 800" in err
    trace2 = tmp_path / "t2.jsonl"
    trace2.write_text(trace.read_text() + mooncake(tmp_path / "short.jsonl", 3, input_length=300).read_text())
    code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace2), *SMALL,
                            "--set", "workers[0].max_model_len=800", "--out", str(tmp_path / "o2"), "--no-png",
                            "--no-tensorboard", "--no-progress")  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["refused_too_long"] == 10 and report["requests"] == 3


def heavy(path: Path, rows: int, gap_ms: int = 100) -> Path:
    """``rows`` Mooncake rows of 700 prompt and 400 output tokens, ``gap_ms`` apart, no shared blocks: each holds up
    to 1,100 tokens of cache, so the ~15 running at once that 16k tokens (mock_planner.yaml's one worker: 1024
    blocks of 16) hold fill it: at 10 a second, that is 1.5 s of each request's decode time."""
    with path.open("w") as f:
        for i in range(rows):
            row = {"timestamp": i * gap_ms, "input_length": 700, "output_length": 400, "hash_ids": [2 * i, 2 * i + 1]}
            f.write(json.dumps(row) + "\n")
    return path


def test_a_graph_with_a_planner_runs_its_planner_and_reports_each_scaling_action(tmp_path, capsys):
    from components.planner.config import PlannerConfig
    from components.planner.simulated import SimulatedPlanner

    trace = heavy(tmp_path / "t.jsonl", 400)
    out = tmp_path / "o"
    argv = ["--graph", str(GRAPHS / "mock_planner.yaml"), "--trace", str(trace), "--startup-s", "2", "--no-progress"]
    code, stdout, err = run(capsys, *argv, "--out", str(out), "--no-png")
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["planner"]["adjustment_interval"] == 10 and report["planner"]["max_gpu_budget"] == 4
    ups = [a for a in report["scaling_actions"] if a["direction"] == "up"]
    # The one worker's cache fills (KV use above the 0.9 up-threshold): the planner adds workers, each taking
    # requests 2 s (--startup-s) after its decision, decisions at least one adjustment interval apart.
    assert ups and ups[0]["from"] == 1 and ups[0]["to"] == 2 and "> up-threshold 0.9" in ups[0]["reason"]
    assert all(a["done_s"] == pytest.approx(a["decided_s"] + 2.0, abs=1e-3) for a in ups)
    assert report["most_workers"]["decode"] >= 2 and report["adjustments"] >= 2
    # Worker-seconds from each worker's span: more than one worker's makespan, fewer than the budget's four.
    assert report["makespan_s"] < report["worker_seconds"] < 4 * report["makespan_s"]
    # The live planner's TensorBoard layout: pull/* scalars and the decisions as text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert {"pull/kv_usage", "pull/decode_workers", "adjustment/decode_workers"} <= set(acc.Tags()["scalars"])
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("adjustment/decisions/text_summary")]
    assert any("decode: scale up 1 -> 2" in t for t in texts)

    # The command's actions are the library's: the graph's planner config as SimulatedPlanner over sim.replay.
    graph = load_graph(GRAPHS / "mock_planner.yaml", [])
    deployment = simulated_deployment(graph)
    w = from_trace(trace, 10**9, vocab_size=deployment.vocab_size)
    cfg = PlannerConfig.model_validate({k: getattr(graph.planner, k) for k in PlannerConfig.model_fields})
    until = w.requests[-1].arrival_s + cfg.adjustment_interval + cfg.metric_pulling_interval
    planner = SimulatedPlanner(cfg, start_s=0.0, until_s=until)
    fleet = dataclasses.replace(deployment.fleet, startup_s=2.0)
    res = replay(w, fleet, deployment.router, 0, scaler=planner)
    assert [(a.decided_s, a.direction, a.reason) for a in res.actions] == [
        (pytest.approx(a["decided_s"], abs=1e-3), a["direction"], a["reason"]) for a in report["scaling_actions"]
    ]

    # --planner-start-s: the first pull that much after the first arrival, every decision at a pull (1 s apart).
    code, stdout, err = run(capsys, *argv, "--out", str(tmp_path / "o3"), "--planner-start-s", "2.5", "--no-png",
                            "--no-tensorboard")  # fmt: skip
    assert code == 0, err
    shifted = json.loads(stdout.strip().splitlines()[-1])
    assert shifted["planner_start_s"] == 2.5 and shifted["scaling_actions"]
    assert all((a["decided_s"] - 2.5) == pytest.approx(round(a["decided_s"] - 2.5)) for a in shifted["scaling_actions"])
    # A negative start: the planner (and the fleet it watches) start before the first arrival, as a live planner
    # started with its deployment does; its pulls, and so its decisions, fall at -2.5 s + whole seconds. The request
    # reports' phase is echoed; one of a whole interval or more is refused.
    code, stdout, err = run(capsys, *argv, "--out", str(tmp_path / "o4"), "--planner-start-s=-2.5",
                            "--request-stats-offset-s", "0.25", "--no-png", "--no-tensorboard")  # fmt: skip
    assert code == 0, err
    early = json.loads(stdout.strip().splitlines()[-1])
    assert early["planner_start_s"] == -2.5 and early["request_stats_offset_s"] == 0.25 and early["scaling_actions"]
    assert all((a["decided_s"] + 2.5) == pytest.approx(round(a["decided_s"] + 2.5)) for a in early["scaling_actions"])
    code, _, err = run(capsys, *argv, "--out", str(tmp_path / "o5"), "--request-stats-offset-s", "1", "--no-png",
                       "--no-tensorboard")  # fmt: skip
    assert code == 1 and "--request-stats-offset-s must be below" in err

    # --without-planner: the fleet as it starts, never resized.
    code, stdout, err = run(capsys, *argv, "--out", str(tmp_path / "o2"), "--without-planner", "--no-png",
                            "--no-tensorboard")  # fmt: skip
    assert code == 0, err
    static = json.loads(stdout.strip().splitlines()[-1])
    assert static["scaling_actions"] == [] and static["planner"] is None and static["most_workers"]["decode"] == 1
    assert static["ttft_ms"]["p99"] > report["ttft_ms"]["p99"]  # the planner's workers took load off the one


def test_a_vllm_group_an_infinitely_fast_group_and_a_missing_trace_are_clear_errors(tmp_path, capsys):
    trace = mooncake(tmp_path / "t.jsonl", 5)
    code, _, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                       "--set", "workers[0].speedup_ratio=inf", "--out", str(tmp_path))  # fmt: skip
    assert code != 0 and "speedup_ratio inf" in err and "finite speedup_ratio" in err
    code, _, err = run(capsys, "--graph", str(GRAPHS / "agg.yaml"), "--trace", str(trace), "--out", str(tmp_path))
    assert code != 0 and "runs the vllm engine" in err and "engine: mock" in err
    code, _, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(tmp_path / "nope.jsonl"),
                       "--out", str(tmp_path))  # fmt: skip
    assert code == 2 and "no such file" in err


def test_the_disaggregated_graph_becomes_prefill_and_decode_engines_with_its_thresholds():
    d = simulated_deployment(load_graph(GRAPHS / "mock_disagg.yaml"))
    assert (d.fleet.workers, d.fleet.prefill) == (2, 2)  # decode: 1 replica x 2 workers; prefill: 2 x 1
    assert (d.fleet.max_local_prefill_length, d.fleet.max_prefill_queue_size) == (1000, 3)
    assert d.model == "tiny-llama" and d.vocab_size == 384


def test_groups_of_one_role_with_different_engines_are_refused():
    graph = load_graph(
        GRAPHS / "mock_disagg.yaml", ["workers[1].role=aggregated", "workers[0].role=aggregated",
                                      "workers[0].num_gpu_blocks=200"],
    )  # fmt: skip
    with pytest.raises(WhatIfError, match="different engine settings"):
        simulated_deployment(graph)


def test_the_progress_line_ends_where_the_replay_ended(tmp_path):
    import io

    from components.cli.simulate import _Series
    from components.sim import Sample

    d = simulated_deployment(load_graph(GRAPHS / "mock_agg.yaml", SMALL[1::2]))
    stream = io.StringIO()
    series = _Series(d, total=300, span_s=60.0, stream=stream)
    series(Sample(0.0, (), (), 0, 1, 0))
    series(Sample(0.1, (), (), 0, 2, 0))  # within 0.5 s of wall time of the first: not drawn
    series(Sample(60.4, (), (), 0, 300, 300))
    series.close()
    lines = stream.getvalue().replace("\r", "\n").split("\n")
    drawn = [line for line in lines if line.startswith("simulate:")]
    assert "0/300 requests done" in drawn[0] and "300/300 requests done" in drawn[-1] and "60.4/60 s" in drawn[-1]
    assert stream.getvalue().endswith("\n")


def test_a_slice_as_the_load_generator_sends_it_and_each_requests_times(tmp_path, capsys):
    # Rows every 250 ms with 700-token prompts and 20..26 output tokens; from trace second 1.0 on (rows 4..), ten of
    # them, prompts cut to 300 tokens and outputs capped at 5: kvmesh bench load's --start-offset-s,
    # --max-requests, --max-input-tokens and --max-output-tokens on the same file.
    trace = mooncake(tmp_path / "t.jsonl", 40)
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                            "--start-offset-s", "1.0", "--requests", "10", "--max-input-tokens", "300",
                            "--max-output-tokens", "5", "--out", str(out), "--no-progress", "--no-png",
                            "--no-tensorboard")  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["requests"] == 10 and report["refused_too_long"] == 0
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["arrival_s"]) for r in rows] == pytest.approx([0.25 * k for k in range(10)])
    assert {r["prompt_tokens"] for r in rows} == {"300"} and {r["max_tokens"] for r in rows} == {"5"}
    # The file's TTFTs are the summary's: its median is the p50 (nearest rank: the 5th of 10).
    ttft = sorted(float(r["ttft_s"]) for r in rows)
    assert report["ttft_ms"]["p50"] == pytest.approx(1000 * ttft[4], abs=1e-3)
    assert all(float(r["mean_itl_s"]) > 0 for r in rows)  # 5 tokens each: 4 gaps
    # 10 requests x 5 tokens over the makespan.
    assert report["output_tokens_per_s"] == pytest.approx(50 / report["makespan_s"], abs=0.1)


def test_slice_flags_are_checked(tmp_path, capsys):
    trace = mooncake(tmp_path / "t.jsonl", 4)
    for flag, value in (("--max-input-tokens", "0"), ("--max-output-tokens", "-1"), ("--start-offset-s", "-2")):
        with pytest.raises(SystemExit) as e:
            run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), "--out", str(tmp_path),
                flag, value)  # fmt: skip
        assert e.value.code == 2


def test_a_graph_with_an_sla_planner_runs_the_sla_controller_on_the_trace(tmp_path, capsys):
    """mode: sla in the graph: the same command runs the SLA planner (what-if before turning it on). The heavy trace
    (10 requests/s of 700 + 400 tokens) needs more than the one worker the graph starts with at the default targets,
    so the SLA planner adds workers; its figures reach TensorBoard under sla/*."""
    trace = heavy(tmp_path / "t.jsonl", 400)
    out = tmp_path / "o"
    argv = ["--graph", str(GRAPHS / "mock_planner.yaml"), "--trace", str(trace), "--startup-s", "2", "--no-progress"]
    sla = ["--set", "planner.mode=sla", "--set", "planner.load_predictor=constant"]
    code, stdout, err = run(capsys, *argv, *sla, "--out", str(out), "--no-png")
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["planner_mode"] == "sla" and report["planner"]["ttft"] == 500.0
    assert report["planner"]["adjustment_interval"] == 10  # the graph's, shared by both modes
    ups = [a for a in report["scaling_actions"] if a["direction"] == "up"]
    assert ups and ups[0]["from"] == 1 and report["most_workers"]["decode"] >= 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"sla/observed_request_rate", "sla/target_decode", "pull/decode_workers"} <= tags
    rates = [e.value for e in acc.Scalars("sla/observed_request_rate")]
    assert max(rates) == pytest.approx(10.0, rel=0.2)  # the trace's 10 requests/s, as the frontend reports count it


def test_enable_rescheduling_runs_the_policies_in_the_replay_and_reports_their_counters(tmp_path, capsys):
    from components.rescheduler.config import ReschedulerConfig
    from components.sim.rescheduling import PolicyRescheduler

    trace = mooncake(tmp_path / "t.jsonl", 40, gap_ms=50)
    flags = ["--enable-rescheduling", "--rescheduling-policies", "neutral_load,binpacking_consolidation"]
    code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                            "--out", str(tmp_path / "on"), "--no-png", "--no-tensorboard", "--no-progress",
                            *flags)  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    # The same replay through the library, with the same config: the command's counters are the adapter's.
    deployment = simulated_deployment(load_graph(GRAPHS / "mock_agg.yaml", SMALL[1::2]))
    w = from_trace(trace, 10**9, vocab_size=deployment.vocab_size)
    cfg = ReschedulerConfig(rescheduling_policies=["neutral_load", "binpacking_consolidation"])
    r = PolicyRescheduler(cfg)
    res = replay(w, deployment.fleet, deployment.router, 0, rescheduler=r)
    assert report["rescheduler"] == {
        "from": "flags",
        "policies": ["neutral_load", "binpacking_consolidation"],
        "interval_ms": 500,
        **r.counters(),
        "migrations_landed": res.migrations,
        "migrations_refused": res.migrations_refused,
    }
    assert report["rescheduler"]["cycles"] > 0
    # Without the flag: no rescheduler, and no key.
    code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                            "--out", str(tmp_path / "off"), "--no-png", "--no-tensorboard",
                            "--no-progress")  # fmt: skip
    assert code == 0 and "rescheduler" not in json.loads(stdout.strip().splitlines()[-1])
    # A policy it does not know is a clear error.
    code, _, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *SMALL,
                       "--out", str(tmp_path / "bad"), "--no-progress", "--enable-rescheduling",
                       "--rescheduling-policies", "nope")  # fmt: skip
    assert code != 0 and "--rescheduling-policies" in err


def test_a_graphs_rescheduler_section_runs_in_the_replay_without_the_flag(tmp_path, capsys):
    from components.rescheduler.config import ReschedulerConfig
    from components.sim.rescheduling import PolicyRescheduler

    # graphs/mock_rescheduler.yaml: neutral_load at threshold 0.25, 500 ms; two workers here (SMALL).
    graph = GRAPHS / "mock_rescheduler.yaml"
    trace = mooncake(tmp_path / "t.jsonl", 40, gap_ms=50)
    code, stdout, err = run(capsys, "--graph", str(graph), "--trace", str(trace), *SMALL,
                            "--out", str(tmp_path / "g"), "--no-png", "--no-tensorboard", "--no-progress")  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    deployment = simulated_deployment(load_graph(graph, SMALL[1::2]))
    w = from_trace(trace, 10**9, vocab_size=deployment.vocab_size)
    r = PolicyRescheduler(
        ReschedulerConfig(rescheduling_policies=["neutral_load"], rescheduling_neutral_load_threshold=0.25)
    )
    res = replay(w, deployment.fleet, deployment.router, 0, rescheduler=r)
    assert report["rescheduler"] == {
        "from": "graph",
        "policies": ["neutral_load"],
        "interval_ms": 500,
        **r.counters(),
        "migrations_landed": res.migrations,
        "migrations_refused": res.migrations_refused,
    }
    assert report["rescheduler"]["cycles"] > 0


def test_prefix_replication_runs_the_replicator_in_the_replay(tmp_path, capsys):
    from components.rescheduler.config import ReplicationConfig, ReschedulerConfig
    from components.sim.replay import MODEL
    from components.sim.replication import PolicyReplicator
    from components.sim.rescheduling import PolicyRescheduler

    # prefix_replication among the policies: the replay runs the replication policy (PolicyReplicator) at the
    # rescheduler's interval with the flags' knobs. Every request carries one 1,536-token document (3 Mooncake blocks of
    # 512 tokens, 96 KV blocks) plus its own question, 20 a second: kv routing keeps them on the document's holder,
    # whose queue passes the low target (1 ms), so the policy copies the document to the other worker.
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i * 50, "input_length": 1800, "output_length": 20, "hash_ids": [0, 1, 2, 100 + i]}
        for i in range(60)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    knobs = {
        "prefix_replication_target_ttft_ms": 1.0,
        "prefix_replication_min_blocks": 1,
        "prefix_replication_min_rate_per_s": 0.01,
        "prefix_replication_cold_rate_per_s": 0.001,
        "prefix_replication_window_s": 10.0,
    }
    kv = [*SMALL, "--set", "frontend.router_policy=kv"]
    flags = ["--enable-rescheduling", "--rescheduling-policies", "prefix_replication"]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    code, stdout, err = run(capsys, "--graph", str(GRAPHS / "mock_agg.yaml"), "--trace", str(trace), *kv,
                            "--out", str(tmp_path / "on"), "--no-png", "--no-tensorboard", "--no-progress",
                            *flags)  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    # The same replay through the library: the command's count of landed copies is the replicator's.
    deployment = simulated_deployment(load_graph(GRAPHS / "mock_agg.yaml", kv[1::2]))
    w = from_trace(trace, 10**9, vocab_size=deployment.vocab_size)
    cfg = ReschedulerConfig(rescheduling_policies=["prefix_replication"], **knobs)
    rep = PolicyReplicator(ReplicationConfig(**knobs), model=MODEL, interval_s=0.5, window_s=10.0)
    replay(w, deployment.fleet, deployment.router, 0, rescheduler=PolicyRescheduler(cfg), replicator=rep)
    assert report["rescheduler"]["policies"] == ["prefix_replication"]
    assert report["rescheduler"]["prefix_copies_landed"] == rep.copies
    assert rep.copies >= 1
