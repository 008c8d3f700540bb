"""The explicit state machine of one migration, and the per-worker table that caps and counts them.

A migration, on either side, goes through::

    pending --> pre_copying --> final_stage --> committed
       |             |               |
       +-------------+---------------+--> aborted_by_source | aborted_by_destination

- ``pending``: accepted (a slot under ``max_migration_concurrency`` is taken; on the destination, blocks are
  reserved), nothing copied yet;
- ``pre_copying``: live migration only: KV blocks are copied while the request keeps decoding on the source,
  stage after stage (the blocks that exist, then those produced meanwhile);
- ``final_stage``: the request is suspended on the source; the rest of its KV (or, by recompute, nothing) and the
  request itself go to the destination;
- ``committed``: it runs on the destination and is freed on the source; ``aborted_by_source``: the source gave up
  (the request finished or was aborted meanwhile, too many stages, the destination's side timed out on the source
  side); ``aborted_by_destination``: the destination refused or failed (no room, at its cap, gone). After an abort
  the request runs on the source as before and the destination holds nothing of it.

A recompute migration skips ``pre_copying``. Terminal states have no way out; any other move raises
``IllegalTransitionError`` (a bug in the caller, never a runtime condition).

``MigrationTable`` holds one worker's migrations in both directions: at most ``max_concurrent`` active at once
(the seed counts outgoing and incoming together: a worker busy sending is not the one to receive), never two of the
same request, counters by direction and outcome, and ``stalled`` for the destination's watchdog (an incoming
migration that heard nothing from its source for too long).

Pure: no clock (every method takes ``now_s``), no asyncio, no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter

from components.migration.errors import IllegalTransitionError


class MigrationState(enum.StrEnum):
    PENDING = "pending"
    PRE_COPYING = "pre_copying"
    FINAL_STAGE = "final_stage"
    COMMITTED = "committed"
    ABORTED_BY_SOURCE = "aborted_by_source"
    ABORTED_BY_DESTINATION = "aborted_by_destination"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL


_ABORTS = {MigrationState.ABORTED_BY_SOURCE, MigrationState.ABORTED_BY_DESTINATION}
TERMINAL = frozenset({MigrationState.COMMITTED, *_ABORTS})
ALLOWED: dict[MigrationState, frozenset[MigrationState]] = {
    MigrationState.PENDING: frozenset({MigrationState.PRE_COPYING, MigrationState.FINAL_STAGE, *_ABORTS}),
    MigrationState.PRE_COPYING: frozenset({MigrationState.FINAL_STAGE, *_ABORTS}),
    MigrationState.FINAL_STAGE: frozenset({MigrationState.COMMITTED, *_ABORTS}),
}


class Direction(enum.StrEnum):
    OUT = "out"  # this worker is the source
    IN = "in"  # this worker is the destination


@dataclasses.dataclass(slots=True)
class Migration:
    """One migration as one side sees it. Times are the caller's monotonic clock."""

    migration_id: str
    request_id: str
    direction: Direction
    peer_instance_id: int
    started_s: float
    state: MigrationState = MigrationState.PENDING
    updated_s: float = 0.0  # the last transition, or the last message from the peer (``touch``)
    num_stages: int = 0  # pre-copy stages run, the final stage included
    num_blocks: int = 0  # KV blocks copied (out) or received (in)
    num_cached_blocks: int = 0  # leading blocks the destination's prefix cache held (not copied)
    suspended_s: float | None = None  # when the final stage suspended the request (out)
    ended_s: float | None = None
    reason: str = ""
    # How it moves (a ``protocol.migration.MigrationMode`` value): the one tried, then the one that ran; counted with
    # its outcome (``MigrationTable.by_mode``).
    mode: str = ""

    @property
    def downtime_s(self) -> float:
        """How long the request was suspended: final stage to the end (0 if it never was)."""
        if self.suspended_s is None or self.ended_s is None:
            return 0.0
        return self.ended_s - self.suspended_s


class MigrationTable:
    """One worker's migrations (module docstring). ``begin`` returns None instead of raising when the cap is
    reached or the request is already migrating: both are ordinary answers ("not now")."""

    def __init__(self, max_concurrent: int) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self._active: dict[str, Migration] = {}
        self._by_request: dict[str, str] = {}
        # (direction, terminal state) -> count; the same by mode too; plus refusals at the cap, by direction.
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.by_mode: Counter[tuple[str, str, str]] = Counter()
        self.refused: Counter[str] = Counter()

    @property
    def active(self) -> list[Migration]:
        return list(self._active.values())

    def __len__(self) -> int:
        return len(self._active)

    def has_slot(self) -> bool:
        return len(self._active) < self.max_concurrent

    def get(self, migration_id: str) -> Migration | None:
        return self._active.get(migration_id)

    def of_request(self, request_id: str) -> Migration | None:
        mid = self._by_request.get(request_id)
        return None if mid is None else self._active.get(mid)

    def is_migrating(self, request_id: str) -> bool:
        return request_id in self._by_request

    def begin(
        self, migration_id: str, request_id: str, direction: Direction, peer_instance_id: int, now_s: float
    ) -> Migration | None:
        """A new migration in ``pending``; None when at the cap or the request already migrates (counted in
        ``refused``)."""
        if not self.has_slot() or request_id in self._by_request or migration_id in self._active:
            self.refused[str(direction)] += 1
            return None
        m = Migration(migration_id, request_id, direction, peer_instance_id, now_s, updated_s=now_s)
        self._active[migration_id] = m
        self._by_request[request_id] = migration_id
        return m

    def advance(self, migration_id: str, state: MigrationState, now_s: float, reason: str = "") -> Migration:
        """Move an active migration to ``state``; a terminal state ends it (it leaves the table and is counted)."""
        m = self._active.get(migration_id)
        if m is None:
            raise IllegalTransitionError(migration_id, "(not active)", str(state))
        if state not in ALLOWED.get(m.state, frozenset()):
            raise IllegalTransitionError(migration_id, str(m.state), str(state))
        if state == MigrationState.FINAL_STAGE and m.direction == Direction.OUT:
            m.suspended_s = now_s
        m.state = state
        m.updated_s = now_s
        if reason:
            m.reason = reason
        if state.is_terminal:
            m.ended_s = now_s
            del self._active[migration_id]
            if self._by_request.get(m.request_id) == migration_id:
                del self._by_request[m.request_id]
            self.outcomes[(str(m.direction), str(state))] += 1
            self.by_mode[(str(m.direction), str(state), m.mode)] += 1
        return m

    def touch(self, migration_id: str, now_s: float) -> None:
        """The peer was heard from (the destination's watchdog counts silence from here)."""
        m = self._active.get(migration_id)
        if m is not None:
            m.updated_s = now_s

    def stalled(self, now_s: float, timeout_s: float) -> list[Migration]:
        """Incoming migrations not yet committed whose source has been silent for ``timeout_s``."""
        return [m for m in self._active.values() if m.direction == Direction.IN and now_s - m.updated_s >= timeout_s]

    def counters(self) -> dict[str, int]:
        """Outcomes as flat names (``out_committed``, ``in_aborted_by_source``, ``out_refused``, ...)."""
        out = {f"{d}_{s}": n for (d, s), n in self.outcomes.items()}
        out.update({f"{d}_refused": n for d, n in self.refused.items()})
        return out

    def outcome_counts(self) -> list[tuple[str, str, str, int]]:
        """(direction, outcome, mode, count) rows, sorted: every terminal outcome by mode, and refusals at the cap
        (outcome ``refused``, mode "")."""
        rows = [(d, s, mode, n) for (d, s, mode), n in self.by_mode.items()]
        rows += [(d, "refused", "", n) for d, n in self.refused.items()]
        return sorted(rows)
