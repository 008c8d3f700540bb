"""RouterConfig: one model for every routing knob, its flags derived (Dynamo's spellings kept as aliases), embedded
in the frontend's config and the standalone router's, and reachable from a graph file's ``frontend`` section."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from components.cli.main import build_parser
from components.deploy.graph import load_graph
from components.deploy.plan import plan_watchers
from components.frontend import FrontendConfig
from components.frontend.main import config_from_args
from components.router import LoadMetric, Router, RouterConfig, RouterServiceConfig, UnknownPolicyError
from components.router.main import add_arguments as router_arguments
from components.runtime.flags import model_from_args

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_every_field_is_documented():
    for model in (RouterConfig, RouterServiceConfig, FrontendConfig):
        undocumented = [n for n, f in model.model_fields.items() if not (f.description or "").strip()]
        assert undocumented == [], model.__name__


def test_defaults_follow_dynamo_autellix_and_the_issue():
    c = RouterConfig()
    assert (c.router_policy, c.overlap_weight, c.router_temperature, c.router_kv_events) == (
        "round_robin",
        1.0,
        0.0,
        True,
    )
    assert (c.router_ttl_s, c.active_decode_blocks_threshold, c.router_replica_sync) == (120.0, None, False)
    assert c.locality_threshold_tokens == 2048 and c.least_loaded_metric == LoadMetric.REQUESTS
    assert RouterServiceConfig().router_replica_sync is True  # replicas are what a standalone router is for


def test_unknown_policies_are_refused_naming_the_known_ones():
    with pytest.raises(ValidationError, match="kv\\+autellix"):
        RouterConfig(router_policy="fastest")
    with pytest.raises(UnknownPolicyError, match="least_used"):
        Router("fastest")
    assert RouterConfig(router_policy="least_used").router_policy == "least_used"
    assert Router("kv_autellix").policy.name == "kv+autellix"


def test_router_flags_keep_dynamos_names_as_aliases():
    argv = "router --namespace ns --router-policy kv --kv-overlap-score-weight 2.5 --router-temperature 0.3"
    argv += " --no-router-kv-events --router-ttl-secs 30 --active-decode-blocks-threshold 0.9"
    argv += " --least-loaded-metric tokens --components a,b"
    args = build_parser().parse_args(argv.split())
    cfg = model_from_args(RouterServiceConfig, args)
    assert (cfg.overlap_weight, cfg.router_temperature, cfg.router_kv_events, cfg.router_ttl_s) == (2.5, 0.3, False, 30)
    assert cfg.active_decode_blocks_threshold == 0.9 and cfg.least_loaded_metric == LoadMetric.TOKENS
    assert (cfg.namespace, cfg.components, cfg.component) == ("ns", ["a", "b"], "router")
    assert build_parser().parse_args(["router", "--router-kv-overlap-score-weight", "3"]).overlap_weight == "3"


def test_the_frontend_takes_every_router_flag():
    args = build_parser().parse_args(
        ["frontend", "--router-policy", "kv+autellix", "--locality-threshold-tokens", "4096", "--router-replica-sync"]
    )
    cfg = config_from_args(args)
    assert isinstance(cfg, RouterConfig)
    assert (cfg.router_policy, cfg.locality_threshold_tokens, cfg.router_replica_sync) == ("kv+autellix", 4096, True)
    assert FrontendConfig().router_policy == "round_robin"


def test_a_graph_may_set_router_knobs_in_its_frontend_section(tmp_path):
    graph = tmp_path / "graphs" / "g.yaml"
    graph.parent.mkdir()
    graph.write_text(
        "namespace: t\nfrontend:\n  router_policy: kv_autellix\n  router_temperature: 0.2\n  overlap_weight: 2\n"
        f"workers:\n  - {{name: mock, engine: mock, model: m, model_path: {ROOT / 'models' / 'tiny-llama'}}}\n"
    )
    g = load_graph(graph)
    [fe, *_] = plan_watchers(
        g,
        etcd_endpoints=["http://127.0.0.1:1"],
        nats_url="nats://127.0.0.1:2",
        frontend_port=0,
        gpus={},
        log_dir=tmp_path,
    )
    cfg = config_from_args(build_parser().parse_args(fe.cmd[3:]))
    assert (cfg.router_policy, cfg.router_temperature, cfg.overlap_weight) == ("kv_autellix", 0.2, 2.0)


def test_router_command_help_lists_its_flags(capsys):
    import argparse

    p = argparse.ArgumentParser(prog="kvmesh router")
    router_arguments(p)
    p.print_help()
    out = capsys.readouterr().out
    for flag in ("--router-policy", "--kv-overlap-score-weight", "--router-ttl-secs", "--locality-threshold-tokens"):
        assert flag in out


def test_the_registry_implements_exactly_the_names_the_config_accepts():
    # config.py validates against names.py without importing the policies (no import circle); the registry must
    # implement every one of those names and no other.
    from components.router.names import ALIASES, POLICY_NAMES
    from components.router.policies import POLICIES

    assert tuple(POLICIES) == POLICY_NAMES
    assert set(ALIASES.values()) <= set(POLICY_NAMES)
