"""``ReschedulerConfig``: Llumnix's names and defaults, its flags (derived by components/runtime/flags.py), and the
validation errors a user sees for an unknown name or a threshold out of range."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from components.migration.types import ORDER_ALIASES, RULE_ALIASES, SelectOrder, SelectRule, parse_order, parse_rule
from components.rescheduler.config import (
    SELECT_ORDERS,
    SELECT_RULES,
    FailoverDomain,
    LoadBalanceScope,
    Policy,
    ReplicationConfig,
    ReschedulerConfig,
)
from components.rescheduler.policies import plan_cycle
from components.runtime.flags import add_model_arguments, argv_for, model_from_args
from tests.unit.test_layering import pure_config_modules

pytestmark = pytest.mark.unit


def parse(argv: list[str]) -> ReschedulerConfig:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, ReschedulerConfig)
    return model_from_args(ReschedulerConfig, parser.parse_args(argv))


def test_defaults_are_llumnixs():
    # The values of the seed document's tables, except where config.py says which of Llumnix's document and code it
    # takes: the load-balance threshold (code: 0.01) and the failover domain (document: instance).
    cfg = ReschedulerConfig()
    assert cfg.enable_rescheduling is False and cfg.colocated_rescheduling_mode is False
    assert cfg.rescheduling_interval_ms == 500 and cfg.interval_s == 0.5
    assert cfg.rescheduling_policies == ["decode_load", "prefill_failover", "decode_failover", "neutral_failover"]
    assert cfg.rescheduling_decode_load_metric == cfg.rescheduling_neutral_load_metric
    assert cfg.rescheduling_decode_load_metric == "kv_cache_usage_ratio_projected"
    assert cfg.rescheduling_decode_load_threshold == 1.0 and cfg.rescheduling_neutral_load_threshold == 1.0
    assert cfg.rescheduling_load_balance_threshold == 0.01
    assert cfg.rescheduling_load_balance_scope == LoadBalanceScope.CLUSTER
    assert cfg.instance_staleness_seconds == 60
    assert cfg.failover_domain == FailoverDomain.INSTANCE
    assert cfg.tpot_slo == 50
    assert (cfg.tpot_slo_dispatch_threshold, cfg.tpot_migrate_out_ceil_threshold) == (0.85, 0.95)
    assert cfg.tpot_migrate_out_floor_threshold == 0.60
    # TOKEN / SR / 1024 in Llumnix's spelling, stored by the migration agent's readable names.
    assert (cfg.rescheduling_req_select_rule, cfg.rescheduling_req_select_order) == ("tokens", "shortest_running")
    assert cfg.rescheduling_req_select_value == 1024
    assert cfg.rescheduling_migrate_timeout_s == 5.0
    assert cfg.rescheduling_max_migrations_per_source == 1


def test_the_tpot_thresholds_in_milliseconds():
    # The seed's adaptive PD example: 0.95 x 50 = 47.5, 0.85 x 50 = 42.5, 0.60 x 50 = 30.
    cfg = ReschedulerConfig()
    assert cfg.tpot_ceiling_ms == pytest.approx(47.5)
    assert cfg.tpot_dispatch_ms == pytest.approx(42.5)
    assert cfg.tpot_floor_ms == pytest.approx(30.0)


def test_flags_carry_llumnixs_names_and_abbreviations():
    cfg = parse(
        [
            "--enable-rescheduling",
            "--rescheduling-policies",
            "binpacking_mitigation, decode_load",
            "--rescheduling-interval-ms",
            "100",
            "--rescheduling-decode-load-threshold",
            "0.7",
            "--rescheduling-load-balance-scope",
            "unit",
            "--failover-domain",
            "node-unit",
            "--instance-staleness-seconds",
            "100",
            "--tpot-slo",
            "40",
            "--rescheduling-req-select-rule",
            "NUM_REQ",
            "--rescheduling-req-select-order",
            "fcwsr",
            "--rescheduling-req-select-value",
            "2",
            "--llumlet-grpc-timeout-seconds",
            "3",
        ]
    )
    assert cfg.enable_rescheduling is True
    assert cfg.rescheduling_policies == [Policy.BINPACKING_MITIGATION, Policy.DECODE_LOAD]  # order kept
    assert cfg.rescheduling_interval_ms == 100
    assert cfg.rescheduling_decode_load_threshold == 0.7
    assert cfg.rescheduling_load_balance_scope == LoadBalanceScope.UNIT
    assert cfg.failover_domain == FailoverDomain.NODE_UNIT
    assert cfg.instance_staleness_seconds == 100
    assert cfg.tpot_slo == 40 and cfg.tpot_ceiling_ms == pytest.approx(38.0)  # 0.95 x 40
    assert cfg.rescheduling_req_select_rule == "num_requests"
    assert cfg.rescheduling_req_select_order == "first_come_waiting_then_shortest_running"
    assert cfg.rescheduling_req_select_value == 2
    assert cfg.rescheduling_migrate_timeout_s == 3


def test_argv_for_gives_the_same_config_back():
    # What `kvmesh serve` will pass a rescheduler process from a graph's section.
    cfg = ReschedulerConfig(
        rescheduling_policies=["neutral_load", "neutral_failover"],
        failover_domain="instance-unit",
        rescheduling_req_select_rule="RATIO",
        rescheduling_req_select_value=0.25,
    )
    assert parse(argv_for(cfg.model_dump(mode="json"))) == cfg


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rescheduling_policies": ["decode_load", "load_balance"]}, "unknown rescheduling policy 'load_balance'"),
        ({"rescheduling_policies": ["decode_load", "decode_load"]}, "listed twice"),
        ({"rescheduling_decode_load_threshold": 0}, "greater than 0"),
        ({"rescheduling_neutral_load_threshold": float("inf")}, "must be finite"),
        ({"rescheduling_load_balance_threshold": 1.5}, "less than 1"),
        ({"rescheduling_load_balance_scope": "rack"}, "'cluster' or 'unit'"),
        ({"failover_domain": "rack"}, "'instance', 'node', 'instance-unit' or 'node-unit'"),
        ({"tpot_slo_dispatch_threshold": 1.2}, "less than or equal to 1"),
        ({"tpot_migrate_out_floor_threshold": 0.9}, "floor < dispatch < ceiling"),
        ({"tpot_slo_dispatch_threshold": 0.95}, "floor < dispatch < ceiling"),
        ({"rescheduling_req_select_rule": "BYTES"}, "unknown request select rule 'BYTES'"),
        ({"rescheduling_req_select_order": "random"}, "unknown request select order 'random'"),
        ({"rescheduling_req_select_rule": "RATIO", "rescheduling_req_select_value": 2}, "lies in (0, 1]"),
        ({"rescheduling_req_select_rule": "NUM_REQ", "rescheduling_req_select_value": 1.5}, "a count >= 1 or -1"),
        ({"rescheduling_req_select_value": 0}, "tokens must be >= 1"),
        ({"rescheduling_interval_ms": 0}, "greater than 0"),
        ({"rescheduling_max_migrations_per_source": 0}, "greater than or equal to 1"),
        ({"rescheduling_decode_load_metric": "kv_cache_usage_ratio"}, "kv_cache_usage_ratio_projected"),
    ],
)
def test_validation_says_what_is_wrong(fields, message):
    with pytest.raises(ValidationError) as err:
        ReschedulerConfig(**fields)
    assert message in str(err.value)


def test_an_unknown_policy_error_lists_the_known_ones():
    with pytest.raises(ValidationError) as err:
        ReschedulerConfig(rescheduling_policies=["decode-load"])
    for policy in Policy:
        assert policy.value in str(err.value)


def test_the_select_tables_match_the_migration_agents():
    # config.py spells the agent's names out (a pure config module may not import the migration package): every
    # name and abbreviation it accepts must be one the agent parses to the same thing, and none may be missing.
    assert set(SELECT_RULES) == set(RULE_ALIASES) and set(SELECT_RULES.values()) == {r.value for r in SelectRule}
    assert set(SELECT_ORDERS) == set(ORDER_ALIASES) and set(SELECT_ORDERS.values()) == {o.value for o in SelectOrder}
    for alias, name in SELECT_RULES.items():
        assert parse_rule(alias) == parse_rule(name) == SelectRule(name)
    for alias, name in SELECT_ORDERS.items():
        assert parse_order(alias) == parse_order(name) == SelectOrder(name)


def test_the_config_is_a_pure_config_module():
    # A graph's schema (components/deploy, rank 7) and the simulator may then import it as a leaf.
    assert "components.rescheduler.config" in pure_config_modules()


def test_prefix_replication_is_a_policy_with_its_own_flags():
    # kvmesh rescheduler's parser (components/cli/rescheduler.py) takes the name and every prefix_replication_* field
    # of ReplicationConfig (ReschedulerConfig inherits them), with units in --help.
    from components.cli.rescheduler import add_arguments, configs_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--rescheduling-policies",
            "decode_load, PREFIX_REPLICATION",
            "--prefix-replication-target-ttft-ms",
            "250",
            "--prefix-replication-min-rate-per-s",
            "2",
            "--prefix-replication-min-blocks",
            "8",
            "--prefix-replication-max-holders",
            "3",
            "--prefix-replication-max-copies-per-cycle",
            "1",
            "--prefix-replication-cold-rate-per-s",
            "0.5",
            "--prefix-replication-min-age-s",
            "0",
            "--prefix-replication-window-s",
            "5",
        ]
    )
    _, cfg = configs_from_args(args)
    assert cfg.rescheduling_policies == [Policy.DECODE_LOAD, Policy.PREFIX_REPLICATION]
    assert (cfg.prefix_replication_target_ttft_ms, cfg.prefix_replication_min_rate_per_s) == (250.0, 2.0)
    assert (cfg.prefix_replication_min_blocks, cfg.prefix_replication_max_holders) == (8, 3)
    assert cfg.prefix_replication_max_copies_per_cycle == 1
    assert (cfg.prefix_replication_cold_rate_per_s, cfg.prefix_replication_min_age_s) == (0.5, 0.0)
    assert cfg.prefix_replication_window_s == 5.0
    # The defaults are ReplicationConfig's, the model the simulator's replicator takes alone.
    assert {
        k: getattr(ReschedulerConfig(), k) for k in ReplicationConfig.model_fields
    } == ReplicationConfig().model_dump()
    # Each flag's help names its unit and its default.
    helps = {a.dest: a.help or "" for a in parser._actions}
    units = {
        "prefix_replication_target_ttft_ms": ("ms", 500.0),
        "prefix_replication_min_rate_per_s": ("Requests per second", 0.5),
        "prefix_replication_min_blocks": ("KV blocks", 16),
        "prefix_replication_max_holders": ("workers", 4),
        "prefix_replication_max_copies_per_cycle": ("KV copies one cycle", 2),
        "prefix_replication_cold_rate_per_s": ("requests per second", 0.1),
        "prefix_replication_min_age_s": ("seconds", 30.0),
        "prefix_replication_window_s": ("Seconds", 30.0),
    }
    assert set(units) == set(ReplicationConfig.model_fields)
    for name, (unit, default) in units.items():
        assert unit in helps[name] and helps[name].endswith(f"default: {default})"), name
    # The plan_cycle of the migration policies skips the name: it plans no pair (the loop's replicator runs it).
    assert plan_cycle([], cfg).pairs == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefix-replication-cold-rate-per-s", "0.5"], "cold_rate_per_s (0.5) must be below"),
        (["--prefix-replication-target-ttft-ms", "0"], "--prefix-replication-target-ttft-ms: Input should be greater"),
        (["--prefix-replication-max-holders", "1"], "--prefix-replication-max-holders: Input should be greater"),
        (["--prefix-replication-window-s", "601"], "--prefix-replication-window-s: Input should be less"),
        (["--prefix-replication-min-blocks", "x"], "--prefix-replication-min-blocks: Input should be a valid integer"),
        (["--rescheduling-policies", "prefix_replica"], "unknown rescheduling policy 'prefix_replica'"),
    ],
)
def test_bad_replication_flags_are_refused_naming_the_flag(argv, message):
    from components.cli.rescheduler import add_arguments, configs_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        configs_from_args(parser.parse_args(argv))
    assert message in str(e.value)
