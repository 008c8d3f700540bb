"""Typed errors of deployments: graph files, state files, the local launcher.

``DeployError`` is the root; the command line prints any of them as one readable message and exits with its
``exit_code``, without a traceback. Every error carries the fields a caller (or a test) needs: the file, the field
path, the namespace, the watcher.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


class DeployError(Exception):
    """Root of every error raised by ``components.deploy``. ``exit_code`` is what ``kvmesh`` exits with."""

    exit_code = 1


@dataclasses.dataclass(frozen=True, slots=True)
class GraphProblem:
    """One thing wrong with a graph file: where (``loc``, e.g. ``workers[0].replicas``; ``line`` when known) and why."""

    loc: str
    message: str
    line: int | None = None  # 1-based line in the graph file; None for values given with --set
    source: str = ""  # "--set" when the value came from a command-line override

    def render(self, path: Path) -> str:
        where = f"{path}:{self.line}" if self.line else str(path)
        origin = f" (from {self.source})" if self.source else ""
        field = f"{self.loc}: " if self.loc else ""
        return f"{where}: {field}{self.message}{origin}"


class GraphError(DeployError):
    """A graph file that cannot be served: unreadable, not YAML, or not valid against the schema.

    The message lists every problem, each naming the file, the line where known, the field path and what is allowed.
    """

    exit_code = 2

    def __init__(self, path: Path, problems: list[GraphProblem]) -> None:
        self.path = path
        self.problems = problems
        lines = [p.render(path) for p in problems]
        head = f"invalid graph {path}" + (f" ({len(problems)} problems)" if len(problems) > 1 else "")
        super().__init__(head + ":\n  " + "\n  ".join(lines))


class OverrideError(DeployError):
    """A ``--set PATH=VALUE`` override that does not parse or names no place in the graph."""

    exit_code = 2

    def __init__(self, override: str, reason: str) -> None:
        super().__init__(f"--set {override}: {reason}")
        self.override = override
        self.reason = reason


class StateError(DeployError):
    """A state file that is missing, unreadable, or describes something that cannot be acted on."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class AlreadyServingError(DeployError):
    """The namespace (or one of its watcher names, which name the log files) is already served from this state dir."""

    def __init__(self, namespace: str, pid: int, detail: str) -> None:
        super().__init__(f"namespace {namespace!r} is already served by pid {pid}: {detail}")
        self.namespace = namespace
        self.pid = pid


class WatcherClashError(DeployError):
    """Another live deployment in the same state dir runs watchers of the same names (they name the log files)."""

    def __init__(self, namespace: str, other_namespace: str, other_pid: int, watchers: list[str], logs: Path) -> None:
        super().__init__(
            f"namespace {namespace!r} cannot start: its watchers {watchers} would share their log files in {logs} "
            f"with those of namespace {other_namespace!r} (kvmesh serve pid {other_pid}), which runs from the same "
            "state dir; rename the worker group, or use another --state-dir"
        )
        self.namespace = namespace
        self.other_namespace = other_namespace
        self.watchers = watchers


class NotServingError(DeployError):
    """``kvmesh stop``/``logs`` named a namespace or watcher that is not served from this state dir."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what = what


class GpuAssignmentError(DeployError):
    """The graph asks for more GPUs than this machine shows."""

    def __init__(self, needed: int, available: list[str], detail: str) -> None:
        have = ",".join(available) if available else "none"
        super().__init__(f"the graph needs {needed} GPUs, this machine has {len(available)} ({have}): {detail}")
        self.needed = needed
        self.available = available


class PortInUseError(DeployError):
    """The frontend's port cannot be bound (another process listens there)."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        super().__init__(
            f"frontend.port {port} on {host} cannot be bound ({reason}); free it, or pick another with "
            "--set frontend.port=PORT (0: a free one)"
        )
        self.host = host
        self.port = port


class StartupError(DeployError):
    """A component failed while the deployment was coming up (it exited, or crashed and was restarted)."""

    def __init__(self, watcher: str, reason: str, log_tail: str = "") -> None:
        tail = f"\n--- last lines of its log ---\n{log_tail}" if log_tail else ""
        super().__init__(f"{watcher}: {reason}{tail}")
        self.watcher = watcher
        self.reason = reason


class ReadyTimeoutError(DeployError, TimeoutError):
    """The deployment was not ready (workers registered, frontend healthy) within ``ready_timeout_s``."""

    def __init__(self, timeout_s: float, waiting_for: list[str]) -> None:
        super().__init__(f"not ready after {timeout_s:g} s; still waiting for: {', '.join(waiting_for)}")
        self.timeout_s = timeout_s
        self.waiting_for = waiting_for


class StopTimeoutError(DeployError, TimeoutError):
    """``kvmesh stop`` gave up waiting for processes to exit."""

    def __init__(self, namespace: str, timeout_s: float, pids: list[int]) -> None:
        super().__init__(
            f"namespace {namespace!r}: processes {pids} still running {timeout_s:g} s after the stop request"
        )
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.pids = pids


class CircusError(DeployError):
    """A command to a deployment's circus arbiter (its controller on ``endpoint``) failed."""

    def __init__(self, endpoint: str, command: str, reason: str) -> None:
        super().__init__(f"circus at {endpoint}: {command}: {reason}")
        self.endpoint = endpoint
        self.command = command
        self.reason = reason


class CircusUnreachableError(CircusError, TimeoutError):
    """The arbiter did not answer within the client's timeout: ``kvmesh serve`` is gone, stuck or stopping."""


class CircusCommandError(CircusError):
    """The arbiter answered with an error (no such watcher, a name already taken, a bad option, still busy with
    another command after the wait)."""
