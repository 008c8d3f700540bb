"""What a routing policy sees and returns: plain dataclasses, no I/O.

A policy is a pure function ``select(request, workers, state) -> (RouteDecision, state)`` over these (STYLE.md habit 1);
``components.router.adapter.Router`` builds them from discovery and from its own bookkeeping of requests in flight.

This module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar


@dataclasses.dataclass(slots=True, frozen=True)
class RouteRequest:
    """One request to place. ``now_s`` is the caller's monotonic clock (a policy never reads one itself)."""

    token_ids: Sequence[int]
    model: str
    now_s: float
    program_id: str | None = None  # a multi-turn conversation or agent program, for affinity policies
    pinned_instance_id: int | None = None  # the caller insists on this worker (a migration, a debugging client)
    excluded_instance_ids: frozenset[int] = frozenset()  # workers already tried for this request (retries)


@dataclasses.dataclass(slots=True, frozen=True)
class WorkerSnapshot:
    """One worker as the router knows it at ``RouteRequest.now_s``.

    ``active_requests`` and ``active_prompt_tokens`` are the router's own count of what it sent there and has not seen
    finish; load reported by the worker itself (KV usage, queue length) is added by the router issue.
    """

    instance_id: int
    metadata: Mapping[str, Any]
    active_requests: int = 0
    active_prompt_tokens: int = 0


@dataclasses.dataclass(slots=True, frozen=True)
class RouteDecision:
    """Where to send a request, and why. ``instance_id`` None means "nowhere": the reason says what was missing."""

    instance_id: int | None
    reason: str


S = TypeVar("S")


class RoutingPolicy(Protocol[S]):
    """A routing policy: a readable ``name`` and a pure ``select``.

    ``workers`` come in ascending ``instance_id`` order, so a policy that walks them is deterministic given its state.
    """

    name: str

    def initial_state(self) -> S: ...

    def select(self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: S) -> tuple[RouteDecision, S]: ...
