"""What the rescheduler's policies read and return: plain, immutable records.

- ``InstanceView``: one worker as the policies see it (its role, health, failure domains, KV blocks, batch and
  predicted TPOT). Built from the fleet view by ``components/rescheduler/views.py``; tests and the simulator may
  build them directly.
- ``MigrationPair``: one migration a cycle chose: source, destination, what to move (the migration agent's request
  selection: rule, order, value), the policy that chose it and why, in numbers.
- ``Rejection``: a candidate a policy or the cycle's validation refused, and why.
- ``CyclePlan``: one cycle's pairs and rejections, in the order the policies ran.

Pure: the standard library and this package's config only (the policies import it; STYLE.md habit 1).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from components.rescheduler.config import Policy


class Role(enum.StrEnum):
    """A worker's role, with the fleet's names (components/protocol/metadata.py ``WorkerRole``); Llumnix calls an
    aggregated worker "neutral"."""

    PREFILL = "prefill"
    DECODE = "decode"
    AGGREGATED = "aggregated"


@dataclasses.dataclass(frozen=True, slots=True)
class InstanceView:
    """One worker at the cycle's instant.

    ``report_age_s`` is the age of its last load report (None: it never sent one; then its load fields are 0 and no
    load or bin-packing policy uses it). ``fresh`` is the fleet's own staleness rule (components/fleet/rules.py:
    about 5 report intervals, 0.5 s at the workers' 100 ms): its numbers are current. ``instance_staleness_seconds``
    (60 s) is the much longer rule that calls a worker failing. ``migratable``: it runs a migration agent (its
    registration names a migration mode), so it can send and receive requests.

    ``leaving``: it drains because it was told to leave (its ``WorkerStatus`` reason is the protocol's
    ``DRAINING_REASON``), e.g. a planner's scale-down; a failover policy empties it like a failing worker.

    ``num_waiting_blocks``: the KV blocks its waiting and partly prefilled requests still need (their prompt tokens
    not yet prefilled, over the block size, rounded up). ``predicted_tpot_ms``: its decode step time at the current
    batch and KV tokens by its announced performance model (None without a load report).
    """

    instance_id: int
    model: str
    role: Role
    schedulable: bool = True
    # Unschedulable because it was told to leave (it drains with a healthy engine: a scale-down), not because it
    # failed; only meaningful when ``schedulable`` is False (policies/common.py: it fences only itself).
    leaving: bool = False
    migratable: bool = True
    fresh: bool = True
    report_age_s: float | None = 0.0
    node: str = ""
    unit: str = ""
    num_total_blocks: int = 0
    num_used_blocks: int = 0
    num_waiting_blocks: int = 0
    batch_size: int = 0
    num_kv_tokens: int = 0
    num_running_decode: int = 0
    predicted_tpot_ms: float | None = None

    @property
    def has_load(self) -> bool:
        return self.report_age_s is not None


@dataclasses.dataclass(frozen=True, slots=True)
class MigrationPair:
    """Move requests from ``source_id`` to ``destination_id``: the migration agent's ``select_rule``,
    ``select_order`` and ``select_value`` (components/migration/policies/selection.py; readable names) say which."""

    source_id: int
    destination_id: int
    model: str
    policy: Policy
    select_rule: str
    select_order: str
    select_value: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["policy"] = str(self.policy)
        return d


@dataclasses.dataclass(frozen=True, slots=True)
class Rejection:
    """A candidate refused: by its policy (no destination, too small a gap) or by the cycle's validation (a
    conflict with a pair already chosen). ``destination_id`` None: no destination was found."""

    policy: Policy
    source_id: int
    destination_id: int | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["policy"] = str(self.policy)
        return d


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyResult:
    """What one policy proposes before the cycle's validation."""

    pairs: tuple[MigrationPair, ...] = ()
    rejected: tuple[Rejection, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class CyclePlan:
    """One cycle's validated pairs (to run concurrently) and what was refused, in policy order."""

    pairs: tuple[MigrationPair, ...] = ()
    rejected: tuple[Rejection, ...] = ()

    def by_policy(self, policy: Policy | str) -> list[MigrationPair]:
        return [p for p in self.pairs if p.policy == policy]

    def to_dict(self) -> dict[str, Any]:
        return {"pairs": [p.to_dict() for p in self.pairs], "rejected": [r.to_dict() for r in self.rejected]}
