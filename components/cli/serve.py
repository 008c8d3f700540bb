"""``kvmesh serve GRAPH``, ``kvmesh stop NS``: the command line of a local deployment (``components.deploy.local``).

``serve`` validates the graph, starts embedded etcd/NATS when asked, starts every watcher under a circus arbiter in
its own asyncio loop, writes ``<state_dir>/<namespace>.json``, waits until every worker has registered in etcd and the
frontend answers ``/health``, prints where the frontend listens (last line: ``READY <url>``), then runs until
SIGINT/SIGTERM/SIGHUP. Stopping goes in dependency order: the watchers (SIGTERM; workers deregister and drain, up to
their ``graceful_timeout_s``; then SIGKILL), then NATS, then etcd. Nothing it started outlives it.

A component that dies before the deployment is ready fails the start at once, with the tail of its log, instead of
waiting out ``ready_timeout_s`` while circus restarts it.

``--detach`` re-runs the same command in a new session with its output in ``<state_dir>/logs/<ns>.serve.log``, and
returns when the state file says ``ready`` (or prints why it failed). ``stop`` sends SIGTERM to the serve process
named in the state file and waits until every process recorded there is gone; if serve itself is already gone (it
was SIGKILLed), it terminates the processes it left behind the same way circus would have.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from components.cli.overrides import add_override_argument
from components.deploy.circus import rotate_log
from components.deploy.errors import (
    DeployError,
    ReadyTimeoutError,
    StartupError,
)
from components.deploy.graph import load_graph
from components.deploy.local import (
    Deployment,
    ServeConfig,
    check_not_serving,
    ready_message,
    stop,
    tail,
)
from components.deploy.state import (
    log_path,
    read_state,
    resolve_state_dir,
    serve_log_name,
    state_path,
)
from components.runtime import RuntimeMeshError
from components.runtime.flags import add_model_arguments, model_from_args

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", help="graph file (YAML), e.g. graphs/mock_agg.yaml")
    add_override_argument(p)
    add_model_arguments(p, ServeConfig)
    # The detached child records where its own output goes; not for people.
    p.add_argument("--serve-log", default=None, help=argparse.SUPPRESS)


def add_stop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("namespace", help="namespace of the graph to stop")
    p.add_argument("--state-dir", default=None, help=ServeConfig.model_fields["state_dir"].description)
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="how long to wait for every process to exit (default: the longest graceful_timeout_s + 30 s)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        cfg = model_from_args(ServeConfig, args)
        if cfg.detach:
            return _detach(args, cfg)
        if logging.getLogger().level > logging.DEBUG:
            # circus logs every spawn and signal at INFO; our own lines say what matters.
            logging.getLogger("circus").setLevel(logging.WARNING)
        return asyncio.run(serve(Path(args.graph), list(args.overrides), cfg, serve_log=args.serve_log))
    except DeployError as e:
        print(f"kvmesh serve: {e}", file=sys.stderr)
        return e.exit_code
    except RuntimeMeshError as e:  # an embedded server that would not start, an unreachable external one
        print(f"kvmesh serve: {e}", file=sys.stderr)
        return 1


def stop_main(args: argparse.Namespace) -> int:
    try:
        print(stop(args.namespace, resolve_state_dir(args.state_dir), args.timeout_s))
        return 0
    except DeployError as e:
        print(f"kvmesh stop: {e}", file=sys.stderr)
        return e.exit_code


# ---------------------------------------------------------------------------------------------------------------------
# serve


async def serve(graph_path: Path, overrides: list[str], cfg: ServeConfig, serve_log: str | None = None) -> int:
    graph = load_graph(graph_path, overrides)
    state_dir = resolve_state_dir(cfg.state_dir)
    check_not_serving(state_dir, graph)
    dep = Deployment(graph, graph_path, overrides, state_dir, cfg)
    dep.state.serve_log = serve_log
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            logger.info("%s: stopping namespace %s", sig.name, graph.namespace)
            print(f"kvmesh serve: {sig.name}, stopping {graph.namespace} (workers drain first)", flush=True)
        stop.set()

    def install_signals() -> None:
        loop = asyncio.get_running_loop()
        # SIGHUP too: a closed terminal should stop the deployment, not leave it running unattended.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            loop.add_signal_handler(sig, on_signal, sig)

    install_signals()
    failure: DeployError | RuntimeMeshError | None = None
    try:
        await dep.start()
        # circus's controller installs its own signal handlers when it is created; ours must win, so that a signal
        # stops the embedded servers after the watchers and not the watchers alone.
        install_signals()
        elapsed_s = await dep.wait_ready(stop, on_waiting=_print_waiting)
        dep.state.status = "ready"
        dep.write()
        print(ready_message(dep.state, state_dir, elapsed_s), flush=True)
        await dep.run(stop)
    except (DeployError, RuntimeMeshError) as e:
        failure = e
        dep.state.status = "failed"
        dep.state.reason = str(e)
    finally:
        await dep.shutdown()
    if failure is not None:
        # Raised only now, after everything was stopped and the state file says why.
        raise failure
    print(f"kvmesh serve: {graph.namespace} stopped", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# --detach


def _detach(args: argparse.Namespace, cfg: ServeConfig) -> int:
    graph_path = Path(args.graph).resolve()
    graph = load_graph(graph_path, args.overrides)  # report a broken graph here, not in a log file
    state_dir = resolve_state_dir(cfg.state_dir)
    check_not_serving(state_dir, graph)
    log = log_path(state_dir, serve_log_name(graph.namespace))
    log.parent.mkdir(parents=True, exist_ok=True)
    rotate_log(log)
    argv = [sys.executable, "-m", "components.cli.main", "--log-level", "INFO", "serve", str(graph_path)]
    argv += ["--state-dir", str(state_dir), "--ready-timeout-s", str(cfg.ready_timeout_s)]
    argv += ["--check-delay-s", str(cfg.check_delay_s), "--poll-interval-s", str(cfg.poll_interval_s)]
    argv += ["--serve-log", str(log)]
    for o in args.overrides:
        argv += ["--set", o]
    with open(log, "ab") as out:
        # A new session: the terminal's Ctrl-C and hang-up no longer reach it.
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    path = state_path(state_dir, graph.namespace)
    deadline = time.monotonic() + cfg.ready_timeout_s + 60  # its own start-up (servers, imports) comes on top
    try:
        while True:
            if proc.poll() is not None:
                raise StartupError(
                    "kvmesh serve", f"exited with {proc.returncode} before it was ready; log {log}", tail(log)
                )
            with contextlib.suppress(DeployError):
                st = read_state(path)
                if st.serve.pid == proc.pid and st.status == "ready":
                    elapsed_s = time.time() - st.started_at
                    print(ready_message(st, state_dir, elapsed_s).replace("Ctrl-C, or ", ""))
                    print(f"kvmesh serve: detached (pid {proc.pid}, output in {log})", flush=True)
                    return 0
            if time.monotonic() > deadline:
                proc.terminate()
                raise ReadyTimeoutError(cfg.ready_timeout_s, [f"kvmesh serve (pid {proc.pid}); see {log}"])
            time.sleep(0.1)
    except KeyboardInterrupt:
        proc.terminate()  # serve stops what it started, in order
        proc.wait()
        return 130


def _print_waiting(waiting: list[str], elapsed_s: float) -> None:
    print(f"kvmesh serve: {elapsed_s:.0f} s, still waiting for {', '.join(waiting)}", flush=True)
