"""The router on real etcd and nats-server, against in-process simulated workers (and one worker process to kill).

- KV events: a long prefix a worker has served is routed back to it, whether the router learned it from events as
  they happened or from the worker's kv_state snapshot when the router joined late; the worker really hits its cache.
- Liveness: a worker that stops (deregisters) or is killed (SIGKILL: its lease lives on for seconds) is excluded
  within one second.
- The frontend with ``router_policy kv`` sends a repeated prompt to the same worker; pins and program ids reach it.
- Two standalone routers (``RouterService``) share their in-flight assignments; ``kvmesh router`` runs as a command.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from components.frontend import Frontend, FrontendConfig
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.router import Router, RouterConfig, RouteRequest, RouterServiceConfig
from components.router.feed import RouterFeed
from components.router.service import RouterClient, RouterService
from components.runtime import Client, Runtime
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL_PATH = str(ROOT / "models" / "tiny-llama")
MODEL = "mock-model"
BS = 16
VOCAB = 384  # the tiny-llama tokenizer's, so the frontend test can use the same engines


def engine_config() -> MockEngineConfig:
    return MockEngineConfig(
        num_gpu_blocks=2048,
        block_size=BS,
        max_model_len=8192,
        speedup_ratio=float("inf"),
        vocab_size=VOCAB,
        eos_token_id=257,
    )


async def eventually(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> float:
    """Poll ``pred`` every 10 ms; returns the seconds it took, fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


class Fleet:
    def __init__(self, rt: Runtime, namespace: str) -> None:
        self.rt = rt
        self.namespace = namespace
        self.workers: list[Worker] = []
        self._client: Client | None = None

    async def add(self, n: int = 1, model: str = MODEL, engine: MockEngineConfig | None = None) -> list[Worker]:
        cfg = WorkerConfig(
            namespace=self.namespace, model=model, model_path=MODEL_PATH, metrics_interval_ms=50, kv_events_batch_ms=5
        )
        ec = engine or engine_config()
        new = [Worker(self.rt, cfg, MockEngine(ec, name=f"m{len(self.workers) + i}")) for i in range(n)]
        for w in new:
            await w.start()
        self.workers += new
        return new

    async def generate(self, worker: Worker, prompt: list[int], rid: str, max_tokens: int = 2) -> list[dict[str, Any]]:
        """Serve ``prompt`` on ``worker`` directly (no router): what a cache warm-up looks like from outside.

        One client for the whole test: closing a runtime client within milliseconds of creating it can hang (its
        etcd watch may swallow the cancellation while it is being set up; see the runtime's Client.close)."""
        if self._client is None:
            self._client = (
                await self.rt.namespace(self.namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
            )
        body = GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)).to_dict()
        return [item async for item in await self._client.direct(body, worker.instance_id)]


@pytest.fixture
async def fleet(make_runtime, namespace) -> AsyncIterator[Fleet]:
    f = Fleet(await make_runtime(), namespace)
    yield f
    for w in f.workers:
        with contextlib.suppress(Exception):
            await w.stop()


@pytest.fixture
async def make_router(make_runtime, namespace) -> AsyncIterator[Callable[..., Any]]:
    feeds: list[RouterFeed] = []

    async def make(**cfg: Any) -> Router:
        router = Router(RouterConfig(router_seed=0, **cfg))
        feed = RouterFeed(await make_runtime(), router, namespace, ["backend"], watch_workers=True)
        await feed.start()
        feeds.append(feed)
        return router

    yield make
    for feed in feeds:
        await feed.stop()


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]


async def test_a_repeated_long_prefix_goes_to_the_worker_holding_it(fleet, make_router):
    workers = await fleet.add(4)
    router = await make_router(router_policy="kv")
    await eventually(lambda: router.members() == sorted(w.instance_id for w in workers), what="discovery")
    prefixes = prompts(4, 1024)  # 64 blocks each
    for i, (w, prefix) in enumerate(zip(workers, prefixes, strict=True)):
        await fleet.generate(w, prefix + [7] * 10, f"warm{i}")
    # Learned through the KV events as they are published.
    for w, prefix in zip(workers, prefixes, strict=True):
        await eventually(lambda p=prefix, w=w: router.index.overlaps(block_hashes(p, BS)).get(w.instance_id) == 64)
    # And the load reports show the warm-up finished: a report still counting a warm-up's prompt as queued prefill
    # rightly costs its holder more than an idle worker's full prefill of this one.
    await eventually(
        lambda: all(not s.num_running and s.queued_prefill_tokens == 0 for s in router.workers(MODEL)),
        what="idle load reports",
    )
    for i, (w, prefix) in enumerate(zip(workers, prefixes, strict=True)):
        req = router.prepare(RouteRequest(prefix + [9, 9, 9] * i, MODEL, time.monotonic()))
        d = router.select(req)
        assert (d.instance_id, d.overlap_blocks) == (w.instance_id, 64), d.reason
    # Routed for real: the chosen worker serves the 64 blocks from its prefix cache.
    req = router.prepare(RouteRequest(prefixes[2] + [5] * 20, MODEL, time.monotonic()))
    d = router.select(req)
    router.on_routed("real", d, req)
    [chosen] = [w for w in workers if w.instance_id == d.instance_id]
    items = await fleet.generate(chosen, list(req.token_ids), "real")
    router.on_first_token("real")
    router.on_finished("real")
    assert TokenChunk.from_dict(items[0]).num_cached_tokens == 1024
    assert router.active_requests(d.instance_id) == 0


async def test_a_router_that_joins_late_learns_warm_caches_from_snapshots(fleet, make_router):
    workers = await fleet.add(3)
    prefix = prompts(1, 2048, seed=1)[0]  # 128 blocks
    await fleet.generate(workers[1], prefix, "before-router")
    router = await make_router(router_policy="kv")
    # No event about that prefix will ever come again: only the kv_state snapshot fetched at join can tell.
    await eventually(lambda: router.index.overlaps(block_hashes(prefix, BS)).get(workers[1].instance_id) == 128)
    d = router.select(router.prepare(RouteRequest(prefix + [3] * 30, MODEL, time.monotonic())))
    assert d.instance_id == workers[1].instance_id


async def test_a_prefix_evicted_to_a_workers_host_tier_is_routed_back_there_and_loaded_not_recomputed(
    fleet, make_router
):
    # 256 device blocks (4,096 tokens) and a host tier of 2,048 blocks per worker.
    small = engine_config().model_copy(update={"num_gpu_blocks": 256, "max_model_len": 4096, "num_host_blocks": 2048})
    workers = await fleet.add(3, engine=small)
    router = await make_router(router_policy="kv")
    await eventually(lambda: router.members() == sorted(w.instance_id for w in workers), what="discovery")
    prefix = prompts(1, 2048, seed=3)[0]  # 128 blocks
    hashes = block_hashes(prefix, BS)
    await fleet.generate(workers[1], prefix + [7] * 10, "warm")
    # Other prompts push it out of worker 1's device cache; its host tier keeps it.
    for i, other in enumerate(prompts(3, 3000, seed=4)):
        await fleet.generate(workers[1], other, f"evict{i}")
    await eventually(
        lambda: (
            router.index.overlaps(hashes).get(workers[1].instance_id, 0) == 0
            and router.host_index is not None
            and router.host_index.overlaps(hashes).get(workers[1].instance_id) == 128
        ),
        what="device eviction and host blocks seen through the KV events",
    )
    await eventually(
        lambda: all(not s.num_running and s.queued_prefill_tokens == 0 for s in router.workers(MODEL)),
        what="idle load reports",
    )
    req = router.prepare(RouteRequest(prefix + [5] * 20, MODEL, time.monotonic()))
    d = router.select(req)
    assert (d.instance_id, d.overlap_blocks, d.host_overlap_blocks) == (workers[1].instance_id, 0, 128), d.reason
    router.on_routed("real", d, req)
    items = await fleet.generate(workers[1], list(req.token_ids), "real")
    router.on_first_token("real")
    router.on_finished("real")
    first = TokenChunk.from_dict(items[0])
    assert first.num_cached_tokens == first.num_host_cached_tokens == 2048  # loaded from host memory, not computed
    # A router that joins now learns the host tier from the kv_state snapshot.
    late = await make_router(router_policy="kv")
    await eventually(
        lambda: late.host_index is not None and late.host_index.overlaps(hashes).get(workers[1].instance_id) == 128,
        what="host blocks from the snapshot",
    )


async def test_a_stopped_worker_is_excluded_within_a_second_and_its_blocks_leave(fleet, make_router):
    workers = await fleet.add(3)
    router = await make_router(router_policy="kv")
    await eventually(lambda: len(router.members()) == 3)
    prefix = prompts(1, 512, seed=2)[0]
    await fleet.generate(workers[0], prefix, "w")
    hashes = block_hashes(prefix, BS)
    await eventually(lambda: workers[0].instance_id in router.index.overlaps(hashes))
    gone = workers[0].instance_id
    stopping = asyncio.create_task(workers[0].stop())  # deregisters first, then drains
    took = await eventually(lambda: gone not in router.members(), timeout_s=1.0, what="exclusion")
    await stopping
    fleet.workers.remove(workers[0])
    assert took < 1.0
    assert gone not in router.index.overlaps(hashes)
    chosen = {router.select(RouteRequest(prefix, MODEL, time.monotonic())).instance_id for _ in range(10)}
    assert gone not in chosen


async def test_a_killed_worker_is_excluded_by_its_silence_before_its_lease_expires(
    fleet, make_router, runtime_config, namespace
):
    """SIGKILL: nothing deregisters it and its lease lives on (10 s here); its load reports stop, and after 5 of
    its 100 ms intervals it counts as dead."""
    await fleet.add(2)
    env = os.environ | {
        "KVMESH_ETCD_ENDPOINTS": runtime_config.etcd_endpoints[0],
        "KVMESH_NATS_URL": runtime_config.nats_url,
        "KVMESH_LEASE_TTL_S": "10",
    }
    cmd = [sys.executable, "-m", "components.cli.main", "worker", "--namespace", namespace, "--model", MODEL]
    cmd += ["--metrics-interval-ms", "100", "--speedup-ratio", "inf", "--vocab-size", str(VOCAB)]
    cmd += ["--eos-token-id", "257", "--max-model-len", "8192"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        assert line.startswith("READY 1 workers: "), line
        doomed = int(line.split(": ")[1], 16)
        router = await make_router(router_policy="round_robin")

        def reporting() -> bool:
            ws = {w.instance_id: w for w in router.workers(MODEL)}
            return doomed in ws and ws[doomed].metrics_interval_s is not None and len(ws) == 3

        await eventually(reporting, timeout_s=10, what="the worker process reporting")
        assert doomed in router.routable(MODEL, time.monotonic())
        proc.kill()
        killed_s = time.monotonic()
        # Excluded by its silence, well before its 10 s lease could expire. How soon is the rule's (5 intervals,
        # at least 0.5 s, after the last report), not a wall-clock race: a loaded CI machine delivers late.
        await eventually(
            lambda: doomed not in router.routable(MODEL, time.monotonic()), timeout_s=5.0, what="exclusion"
        )
        last = {w.instance_id: w for w in router.workers(MODEL)}[doomed]
        assert last.metrics_received_s is not None and last.metrics_received_s <= killed_s + 0.5
        assert last.metrics_stale_after_s - last.metrics_received_s < 1.0  # 5 x ~100 ms, floor 0.5 s
        assert router.is_member(doomed)  # still registered: only its silence gave it away
        chosen = {router.select(RouteRequest([1, 2, 3], MODEL, time.monotonic())).instance_id for _ in range(6)}
        assert doomed not in chosen and len(chosen) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


# --- the frontend ---------------------------------------------------------------------------------------------------


@pytest.fixture
async def frontend(make_runtime, fleet, namespace) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[Frontend, AsyncOpenAI]] = []

    async def make(**config: Any) -> tuple[Frontend, AsyncOpenAI]:
        fe = Frontend(FrontendConfig(namespace=namespace, port=0, **config), await make_runtime())
        url = await fe.start()
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        made.append((fe, client))
        return fe, client

    yield make
    for fe, client in made:
        await client.close()
        await fe.stop()


def served(w: Worker) -> int:
    return sum(s.server.num_served for s in w._served if s.info.endpoint == ENDPOINT_GENERATE)


async def test_the_frontend_with_kv_routing_sends_a_repeated_prompt_to_the_same_worker(fleet, frontend):
    workers = await fleet.add(3, model="tiny-llama")
    fe, client = await frontend(router_policy="kv")
    await fe.registry.wait_for_model("tiny-llama")
    await eventually(lambda: len(fe.registry.models["tiny-llama"].instances) == 3)
    prompt = prompts(1, 640, seed=3)[0]  # 40 blocks
    first = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4)
    [home] = [w for w in workers if served(w) == 1]
    assert first.usage.prompt_tokens == 640
    await eventually(lambda: fe.router.index.overlaps(block_hashes(prompt, BS)).get(home.instance_id) == 40)
    for _ in range(3):
        again = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4)
        assert again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens >= 624  # all but the last block (or token) cached
    assert [served(w) for w in workers] == [4 if w is home else 0 for w in workers]
    assert fe.router.active_requests(home.instance_id) == 0


async def test_the_frontend_honours_a_pin_and_passes_program_ids_to_affinity_policies(fleet, frontend):
    workers = await fleet.add(2, model="tiny-llama")
    fe, client = await frontend(router_policy="kv+autellix", locality_threshold_tokens=100)
    await fe.registry.wait_for_model("tiny-llama")
    await eventually(lambda: len(fe.registry.models["tiny-llama"].instances) == 2)
    target = workers[1]
    for _ in range(3):
        await client.completions.create(
            model="tiny-llama",
            prompt=[1, 2, 3],
            max_tokens=1,
            extra_headers={"x-worker-instance-id": f"{target.instance_id:x}"},
        )
    assert (served(workers[0]), served(target)) == (0, 3)
    # A long request with a program id (the header wins over `user`) is remembered, then forgotten at its end.
    long_prompt = prompts(1, 200, seed=4)[0]
    await client.completions.create(
        model="tiny-llama", prompt=long_prompt, max_tokens=1, user="alice", extra_headers={"x-program-id": "agent-1"}
    )
    state = fe.router.policy_state("tiny-llama")
    assert set(state.programs) == {"agent-1"} and state.stats.num_assigns == 1
    await client.completions.create(model="tiny-llama", prompt=long_prompt, max_tokens=1, user="bob")
    await client.completions.create(
        model="tiny-llama",
        prompt=long_prompt,
        max_tokens=1,
        extra_headers={"x-program-id": "agent-1", "x-program-end": "true"},
    )
    state = fe.router.policy_state("tiny-llama")
    assert set(state.programs) == {"bob"} and state.stats.num_locality_hits == 1 and state.stats.num_ended == 1


# --- standalone routers ---------------------------------------------------------------------------------------------


async def test_two_standalone_routers_share_their_in_flight_assignments(fleet, make_runtime, namespace):
    workers = await fleet.add(2)
    services = []
    for _ in range(2):
        cfg = RouterServiceConfig(namespace=namespace, router_policy="least_loaded", router_sync_interval_s=0.2)
        svc = RouterService(cfg, await make_runtime())
        await svc.start()
        services.append(svc)
    a, b = services
    client = await RouterClient.connect(await make_runtime(), namespace)
    try:
        await eventually(lambda: len(client.instance_ids()) == 2)
        await eventually(lambda: all(len(s.router.members()) == 2 for s in services))
        ids = sorted(w.instance_id for w in workers)
        # r1 through replica a; r2 through replica b, which must count r1 and pick the other worker.
        d1 = await client.route(MODEL, [1, 2, 3], "r1", router_instance_id=a.instance_id)
        await eventually(lambda: b.router.is_inflight("r1"))
        d2 = await client.route(MODEL, [1, 2, 3], "r2", router_instance_id=b.instance_id)
        assert {d1.instance_id, d2.instance_id} == set(ids)
        await eventually(lambda: a.router.is_inflight("r2"))
        assert [a.router.active_requests(i) for i in ids] == [1, 1] == [b.router.active_requests(i) for i in ids]
        # Reports may reach either replica: r1's end, told to b, settles it on a too.
        assert await client.report("r1", "first_token", router_instance_id=b.instance_id)
        assert await client.report("r1", "finished", router_instance_id=b.instance_id)
        await eventually(lambda: not a.router.is_inflight("r1"))
        assert not await client.report("r1", "finished", router_instance_id=a.instance_id)  # already settled
        # A dry run (no request id) records nothing; "no workers" is a decision, not an error.
        d = await client.route(MODEL, [4, 5])
        assert d.instance_id == d1.instance_id  # the idle one
        nowhere = await client.route("no-such-model", [1])
        assert nowhere.instance_id is None and "no workers" in nowhere.reason
        # Stopping a replica says bye: the other forgets r2 at once, not after 5 silent intervals.
        await b.stop()
        services.remove(b)
        await eventually(lambda: not a.router.is_inflight("r2"), timeout_s=0.5)
    finally:
        await client.close()
        for s in services:
            await s.stop()


async def test_kvmesh_router_command_serves_until_sigterm(fleet, make_runtime, runtime_config, namespace):
    await fleet.add(1)
    env = os.environ | {
        "KVMESH_ETCD_ENDPOINTS": runtime_config.etcd_endpoints[0],
        "KVMESH_NATS_URL": runtime_config.nats_url,
    }
    cmd = [sys.executable, "-m", "components.cli.main", "router", "--namespace", namespace, "--router-policy", "kv"]
    cmd += ["--kv-overlap-score-weight", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        assert line.startswith("READY "), line
        client = await RouterClient.connect(await make_runtime(), namespace)
        try:
            d = None
            for _ in range(100):  # the router discovers the worker a moment after it is ready
                d = await client.route(MODEL, list(range(1, 40)), "cli-1")
                if d.instance_id is not None:
                    break
                await asyncio.sleep(0.05)
            assert d is not None and d.instance_id == fleet.workers[0].instance_id and d.reason.startswith("kv:")
            assert await client.report("cli-1", "finished")
        finally:
            await client.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
        assert proc.stdout.read().strip().endswith("STOPPED")  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
