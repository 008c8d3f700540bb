"""The filters every rescheduling policy shares: the load metric, "failing", the failure-domain fence, "healthy".

Load metric: projected KV use (Llumnix's ``kv_cache_usage_ratio_projected``, its "virtual usage")
--------------------------------------------------------------------------------------------------------------
::

    projected_kv_use = (blocks in use + blocks the waiting requests will need) / total blocks

A worker with 1,000 blocks, 600 in use and two waiting prompts of 1,000 tokens (16-token blocks: 63 blocks each,
126) has ``(600 + 126) / 1000 = 0.726``, although its plain KV use is 0.600: the queue counts as the load it is about
to be, so a worker with free blocks and a long queue is not taken for an idle one. It may pass 1 (the queue asks for
more than is free). A worker with no blocks (no load report yet) has none: ``None``, and no load policy uses it.

Failing and the fence
---------------------
A worker is failing when it said it takes no requests (unschedulable: its engine died, it drains, an owner saw it
gone) or its last load report is older than ``instance_staleness_seconds`` (60 s); a worker that never reported is
not failing (a starting worker has nothing to go stale). The fence is every worker in a failing worker's
``failover_domain`` (instance, node, instance-unit, node-unit), whatever its role or model: no policy chooses a
destination in it, and the load and bin-packing policies take no source from it either (Llumnix applies its failover
filter to them too: a failing domain is the failover policies' to empty).

A worker that drains because it was told to leave (``InstanceView.leaving``: a planner's scale-down, its engine
healthy) is failing too, so its role's failover policy empties it (migration-assisted scale-down), but it fences only
itself, whatever the domain: nothing failed on its node or unit. With ``--failover-domain node`` on a one-node
deployment, fencing its node would leave its requests no destination and the scale-down would fall back to waiting
for them; it would also stop load balancing on the node for as long as it drains.

Pure: the standard library and this package only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from components.rescheduler.config import SELECT_ORDERS, FailoverDomain, ReschedulerConfig
from components.rescheduler.types import InstanceView

# Orders that take waiting requests; the bin-packing policies move decode (running) requests only.
WAITING_ORDERS = frozenset({SELECT_ORDERS["FCW"], SELECT_ORDERS["FCWSR"]})
SHORTEST_RUNNING = SELECT_ORDERS["SR"]


def projected_kv_use(view: InstanceView) -> float | None:
    """(blocks in use + blocks the waiting requests need) / total blocks; None without blocks (module docstring)."""
    if view.num_total_blocks <= 0:
        return None
    return (view.num_used_blocks + view.num_waiting_blocks) / view.num_total_blocks


def is_stale(view: InstanceView, config: ReschedulerConfig) -> bool:
    """Its last report is older than ``instance_staleness_seconds``; never reported: not stale."""
    return view.report_age_s is not None and view.report_age_s > config.instance_staleness_seconds


def failing_reason(view: InstanceView, config: ReschedulerConfig) -> str:
    """Why the worker is failing ("" when it is not)."""
    if not view.schedulable:
        return "unschedulable (leaving: draining)" if view.leaving else "unschedulable"
    if is_stale(view, config):
        return f"stale: last report {view.report_age_s:.1f} s ago > {config.instance_staleness_seconds:g} s"
    return ""


def domain_of(failed: InstanceView, views: Iterable[InstanceView], domain: FailoverDomain) -> set[int]:
    """The workers that fail with ``failed`` under ``domain`` (itself included)."""
    views = list(views)
    if domain == FailoverDomain.INSTANCE:
        return {failed.instance_id}
    if domain == FailoverDomain.NODE:
        return {v.instance_id for v in views if v.node == failed.node} | {failed.instance_id}
    if domain == FailoverDomain.INSTANCE_UNIT:
        return {v.instance_id for v in views if v.unit == failed.unit} | {failed.instance_id}
    units = {v.unit for v in views if v.node == failed.node} | {failed.unit}  # NODE_UNIT
    return {v.instance_id for v in views if v.unit in units} | {failed.instance_id}


def fence(views: Sequence[InstanceView], config: ReschedulerConfig) -> set[int]:
    """Every worker inside some failing worker's failure domain (module docstring)."""
    out: set[int] = set()
    for v in views:
        if not v.schedulable and v.leaving:
            out.add(v.instance_id)  # a scale-down, not a failure: its node and unit stay healthy
        elif failing_reason(v, config):
            out |= domain_of(v, views, config.failover_domain)
    return out


def healthy(view: InstanceView, config: ReschedulerConfig, fenced: set[int]) -> bool:
    """May take part in a load or bin-packing migration, or receive a failover: schedulable, current numbers
    (the fleet's freshness rule), not stale, able to migrate, outside the fence."""
    return (
        view.schedulable
        and view.has_load
        and view.fresh
        and not is_stale(view, config)
        and view.migratable
        and view.instance_id not in fenced
    )


def running_order(order: str) -> str:
    """``order``, or shortest_running in place of an order that takes waiting requests (decode requests only)."""
    return SHORTEST_RUNNING if order in WAITING_ORDERS else order
