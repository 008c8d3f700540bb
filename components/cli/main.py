"""The ``kvmesh`` command: one subcommand per component, and ``bench`` with one subcommand per benchmark.

Each subcommand is a row of ``COMMANDS``/``BENCHMARKS``: its name, the module that implements it (imported only when
that subcommand is built, so ``kvmesh status`` never imports vLLM), the functions that add its flags and run it, and
its one-line help. Every benchmark prints one JSON object as its last line, so results can be compared run to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable

Runner = Callable[[argparse.Namespace], int]


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    name: str
    module: str
    help: str
    add_arguments: str = "add_arguments"
    run: str = "main"


COMMANDS = (
    Command("status", "components.cli.status", "list every instance registered in etcd, by deployment and watcher"),
    Command("worker", "components.workers.main", "run engine workers that register in etcd and serve over NATS"),
    Command("serve", "components.cli.serve", "run a graph file on this machine under circus (Ctrl-C or 'kvmesh stop')"),
    Command(
        "stop",
        "components.cli.serve",
        "stop a graph served with 'kvmesh serve --detach' (workers drain first)",
        add_arguments="add_stop_arguments",
        run="stop_main",
    ),
    Command("logs", "components.cli.logs", "print or follow (-f) a served component's log, state/logs/NAME.log"),
    Command("frontend", "components.frontend.main", "serve the OpenAI API for a namespace's workers (from etcd)"),
    Command("router", "components.router.main", "a standalone router: serves 'route'/'report' for a namespace"),
    Command("planner", "components.planner.main", "scale prefill/decode pools on KV use and the prefill queue"),
    Command("profile", "components.cli.profile", "measure an engine's step times into a profile (JSON + PNG)"),
)

BENCHMARKS = (
    Command("transport", "components.cli.bench.transport", "runtime request plane vs a bare nats-py loop"),
    Command("fleet", "components.cli.bench.fleet", "cost of a fleet of simulated workers in one process"),
    Command("frontend", "components.cli.bench.frontend", "the frontend's CPU cost per request at infinite speed"),
    Command("load", "components.cli.bench.load", "load an OpenAI-compatible URL: concurrency or trace replay"),
    Command("vs-vllm", "components.cli.bench.vs_vllm", "kvmesh + one vLLM worker vs `vllm serve`, same load"),
    Command("router", "components.cli.bench.router", "cost of one routing decision (8-1024 workers), KV event ingest"),
    Command("routing", "components.cli.bench.routing", "routing quality per policy at fractions of measured capacity"),
    Command("routing-live", "components.cli.bench.routing_live", "one trace slice per policy on a live deployment"),
    Command("disagg", "components.cli.bench.disagg", "aggregated vs disaggregated prefill/decode, simulated fleets"),
    Command(
        "kv-transfer", "components.cli.bench.kv_transfer", "a vLLM decode engine's first token: KV pull vs recompute"
    ),
    Command("migration", "components.cli.bench.migration", "migration downtime (live vs recompute) and failover"),
    Command("planner", "components.cli.bench.planner", "planner vs fixed fleets under a sinusoidal load, simulated"),
)


def _add(sub: argparse._SubParsersAction, cmd: Command) -> None:
    module = importlib.import_module(cmd.module)
    p = sub.add_parser(cmd.name, help=cmd.help)
    getattr(module, cmd.add_arguments)(p)
    p.set_defaults(run=getattr(module, cmd.run))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    ap.add_argument("--log-level", default="WARNING", help="Python logging level (DEBUG, INFO, WARNING, ...)")
    sub = ap.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        _add(sub, cmd)
    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object as its last line")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for cmd in BENCHMARKS:
        _add(bench_sub, cmd)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run: Runner = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
