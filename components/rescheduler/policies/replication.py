"""Hot-prefix replication: ``plan_replication(prefixes, workers, state, config, now_s) -> (ReplicationPlan, state)``.

Which prefixes' KV to copy to more workers, and which copies to drop, off the request path (docs/rescheduler.md,
"Hot-prefix replication"). Over a snapshot the adapter builds:

- ``PrefixLoad``: a prefix (named by its last block's chained hash, which names the whole chain), its length in
  blocks, the workers that hold all of it (the router's KV index), and the requests per second that carried it;
- ``WorkerLoad``: a worker's predicted TTFT for a new request (the router's kv cost: its queued prefill through the
  perf model), its free KV blocks, whether it may receive a copy (schedulable, fresh, runs a KV hand-off) and
  whether it can be a copy's source (runs a KV hand-off);
- ``ReplicationState``: the replicas this policy made (so it drops only its own) and the copies still running.

Rules, in order (numbers from ``ReplicationConfig``):

1. Cold: a replica of ours, at least ``min_age_s`` old, whose prefix carries fewer than ``cold_rate_per_s`` requests
   per second per holder while its holders' mean predicted TTFT is below the target, is dropped (one per prefix per
   cycle: the one on the holder predicted slowest). A replica whose worker no longer holds the prefix (evicted) is
   forgotten.
2. Hot: a prefix of at least ``min_blocks`` blocks, carrying at least ``min_rate_per_s`` requests per second, whose
   holders' mean predicted TTFT is at or above ``target_ttft_ms``. Its load splits over its holders, so the wait
   scales as 1/holders: it needs ``ceil(holders x mean / target)`` holders, at most ``max_holders``.
3. Copy: hottest prefix first, one copy per prefix and per destination per cycle, at most ``max_copies_per_cycle``:
   to the eligible non-holder with room for the prefix and the lowest predicted TTFT below the target (ties: lowest
   id); from the holder that can hand it over (``can_export``) with the lowest predicted TTFT. A prefix with a copy
   running gets none.

Pure (STYLE.md habit 1): the standard library and this package only; time is ``now_s``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from components.rescheduler.config import ReplicationConfig


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixLoad:
    prefix_hash: int
    num_blocks: int
    holders: tuple[int, ...]
    requests_per_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLoad:
    instance_id: int
    predicted_ttft_ms: float
    num_free_blocks: int
    eligible: bool = True
    # It can hand a prefix it holds over to another worker (its engine takes part in a copy: a vLLM engine needs the
    # NIXL connector); a holder that cannot is no source, though its TTFT still counts in its prefix's mean.
    can_export: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Replica:
    prefix_hash: int
    instance_id: int
    created_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicationState:
    """The replicas this policy made and not yet dropped; the copies started and not finished (prefix, worker)."""

    replicas: tuple[Replica, ...] = ()
    in_flight: frozenset[tuple[int, int]] = frozenset()


class ActionKind(enum.StrEnum):
    COPY = "copy"  # copy the prefix's KV from source_id to destination_id
    DROP = "drop"  # release the replica on destination_id (its blocks become evictable)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicationAction:
    kind: ActionKind
    prefix_hash: int
    destination_id: int
    source_id: int | None
    num_blocks: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicationPlan:
    actions: tuple[ReplicationAction, ...] = ()
    skipped: tuple[str, ...] = ()  # hot prefixes that got no copy, and why

    def copies(self) -> list[ReplicationAction]:
        return [a for a in self.actions if a.kind is ActionKind.COPY]

    def drops(self) -> list[ReplicationAction]:
        return [a for a in self.actions if a.kind is ActionKind.DROP]


def holders_needed(num_holders: int, mean_ttft_ms: float, config: ReplicationConfig) -> int:
    """Holders a prefix needs so its holders' predicted TTFT falls to the target: the wait scales as 1/holders, so
    ceil(holders x mean / target), at least the holders it has and at most ``max_holders`` (2 holders at a mean of
    800 ms against 500 ms: ceil(3.2) = 4)."""
    need = math.ceil(num_holders * mean_ttft_ms / config.prefix_replication_target_ttft_ms - 1e-9)
    return max(num_holders, min(need, config.prefix_replication_max_holders))


def _mean_ttft(holders: Sequence[int], workers: dict[int, WorkerLoad]) -> float | None:
    known = [workers[h].predicted_ttft_ms for h in holders if h in workers]
    return sum(known) / len(known) if known else None


def plan_replication(
    prefixes: Sequence[PrefixLoad],
    workers: Sequence[WorkerLoad],
    state: ReplicationState,
    config: ReplicationConfig,
    now_s: float,
) -> tuple[ReplicationPlan, ReplicationState]:
    """This cycle's copies and drops and the state after them (module docstring)."""
    by_id = {w.instance_id: w for w in workers}
    by_prefix = {p.prefix_hash: p for p in prefixes}
    target = config.prefix_replication_target_ttft_ms
    actions: list[ReplicationAction] = []
    skipped: list[str] = []

    # 1. Cold replicas.
    kept: list[Replica] = []
    dropped_prefixes: set[int] = set()
    ours = sorted(
        state.replicas, key=lambda r: -by_id[r.instance_id].predicted_ttft_ms if r.instance_id in by_id else 0.0
    )
    for rep in ours:
        p = by_prefix.get(rep.prefix_hash)
        if p is not None and rep.instance_id not in p.holders:
            continue  # evicted by the worker: nothing left to drop
        holders = p.holders if p is not None else (rep.instance_id,)
        rate = p.requests_per_s if p is not None else 0.0
        per_holder = rate / max(1, len(holders))
        mean = _mean_ttft(holders, by_id)
        cold = (
            per_holder < config.prefix_replication_cold_rate_per_s
            and (mean is None or mean < target)
            and now_s - rep.created_s >= config.prefix_replication_min_age_s
            and rep.prefix_hash not in dropped_prefixes
        )
        if cold:
            dropped_prefixes.add(rep.prefix_hash)
            actions.append(
                ReplicationAction(
                    ActionKind.DROP,
                    rep.prefix_hash,
                    rep.instance_id,
                    None,
                    p.num_blocks if p is not None else 0,
                    f"{rate:.2f} req/s over {len(holders)} holders = {per_holder:.2f} < "
                    f"{config.prefix_replication_cold_rate_per_s:g} per holder, age {now_s - rep.created_s:.0f} s",
                )
            )
        else:
            kept.append(rep)

    # 2. Hot prefixes, hottest first.
    hot: list[tuple[PrefixLoad, float, int]] = []
    for p in prefixes:
        if not p.holders or p.num_blocks < config.prefix_replication_min_blocks:
            continue
        if p.requests_per_s < config.prefix_replication_min_rate_per_s:
            continue
        mean = _mean_ttft(p.holders, by_id)
        if mean is None or mean < target:
            continue
        need = holders_needed(len(p.holders), mean, config)
        if need <= len(p.holders):
            skipped.append(f"prefix {p.prefix_hash:x}: {len(p.holders)} holders, at the cap of {need}")
            continue
        hot.append((p, mean, need))
    hot.sort(key=lambda t: (-t[0].requests_per_s, t[0].prefix_hash))

    # 3. Copies.
    busy_prefixes = {pfx for pfx, _ in state.in_flight}
    taken: set[int] = {dst for _, dst in state.in_flight}
    in_flight = set(state.in_flight)
    copies = 0
    for p, mean, need in hot:
        if copies >= config.prefix_replication_max_copies_per_cycle:
            skipped.append(f"prefix {p.prefix_hash:x}: the cycle's {copies} copies are taken")
            continue
        if p.prefix_hash in busy_prefixes:
            skipped.append(f"prefix {p.prefix_hash:x}: a copy is already running")
            continue
        sources = [by_id[h] for h in p.holders if h in by_id and by_id[h].can_export]
        candidates = [
            w
            for w in workers
            if w.eligible
            and w.instance_id not in p.holders
            and w.instance_id not in taken
            and w.num_free_blocks >= p.num_blocks
            and w.predicted_ttft_ms < target
        ]
        if not sources or not candidates:
            missing = "holder that can hand it over" if not sources else "destination"
            skipped.append(f"prefix {p.prefix_hash:x}: no {missing}")
            continue
        src = min(sources, key=lambda w: (w.predicted_ttft_ms, w.instance_id))
        dst = min(candidates, key=lambda w: (w.predicted_ttft_ms, w.instance_id))
        actions.append(
            ReplicationAction(
                ActionKind.COPY,
                p.prefix_hash,
                dst.instance_id,
                src.instance_id,
                p.num_blocks,
                f"{len(p.holders)} holders at a mean predicted TTFT of {mean:.0f} ms >= {target:g} ms need {need}; "
                f"{dst.instance_id:x} is predicted at {dst.predicted_ttft_ms:.0f} ms",
            )
        )
        copies += 1
        taken.add(dst.instance_id)
        in_flight.add((p.prefix_hash, dst.instance_id))
    return ReplicationPlan(tuple(actions), tuple(skipped)), ReplicationState(tuple(kept), frozenset(in_flight))


def drop_failed(state: ReplicationState, replica: Replica) -> ReplicationState:
    """The state after a drop of ``replica`` failed (an error or no reply): the replica is ours again, with its
    first ``created_s``, so a later cycle that still finds it cold drops it again (``plan_replication`` removed it
    from the state when it planned the drop). Already there (restored twice): unchanged."""
    if any(r.prefix_hash == replica.prefix_hash and r.instance_id == replica.instance_id for r in state.replicas):
        return state
    return ReplicationState((*state.replicas, replica), state.in_flight)


def copy_finished(
    state: ReplicationState, prefix_hash: int, instance_id: int, now_s: float, ok: bool
) -> ReplicationState:
    """The state after a copy ended: no longer in flight; a replica of ours from ``now_s`` when it succeeded."""
    in_flight = state.in_flight - {(prefix_hash, instance_id)}
    replicas = state.replicas + ((Replica(prefix_hash, instance_id, now_s),) if ok else ())
    return ReplicationState(replicas, in_flight)
