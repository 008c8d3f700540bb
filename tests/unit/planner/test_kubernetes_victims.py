"""Which pods leave first when the kubernetes connector lowers a pool (``victim_pods``, pure): a worker already
leaving (draining, or the rescheduler emptying it), then the fewest requests, then the lowest KV use; workers
without a pod (not on Kubernetes) never."""

from __future__ import annotations

import pytest

from components.fleet import MemoryFleet
from components.planner.connectors.kubernetes import victim_pods
from components.planner.policy import Pool
from components.protocol.messages import LoadSnapshot
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.protocol.migration import WorkerStatus

pytestmark = pytest.mark.unit
MODEL = "m"


def load(running: int, kv: float) -> LoadSnapshot:
    return LoadSnapshot(
        now_s=0.0,
        kv_usage=kv,
        num_total_blocks=100,
        num_active_blocks=int(kv * 100),
        num_running=running,
        num_waiting=0,
        num_waiting_prefill_tokens=0,
        num_preemptions=0,
        batch_size=running,
        num_kv_tokens=0,
    )


def test_leaving_first_then_fewest_requests_then_lowest_kv_use():
    f = MemoryFleet()
    pods = {1: "w-a", 2: "w-b", 3: "w-c", 4: "w-d", 5: ""}
    for iid, pod in pods.items():
        f.add_instance(iid, WorkerMetadata(model=MODEL, role=WorkerRole.DECODE, pod=pod).to_dict())
    f.add_instance(9, WorkerMetadata(model=MODEL, role=WorkerRole.PREFILL, pod="p-a").to_dict())
    for iid, (running, kv) in {1: (5, 0.5), 2: (1, 0.6), 3: (1, 0.2), 4: (9, 0.9), 5: (0, 0.0)}.items():
        f.apply_load(iid, load(running, kv), 1.0)
    f.apply_status(4, WorkerStatus(schedulable=False, reason="draining"), 1.0)
    snap = f.snapshot(1.5)
    # w-d drains (9 requests, but leaving already); then w-c and w-b (1 request each: w-c's KV use is lower), w-a.
    assert victim_pods(snap, MODEL, Pool.DECODE, 4) == ["w-d", "w-c", "w-b", "w-a"]
    assert victim_pods(snap, MODEL, Pool.DECODE, 1) == ["w-d"]
    assert victim_pods(snap, MODEL, Pool.PREFILL, 3) == ["p-a"]  # its own pool only
