"""The ``local`` environment: the planner resizes a deployment that ``kvmesh serve`` runs on this machine, through the
circus arbiter serve started (its controller endpoint is in ``<state_dir>/<namespace>.json``).

What a pool is, here
--------------------
A pool is the watchers of the state file whose workers serve the planner's model in the pool's roles (decode pool:
``decode`` or ``aggregated``; prefill pool: ``prefill``), in the state file's order (serve's graph order, then
watchers added later). Its size is the workers its *active* watchers run (``num_workers`` each, as circus reports the
watcher ``active``); a watcher circus stopped (it crash-looped, or a previous planner had it leave) runs none.
``set_pool_size(pool, n)`` sets that size: nothing when it is ``n`` already; otherwise whole watchers are added
(until the pool has at least ``n`` workers) or removed (until it has at most ``n``), one at a time. With one worker per
watcher (every vLLM group, and the example graphs) that is exactly ``n``.

The pool's *first* watcher (its first in the state file: replica 0 of its first group, unless a person removed that)
is the template and is never removed: the command to start another is always known.

Adding a worker
---------------
A new watcher named as serve names replicas, ``<namespace>-<group>-<i>`` with the smallest free ``i``, runs the
template's command with the template's environment (kvmesh's part of it, from the state file, on top of serve's own:
circus ``copy_env``), its own ``CUDA_VISIBLE_DEVICES`` when the group uses GPUs (``len(template.gpus)`` of the
devices in ``gpus_available`` that no watcher of the state file holds) and its own log,
``<state_dir>/logs/<watcher>.log``. ``set_pool_size`` returns once its workers have registered in etcd (the rule
serve's readiness uses: ``registered_workers_by_pid``) and serve's state file records it. A watcher whose process
exits more than twice before that, or that circus gives up on, fails the change with the tail of its log
(``WorkerStartError``); none registered within ``scaling_timeout_s``: ``ScalingTimeoutError``. Either way the watcher
is retired again (below), so a failed change leaves the fleet as it was.

Removing a worker
-----------------
The victim is the pool's last active watcher (never the template). In this order:

1. SIGTERM to its process (circus ``signal``), first, a few ms after the decision: the worker says at once that it
   takes no new requests (``worker_status``, reason ``draining``), so routers send it nothing from then on, and
   drains: a decode worker finishes its requests in flight (its ``generate`` stays registered meanwhile), a prefill
   worker finishes, delivers and acks the queue item in hand (components/workers/disagg.py), then it exits 0. When a
   rescheduler runs (standalone, colocated or a graph's ``rescheduler:`` section), its failover policy moves the
   draining worker's requests to the others and the drain ends as soon as the last one has left: migration-assisted
   scale-down, seconds sooner with long outputs (docs/rescheduler.md). Without one it waits for them;
2. the ``before_spawn`` hook ``refuse_spawn`` on the watcher, so circus does not replace the process when it exits
   (one it replaced in the few ms before the hook was in place is sent SIGTERM too);
3. wait for the process to exit, up to the watcher's ``graceful_timeout_s`` (then SIGKILL, as circus itself would);
4. only then ``rm`` the watcher (nothing left to stop: circus's exclusive command lock is held for milliseconds, never
   for a drain); serve's next state refresh drops it, which ``set_pool_size`` waits for.

Nothing else is touched: no other watcher is signalled, stopped or restarted (Dynamo's issue #985: removing one
worker took the whole deployment down).

Serialised, restartable, hand-edited
------------------------------------
Circus runs one exclusive command at a time: this connector runs one change at a time (an ``asyncio.Lock`` across
pools) and ``CircusController`` retries circus's "already running" refusals (its own periodic check, a person's
circusctl). Nothing is remembered between calls: each reads the state file (which only serve writes, atomically,
within ``server_check_interval_s`` of any change, whoever made it) and asks circus what runs. So a planner restarted
mid-way finds the fleet as it is: a watcher it was adding is counted (and registers or fails by itself); one it was
removing exits by itself, circus stops it (the hook), and the next change removes the stopped watcher first. A
watcher a person added (``circusctl add``; named as serve names replicas, or any name whose command is a ``kvmesh
worker`` of the model) or removed by hand is where the next change starts from, never something it reverts.

Errors: every failure is a ``ConnectorError`` (the loop logs it and decides again at a later interval):
``DeploymentUnavailableError`` (no state file, serve gone or not ``ready``, circus not answering, the state file not
updated), ``CircusCommandFailedError`` (circus refused a command), ``NoFreeGpuError``, ``WorkerStartError``,
``ScalingTimeoutError``, ``NothingToScaleError`` (no watcher of the model in the pool's roles; only the template
left), ``RegistryUnavailableError`` (etcd did not answer while a new worker started).

Imports: the deployment library (``components.deploy``: state, circus, serve's registration rule), the runtime, the
protocol; never ``components.cli``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from components.deploy.circus import CircusController, rotate_log
from components.deploy.errors import CircusError, CircusUnreachableError, StateError
from components.deploy.graph import replica_watcher
from components.deploy.local import registered_workers_by_pid, settled_tail
from components.deploy.plan import REDACTED
from components.deploy.state import ServeState, WatcherState, log_path, read_state, state_path
from components.planner.config import DEFAULT_SCALING_TIMEOUT_S
from components.planner.connectors.base import ConnectorError, ScalingTimeoutError
from components.planner.policy import Pool
from components.protocol.metadata import WorkerRole
from components.runtime import Runtime
from components.runtime.errors import RuntimeMeshError

logger = logging.getLogger(__name__)

NAME = "local"
POOL_ROLES: Mapping[Pool, frozenset[str]] = {
    Pool.DECODE: frozenset({str(WorkerRole.DECODE), str(WorkerRole.AGGREGATED)}),
    Pool.PREFILL: frozenset({str(WorkerRole.PREFILL)}),
}
# A new watcher whose process exited more often than this before its workers registered has failed (serve's own
# max_start_restarts default: a slow first connection deserves another try, a bad flag does not).
MAX_START_RESTARTS = 2
# After SIGKILL, how long the process may take to be gone (the kernel reaps it in milliseconds).
KILL_WAIT_S = 5.0


# --------------------------------------------------------------------------------------------------------------------
# Errors


class DeploymentUnavailableError(ConnectorError):
    """No deployment to change: no state file, serve gone or not ``ready``, circus not answering, or serve did not
    record the change in its state file."""


class CircusCommandFailedError(ConnectorError):
    """The arbiter refused a command (``reason`` is circus's)."""


class NoFreeGpuError(ConnectorError):
    """The pool's group uses GPUs and fewer are free than a new replica needs."""


class WorkerStartError(ConnectorError):
    """A new watcher's process kept exiting before its workers registered; ``log_tail`` says why."""

    def __init__(self, pool: Pool, count: int | None, message: str, log_tail: str = "") -> None:
        tail_text = f"\n--- last lines of its log ---\n{log_tail}" if log_tail else ""
        super().__init__(NAME, pool, count, message + tail_text)
        self.log_tail = log_tail


class NothingToScaleError(ConnectorError):
    """The deployment has no watcher of the model in the pool's roles, or only the pool's first one, which is never
    removed."""


class RegistryUnavailableError(ConnectorError):
    """etcd did not answer while the connector waited for a new worker to register."""


# --------------------------------------------------------------------------------------------------------------------
# Pure: a pool in the state file


@dataclasses.dataclass(frozen=True, slots=True)
class PoolLayout:
    """One pool's watchers as the state file lists them and circus reports them."""

    watchers: tuple[WatcherState, ...]  # in the state file's order, present in circus
    active: tuple[WatcherState, ...]  # circus reports them active
    stopped: tuple[WatcherState, ...]  # circus stopped them: they run nothing
    template: WatcherState | None  # the first watcher: copied to add one, never removed

    @property
    def workers(self) -> int:
        return sum(w.num_workers for w in self.active)


def pool_layout(state: ServeState, statuses: Mapping[str, str], model: str, pool: Pool) -> PoolLayout:
    """``statuses``: circus's, by lower-cased watcher name (a watcher the state file lists but circus no longer
    runs is left out: serve's next refresh drops it)."""
    roles = POOL_ROLES[pool]
    mine = tuple(
        w
        for w in state.watchers
        if w.kind == "worker" and w.model == model and w.role in roles and w.name.lower() in statuses
    )
    active = tuple(w for w in mine if statuses[w.name.lower()] == "active")
    stopped = tuple(w for w in mine if statuses[w.name.lower()] == "stopped")
    return PoolLayout(watchers=mine, active=active, stopped=stopped, template=mine[0] if mine else None)


def watchers_to_add(layout: PoolLayout, target: int) -> int:
    """How many copies of the template bring the pool to at least ``target`` workers."""
    if layout.template is None or target <= layout.workers:
        return 0
    return math.ceil((target - layout.workers) / max(1, layout.template.num_workers))


def watchers_to_remove(layout: PoolLayout, target: int) -> list[WatcherState]:
    """The active watchers to remove, last first, until the pool has at most ``target`` workers; never the
    template."""
    out: list[WatcherState] = []
    workers = layout.workers
    for w in reversed(layout.active):
        if workers <= target:
            break
        if w is layout.template:
            continue
        out.append(w)
        workers -= w.num_workers
    return out


def next_replica(names: Sequence[str], namespace: str, group: str) -> tuple[str, int]:
    """The watcher name (and replica index) serve would give the next replica of ``group``: the smallest index >= 1
    that no watcher uses (compared without case: circus keys watchers by the lower-cased name)."""
    taken = {n.lower() for n in names}
    i = 1
    while replica_watcher(namespace, group, i).lower() in taken:
        i += 1
    return replica_watcher(namespace, group, i), i


def free_gpus(state: ServeState) -> list[str]:
    """The devices found at start that no watcher of the state file holds, in their order."""
    held = {g for w in state.watchers for g in w.gpus}
    return [g for g in state.gpus_available if g not in held]


def new_replica_env(template: WatcherState, gpus: Sequence[str]) -> dict[str, str]:
    """The template's environment (kvmesh's part; serve's own comes from circus's copy_env) with its own GPUs."""
    env = dict(template.env)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


# --------------------------------------------------------------------------------------------------------------------
# The connector


class LocalConnector:
    """Sets pool sizes of the deployment ``kvmesh serve`` runs as ``namespace`` from ``state_dir`` (module
    docstring)."""

    name = NAME

    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        model: str,
        state_dir: Path,
        start_timeout_s: float = DEFAULT_SCALING_TIMEOUT_S,
        poll_s: float = 0.2,
        state_wait_s: float = 10.0,
        circus_timeout_s: float = 5.0,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.model = model
        self.state_dir = state_dir
        self.path = state_path(state_dir, namespace)
        self.start_timeout_s = start_timeout_s
        self.poll_s = poll_s
        self.state_wait_s = state_wait_s
        self.circus_timeout_s = circus_timeout_s
        self._lock = asyncio.Lock()
        self._cached: tuple[int, ServeState] | None = None  # (mtime_ns, state) for gpus_per_worker
        self.num_added = 0
        self.num_removed = 0

    # --- the Connector protocol -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Remove the stopped watchers of both pools (not their templates): a previous planner had them leave and
        stopped before removing them, or circus gave up on them. Nothing else changes; nothing at all while the
        deployment is not ``ready`` (a planner that serve starts starts with it)."""
        async with self._lock:
            for pool in Pool:
                try:
                    st = read_state(self.path)
                    if st.status != "ready" or st.circus is None or not st.serve.alive():
                        return
                    ctl = CircusController(st.circus.endpoint, timeout_s=self.circus_timeout_s)
                    layout = pool_layout(st, await asyncio.to_thread(ctl.statuses), self.model, pool)
                    await self._remove_stopped(pool, None, layout, ctl)
                except (CircusError, StateError) as e:
                    raise DeploymentUnavailableError(NAME, pool, None, f"picking up the fleet: {e}") from e

    async def set_pool_size(self, pool: Pool, count: int) -> None:
        async with self._lock:
            try:
                await self._set(pool, count)
            except ConnectorError:
                raise  # ScalingTimeoutError is a TimeoutError, an OSError: not to be read as a file problem below
            except CircusUnreachableError as e:
                raise DeploymentUnavailableError(NAME, pool, count, str(e)) from e
            except CircusError as e:
                raise CircusCommandFailedError(NAME, pool, count, str(e)) from e
            except StateError as e:
                raise DeploymentUnavailableError(NAME, pool, count, str(e)) from e
            except OSError as e:  # a log file that cannot be rotated, a state dir gone
                raise DeploymentUnavailableError(NAME, pool, count, f"{type(e).__name__}: {e}") from e

    async def pool_size(self, pool: Pool) -> int | None:
        """The workers of the pool's active watchers (``pool_layout``: a watcher a person added or removed with
        circusctl counts as it is); None while the deployment is not ready."""
        try:
            st = read_state(self.path)
            if st.status != "ready" or st.circus is None or not st.serve.alive():
                return None
            ctl = CircusController(st.circus.endpoint, timeout_s=self.circus_timeout_s)
            return pool_layout(st, await asyncio.to_thread(ctl.statuses), self.model, pool).workers
        except (CircusError, StateError, OSError) as e:
            raise DeploymentUnavailableError(NAME, pool, None, f"reading its size: {e}") from e

    def gpus_per_worker(self, pool: Pool) -> int | None:
        """GPUs one replica of the pool's template uses (its group's gpus_per_replica), for the policy's budget; None
        when the state file cannot be read or the pool has no watcher. Read from the state file when it changed."""
        try:
            mtime = self.path.stat().st_mtime_ns
            if self._cached is None or self._cached[0] != mtime:
                self._cached = (mtime, read_state(self.path))
        except (OSError, StateError):
            return None
        roles = POOL_ROLES[pool]
        state = self._cached[1]
        template = next(
            (w for w in state.watchers if w.kind == "worker" and w.model == self.model and w.role in roles), None
        )
        return None if template is None else len(template.gpus)

    async def close(self) -> None:
        """Nothing held between calls: each change reads the state file and asks circus afresh."""

    # --- one change -------------------------------------------------------------------------------------------------

    def _ready_state(self, pool: Pool, count: int) -> ServeState:
        st = read_state(self.path)
        if not st.serve.alive():
            raise DeploymentUnavailableError(
                NAME, pool, count, f"kvmesh serve (pid {st.serve.pid}) of {self.namespace} is not running"
            )
        if st.status != "ready" or st.circus is None:
            raise DeploymentUnavailableError(
                NAME, pool, count, f"deployment {self.namespace} is {st.status}, not ready: nothing is changed"
            )
        return st

    async def _set(self, pool: Pool, count: int) -> None:
        st = self._ready_state(pool, count)
        assert st.circus is not None
        ctl = CircusController(st.circus.endpoint, timeout_s=self.circus_timeout_s)
        layout = pool_layout(st, await asyncio.to_thread(ctl.statuses), self.model, pool)
        if layout.template is None:
            roles = "/".join(sorted(POOL_ROLES[pool]))
            raise NothingToScaleError(
                NAME, pool, count, f"no watcher in {self.path} runs {roles} workers of model {self.model!r}"
            )
        await self._remove_stopped(pool, count, layout, ctl)
        if layout.workers == count:
            logger.debug("%s pool already has %d workers", pool, count)
            return
        if count > layout.workers:
            adds = watchers_to_add(layout, count)
            logger.info(
                "%s pool: %d -> %d workers: adding %d watcher(s) like %s", pool, layout.workers, count, adds,
                layout.template.name,
            )  # fmt: skip
            await self._add_many(pool, count, adds, layout.template, ctl)
            return
        victims = watchers_to_remove(layout, count)
        if not victims:
            raise NothingToScaleError(
                NAME,
                pool,
                count,
                f"only {layout.template.name} ({layout.workers} workers) is left, and a pool's first watcher is "
                "never removed",
            )
        logger.info(
            "%s pool: %d -> %d workers: removing %s", pool, layout.workers, count, ", ".join(v.name for v in victims)
        )
        for victim in victims:
            await self._retire(pool, count, victim, ctl)

    async def _remove_stopped(self, pool: Pool, count: int | None, layout: PoolLayout, ctl: CircusController) -> None:
        for w in layout.stopped:
            if w is not layout.template:
                # Circus stopped it: it crash-looped, or a planner had it leave and stopped before removing it.
                logger.info("%s pool: removing stopped watcher %s (it runs no process)", pool, w.name)
                await asyncio.to_thread(ctl.remove, w.name)
                self.num_removed += 1
                await self._wait_state(pool, count, _without(w.name), f"{w.name} removed")

    async def _add_many(self, pool: Pool, count: int, adds: int, template: WatcherState, ctl: CircusController) -> None:
        """Add ``adds`` watchers at once: names and GPUs are handed out from one reading of the state, then every
        watcher starts and is waited for together, so a step of several workers takes one start-up, not one each
        (the SLA planner asks for several at a time; a vLLM worker starts in ~37 s here). Those the free GPUs allow
        are started; then a shortfall is a ``NoFreeGpuError``, as is the first failure among the started ones."""
        st = self._ready_state(pool, count)
        group = template.group or template.name
        taken = [w.name for w in st.watchers] + await asyncio.to_thread(ctl.watchers)
        need = len(template.gpus)
        free = free_gpus(st)
        plans: list[tuple[str, list[str]]] = []
        short: str | None = None
        for k in range(adds):
            name, _ = next_replica(taken, self.namespace, group)
            taken.append(name)
            gpus = free[k * need : (k + 1) * need]
            if len(gpus) < need:
                short = (
                    f"{name} needs {need} GPUs like {template.name}; free: {','.join(free[k * need :]) or 'none'} "
                    f"of {','.join(st.gpus_available) or 'none'}"
                )
                break
            plans.append((name, gpus))
        results = await asyncio.gather(
            *(self._add(pool, count, template, ctl, name, gpus) for name, gpus in plans), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if short is not None:
            raise NoFreeGpuError(NAME, pool, count, short)

    async def _add(
        self, pool: Pool, count: int, template: WatcherState, ctl: CircusController, name: str, free: list[str]
    ) -> None:
        need = len(free)
        env = new_replica_env(template, free[:need])
        if hidden := sorted(k for k, v in env.items() if v == REDACTED):
            raise NothingToScaleError(
                NAME, pool, count, f"{template.name}'s environment has secrets the state file hides ({hidden})"
            )
        log = log_path(self.state_dir, name)
        log.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(log)
        await asyncio.to_thread(ctl.add, name, template.cmd, env, log, template.graceful_timeout_s)
        self.num_added += 1
        logger.info(
            "%s pool: added watcher %s (copy of %s, GPUs %s, log %s); waiting for its %d worker(s) to register",
            pool, name, template.name, ",".join(free[:need]) or "none", log, template.num_workers,
        )  # fmt: skip
        try:
            await self._wait_registered(pool, count, name, template.num_workers, log, ctl)
        except ConnectorError:
            logger.warning("%s pool: %s did not come up; removing it again", pool, name)
            retired = WatcherState.model_validate(template.model_dump() | {"name": name, "log": str(log)})
            try:
                await self._retire(pool, count, retired, ctl)
            except ConnectorError as e:
                logger.warning("%s pool: removing %s after its failed start: %s", pool, name, e)
            raise
        await self._wait_state(
            pool, count, lambda s: (w := s.watcher(name)) is not None and bool(w.processes), f"{name} recorded"
        )
        logger.info("%s pool: %s is up", pool, name)

    async def _wait_registered(
        self, pool: Pool, count: int, name: str, num_workers: int, log: Path, ctl: CircusController
    ) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        seen: set[int] = set()
        last_error: RuntimeMeshError | None = None
        ns = self.runtime.namespace(self.namespace)
        while True:
            pids = await asyncio.to_thread(ctl.pids, name)
            seen |= set(pids)
            exits = len(seen - set(pids))
            if exits > MAX_START_RESTARTS:
                why = f"{name} exited {exits} times before registering"
                raise WorkerStartError(pool, count, why, await settled_tail(log))
            if not pids and (await asyncio.to_thread(ctl.statuses)).get(name.lower()) == "stopped":
                why = f"circus stopped {name} (it kept crashing)"
                raise WorkerStartError(pool, count, why, await settled_tail(log))
            if pids:
                try:
                    by_pid = registered_workers_by_pid(await ns.list_instances())
                    last_error = None
                    if sum(by_pid.get(p, 0) for p in pids) >= num_workers:
                        return
                except RuntimeMeshError as e:
                    last_error = e
            if time.monotonic() > deadline:
                if last_error is not None:
                    raise RegistryUnavailableError(
                        NAME, pool, count, f"etcd did not answer while {name} started: {last_error}"
                    )
                raise ScalingTimeoutError(NAME, pool, count, self.start_timeout_s)
            await asyncio.sleep(self.poll_s)

    async def _retire(self, pool: Pool, count: int, victim: WatcherState, ctl: CircusController) -> None:
        """SIGTERM, refuse a respawn, wait for the exit (SIGKILL past the graceful timeout), then remove."""
        t0 = time.monotonic()
        pids = await asyncio.to_thread(ctl.pids, victim.name)
        if pids:
            # First, so that the worker leaves etcd (and the router's view) as soon after the decision as it can.
            await asyncio.to_thread(ctl.signal, victim.name, signal.SIGTERM)
        await asyncio.to_thread(ctl.refuse_spawn, victim.name)
        logger.info(
            "%s pool: retiring %s: SIGTERM to pid %s %.0f ms after the change began; waiting up to %g s for it to "
            "drain and exit", pool, victim.name, ",".join(map(str, pids)) or "-", (time.monotonic() - t0) * 1000,
            victim.graceful_timeout_s,
        )  # fmt: skip
        signalled = set(pids)
        deadline = t0 + victim.graceful_timeout_s
        while True:
            pids = await asyncio.to_thread(ctl.pids, victim.name)
            if fresh := [p for p in pids if p not in signalled]:
                # circus replaced the process in the moment before the hook was set: that one leaves too.
                logger.info("%s pool: %s was restarted (pid %s) before it could be held: SIGTERM", pool, victim.name,
                            fresh)  # fmt: skip
                await asyncio.to_thread(ctl.signal, victim.name, signal.SIGTERM)
                signalled |= set(fresh)
            if not [p for p in pids if _alive(p)]:
                break
            if time.monotonic() > deadline:
                logger.warning(
                    "%s pool: %s still runs %g s after SIGTERM: SIGKILL", pool, victim.name, victim.graceful_timeout_s
                )
                await asyncio.to_thread(ctl.signal, victim.name, signal.SIGKILL, True)
                deadline = time.monotonic() + KILL_WAIT_S
                victim = victim.model_copy(update={"graceful_timeout_s": KILL_WAIT_S})
                continue
            await asyncio.sleep(self.poll_s)
        await asyncio.to_thread(ctl.remove, victim.name)
        self.num_removed += 1
        await self._wait_state(pool, count, _without(victim.name), f"{victim.name} removed")
        logger.info("%s pool: %s drained, exited and removed in %.1f s", pool, victim.name, time.monotonic() - t0)

    async def _wait_state(self, pool: Pool, count: int | None, done: Callable[[ServeState], bool], what: str) -> None:
        """Until serve's state file shows the change (it refreshes within a fraction of a second)."""
        deadline = time.monotonic() + self.state_wait_s
        while True:
            try:
                if done(read_state(self.path)):
                    return
            except StateError:
                pass  # mid-replace on a filesystem without atomic rename, or gone: the deadline decides
            if time.monotonic() > deadline:
                raise DeploymentUnavailableError(
                    NAME, pool, count, f"kvmesh serve did not record the change ({what}) in {self.path} within "
                    f"{self.state_wait_s:g} s",
                )  # fmt: skip
            await asyncio.sleep(0.05)


def _without(name: str) -> Callable[[ServeState], bool]:
    return lambda st: st.watcher(name) is None


def _alive(pid: int) -> bool:
    """The process runs (not a zombie waiting for circus to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


__all__ = [
    "CircusCommandFailedError",
    "DeploymentUnavailableError",
    "LocalConnector",
    "NoFreeGpuError",
    "NothingToScaleError",
    "PoolLayout",
    "RegistryUnavailableError",
    "WorkerStartError",
    "free_gpus",
    "next_replica",
    "pool_layout",
    "watchers_to_add",
    "watchers_to_remove",
]
