"""The engine contract: what every engine (simulated or real vLLM) offers to the worker process.

The messages it speaks (``GenerateRequest``, ``TokenChunk``, ``LoadSnapshot``, ``KvEvent`` ...) are the wire contract
of the whole mesh and live in ``components.protocol``; this module holds what only workers and engines share: the
``Engine`` protocol, the engine errors, and what a disaggregated worker announces of its engine
(``remote_prefill_mode_of``).

Imports: the standard library and ``components.protocol``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from components.protocol.errors import ErrorCode
from components.protocol.messages import GenerateRequest, KvEvent, KvStateSnapshot, LoadSnapshot, TokenChunk
from components.protocol.metadata import RemotePrefillMode, WorkerRole


class EngineError(Exception):
    """Root of engine errors."""


class EngineRequestError(EngineError):
    """One request failed (bad parameters, prompt too long); the engine keeps serving. The client's to fix: it
    travels as ``request_invalid`` (an HTTP 400), never retried elsewhere."""

    wire_code = ErrorCode.REQUEST_INVALID
    wire_param: str | None = None


class EngineDeadError(EngineError):
    """The engine cannot serve any more requests. Fatal for the worker; another worker may serve the request."""

    wire_code = ErrorCode.ENGINE_DEAD


@runtime_checkable
class Engine(Protocol):
    """What the worker needs of an engine.

    Migration hooks (export/import of a running request's state) are added by the rescheduler issue as optional
    methods; the worker checks for them with ``hasattr``. Likewise optional: ``remote_prefill_mode``, a
    ``RemotePrefillMode`` saying how the engine takes a remotely prefilled prompt (``remote_prefill_mode_of``). An
    optional attribute, not a protocol member: a ``runtime_checkable`` protocol checks data members too, and every
    engine (test doubles included) would have to grow one. And ``prefill_handoff(request)``: prefill a prompt and
    keep its KV for another engine to pull, returning the first chunk and where the KV is (vLLM with NIXL); a
    prefill worker uses it when the decode worker will pull (components/workers/disagg.py).
    """

    block_size: int
    max_model_len: int  # prompt + output tokens one request may hold; the frontend rejects longer ones up front

    async def start(self) -> None:
        """Allocate resources; called once before the first request."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """(An async generator.) Stream the request's output.

        Closing the iterator early aborts the request and frees its blocks.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (waiting or running) and free its blocks; unknown ids are ignored."""
        ...

    def snapshot(self) -> LoadSnapshot:
        """The current load; cheap, no I/O."""
        ...

    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        """Batches of KV events in event-id order, for the life of the engine (one consumer)."""
        ...

    def kv_state(self) -> KvStateSnapshot:
        """Everything the prefix cache holds now, for a router to resynchronise."""
        ...

    def dead_reason(self) -> str | None:
        """Why the engine can serve no more requests (its engine process died, its loop crashed); None while it
        can. Cheap, no I/O: the worker polls it to leave the fleet instead of failing every request routed to it."""
        ...

    async def shutdown(self) -> None:
        """Abort what is left and release resources."""
        ...


def remote_prefill_mode_of(engine: object, role: WorkerRole) -> str:
    """The ``remote_prefill_mode`` a worker of ``role`` running ``engine`` announces (``WorkerMetadata``): "" for an
    aggregated worker, which never prefills remotely; else the engine's declared ``remote_prefill_mode``. An engine
    that declares none is announced as ``recompute``: with no way to receive KV blocks, its decode worker would have
    to compute the prompt again, and saying so beats promising a transfer that never comes."""
    if role == WorkerRole.AGGREGATED:
        return ""
    return str(getattr(engine, "remote_prefill_mode", RemotePrefillMode.RECOMPUTE))
