"""One rescheduling cycle's decisions: ``plan_cycle(views, config, in_flight) -> CyclePlan``.

Runs each policy of ``--rescheduling-policies`` in order over the same views and validates every pair it proposes
against the pairs already chosen this cycle and the migrations still running from earlier cycles (``in_flight``:
(source, destination) ids), in this order of checks:

1. never A -> B and B -> A: a pair whose reverse is chosen or running is refused;
2. a worker is a source or a destination in one cycle, not both: a pair whose source is a destination of a chosen or
   running pair, or whose destination is a source of one, is refused (its requests would be moved twice, or moved
   onto a worker that is being emptied);
3. one migration per source at a time (``--rescheduling-max-migrations-per-source``, 1): a source already that
   many times a source of chosen or running pairs is refused.

An earlier policy's pair wins over a later conflicting one, so the order of ``--rescheduling-policies`` is a
priority. Every refusal is a ``Rejection`` with its reason; the policies' own (no destination, gap too small) come
first, in policy order.

The live loop and the simulator both call this function (STYLE.md: never a copy). Pure: the standard library and
this package only; no clock (views carry their ages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from components.rescheduler.config import Policy, ReschedulerConfig
from components.rescheduler.policies import binpacking, failover, load, waiting
from components.rescheduler.types import CyclePlan, InstanceView, MigrationPair, PolicyResult, Rejection

PolicyFn = Callable[[Sequence[InstanceView], ReschedulerConfig], PolicyResult]

POLICIES: dict[Policy, PolicyFn] = {
    Policy.DECODE_LOAD: load.decode_load,
    Policy.NEUTRAL_LOAD: load.neutral_load,
    Policy.PREFILL_FAILOVER: failover.prefill_failover,
    Policy.DECODE_FAILOVER: failover.decode_failover,
    Policy.NEUTRAL_FAILOVER: failover.neutral_failover,
    Policy.BINPACKING_MITIGATION: binpacking.mitigation,
    Policy.BINPACKING_CONSOLIDATION: binpacking.consolidation,
    Policy.WAITING_FIT: waiting.waiting_fit,
}


def conflict(pair: MigrationPair, chosen: Iterable[tuple[int, int]], max_per_source: int) -> str | None:
    """Why ``pair`` may not join ``chosen`` (source, destination ids: this cycle's and the running ones), or None."""
    chosen = list(chosen)
    src, dst = pair.source_id, pair.destination_id
    if src == dst:
        return f"source and destination are both {src}"
    if (dst, src) in chosen:
        return f"{dst} -> {src} is already chosen or running"
    if any(d == src for _, d in chosen):
        return f"source {src} is already a destination this cycle"
    if any(s == dst for s, _ in chosen):
        return f"destination {dst} is already a source this cycle"
    taken = sum(1 for s, _ in chosen if s == src)
    if taken >= max_per_source:
        return f"source {src} already takes part in {taken} migration(s), at most {max_per_source}"
    return None


def plan_cycle(
    views: Sequence[InstanceView],
    config: ReschedulerConfig,
    in_flight: Iterable[tuple[int, int]] = (),
) -> CyclePlan:
    """The cycle's validated pairs and refusals (module docstring)."""
    chosen_ids: list[tuple[int, int]] = list(in_flight)
    pairs: list[MigrationPair] = []
    rejected: list[Rejection] = []
    for policy in config.rescheduling_policies:
        fn = POLICIES.get(policy)
        if fn is None:  # prefix_replication plans KV copies, not pairs: the loop's replicator runs it
            continue
        result = fn(views, config)
        rejected += result.rejected
        for pair in result.pairs:
            why = conflict(pair, chosen_ids, config.rescheduling_max_migrations_per_source)
            if why is not None:
                rejected.append(Rejection(policy, pair.source_id, pair.destination_id, f"{why} ({pair.reason})"))
                continue
            pairs.append(pair)
            chosen_ids.append((pair.source_id, pair.destination_id))
    return CyclePlan(tuple(pairs), tuple(rejected))
