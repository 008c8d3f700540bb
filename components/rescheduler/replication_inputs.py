"""Hot-prefix replication's snapshot, built from the fleet view: what the live loop (replicator.py) hands to the pure
policy (policies/replication.py, ``plan_replication``). Pure: no I/O, time is ``snapshot.now_s``.

- ``prefix_loads(snapshot, model, window_s, holders_of)``: the prefixes the frontends' request reports carried
  (``RequestStatsReport.prefixes``: per interval, each prefix's chained block hashes and its requests) over the
  last ``window_s`` seconds, merged by ``PrefixRates`` (the same tracker the simulator feeds request by request: a
  prefix keyed by its first block, its blocks the run every report of it shared), each with its holders
  (``holders_of(hashes)``: the workers whose KV holds all of them, from a KV index fed by the workers' KV events)
  and its rate, requests in the window over ``window_s``;
- ``worker_loads(snapshot, model)``: each serving worker of the model with
  - ``predicted_ttft_ms``: ``predicted_wait_ms``, how long a new prompt waits there before its own prefill, by the
    one model the router's ``kv`` cost and the SLA planner use (``components.perf.queueing.queued_wait_ms``), on its
    latest load report: its ``num_waiting_prefill_tokens`` at its prefill rate under its running requests and KV
    tokens, plus half a prefill step's fixed cost while anything is queued. The router adds its own requests not
    yet reported; the rescheduler routes none, so the report is all it has;
  - ``num_free_blocks``: total less active blocks of that report (cached free blocks count as free: an import may
    evict them, as a prefill would);
  - ``eligible``: schedulable, its report fresh (the fleet's staleness rule), not a prefill worker (a copy makes a
    holder only where requests are routed), and its metadata names a ``prefix_copy_mode``;
  - ``can_export``: its metadata names a ``prefix_copy_mode`` (a holder that would refuse, a vLLM engine without
    the NIXL connector, is no source; a draining one still is).

Imports components.fleet (rank 3), components.perf (rank 1) and this package's policies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from components.fleet.model import FleetInstance, FleetSnapshot
from components.perf import queueing
from components.protocol.metadata import WorkerRole
from components.rescheduler.policies.prefix_rates import PrefixRates
from components.rescheduler.policies.replication import PrefixLoad, WorkerLoad


def predicted_wait_ms(instance: FleetInstance) -> float | None:
    """The queueing wait of a new prompt on ``instance`` by its latest load report (module docstring); None without
    a report."""
    if instance.load is None:
        return None
    snap = instance.load.snapshot
    perf = instance.perf
    rate = queueing.prefill_ms_per_prompt_token(perf, snap.num_running, snap.num_kv_tokens)
    return queueing.queued_wait_ms(snap.num_waiting_prefill_tokens, rate, queueing.step_residual_ms(perf))


def worker_loads(snapshot: FleetSnapshot, model: str) -> list[WorkerLoad]:
    """The model's serving workers as the policy reads them, by instance id (module docstring). A worker with no
    load report yet is left out (its TTFT is unknown; it is no destination either)."""
    out = []
    for iid in sorted(snapshot.instances):
        inst = snapshot.instances[iid]
        if inst.model != model or inst.role == WorkerRole.PREFILL:
            continue
        wait = predicted_wait_ms(inst)
        if wait is None or inst.load is None:
            continue
        snap = inst.load.snapshot
        copies = bool(inst.meta.prefix_copy_mode)
        eligible = copies and inst.schedulable and inst.load.fresh(snapshot.now_s)
        free = max(0, snap.num_total_blocks - snap.num_active_blocks)
        out.append(WorkerLoad(iid, wait, free, eligible, can_export=copies))
    return out


def prefix_loads(
    snapshot: FleetSnapshot,
    model: str,
    window_s: float,
    holders_of: Callable[[Sequence[int]], Sequence[int]],
) -> tuple[list[PrefixLoad], dict[int, tuple[int, ...]]]:
    """The model's prefixes over the last ``window_s`` of request reports (module docstring), by first-block hash,
    and each one's chained block hashes by its name (its last hash), for the copy."""
    rates = PrefixRates(window_s)
    records = sorted(snapshot.requests.get(model, ()), key=lambda r: r.received_s)
    for rec in records:
        if rec.received_s <= snapshot.now_s - window_s:
            continue
        for p in rec.report.prefixes:
            rates.observe(p.block_hashes, rec.received_s, p.requests)
    loads = rates.loads(snapshot.now_s, holders_of)
    return loads, {p.prefix_hash: rates.block_hashes(p.prefix_hash) for p in loads}
