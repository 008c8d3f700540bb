"""The ``kvmesh`` command: one subcommand per component, and ``bench`` with one subcommand per benchmark.

Each subcommand is a row of ``COMMANDS``/``BENCHMARKS``: its name, the module that implements it (imported only when
that subcommand is the one run, so ``kvmesh status`` never imports vLLM and a worker imports no benchmark), the
functions that add its flags and run it, and its one-line help. Every benchmark prints one JSON object as its last
line, so results can be compared run to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

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
    Command("k8s", "components.cli.k8s", "render a graph as Kubernetes manifests; apply or delete them on a cluster"),
    Command("logs", "components.cli.logs", "print or follow (-f) a served component's log, state/logs/NAME.log"),
    Command(
        "frontend",
        "components.cli.frontend",
        "serve the OpenAI API for a namespace's workers (from etcd); --colocated-rescheduling-mode: and reschedule",
    ),
    Command("router", "components.router.main", "a standalone router: serves 'route'/'report' for a namespace"),
    Command("planner", "components.planner.main", "scale prefill/decode pools on KV use and the prefill queue"),
    Command("rescheduler", "components.cli.rescheduler", "move running requests between workers (Llumnix's policies)"),
    Command("profile", "components.cli.profile", "measure an engine's step times into a profile (JSON + PNG)"),
    Command(
        "simulate", "components.cli.simulate", "what-if: a graph's fleet and router replayed on a trace, simulated"
    ),
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
    Command("simvalidate", "components.cli.bench.simvalidate", "kvmesh simulate vs kvmesh serve on one trace slice"),
    Command("disagg", "components.cli.bench.disagg", "aggregated vs disaggregated prefill/decode, simulated fleets"),
    Command(
        "kv-transfer", "components.cli.bench.kv_transfer", "a vLLM decode engine's first token: KV pull vs recompute"
    ),
    Command("migration", "components.cli.bench.migration", "migration downtime (live vs recompute) and failover"),
    Command(
        "rescheduling", "components.cli.bench.rescheduling", "the rescheduler's policies off vs on, simulated fleets"
    ),
    Command("planner", "components.cli.bench.planner", "planner vs fixed fleets under a sinusoidal load, simulated"),
    Command(
        "planner-live", "components.cli.bench.planner_live", "the planner live and simulated on one sinusoid, compared"
    ),
    Command(
        "scale-down", "components.cli.bench.scale_down", "remove a worker with long outputs: drain vs migration, live"
    ),
    Command(
        "rescheduling-live",
        "components.cli.bench.rescheduling_live",
        "an imbalanced live fleet converging under the rescheduler, losing no token",
    ),
    Command("startup", "components.cli.bench.startup", "how long a new worker (simulated, vLLM) takes to register"),
)


def _add(sub: argparse._SubParsersAction, cmd: Command, *, with_flags: bool) -> None:
    p = sub.add_parser(cmd.name, help=cmd.help)
    if with_flags:
        module = importlib.import_module(cmd.module)
        getattr(module, cmd.add_arguments)(p)
        p.set_defaults(run=getattr(module, cmd.run))


def _first_word(argv: Sequence[str], value_options: tuple[str, ...] = ()) -> int | None:
    """Where the first positional word of ``argv`` is, as argparse reads it: an option of ``value_options`` (or an
    abbreviation of one, argparse accepts those) written without ``=`` takes the next word as its value; after ``--``
    every word is positional."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return i + 1 if i + 1 < len(argv) else None
        if not word.startswith("-") or word == "-":
            return i
        if "=" not in word and len(word) > 2 and any(o.startswith(word) for o in value_options):
            i += 1
        i += 1
    return None


# Every process a deployment or a test starts is a ``kvmesh`` subcommand. Importing all twenty modules to build every
# parser cost each one ~0.3 s of CPU on the 2-core test machine (``import`` of the table's modules: 0.85 s; of
# components.workers.main alone: 0.55 s), paid again by every worker, frontend and planner started.
def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given ``argv``, only the subcommand that ``argv`` names gets its flags (and its module
    imported). The others keep their name and help, so help and 'invalid choice' messages still list every one."""
    ap = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    ap.add_argument("--log-level", default="WARNING", help="Python logging level (DEBUG, INFO, WARNING, ...)")
    chosen = bench_chosen = None
    if argv is not None:
        at = _first_word(argv, ("--log-level",))
        chosen = None if at is None else argv[at]
        if at is not None and chosen == "bench":
            rest = argv[at + 1 :]
            bench_at = _first_word(rest)
            bench_chosen = None if bench_at is None else rest[bench_at]
    sub = ap.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        _add(sub, cmd, with_flags=argv is None or cmd.name == chosen)
    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object as its last line")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for cmd in BENCHMARKS:
        _add(bench_sub, cmd, with_flags=argv is None or (chosen == "bench" and cmd.name == bench_chosen))
    return ap


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(words).parse_args(words)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run: Runner = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
