"""One view of the fleet: instances (role, failure domains, schedulability, latest load, announced performance model),
each model's prefill queue, and the one staleness rule and the one schedulability rule (``rules``).

- ``rules``: the two rules with their numbers (pure);
- ``model``: ``FleetInstance``, ``LoadRecord``, ``FleetSnapshot`` (immutable; what pure policies take as input);
- ``queues``: each model's prefill queue from its prefill workers' reports (pure);
- ``request_counts``: ``RequestCounts``, what a producer of the frontends' request reports (a frontend, the
  simulator) counts between two reports (pure);
- ``state``: ``FleetState``, the bookkeeping with time as an input: the in-memory twin (``MemoryFleet``) and the
  live view's core; ``FleetView``, the read interface both give; ``FleetListener``, how a reader keeps derived
  tables current;
- ``live``: ``LiveFleet``, a ``FleetState`` fed from the mesh (discovery and the ``load_metrics``,
  ``worker_status``, ``prefill_queue`` and ``request_stats`` topics). Imported explicitly: importing this package
  loads no I/O client.

Rank 3 (tests/unit/test_layering.py): above ``runtime``, below ``router`` and ``migration``; imports ``protocol``,
``perf`` and (``live`` only) ``runtime``.
"""

from components.fleet.model import FailureDomains, FleetInstance, FleetSnapshot, LoadRecord
from components.fleet.rules import DOWN_HOLD_S, LOAD_REPORTS, QUEUE_REPORTS, StaleRule, stale_at
from components.fleet.state import FleetListener, FleetState, FleetView, MemoryFleet

__all__ = [
    "DOWN_HOLD_S",
    "LOAD_REPORTS",
    "QUEUE_REPORTS",
    "FailureDomains",
    "FleetInstance",
    "FleetListener",
    "FleetSnapshot",
    "FleetState",
    "FleetView",
    "LoadRecord",
    "MemoryFleet",
    "StaleRule",
    "stale_at",
]
