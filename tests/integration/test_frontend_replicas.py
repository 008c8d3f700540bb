"""``kvmesh frontend --replicas 2``: two frontend processes on one port, over real etcd and nats-server, in front of
simulated workers that run in this process (so the test can see their engines).

Which replica answered a request is read from its id (``cmpl-<the process's 12-hex-digit prefix><counter>``,
components/frontend/service.py). A ``Pinned`` session holds one keep-alive connection, so everything sent through
it reaches the replica that accepted that connection; the tests open connections until each replica has one (the
kernel's SO_REUSEPORT hash picks the replica per connection).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from openai import AsyncOpenAI

from components.fleet.live import LiveFleet
from components.fleet.model import RequestWindow
from components.runtime import RuntimeConfig
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker
from tests.support.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL_PATH = str(ROOT / "models" / "tiny-llama")
MODEL = "tiny-llama"


def replica_of(response_id: str) -> str:
    """The answering process's request-id prefix (``FrontendService.new_request_id``)."""
    return response_id.split("-", 1)[1][:12]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (the sum over samples that match); 0 if absent."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\S+?)(\{.*\})? (\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


class Pinned:
    """One keep-alive connection to the frontend: every request sent through it reaches the same replica."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        self.replica = ""

    async def complete(self, prompt: Any, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            out: dict[str, Any] = await r.json()
        self.replica = replica_of(out["id"])
        return out

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()

    async def close(self) -> None:
        await self.session.close()


class Replicas:
    """A ``kvmesh frontend --replicas 2`` process and the workers it serves."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, workers: list[Worker]) -> None:
        self.proc = proc
        self.url = url
        self.workers = workers
        self.pinned: list[Pinned] = []

    def replica_pids(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children()]

    async def pin(self) -> dict[str, Pinned]:
        """A connection to each replica (opened until both have one: each lands on one of two, by the hash)."""
        by_replica: dict[str, Pinned] = {}
        for _ in range(64):
            p = Pinned(self.url)
            self.pinned.append(p)
            await p.complete("hi")
            by_replica.setdefault(p.replica, p)
            if len(by_replica) == 2:
                return by_replica
        raise AssertionError(f"64 connections all reached {list(by_replica)}")

    async def close(self) -> None:
        for p in self.pinned:
            await p.close()


@pytest.fixture
async def make_replicas(
    runtime_config: RuntimeConfig, make_runtime: Any, namespace: str
) -> AsyncIterator[Callable[..., Awaitable[Replicas]]]:
    made: list[Replicas] = []

    async def make(*flags: str, num_workers: int = 2, kv_events_batch_ms: int = 10, **engine: Any) -> Replicas:
        worker_rt = await make_runtime()
        workers = []
        for i in range(num_workers):
            ecfg = MockEngineConfig(vocab_size=384, eos_token_id=257, max_model_len=2048, num_gpu_blocks=512,
                                    **({"speedup_ratio": float("inf")} | engine))  # fmt: skip
            w = Worker(worker_rt, WorkerConfig(namespace=namespace, model=MODEL, model_path=MODEL_PATH,
                                               metrics_interval_ms=100, kv_events_batch_ms=kv_events_batch_ms),
                       MockEngine(ecfg, name=f"m{i}"))  # fmt: skip
            await w.start()
            workers.append(w)
        cmd = [sys.executable, "-m", "components.cli.main", "--log-level", "INFO", "frontend", "--namespace", namespace,
               "--port", "0", "--etcd", runtime_config.etcd_endpoints[0], "--nats", runtime_config.nats_url,
               "--replicas", "2", *flags]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line.startswith("READY http://127.0.0.1:"), line
        r = Replicas(proc, line.split()[1], workers)
        made.append(r)
        return r

    yield make
    for r in made:
        await r.close()
        if r.proc.returncode is None:
            r.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(r.proc.wait(), 60)
            except TimeoutError:
                r.proc.kill()
                await r.proc.wait()
        for w in r.workers:
            await w.stop()


async def test_the_openai_clients_requests_land_on_both_processes_and_metrics_count_them_all(make_replicas):
    r: Replicas = await make_replicas()
    assert len(r.replica_pids()) == 2
    seen: dict[str, int] = {}
    clients = []
    try:
        # Each client has its own connection pool: a new connection each, spread over the replicas by the kernel.
        for _ in range(40):
            client = AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
            clients.append(client)
            out = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
            assert out.usage is not None and out.usage.completion_tokens == 3
            seen[replica_of(out.id)] = seen.get(replica_of(out.id), 0) + 1
            if len(seen) == 2 and len(clients) >= 8:
                break
    finally:
        for c in clients:
            await c.close()
    assert len(seen) == 2, seen
    # Whichever replica answers the scrape counts every replica's requests.
    by = await r.pin()
    for p in by.values():
        text = await p.metrics()
        done = metric(text, "kvmesh_frontend_requests_total", endpoint="completions", status="200")
        assert done == sum(seen.values()) + len(r.pinned), p.replica
        assert metric(text, "kvmesh_frontend_worker_requests_total", model=MODEL) == done


async def test_an_abort_and_its_metrics_are_right_whichever_process_took_the_request(make_replicas):
    # least_loaded reads in-flight counts, so the replicas share them (router_replica_sync, on by default).
    r: Replicas = await make_replicas("--router-policy", "least_loaded", speedup_ratio=1.0)
    by = await r.pin()
    a, b = by.values()
    # Real time: ~5 ms a decode step, so 1500 tokens take ~8 s; each request is aborted long before.
    body = {"model": MODEL, "prompt": "hold on", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    streams = []
    for p in (a, b):
        resp = await p.session.post(p.url + "/v1/completions", json=body)
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: {")
        streams.append(resp)

    async def running() -> int:
        return sum(w.engine.snapshot().num_running for w in r.workers)

    assert await running() == 2
    # Each replica's router counts both requests: its own, and the other's through replica sync.
    extra = await r.pin()  # fresh connections for scrapes: the pinned ones are busy streaming

    async def views(n: int) -> bool:
        counts = [
            metric(await p.metrics(), "kvmesh_frontend_router_inflight_requests", model=MODEL) for p in extra.values()
        ]
        return counts == [n, n]

    await wait_until_async(lambda: views(2), timeout_s=10)
    for resp in streams:
        resp.close()  # the client goes away mid-stream

    async def freed() -> bool:
        return await running() == 0 and all(w.engine.snapshot().num_waiting == 0 for w in r.workers)

    await wait_until_async(freed, timeout_s=10)
    await wait_until_async(lambda: views(0), timeout_s=10)
    for p in extra.values():
        text = await p.metrics()
        assert metric(text, "kvmesh_frontend_requests_total", endpoint="completions", status="499") == 2
        assert metric(text, "kvmesh_frontend_inflight_requests", model=MODEL) == 0


async def test_a_repeated_prefix_lands_on_its_holder_whichever_process_takes_it(make_replicas):
    r: Replicas = await make_replicas("--router-policy", "kv", num_workers=4)
    by = await r.pin()
    x, y = by
    # Two prompts of 256 token ids (16 blocks), each sent first through one replica, then again through the other.
    prompts = {(x, y): [(7 * i + 3) % 256 for i in range(256)], (y, x): [(11 * i + 5) % 256 for i in range(256)]}
    for (first, second), prompt in prompts.items():
        sender, repeater = by[first], by[second]
        before = await repeater.metrics()
        out = await sender.complete(prompt, max_tokens=2)
        assert out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0

        async def holder(repeater: Pinned = repeater, before: str = before) -> str | None:
            """The worker whose blocks in the other replica's KV index grew by the prompt's 16 (its KV events
            reached that process), if any yet."""
            text = await repeater.metrics()
            for m in re.finditer(r'kvmesh_frontend_router_kv_blocks\{[^}]*worker="([0-9a-f]+)"[^}]*\} (\S+)', text):
                gained = float(m.group(2)) - metric(before, "kvmesh_frontend_router_kv_blocks", worker=m.group(1))
                if gained >= 16:
                    return m.group(1)
            return None

        async def indexed(holder: Callable[[], Awaitable[str | None]] = holder) -> bool:
            return await holder() is not None

        await wait_until_async(indexed, timeout_s=10)
        w = await holder()
        assert w is not None
        served_before = metric(await repeater.metrics(), "kvmesh_frontend_worker_requests_total", worker=w)
        again = await repeater.complete(prompt, max_tokens=2)
        assert replica_of(again["id"]) == second
        # The other process sent it to the holder: its prefix came from the cache (all but the last block at most).
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256 - 16
        served = metric(await repeater.metrics(), "kvmesh_frontend_worker_requests_total", worker=w)
        assert served == served_before + 1


async def test_a_prefix_routed_by_one_process_goes_to_its_worker_at_the_other_before_the_kv_events(make_replicas):
    # The workers hold their KV events back for 60 s (their batch window), so neither process's index learns of a
    # block from events during the test: what the other process knows it knows from the first one's routed message
    # (its provisional blocks). On main it knows nothing and the wait below times out.
    r: Replicas = await make_replicas("--router-policy", "kv", num_workers=4, kv_events_batch_ms=60_000)
    by = await r.pin()
    x, y = by
    sender, repeater = by[x], by[y]
    prompt = [(13 * i + 1) % 256 for i in range(256)]  # 256 token ids: 16 blocks
    out = await sender.complete(prompt, max_tokens=2)
    assert out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0

    async def predicted() -> str | None:
        """The worker holding the prompt's 16 blocks in the other process's index, if any yet."""
        text = await repeater.metrics()
        for m in re.finditer(r'kvmesh_frontend_router_kv_blocks\{[^}]*worker="([0-9a-f]+)"[^}]*\} (\S+)', text):
            if float(m.group(2)) >= 16:
                return m.group(1)
        return None

    async def known() -> bool:
        return await predicted() is not None

    await wait_until_async(known, timeout_s=10)
    w = await predicted()
    assert w is not None
    assert sum(x.num_kv_batches_published for x in r.workers) == 0  # no event has left any worker
    served_before = metric(await repeater.metrics(), "kvmesh_frontend_worker_requests_total", worker=w)
    again = await repeater.complete(prompt, max_tokens=2)
    assert replica_of(again["id"]) == y
    # The other process sent it to the worker that computed it: the engine found the prefix in its cache.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256 - 16
    assert metric(await repeater.metrics(), "kvmesh_frontend_worker_requests_total", worker=w) == served_before + 1


async def test_a_replica_that_dies_is_started_again_and_serves(make_replicas):
    r: Replicas = await make_replicas()
    old = r.replica_pids()
    os.kill(old[0], signal.SIGKILL)

    async def replaced() -> bool:
        pids = r.replica_pids()
        return len(pids) == 2 and old[0] not in pids

    await wait_until_async(replaced, timeout_s=30)
    # The new process listens again: connections reach two processes, both answer.
    await wait_until_async(lambda: _both_answer(r), timeout_s=60, step_s=0.2)


async def _both_answer(r: Replicas) -> bool:
    with contextlib.suppress(aiohttp.ClientError, AssertionError):
        by = await r.pin()
        return len(by) == 2
    return False


async def test_sigterm_stops_every_replica(make_replicas):
    r: Replicas = await make_replicas()
    pids = r.replica_pids()
    assert r.proc.stdout is not None
    r.proc.send_signal(signal.SIGTERM)
    rest = (await asyncio.wait_for(r.proc.stdout.read(), 60)).decode()
    assert await r.proc.wait() == 0
    assert rest.strip().endswith("STOPPED")
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


async def test_each_replica_publishes_request_reports_of_the_requests_it_took(make_replicas, make_runtime, namespace):
    fleet = LiveFleet(await make_runtime(), namespace)
    await fleet.start()
    try:
        r: Replicas = await make_replicas("--request-stats-interval-s", "0.2")

        def window(since_s: float) -> RequestWindow:
            return fleet.snapshot().request_window(MODEL, since_s)

        # Both processes report (zeros while idle), each under its own source: wait for both before counting.
        t0 = fleet.clock()
        await wait_until(lambda: window(t0).sources == 2, timeout_s=30.0)
        t1 = fleet.clock()
        by = await r.pin()  # requests until each replica has taken one: 1 prompt token ("hi"), 1 output token each
        took = collections.Counter(p.replica for p in r.pinned)
        assert len(took) == 2 and sum(took.values()) == len(r.pinned)
        await wait_until(lambda: window(t1).finished >= len(r.pinned), timeout_s=30.0)
        w = window(t1)
        assert (w.requests, w.finished, w.failed, w.output_tokens) == (len(r.pinned), len(r.pinned), 0, len(r.pinned))
        # Per source, the requests of one replica: the same split as the replicas' own request ids show.
        per_source: collections.Counter[str] = collections.Counter()
        for rec in fleet.snapshot().requests[MODEL]:
            if rec.received_s > t1:
                per_source[rec.source] += rec.report.requests
        assert sorted(per_source.values()) == sorted(took.values()), (per_source, took, list(by))
    finally:
        await fleet.stop()
