"""The fleet view as the rescheduler's policies read it: ``instance_views(snapshot) -> list[InstanceView]``.

Per ``FleetInstance`` of a ``FleetSnapshot`` (components/fleet/model.py):

- role, model, schedulability as the fleet decides them (components/fleet/rules.py);
- ``node`` and ``unit`` from its ``FailureDomains`` (the unit is its ``failure_unit`` label, else its node);
- ``migratable``: its registration names a migration mode (it runs a migration agent);
- from its latest ``LoadRecord``: ``report_age_s`` = ``now_s`` - receive time, ``fresh`` by the fleet's rule, the
  KV blocks in use and in all, batch size, KV tokens, running requests; ``num_waiting_blocks`` = its prompt tokens
  not yet prefilled over its block size, rounded up (a lower bound: each waiting request rounds up on its own, and
  the snapshot sums their tokens); a worker that announces no block size is taken at perf's 16 (vLLM's default);
- ``predicted_tpot_ms``: its decode step time at that batch and KV tokens, by the step-time model it announced
  (``FleetInstance.perf``, a components/perf ``StepTimeModel``). 64 sequences attending 131,072 KV tokens on the
  defaults: 5 + 64 x 0.02 + 131,072 x 3e-5 = 10.2 ms. A step that also prefills is longer; the snapshot does not say
  how much prefill a step carries, so the prediction is the decode part's.

Not a policy module: it imports components.fleet (rank 3) and components.perf (rank 1).
"""

from __future__ import annotations

import math

from components.fleet.model import FleetInstance, FleetSnapshot
from components.perf.model import BLOCK_SIZE
from components.protocol.migration import DRAINING_REASON
from components.rescheduler.types import InstanceView, Role


def instance_view(instance: FleetInstance, now_s: float) -> InstanceView:
    """One worker's view at ``now_s`` (module docstring)."""
    record = instance.load
    snap = record.snapshot if record is not None else None
    block_size = instance.meta.block_size if instance.meta.block_size > 0 else BLOCK_SIZE
    return InstanceView(
        instance_id=instance.instance_id,
        model=instance.model,
        role=Role(str(instance.role)),
        schedulable=instance.schedulable,
        leaving=not instance.schedulable and instance.unschedulable_reason == DRAINING_REASON,
        migratable=bool(instance.meta.migration_mode),
        fresh=record is not None and record.fresh(now_s),
        report_age_s=None if record is None else max(0.0, now_s - record.received_s),
        node=instance.domains.node,
        unit=instance.domains.unit,
        num_total_blocks=snap.num_total_blocks if snap else 0,
        num_used_blocks=snap.num_active_blocks if snap else 0,
        num_waiting_blocks=math.ceil(snap.num_waiting_prefill_tokens / block_size) if snap else 0,
        batch_size=snap.batch_size if snap else 0,
        num_kv_tokens=snap.num_kv_tokens if snap else 0,
        # The engine's running requests (a partly prefilled one included: the migration agent skips it).
        num_running_decode=snap.num_running if snap else 0,
        predicted_tpot_ms=instance.perf.decode_ms(snap.batch_size, snap.num_kv_tokens) if snap else None,
    )


def instance_views(snapshot: FleetSnapshot) -> list[InstanceView]:
    """Every instance of ``snapshot`` as an ``InstanceView``, by instance id."""
    return [instance_view(snapshot.instances[i], snapshot.now_s) for i in sorted(snapshot.instances)]
