"""What the migration agent needs of an engine: the contract the simulated engine (live) and the vLLM adapter
(kv_transfer or recompute) implement, and the marker an engine's stream yields when a request is suspended.

The **source** side:

- ``request_table()``: the requests selection reads (``types.RequestTable``);
- ``kv_extent(request_id)``: the whole blocks of KV the request has now (count, and the tokens they hold), read
  stage after stage by a live pre-copy, once (to reserve room on the destination) by kv_transfer; None when the
  engine does not know the request (or moves no KV);
- ``suspend(request_id)``: stop scheduling the request at the next step boundary. Its ``generate`` stream first
  delivers every token produced before, then yields one ``SuspendedChunk``, then waits; False when the request is
  unknown or already finished. ``suspended_state(request_id)``: the request as a ``MigratingRequest`` (prompt,
  outputs, sampling, how many tokens have KV); ``resume(request_id)``: the migration failed, schedule it again (its
  stream goes on). Closing a suspended request's stream frees it (after a commit: the source's copy is released).
- ``transfer_time_s(num_blocks)``: how long sending that many blocks takes (the simulated engine's model; an engine
  whose transfers take real time answers 0).
- ``export_kv(request_id)`` (kv_transfer): once suspended, make the request's whole KV (prompt + outputs) pullable
  by another engine and return the hand-off that names it (the engine's own terms, carried opaque in
  ``MigratingRequest.kv_transfer_params``); None when it cannot (the destination then computes it again). Engines
  of other modes return None.

The **destination** side, live and kv_transfer: ``reserve_migration`` (room for the KV to come, sharing what its
prefix cache holds: returns how many leading blocks it already has, or None without room; an engine that cannot
set blocks aside ahead of a request, as vLLM, checks its free blocks and remembers the migration),
``extend_migration`` (more blocks, a later pre-copy stage), ``cancel_migration`` (free them); and for every mode
``commit_migration`` (the request joins the engine: with the KV reserved for ``migration_id`` when given, else by
recompute; with ``request.kv_transfer_params`` its engine pulls the KV they name, and an engine that cannot use them
clears them from ``request`` and computes the request again; returns its output stream, chunks numbered from the
request's position).

The three modes (``protocol.migration.MigrationMode``) use the calls so: **live** reserves, pre-copies stage after
stage while the request decodes, suspends, copies the rest and commits; **kv_transfer** (vLLM with its NIXL
connector: it cannot export a running request's KV) reserves, suspends, exports and commits, and the destination's
engine pulls; **recompute** suspends and commits.

Imports: the protocol package and this package's ``types``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

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

    async def export_kv(self, request_id: str) -> dict[str, Any] | None: ...

    def reserve_migration(self, migration_id: str, request_id: str, token_ids: list[int]) -> int | None: ...

    def extend_migration(self, migration_id: str, token_ids: list[int]) -> bool: ...

    def cancel_migration(self, migration_id: str) -> bool: ...

    def commit_migration(self, migration_id: str | None, request: MigratingRequest) -> AsyncIterator[TokenChunk]: ...

    async def abort(self, request_id: str) -> None: ...


def supports_migration(engine: object) -> bool:
    """Whether ``engine`` implements the contract (the worker then runs an agent for it)."""
    return isinstance(engine, MigratableEngine)
