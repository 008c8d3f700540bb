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

circus is imported lazily: importing it calls ``logging.basicConfig()``, which would otherwise configure logging
before ``kvmesh --log-level`` does.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from components.deploy.plan import WatcherPlan
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


class CircusLauncher:
    """A circus arbiter in the running asyncio loop, its controller and publisher on free loopback ports."""

    def __init__(self, *, check_delay_s: float = 1.0, proc_name: str = "kvmesh-serve") -> None:
        self.check_delay_s = check_delay_s
        self.proc_name = proc_name
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pubsub_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._arbiter: Any = None

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
