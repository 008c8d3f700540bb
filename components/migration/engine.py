"""What the migration agent needs of an engine: the contract the simulated engine (live) and the vLLM adapter
(recompute) implement, and the marker an engine's stream yields when a request is suspended.

The **source** side:

- ``request_table()``: the requests selection reads (``types.RequestTable``);
- ``kv_extent(request_id)``: the whole blocks of KV the request has now (count, and the tokens they hold), read
  stage after stage by a live pre-copy; None when the engine does not know the request;
- ``suspend(request_id)``: stop scheduling the request at the next step boundary. Its ``generate`` stream first
  delivers every token produced before, then yields one ``SuspendedChunk``, then waits; False when the request is
  unknown or already finished. ``suspended_state(request_id)``: the request as a ``MigratingRequest`` (prompt,
  outputs, sampling, how many tokens have KV); ``resume(request_id)``: the migration failed, schedule it again (its
  stream goes on). Closing a suspended request's stream frees it (after a commit: the source's copy is released).
- ``transfer_time_s(num_blocks)``: how long sending that many blocks takes (the simulated engine's model; an engine
  whose transfers take real time answers 0).

The **destination** side, live: ``reserve_migration`` (blocks for the KV to come, sharing what its prefix cache
holds: returns how many leading blocks it already has, or None without room), ``extend_migration`` (more blocks, a
later pre-copy stage), ``cancel_migration`` (free them); and for both modes ``commit_migration`` (the request joins
the engine: with the KV reserved for ``migration_id`` when given, else by recompute; returns its output stream,
chunks numbered from the request's position).

A KV-transfer mode for an engine that can export blocks (vLLM with a KV connector) implements the same calls:
``reserve_migration`` would register the request with the connector (its remote blocks named), each stage's copy
the connector's transfer, ``commit_migration`` the request's admission with ``do_remote_prefill`` params
(components/workers/engines/vllm/engine.py says where).

Imports: the protocol package and this package's ``types``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from components.migration.types import RequestTable
from components.protocol.messages import TokenChunk
from components.protocol.migration import MigratingRequest


@dataclasses.dataclass(slots=True)
class SuspendedChunk(TokenChunk):
    """Yielded by an engine's stream once a suspended request has delivered every token it produced: the agent's
    cue to hand it over (or resume it). Never sent to a client."""


@dataclasses.dataclass(frozen=True, slots=True)
class KvExtent:
    """A request's KV at one instant: ``num_full_blocks`` whole blocks, holding ``token_ids`` (their tokens, in
    order: ``num_full_blocks * block_size`` of them), and ``num_blocks`` blocks in all (the last may be partial)."""

    num_full_blocks: int
    num_blocks: int
    token_ids: list[int]


@runtime_checkable
class MigratableEngine(Protocol):
    """An engine the migration agent can move requests off and onto (module docstring)."""

    block_size: int
    migration_mode: str  # protocol.migration.MigrationMode's value

    def request_table(self) -> RequestTable: ...

    def kv_extent(self, request_id: str) -> KvExtent | None: ...

    def suspend(self, request_id: str) -> bool: ...

    def suspended_state(self, request_id: str) -> MigratingRequest | None: ...

    def resume(self, request_id: str) -> bool: ...

    def transfer_time_s(self, num_blocks: int) -> float: ...

    def reserve_migration(self, migration_id: str, request_id: str, token_ids: list[int]) -> int | None: ...

    def extend_migration(self, migration_id: str, token_ids: list[int]) -> bool: ...

    def cancel_migration(self, migration_id: str) -> bool: ...

    def commit_migration(self, migration_id: str | None, request: MigratingRequest) -> AsyncIterator[TokenChunk]: ...

    async def abort(self, request_id: str) -> None: ...


def supports_migration(engine: object) -> bool:
    """Whether ``engine`` implements the contract (the worker then runs an agent for it)."""
    return isinstance(engine, MigratableEngine)
