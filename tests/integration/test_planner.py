"""The planner on real etcd and NATS: simulated workers in this process, the ``virtual`` connector, and an "outside
system" coroutine (the test's) that answers the connector by starting and stopping in-process mock workers.

Short intervals (pull 0.05 s, adjust 0.3 s) and workers that report every 50 ms, so one adjustment sees ~6 pulls
of ~6 fresh snapshots each. High KV use: each mock engine has 32 blocks of 16 tokens (512 tokens of KV, and
max_model_len 512) and four requests at a time of 64-token prompts that run to 512 tokens; 4 x 4 prompt blocks grow
to 32 within ~64 steps (~0.3 s at speedup 1) and stay there (preemption by recompute refills them; a finished request
is replaced at once), so the average KV use is 0.6-0.9, above the test's 0.6 up-threshold (PLANNER_CFG).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from components.planner.config import PlannerConfig
from components.planner.connectors.virtual import VirtualConnector, VirtualRequest, done_key, pool_prefix, target_key
from components.planner.loop import Planner, status_key
from components.planner.policy import Direction, Pool
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import GenerateRequest, SamplingParams
from components.runtime import Runtime
from components.runtime.discovery import WatchEventKind
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration
MODEL = "mock-model"

# The namespace is each test's own: OutsideSystem sets it.
WORKER_CFG = WorkerConfig(namespace="-", model=MODEL, metrics_interval_ms=50, kv_events_batch_ms=5, drain_timeout_s=1)
ENGINE_CFG = MockEngineConfig(
    num_gpu_blocks=32,
    block_size=16,
    max_model_len=512,
    speedup_ratio=1.0,
    vocab_size=1000,
    eos_token_id=999,
)
# Up-threshold 0.6 rather than 0.9: the saturated worker's KV use averages ~0.88-0.9 over an interval (preemption frees
# a victim's blocks for a step or two), which would make the test wait on a coin flip at 0.9. After the scale-up the
# pool's average is ~0.45 (one saturated worker, one idle): between 0.2 and 0.6, so it holds at 2 workers.
PLANNER_CFG = PlannerConfig(
    metric_pulling_interval=0.05,
    adjustment_interval=0.3,
    decode_kv_scale_up_threshold=0.6,
    decode_kv_scale_down_threshold=0.2,
)


class OutsideSystem:
    """What the virtual connector talks to: watches the decode pool's target and makes the fleet that size with
    in-process mock workers, then answers ``done`` with the request's id."""

    def __init__(self, runtime: Runtime, namespace: str) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.worker_cfg = WORKER_CFG.model_copy(update={"namespace": namespace})
        self.workers: list[Worker] = []
        self.targets: list[int] = []  # every target it was asked for, in order
        self._task: asyncio.Task[None] | None = None

    async def add_worker(self) -> Worker:
        w = Worker(
            self.runtime, self.worker_cfg, MockEngine(ENGINE_CFG, name=f"m{len(self.workers)}"), len(self.workers)
        )
        await w.start()
        self.workers.append(w)
        return w

    async def _serve(self) -> None:
        discovery = self.runtime.discovery
        key = target_key(self.namespace, MODEL, Pool.DECODE)
        async for ev in discovery.watch_prefix(pool_prefix(self.namespace, MODEL, Pool.DECODE)):
            if ev.key != key or ev.kind != WatchEventKind.PUT or ev.value is None:
                continue
            request = VirtualRequest.from_json(ev.value)
            self.targets.append(request.count)
            while len(self.workers) < request.count:
                await self.add_worker()
            while len(self.workers) > request.count:
                await self.workers.pop().stop()
            await discovery.put(done_key(self.namespace, MODEL, Pool.DECODE), request.to_json())

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name="outside-system")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for w in self.workers:
            await w.stop()


async def saturate(runtime: Runtime, namespace: str, worker: Worker, n: int = 4) -> list[asyncio.Task[None]]:
    """``n`` long requests straight to ``worker``, consumed in the background until cancelled."""
    client = await runtime.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
    await client.wait_for_instances(1, timeout_s=5)

    async def one(i: int) -> None:
        for k in itertools.count():  # each request ends at max_model_len (512 tokens): send the next at once
            prompt = [1 + (i * 64 + j + k) % 900 for j in range(64)]  # distinct prompts: no shared prefix
            req = GenerateRequest(f"long-{i}-{k}", prompt, SamplingParams(max_tokens=4000, ignore_eos=True))
            stream = await client.direct(req.to_dict(), worker.instance_id)
            async for _ in stream:
                pass

    return [asyncio.create_task(one(i), name=f"load-{i}") for i in range(n)]


@pytest.fixture
async def deployment(make_runtime, namespace) -> AsyncIterator[tuple[Runtime, OutsideSystem]]:
    """One saturated aggregated worker, the outside system that owns it, and a runtime for the planner."""
    workers_rt = await make_runtime()
    outside = OutsideSystem(workers_rt, namespace)
    first = await outside.add_worker()
    outside.start()
    load = await saturate(await make_runtime(), namespace, first)
    planner_rt = await make_runtime()
    yield planner_rt, outside
    for t in load:
        t.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    await outside.stop()


@contextlib.asynccontextmanager
async def running(planner: Planner) -> AsyncIterator[Planner]:
    await planner.start()
    try:
        yield planner
    finally:
        await planner.stop()


async def test_high_kv_use_scales_decode_up_by_one_through_the_virtual_connector(deployment, tmp_path, namespace):
    rt, outside = deployment
    connector = VirtualConnector(rt, namespace, MODEL, timeout_s=10)
    planner = Planner(rt, PLANNER_CFG, namespace, MODEL, connector, log_dir=str(tmp_path / "tb"))
    async with running(planner):
        await wait_until(lambda: planner.num_changes_applied >= 1, timeout_s=15)
        # The first change was one more decode worker, for the reason the policy gave.
        assert outside.targets[0] == 2
        assert len(outside.workers) == 2
        up = [
            d for d in (planner.last_decision.decisions if planner.last_decision else ()) if d.direction == Direction.UP
        ]
        assert not up or up[0].target == 2
        # Within the next interval the pool has 2 workers as the planner sees it, and nothing else was asked.
        await wait_until(
            lambda: planner.last_observation is not None and planner.last_observation.decode.workers == 2,
            timeout_s=5,
        )
        assert outside.targets == [2]
        assert planner.num_change_failures == 0
        # The last decision is where `kvmesh status` reads it.
        status = await rt.discovery.get_prefix(status_key(namespace, MODEL))
        assert status

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"pull/kv_usage", "pull/decode_workers", "pull/gpus", "pull/running_requests"} <= tags
    assert {"adjustment/kv_usage", "adjustment/decode_workers"} <= tags
    # The pool went 1 -> 2 and the KV use that made it so was above the 0.6 up-threshold.
    assert acc.Scalars("pull/decode_workers")[0].value == 1
    assert max(e.value for e in acc.Scalars("pull/decode_workers")) == 2
    assert max(e.value for e in acc.Scalars("adjustment/kv_usage")) > 0.6
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("adjustment/decisions/text_summary")]
    assert any("decode: scale up 1 -> 2" in t for t in texts)


async def test_no_operation_reports_the_scale_up_and_changes_nothing(deployment, tmp_path, namespace):
    rt, outside = deployment
    cfg = PLANNER_CFG.model_copy(update={"no_operation": True})
    planner = Planner(
        rt, cfg, namespace, MODEL, VirtualConnector(rt, namespace, MODEL, timeout_s=10), log_dir=str(tmp_path)
    )
    async with running(planner):

        def would_scale_up() -> bool:
            adj = planner.last_decision
            d = adj.decision(Pool.DECODE) if adj else None
            return d is not None and d.direction == Direction.UP

        await wait_until(would_scale_up, timeout_s=15)
        assert planner.last_decision is not None and planner.last_decision.no_operation
        assert planner.last_decision.changes() == ()
        await asyncio.sleep(4 * PLANNER_CFG.adjustment_interval)  # more would-be scale-ups: none applied
    assert planner.num_changes_applied == 0
    assert outside.targets == [] and len(outside.workers) == 1
    assert await rt.discovery.get_prefix(target_key(namespace, MODEL, Pool.DECODE)) == {}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert {e.value for e in acc.Scalars("pull/decode_workers")} == {1}
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("adjustment/decisions/text_summary")]
    assert any("[no-operation] decode: would scale up 1 -> 2" in t for t in texts)


def planner_process(runtime_config, namespace: str, log_dir: Path) -> subprocess.Popen:
    from tests.integration.test_worker import worker_env

    cmd = [sys.executable, "-m", "components.cli.main", "planner", "--namespace", namespace, "--environment", "virtual"]
    cmd += ["--metric-pulling-interval", "0.05", "--adjustment-interval", "0.2", "--log-dir", str(log_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=worker_env(runtime_config))


async def test_kvmesh_planner_command_runs_and_stops_on_sigterm(runtime_config, tmp_path, namespace):
    """The command line end to end: READY, TensorBoard files written, SIGTERM -> STOPPED and exit 0."""
    proc = planner_process(runtime_config, namespace, tmp_path)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.startswith(f"READY planner {namespace}/{MODEL} (virtual)"), line
        await wait_until(lambda: any(tmp_path.glob("events.out.tfevents.*")), timeout_s=10)
        await asyncio.sleep(0.5)  # a few pulls and adjustments (no worker: hold, "missing metrics")
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0
        assert out.strip().splitlines()[-1] == "STOPPED"
    finally:
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)


class HeldConnector:
    """A connector whose every change waits until the test releases it (the loop's bookkeeping around
    ``set_pool_size``, nothing else, is what the test below checks)."""

    name = "held"

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.release: list[asyncio.Event] = []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def gpus_per_worker(self, pool: Pool) -> int | None:
        return None

    async def set_pool_size(self, pool: Pool, count: int) -> None:
        self.calls.append(count)
        ev = asyncio.Event()
        self.release.append(ev)
        await ev.wait()


async def test_an_addition_in_progress_can_be_raised_and_the_pool_settles_when_the_latest_change_ends(
    make_runtime, namespace
):
    from components.planner.config import SlaPlannerConfig
    from components.planner.policy import Adjustment, ScalingDecision
    from components.planner.sla.controller import SlaController

    cfg = SlaPlannerConfig()
    connector = HeldConnector()
    planner = Planner(
        await make_runtime(),
        cfg,
        namespace,
        MODEL,
        connector,
        controller=SlaController(cfg, MODEL),  # type: ignore[arg-type]
    )

    def step(current: int, target: int) -> Adjustment:
        direction = Direction.UP if target > current else Direction.DOWN
        return Adjustment(0.0, (ScalingDecision(Pool.DECODE, direction, current, target, "test", {}),), 1, 1, False)

    planner.apply(step(1, 2))
    await wait_until(lambda: connector.calls == [2], timeout_s=5)
    planner.apply(step(2, 5))  # raised while 1 -> 2 runs: a second change, to 5
    await wait_until(lambda: connector.calls == [2, 5], timeout_s=5)
    planner.apply(step(5, 4))  # a removal while an addition runs: refused, nothing asked
    assert connector.calls == [2, 5] and planner.changes_in_progress()[Pool.DECODE].target == 5
    connector.release[0].set()  # the first change ends: the pool is not settled, the raise still runs
    await wait_until(lambda: planner.num_changes_applied == 1, timeout_s=5)
    assert planner.changes_in_progress()[Pool.DECODE].target == 5
    connector.release[1].set()
    await wait_until(lambda: planner.num_changes_applied == 2, timeout_s=5)
    assert planner.changes_in_progress() == {}


async def test_a_worker_added_by_hand_is_the_new_start_and_the_planner_still_scales_down(make_runtime, namespace):
    # Dynamo's issue 4420: after a hand edit its planner could no longer scale down. Here the outside system reports
    # 2 workers by itself (a person scaled it), the second registers later: the planner holds the pool as changing
    # 1 -> 2 until it does, then, the pool idle (KV use 0 < 0.2), scales it down to 1 through the connector.
    workers_rt = await make_runtime()
    outside = OutsideSystem(workers_rt, namespace)
    await outside.add_worker()
    outside.start()
    rt = await make_runtime()
    planner = Planner(rt, PLANNER_CFG, namespace, MODEL, VirtualConnector(rt, namespace, MODEL, timeout_s=10))
    try:
        async with running(planner):
            await wait_until(lambda: planner.num_pulls >= 2, timeout_s=10)
            assert await planner.connector.pool_size(Pool.DECODE) is None  # nothing answered yet
            by_hand = VirtualRequest(2, "by-hand").to_json()
            await workers_rt.discovery.put(done_key(namespace, MODEL, Pool.DECODE), by_hand)
            await wait_until(lambda: Pool.DECODE in planner.changes_in_progress(), timeout_s=10)
            change = planner.changes_in_progress()[Pool.DECODE]
            assert (change.before, change.target) == (1, 2)
            assert outside.targets == []  # the planner asked for nothing meanwhile
            await outside.add_worker()
            await wait_until(lambda: outside.targets[-1:] == [1], timeout_s=20)
            assert len(outside.workers) == 1 and planner.num_change_failures == 0
    finally:
        await outside.stop()
