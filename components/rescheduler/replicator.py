"""``LiveReplicator``: hot-prefix replication run by the rescheduler's loop (loop.py), when ``prefix_replication`` is
among ``--rescheduling-policies``. All of its I/O around the pure policy (policies/replication.py).

Its inputs, kept current by a view of its own (the same in a standalone ``kvmesh rescheduler`` and colocated in a
frontend, which may route with no KV index at all):

- a ``Router`` with a ``kv`` config over a ``LiveFleet`` (``RouterFeed``: the workers' registrations, their load
  reports and statuses, and their KV events, with the router's resync of a worker's ``kv_state`` on a gap or a
  join): the router's KV index says which workers hold a prefix. The router routes nothing here;
- the same fleet view follows the frontends' request reports (``request_stats``), whose ``prefixes`` say which
  prefixes requests carried and how many (a frontend reports them with ``--request-stats-prefixes``);
- each cycle, replication_inputs.py turns the view's snapshot into the policy's ``PrefixLoad``s and
  ``WorkerLoad``s (predicted TTFT: the perf package's queueing wait, the router's ``kv`` cost model, on each
  worker's load report), per model.

``cycle(now_s)`` runs ``plan_replication`` per model and carries its actions out concurrently, each under the call
timeout: a copy through the destination's ``import_prefix`` (``copy_prefix``), then ``copy_finished`` with its
outcome; a drop through the holder's ``drop_prefix`` (``drop_prefix``). A failed or timed-out call is counted and
the others go on. The policy drops only replicas it made; their block hashes are kept here from the copy, as the
reports may no longer name a prefix that went cold.

Owns: the router's feed and fleet view, the two endpoint clients; released by ``stop()``, each in its own try.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from components.fleet.live import LiveFleet
from components.rescheduler.config import ReplicationConfig
from components.rescheduler.policies.replication import (
    ActionKind,
    PrefixLoad,
    Replica,
    ReplicationAction,
    ReplicationState,
    copy_finished,
    drop_failed,
    plan_replication,
)
from components.rescheduler.replication import copy_prefix, drop_prefix, drop_prefix_client, import_prefix_client
from components.rescheduler.replication_inputs import prefix_loads, worker_loads
from components.router import Router, RouterConfig
from components.router.feed import RouterFeed
from components.runtime import Client, Runtime, RuntimeMeshError

logger = logging.getLogger(__name__)


class ActionOutcome(enum.StrEnum):
    SUCCEEDED = "succeeded"  # copied (the destination's reply had no error) / dropped
    FAILED = "failed"  # the call raised, or the worker's reply said why it did nothing
    TIMED_OUT = "timed_out"  # no reply within the call timeout


@dataclasses.dataclass(frozen=True, slots=True)
class ActionResult:
    """One copy or drop as it ran: the policy's action, its model, how it ended and what the worker said."""

    model: str
    action: ReplicationAction
    outcome: ActionOutcome
    detail: str
    blocks: int  # blocks imported (copy) or evicted (drop)
    duration_s: float
    # The prefix's blocks as sent (a drop of a prefix no longer reported has no length in its action).
    prefix_blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        a = self.action
        return {
            "kind": str(a.kind),
            "model": self.model,
            "prefix": f"{a.prefix_hash:x}",
            "num_blocks": self.prefix_blocks or a.num_blocks,
            "source": a.source_id,
            "destination": a.destination_id,
            "reason": a.reason,
            "outcome": str(self.outcome),
            "detail": self.detail,
            "blocks": self.blocks,
            "duration_s": round(self.duration_s, 4),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicationCycle:
    results: tuple[ActionResult, ...] = ()
    skipped: tuple[str, ...] = ()  # hot prefixes that got no copy, and why (the policy's)


class LiveReplicator:
    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        component: str,
        config: ReplicationConfig,
        *,
        call_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.component = component
        self.config = config
        self.call_timeout_s = call_timeout_s
        self.clock = clock
        # kv with events: the index is fed by the workers' KV events (not the approximate, routed-request one).
        self.router = Router(RouterConfig(router_policy="kv", router_kv_events=True))
        self.fleet = LiveFleet(
            runtime,
            namespace,
            state=self.router.fleet,
            watch_membership=False,  # the feed sets the members from the generate registrations
            follow_queues=False,
            follow_requests=True,
            clock=clock,
        )
        self.feed = RouterFeed(runtime, self.router, namespace, [component], watch_workers=True, fleet=self.fleet)
        self.states: dict[str, ReplicationState] = {}
        # (model, prefix name) -> its chained block hashes, for the replicas this policy made (a drop names them).
        self._chains: dict[tuple[str, int], tuple[int, ...]] = {}
        # (model, prefix name, worker) -> the replica a drop now running released from the state, with its hashes:
        # restored when the drop fails (``drop_failed``), so a cold replica is never forgotten while it still holds KV.
        self._dropping: dict[tuple[str, int, int], tuple[Replica, tuple[int, ...]]] = {}
        self._import: Client | None = None
        self._drop: Client | None = None
        self.last_skipped: list[str] = []
        self.last_prefixes: list[PrefixLoad] = []  # the last cycle's, all models (status, tests)

    async def start(self) -> None:
        await self.feed.start()
        self._import = await import_prefix_client(self.runtime, self.namespace, self.component)
        self._drop = await drop_prefix_client(self.runtime, self.namespace, self.component)

    async def stop(self) -> None:
        try:
            await self.feed.stop()
        except Exception as e:  # noqa: BLE001 - release the rest
            logger.warning("stopping the replicator's router feed: %s", e)
        for client in (self._import, self._drop):
            if client is None:
                continue
            try:
                await client.close()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("closing a replication client: %s", e)
        self._import = self._drop = None

    def holders_of(self, hashes: Sequence[int]) -> list[int]:
        """The workers whose KV holds every one of ``hashes`` (the router's index)."""
        return [w for w, n in self.router.index.overlaps(hashes).items() if n >= len(hashes)]

    def plan(self, now_s: float) -> list[tuple[str, ReplicationAction, tuple[int, ...]]]:
        """This cycle's actions, each with its model and the prefix's block hashes (the policy's state after them in
        ``states``; the hot prefixes left without a copy in ``last_skipped``)."""
        snapshot = self.fleet.snapshot(now_s)
        models = sorted({inst.model for inst in snapshot.instances.values()})
        out: list[tuple[str, ReplicationAction, tuple[int, ...]]] = []
        self.last_skipped = []
        self.last_prefixes = []
        for model in models:
            prefixes, chains = prefix_loads(snapshot, model, self.config.prefix_replication_window_s, self.holders_of)
            workers = worker_loads(snapshot, model)
            self.last_prefixes += prefixes
            if prefixes and logger.isEnabledFor(logging.DEBUG):
                logger.debug("replication inputs of %s: %s; %s", model, prefixes, workers)
            state = self.states.get(model, ReplicationState())
            plan, self.states[model] = plan_replication(prefixes, workers, state, self.config, now_s)
            self.last_skipped += [f"{model}: {s}" for s in plan.skipped]
            ours_before = {(r.prefix_hash, r.instance_id): r for r in state.replicas}
            for a in plan.actions:
                hashes = chains.get(a.prefix_hash) or self._chains.get((model, a.prefix_hash), ())
                out.append((model, a, hashes))
                rep = ours_before.get((a.prefix_hash, a.destination_id))
                if a.kind is ActionKind.DROP and rep is not None:
                    self._dropping[(model, a.prefix_hash, a.destination_id)] = (rep, hashes)
        # Keep the hashes of the replicas still ours (a dropped or evicted one's are not needed again).
        ours = {(m, r.prefix_hash) for m, st in self.states.items() for r in st.replicas}
        self._chains = {k: v for k, v in self._chains.items() if k in ours}
        return out

    async def cycle(self, now_s: float) -> ReplicationCycle:
        """Plan and carry out this cycle's copies and drops, concurrently (module docstring)."""
        actions = self.plan(now_s)
        results = await asyncio.gather(*(self._run(model, a, hashes) for model, a, hashes in actions))
        return ReplicationCycle(tuple(results), tuple(self.last_skipped))

    async def _run(self, model: str, a: ReplicationAction, hashes: tuple[int, ...]) -> ActionResult:
        t0 = time.monotonic()
        blocks = 0
        outcome = ActionOutcome.FAILED
        detail = ""
        if not hashes:
            detail = "the prefix's block hashes are unknown"
        else:
            try:
                if a.kind is ActionKind.COPY:
                    assert self._import is not None and a.source_id is not None, "start() first"
                    reply = await copy_prefix(self._import, a.destination_id, a.source_id, hashes, self.call_timeout_s)
                    blocks = reply.imported
                    detail = reply.error or f"{reply.imported} imported of {reply.held_by_source} the source held"
                    ok = not reply.error
                else:
                    assert self._drop is not None, "start() first"
                    dreply = await drop_prefix(self._drop, a.destination_id, hashes, self.call_timeout_s)
                    blocks = dreply.dropped
                    detail = dreply.error or f"{dreply.dropped} dropped, {dreply.in_use} in use kept"
                    ok = not dreply.error
                outcome = ActionOutcome.SUCCEEDED if ok else ActionOutcome.FAILED
            except TimeoutError:
                outcome, detail = ActionOutcome.TIMED_OUT, f"no reply within {self.call_timeout_s:g} s"
            except RuntimeMeshError as e:
                outcome, detail = ActionOutcome.FAILED, f"{type(e).__name__}: {e}"
        if a.kind is ActionKind.COPY:
            ok = outcome is ActionOutcome.SUCCEEDED
            state = self.states.get(model, ReplicationState())
            self.states[model] = copy_finished(state, a.prefix_hash, a.destination_id, self.clock(), ok)
            if ok:
                self._chains[(model, a.prefix_hash)] = hashes
        else:
            dropping = self._dropping.pop((model, a.prefix_hash, a.destination_id), None)
            if dropping is not None and outcome is not ActionOutcome.SUCCEEDED and hashes:
                rep, chain = dropping
                self.states[model] = drop_failed(self.states.get(model, ReplicationState()), rep)
                self._chains[(model, a.prefix_hash)] = chain
        level = logging.INFO if outcome is ActionOutcome.SUCCEEDED else logging.WARNING
        logger.log(
            level,
            "prefix replication: %s %x (%d blocks) %s -> %x: %s (%s; %s)",
            a.kind,
            a.prefix_hash,
            len(hashes),
            "-" if a.source_id is None else f"{a.source_id:x}",
            a.destination_id,
            outcome,
            detail,
            a.reason,
        )
        return ActionResult(model, a, outcome, detail, blocks, time.monotonic() - t0, len(hashes))
