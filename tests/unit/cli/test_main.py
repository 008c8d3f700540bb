"""``kvmesh``'s command table (components/cli/main.py): a process imports the module of its own subcommand only, and
the command line it parses is the one that every subcommand's flags together would parse."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.cli.main import BENCHMARKS, COMMANDS, _first_word, build_parser

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]

# Command lines as deployments and tests write them, each with the words argparse reads in its own way: options
# before the subcommand, an abbreviated option, ``--opt=value``, a benchmark.
ARGVS = [
    ["--log-level", "INFO", "worker", "--namespace", "ns", "--engine", "mock", "--model", "m"],
    ["--log-level=DEBUG", "frontend", "--namespace", "ns", "--port", "8001"],
    ["--log", "ERROR", "router", "--namespace", "ns"],
    ["status", "--namespace", "ns"],
    ["planner", "--namespace", "pl", "--environment", "virtual"],
    ["stop", "mock"],
    ["logs", "mock-frontend-0"],
    ["serve", "graphs/mock_agg.yaml"],
    ["bench", "load", "--url", "http://127.0.0.1:1", "--model", "fake"],
    ["--log-level", "WARNING", "bench", "planner"],
]


@pytest.mark.parametrize("argv", ARGVS, ids=lambda a: " ".join(a))
def test_a_command_line_parses_as_it_does_with_every_subcommand_s_flags(argv):
    # The reference is the parser with every subcommand's flags: what `kvmesh` built before it imported one module.
    assert vars(build_parser(argv).parse_args(argv)) == vars(build_parser().parse_args(argv))


def test_the_first_word_is_found_as_argparse_finds_it():
    assert _first_word(["--log-level", "bench", "worker"], ("--log-level",)) == 2  # the option's value is no command
    assert _first_word(["--log-l", "INFO", "worker"], ("--log-level",)) == 2  # argparse accepts the abbreviation
    assert _first_word(["--log-level=INFO", "worker"], ("--log-level",)) == 1
    assert _first_word(["-h"], ("--log-level",)) is None
    assert _first_word(["--", "--odd"], ("--log-level",)) == 1
    assert _first_word([], ("--log-level",)) is None


def test_help_lists_every_subcommand_and_every_benchmark(capsys):
    for argv, names in ((["--help"], [c.name for c in COMMANDS] + ["bench"]), (["bench", "--help"], BENCHMARKS)):
        with pytest.raises(SystemExit) as done:
            build_parser(argv).parse_args(argv)
        assert done.value.code == 0
        out = capsys.readouterr().out
        for cmd in names:
            name = cmd if isinstance(cmd, str) else cmd.name
            assert name in out
            if not isinstance(cmd, str):
                assert cmd.help.split()[0] in out


def test_a_subcommand_s_help_shows_its_own_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser(["worker", "--help"]).parse_args(["worker", "--help"])
    assert "--namespace" in capsys.readouterr().out


def test_a_process_imports_the_module_of_its_subcommand_and_no_other():
    modules = sorted({c.module for c in COMMANDS + BENCHMARKS})
    code = (
        "import json, sys\n"
        "from components.cli.main import build_parser\n"
        "build_parser(sys.argv[1:])\n"
        f"print(json.dumps([m for m in {modules!r} if m in sys.modules]))\n"
    )

    def loaded(*argv: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert loaded("--help") == []
    assert loaded("--log-level", "INFO", "worker") == ["components.workers.main"]
    assert loaded("bench", "load") == ["components.cli.bench.load"]
