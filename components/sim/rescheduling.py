"""``PolicyRescheduler``: the live rescheduler's cycle on the simulator's clock (a ``Rescheduler`` of dynamics.py).

Each cycle (every ``rescheduling_interval_ms`` of virtual time, called by ``replay``):

1. the plan is ``components.rescheduler.loop.policy_planner(config)``, the very function the live loop calls: the
   snapshot's instance views (components/rescheduler/views.py) through ``plan_cycle`` given the pairs in flight;
2. as the live loop does, an order whose source still has a migration in flight is skipped (one migrate call per
   source at a time), whatever the plan said;
3. each order becomes ``Migration``s by the migration agent's own selection, ``select_requests`` (components/
   migration/policies/selection.py), over the source's request table built from what ``replay`` hands over: its
   running requests that have produced a token, in the replay's order (arrival order: the engine's running order
   unless a preemption reordered it), its waiting queue in queue order (never admitted or preempted: no KV, so
   the replay moves them at once with nothing to transfer; FCW and FCWSR take them), and the KV capacity from the
   worker's load report (total blocks x block size, RATIO's base);
4. a pair stays in flight, as the live executor's migrate call does, until every request it moved has landed on its
   destination or finished before it could leave (``replay`` calls ``migration_done``).

Counters, as the live loop's (components/rescheduler/loop.py): cycles, pairs by policy, requests moved by policy,
pairs skipped because their source was busy, and refusals by policy.

What differs from a live deployment: a migration here fails only one way, as the live agent's "aborted by
destination": a destination without room for the request's KV when its source stops it refuses, and the request
stays on its source (replay.py, ``RunResult.migrations_refused``; before, the destination recomputed it, a
preemption no engine counted). No call times out and no transfer fails.

Imports: components.rescheduler (rank 5: its config, planner and views), components.migration (4: the selection),
this package's dynamics, and the standard library.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from components.fleet.model import FleetSnapshot
from components.migration.policies.selection import select_requests
from components.migration.types import RequestTable, RequestView
from components.perf.model import BLOCK_SIZE
from components.rescheduler.config import ReschedulerConfig
from components.rescheduler.executor import MigrationOrder
from components.rescheduler.loop import CyclePlanner, policy_planner

from .dynamics import Migration, RunningRequest


@dataclasses.dataclass(slots=True)
class _Pair:
    """One order being carried out: its requests not yet landed."""

    source_id: int
    destination_id: int
    policy: str
    pending: set[str]


class PolicyRescheduler:
    """The rescheduler's policies in ``replay`` (module docstring)."""

    def __init__(self, config: ReschedulerConfig, plan: CyclePlanner | None = None) -> None:
        self.config = config
        self.plan = plan if plan is not None else policy_planner(config)
        self.num_cycles = 0
        self.pairs_by_policy: collections.Counter[str] = collections.Counter()
        self.migrations_by_policy: collections.Counter[str] = collections.Counter()
        self.rejected_by_policy: collections.Counter[str] = collections.Counter()
        self.skipped_in_flight = 0
        self.empty_pairs = 0  # pairs whose selection found nothing to move
        self._pairs: list[_Pair] = []
        self._pair_of: dict[str, _Pair] = {}  # request id -> the pair moving it

    @property
    def interval_s(self) -> float:
        return self.config.interval_s

    @property
    def in_flight(self) -> frozenset[tuple[int, int]]:
        """(source, destination) of the pairs with a request not yet landed."""
        return frozenset((p.source_id, p.destination_id) for p in self._pairs)

    def cycle(
        self, now_s: float, fleet: FleetSnapshot, running: Mapping[int, Sequence[RunningRequest]]
    ) -> Sequence[Migration]:
        self.num_cycles += 1
        in_flight = self.in_flight
        decision = self.plan(fleet, in_flight)
        self.rejected_by_policy.update(r.policy for r in decision.rejected)
        busy = {src for src, _ in in_flight}
        out: list[Migration] = []
        for order in decision.orders:
            if order.source_id in busy:
                self.skipped_in_flight += 1
                continue
            self.pairs_by_policy[order.policy] += 1
            ids = self._select(order, fleet, running.get(order.source_id, ()))
            if not ids:
                self.empty_pairs += 1
                continue
            busy.add(order.source_id)
            pair = _Pair(order.source_id, order.destination_id, order.policy, set(ids))
            self._pairs.append(pair)
            for rid in ids:
                self._pair_of[rid] = pair
                out.append(Migration(rid, order.source_id, order.destination_id))
            self.migrations_by_policy[order.policy] += len(ids)
        return out

    def migration_done(self, request_id: str, now_s: float) -> None:
        """``replay``: the request landed on its destination, or finished before it could leave its source."""
        pair = self._pair_of.pop(request_id, None)
        if pair is None:
            return
        pair.pending.discard(request_id)
        if not pair.pending:
            self._pairs.remove(pair)

    def _select(self, order: MigrationOrder, fleet: FleetSnapshot, running: Sequence[RunningRequest]) -> list[str]:
        instance = fleet.instances.get(order.source_id)
        capacity = 0
        if instance is not None and instance.load is not None:
            block_size = instance.meta.block_size if instance.meta.block_size > 0 else BLOCK_SIZE
            capacity = instance.load.snapshot.num_total_blocks * block_size
        free = [r for r in running if r.request_id not in self._pair_of]
        table = RequestTable(
            tuple(RequestView(r.request_id, r.prompt_tokens, r.output_tokens) for r in free if not r.waiting),
            tuple(RequestView(r.request_id, r.prompt_tokens, r.output_tokens) for r in free if r.waiting),
            capacity,
        )
        return list(select_requests(table, order.select_rule, order.select_value, order.select_order).request_ids)

    def counters(self) -> dict[str, Any]:
        """What a report prints: cycles, pairs and requests moved by policy, pairs skipped or empty, refusals."""
        return {
            "cycles": self.num_cycles,
            "pairs_by_policy": dict(sorted(self.pairs_by_policy.items())),
            "migrations_by_policy": dict(sorted(self.migrations_by_policy.items())),
            "pairs_skipped_source_busy": self.skipped_in_flight,
            "pairs_with_nothing_to_move": self.empty_pairs,
            "rejected_by_policy": dict(sorted(self.rejected_by_policy.items())),
        }
