"""The distributed runtime: namespace -> component -> endpoint, served and called over the mesh.

    runtime = await Runtime.connect(RuntimeConfig.from_env())
    ep = runtime.namespace("demo").component("backend").endpoint("generate")
    served = await ep.serve(handler, metadata={"model": "tiny"})      # handler: async generator (body, ctx)
    client = await ep.client()
    await client.wait_for_instances(1)
    async for item in await client.generate({"prompt": [1, 2, 3]}):
        ...

Owns: the primary lease (and any extra leases), the response inbox, a supervisor of named tasks. Registration:
``kvmesh/<ns>/instances/<component>/<endpoint>/<instance_id hex>`` -> JSON ``InstanceInfo``, under a lease, so an
instance whose process dies vanishes after at most the lease TTL; a graceful ``shutdown()`` revokes the lease so it
vanishes at once. The instance id is chosen by the runtime and does not change if the lease is lost and re-acquired.

Imports no other kvmesh component.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import json
import logging
import random
import re
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from components.runtime.bus import DEFAULT_ACK_WAIT_S, DEFAULT_MAX_DELIVERIES, Bus, NatsBus, WorkQueue
from components.runtime.config import RuntimeConfig
from components.runtime.discovery import Discovery, EtcdDiscovery, WatchEventKind
from components.runtime.errors import (
    BusUnavailableError,
    ConfigError,
    InstanceGoneError,
    NoInstancesError,
    ShutdownError,
)
from components.runtime.events import EventPlane
from components.runtime.request_plane import (
    Handler,
    InstanceServer,
    ResponseMux,
    ResponseStream,
    open_stream,
    probe_instance,
)
from components.runtime.supervisor import Supervisor

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _check_name(kind: str, name: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"{kind} name {name!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return name


@dataclasses.dataclass(slots=True, frozen=True)
class InstanceInfo:
    """What discovery knows of one served endpoint instance."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    subject: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self) | {"metadata": dict(self.metadata)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> InstanceInfo:
        d = json.loads(data)
        return cls(
            namespace=d["namespace"],
            component=d["component"],
            endpoint=d["endpoint"],
            instance_id=int(d["instance_id"]),
            subject=d["subject"],
            metadata=d.get("metadata") or {},
        )


def instances_prefix(namespace: str, component: str | None = None, endpoint: str | None = None) -> str:
    p = f"kvmesh/{namespace}/instances/"
    if component is not None:
        p += f"{component}/"
        if endpoint is not None:
            p += f"{endpoint}/"
    return p


class RouterMode(enum.StrEnum):
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    DIRECT = "direct"


# How long each closing step of ``Runtime.shutdown`` may take (a CI run's test teardown hung in one for > 120 s).
SHUTDOWN_STEP_TIMEOUT_S = 10.0


async def _bounded(what: str, step: Coroutine[Any, Any, Any], timeout_s: float) -> None:
    """Run one closing step of ``Runtime.shutdown``: an error or a step past ``timeout_s`` is logged, not raised."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except TimeoutError:
        logger.warning("%s: no answer within %g s, left behind", what, timeout_s)
    except Exception as e:  # noqa: BLE001
        logger.warning("%s: %s", what, e)


class Runtime:
    def __init__(self, config: RuntimeConfig, discovery: Discovery, bus: Bus) -> None:
        self.config = config
        self.discovery = discovery
        self.bus = bus
        self.supervisor = Supervisor("runtime")
        self.mux = ResponseMux(bus, config.response_host if config.response_transport == "tcp" else None)
        self.primary_lease = 0
        self._served: list[ServedEndpoint] = []
        self._clients: list[Client] = []
        self._closed = False

    @classmethod
    async def connect(cls, config: RuntimeConfig | None = None, name: str = "kvmesh") -> Runtime:
        """Connect to etcd and NATS (ConnectError names the one that failed) and take the primary lease."""
        config = config or RuntimeConfig.from_env()
        discovery = EtcdDiscovery(config)
        await discovery.start()
        bus = NatsBus(config, name=name)
        try:
            await bus.start()
        except BaseException:
            await discovery.close(revoke=False)
            raise
        return await cls.from_parts(config, discovery, bus)

    @classmethod
    async def from_parts(cls, config: RuntimeConfig, discovery: Discovery, bus: Bus) -> Runtime:
        """A runtime over already started parts (the in-memory twins in unit tests)."""
        rt = cls(config, discovery, bus)
        await rt.mux.start()
        rt.primary_lease = await discovery.grant_lease(config.lease_ttl_s)
        return rt

    def namespace(self, name: str) -> Namespace:
        return Namespace(self, _check_name("namespace", name))

    async def create_lease(self, ttl_s: int | None = None) -> int:
        """An extra lease, for a process that hosts several instances with independent lifetimes."""
        return await self.discovery.grant_lease(ttl_s or self.config.lease_ttl_s)

    async def shutdown(self, drain_timeout_s: float = 30.0, step_timeout_s: float = SHUTDOWN_STEP_TIMEOUT_S) -> None:
        """Drain served endpoints, revoke leases (instances vanish at once), close everything.

        Each resource is released in its own try, so one failure does not leak the rest, and each closing step gets
        at most ``step_timeout_s`` (the drains their ``drain_timeout_s`` on top): a peer that stops answering
        mid-shutdown (etcd, NATS, a connection to a killed instance) is logged by name and left behind instead of
        holding the process forever.
        """
        if self._closed:
            return
        self._closed = True
        for served in list(self._served):
            await _bounded(f"stopping {served.info.subject}", served.stop(drain_timeout_s=drain_timeout_s),
                           drain_timeout_s + step_timeout_s)  # fmt: skip
        for client in list(self._clients):
            await _bounded("closing a client", client.close(), step_timeout_s)
        await _bounded("closing supervisor", self.supervisor.close(), step_timeout_s)
        await _bounded("closing discovery", self.discovery.close(revoke=True), step_timeout_s)
        await _bounded("closing bus", self._close_bus(), step_timeout_s)

    async def _close_bus(self) -> None:
        await self.mux.stop()
        await self.bus.close()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError("runtime is shut down")


class Namespace:
    def __init__(self, runtime: Runtime, name: str) -> None:
        self.runtime = runtime
        self.name = name
        self.events = EventPlane(runtime.bus, name)

    def component(self, name: str) -> Component:
        return Component(self, _check_name("component", name))

    async def work_queue(
        self,
        name: str,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
        max_items: int | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> WorkQueue:
        """A durable JetStream work queue scoped to this namespace; ``name`` follows the rules of every other name.
        See ``components.runtime.bus`` for the semantics and the defaults."""
        return await self.runtime.bus.work_queue(
            f"{self.name}.{_check_name('queue', name)}", ack_wait_s, max_items, max_deliveries
        )

    async def prefill_queue(
        self,
        model: str,
        ack_wait_s: float = DEFAULT_ACK_WAIT_S,
        max_items: int | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> WorkQueue:
        """The prefill queue of ``model`` in this namespace (disaggregated serving: decode workers push, prefill
        workers pop). ``model`` is the served model name as is ('/', '.', ':' and the like included); each (namespace,
        model) has a queue of its own. Its bus name ``<namespace>.prefill.<model>`` cannot meet a ``work_queue``
        name, which has no second '.'."""
        if not model:
            raise ConfigError("prefill queue: model name must not be empty")
        return await self.runtime.bus.work_queue(f"{self.name}.prefill.{model}", ack_wait_s, max_items, max_deliveries)

    async def list_instances(self) -> list[InstanceInfo]:
        listing = await self.runtime.discovery.get_prefix(instances_prefix(self.name))
        return [InstanceInfo.from_json(v) for v in listing.values()]


class Component:
    def __init__(self, namespace: Namespace, name: str) -> None:
        self.namespace = namespace
        self.name = name

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(self, _check_name("endpoint", name))


class Endpoint:
    def __init__(self, component: Component, name: str) -> None:
        self.component = component
        self.name = name
        self.runtime = component.namespace.runtime

    @property
    def path(self) -> str:
        return f"{self.component.namespace.name}/{self.component.name}/{self.name}"

    def _subject(self, instance_id: int) -> str:
        ns = self.component.namespace.name
        return f"kvmesh.{ns}.{self.component.name}.{self.name}.{instance_id:x}"

    def subject_of(self, instance_id: int) -> str:
        """The request-plane subject instance ``instance_id`` of this endpoint serves on (a hand-over names it)."""
        return self._subject(instance_id)

    async def serve(
        self,
        handler: Handler,
        metadata: Mapping[str, Any] | None = None,
        lease: int | None = None,
        instance_id: int | None = None,
    ) -> ServedEndpoint:
        """Subscribe, then register under the lease (primary unless given). Returns once discoverable."""
        self.runtime._check_open()
        iid = instance_id if instance_id is not None else secrets.randbits(63)
        info = InstanceInfo(
            namespace=self.component.namespace.name,
            component=self.component.name,
            endpoint=self.name,
            instance_id=iid,
            subject=self._subject(iid),
            metadata=dict(metadata or {}),
        )
        cfg = self.runtime.config
        server = InstanceServer(
            self.runtime.bus,
            info.subject,
            iid,
            handler,
            client_check_s=cfg.client_check_s,
            probe_timeout_s=cfg.probe_timeout_s,
        )
        await server.start()
        await self.runtime.bus.flush()  # the subscription must be live before anyone can discover us
        served = ServedEndpoint(self, info, server, self.runtime.primary_lease if lease is None else lease)
        await served.register()
        self.runtime._served.append(served)
        logger.info("serving %s as instance %x", self.path, iid)
        return served

    async def client(self, router_mode: RouterMode | str = RouterMode.ROUND_ROBIN) -> Client:
        """A client that follows this endpoint's instances live (etcd watch)."""
        self.runtime._check_open()
        client = Client(self, RouterMode(router_mode))
        await client.start()
        self.runtime._clients.append(client)
        return client


class ServedEndpoint:
    """One registered instance of an endpoint."""

    def __init__(self, endpoint: Endpoint, info: InstanceInfo, server: InstanceServer, lease: int) -> None:
        self.endpoint = endpoint
        self.info = info
        self.server = server
        self.lease = lease
        self._stopped = False

    @property
    def instance_id(self) -> int:
        return self.info.instance_id

    @property
    def key(self) -> str:
        e = self.endpoint
        return instances_prefix(e.component.namespace.name, e.component.name, e.name) + f"{self.info.instance_id:x}"

    async def register(self) -> None:
        await self.endpoint.runtime.discovery.put(self.key, self.info.to_json(), lease=self.lease)

    def adopt(self, handler: Handler, body: Any, route: dict[str, Any], first_seq: int) -> None:
        """Serve a request another instance handed over (``InstanceServer.adopt``): ``handler(body, ctx)``'s items
        go to the client's stream on ``route`` from frame ``first_seq`` on."""
        self.server.adopt(handler, body, route, first_seq)

    async def update_metadata(self, **changes: Any) -> None:
        """Change the advertised metadata (e.g. a role change) without re-subscribing."""
        self.info = dataclasses.replace(self.info, metadata={**self.info.metadata, **changes})
        await self.register()

    async def stop(self, drain_timeout_s: float = 30.0) -> int:
        """Deregister (no new requests are routed here), finish what is in flight, unsubscribe.

        Returns the number of requests cancelled because they outlived ``drain_timeout_s``.
        """
        if self._stopped:
            return 0
        self._stopped = True
        rt = self.endpoint.runtime
        try:
            await rt.discovery.delete(self.key)
        except Exception as e:  # noqa: BLE001
            logger.warning("deregistering %s: %s", self.key, e)
        cancelled = await self.server.drain(drain_timeout_s)
        await self.server.stop()
        with contextlib.suppress(ValueError):
            rt._served.remove(self)
        return cancelled


class Client:
    """Calls an endpoint's instances. The instance list is kept live from an etcd watch."""

    def __init__(self, endpoint: Endpoint, mode: RouterMode) -> None:
        self.endpoint = endpoint
        self.runtime = endpoint.runtime
        self.mode = mode
        self._instances: dict[int, InstanceInfo] = {}
        self._ids: list[int] = []
        self._changed = asyncio.Condition()
        self._rr = itertools.count()
        self._rng = random.Random()
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[], None]] = []
        # Instances whose registration vanished with etcd's data while they may still run: iid -> the monotonic
        # instant after which they are dropped unless they re-register (``vanished_instance_trust_s``).
        self._vanished: dict[int, float] = {}
        self._confirming: dict[int, asyncio.Task[None]] = {}
        self.num_vanished_kept = 0  # registrations lost with etcd's data whose instance was kept (tests, status)

    async def start(self) -> None:
        prefix = instances_prefix(
            self.endpoint.component.namespace.name, self.endpoint.component.name, self.endpoint.name
        )
        # Apply a listing now, so the client knows the instances when start() returns. The watch lists again when it
        # starts; it is handed this listing as ``known`` so that an instance deregistered between the two listings
        # arrives as a DELETE. Without it the watch's listing merely lacked the key and the client kept routing to
        # a stopped instance forever (test_request_plane.py::test_client_created_just_before_an_instance_stops...).
        listing = await self.runtime.discovery.get_prefix(prefix)
        for v in listing.values():
            info = InstanceInfo.from_json(v)
            self._instances[info.instance_id] = info
        self._ids = sorted(self._instances)
        self._task = self.runtime.supervisor.spawn(self._watch(prefix, listing), name=f"watch:{self.endpoint.path}")

    async def _watch(self, prefix: str, known: Mapping[str, bytes]) -> None:
        async for ev in self.runtime.discovery.watch_prefix(prefix, known=known):
            iid = int(ev.key.rsplit("/", 1)[1], 16)
            if ev.kind == WatchEventKind.PUT and ev.value is not None:
                self._instances[iid] = InstanceInfo.from_json(ev.value)
                self._vanished.pop(iid, None)
                task = self._confirming.pop(iid, None)
                if task is not None:
                    task.cancel()
            elif ev.relisted and iid in self._instances and self.runtime.config.vanished_instance_trust_s > 0:
                # Registry loss, not a deregistration (a real one arrives as a watch DELETE, not from a listing):
                # keep routing to it while the request plane says it is there and it has time to re-register.
                self._keep_vanished(iid)
                continue
            else:
                self._drop(iid)
            await self._notify()

    async def _notify(self) -> None:
        self._ids = sorted(self._instances)
        async with self._changed:
            self._changed.notify_all()
        for cb in self._listeners:
            cb()

    def _drop(self, iid: int) -> None:
        self._instances.pop(iid, None)
        self._vanished.pop(iid, None)
        task = self._confirming.pop(iid, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _keep_vanished(self, iid: int) -> None:
        """The rule for a registration lost with etcd's data: the instance stays routable until it re-registers
        (then it is simply known again), or the request plane says nobody serves its subject (no responders: it
        died meanwhile), or ``vanished_instance_trust_s`` passes without a re-registration, whichever comes first."""
        if iid in self._vanished:
            return
        cfg = self.runtime.config
        self._vanished[iid] = time.monotonic() + cfg.vanished_instance_trust_s
        self.num_vanished_kept += 1
        logger.warning(
            "instance %x of %s vanished from etcd (registry lost?); kept for up to %g s while it answers",
            iid,
            self.endpoint.path,
            cfg.vanished_instance_trust_s,
        )
        self._confirming[iid] = self.runtime.supervisor.spawn(self._confirm(iid), name=f"confirm:{iid:x}")

    async def _confirm(self, iid: int) -> None:
        cfg = self.runtime.config
        while iid in self._vanished:
            info = self._instances.get(iid)
            if info is None:
                return
            alive = await probe_instance(self.runtime.bus, info.subject, cfg.probe_timeout_s)
            if iid not in self._vanished:
                return  # re-registered meanwhile
            if alive is False or time.monotonic() >= self._vanished[iid]:
                why = "no responders on its subject" if alive is False else "it did not re-register in time"
                logger.warning("instance %x of %s dropped: %s", iid, self.endpoint.path, why)
                self._drop(iid)
                await self._notify()
                return
            await asyncio.sleep(min(1.0, max(0.0, self._vanished[iid] - time.monotonic())))

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every change of the instance list (routers keep their snapshots this way)."""
        self._listeners.append(callback)

    def instance_ids(self) -> list[int]:
        return list(self._ids)

    def instances(self) -> list[InstanceInfo]:
        return [self._instances[i] for i in self._ids]

    def instance(self, instance_id: int) -> InstanceInfo | None:
        return self._instances.get(instance_id)

    async def wait_for_instances(self, n: int = 1, timeout_s: float = 30.0) -> list[int]:
        """Wait until at least ``n`` instances are known; TimeoutError after ``timeout_s``."""

        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self._ids) >= n)

        async with asyncio.timeout(timeout_s):
            await wait()
        return self.instance_ids()

    def _pick(self, mode: RouterMode) -> int:
        ids = self._ids
        if not ids:
            raise NoInstancesError(self.endpoint.path)
        if mode == RouterMode.RANDOM:
            return self._rng.choice(ids)
        return ids[next(self._rr) % len(ids)]

    async def generate(
        self, request: Any, instance_id: int | None = None, request_id: str | None = None
    ) -> ResponseStream:
        """Send ``request`` to ``instance_id`` (direct) or to one chosen by the client's mode.

        Returns once the instance acknowledged the request; raises NoInstancesError, InstanceGoneError or
        InstanceDrainingError before any item was produced, so the caller may retry elsewhere.
        """
        self.runtime._check_open()
        cfg = self.runtime.config
        bus = self.runtime.bus
        waited_until = 0.0
        if not bus.is_connected:
            # NATS is down (restarting): wait for it, bounded, rather than fail a request that would go through in
            # a moment. Instances re-subscribe a moment after this client is back, so "no responders" is retried
            # until the same deadline when this request had to wait.
            t0 = time.monotonic()
            if not await bus.wait_connected(cfg.bus_wait_s):
                raise BusUnavailableError(cfg.nats_url, cfg.bus_wait_s)
            waited_until = t0 + cfg.bus_wait_s
        if instance_id is None:
            if self.mode == RouterMode.DIRECT:
                raise ValueError("direct mode needs an instance_id")
            instance_id = self._pick(self.mode)
        info = self._instances.get(instance_id)
        subject = info.subject if info is not None else self.endpoint._subject(instance_id)
        while True:
            try:
                return await open_stream(
                    bus,
                    self.runtime.mux,
                    subject,
                    instance_id,
                    request,
                    ack_timeout_s=cfg.request_ack_timeout_s,
                    idle_probe_s=cfg.stream_idle_probe_s,
                    probe_timeout_s=cfg.probe_timeout_s,
                    request_id=request_id,
                )
            except InstanceGoneError:
                if time.monotonic() >= waited_until:
                    raise
                await asyncio.sleep(0.05)

    async def round_robin(self, request: Any) -> ResponseStream:
        return await self.generate(request, self._pick(RouterMode.ROUND_ROBIN))

    async def random(self, request: Any) -> ResponseStream:
        return await self.generate(request, self._pick(RouterMode.RANDOM))

    async def direct(self, request: Any, instance_id: int) -> ResponseStream:
        return await self.generate(request, instance_id)

    async def close(self) -> None:
        """Stop following instances. Bounded: a cancel that lands while aetcd sets up its watch can be swallowed
        (Python 3.11's ``asyncio.wait_for`` loses a cancel that races its inner future), so cancel again until the
        task ends, and give up waiting after ~2 s rather than hang the caller's shutdown."""
        for confirming in self._confirming.values():
            confirming.cancel()
        self._confirming.clear()
        task, self._task = self._task, None
        if task is not None:
            for _ in range(20):
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if done:
                    break
            else:
                logger.warning("watch task of %s did not stop after 20 cancels; leaving it", self.endpoint.path)
        with contextlib.suppress(ValueError):
            self.runtime._clients.remove(self)
