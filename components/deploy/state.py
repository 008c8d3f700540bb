"""State files: what a local deployment (``kvmesh serve``) runs, for ``stop``, ``logs``, ``status`` and the planner.

``<state_dir>/<namespace>.json`` is one ``ServeState``: the serve process, the circus controller endpoint, the
etcd/NATS endpoints, the frontend URL, and per watcher its command, the environment kvmesh set, its GPUs, its log and
its processes. It is rewritten whenever something changes, always atomically (a temporary file in the same directory,
fsync, ``os.replace``), so a reader never sees half a file. Logs go to ``<state_dir>/logs/<watcher>.log``.

A process is recorded as (pid, create_time): a pid alone may have been reused by an unrelated process by the time
someone reads the file; the pair identifies one process for its whole life.

The state directory is ``--state-dir``, else ``$KVMESH_STATE_DIR``, else ``./state``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from components.deploy.errors import StateError

STATE_DIR_ENV = "KVMESH_STATE_DIR"
DEFAULT_STATE_DIR = "state"
STATE_VERSION = 1


def resolve_state_dir(flag: str | os.PathLike[str] | None = None) -> Path:
    """``--state-dir``, else ``$KVMESH_STATE_DIR``, else ``./state``; absolute, so a detached child finds the same."""
    chosen = flag if flag else os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR
    return Path(chosen).expanduser().resolve()


def state_path(state_dir: Path, namespace: str) -> Path:
    return state_dir / f"{namespace}.json"


def log_dir(state_dir: Path) -> Path:
    return state_dir / "logs"


def log_path(state_dir: Path, name: str) -> Path:
    return log_dir(state_dir) / f"{name}.log"


def serve_log_name(namespace: str) -> str:
    # A '.' cannot appear in a watcher name (graph.py), so this never collides with a watcher's log.
    return f"{namespace}.serve"


class ProcessRecord(BaseModel):
    """One process, identified for its whole life (a pid may be reused after it exits)."""

    model_config = ConfigDict(extra="forbid")

    pid: int = Field(description="Process id.")
    create_time: float = Field(description="psutil's create_time: seconds since the epoch, as the kernel reports it.")

    @classmethod
    def of(cls, pid: int) -> ProcessRecord:
        return cls(pid=pid, create_time=psutil.Process(pid).create_time())

    def alive(self) -> bool:
        """True while this very process runs (not a zombie, not a newer process with the same pid)."""
        try:
            p = psutil.Process(self.pid)
            # create_time is derived from the boot time and the start tick; two reads of one process agree to
            # far better than 10 ms, two processes that share a pid started at least a pid-wrap apart.
            return abs(p.create_time() - self.create_time) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


WatcherKind = Literal["frontend", "worker", "planner", "rescheduler"]


class WatcherState(BaseModel):
    """One circus watcher: the frontend, one worker replica, the planner or the rescheduler."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Watcher name: '<namespace>-frontend', '<namespace>-<group>-<replica>', ...")
    kind: WatcherKind = Field(description="What the watcher runs.")
    group: str | None = Field(default=None, description="Worker group name (workers only).")
    replica: int | None = Field(default=None, description="Replica index within the group (workers only).")
    component: str | None = Field(default=None, description="Component the workers register under (workers only).")
    model: str | None = Field(default=None, description="Served model name of its workers (workers only).")
    role: str | None = Field(
        default=None, description="Its workers' role: aggregated, prefill or decode (workers only)."
    )
    num_workers: int = Field(default=0, description="Workers this watcher registers in etcd once ready.")
    cmd: list[str] = Field(description="argv.")
    env: dict[str, str] = Field(
        description="Environment kvmesh set on top of its own (endpoints, GPUs, graph env); secrets redacted."
    )
    gpus: list[str] = Field(default_factory=list, description="CUDA_VISIBLE_DEVICES given to it, in order.")
    log: str = Field(description="Where its stdout and stderr go.")
    graceful_timeout_s: float = Field(description="SIGTERM, then SIGKILL after this long.")
    processes: list[ProcessRecord] = Field(default_factory=list, description="Its live processes, last we looked.")
    added: bool = Field(
        default=False,
        description="Added after start-up through the circus controller (by the planner, or by hand), not planned "
        "from the graph; what is known of it was read from circus.",
    )
    startup_s: float | None = Field(
        default=None,
        description="Workers only: seconds from its first process's start to all of its workers registered in etcd, "
        "as kvmesh serve saw it while starting the deployment (the SLA planner's start-up lead reads it); None: "
        "not seen (added later, or not registered yet).",
    )


class ServerState(BaseModel):
    """An embedded etcd or nats-server started by kvmesh serve."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="Client URL.")
    process: ProcessRecord | None = Field(default=None, description="Its process while it runs.")
    data_dir: str = Field(description="Data directory (wiped at start).")
    log: str = Field(description="Its own log file.")
    restarts: int = Field(default=0, description="How often kvmesh serve restarted it after it exited.")
    last_exit: str = Field(default="", description="When and how it last exited, e.g. '... was killed by SIGKILL'.")


class CircusState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="circus controller (zmq): add/rm/list watchers with circus.client.CircusClient.")
    pubsub_endpoint: str = Field(description="circus event publisher (zmq).")


ServeStatus = Literal["starting", "ready", "stopping", "stopped", "failed"]


class ServeState(BaseModel):
    """Everything a local deployment is running; written by ``kvmesh serve``, read by everything else."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(default=STATE_VERSION, description="State file format version.")
    namespace: str = Field(description="The graph's namespace.")
    graph: str = Field(description="Absolute path of the graph file served.")
    overrides: list[str] = Field(default_factory=list, description="--set overrides applied to it.")
    status: ServeStatus = Field(description="starting, ready, stopping, stopped or failed.")
    reason: str = Field(default="", description="Why it failed, when it did.")
    serve: ProcessRecord = Field(description="The kvmesh serve process (the circus arbiter); SIGTERM stops it all.")
    started_at: float = Field(description="When serve started, seconds since the epoch.")
    updated_at: float = Field(default_factory=time.time, description="When this file was last written.")
    serve_log: str | None = Field(default=None, description="serve's own output, when detached.")
    etcd_endpoints: list[str] = Field(description="etcd client URLs every component uses.")
    nats_url: str = Field(description="NATS URL every component uses.")
    embedded_etcd: ServerState | None = Field(default=None, description="The embedded etcd, if any.")
    embedded_nats: ServerState | None = Field(default=None, description="The embedded nats-server, if any.")
    frontend_url: str | None = Field(default=None, description="Where the frontend listens.")
    circus: CircusState | None = Field(default=None, description="The arbiter's endpoints, once it runs.")
    gpus_available: list[str] = Field(default_factory=list, description="GPUs found at start (nvidia-smi order).")
    watchers: list[WatcherState] = Field(default_factory=list, description="Every watcher, frontend first.")

    def all_processes(self) -> list[ProcessRecord]:
        """Every process this deployment started, serve itself first."""
        out = [self.serve]
        out += [p for w in self.watchers for p in w.processes]
        out += [s.process for s in (self.embedded_etcd, self.embedded_nats) if s and s.process]
        return out

    def watcher(self, name: str) -> WatcherState | None:
        return next((w for w in self.watchers if w.name == name), None)


def write_state(path: Path, state: ServeState) -> None:
    """Replace ``path`` with ``state`` atomically: readers see the old file or the new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state.updated_at = time.time()
    data = state.model_dump_json(indent=2).encode() + b"\n"
    # The temporary file must be in the same directory: os.replace is atomic only within one filesystem.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_state(path: Path) -> ServeState:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StateError(path, "no such state file (is the namespace served from this state dir?)") from None
    except OSError as e:
        raise StateError(path, f"cannot read: {e.strerror or e}") from None
    try:
        return ServeState.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as e:
        raise StateError(path, f"not a kvmesh state file: {e}") from None


def live_states(state_dir: Path) -> list[ServeState]:
    """State files in ``state_dir`` whose serve process still runs (unreadable or stale files are skipped)."""
    out = []
    for p in sorted(state_dir.glob("*.json")):
        with contextlib.suppress(StateError):
            st = read_state(p)
            if st.serve.alive():
                out.append(st)
    return out
