"""Simulated workers on real etcd and nats-server: register, serve, report, drain."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_KV_STATE, TOPIC_KV_EVENTS, TOPIC_LOAD_METRICS
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import (
    GenerateRequest,
    KvEvent,
    KvEventKind,
    KvStateSnapshot,
    LoadSnapshot,
    SamplingParams,
    TokenChunk,
)
from components.runtime import collect
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

# `kvmesh worker` with mock engines at speedup 1 (~5 ms per decode step); the caller adds its namespace and flags.
MOCK_WORKER_FLAGS = ["--speedup-ratio", "1", "--vocab-size", "1000", "--eos-token-id", "999"]
MOCK_WORKER_FLAGS += ["--num-gpu-blocks", "1024", "--max-model-len", "4096"]


def worker_command(namespace: str, *flags: str, log_level: str = "WARNING") -> list[str]:
    cmd = [sys.executable, "-m", "components.cli.main", "--log-level", log_level, "worker", "--namespace", namespace]
    return [*cmd, *MOCK_WORKER_FLAGS, *flags]


def worker_env(runtime_config, **extra: str) -> dict[str, str]:
    return os.environ | {
        "KVMESH_ETCD_ENDPOINTS": runtime_config.etcd_endpoints[0],
        "KVMESH_NATS_URL": runtime_config.nats_url,
        **extra,
    }


async def ready_instance_id(proc: subprocess.Popen) -> int:
    """The instance id a one-worker `kvmesh worker` prints on its READY line."""
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
    assert line.startswith("READY 1 workers: "), line
    return int(line.split(": ")[1], 16)


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> dict:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)).to_dict()


async def tokens_of(stream) -> list[int]:
    out: list[int] = []
    async for item in stream:
        out += TokenChunk.from_dict(item).token_ids
    return out


@pytest.fixture
async def fleet(make_runtime, namespace):
    """Four in-process workers on one runtime (each with its own lease), plus a client runtime."""
    rt = await make_runtime()
    cfg = WorkerConfig(namespace=namespace, model="mock-model", metrics_interval_ms=50, kv_events_batch_ms=5)
    engine_cfg = MockEngineConfig(
        num_gpu_blocks=256,
        block_size=16,
        max_model_len=2048,
        speedup_ratio=float("inf"),
        vocab_size=1000,
        eos_token_id=999,
    )
    workers = [Worker(rt, cfg, MockEngine(engine_cfg, name=f"m{i}"), index=i) for i in range(4)]
    for w in workers:
        await w.start()
    client_rt = await make_runtime()
    yield workers, client_rt
    for w in workers:
        await w.stop()


async def test_workers_register_with_own_leases_and_serve(fleet, namespace):
    workers, crt = fleet
    client = await crt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
    await client.wait_for_instances(4, timeout_s=5)
    assert set(client.instance_ids()) == {w.instance_id for w in workers}
    assert len({w.lease for w in workers}) == 4
    assert {i.metadata["model"] for i in client.instances()} == {"mock-model"}
    assert {i.metadata["block_size"] for i in client.instances()} == {16}

    prompt = list(range(1, 41))
    outs = [await tokens_of(await client.direct(request(f"r{w.index}", prompt), w.instance_id)) for w in workers]
    assert len(outs[0]) == 8
    assert all(o == outs[0] for o in outs)  # identical requests, identical tokens on every worker


async def test_metrics_and_kv_events_reach_a_subscriber(fleet, namespace):
    workers, crt = fleet
    ns = crt.namespace(namespace)
    metrics = await ns.events.subscribe(TOPIC_LOAD_METRICS, decode=LoadSnapshot.from_dict)
    kv = await ns.events.subscribe(TOPIC_KV_EVENTS, decode=lambda p: [KvEvent.from_dict(e) for e in p])
    seen: set[int] = set()
    while len(seen) < 4:
        ev = await metrics.get(timeout_s=5)
        assert 0.0 <= ev.payload.kv_usage <= 1.0 and ev.payload.num_total_blocks == 256
        seen.add(ev.source_id)
    assert seen == {w.instance_id for w in workers}

    client = await ns.component("backend").endpoint(ENDPOINT_GENERATE).client()
    await client.wait_for_instances(4)
    target = workers[2]
    prompt = list(range(100, 164))  # 64 tokens = 4 full blocks of 16
    await tokens_of(await client.direct(request("kv1", prompt, max_tokens=4), target.instance_id))
    stored: list[int] = []
    last_id = -1
    while len(stored) < 4:
        ev = await kv.get(timeout_s=5)
        assert ev.source_id == target.instance_id
        for e in ev.payload:
            assert e.event_id == last_id + 1 or last_id == -1  # contiguous ids per worker
            last_id = e.event_id
            if e.kind == KvEventKind.BLOCK_STORED:
                stored += e.block_hashes
    assert stored[:4] == block_hashes(prompt, 16)

    # The snapshot endpoint answers with the same blocks (what a router uses to resynchronise).
    state_client = await ns.component("backend").endpoint(ENDPOINT_KV_STATE).client()
    await state_client.wait_for_instances(4)
    [state] = await collect(await state_client.direct({}, target.instance_id))
    snap = KvStateSnapshot.from_dict(state)
    assert set(block_hashes(prompt, 16)) <= set(snap.block_hashes)
    assert snap.last_event_id >= last_id


async def test_engine_request_error_reaches_client_and_worker_keeps_serving(fleet, namespace):
    workers, crt = fleet
    client = await crt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
    await client.wait_for_instances(4)
    from components.runtime import RemoteHandlerError

    with pytest.raises(RemoteHandlerError) as exc:
        await tokens_of(await client.direct(request("bad", [5000]), workers[0].instance_id))  # id outside vocab
    assert "vocab" in exc.value.message.lower() or "token" in exc.value.message.lower()
    assert len(await tokens_of(await client.direct(request("ok", [1, 2, 3]), workers[0].instance_id))) == 8


async def test_sigterm_drains_with_zero_failed_requests(make_runtime, runtime_config, namespace):
    env = worker_env(runtime_config, KVMESH_LEASE_TTL_S="3")
    # Speedup 1 with the default step model: ~5 ms per decode step, so 200 tokens take about 1 s.
    cmd = worker_command(namespace, "--num-workers", "2", log_level="INFO")
    proc = subprocess.Popen(  # noqa: ASYNC220
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.startswith("READY 2 workers"), line
        crt = await make_runtime()
        client = await crt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(2, timeout_s=5)
        streams = [await client.generate(request(f"d{i}", [1, 2, 3, 4 + i], max_tokens=200)) for i in range(8)]
        first = [await s.__anext__() for s in streams]  # every request is running when the signal arrives
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.gather(*(tokens_of(s) for s in streams))
        totals = [len(TokenChunk.from_dict(f).token_ids) + len(r) for f, r in zip(first, rest, strict=True)]
        assert totals == [200] * 8
        out, err = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0
        assert out.strip().endswith("STOPPED")
        assert "start-up heap frozen: " in err  # before READY (eventloop.freeze_startup_heap)
        assert "ERROR" not in err, err  # a clean exit logs no error (it once logged an unretrieved gather)
        assert client.instance_ids() == [] or await _eventually_empty(client)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


async def _eventually_empty(client) -> bool:
    for _ in range(50):
        if not client.instance_ids():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_sigkill_mid_stream_interrupts_only_that_workers_streams(make_runtime, runtime_config, namespace):
    """SIGKILL loses the process; its streams end with StreamInterruptedError, nothing hangs, others keep serving."""
    from components.runtime import StreamInterruptedError

    env = worker_env(runtime_config)
    cmd = worker_command(namespace)
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]  # noqa: ASYNC220
    try:
        ids = [await ready_instance_id(p) for p in procs]
        crt = await make_runtime()
        client = await crt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(2, timeout_s=5)
        doomed = [await client.direct(request(f"k{i}", [1, 2, 3, i], max_tokens=2000), ids[0]) for i in range(3)]
        for s in doomed:
            await s.__anext__()
        procs[0].kill()
        for s in doomed:
            with pytest.raises(StreamInterruptedError):
                await asyncio.wait_for(tokens_of(s), 10)  # bounded: a hang fails the test
        survivor = await tokens_of(await client.direct(request("ok", [1, 2, 3], max_tokens=16), ids[1]))
        assert len(survivor) == 16
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)


async def test_a_worker_whose_engine_dies_leaves_the_fleet_and_its_process_exits_1(
    make_runtime, runtime_config, namespace
):
    """The engine dies (fault injection: --fail-after-s); its worker deregisters within a check interval, the request
    it was serving fails (not hangs), a sibling whose engine lives keeps serving, and once every engine of the
    process has died the process exits 1 so its supervisor starts a fresh one."""
    from components.runtime import RemoteHandlerError, StreamInterruptedError

    env = worker_env(runtime_config)
    cmd = worker_command(namespace, "--engine-check-interval-ms", "100")
    healthy = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    doomed = subprocess.Popen([*cmd, "--fail-after-s", "3"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        ids = [await ready_instance_id(p) for p in (healthy, doomed)]
        crt = await make_runtime()
        client = await crt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(2, timeout_s=5)
        # ~5 ms per decode step: 5000 tokens outlast the 3 s the doomed engine has left.
        stream = await client.direct(request("long", [1, 2, 3], max_tokens=5000), ids[1])
        await stream.__anext__()
        with pytest.raises((RemoteHandlerError, StreamInterruptedError)):
            await asyncio.wait_for(tokens_of(stream), 15)
        assert await asyncio.to_thread(doomed.wait, 15) == 1
        assert "DEAD mock engine" in doomed.stdout.read()
        for _ in range(100):
            if client.instance_ids() == [ids[0]]:
                break
            await asyncio.sleep(0.05)
        assert client.instance_ids() == [ids[0]]
        assert len(await tokens_of(await client.generate(request("ok", [1, 2, 3], max_tokens=16)))) == 16
    finally:
        for p in (healthy, doomed):
            if p.poll() is None:
                p.kill()
            p.wait(5)
