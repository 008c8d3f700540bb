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

Two kinds of engine serve it:

* **simulated** (``can_import``: ``import_prefix``, ``transfer_time_s``, ``drop_prefix``): the steps above;
* **vLLM** (``can_pull``: ``export_prefix``, ``pull_prefix``): a NIXL hand-off, as a decode worker pulls a remote
  prefill's blocks (engines/vllm/engine.py). The destination asks the source worker's ``export_prefix`` endpoint
  (``PrefixImporter.handle_export`` there): the source's engine maps the prefix's kvmesh hashes to the tokens its
  KV events said those blocks hold, computes them as a request of their own with ``do_remote_decode`` (its prefix
  cache serves all but the last block) and answers the tokens and vLLM's ``kv_transfer_params``; the destination's
  engine submits the same tokens with them and ``max_tokens=1``, so vLLM pulls the blocks, which stay in its prefix
  cache as free cached KV (``BlockStored``: routers see the new holder); the sampled token is discarded. The
  request names hashes only (the rescheduler knows no tokens: the frontends report hashed prefixes), and the source
  is the one worker that surely knows the tokens: it holds the blocks. An engine without the NIXL connector refuses
  both sides with the reason, at once. ``drop_prefix`` on vLLM: ``engine.drop_prefix``'s answer (engine.py).

Owns: the clients of the source workers' ``kv_state`` and ``export_prefix`` endpoints, closed by ``close()``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from components.protocol.endpoints import ENDPOINT_EXPORT_PREFIX, ENDPOINT_KV_STATE
from components.protocol.messages import KvStateSnapshot
from components.protocol.replication import (
    DropPrefixReply,
    DropPrefixRequest,
    ExportPrefixReply,
    ExportPrefixRequest,
    ImportPrefixReply,
    ImportPrefixRequest,
    PrefixCopyMode,
)
from components.runtime import Client, RequestContext, Runtime, RuntimeMeshError
from components.workers.engines.base import EngineError
from components.workers.engines.mock.block_pool import NoFreeBlocksError

logger = logging.getLogger(__name__)


def can_import(engine: object) -> bool:
    """Whether ``engine`` can cache KV sent to it with no request (and model the transfer), and drop it again."""
    return all(callable(getattr(engine, name, None)) for name in ("import_prefix", "transfer_time_s", "drop_prefix"))


def can_pull(engine: object) -> bool:
    """Whether ``engine`` copies a prefix's KV by a hand-off over a KV connector (vLLM): it serves both sides."""
    return all(callable(getattr(engine, name, None)) for name in ("export_prefix", "pull_prefix", "drop_prefix"))


def prefix_copy_mode(engine: object) -> str:
    """What the worker of ``engine`` announces as its ``prefix_copy_mode`` (a ``PrefixCopyMode`` value, "" when it
    cannot copy): a vLLM engine that would refuse every copy (``prefix_copy_refusal``: no NIXL connector, no prefix
    caching) says so in its metadata, so that the rescheduler never picks it for either end. Measured on vLLM: the
    refusal comes at once, but the policy, which sends a hot prefix to the eligible worker predicted lowest, would
    pick the same refusing worker every cycle, and no other worker would get the copy."""
    if can_import(engine):
        return str(PrefixCopyMode.SIMULATED)
    if can_pull(engine):
        refusal = getattr(engine, "prefix_copy_refusal", None)
        return "" if callable(refusal) and refusal() is not None else str(PrefixCopyMode.KV_TRANSFER)
    return ""


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
        self._export_client: Client | None = None

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
        if can_pull(self.engine):
            return await self._pull_prefix(req)
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

    async def _pull_prefix(self, req: ImportPrefixRequest) -> ImportPrefixReply:
        """A copy by a hand-off over the engine's KV connector (module docstring, vLLM). ``transfer_s``: the wall time
        of the pull (the destination's request), measured, not modelled."""
        refusal = self.engine.prefix_copy_refusal()
        if refusal is not None:
            return ImportPrefixReply(error=refusal)  # before asking the source to keep anything
        try:
            if self._export_client is None:
                ns = self.runtime.namespace(self.namespace)
                self._export_client = await ns.component(self.component).endpoint(ENDPOINT_EXPORT_PREFIX).client()
            body = ExportPrefixRequest(req.block_hashes).to_dict()
            items = [item async for item in await self._export_client.direct(body, req.source_id)]
        except (RuntimeMeshError, TimeoutError) as e:
            return ImportPrefixReply(error=f"asking source {req.source_id:x} to export the prefix: {e}")
        export = ExportPrefixReply.from_dict(items[0]) if items else ExportPrefixReply(error="no reply")
        if export.error or not export.kv_transfer_params:
            return ImportPrefixReply(export.held, error=f"source {req.source_id:x}: {export.error or 'no hand-off'}")
        t0 = time.perf_counter()
        try:
            imported, error = await self.engine.pull_prefix(list(export.token_ids), export.kv_transfer_params)
        except EngineError as e:
            return ImportPrefixReply(export.held, error=f"pulling the prefix: {e}")
        transfer_s = time.perf_counter() - t0
        logger.info(
            "worker %x: pulled %d of %d blocks of a prefix from %x in %.1f ms%s",
            self.instance_id,
            imported,
            export.held,
            req.source_id,
            transfer_s * 1e3,
            f" ({error})" if error else "",
        )
        return ImportPrefixReply(export.held, imported, transfer_s, error)

    async def handle_export(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """The source side of a pulled copy (``export_prefix``): keep the prefix's cached blocks for the pull."""
        req = ExportPrefixRequest.from_dict(body)
        try:
            held, tokens, handoff, error = await self.engine.export_prefix(list(req.block_hashes))
        except EngineError as e:
            held, tokens, handoff, error = 0, [], None, f"exporting the prefix: {e}"
        yield ExportPrefixReply(held, tuple(tokens), handoff, error).to_dict()

    async def handle_drop(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        yield (await self.drop_prefix(DropPrefixRequest.from_dict(body))).to_dict()

    async def drop_prefix(self, req: DropPrefixRequest) -> DropPrefixReply:
        """The engine's eviction (a simulated engine's is synchronous; vLLM's a call into its engine core, which
        refuses with the reason where it cannot evict: engines/vllm/engine.py)."""
        try:
            result = self.engine.drop_prefix(list(req.block_hashes))
            dropped, in_use = (await result) if inspect.isawaitable(result) else result
        except EngineError as e:
            n = len(req.block_hashes)
            logger.warning("worker %x: drop of a prefix's %d blocks refused: %s", self.instance_id, n, e)
            return DropPrefixReply(error=str(e))
        logger.info(
            "worker %x: dropped %d of a prefix's %d blocks (%d in use kept)",
            self.instance_id,
            dropped,
            len(req.block_hashes),
            in_use,
        )
        return DropPrefixReply(int(dropped), int(in_use))

    async def close(self) -> None:
        clients = (self._client, self._export_client)
        self._client = self._export_client = None
        for client in clients:
            if client is None:
                continue
            try:
                await client.close()
            except RuntimeMeshError as e:  # each released in its own try: the other still closes
                logger.warning("worker %x: closing a replication client: %s", self.instance_id, e)
