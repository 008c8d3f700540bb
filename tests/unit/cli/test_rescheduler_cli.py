"""``kvmesh rescheduler`` and ``kvmesh frontend --colocated-rescheduling-mode``: their flags, derived from the
configs (components/cli/rescheduler.py, components/cli/frontend.py). The loop they run is tested in
tests/unit/test_rescheduler_loop.py and tests/integration/test_rescheduler.py."""

from __future__ import annotations

import pytest

from components.cli.main import build_parser
from components.rescheduler.config import FailoverDomain, Policy

pytestmark = pytest.mark.unit


def parse(*argv: str):
    return build_parser(list(argv)).parse_args(list(argv))


def test_the_standalone_command_takes_llumnix_s_flags_and_its_own():
    from components.cli.rescheduler import configs_from_args

    args = parse(
        "rescheduler",
        "--namespace",
        "ns1",
        "--rescheduling-policies",
        "decode_load,neutral_failover",
        "--rescheduling-interval-ms",
        "100",
        "--llumlet-grpc-timeout-seconds",
        "2.5",
        "--rescheduling-req-select-order",
        "LCR",
        "--failover-domain",
        "node",
        "--metrics-port",
        "9123",
    )
    run, cfg = configs_from_args(args)
    assert (run.namespace, run.component, run.metrics_port) == ("ns1", "backend", 9123)
    assert cfg.rescheduling_policies == [Policy.DECODE_LOAD, Policy.NEUTRAL_FAILOVER]
    assert cfg.interval_s == 0.1
    assert cfg.rescheduling_migrate_timeout_s == 2.5  # Llumnix's spelling of the call timeout
    assert cfg.rescheduling_req_select_order == "last_come_running"  # the seed's abbreviation, read
    assert cfg.failover_domain == FailoverDomain.NODE


def test_the_standalone_command_has_no_switch_for_where_it_runs(capsys):
    for flag in ("--enable-rescheduling", "--colocated-rescheduling-mode"):
        with pytest.raises(SystemExit) as done:
            parse("rescheduler", flag)
        assert done.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_a_bad_value_is_refused_by_its_flag():
    from components.cli.rescheduler import configs_from_args

    with pytest.raises(SystemExit, match=r"--rescheduling-policies: .*unknown rescheduling policy 'balance'"):
        configs_from_args(parse("rescheduler", "--rescheduling-policies", "balance"))


def test_colocated_mode_refuses_several_frontend_replicas(capsys):
    from components.cli.frontend import EXIT_USAGE, main

    args = parse("frontend", "--enable-rescheduling", "--colocated-rescheduling-mode", "--replicas", "2")
    assert main(args) == EXIT_USAGE
    assert "--replicas 1" in capsys.readouterr().err


def test_colocated_prefix_replication_turns_on_the_frontends_prefix_reports():
    from components.cli.frontend import colocated_frontend_config
    from components.frontend.main import config_from_args
    from components.rescheduler.config import REPORTED_PREFIXES, ReschedulerConfig
    from components.runtime.flags import model_from_args

    def configs(*flags: str):
        args = parse("frontend", "--enable-rescheduling", "--colocated-rescheduling-mode", *flags)
        return colocated_frontend_config(config_from_args(args), model_from_args(ReschedulerConfig, args))

    # The policy reads the frontend's reports' prefixes: on (16) unless the flag says otherwise; off without it.
    assert configs("--rescheduling-policies", "prefix_replication").request_stats_prefixes == REPORTED_PREFIXES == 16
    given = configs("--rescheduling-policies", "prefix_replication", "--request-stats-prefixes", "2")
    assert given.request_stats_prefixes == 2
    assert configs("--rescheduling-policies", "neutral_load").request_stats_prefixes == 0
