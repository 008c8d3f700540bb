"""The worker's side of hot-prefix replication: its ``import_prefix`` and ``drop_prefix`` endpoints
(``PrefixImporter``).

The rescheduler (components/rescheduler/replication.py) asks a worker to copy a prefix's KV from a source worker
that holds it, off the request path. The importer:

1. asks the source worker's ``kv_state`` endpoint which blocks it holds (the source side of the hand-off: only the
   run of the prefix's blocks from its start that the source still caches is copied; blocks it evicted meanwhile
   are not invented);
2. waits the engine's modelled transfer of those blocks (``transfer_time_s``: the same model as migration's and
   disaggregation's hand-off on simulated engines, e.g. 512 blocks of 2 MiB at 400 Gb/s: 1 ms + 21.5 ms);
3. has its engine cache them (``import_prefix``): the engine publishes ``BLOCK_STORED``, so routers see a new
   holder and a later request with the prefix hits them.

``drop_prefix`` is the drop of a cold replica: the engine evicts the prefix's cached blocks that no request uses
(``drop_prefix``; ``BLOCK_REMOVED``, so routers forget this holder) and the reply says how many.

Served only by workers whose engine has ``import_prefix`` and ``drop_prefix`` (simulated engines). vLLM would pull
the blocks over NIXL as a decode worker pulls a remote prefill's, and evict them through its KV manager; neither is
built (docs/rescheduler.md).

Owns: the client of the source workers' ``kv_state`` endpoint, closed by ``close()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from components.protocol.endpoints import ENDPOINT_KV_STATE
from components.protocol.messages import KvStateSnapshot
from components.protocol.replication import DropPrefixReply, DropPrefixRequest, ImportPrefixReply, ImportPrefixRequest
from components.runtime import Client, RequestContext, Runtime, RuntimeMeshError
from components.workers.engines.mock.block_pool import NoFreeBlocksError

logger = logging.getLogger(__name__)


def can_import(engine: object) -> bool:
    """Whether ``engine`` can cache KV sent to it with no request (and model the transfer), and drop it again."""
    return all(callable(getattr(engine, name, None)) for name in ("import_prefix", "transfer_time_s", "drop_prefix"))


def held_run(block_hashes: tuple[int, ...], cached: set[int]) -> int:
    """How many of ``block_hashes``, from the first, are all in ``cached`` (a prefix is usable only from its start)."""
    n = 0
    for h in block_hashes:
        if h not in cached:
            break
        n += 1
    return n


class PrefixImporter:
    def __init__(self, runtime: Runtime, namespace: str, component: str, engine: Any, instance_id: int) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.component = component
        self.engine = engine
        self.instance_id = instance_id
        self._client: Client | None = None

    async def _source_cache(self, source_id: int) -> set[int]:
        if self._client is None:
            ns = self.runtime.namespace(self.namespace)
            self._client = await ns.component(self.component).endpoint(ENDPOINT_KV_STATE).client()
        items = [item async for item in await self._client.direct({}, source_id)]
        return set(KvStateSnapshot.from_dict(items[0]).block_hashes) if items else set()

    async def handle(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        yield (await self.import_prefix(ImportPrefixRequest.from_dict(body))).to_dict()

    async def import_prefix(self, req: ImportPrefixRequest) -> ImportPrefixReply:
        if req.source_id == self.instance_id:
            return ImportPrefixReply(error="the source is this worker")
        try:
            held = held_run(req.block_hashes, await self._source_cache(req.source_id))
        except (RuntimeMeshError, TimeoutError) as e:
            return ImportPrefixReply(error=f"asking source {req.source_id:x} for its KV state: {e}")
        if held == 0:
            return ImportPrefixReply(error=f"source {req.source_id:x} holds none of the prefix")
        transfer_s = float(self.engine.transfer_time_s(held))
        if transfer_s > 0:
            await asyncio.sleep(transfer_s)  # the modelled hand-off of `held` blocks
        try:
            imported = int(self.engine.import_prefix(list(req.block_hashes[:held])))
        except NoFreeBlocksError as e:
            return ImportPrefixReply(held, 0, transfer_s, f"no room: {e}")
        logger.info(
            "worker %x: imported %d of %d blocks of a prefix from %x (%.1f ms transfer)",
            self.instance_id,
            imported,
            held,
            req.source_id,
            transfer_s * 1e3,
        )
        return ImportPrefixReply(held, imported, transfer_s)

    async def handle_drop(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        yield self.drop_prefix(DropPrefixRequest.from_dict(body)).to_dict()

    def drop_prefix(self, req: DropPrefixRequest) -> DropPrefixReply:
        dropped, in_use = self.engine.drop_prefix(list(req.block_hashes))
        logger.info(
            "worker %x: dropped %d of a prefix's %d blocks (%d in use kept)",
            self.instance_id,
            dropped,
            len(req.block_hashes),
            in_use,
        )
        return DropPrefixReply(int(dropped), int(in_use))

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
