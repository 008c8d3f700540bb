"""Several frontend processes on one port: ``kvmesh frontend --replicas N`` (``frontend.replicas: N`` in a graph).

One Python process relays every token of every stream on one event loop; at a few hundred streamed requests/s it
is the bottleneck, and new requests wait behind streaming work (their TTFT grows while a core is idle). ``Replicas``
is a small supervisor that runs N ordinary ``kvmesh frontend`` processes instead, each with ``--replicas 1
--reuse-port`` on the same port, and owns nothing else (no mesh connection, no HTTP):

- **One port, N acceptors: SO_REUSEPORT.** Every replica binds and listens on the port itself; the kernel spreads
  incoming connections over the listening sockets by a hash of the connection's addresses. Chosen over one
  acceptor handing sockets over (an extra hop and a process that must keep up with every connection) and over one
  inherited listening socket that every replica accepts from (libuv accepts every pending connection in one go, so
  a burst of connections, such as a client pool opening, lands on whichever replica woke first; the hash spreads
  them evenly whoever is busy). A connection stays with its replica: a client with one keep-alive connection talks
  to one replica, a pool of connections to all of them. The port is checked and, when 0, chosen here first (a
  socket bound with SO_REUSEPORT and never listened on holds it until the replicas listen; the kernel sends no
  connection to a socket that does not listen).
- **Routing state, shared as the standalone router's replicas share it**: the replicas run with
  ``router_replica_sync`` when the policy reads in-flight counts (every policy but round robin and random;
  ``RoutingPolicy.uses_inflight``; an explicit ``--router-replica-sync``/``--no-router-replica-sync`` wins), so
  each counts the requests in flight that the others placed (components/router/feed.py); each follows the workers'
  KV events itself, so every replica's KV index holds the same blocks and a repeated prefix goes to its holder
  whichever replica takes it.
- **/metrics, whichever replica answers**: prometheus_client's multiprocess mode. The replicas get
  ``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory, removed at the end); each writes its counters, histograms and
  gauges there, and a scrape of any replica sums all of them (``inflight`` as the sum over live replicas). A
  replica that exits is marked dead there (its gauges leave the sum, its counts stay).
- **Life**: ``READY http://host:port`` once every replica printed its own; SIGTERM/SIGINT is passed on to every
  replica, which drains (``shutdown_timeout_s``) and exits, then ``STOPPED``. A replica that dies after start-up is
  started again (after 0.5 s, doubling up to 8 s); ``MAX_CRASHES`` deaths in a row, each within
  ``CRASH_WINDOW_S`` of its start, end the frontend with ``DEAD``, as does any replica that exits before it was
  ready. The replicas stay in this process group (not a session of their own: that would put each in its own
  scheduler autogroup) and receive SIGTERM should this process die without passing it on (Linux's parent-death
  signal), so ``kvmesh stop`` ends all of them either way.

Imports: the standard library, prometheus_client's multiprocess helpers, the frontend's config and the flags kit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from components.frontend.config import FrontendConfig
from components.router import make_policy
from components.runtime import eventloop
from components.runtime.config import RuntimeConfig
from components.runtime.flags import argv_for, given_values

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable, read when it is imported
REPLICA_ENV = "KVMESH_FRONTEND_REPLICA"  # the replica's index, for its process name, logs and /health
REPLICAS_ENV = "KVMESH_FRONTEND_REPLICAS"  # how many replicas share the port, for /health
API_KEY_ENV = "KVMESH_API_KEY"
MAX_CRASHES = 5
CRASH_WINDOW_S = 60.0
RESTART_DELAY_S = (0.5, 8.0)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM this process when its parent dies (the supervisor was SIGKILLed)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``(host, port)`` with SO_REUSEPORT (port 0: a free one), never listening: it says now
    whether the port is free and holds it until the replicas listen on it beside it. Raises ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def replica_argv(
    cfg: FrontendConfig, args: argparse.Namespace, port: int, log_level: str, python: str = sys.executable
) -> list[str]:
    """The command line of one replica: this frontend's given settings, on ``port``, with ``--replicas 1
    --reuse-port`` and replica sync (unless switched off explicitly). The API key goes through the environment."""
    values = {k: getattr(cfg, k) for k in sorted(cfg.model_fields_set) if k != "api_key"}
    # Shared in-flight counts for a policy that reads them; round robin and random read none, and would only pay.
    values.setdefault("router_replica_sync", make_policy(cfg).uses_inflight)
    values |= {"port": port, "replicas": 1, "reuse_port": True}
    runtime = argv_for(given_values(RuntimeConfig, args))
    return [python, "-m", "components.cli.main", "--log-level", log_level, "frontend", *runtime, *argv_for(values)]


class _Replica:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.started_s = 0.0
        self.crashes = 0  # deaths in a row, each soon after its start
        self.reader: asyncio.Task[None] | None = None


class Replicas:
    """Runs ``num`` frontend processes on one port until told to stop (module docstring)."""

    def __init__(
        self,
        cfg: FrontendConfig,
        num: int,
        argv: Callable[[int], list[str]],
        *,
        multiproc_dir: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.num = num
        self._argv = argv
        self.multiproc_dir = multiproc_dir or tempfile.mkdtemp(prefix="kvmesh-frontend-metrics-")
        self.replicas = [_Replica(i) for i in range(num)]
        self.port = 0
        self.url = ""
        self._died: asyncio.Queue[_Replica] = asyncio.Queue()

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.replicas if r.proc is not None and r.proc.returncode is None]

    async def _spawn(self, r: _Replica) -> None:
        env = os.environ | {MULTIPROC_ENV: self.multiproc_dir, REPLICA_ENV: str(r.index), REPLICAS_ENV: str(self.num)}
        if self.cfg.api_key:
            env[API_KEY_ENV] = self.cfg.api_key
        r.ready.clear()
        r.proc = await asyncio.create_subprocess_exec(
            *self._argv(self.port), env=env, stdout=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent
        )
        r.started_s = time.monotonic()
        r.reader = asyncio.create_task(self._read(r, r.proc), name=f"frontend-replica-{r.index}")

    async def _read(self, r: _Replica, proc: asyncio.subprocess.Process) -> None:
        """The replica's stdout (READY, then its last line), then its exit."""
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line.startswith("READY"):
                r.ready.set()
            elif line:
                logger.info("replica %d (pid %d): %s", r.index, proc.pid, line)
        await proc.wait()
        self._died.put_nowait(r)

    async def start(self) -> str:
        """Start every replica; return the URL once all of them listen. Raises ``RuntimeError`` when one exits
        first (its log is this process's stderr), ``OSError`` when the port is taken."""
        cfg = self.cfg
        holder = reserve_port(cfg.host, cfg.port)
        try:
            self.port = holder.getsockname()[1]
            for r in self.replicas:
                await self._spawn(r)
            waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(r.ready.wait()) for r in self.replicas}
            died: asyncio.Future[Any] = asyncio.ensure_future(self._died.get())
            try:
                pending = set(waits)
                while pending:
                    done, pending = await asyncio.wait(pending | {died}, return_when=asyncio.FIRST_COMPLETED)
                    if died in done:
                        r = died.result()
                        code = r.proc.returncode if r.proc is not None else None
                        raise RuntimeError(f"frontend replica {r.index} exited ({code}) before it was ready")
                    pending.discard(died)
            finally:
                for w in (*waits, died):
                    w.cancel()
        finally:
            holder.close()
        host = cfg.host if ":" not in cfg.host else f"[{cfg.host}]"
        self.url = f"http://{host}:{self.port}"
        logger.info("%d frontend replicas listening on %s (pids %s)", self.num, self.url, self.pids())
        return self.url

    async def run(self, stop: asyncio.Event) -> tuple[int, str]:
        """Restart replicas that die until ``stop`` is set (or one crashes too often); returns (exit code, line)."""
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while True:
                died = asyncio.ensure_future(self._died.get())
                done, _ = await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
                if stopped in done:
                    died.cancel()
                    return 0, "STOPPED"
                r = died.result()
                self._mark_dead(r)
                code = r.proc.returncode if r.proc is not None else None
                lived_s = time.monotonic() - r.started_s
                r.crashes = r.crashes + 1 if lived_s < CRASH_WINDOW_S else 1
                if r.crashes >= MAX_CRASHES:
                    return 1, f"DEAD frontend replica {r.index} exited {r.crashes} times in a row (last: {code})"
                delay = min(RESTART_DELAY_S[0] * 2 ** (r.crashes - 1), RESTART_DELAY_S[1])
                logger.warning("frontend replica %d exited (%s) after %.1f s; starting it again in %.1f s",
                               r.index, code, lived_s, delay)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()
                if stop.is_set():
                    return 0, "STOPPED"
                await self._spawn(r)
        finally:
            stopped.cancel()

    def _mark_dead(self, r: _Replica) -> None:
        if r.proc is None:
            return
        from prometheus_client import multiprocess  # only the supervisor needs it, after start-up

        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(r.proc.pid, self.multiproc_dir)

    async def stop(self) -> None:
        """SIGTERM every replica, wait for them to drain (``shutdown_timeout_s`` + 10 s, then SIGKILL), clean up."""
        procs = [r.proc for r in self.replicas if r.proc is not None and r.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        grace_s = self.cfg.shutdown_timeout_s + 10.0
        try:
            async with asyncio.timeout(grace_s):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    logger.warning("frontend replica pid %d did not stop within %.0f s: killing it", p.pid, grace_s)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        readers = [r.reader for r in self.replicas if r.reader is not None]
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        shutil.rmtree(self.multiproc_dir, ignore_errors=True)


async def _main(cfg: FrontendConfig, num: int, args: argparse.Namespace) -> int:
    stop = eventloop.stop_on_signals()
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    replicas = Replicas(cfg, num, lambda port: replica_argv(cfg, args, port, str(level)))
    code, last = 1, "STOPPED"
    try:
        try:
            url = await replicas.start()
        except (RuntimeError, OSError) as e:
            print(f"DEAD {e}", flush=True)
            return 1
        print(f"READY {url}", flush=True)
        code, last = await replicas.run(stop)
    finally:
        await replicas.stop()
    print(last, flush=True)
    return code


def run_replicas(cfg: FrontendConfig, num: int, args: argparse.Namespace) -> int:
    """``kvmesh frontend --replicas N`` (N > 1): run the supervisor until SIGTERM/SIGINT; returns the exit code."""
    return eventloop.run(_main(cfg, num, args))
