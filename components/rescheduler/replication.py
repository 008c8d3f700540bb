"""The rescheduler's side of hot-prefix replication's calls: ``copy_prefix`` asks a destination worker's
``import_prefix`` endpoint (components/workers/replication.py) to copy a prefix's KV from a source worker;
``drop_prefix`` asks a holder's ``drop_prefix`` endpoint to evict a replica that went cold.

The loop's adapter around the pure policy (replicator.py, ``LiveReplicator``) calls them for each ``COPY`` and
``DROP`` action (docs/rescheduler.md, "Hot-prefix replication").
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from components.protocol.endpoints import ENDPOINT_DROP_PREFIX, ENDPOINT_IMPORT_PREFIX
from components.protocol.replication import DropPrefixReply, DropPrefixRequest, ImportPrefixReply, ImportPrefixRequest
from components.runtime import Client, Runtime


async def import_prefix_client(runtime: Runtime, namespace: str, component: str) -> Client:
    """A client of the workers' ``import_prefix`` endpoint (close it when done)."""
    return await runtime.namespace(namespace).component(component).endpoint(ENDPOINT_IMPORT_PREFIX).client()


async def copy_prefix(
    client: Client, destination_id: int, source_id: int, block_hashes: Sequence[int], timeout_s: float
) -> ImportPrefixReply:
    """Copy the prefix named by ``block_hashes`` (chained, from its start) from ``source_id`` to ``destination_id``;
    the destination's reply (its ``error`` says why nothing was copied). ``TimeoutError`` past ``timeout_s``."""
    body = ImportPrefixRequest(source_id, tuple(block_hashes)).to_dict()

    async def call() -> ImportPrefixReply:
        items = [item async for item in await client.direct(body, destination_id)]
        return ImportPrefixReply.from_dict(items[0]) if items else ImportPrefixReply(error="no reply")

    async with asyncio.timeout(timeout_s):
        return await call()


async def drop_prefix_client(runtime: Runtime, namespace: str, component: str) -> Client:
    """A client of the workers' ``drop_prefix`` endpoint (close it when done)."""
    return await runtime.namespace(namespace).component(component).endpoint(ENDPOINT_DROP_PREFIX).client()


async def drop_prefix(
    client: Client, instance_id: int, block_hashes: Sequence[int], timeout_s: float
) -> DropPrefixReply:
    """Ask ``instance_id`` to evict the cached blocks of the prefix named by ``block_hashes`` that no request uses;
    its reply (``dropped``, ``in_use``). ``TimeoutError`` past ``timeout_s``."""
    body = DropPrefixRequest(tuple(block_hashes)).to_dict()

    async def call() -> DropPrefixReply:
        items = [item async for item in await client.direct(body, instance_id)]
        return DropPrefixReply.from_dict(items[0]) if items else DropPrefixReply(error="no reply")

    async with asyncio.timeout(timeout_s):
        return await call()
