"""Failover: ``prefill_failover``, ``decode_failover``, ``neutral_failover`` empty failing workers of their role.

- **Sources**: the policy's role's workers that are failing (``common.failing_reason``: unschedulable, or last load
  report older than ``--instance-staleness-seconds``), by instance id. A failing worker that runs no migration agent
  cannot send its requests anywhere: refused, with the reason.
- **Destinations**: workers of the same model and role that are healthy (``common.healthy``) and outside the fence:
  the ``--failover-domain`` of every failing worker (instance, node, instance-unit, node-unit). With ``node`` a
  worker on a failing worker's node is never a destination, healthy or not.
- **Selector**: round robin (Llumnix's ``roundRobinSelector``): the i-th source to the (i mod n)-th destination,
  destinations by projected KV use, lowest first, so two failing workers and three destinations use the two least
  loaded.
- **What moves**: everything (the migration agent's ``num_requests`` -1: every request, running and waiting, longest
  running first), whatever ``--rescheduling-req-select-*`` say, as Llumnix's failover does.

Llumnix takes every worker of a failing worker's domain as a source (with ``node``: the node's healthy workers too);
here only the failing workers are sources and the rest of the domain is fenced off as destinations, as issue 26
states the policy: emptying healthy workers because a neighbour failed would start migrations that the failing one's
own do not need, and a real node failure makes its other workers unschedulable or stale within the staleness time.

Pure: the standard library and this package only.
"""

from __future__ import annotations

from collections.abc import Sequence

from components.rescheduler.config import SELECT_ORDERS, SELECT_RULES, Policy, ReschedulerConfig
from components.rescheduler.policies.common import failing_reason, fence, healthy, projected_kv_use
from components.rescheduler.types import InstanceView, MigrationPair, PolicyResult, Rejection, Role

ROLE_OF = {
    Policy.PREFILL_FAILOVER: Role.PREFILL,
    Policy.DECODE_FAILOVER: Role.DECODE,
    Policy.NEUTRAL_FAILOVER: Role.AGGREGATED,
}
# Every request (the agent's NUM_REQ -1), longest first: the seed's failover selection.
EVERY_REQUEST = (SELECT_RULES["NUM_REQ"], SELECT_ORDERS["LR"], -1.0)


def failover(policy: Policy, views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    """The pairs ``policy`` (one of the three failover policies) proposes over ``views`` (module docstring)."""
    role = ROLE_OF[policy]
    fenced = fence(views, config)
    pairs: list[MigrationPair] = []
    rejected: list[Rejection] = []
    failing = sorted((v for v in views if v.role == role and failing_reason(v, config)), key=lambda v: v.instance_id)
    by_model: dict[str, list[InstanceView]] = {}
    for v in views:
        if v.role == role and healthy(v, config, fenced):
            by_model.setdefault(v.model, []).append(v)
    for candidates in by_model.values():
        candidates.sort(key=lambda v: (projected_kv_use(v) or 0.0, v.instance_id))
    next_of: dict[str, int] = {}
    rule, order, value = EVERY_REQUEST
    for src in failing:
        why = failing_reason(src, config)
        if not src.migratable:
            rejected.append(Rejection(policy, src.instance_id, None, f"{why}; runs no migration agent"))
            continue
        destinations = by_model.get(src.model, [])
        if not destinations:
            rejected.append(
                Rejection(
                    policy,
                    src.instance_id,
                    None,
                    f"{why}; no healthy {role} worker of {src.model!r} outside the failing "
                    f"{config.failover_domain} domains ({len(fenced)} workers fenced)",
                )
            )
            continue
        i = next_of.get(src.model, 0)
        dst = destinations[i % len(destinations)]
        next_of[src.model] = i + 1
        pairs.append(
            MigrationPair(
                source_id=src.instance_id,
                destination_id=dst.instance_id,
                model=src.model,
                policy=policy,
                select_rule=rule,
                select_order=order,
                select_value=value,
                reason=f"{why}; to the {i % len(destinations) + 1}. of {len(destinations)} destinations outside "
                f"its {config.failover_domain} domain (node {dst.node!r}, unit {dst.unit!r}, projected KV use "
                f"{projected_kv_use(dst) or 0.0:.3f})",
            )
        )
    return PolicyResult(tuple(pairs), tuple(rejected))


def prefill_failover(views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    return failover(Policy.PREFILL_FAILOVER, views, config)


def decode_failover(views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    return failover(Policy.DECODE_FAILOVER, views, config)


def neutral_failover(views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    return failover(Policy.NEUTRAL_FAILOVER, views, config)
