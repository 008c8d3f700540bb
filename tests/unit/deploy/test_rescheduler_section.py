"""A graph's ``rescheduler:`` section (components/deploy/graph.py): the rescheduler's configs less what the graph
decides; its watcher plan (``kvmesh rescheduler``), or, colocated, the frontend's command with the rescheduler's
switches and fields. Each planned command is parsed back as the CLI will (flags round trip)."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.cli.main import build_parser
from components.deploy.plan import plan_watchers
from components.rescheduler.config import Policy, ReschedulerConfig
from tests.unit.deploy.test_planner_section import errors, graph_text, load

pytestmark = pytest.mark.unit


def plans(g, tmp_path: Path):
    return plan_watchers(
        g,
        etcd_endpoints=["http://127.0.0.1:1"],
        nats_url="nats://127.0.0.1:2",
        frontend_port=8000,
        gpus={},
        log_dir=tmp_path / "logs",
        state_dir=tmp_path / "state",
    )


def test_no_section_no_rescheduler_an_empty_one_a_watcher_with_the_defaults(tmp_path):
    assert load(tmp_path, graph_text("")).rescheduler is None
    assert load(tmp_path, graph_text("")).watcher_names() == ["t-frontend", "t-g0-0"]
    g = load(tmp_path, graph_text("rescheduler:\n"))
    assert g.rescheduler is not None and g.rescheduler.enable_rescheduling  # the section is the switch
    assert g.watcher_names() == ["t-frontend", "t-g0-0", "t-rescheduler"]
    off = load(tmp_path, graph_text("rescheduler: {enable_rescheduling: false}\n"))
    assert off.watcher_names() == ["t-frontend", "t-g0-0"]
    assert [p.name for p in plans(off, tmp_path)] == ["t-frontend", "t-g0-0"]


def test_the_watcher_is_kvmesh_rescheduler_with_the_sections_values(tmp_path):
    from components.cli.rescheduler import configs_from_args

    g = load(
        tmp_path,
        graph_text(
            "rescheduler:\n  rescheduling_policies: [decode_load, neutral_failover]\n"
            "  rescheduling_interval_ms: 100\n  failover_domain: node\n  metrics_port: 9\n"
        ),
    )
    r = plans(g, tmp_path)[-1]
    assert (r.name, r.kind, r.component) == ("t-rescheduler", "rescheduler", "backend")
    assert r.log == tmp_path / "logs" / "t-rescheduler.log"
    args = build_parser().parse_args(r.cmd[3:])
    assert args.command == "rescheduler"
    run, cfg = configs_from_args(args)
    assert (run.namespace, run.state_dir, run.metrics_port) == ("t", str(tmp_path / "state"), 9)
    assert cfg.rescheduling_policies == [Policy.DECODE_LOAD, Policy.NEUTRAL_FAILOVER]
    assert (cfg.rescheduling_interval_ms, str(cfg.failover_domain)) == (100, "node")
    assert cfg.tpot_slo == ReschedulerConfig().tpot_slo
    for key, says in (("namespace", "the graph's top-level namespace"), ("state_dir", "kvmesh serve's own state")):
        assert says in errors(tmp_path, graph_text(f"rescheduler:\n  {key}: x\n")), key
    assert "unknown rescheduling policy 'nope'" in errors(
        tmp_path, graph_text("rescheduler: {rescheduling_policies: [nope]}\n")
    )


def test_colocated_the_frontend_runs_it_with_one_replica_and_no_watcher_is_added(tmp_path):
    from components.rescheduler.config import ReschedulerConfig as Cfg
    from components.runtime.flags import model_from_args

    text = graph_text("rescheduler: {colocated_rescheduling_mode: true, rescheduling_policies: [neutral_load]}\n")
    text = text.replace("workers:", "frontend: {replicas: 1}\nworkers:")
    g = load(tmp_path, text)
    assert g.watcher_names() == ["t-frontend", "t-g0-0"]
    front = plans(g, tmp_path)[0]
    args = build_parser().parse_args(front.cmd[3:])
    assert args.command == "frontend"
    cfg = model_from_args(Cfg, args)
    assert cfg.enable_rescheduling and cfg.colocated_rescheduling_mode
    assert cfg.rescheduling_policies == [Policy.NEUTRAL_LOAD]
    # Without replicas: 1 (the default is one per two cores), with no frontend, or with a standalone-only field: no.
    loose = graph_text("rescheduler: {colocated_rescheduling_mode: true}\n")
    assert "the rescheduler runs inside one frontend process; frontend.replicas is its default" in errors(
        tmp_path, loose
    )
    assert "this graph runs none (frontend.enabled)" in errors(
        tmp_path, loose.replace("workers:", "frontend: {enabled: false}\nworkers:")
    )
    assert "rescheduler.metrics_port: a colocated rescheduler does not take it" in errors(
        tmp_path,
        text.replace("colocated_rescheduling_mode: true", "colocated_rescheduling_mode: true, metrics_port: 9"),
    )


def test_a_standalone_prefix_replication_turns_on_the_frontends_prefix_reports(tmp_path):
    from components.cli.rescheduler import configs_from_args
    from components.frontend.main import config_from_args as frontend_config
    from components.rescheduler.config import REPORTED_PREFIXES

    g = load(
        tmp_path,
        graph_text(
            "rescheduler:\n  rescheduling_policies: [prefix_replication]\n"
            "  prefix_replication_target_ttft_ms: 200\n  prefix_replication_window_s: 10\n"
        ),
    )
    front, *_, resched = plans(g, tmp_path)
    # The rescheduler's watcher carries the section's replication fields as flags ...
    _, cfg = configs_from_args(build_parser().parse_args(resched.cmd[3:]))
    assert cfg.rescheduling_policies == [Policy.PREFIX_REPLICATION]
    assert (cfg.prefix_replication_target_ttft_ms, cfg.prefix_replication_window_s) == (200.0, 10.0)
    # ... and the frontend reports the prefixes its requests carried, which that policy reads.
    assert frontend_config(build_parser().parse_args(front.cmd[3:])).request_stats_prefixes == REPORTED_PREFIXES
    # Without the policy the frontend's reports stay as they were (no prefixes).
    plain = plans(load(tmp_path, graph_text("rescheduler: {rescheduling_policies: [decode_load]}\n")), tmp_path)
    assert frontend_config(build_parser().parse_args(plain[0].cmd[3:])).request_stats_prefixes == 0
