"""The live fleet view (components/fleet/live.py) on real etcd and nats-server.

- The behaviours the in-memory twin has (tests/support/fleet.py), run here against the live view: real
  registrations and real events, arrivals stamped with a clock the test sets.
- A real worker (mock engine) followed through its life: it registers (role, model, failure domains, announced
  step-time model), reports, says it takes no new requests, goes stale when its reports stop while it stays
  registered, and leaves.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from components.fleet.live import LiveFleet
from components.protocol.metadata import WorkerRole
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker
from tests.support.fleet import BEHAVIOURS, Clock, LiveDriver
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL_PATH = str(Path(__file__).resolve().parents[2] / "models" / "tiny-llama")


@pytest.fixture
async def live(make_runtime, namespace) -> AsyncIterator[LiveDriver]:
    rt = await make_runtime()
    fleet = LiveFleet(rt, namespace, clock=Clock())
    await fleet.start()
    driver = LiveDriver(fleet, rt, namespace)
    await driver.ready()
    try:
        yield driver
    finally:
        await fleet.stop()


@pytest.mark.parametrize("name", sorted(BEHAVIOURS))
async def test_live(name: str, live: LiveDriver) -> None:
    await BEHAVIOURS[name](live)


async def test_the_live_view_follows_a_worker_from_registration_to_departure(make_runtime, namespace):
    rt = await make_runtime()
    fleet = LiveFleet(rt, namespace)  # the monotonic clock: the worker reports on its own
    await fleet.start()
    engine = MockEngineConfig(num_gpu_blocks=256, block_size=16, max_model_len=2048, vocab_size=384, eos_token_id=257)
    cfg = WorkerConfig(namespace=namespace, model="mm", model_path=MODEL_PATH, metrics_interval_ms=50)
    worker = Worker(rt, cfg, MockEngine(engine, name="w0"))
    try:
        await worker.start()
        iid = worker.instance_id
        # Registered: its role, model, failure domains (this process on this host) and its step-time model.
        await wait_until(lambda: fleet.instance(iid) is not None)
        inst = fleet.instance(iid)
        assert inst is not None
        assert (inst.model, inst.role, inst.schedulable) == ("mm", WorkerRole.AGGREGATED, True)
        assert inst.domains.process == (socket.gethostname(), os.getpid()) and inst.domains.unit == socket.gethostname()
        assert inst.perf.to_mapping() == pytest.approx(dict(inst.meta.step_time))
        assert inst.meta.step_time  # the mock engine announces its model
        # Reports: fresh, with the interval it publishes at (50 ms) learned from the arrivals.
        await wait_until(lambda: iid in fleet.snapshot().fresh_loads("mm"))
        await wait_until(lambda: (fleet.state.load(iid).interval_s or 0) > 0)
        # Says it takes no new requests (what a drain or a dead engine does first), and stays registered.
        await worker._stop_scheduling("maintenance")
        await wait_until(lambda: not fleet.instance(iid).schedulable)
        assert fleet.instance(iid).unschedulable_reason == "maintenance"
        assert fleet.snapshot().schedulable_count("mm") == 0 and len(fleet.snapshot().serving("mm")) == 1
        # Its reports stop while it stays registered (a hung metrics loop): stale by the one rule, within
        # max(0.5 s, 5 x ~50 ms) = 0.5 s of its last report, long before its lease (3 s in tests) would expire.
        metrics = [t for t in asyncio.all_tasks() if t.get_name().endswith(f":metrics:{iid:x}")]  # supervisor's prefix
        assert len(metrics) == 1
        metrics[0].cancel()
        last = fleet.state.load(iid)
        assert last is not None
        took = await wait_until(lambda: iid not in fleet.snapshot().fresh_loads("mm"), timeout_s=3.0)
        assert fleet.instance(iid) is not None and fleet.snapshot().stale("mm") == [iid]
        rec = fleet.state.load(iid)
        assert rec.stale_at_s == pytest.approx(rec.received_s + max(0.5, 5 * rec.interval_s))
        assert took < 2.0
        # Leaves: gone from the view, its late reports ignored.
        await worker.stop()
        await wait_until(lambda: fleet.instance(iid) is None)
        assert fleet.state.has_departed(iid) and fleet.snapshot().models() == []
    finally:
        await worker.stop()
        await fleet.stop()
