"""Load balancing: ``decode_load`` (decode workers) and ``neutral_load`` (aggregated workers).

The metric is projected KV use (``common.projected_kv_use``). Candidates are one model's workers of the policy's
role that are healthy (``common.healthy``: schedulable, current, not stale, able to migrate, outside the fence).

- **cluster** scope (``--rescheduling-load-balance-scope cluster``): sources are the workers at or above the policy's
  threshold (``--rescheduling-{decode,neutral}-load-threshold``), destinations those below it. Sources by load,
  highest first, are paired with destinations by load, lowest first: the i-th highest with the i-th lowest, each
  worker in one pair. Loads 0.9, 0.3, 0.8, 0.2, 0.4 at 0.7: sources 0.9, 0.8; destinations 0.2, 0.3, 0.4; pairs
  0.9 -> 0.2 and 0.8 -> 0.3 (0.4 is left over).
- **unit** scope: the same pairing inside each failure unit, with every worker of the unit a candidate at any load
  (no threshold, as in Llumnix: a unit is balanced whatever its load): its highest with its lowest, its second
  highest with its second lowest, until the two meet.

A pair is made only when the source's load exceeds the destination's by more than
``--rescheduling-load-balance-threshold`` (0.01): moving requests between two workers 0.005 apart narrows nothing
worth a migration. Llumnix refuses a pair whose difference is below the threshold; here one equal to it is refused
too, so a threshold of 0 never pairs two equally loaded workers. Ties in load are broken by instance id.

Each pair moves what ``--rescheduling-req-select-rule/-order/-value`` say (1,024 tokens, shortest running first), or
with ``rescheduling_load_balance_gap_budget`` x > 0 (not Llumnix's) ``kv_ratio`` x times the pair's gap in the
configured order: at 0.5, loads 0.9 -> 0.3 move up to 0.3 of the source's KV, and the selection's "closest" rule
takes no request of 0.6 or more (a move of s across a gap g leaves |g - 2 s|, narrower only when s < g).

Pure: the standard library and this package only.
"""

from __future__ import annotations

from collections.abc import Sequence

from components.rescheduler.config import SELECT_RULES, LoadBalanceScope, Policy, ReschedulerConfig
from components.rescheduler.policies.common import fence, healthy, projected_kv_use
from components.rescheduler.types import InstanceView, MigrationPair, PolicyResult, Rejection, Role

ROLE_OF = {Policy.DECODE_LOAD: Role.DECODE, Policy.NEUTRAL_LOAD: Role.AGGREGATED}


def threshold_of(policy: Policy, config: ReschedulerConfig) -> float:
    if policy == Policy.DECODE_LOAD:
        return config.rescheduling_decode_load_threshold
    return config.rescheduling_neutral_load_threshold


def balance(policy: Policy, views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    """The pairs ``policy`` (decode_load or neutral_load) proposes over ``views`` (module docstring)."""
    role = ROLE_OF[policy]
    fenced = fence(views, config)
    loads: dict[int, float] = {}
    groups: dict[tuple[str, str], list[InstanceView]] = {}
    for v in views:
        load = projected_kv_use(v)
        if v.role != role or load is None or not healthy(v, config, fenced):
            continue
        loads[v.instance_id] = load
        key = (v.model, v.unit if config.rescheduling_load_balance_scope == LoadBalanceScope.UNIT else "")
        groups.setdefault(key, []).append(v)

    pairs: list[MigrationPair] = []
    rejected: list[Rejection] = []
    threshold = threshold_of(policy, config)
    for (model, unit), members in sorted(groups.items()):
        by_load = sorted(members, key=lambda v: (-loads[v.instance_id], v.instance_id))
        if config.rescheduling_load_balance_scope == LoadBalanceScope.CLUSTER:
            sources = [v for v in by_load if loads[v.instance_id] >= threshold]
            below = [v for v in by_load if loads[v.instance_id] < threshold]
            destinations = sorted(below, key=lambda v: (loads[v.instance_id], v.instance_id))
            where = f"threshold {threshold:g}"
        else:
            half = len(by_load) // 2
            sources = by_load[:half]
            destinations = sorted(by_load[half:], key=lambda v: (loads[v.instance_id], v.instance_id))
            where = f"unit {unit!r}"
        for i, src in enumerate(sources):
            s_load = loads[src.instance_id]
            if i >= len(destinations):
                rejected.append(
                    Rejection(policy, src.instance_id, None, f"load {s_load:.3f} ({where}): no destination left")
                )
                continue
            dst = destinations[i]
            d_load = loads[dst.instance_id]
            gap = s_load - d_load
            if gap <= config.rescheduling_load_balance_threshold:
                rejected.append(
                    Rejection(
                        policy,
                        src.instance_id,
                        dst.instance_id,
                        f"load {s_load:.3f} -> {d_load:.3f}: gap {gap:.3f} <= load-balance threshold "
                        f"{config.rescheduling_load_balance_threshold:g}",
                    )
                )
                continue
            rule, value = config.rescheduling_req_select_rule, config.rescheduling_req_select_value
            if config.rescheduling_load_balance_gap_budget > 0:
                rule, value = SELECT_RULES["RATIO"], min(1.0, config.rescheduling_load_balance_gap_budget * gap)
            pairs.append(
                MigrationPair(
                    source_id=src.instance_id,
                    destination_id=dst.instance_id,
                    model=model,
                    policy=policy,
                    select_rule=rule,
                    select_order=config.rescheduling_req_select_order,
                    select_value=value,
                    reason=f"projected KV use {s_load:.3f} -> {d_load:.3f} ({where}; gap {gap:.3f} > "
                    f"{config.rescheduling_load_balance_threshold:g})",
                )
            )
    return PolicyResult(tuple(pairs), tuple(rejected))


def decode_load(views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    return balance(Policy.DECODE_LOAD, views, config)


def neutral_load(views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    return balance(Policy.NEUTRAL_LOAD, views, config)
