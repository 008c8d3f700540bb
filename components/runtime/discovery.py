"""Discovery: keys under leases, and prefix watches that survive server restarts.

``Discovery`` is the protocol the rest of the runtime uses; ``EtcdDiscovery`` implements it on etcd (through aetcd,
the only importer of the etcd client in kvmesh) and ``components.runtime.memory.MemoryDiscovery`` in memory.

Semantics both implementations keep:
- A *lease handle* is a small local integer that stays valid for the life of the process. Behind it sits a server lease
  that may change: when the server lease is lost (etcd restarted without its data, a partition longer than the TTL),
  a new one is granted and every key put under the handle is put again. Callers never see the server lease id change.
- ``watch_prefix`` first yields a PUT for every key already present, then changes in revision order. After a
  reconnection it lists the prefix again and yields only the difference (DELETE for keys that vanished, PUT for keys
  that appeared or changed), then watches from the listing's revision + 1: no change is lost or repeated. A caller
  that already applied a listing of its own passes it as ``known``: the first listing then yields only the difference
  from it too, so a key deleted between the caller's listing and the watch's is reported (not silently kept).
- Deleting or revoking is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

import aetcd
import aetcd.exceptions

from components.runtime.config import RuntimeConfig, parse_host_port
from components.runtime.credentials import etcd_credentials
from components.runtime.errors import ConnectError, ShutdownError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WatchEventKind(enum.StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclasses.dataclass(slots=True, frozen=True)
class WatchEvent:
    kind: WatchEventKind
    key: str
    value: bytes | None  # None for DELETE
    # True for an event derived from a re-listing after the watch's history was lost (etcd came back without its
    # data, or compacted past the last revision seen): a DELETE then means "not in the listing", which may be a key
    # lost with the data while its owner is alive, not a deregistration (components/runtime/runtime.py: Client).
    relisted: bool = False


class Discovery(Protocol):
    async def start(self) -> None: ...

    async def close(self, *, revoke: bool = True) -> None: ...

    async def grant_lease(self, ttl_s: int) -> int: ...

    async def revoke_lease(self, lease: int) -> None: ...

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None: ...

    async def delete(self, key: str) -> None: ...

    async def get_prefix(self, prefix: str) -> dict[str, bytes]: ...

    def watch_prefix(self, prefix: str, known: Mapping[str, bytes] | None = None) -> AsyncIterator[WatchEvent]: ...

    def server_lease_id(self, lease: int) -> int: ...


@dataclasses.dataclass
class _LeaseState:
    handle: int
    ttl_s: int
    server_id: int
    keys: dict[str, bytes] = dataclasses.field(default_factory=dict)
    last_ok_s: float = 0.0
    task: asyncio.Task[None] | None = None
    num_reacquired: int = 0


def diff_listing(known: dict[str, bytes], listing: dict[str, bytes], relisted: bool = False) -> list[WatchEvent]:
    """Events that turn ``known`` into ``listing`` (used after a reconnection)."""
    events = [WatchEvent(WatchEventKind.DELETE, k, None, relisted) for k in known if k not in listing]
    events += [WatchEvent(WatchEventKind.PUT, k, v, relisted) for k, v in listing.items() if known.get(k) != v]
    return events


class EtcdDiscovery:
    """Discovery on etcd. One client for leases and puts; one client per watch, re-created after a failure."""

    def __init__(self, config: RuntimeConfig) -> None:
        self._config = config
        self._endpoints = [parse_host_port(ep, 2379) for ep in config.etcd_endpoints]
        self._endpoint_index = 0
        self._client: aetcd.Client | None = None
        self._leases: dict[int, _LeaseState] = {}
        self._next_handle = 1
        self._closed = False
        self._client_lock = asyncio.Lock()

    # -- connection ---------------------------------------------------------------------------------------------

    # gRPC backs off up to 120 s between reconnection attempts by default; after an etcd restart that would leave
    # keep-alives and puts failing for minutes. Cap it at 1 s.
    _GRPC_OPTIONS = {
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.min_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 1000,
        # gRPC shares subchannels process-wide by default: a new client to an address that another client saw refuse
        # would inherit that subchannel's back-off and fail at once, even though the server is back (seen in CI).
        "grpc.use_local_subchannel_pool": 1,
    }

    def _new_client(self) -> aetcd.Client:
        host, port = self._endpoints[self._endpoint_index % len(self._endpoints)]
        return aetcd.Client(
            host=host,
            port=port,
            timeout=max(1, int(self._config.connect_timeout_s)),
            options=self._GRPC_OPTIONS,
            **etcd_credentials(),
        )

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op``, retrying connection failures (etcd restarting) for up to ``connect_timeout_s``."""
        deadline = time.monotonic() + self._config.connect_timeout_s
        backoff_s = 0.05
        while True:
            try:
                return await op()
            except (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError) as e:
                if time.monotonic() + backoff_s > deadline:
                    raise ConnectError("etcd", ",".join(self._config.etcd_endpoints), f"{what}: {e}") from e
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 0.5)

    async def start(self) -> None:
        """Connect to the first reachable endpoint, for up to ``connect_timeout_s`` in all: a refused connection (etcd
        still starting, or restarting) is tried again on a short back-off. ConnectError names every endpoint tried."""
        deadline = time.monotonic() + self._config.connect_timeout_s
        backoff_s = 0.05
        while True:
            reasons = []
            for i in range(len(self._endpoints)):
                self._endpoint_index = i
                client = self._new_client()
                left = max(0.05, deadline - time.monotonic())
                try:
                    async with asyncio.timeout(left):
                        await self._probe(client)
                except (TimeoutError, aetcd.exceptions.ClientError, OSError) as e:
                    reasons.append(f"{self._config.etcd_endpoints[i]}: {type(e).__name__} {e}".strip())
                    with contextlib.suppress(Exception):
                        await client.close()
                    continue
                self._client = client
                return
            if time.monotonic() + backoff_s >= deadline:
                raise ConnectError("etcd", ",".join(self._config.etcd_endpoints), "; ".join(reasons))
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 0.5)

    @staticmethod
    async def _probe(client: aetcd.Client) -> None:
        await client.connect()
        await client.get(b"kvmesh/__probe__")

    def _c(self) -> aetcd.Client:
        if self._closed or self._client is None:
            raise ShutdownError("discovery is closed")
        return self._client

    async def close(self, *, revoke: bool = True) -> None:
        """Stop keep-alives; with ``revoke`` the leases are revoked so every key vanishes at once."""
        if self._closed:
            return
        for st in self._leases.values():
            if st.task is not None:
                st.task.cancel()
        for st in self._leases.values():
            if st.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await st.task
        if revoke and self._client is not None:
            for st in list(self._leases.values()):
                try:
                    async with asyncio.timeout(2.0):
                        await self._client.revoke_lease(st.server_id)
                except (TimeoutError, aetcd.exceptions.ClientError) as e:
                    logger.warning("could not revoke lease %x on close: %s", st.server_id, e)
        self._closed = True
        if self._client is not None:
            try:
                await self._client.close()
            except Exception as e:  # noqa: BLE001
                logger.debug("closing etcd client: %s", e)

    # -- leases -------------------------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self._retry("grant lease", lambda: self._c().lease(ttl_s))
        handle = self._next_handle
        self._next_handle += 1
        st = _LeaseState(handle=handle, ttl_s=ttl_s, server_id=lease.id, last_ok_s=time.monotonic())
        self._leases[handle] = st
        st.task = asyncio.create_task(self._keep_alive(st), name=f"etcd-keepalive-{lease.id:x}")
        logger.debug("granted lease %x (ttl %d s) as handle %d", lease.id, ttl_s, handle)
        return handle

    def server_lease_id(self, lease: int) -> int:
        return self._leases[lease].server_id

    def lease_reacquisitions(self, lease: int) -> int:
        """How many times this handle's server lease was lost and granted again."""
        return self._leases[lease].num_reacquired

    async def revoke_lease(self, lease: int) -> None:
        st = self._leases.pop(lease, None)
        if st is None:
            return
        if st.task is not None:
            st.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await st.task
        with contextlib.suppress(aetcd.exceptions.ClientError):
            await self._c().revoke_lease(st.server_id)

    async def _keep_alive(self, st: _LeaseState) -> None:
        """Refresh every TTL/3; on loss grant a new lease and put every key again.

        A refresh that reports TTL <= 0 means the server no longer has the lease. A refresh that fails to connect is
        retried with back-off; once etcd answers again the next refresh tells whether the lease survived.
        """
        interval_s = st.ttl_s / 3
        backoff_s = 0.1
        delay_s = interval_s
        while True:
            await asyncio.sleep(delay_s)
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 a cancel (close, revoke_lease) that lands in the loop
                # iteration where the refresh completes is swallowed by wait_for, and this loop then ran on while
                # its canceller awaited it for good (a CI test teardown hung past 120 s; a prefill worker's stop hung
                # at revoking its lease). tests/unit/runtime/test_lease_keep_alive.py
                async with asyncio.timeout(interval_s):
                    reply = await self._c().refresh_lease(st.server_id)
                if reply is None or reply.TTL <= 0:
                    await self._reacquire(st)
                st.last_ok_s = time.monotonic()
                backoff_s = 0.1
                delay_s = interval_s
            except (TimeoutError, aetcd.exceptions.ClientError, OSError) as e:
                # Retry on the back-off, not after another TTL/3: an etcd that comes back without its data must
                # see this process's registrations again within about a second (the back-off's cap), not 3-4 s
                # later while frontends find no instance.
                logger.warning("lease %x keep-alive failed (%s); retrying in %.1f s", st.server_id, e, backoff_s)
                delay_s = backoff_s
                backoff_s = min(backoff_s * 2, self._config.reconnect_backoff_max_s)

    async def _reacquire(self, st: _LeaseState) -> None:
        old = st.server_id
        lease = await self._c().lease(st.ttl_s)
        st.server_id = lease.id
        st.num_reacquired += 1
        for key, value in st.keys.items():
            await self._c().put(key.encode(), value, lease=st.server_id)
        logger.warning("lease %x was lost; re-acquired as %x and restored %d keys", old, lease.id, len(st.keys))

    # -- keys ---------------------------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        server_lease = None
        if lease is not None:
            st = self._leases[lease]
            st.keys[key] = value
            server_lease = st.server_id
        await self._retry(f"put {key}", lambda: self._c().put(key.encode(), value, lease=server_lease))

    async def delete(self, key: str) -> None:
        for st in self._leases.values():
            st.keys.pop(key, None)
        await self._retry(f"delete {key}", lambda: self._c().delete(key.encode()))

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        listing, _ = await self._retry(f"list {prefix}", lambda: self._list(self._c(), prefix))
        return listing

    @staticmethod
    async def _server_revision(client: aetcd.Client) -> int:
        res = await client.get_prefix(b"kvmesh/__revision_probe__")
        return int(res.header.revision)

    @staticmethod
    async def _list(client: aetcd.Client, prefix: str) -> tuple[dict[str, bytes], int]:
        res = await client.get_prefix(prefix.encode())
        return {kv.key.decode(): kv.value for kv in res}, res.header.revision

    async def watch_prefix(self, prefix: str, known: Mapping[str, bytes] | None = None) -> AsyncIterator[WatchEvent]:
        """See the module docstring. Runs until the consumer stops iterating or discovery closes.

        After a broken watch, the new one resumes from the last revision seen, so every change in between arrives
        as it happened. Only when etcd can no longer replay that history (compacted, or the server came back with a
        lower revision: its data was lost) does it list the prefix again and yield the difference.
        """
        seen: dict[str, bytes] = dict(known or {})
        last_rev = 0  # 0: list first
        listed_once = False  # a later listing is a recovery: its DELETEs are marked ``relisted``
        backoff_s = 0.1
        while not self._closed:
            client = self._new_client()
            watch = None
            try:
                if last_rev and await self._server_revision(client) < last_rev:
                    logger.warning("etcd revision went backwards (data lost); re-listing %s", prefix)
                    last_rev = 0
                if not last_rev:
                    listing, last_rev = await self._list(client, prefix)
                    # A DELETE from a listing is "not listed": a key lost with etcd's data (a later listing, or a
                    # first one against the caller's own) as well as a deregistration; the caller tells them apart.
                    for ev in diff_listing(seen, listing, relisted=listed_once or bool(known)):
                        yield ev
                    seen = listing
                    listed_once = True
                watch = await client.watch_prefix(prefix.encode(), start_revision=last_rev + 1)
                backoff_s = 0.1
                async for ev in watch:
                    key = ev.kv.key.decode()
                    last_rev = max(last_rev, ev.kv.mod_revision)
                    if ev.kind == aetcd.rtypes.EventKind.PUT:
                        seen[key] = ev.kv.value
                        yield WatchEvent(WatchEventKind.PUT, key, ev.kv.value)
                    else:
                        seen.pop(key, None)
                        yield WatchEvent(WatchEventKind.DELETE, key, None)
            except aetcd.exceptions.RevisionCompactedError:
                logger.warning("watch history of %s compacted past revision %d; re-listing", prefix, last_rev)
                last_rev = 0
            except (aetcd.exceptions.ClientError, OSError, TimeoutError) as e:
                if self._closed:
                    break
                logger.warning(
                    "watch on %s broke (%s); resuming after revision %d in %.1f s", prefix, e, last_rev, backoff_s
                )
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._config.reconnect_backoff_max_s)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(1.0):
                            await watch.cancel()
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await client.close()
