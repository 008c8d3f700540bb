"""Hot-prefix replication in the simulator (components/sim/replication.py, replay's ``replicator``)."""

from __future__ import annotations

import pytest

from components import sim
from components.rescheduler.config import ReplicationConfig
from components.router import RouterConfig
from components.sim import FleetSpec, replay
from components.sim.replication import PolicyReplicator
from components.sim.workloads import synthetic
from components.workers.simulated import MockEngineConfig

pytestmark = pytest.mark.unit


def documents(n: int = 120) -> tuple[sim.Workload, FleetSpec]:
    # 8 shared documents of ~12k tokens on 4 workers, at twice the step-time model's capacity estimate: the holders
    # of the hottest documents queue.
    fleet = FleetSpec(workers=4, engine=MockEngineConfig(num_gpu_blocks=4096, max_model_len=32768))
    base = synthetic("documents", n, vocab_size=1000, seed=4)
    return base.at_rate(2 * sim.model_estimate(base, fleet)), fleet


def test_a_replicator_that_copies_nothing_leaves_the_run_unchanged() -> None:
    # A target no holder reaches: no copy, so every field of the run equals the run without a replicator.
    w, fleet = documents()
    rep = PolicyReplicator(ReplicationConfig(prefix_replication_target_ttft_ms=1e9), model="sim")
    assert replay(w, fleet, "kv", seed=1, replicator=rep) == replay(w, fleet, "kv", seed=1)
    assert rep.copies == 0


def test_hot_documents_are_copied_and_the_copies_become_holders() -> None:
    # A 25 ms target: the holders of hot documents are predicted above it, so copies are made; each landed copy is a
    # replica the policy tracks until its worker evicts it, and every request still finishes.
    # The kv router without provisional blocks: with them (the default) this workload's documents are spread so that
    # no holder is predicted above 25 ms (0 copies; 1 at 5 ms), and this test is about the copies.
    w, fleet = documents()
    rep = PolicyReplicator(ReplicationConfig(prefix_replication_target_ttft_ms=25.0), model="sim")
    res = replay(w, fleet, RouterConfig(router_policy="kv", router_provisional_ttl_s=0), seed=1, replicator=rep)
    assert rep.copies >= 1
    assert len(res.ttft_s) == len(w.requests)
    # A copy in flight at the end never landed; every landed one was recorded or later forgotten as evicted.
    assert len(rep.state.replicas) <= rep.copies
