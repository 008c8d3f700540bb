"""The ``virtual`` environment: the planner writes each pool's target size into etcd and an outside system (a test,
the fleet simulator) makes it so and says when it has.

Keys, under the deployment's namespace and the served model (percent-encoded: a model name may hold '/'):

    kvmesh/<ns>/planner/virtual/<model>/<pool>/target   written by the planner: {"count": n, "request_id": "..."}
    kvmesh/<ns>/planner/virtual/<model>/<pool>/done     written by the outside system when the pool has n workers:
                                                        the same {"count": n, "request_id": "..."}

``set_pool_size`` writes ``target`` (without a lease: a planner that restarts finds the last target still there,
and an outside system that restarts finds what it was asked) and waits, by a watch on ``done``, for the request id
it wrote; a ``done`` for an older request does not count. No answer within ``timeout_s``: ``ScalingTimeoutError``.
``VirtualRequest`` and the two key functions are public so the outside system reads and answers the same format.

All etcd access goes through ``Runtime.discovery`` (components/runtime is the only etcd importer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from urllib.parse import quote

from components.planner.config import DEFAULT_SCALING_TIMEOUT_S
from components.planner.connectors.base import ConnectorError, ScalingTimeoutError
from components.planner.policy import Pool
from components.runtime import Runtime
from components.runtime.discovery import WatchEventKind
from components.runtime.errors import RuntimeMeshError

logger = logging.getLogger(__name__)

# An outside system that starts a simulated worker answers in well under a second; one that starts a real engine
# (model load, CUDA graphs) takes minutes: PlannerRunConfig.scaling_timeout_s.
DEFAULT_TIMEOUT_S = DEFAULT_SCALING_TIMEOUT_S


def pool_prefix(namespace: str, model: str, pool: Pool) -> str:
    return f"kvmesh/{namespace}/planner/virtual/{quote(model, safe='')}/{pool}/"


def target_key(namespace: str, model: str, pool: Pool) -> str:
    return pool_prefix(namespace, model, pool) + "target"


def done_key(namespace: str, model: str, pool: Pool) -> str:
    return pool_prefix(namespace, model, pool) + "done"


@dataclasses.dataclass(frozen=True, slots=True)
class VirtualRequest:
    """One target (or its answer): the pool's worker count and the id that ties an answer to its request."""

    count: int
    request_id: str

    def to_json(self) -> bytes:
        return json.dumps({"count": self.count, "request_id": self.request_id}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> VirtualRequest:
        d = json.loads(data)
        return cls(count=int(d["count"]), request_id=str(d["request_id"]))


class VirtualConnector:
    name = "virtual"

    def __init__(self, runtime: Runtime, namespace: str, model: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.model = model
        self.timeout_s = timeout_s

    async def start(self) -> None:
        """Nothing to pick up: the last targets stay in etcd for the outside system, which answers or not."""

    async def set_pool_size(self, pool: Pool, count: int) -> None:
        discovery = self.runtime.discovery
        request = VirtualRequest(count, uuid.uuid4().hex)
        # The watch lists the prefix when first iterated (after the put below) and yields every key it lists, then
        # every change: an answer written before the listing is seen in it, a later one in the watch, and an older
        # request's answer is skipped by its id.
        watch = discovery.watch_prefix(pool_prefix(self.namespace, self.model, pool))
        answer_key = done_key(self.namespace, self.model, pool)
        try:
            await discovery.put(target_key(self.namespace, self.model, pool), request.to_json())
            logger.info("virtual: asked for %d %s workers (request %s)", count, pool, request.request_id)
            try:
                async with asyncio.timeout(self.timeout_s):
                    async for ev in watch:
                        if ev.key != answer_key or ev.kind != WatchEventKind.PUT or ev.value is None:
                            continue
                        try:
                            answer = VirtualRequest.from_json(ev.value)
                        except (ValueError, KeyError, TypeError) as e:
                            logger.warning("virtual: unreadable answer at %s: %r", answer_key, e)
                            continue
                        if answer.request_id == request.request_id:
                            logger.info("virtual: %s pool at %d workers", pool, answer.count)
                            return
            except TimeoutError:
                raise ScalingTimeoutError(self.name, pool, count, self.timeout_s) from None
        finally:
            # Discovery.watch_prefix is typed as an AsyncIterator; the etcd one is an async generator, whose watch
            # (a server-side stream) is released only by closing it.
            aclose = getattr(watch, "aclose", None)
            if aclose is not None:
                await aclose()
        raise ConnectorError(self.name, pool, count, "discovery closed before the change was reported done")

    async def pool_size(self, pool: Pool) -> int | None:
        """The outside system's last answer (its ``done`` count: what it says the pool has; it may write one by
        itself, a hand change), None before any."""
        try:
            key = done_key(self.namespace, self.model, pool)
            value = (await self.runtime.discovery.get_prefix(key)).get(key)
        except RuntimeMeshError as e:
            raise ConnectorError(self.name, pool, None, f"reading its size: {e}") from e
        if value is None:
            return None
        try:
            return VirtualRequest.from_json(value).count
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectorError(self.name, pool, None, f"unreadable answer: {e!r}") from e

    def gpus_per_worker(self, pool: Pool) -> int | None:
        """Unknown: the outside system's workers count as the config's ``*_engine_num_gpu``."""
        return None

    async def close(self) -> None:
        """Nothing held between calls: each ``set_pool_size`` owns its watch."""
