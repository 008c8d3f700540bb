"""A deployment on this machine: embedded etcd/NATS, every watcher under a circus arbiter, and the state file.

``Deployment`` is what ``kvmesh serve`` runs (``components/cli/serve.py`` adds the command line, signals and printing
around it): ``start`` starts the embedded servers and the watchers, ``wait_ready`` waits until every worker has
registered and the frontend answers ``/health``, ``run`` serves until told to stop, ``shutdown`` stops everything in
dependency order: the watchers (SIGTERM; workers deregister and drain, up to their ``graceful_timeout_s``; then
SIGKILL), then NATS, then etcd. ``stop`` ends a deployment from another process through its state file.

A component that dies before the deployment is ready fails the start at once, with the tail of its log, instead of
waiting out ``ready_timeout_s`` while circus restarts it.

Imports: the deployment library (graph, plan, circus, state), the runtime and the protocol; never ``components.cli``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from pydantic import BaseModel, Field

from components.deploy.circus import CircusLauncher, WatcherInfo, detect_gpus, rotate_log
from components.deploy.errors import (
    AlreadyServingError,
    DeployError,
    NotServingError,
    PortInUseError,
    ReadyTimeoutError,
    StartupError,
    StopTimeoutError,
    WatcherClashError,
)
from components.deploy.graph import Graph, planner_watcher, replica_watcher
from components.deploy.plan import WatcherPlan, assign_gpus, plan_watchers
from components.deploy.state import (
    ProcessRecord,
    ServerState,
    ServeState,
    WatcherState,
    live_states,
    log_dir,
    read_state,
    state_path,
    write_state,
)
from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_KV_STATE
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.runtime.config import RuntimeConfig
from components.runtime.errors import RuntimeMeshError
from components.runtime.servers import EtcdServer, NatsServer, ServerProcess, free_port

if TYPE_CHECKING:
    from components.runtime import InstanceInfo, Runtime

logger = logging.getLogger(__name__)


class ServeConfig(BaseModel):
    """kvmesh serve: where its state goes and how long it waits."""

    state_dir: str | None = Field(
        default=None,
        description="Directory of state files (<namespace>.json) and logs (logs/<watcher>.log); "
        "unset: $KVMESH_STATE_DIR, else ./state",
    )
    ready_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="How long start-up may take until every worker has registered and the frontend is healthy "
        "(a vLLM engine loads and profiles for tens of seconds on a CPU); then serve stops everything and fails.",
    )
    detach: bool = Field(
        default=False, description="Return once ready and leave the deployment running; 'kvmesh stop NS' ends it."
    )
    check_delay_s: float = Field(
        default=1.0, gt=0, description="How often circus looks for exited processes to restart (circus's default)."
    )
    max_start_restarts: int = Field(
        default=2,
        ge=0,
        description="Crashes per watcher tolerated before the deployment is ready (circus restarts a crashed process; "
        "a transient failure such as a slow first connection deserves another try, a bad flag does not); one more "
        "fails the start with the tail of its log.",
    )
    server_check_interval_s: float = Field(
        default=0.25,
        gt=0,
        description="How often serve checks that the embedded etcd and nats-server still run (a dead one is "
        "restarted at once: the mesh rides out a gap this short).",
    )
    server_restart_backoff_s: list[float] = Field(
        default_factory=lambda: [0.0, 0.5, 1.0, 2.0, 4.0],
        min_length=1,
        description="Delays before each attempt to restart an embedded server that exited; when the last attempt "
        "fails too, the deployment fails with the reason.",
    )
    progress_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="While starting, how often serve says what it is still waiting for (which watchers have not "
        "registered their workers, whether the frontend answers /health).",
    )
    poll_interval_s: float = Field(
        default=0.2,
        gt=0,
        description="How often start-up checks registrations and health, and how soon a dead component is noticed.",
    )


class StartInterruptedError(DeployError):
    """A signal arrived before the deployment was ready."""

    exit_code = 130


def check_not_serving(state_dir: Path, graph: Graph) -> None:
    """The namespace must not be served from this state dir already, nor may a watcher name (it names a log file)."""
    mine = set(graph.watcher_names())
    try:
        prev: ServeState | None = read_state(state_path(state_dir, graph.namespace))
    except DeployError:
        prev = None  # never served here, or an unreadable file that the new one replaces
    if prev is not None and not prev.serve.alive():
        if left := [p.pid for p in prev.all_processes()[1:] if p.alive()]:
            # A serve that was SIGKILLed leaves its watchers and its etcd running; starting again would wipe the
            # data directory under a live etcd and double the workers.
            raise AlreadyServingError(
                graph.namespace,
                prev.serve.pid,
                f"it is gone but left processes {left} running; 'kvmesh stop {graph.namespace}' ends them",
            )
    for st in live_states(state_dir):
        if st.namespace == graph.namespace:
            raise AlreadyServingError(st.namespace, st.serve.pid, f"see {state_path(state_dir, st.namespace)}")
        # Watcher names carry the namespace, so two graphs clash only when the names still meet (namespace "a" with
        # group "b-c" and namespace "a-b" with group "c"): say that, not that this namespace is served.
        if clash := sorted(mine & {w.name for w in st.watchers}):
            raise WatcherClashError(graph.namespace, st.namespace, st.serve.pid, clash, log_dir(state_dir))


class Deployment:
    """One served graph: embedded servers, the circus launcher and the state file. Owned by ``serve``."""

    def __init__(self, graph: Graph, graph_path: Path, overrides: list[str], state_dir: Path, cfg: ServeConfig) -> None:
        self.graph = graph
        self.cfg = cfg
        self.state_dir = state_dir
        self.path = state_path(state_dir, graph.namespace)
        self.etcd: EtcdServer | None = None
        self.nats: NatsServer | None = None
        self.launcher: CircusLauncher | None = None
        self._frontend_replicas_ready: set[int] = set()  # the frontend's processes seen healthy (``healthy``)
        self.plans: list[WatcherPlan] = []
        self.gpus_available = detect_gpus()
        self.gpus = assign_gpus(graph.namespace, graph.workers, self.gpus_available)
        self.state = ServeState(
            namespace=graph.namespace,
            graph=str(graph_path.resolve()),
            overrides=overrides,
            status="starting",
            serve=ProcessRecord.of(os.getpid()),
            started_at=time.time(),
            etcd_endpoints=list(graph.infrastructure.etcd.endpoints),
            nats_url=graph.infrastructure.nats.url or "",
            gpus_available=self.gpus_available,
        )

    def write(self) -> None:
        write_state(self.path, self.state)

    async def start(self) -> None:
        """Embedded servers, then every watcher. Returns once all are spawned; see ``wait_ready``."""
        fe = self.graph.frontend
        if fe.enabled and fe.port:
            # A frontend that cannot bind would crash-loop and fail the start only after the servers and workers
            # came up; say so before starting anything.
            _check_port_free(fe.host, fe.port)
        infra = self.graph.infrastructure
        data = self.state_dir / self.graph.namespace
        if infra.etcd.embedded:
            self.etcd = EtcdServer(data_dir=data / "etcd", port=infra.etcd.port)
            self.etcd.wipe()  # a previous run's registrations must not count as this run's workers
            await asyncio.to_thread(self.etcd.start)
            self.state.etcd_endpoints = [self.etcd.endpoint]
            self.state.embedded_etcd = _server_state(self.etcd, self.etcd.endpoint)
            self.write()
        if infra.nats.embedded:
            self.nats = NatsServer(data_dir=data / "nats", port=infra.nats.port)
            shutil.rmtree(self.nats.data_dir / "jetstream", ignore_errors=True)  # no stale queued work
            await asyncio.to_thread(self.nats.start)
            self.state.nats_url = self.nats.url
            self.state.embedded_nats = _server_state(self.nats, self.nats.url)
            self.write()

        port = fe.port or free_port("127.0.0.1" if fe.host in ("0.0.0.0", "::") else fe.host)
        if fe.enabled:
            self.state.frontend_url = f"http://{_client_host(fe.host)}:{port}"
        logs = log_dir(self.state_dir)
        self.plans = plan_watchers(
            self.graph,
            etcd_endpoints=self.state.etcd_endpoints,
            nats_url=self.state.nats_url,
            frontend_port=port,
            gpus=self.gpus,
            log_dir=logs,
            state_dir=self.state_dir,
        )
        for plan in self.plans:
            plan.log.parent.mkdir(parents=True, exist_ok=True)
            rotate_log(plan.log)
        self.launcher = CircusLauncher(
            check_delay_s=self.cfg.check_delay_s, proc_name=f"kvmesh-serve-{self.graph.namespace}"
        )
        self.state.circus = self.launcher.circus_state
        self.state.watchers = [_watcher_state(p) for p in self.plans]
        self.write()
        await self.launcher.start(self.plans)
        self.refresh()

    def refresh(self) -> bool:
        """Bring the state file's watchers in line with the arbiter's and record their current processes; rewrite
        the file (atomically) if anything changed. A watcher added through the circus controller (the planner, or a
        person with circusctl) is recorded from what circus runs (``added_watcher_state``); one removed through it
        is dropped, and its log file closed. So the state file is the fleet as it is, whoever changed it."""
        if self.launcher is None or self.launcher.stopping:
            return False
        procs = self.launcher.processes()
        names = self.launcher.watcher_names()
        changed = False
        present = set(names)
        kept = [w for w in self.state.watchers if w.name in present]
        if len(kept) != len(self.state.watchers):
            gone = sorted({w.name for w in self.state.watchers} - present)
            logger.info("watchers removed through the circus controller: %s", ", ".join(gone))
            self.state.watchers = kept
            changed = True
        self.launcher.close_removed()
        known = {w.name for w in self.state.watchers}
        for name in names:
            if name not in known and (info := self.launcher.describe(name)) is not None:
                record = added_watcher_state(self.graph, info)
                logger.info("watcher added through the circus controller: %s (%s)", name, record.group or record.kind)
                self.state.watchers.append(record)
                changed = True
        for w in self.state.watchers:
            new = procs.get(w.name, [])
            if w.kind == "frontend":
                new = new + replica_processes(new)
            if new != w.processes:
                w.processes = new
                changed = True
        if changed:
            self.write()
        return changed

    async def wait_ready(
        self, stop: asyncio.Event, on_waiting: Callable[[list[str], float], None] | None = None
    ) -> float:
        """Until every worker watcher's processes have registered their workers and the frontend is healthy.

        ``on_waiting(what, elapsed_s)`` is called every ``progress_interval_s`` while something is still awaited,
        so a person watching a slow start (vLLM engines load for tens of seconds) sees what it waits for.
        """
        assert self.launcher is not None
        t0 = time.monotonic()
        deadline = t0 + self.cfg.ready_timeout_s
        next_progress = t0 + self.cfg.progress_interval_s
        # Imported here: the runtime's clients (nats-py with aiohttp, aetcd with grpc) are ~0.3 s of import that
        # ``kvmesh stop``/``logs``, the planner and graph loading never use; only waiting for readiness does.
        from components.runtime import Runtime

        rcfg = RuntimeConfig(etcd_endpoints=self.state.etcd_endpoints, nats_url=self.state.nats_url)
        runtime = await Runtime.connect(rcfg, name=f"kvmesh-serve-{self.graph.namespace}")
        seen: dict[str, set[int]] = {}
        try:
            while True:
                self.refresh()
                for w in self.state.watchers:
                    failed = self._exits_beyond_limit(w, seen)
                    if failed:
                        times = "once" if failed == 1 else f"{failed} times"
                        raise StartupError(
                            w.name,
                            f"exited {times} during start-up (max_start_restarts {self.cfg.max_start_restarts}); "
                            f"its log: {w.log}",
                            await settled_tail(Path(w.log)),
                        )
                waiting = await self._waiting_for(runtime)
                if not waiting:
                    return time.monotonic() - t0
                if stop.is_set():
                    raise StartInterruptedError("interrupted while starting")
                now = time.monotonic()
                if now > deadline:
                    raise ReadyTimeoutError(self.cfg.ready_timeout_s, waiting)
                if on_waiting is not None and now >= next_progress:
                    on_waiting(waiting, now - t0)
                    next_progress = now + self.cfg.progress_interval_s
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.cfg.poll_interval_s):
                        await stop.wait()
        finally:
            await runtime.shutdown(drain_timeout_s=1.0)

    def _exits_beyond_limit(self, w: WatcherState, seen: dict[str, set[int]]) -> int:
        """How many of ``w``'s processes have exited since start-up began, if more than ``max_start_restarts``
        (else 0)."""
        pids = seen.setdefault(w.name, set())
        pids.update(p.pid for p in w.processes)
        alive = {p.pid for p in w.processes if p.alive()}
        exits = len(pids - alive)
        return exits if exits > self.cfg.max_start_restarts else 0

    async def _waiting_for(self, runtime: Runtime) -> list[str]:
        by_pid = registered_workers_by_pid(await runtime.namespace(self.graph.namespace).list_instances())
        waiting = []
        for w in self.state.watchers:
            if w.kind == "worker":
                got = sum(by_pid.get(p.pid, 0) for p in w.processes)
                if got < w.num_workers:
                    waiting.append(f"{w.name} ({got}/{w.num_workers} workers registered)")
                elif w.startup_s is None and w.processes:
                    # Measured here, within one poll interval (poll_interval_s) of the registration: how long this
                    # machine takes to bring the group's worker up, which the SLA planner scales ahead by.
                    w.startup_s = round(max(0.0, time.time() - min(p.create_time for p in w.processes)), 3)
            elif w.kind == "frontend" and self.state.frontend_url:
                # Healthy *and* listing every model the graph serves: the frontend answers 200 before it has
                # discovered any worker, and 503 while it loads a model's tokenizer, so 200 alone can precede that.
                models = {g.model for g in self.graph.workers if g.replicas > 0 and g.role != WorkerRole.PREFILL}
                url = self.state.frontend_url + "/health"
                if not await asyncio.to_thread(healthy, url, models, self._frontend_replicas_ready):
                    waiting.append(f"{w.name} (GET {self.state.frontend_url}/health: 200 listing {sorted(models)})")
        return waiting

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until a signal, or until circus is told to quit through its controller, or an embedded server that
        died cannot be brought back."""
        assert self.launcher is not None
        while not stop.is_set() and not self.launcher.stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.server_check_interval_s):
                    await stop.wait()
            self.refresh()
            await self.supervise_servers()

    async def supervise_servers(self) -> None:
        """Restart an embedded etcd or nats-server that exited, on the same ports and with the same data (JetStream's
        included), as circus restarts a watcher: the mesh rides out the gap (clients keep their instances, requests
        wait for the bus, workers re-register), so the deployment must not end with it. Tries after each delay of
        ``server_restart_backoff_s``; only a server that cannot come back fails the deployment, saying why."""
        for server, record in ((self.etcd, self.state.embedded_etcd), (self.nats, self.state.embedded_nats)):
            if server is None or record is None or server.proc is None:
                continue
            code = server.proc.poll()
            if code is None:
                continue
            why = exit_reason(code)
            record.restarts += 1
            record.last_exit = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {why}"
            record.process = None
            logger.warning("embedded %s %s; restarting it on the same port and data (restart %d)", server.name, why,
                           record.restarts)  # fmt: skip
            self.write()
            failure: Exception | None = None
            for delay_s in self.cfg.server_restart_backoff_s:
                await asyncio.sleep(delay_s)
                try:
                    await asyncio.to_thread(server.start)
                except (RuntimeMeshError, OSError) as e:  # ConnectError: it did not come up (port held, crash)
                    failure = e
                    logger.warning("embedded %s did not come back: %s", server.name, e)
                    continue
                failure = None
                break
            if failure is not None:
                tries = len(self.cfg.server_restart_backoff_s)
                raise StartupError(
                    server.name,
                    f"embedded {server.name} {why} and did not come back after {tries} tries: {failure}; "
                    f"its log: {server.log_path}",
                )
            record.process = ProcessRecord.of(server.pid) if server.pid else None
            self.write()
            logger.warning("embedded %s is back (pid %s)", server.name, server.pid)

    async def shutdown(self) -> None:
        """Watchers first (they drain through etcd and NATS), then NATS, then etcd. Each step in its own try."""
        if self.state.status not in ("failed",):
            self.state.status = "stopping"
        with contextlib.suppress(OSError):
            self.write()
        if self.launcher is not None:
            try:
                await self.launcher.stop()
            except Exception as e:  # noqa: BLE001 - the servers below must still be stopped
                logger.error("stopping the circus watchers: %s", e)
        for server in (self.nats, self.etcd):
            if server is None:
                continue
            try:
                await asyncio.to_thread(server.stop)
                # Its data (60 MB of etcd WAL, JetStream's store) is wiped at the next start anyway; its log stays.
                remove_server_data(server.data_dir)
            except Exception as e:  # noqa: BLE001 - keep stopping the rest
                logger.error("stopping embedded %s: %s", server.name, e)
        if self.state.status != "failed":
            self.state.status = "stopped"
        with contextlib.suppress(OSError):
            self.write()


def replica_processes(parents: Iterable[ProcessRecord]) -> list[ProcessRecord]:
    """The frontend's replica processes (``kvmesh frontend --replicas N`` runs them as its children): recorded with
    the watcher's own, so that ``kvmesh stop`` waits for every one of them and ends them if serve is gone."""
    out: list[ProcessRecord] = []
    for parent in parents:
        try:
            children = psutil.Process(parent.pid).children()
        except psutil.Error:
            continue
        for child in sorted(children, key=lambda c: c.pid):
            try:
                out.append(ProcessRecord(pid=child.pid, create_time=child.create_time()))
            except psutil.Error:
                continue
    return out


def registered_workers_by_pid(instances: Iterable[InstanceInfo]) -> dict[int, int]:
    """Process id -> how many of its workers have registered. A worker is up once it serves ``generate``; a prefill
    worker serves none (its work comes from the prefill queue), so its ``kv_state`` counts, registered once it pulls
    from the queue. Serve's readiness and the planner's "the new worker is up" use this one rule."""
    by_pid: dict[int, int] = {}
    for inst in instances:
        meta = WorkerMetadata.from_dict(inst.metadata)
        counts = inst.endpoint == ENDPOINT_GENERATE or (
            inst.endpoint == ENDPOINT_KV_STATE and meta.role == WorkerRole.PREFILL
        )
        if counts and meta.pid:
            by_pid[meta.pid] = by_pid.get(meta.pid, 0) + 1
    return by_pid


_SUBCOMMANDS = ("worker", "frontend", "planner", "rescheduler")


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def added_watcher_state(graph: Graph, info: WatcherInfo) -> WatcherState:
    """The state file's record of a watcher added through the circus controller. A name serve would give a replica
    of a group (``<namespace>-<group>-<i>``; the longest matching group name wins, as 'a-b' over 'a') makes it a
    replica of that group: its component, model, role and worker count are the group's. Any other name: read from
    its command line (``kvmesh worker --model M --role R --num-workers N``), so a watcher a person added under a
    name of their own still counts in its model's pools."""
    gpus = [g for g in info.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    base = WatcherState(
        name=info.name,
        kind="worker",
        cmd=info.cmd,
        env=info.env,
        gpus=gpus,
        log=info.log,
        graceful_timeout_s=info.graceful_timeout_s,
        added=True,
    )
    for g in sorted(graph.workers, key=lambda g: len(g.name), reverse=True):
        prefix = replica_watcher(graph.namespace, g.name, 0)[:-1]
        rest = info.name[len(prefix) :] if info.name.startswith(prefix) else ""
        if rest.isdigit():
            return base.model_copy(
                update={
                    "group": g.name,
                    "replica": int(rest),
                    "component": g.component,
                    "model": g.model,
                    "role": str(g.role),
                    "num_workers": g.num_workers,
                }
            )
    kind = next((a for a in info.cmd if a in _SUBCOMMANDS), "worker")
    if info.name == planner_watcher(graph.namespace):
        kind = "planner"
    if kind != "worker":
        return base.model_copy(update={"kind": kind})
    num = _flag_value(info.cmd, "--num-workers")
    return base.model_copy(
        update={
            "component": _flag_value(info.cmd, "--component") or "backend",
            "model": _flag_value(info.cmd, "--model"),
            "role": _flag_value(info.cmd, "--role") or str(WorkerRole.AGGREGATED),
            "num_workers": int(num) if num and num.isdigit() else 1,
        }
    )


def ready_message(state: ServeState, state_dir: Path, elapsed_s: float) -> str:
    workers = [w for w in state.watchers if w.kind == "worker"]
    example = workers[0].name if workers else f"{state.namespace}-frontend"
    lines = [
        f"kvmesh serve: namespace {state.namespace} ready in {elapsed_s:.1f} s: "
        f"{sum(w.num_workers for w in workers)} workers in {len(workers)} watchers",
        f"  frontend  {state.frontend_url}  (OpenAI API at {state.frontend_url}/v1)"
        if state.frontend_url
        else "  frontend  none (frontend.enabled is false)",
        f"  etcd      {','.join(state.etcd_endpoints)}" + (" (embedded)" if state.embedded_etcd else ""),
        f"  nats      {state.nats_url}" + (" (embedded)" if state.embedded_nats else ""),
        f"  circus    {state.circus.endpoint if state.circus else '-'}",
        *(
            f"  planner   {w.name} scales {w.model} (kvmesh status shows its decisions; kvmesh logs {w.name})"
            for w in state.watchers
            if w.kind == "planner"
        ),
        *(
            f"  rescheduler {w.name} moves requests between workers (kvmesh status shows its last cycle; kvmesh logs "
            f"{w.name})"
            for w in state.watchers
            if w.kind == "rescheduler"
        ),
        f"  state     {state_path(state_dir, state.namespace)}",
        f"  logs      {log_dir(state_dir)}/<watcher>.log  (kvmesh logs {example} -f)",
        f"  stop      Ctrl-C, or kvmesh stop {state.namespace}",
        f"READY {state.frontend_url or ''}".rstrip(),
    ]
    return "\n".join(lines)


def _server_state(server: ServerProcess, endpoint: str) -> ServerState:
    proc = ProcessRecord.of(server.pid) if server.pid else None
    return ServerState(endpoint=endpoint, process=proc, data_dir=str(server.data_dir), log=str(server.log_path))


def _watcher_state(p: WatcherPlan) -> WatcherState:
    return WatcherState(
        name=p.name,
        kind=p.kind,
        group=p.group,
        replica=p.replica,
        component=p.component,
        model=p.model,
        role=p.role,
        num_workers=p.num_workers,
        cmd=p.cmd,
        env=p.redacted_env(),
        gpus=p.gpus,
        log=str(p.log),
        graceful_timeout_s=p.graceful_timeout_s,
    )


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds: TIME_WAIT is not "in use"
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(host, port, e.strerror or str(e)) from None


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def healthy(url: str, models: Iterable[str] = (), replicas_seen: set[int] | None = None) -> bool:
    """``url`` answers 200 and its JSON's ``models`` include every one of ``models``.

    A frontend of several processes on one port (``kvmesh frontend --replicas N``) says in that JSON which one
    answered (``replica`` i of ``replicas`` N), and each process discovers workers and loads tokenizers on its own:
    then every one must have answered so. Each probe is a new connection, which the kernel hashes onto one of the
    processes, so up to 8N probes are made per call; the processes seen ready are kept in ``replicas_seen`` across
    calls (a process, once ready, stays so)."""
    wanted = set(models)
    seen = replicas_seen if replicas_seen is not None else set()
    probes, limit = 0, 1
    while probes < limit:
        probes += 1
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status != 200:
                    return False
                body = json.loads(r.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return False
        if not isinstance(body, dict) or not wanted <= set(body.get("models", [])):
            return False
        num, index = body.get("replicas"), body.get("replica")
        if not isinstance(num, int) or not isinstance(index, int) or num <= 1:
            return True  # one process
        seen.add(index)
        if len(seen & set(range(num))) == num:
            return True
        limit = 8 * num
    return False


async def settled_tail(path: Path, num_lines: int = 20, quiet_s: float = 0.25, timeout_s: float = 3.0) -> str:
    """``tail`` of a log that an exited process's output is still being copied into: circus's stream redirector
    reads the process's pipes and writes the file on its own schedule, so at the moment the exit is seen its last
    lines (usually the error) may not be there yet. Read once the file has not grown for ``quiet_s``, or after
    ``timeout_s`` at most. There is no event to wait for: the redirector says nothing when it has drained a pipe."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    size, since = -1, loop.time()
    while loop.time() < deadline:
        try:
            now_size = os.stat(path).st_size
        except OSError:
            now_size = -1
        if now_size != size:
            size, since = now_size, loop.time()
        elif loop.time() - since >= quiet_s:
            break
        await asyncio.sleep(0.05)
    return tail(path, num_lines)


def tail(path: Path, num_lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def stop(namespace: str, state_dir: Path, timeout_s: float | None = None) -> str:
    """Stop the graph served as ``namespace`` from ``state_dir``; returns what was done."""
    path = state_path(state_dir, namespace)
    try:
        st = read_state(path)
    except DeployError as e:
        raise NotServingError(f"namespace {namespace!r}", str(e)) from None
    if timeout_s is None:
        timeout_s = max([w.graceful_timeout_s for w in st.watchers] + [0.0]) + 30.0
    if st.serve.alive():
        os.kill(st.serve.pid, signal.SIGTERM)
        remaining = _wait_gone(st.all_processes(), timeout_s)
        if remaining:
            raise StopTimeoutError(namespace, timeout_s, [p.pid for p in remaining])
        return f"stopped {namespace} (serve pid {st.serve.pid})"
    # serve is gone without stopping its watchers (SIGKILL, OOM): do what it would have done, in the same order.
    leftovers = [p for p in st.all_processes()[1:] if p.alive()]
    if not leftovers:
        return f"{namespace} was not running (status {st.status})"
    servers = {s.process.pid for s in (st.embedded_etcd, st.embedded_nats) if s and s.process}
    watchers = [p for p in leftovers if p.pid not in servers]
    grace = max([w.graceful_timeout_s for w in st.watchers] + [5.0])
    for group, grace_s in ((watchers, grace), ([p for p in leftovers if p.pid in servers], 5.0)):
        for p in group:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        for p in _wait_gone(group, grace_s):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # circus made each watcher a session leader: take its children too
        if still := _wait_gone(group, 5.0):
            raise StopTimeoutError(namespace, grace_s + 5.0, [p.pid for p in still])
    for server in (st.embedded_etcd, st.embedded_nats):
        if server is not None:
            remove_server_data(Path(server.data_dir))
    st.status = "stopped"
    write_state(path, st)
    return f"serve (pid {st.serve.pid}) of {namespace} was gone; stopped the {len(leftovers)} processes it left"


def exit_reason(code: int) -> str:
    """``Popen.returncode`` in words: "was killed by SIGKILL", "exited with status 1". 0 reads "exited": a server
    does not exit 0 on its own while serving, and circus's SIGCHLD handler reaps every child of this process, so
    when it reaps the server first, Popen only learns that it is gone (and reports 0)."""
    if code == 0:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def remove_server_data(data_dir: Path) -> None:
    """Everything an embedded server stored (etcd's data and WAL, JetStream's store), not its log files."""
    if not data_dir.is_dir():
        return
    for child in data_dir.iterdir():
        if ".log" in child.name:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                child.unlink()


def _wait_gone(procs: list[ProcessRecord], timeout_s: float) -> list[ProcessRecord]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if p.alive()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if p.alive()]
    return alive
