"""``RouterFeed``: keeps a ``Router``'s inputs current from the mesh. All of the router's I/O lives here.

- the fleet view: a ``components.fleet.live.LiveFleet`` over the router's ``FleetState`` (the owner's, when it
  passes one: the frontend's follows the prefill queue too), following the ``load_metrics`` topic (every policy: it
  is how a dead worker is noticed within ~0.5 s) and the ``worker_status`` topic (a worker whose engine died, or
  that drains, is chosen no more from the moment it says so, while its registration stays until its requests are
  gone);
- ``kv_events`` topic -> ``Router.apply_kv_events`` (KV policies with events on). On an event-id gap, and for every
  worker that joins (its earlier events were never seen), a named task fetches the worker's ``kv_state`` snapshot
  straight from that instance and loads it; events that race the fetch are buffered and replayed after it. A fetch
  that fails is retried with back-off while the worker is still registered;
- discovery (``watch_workers``, the standalone router; the frontend's model registry does this itself) -> the
  ``generate`` instances of the configured components, grouped by their ``model`` metadata, ->
  ``Router.set_workers``; a worker that deregisters, or whose lease expires, leaves with its KV blocks;
- ``router_sync`` topic (``router_replica_sync``): publishes this router's assignment changes as they happen
  (those within ``SYNC_GATHER_S`` of each other in one ``batch`` message) and its whole in-flight table every
  ``router_sync_interval_s``; applies the other replicas'; forgets a replica silent for
  5 intervals (its process died) together with its requests.

Owns: its subscriptions, its runtime clients and its tasks (named ``router-*``, in the runtime's supervisor), all
released by ``stop()``, each in its own try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from components.fleet.live import LiveFleet
from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_KV_STATE, TOPIC_KV_EVENTS
from components.protocol.messages import KvEvent, KvStateSnapshot
from components.protocol.metadata import WorkerMetadata, is_routable
from components.router.adapter import Router
from components.router.errors import RouterProtocolError
from components.router.protocol import TOPIC_ROUTER_SYNC
from components.runtime import Client, EventSubscription, RecoverableError, Runtime

logger = logging.getLogger(__name__)

# A kv_state fetch: the worker answers from memory (a 1M-block snapshot is ~9 MB of msgpack), so 5 s is generous.
RESYNC_TIMEOUT_S = 5.0
# Back-off between failed fetches: 0.1, 0.2, 0.4, ... capped at 5 s, for as long as the worker stays registered.
RESYNC_BACKOFF_S = (0.1, 5.0)
# A replica that published nothing (not even its periodic state) for this many sync intervals is presumed dead.
REPLICA_TIMEOUT_INTERVALS = 5
# How long the first assignment change waits for others to share its sync message: 2 ms, against load reports
# every 100 ms; at 400 requests/s (1,200 changes/s) about 2-3 changes share a message instead of one each.
SYNC_GATHER_S = 0.002


class RouterFeed:
    def __init__(
        self,
        runtime: Runtime,
        router: Router,
        namespace: str,
        components: Sequence[str],
        *,
        watch_workers: bool = False,
        fleet: LiveFleet | None = None,
    ) -> None:
        """``fleet``: the live view over ``router.fleet`` to start and stop with the feed (the owner's, or None: one
        of the feed's own, following loads and statuses)."""
        if fleet is not None and fleet.state is not router.fleet:
            raise ValueError("the live fleet view must feed the router's own FleetState")
        self.fleet = (
            fleet
            if fleet is not None
            else LiveFleet(
                runtime,
                namespace,
                state=router.fleet,
                watch_membership=False,
                follow_queues=False,
                follow_requests=False,
            )
        )
        self.runtime = runtime
        self.router = router
        self.namespace = namespace
        self.components = list(components)
        self.watch_workers = watch_workers
        self._subs: list[EventSubscription[Any]] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._kv_state_clients: list[Client] = []
        self._generate_clients: list[Client] = []
        self._resyncing: dict[int, asyncio.Task[None]] = {}
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._sync = router.config.router_replica_sync
        self._models: set[str] = set()
        self.num_resyncs = 0
        self.num_resync_failures = 0

    # --- life -------------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        rt = self.runtime
        ns = rt.namespace(self.namespace)
        spawn = rt.supervisor.spawn
        router = self.router
        await self.fleet.start()
        if router.uses_kv and not router.approximate:
            for comp in self.components:
                self._kv_state_clients.append(await ns.component(comp).endpoint(ENDPOINT_KV_STATE).client())
            kv: EventSubscription[Any] = await ns.events.subscribe(TOPIC_KV_EVENTS)
            self._subs.append(kv)
            self._tasks.append(spawn(self._consume_kv_events(kv), name=f"router-kv-events:{self.namespace}"))
            router.membership_listeners.append(self._on_membership)
            for iid in router.members():  # workers the owner told the router about before the feed started
                self._schedule_resync(iid)
        if self._sync:
            sync: EventSubscription[Any] = await ns.events.subscribe(TOPIC_ROUTER_SYNC)
            self._subs.append(sync)
            router.sync_listeners.append(self._outbox.put_nowait)
            self._tasks.append(spawn(self._consume_sync(sync), name=f"router-sync-in:{self.namespace}"))
            self._tasks.append(spawn(self._publish_sync(), name=f"router-sync-out:{self.namespace}"))
        if self.watch_workers:
            for comp in self.components:
                client = await ns.component(comp).endpoint(ENDPOINT_GENERATE).client()
                client.on_change(self._rebuild_models)
                self._generate_clients.append(client)
            self._rebuild_models()
        logger.info(
            "router %x (%s) follows namespace %s: metrics%s%s",
            router.replica_id,
            router.config.router_policy,
            self.namespace,
            ", KV events" if router.uses_kv and not router.approximate else "",
            ", replica sync" if self._sync else "",
        )

    async def stop(self) -> None:
        try:
            await self._stop()
        finally:
            await self.fleet.stop()

    async def _stop(self) -> None:
        router = self.router
        if router.provisional:
            logger.info("router %x provisional KV blocks: %s", router.replica_id, router.provisional_summary())
        if self._sync:
            with contextlib.suppress(ValueError):
                router.sync_listeners.remove(self._outbox.put_nowait)
            try:
                await self.runtime.namespace(self.namespace).events.publish(
                    TOPIC_ROUTER_SYNC, {"op": "bye"}, source_id=router.replica_id
                )
            except Exception as e:  # noqa: BLE001 - the others forget us after 5 silent intervals anyway
                logger.debug("publishing router bye: %s", e)
        with contextlib.suppress(ValueError):
            router.membership_listeners.remove(self._on_membership)
        tasks = [*self._tasks, *self._resyncing.values()]
        self._tasks.clear()
        self._resyncing.clear()
        for t in tasks:
            t.cancel()
        # gather, not "await t" under suppress(CancelledError): a stop() that is itself cancelled must stay cancelled.
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in self._subs:
            try:
                await sub.close()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("closing subscription %s: %s", sub.topic, e)
        self._subs.clear()
        for client in [*self._kv_state_clients, *self._generate_clients]:
            try:
                await client.close()
            except Exception as e:  # noqa: BLE001 - release the rest
                logger.warning("closing client of %s: %s", client.endpoint.path, e)
        self._kv_state_clients.clear()
        self._generate_clients.clear()

    # --- discovery --------------------------------------------------------------------------------------------------

    def _rebuild_models(self) -> None:
        by_model: dict[str, list[tuple[int, Any]]] = {}
        for client in self._generate_clients:
            for info in client.instances():
                meta = WorkerMetadata.from_dict(info.metadata)
                model = meta.model
                if not is_routable(meta):
                    continue
                by_model.setdefault(model, []).append((info.instance_id, info.metadata))
        for model, workers in by_model.items():
            self.router.set_workers(model, workers)
        for model in self._models - by_model.keys():
            self.router.set_workers(model, [])
        self._models = set(by_model)

    def _on_membership(self, added: set[int], removed: set[int]) -> None:
        for iid in removed:
            task = self._resyncing.pop(iid, None)
            if task is not None:
                task.cancel()
        for iid in added:
            self._schedule_resync(iid)

    # --- KV events and resyncs --------------------------------------------------------------------------------------

    async def _consume_kv_events(self, sub: EventSubscription[Any]) -> None:
        router = self.router
        async for ev in sub:
            try:
                events = [KvEvent.from_dict(e) for e in ev.payload]
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("KV events from %x do not parse: %r", ev.source_id, e)
                continue
            if not router.apply_kv_events(ev.source_id, events, time.monotonic()):
                self._schedule_resync(ev.source_id)

    def _schedule_resync(self, iid: int) -> None:
        if iid in self._resyncing:
            return
        self.router.begin_resync(iid)
        self._resyncing[iid] = self.runtime.supervisor.spawn(self._resync(iid), name=f"router-kv-resync:{iid:x}")

    def _kv_state_client(self, iid: int) -> Client | None:
        for client in self._kv_state_clients:
            if client.instance(iid) is not None:
                return client
        return None

    async def _resync(self, iid: int) -> None:
        delay, max_delay = RESYNC_BACKOFF_S
        try:
            while True:
                client = self._kv_state_client(iid)
                if client is None and not self.router.is_member(iid):
                    # Not (or no longer) registered anywhere: nothing to fetch from. A worker that registers later
                    # gets a resync of its own when it joins.
                    logger.debug("no kv_state instance %x to resync from", iid)
                    return
                if client is not None:
                    try:
                        async with asyncio.timeout(RESYNC_TIMEOUT_S):
                            stream = await client.direct({}, iid)
                            items = [item async for item in stream]
                        snap = KvStateSnapshot.from_dict(items[0])
                    except (RecoverableError, TimeoutError, IndexError, KeyError, TypeError) as e:
                        self.num_resync_failures += 1
                        logger.info("KV state of worker %x not fetched (%r); retrying in %.1f s", iid, e, delay)
                    else:
                        self.num_resyncs += 1
                        if self.router.load_kv_state(iid, snap):
                            logger.info(
                                "KV index of worker %x resynced: %d blocks as of event %d",
                                iid,
                                len(snap.block_hashes),
                                snap.last_event_id,
                            )
                            return
                        # The events buffered during the fetch had a gap of their own: fetch again, at once.
                        logger.info("KV events of worker %x had a gap during its resync; fetching again", iid)
                        continue
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)
        finally:
            if self._resyncing.get(iid) is asyncio.current_task():
                del self._resyncing[iid]

    # --- replica sync -----------------------------------------------------------------------------------------------

    async def _consume_sync(self, sub: EventSubscription[Any]) -> None:
        router = self.router
        async for ev in sub:
            try:
                router.apply_sync(ev.source_id, ev.payload, time.monotonic())
            except RouterProtocolError as e:
                logger.warning("%s", e)

    async def _publish_sync(self) -> None:
        """Assignment changes go out in batches: the first change waits ``SYNC_GATHER_S`` for others, then every
        change queued by then leaves in one ``batch`` message (three changes per request, each sent alone, cost
        every replica three messages per request placed anywhere). The whole table follows every interval."""
        router = self.router
        events = self.runtime.namespace(self.namespace).events
        interval = router.config.router_sync_interval_s
        loop = asyncio.get_running_loop()
        next_state = loop.time()
        outbox = self._outbox
        while True:
            msg: dict[str, Any] | None
            wait = next_state - loop.time()
            if wait > 0:
                try:
                    async with asyncio.timeout(wait):
                        msg = await outbox.get()
                except TimeoutError:
                    msg = None
            else:
                msg = None
            batch: list[dict[str, Any]] = []
            if msg is not None:
                batch.append(msg)
                await asyncio.sleep(SYNC_GATHER_S)
                while not outbox.empty():
                    batch.append(outbox.get_nowait())
            else:
                # The periodic state goes out after everything queued before it, so it is the newest word.
                while not outbox.empty():
                    batch.append(outbox.get_nowait())
                batch.append(router.sync_state())
                next_state = loop.time() + interval
                router.expire_replicas(time.monotonic(), REPLICA_TIMEOUT_INTERVALS * interval)
            out = batch[0] if len(batch) == 1 else {"op": "batch", "ops": batch}
            try:
                await events.publish(TOPIC_ROUTER_SYNC, out, source_id=router.replica_id)
            except Exception as e:  # noqa: BLE001 - NATS reconnecting: the next state message heals the loss
                logger.debug("publishing router sync: %s", e)
