"""The ``kvmesh`` command: one subcommand per component, and ``bench`` with one subcommand per benchmark.

Every benchmark prints one JSON object as its last line, so results can be compared run to run.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

Runner = Callable[[argparse.Namespace], int]


def _bench_transport(sub: argparse._SubParsersAction) -> None:
    from components.runtime import bench_transport

    p = sub.add_parser("transport", help="runtime request plane vs a bare nats-py loop (chunks/s, first-chunk latency)")
    bench_transport.add_arguments(p)
    p.set_defaults(run=bench_transport.main)


def _bench_frontend(sub: argparse._SubParsersAction) -> None:
    from components.frontend import bench

    p = sub.add_parser("frontend", help="the frontend's own CPU cost per request on mock_agg.yaml at infinite speed")
    bench.add_arguments(p)
    p.set_defaults(run=bench.main)


def _bench_fleet(sub: argparse._SubParsersAction) -> None:
    from components.workers import bench_fleet

    p = sub.add_parser("fleet", help="cost of a fleet of simulated workers in one process (requests/s, CPU-ms/request)")
    bench_fleet.add_arguments(p)
    p.set_defaults(run=bench_fleet.main)


def _bench_load(sub: argparse._SubParsersAction) -> None:
    from components.cli import bench_load

    p = sub.add_parser("load", help="load an OpenAI-compatible URL: concurrency or trace replay (latencies, tokens/s)")
    bench_load.add_arguments(p)
    p.set_defaults(run=bench_load.main)


def _bench_vs_vllm(sub: argparse._SubParsersAction) -> None:
    from components.cli import bench_vs_vllm

    p = sub.add_parser("vs-vllm", help="kvmesh + one vLLM worker vs `vllm serve`, same model and load (tokens/s, TTFT)")
    bench_vs_vllm.add_arguments(p)
    p.set_defaults(run=bench_vs_vllm.main)


def _bench_router(sub: argparse._SubParsersAction) -> None:
    from components.cli import bench_router

    p = sub.add_parser("router", help="cost of one routing decision (kv vs baselines, 8-1024 workers), KV event ingest")
    bench_router.add_arguments(p)
    p.set_defaults(run=bench_router.main)


def _bench_routing(sub: argparse._SubParsersAction) -> None:
    from components.cli import bench_routing

    p = sub.add_parser("routing", help="routing quality: a Mooncake trace slice per policy on simulated workers (TTFT)")
    bench_routing.add_arguments(p)
    p.set_defaults(run=bench_routing.main)


def _frontend(sub: argparse._SubParsersAction) -> None:
    from components.frontend import main as frontend_main

    p = sub.add_parser("frontend", help="serve the OpenAI API for a namespace's workers (models discovered from etcd)")
    frontend_main.add_arguments(p)
    p.set_defaults(run=frontend_main.main)


def _router(sub: argparse._SubParsersAction) -> None:
    from components.router import main as router_main

    p = sub.add_parser("router", help="a standalone router: serves 'route'/'report' for a namespace's workers")
    router_main.add_arguments(p)
    p.set_defaults(run=router_main.main)


def _status(sub: argparse._SubParsersAction) -> None:
    from components.cli import status

    p = sub.add_parser("status", help="list every instance registered in etcd")
    status.add_arguments(p)
    p.set_defaults(run=status.main)


def _serve(sub: argparse._SubParsersAction) -> None:
    from components.cli import serve

    p = sub.add_parser("serve", help="run a graph file on this machine under circus (Ctrl-C or 'kvmesh stop' ends it)")
    serve.add_arguments(p)
    p.set_defaults(run=serve.main)


def _stop(sub: argparse._SubParsersAction) -> None:
    from components.cli import serve

    p = sub.add_parser("stop", help="stop a graph served with 'kvmesh serve --detach' (workers drain first)")
    serve.add_stop_arguments(p)
    p.set_defaults(run=serve.stop_main)


def _logs(sub: argparse._SubParsersAction) -> None:
    from components.cli import logs

    p = sub.add_parser("logs", help="print or follow (-f) a served component's log, state/logs/NAME.log")
    logs.add_arguments(p)
    p.set_defaults(run=logs.main)


def _worker(sub: argparse._SubParsersAction) -> None:
    from components.workers import main as worker_main

    p = sub.add_parser("worker", help="run engine workers that register in etcd and serve over NATS")
    worker_main.add_arguments(p)
    p.set_defaults(run=worker_main.main)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    ap.add_argument("--log-level", default="WARNING", help="Python logging level (DEBUG, INFO, WARNING, ...)")
    sub = ap.add_subparsers(dest="command", required=True)
    _status(sub)
    _worker(sub)
    _serve(sub)
    _stop(sub)
    _logs(sub)
    _frontend(sub)
    _router(sub)
    bench = sub.add_parser("bench", help="benchmarks; each prints one JSON object as its last line")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    _bench_transport(bench_sub)
    _bench_fleet(bench_sub)
    _bench_frontend(bench_sub)
    _bench_load(bench_sub)
    _bench_vs_vllm(bench_sub)
    _bench_router(bench_sub)
    _bench_routing(bench_sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run: Runner = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
