"""``MigrationExecutor``: runs one cycle's migration pairs through the source workers' ``migrate`` endpoints.

Each pair is one call to its SOURCE worker's ``migrate`` endpoint (components/protocol/endpoints.py
``ENDPOINT_MIGRATE``, body ``MigrateRequest``: the destination, which requests (ids, or the selection rule, order and
value) and ``trigger``, the policy's name); the source answers with one ``MigrationReport`` per request it tried to
move, then ends the stream (docs/migration.md). The pairs of one cycle run concurrently, each bounded by its own
``call_timeout_s``; a call that fails or times out is counted and logged, and never stops the others.

Outcomes, per pair (``PairResult``) and summed per policy (``ExecutionCounts``):

- ``attempted``: migrations the source reported (one per request it selected) plus one for each call that ended
  without a report (failed or timed out: the source may have been moving a request when it ended);
- ``committed``: reports whose state is ``committed`` (the request now runs on the destination);
- ``aborted``: reports of an aborted migration (``aborted_by_source``/``aborted_by_destination``: the request goes on
  where it was, so no client sees it);
- ``failed``: calls that raised (the source is gone, it refused the call, its stream broke);
- ``timed_out``: calls with no end of stream within ``call_timeout_s`` (the stream is closed, which cancels the
  source's handler, and a migration in flight there aborts by the agent's own rules);
- ``empty``: calls that ended with no report (the source had no request the selection picked).

Which pairs have a call in flight is ``in_flight`` ((source, destination) ids; the loop passes them to the policies,
so that a source is not chosen again while it still moves requests, nor the reverse of a running pair).

Owns nothing but the calls it makes; imports ``components.runtime``'s client API and the protocol, no mesh client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from components.protocol.endpoints import ENDPOINT_MIGRATE
from components.protocol.migration import MigrateRequest, MigrationReport
from components.runtime import Client, RuntimeMeshError

logger = logging.getLogger(__name__)

COMMITTED = "committed"  # MigrationState.COMMITTED's value (components/migration/states.py), as the report says it


class CallOutcome(enum.StrEnum):
    """How one ``migrate`` call ended."""

    DONE = "done"  # the stream ended normally (its reports say what moved)
    FAILED = "failed"  # the call raised
    TIMED_OUT = "timed_out"  # no end of stream within the call timeout


@dataclasses.dataclass(frozen=True, slots=True)
class MigrationOrder:
    """One pair as the executor sends it: move from ``source_id`` to ``destination_id`` what the selection (or
    ``request_ids``) picks, for ``policy`` (the ``trigger`` the source logs and counts). ``mode`` "" lets the source
    use its engine's best mode."""

    source_id: int
    destination_id: int
    policy: str
    reason: str = ""
    select_rule: str = "num_requests"
    select_order: str = "shortest_running"
    select_value: float = 1.0
    request_ids: tuple[str, ...] = ()
    mode: str = ""
    dst_component: str = ""

    def request(self) -> MigrateRequest:
        return MigrateRequest(
            dst_instance_id=self.destination_id,
            dst_component=self.dst_component,
            select_rule=self.select_rule,
            select_value=self.select_value,
            select_order=self.select_order,
            trigger=self.policy,
            request_ids=list(self.request_ids),
            mode=self.mode,
        )


@dataclasses.dataclass(slots=True)
class PairResult:
    """What one pair's call came to."""

    order: MigrationOrder
    outcome: CallOutcome
    reports: list[MigrationReport] = dataclasses.field(default_factory=list)
    error: str = ""
    duration_s: float = 0.0

    @property
    def num_committed(self) -> int:
        return sum(1 for r in self.reports if r.state == COMMITTED)

    @property
    def num_aborted(self) -> int:
        return sum(1 for r in self.reports if r.state != COMMITTED)

    @property
    def num_attempted(self) -> int:
        """Reports, or 1 for a call that ended without any (it may have been moving a request when it ended)."""
        if self.reports:
            return len(self.reports)
        return 0 if self.outcome == CallOutcome.DONE else 1

    def to_dict(self) -> dict[str, Any]:
        o = self.order
        return {
            "source": o.source_id,
            "destination": o.destination_id,
            "policy": o.policy,
            "reason": o.reason,
            "outcome": str(self.outcome),
            "error": self.error,
            "duration_s": round(self.duration_s, 4),
            "committed": self.num_committed,
            "aborted": self.num_aborted,
            "migrations": [
                {"request_id": r.request_id, "state": r.state, "mode": r.mode, "reason": r.reason} for r in self.reports
            ],
        }


@dataclasses.dataclass(slots=True)
class ExecutionCounts:
    """Outcomes summed over pairs (module docstring)."""

    pairs: int = 0
    attempted: int = 0
    committed: int = 0
    aborted: int = 0
    failed: int = 0
    timed_out: int = 0
    empty: int = 0

    def add(self, result: PairResult) -> None:
        self.pairs += 1
        self.attempted += result.num_attempted
        self.committed += result.num_committed
        self.aborted += result.num_aborted
        if result.outcome == CallOutcome.FAILED:
            self.failed += 1
        elif result.outcome == CallOutcome.TIMED_OUT:
            self.timed_out += 1
        elif not result.reports:
            self.empty += 1

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def counts_by_policy(results: Iterable[PairResult]) -> dict[str, ExecutionCounts]:
    out: dict[str, ExecutionCounts] = {}
    for r in results:
        out.setdefault(r.order.policy, ExecutionCounts()).add(r)
    return out


class MigrateCaller(Protocol):
    """What the executor needs of the request plane: open a stream to one instance (``components.runtime.Client``)."""

    async def direct(self, request: Any, instance_id: int) -> Any: ...


class MigrationExecutor:
    """Runs pairs through ``client`` (a ``Client`` of the workers' ``migrate`` endpoint, or any ``MigrateCaller``)."""

    def __init__(self, client: MigrateCaller, call_timeout_s: float) -> None:
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self.client = client
        self.call_timeout_s = call_timeout_s
        self._in_flight: dict[tuple[int, int], int] = {}  # (source, destination) -> calls in flight
        self.totals: dict[str, ExecutionCounts] = {}  # by policy, since start

    @property
    def in_flight(self) -> frozenset[tuple[int, int]]:
        """(source, destination) of every ``migrate`` call in flight."""
        return frozenset(self._in_flight)

    @property
    def in_flight_sources(self) -> frozenset[int]:
        return frozenset(src for src, _ in self._in_flight)

    async def execute(self, orders: Sequence[MigrationOrder]) -> list[PairResult]:
        """Run every order concurrently; returns one result per order, in order. Never raises for a pair's failure;
        a cancel of the caller cancels every call (and propagates)."""
        if not orders:
            return []
        results = await asyncio.gather(*(self._one(o) for o in orders))
        for r in results:
            self.totals.setdefault(r.order.policy, ExecutionCounts()).add(r)
        return list(results)

    async def _one(self, order: MigrationOrder) -> PairResult:
        key = (order.source_id, order.destination_id)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        t0 = time.monotonic()
        reports: list[MigrationReport] = []
        try:
            async with asyncio.timeout(self.call_timeout_s):
                await self._call(order, reports)
            result = PairResult(order, CallOutcome.DONE, reports)
        except TimeoutError:
            # asyncio.timeout's own TimeoutError, or the runtime's RequestTimeoutError (a TimeoutError too).
            result = PairResult(order, CallOutcome.TIMED_OUT, reports, f"no end of stream in {self.call_timeout_s:g} s")
        except RuntimeMeshError as e:
            result = PairResult(order, CallOutcome.FAILED, reports, str(e))
        except (KeyError, TypeError, ValueError) as e:  # a report that does not parse (a peer of another version)
            result = PairResult(order, CallOutcome.FAILED, reports, f"bad report: {e!r}")
        finally:
            n = self._in_flight[key] - 1
            if n:
                self._in_flight[key] = n
            else:
                del self._in_flight[key]
        result.duration_s = time.monotonic() - t0
        log = logger.info if result.outcome == CallOutcome.DONE else logger.warning
        log(
            "%s: %x -> %x %s (%d committed, %d aborted)%s",
            order.policy,
            order.source_id,
            order.destination_id,
            result.outcome,
            result.num_committed,
            result.num_aborted,
            f": {result.error}" if result.error else "",
        )
        return result

    async def _call(self, order: MigrationOrder, reports: list[MigrationReport]) -> None:
        stream = await self.client.direct(order.request().to_dict(), order.source_id)
        try:
            async for item in stream:
                reports.append(MigrationReport.from_dict(item))
        finally:
            # Closing a stream that did not end cancels the source's handler (a timeout, a cancelled cycle).
            with contextlib.suppress(RuntimeMeshError):
                await stream.aclose()


async def migrate_client(runtime: Any, namespace: str, component: str = "backend") -> Client:
    """A client of ``component``'s ``migrate`` endpoint in ``namespace`` (direct calls only)."""
    return await runtime.namespace(namespace).component(component).endpoint(ENDPOINT_MIGRATE).client()


def totals_to_dict(totals: Mapping[str, ExecutionCounts]) -> dict[str, dict[str, int]]:
    return {policy: c.to_dict() for policy, c in sorted(totals.items())}
