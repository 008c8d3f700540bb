"""Request migration between simulated workers on real etcd and nats-server (components/migration/agent.py).

Workers run in this process, each on its own runtime (its own etcd and NATS connections, as separate processes
would), or as `kvmesh worker` subprocesses where a test kills one. Clients talk to the workers' ``generate``
endpoints directly; migrations are asked of a worker's ``migrate`` endpoint as a rescheduler would. "The tokens of
an unmoved run" come from the same requests on a MockEngine of the same config in this process (its output is a
pure function of the config and the request: components/workers/engines/mock/scheduler.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from components.migration.states import Direction, MigrationState
from components.protocol.endpoints import ENDPOINT_ABORT, ENDPOINT_GENERATE, ENDPOINT_MIGRATE
from components.protocol.errors import ErrorCode
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.protocol.migration import AbortReply, AbortRequest, MigrateRequest, MigrationReport
from components.runtime import Client, RemoteHandlerError, Runtime, ServedEndpoint
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

# speedup 1 (the modelled ~5 ms decode steps, in real time): requests keep decoding while they are moved. A vocabulary
# without EOS in reach (eos 999 of 1000, ignore_eos set anyway) so every request runs to max_tokens.
ENGINE = {
    "num_gpu_blocks": 2048,
    "block_size": 16,
    "max_model_len": 4096,
    "speedup_ratio": 1.0,
    "vocab_size": 1000,
    "eos_token_id": 999,
}


def engine_config(**overrides: Any) -> MockEngineConfig:
    return MockEngineConfig(**{**ENGINE, **overrides})


def gen_request(rid: str, prompt_len: int, max_tokens: int, seed: int | None = None) -> GenerateRequest:
    prompt = [(7 * i + len(rid)) % 997 for i in range(prompt_len)]
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed))


async def unmoved(requests: list[GenerateRequest]) -> dict[str, list[int]]:
    ref = MockEngine(engine_config(speedup_ratio=float("inf")), name="reference")
    await ref.start()
    try:
        out = {}
        for r in requests:
            out[r.request_id] = [t async for c in ref.generate(r) for t in c.token_ids]
        return out
    finally:
        await ref.shutdown()


class Stream:
    """A client's stream, read in the background: tokens with their positions checked on arrival."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for item in self.stream:
                chunk = TokenChunk.from_dict(item)
                assert chunk.position == len(self.tokens), (chunk.position, len(self.tokens))
                self.tokens += chunk.token_ids
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e

    async def done(self, timeout_s: float = 30.0) -> list[int]:
        await asyncio.wait_for(self.task, timeout_s)
        if self.error is not None:
            raise self.error
        return self.tokens


async def start_worker(make_runtime: Any, namespace: str, index: int, **engine: Any) -> Worker:
    rt = await make_runtime()
    cfg = WorkerConfig(namespace=namespace, model="mock-model", metrics_interval_ms=50, kv_events_batch_ms=5)
    worker = Worker(rt, cfg, MockEngine(engine_config(**engine), name=f"w{index}"), index=index)
    await worker.start()
    return worker


async def clients(rt: Runtime, namespace: str) -> tuple[Client, Client, Client]:
    comp = rt.namespace(namespace).component("backend")
    return (
        await comp.endpoint(ENDPOINT_GENERATE).client(),
        await comp.endpoint(ENDPOINT_MIGRATE).client(),
        await comp.endpoint(ENDPOINT_ABORT).client(),
    )


async def migrate(client: Client, src: int, req: MigrateRequest) -> list[MigrationReport]:
    stream = await client.direct(req.to_dict(), src)
    return [MigrationReport.from_dict(item) async for item in stream]


@pytest.fixture
async def pair(make_runtime: Any, namespace) -> AsyncIterator[tuple[Worker, Worker, Runtime]]:
    a = await start_worker(make_runtime, namespace, 0)
    b = await start_worker(make_runtime, namespace, 1)
    client_rt = await make_runtime()
    yield a, b, client_rt
    for w in (a, b):
        await w.stop()


async def test_live_migration_under_load_back_and_forth_gives_every_client_the_unmoved_tokens(pair, namespace) -> None:
    a, b, crt = pair
    gen, mig, _ = await clients(crt, namespace)
    await gen.wait_for_instances(2, timeout_s=5)
    # Prompts of 40..1200 tokens: the long ones have more whole blocks than the last stage takes (16), so they are
    # pre-copied while they decode; 600 output tokens at ~5 ms a step keep every request running through the rounds.
    requests = [gen_request(f"r{i}", 40 + 230 * i, 600, seed=i) for i in range(6)]
    expected = await unmoved(requests)
    streams = [Stream(await gen.direct(r.to_dict(), a.instance_id)) for r in requests]
    await wait_until(lambda: all(len(s.tokens) >= 2 for s in streams), timeout_s=15)
    reports: list[MigrationReport] = []
    workers = [a, b]
    for round_ in range(8):  # bounded: 8 rounds of up to 3 requests each way
        src, dst = workers[round_ % 2], workers[(round_ + 1) % 2]
        order = ["SR", "LR", "LCR", "FCR"][round_ % 4]
        reports += await migrate(
            mig, src.instance_id, MigrateRequest(dst.instance_id, select_value=3, select_order=order)
        )
    results = [await s.done() for s in streams]
    assert results == [expected[r.request_id] for r in requests]
    committed = [r for r in reports if r.state == "committed"]
    assert len(committed) >= 8, [(r.request_id, r.state, r.reason) for r in reports]
    assert any(r.num_stages >= 2 for r in committed)  # some were pre-copied while decoding, then finished
    assert max(s.stream.num_moves for s in streams) >= 2  # moved there and back (at least)
    assert all(r.mode == "live" for r in reports)
    # Everything ended cleanly: no migration left, no blocks left reserved or held.
    for w in workers:
        assert w.agent is not None and len(w.agent.table) == 0
        await wait_until(lambda w=w: w.engine.scheduler.pool.num_active_blocks == 0)  # type: ignore[attr-defined]
    counters = a.agent.counters()  # type: ignore[union-attr]
    assert counters.get("out_committed", 0) + b.agent.counters().get("out_committed", 0) == len(committed)  # type: ignore[union-attr]


async def test_recompute_mode_moves_a_request_without_its_kv_and_the_tokens_are_the_same(pair, namespace) -> None:
    a, b, crt = pair
    gen, mig, _ = await clients(crt, namespace)
    req = gen_request("rc", 700, 300, seed=5)
    expected = await unmoved([req])
    s = Stream(await gen.direct(req.to_dict(), a.instance_id))
    await wait_until(lambda: len(s.tokens) >= 5, timeout_s=10)
    [report] = await migrate(mig, a.instance_id, MigrateRequest(b.instance_id, request_ids=["rc"], mode="recompute"))
    assert (report.state, report.mode, report.num_blocks_copied) == ("committed", "recompute", 0)
    assert await s.done() == expected["rc"]


async def test_workers_publish_their_migration_counters_by_direction_outcome_and_mode(pair, namespace) -> None:
    """Each worker's counters go out on ``migration_counters`` when they change (and every 10 s): a live and a
    recompute move from a to b are counted out on a and in on b, by the mode that ran."""
    from components.protocol.endpoints import TOPIC_MIGRATION_COUNTERS
    from components.protocol.migration import MigrationCountersReport, MigrationOutcomeCount

    a, b, crt = pair
    gen, mig, _ = await clients(crt, namespace)
    heard: dict[int, MigrationCountersReport] = {}
    sub = await crt.namespace(namespace).events.subscribe(TOPIC_MIGRATION_COUNTERS)

    async def listen() -> None:
        async for ev in sub:
            heard[ev.source_id] = MigrationCountersReport.from_dict(ev.payload)

    listener = asyncio.ensure_future(listen())
    try:
        for mode in ("live", "recompute"):
            req = gen_request(f"cnt-{mode}", 600, 200, seed=3)
            s = Stream(await gen.direct(req.to_dict(), a.instance_id))
            await wait_until(lambda s=s: len(s.tokens) >= 5, timeout_s=10)
            ask = MigrateRequest(b.instance_id, request_ids=[req.request_id], mode=mode)
            [report] = await migrate(mig, a.instance_id, ask)
            assert (report.state, report.mode) == ("committed", mode)
            await s.done()

        def row(worker: Worker, direction: str, mode: str) -> MigrationOutcomeCount:
            return MigrationOutcomeCount(direction, "committed", mode, 1)

        await wait_until(
            lambda: (
                a.instance_id in heard
                and b.instance_id in heard
                and {row(a, "out", "live"), row(a, "out", "recompute")} <= set(heard[a.instance_id].outcomes)
                and {row(b, "in", "live"), row(b, "in", "recompute")} <= set(heard[b.instance_id].outcomes)
            ),
            timeout_s=5,
        )
        assert (heard[a.instance_id].model, heard[a.instance_id].mode) == ("mock-model", "live")
        assert heard[b.instance_id].kv_pull_failures == 0
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await sub.close()


async def test_an_abort_after_migration_reaches_the_destination(pair, namespace) -> None:
    a, b, crt = pair
    gen, mig, abort = await clients(crt, namespace)
    s = Stream(await gen.direct(gen_request("ab", 300, 2000).to_dict(), a.instance_id))
    await wait_until(lambda: len(s.tokens) >= 3, timeout_s=10)
    [report] = await migrate(mig, a.instance_id, MigrateRequest(b.instance_id, request_ids=["ab"]))
    assert report.state == "committed"
    await wait_until(lambda: "ab" in b.engine.scheduler.requests)  # type: ignore[attr-defined]
    # Asked of the worker it started on: forwarded to where it runs now.
    reply_stream = await abort.direct(AbortRequest("ab", "operator").to_dict(), a.instance_id)
    [reply] = [AbortReply.from_dict(x) async for x in reply_stream]
    assert reply.aborted and reply.instance_id == b.instance_id
    assert a.agent.num_aborts_forwarded == 1  # type: ignore[union-attr]
    with pytest.raises(RemoteHandlerError) as exc:
        await s.done()
    assert exc.value.code == ErrorCode.ABORTED and not exc.value.recoverable
    assert "operator" in exc.value.message
    await wait_until(lambda: "ab" not in b.engine.scheduler.requests)  # type: ignore[attr-defined]


async def test_a_client_that_leaves_after_a_migration_cancels_the_request_on_the_destination(pair, namespace) -> None:
    a, b, crt = pair
    gen, mig, _ = await clients(crt, namespace)
    stream = await gen.direct(gen_request("cx", 300, 2000).to_dict(), a.instance_id)
    await stream.__anext__()
    [report] = await migrate(mig, a.instance_id, MigrateRequest(b.instance_id, request_ids=["cx"]))
    assert report.state == "committed"
    for _ in range(2000):  # what A sent before its MOVED frame, then B's first frames
        await stream.__anext__()
        if stream.instance_id == b.instance_id:
            break
    assert stream.instance_id == b.instance_id
    await stream.aclose()
    await wait_until(lambda: "cx" not in b.engine.scheduler.requests)  # type: ignore[attr-defined]
    assert b.engine.scheduler.pool.num_active_blocks == 0  # type: ignore[attr-defined]


async def test_a_full_destination_refuses_and_the_request_goes_on_at_the_source(make_runtime, namespace) -> None:
    a = await start_worker(make_runtime, namespace, 0)
    # 300 blocks (4800 tokens >= max_model_len), at a tenth of real time so that its hog outlasts the test.
    tiny = await start_worker(make_runtime, namespace, 1, num_gpu_blocks=300, speedup_ratio=0.1)
    try:
        crt = await make_runtime()
        gen, mig, _ = await clients(crt, namespace)
        # 4000 prompt tokens hold 250 of the 300 blocks while it decodes (90 tokens at ~50 ms a step: ~4.5 s).
        hog = Stream(await gen.direct(gen_request("hog", 4000, 90).to_dict(), tiny.instance_id))
        req = gen_request("large", 1500, 200)  # its prompt differs from the hog's (rid length)
        expected = await unmoved([req])
        s = Stream(await gen.direct(req.to_dict(), a.instance_id))
        await wait_until(lambda: len(s.tokens) >= 3 and len(hog.tokens) >= 1, timeout_s=10)
        [report] = await migrate(mig, a.instance_id, MigrateRequest(tiny.instance_id, request_ids=["large"]))
        assert report.state == "aborted_by_destination" and "no room" in report.reason
        assert await s.done() == expected["large"]
        assert s.stream.num_moves == 0
        await hog.stream.aclose()
    finally:
        await a.stop()
        await tiny.stop()


# --- workers killed mid-migration (subprocesses) --------------------------------------------------------------------


def worker_process(runtime_config: Any, namespace: str, *flags: str) -> subprocess.Popen[str]:
    env = os.environ | {
        "KVMESH_ETCD_ENDPOINTS": runtime_config.etcd_endpoints[0],
        "KVMESH_NATS_URL": runtime_config.nats_url,
    }
    cmd = [sys.executable, "-m", "components.cli.main", "--log-level", "WARNING", "worker", "--namespace", namespace]
    for k, v in ENGINE.items():
        cmd += ["--" + k.replace("_", "-"), str(v)]
    return subprocess.Popen([*cmd, *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


async def ready_instance_id(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
    assert line.startswith("READY 1 workers: "), line
    return int(line.split(": ")[1], 16)


def incoming(worker: Worker) -> list[Any]:
    assert worker.agent is not None
    return [m for m in worker.agent.table.active if m.direction == Direction.IN]


async def test_a_source_killed_mid_migration_leaves_no_reservation_on_the_destination(
    make_runtime, runtime_config, namespace
) -> None:
    # 0.05 Gb/s: the first pre-copy stage (75 blocks of 2 MiB) takes ~25 s, so the source is surely mid-stage when
    # it is killed.
    src = worker_process(runtime_config, namespace, "--kv-transfer-bandwidth-gbps", "0.05")
    dst = await start_worker(make_runtime, namespace, 1)
    try:
        src_id = await ready_instance_id(src)
        crt = await make_runtime()
        gen, mig, _ = await clients(crt, namespace)
        await gen.wait_for_instances(2, timeout_s=10)
        s = Stream(await gen.direct(gen_request("k", 1200, 3000).to_dict(), src_id))
        await wait_until(lambda: len(s.tokens) >= 2, timeout_s=10)
        moving = asyncio.ensure_future(migrate(mig, src_id, MigrateRequest(dst.instance_id, request_ids=["k"])))
        await wait_until(lambda: len(incoming(dst)) == 1, timeout_s=10)
        pool = dst.engine.scheduler.pool  # type: ignore[attr-defined]
        assert pool.num_active_blocks == 75  # 1200 // 16 whole blocks reserved
        src.kill()
        # Freed once the watchdog finds the source's subject without responders (every 0.5 s), long before the
        # 10 s pending timeout.
        took = await wait_until(lambda: not incoming(dst) and pool.num_active_blocks == 0, timeout_s=5)
        assert took < 5
        assert dst.agent.counters().get("in_aborted_by_source") == 1  # type: ignore[union-attr]
        with pytest.raises(Exception):  # noqa: B017 - whichever way the dead source's streams end
            await moving
        with pytest.raises(Exception):  # noqa: B017
            await s.done(timeout_s=10)
    finally:
        if src.poll() is None:
            src.kill()
        src.wait(10)
        await dst.stop()


async def test_a_destination_killed_mid_migration_leaves_the_request_running_on_the_source(
    make_runtime, runtime_config, namespace
) -> None:
    src = await start_worker(make_runtime, namespace, 0, kv_transfer_bandwidth_gbps=0.05)
    dst = worker_process(runtime_config, namespace)
    try:
        dst_id = await ready_instance_id(dst)
        crt = await make_runtime()
        gen, mig, _ = await clients(crt, namespace)
        await gen.wait_for_instances(2, timeout_s=10)
        req = gen_request("d", 1200, 500)
        expected = await unmoved([req])
        s = Stream(await gen.direct(req.to_dict(), src.instance_id))
        await wait_until(lambda: len(s.tokens) >= 2, timeout_s=10)
        moving = asyncio.ensure_future(migrate(mig, src.instance_id, MigrateRequest(dst_id, request_ids=["d"])))
        assert src.agent is not None
        await wait_until(
            lambda: any(m.state == MigrationState.PRE_COPYING for m in src.agent.table.active),  # type: ignore[union-attr]
            timeout_s=10,
        )
        dst.kill()
        [report] = await asyncio.wait_for(moving, 40)
        assert report.state == "aborted_by_destination", report
        assert await s.done(timeout_s=30) == expected["d"]
        assert s.stream.num_moves == 0 and s.stream.instance_id == src.instance_id
    finally:
        if dst.poll() is None:
            dst.kill()
        dst.wait(10)
        await src.stop()


async def test_served_endpoints_of_a_migrating_worker(pair) -> None:
    a, _, _ = pair
    assert isinstance(a.agent.generate_endpoint, ServedEndpoint)  # type: ignore[union-attr]
    assert a.metadata["migration_mode"] == "live"


async def test_a_draining_worker_says_it_is_unschedulable_and_stays_registered_until_its_requests_are_done(
    make_runtime,
    namespace,
) -> None:
    from components.protocol.endpoints import TOPIC_WORKER_STATUS
    from components.protocol.migration import WorkerStatus
    from components.router import Router
    from components.router.feed import RouterFeed

    w = await start_worker(make_runtime, namespace, 0)
    crt = await make_runtime()
    gen, _, _ = await clients(crt, namespace)
    await gen.wait_for_instances(1, timeout_s=5)
    # A router fed from the event plane, as the frontend's is.
    router = Router()
    router.set_workers("mock-model", [(w.instance_id, w.metadata)])
    feed = RouterFeed(crt, router, namespace, ["backend"])
    await feed.start()
    statuses: list[WorkerStatus] = []
    sub = await crt.namespace(namespace).events.subscribe(TOPIC_WORKER_STATUS)

    async def follow() -> None:
        async for ev in sub:
            if ev.source_id == w.instance_id:
                statuses.append(WorkerStatus.from_dict(ev.payload))

    following = asyncio.ensure_future(follow())
    try:
        s = Stream(await gen.direct(gen_request("drain", 100, 400).to_dict(), w.instance_id))  # ~2 s of decoding
        await wait_until(lambda: len(s.tokens) >= 2, timeout_s=10)
        stopping = asyncio.ensure_future(w.stop())
        await wait_until(lambda: bool(statuses), timeout_s=5)
        assert statuses[0] == WorkerStatus(False, "draining", 1)
        await wait_until(lambda: not router.is_schedulable(w.instance_id), timeout_s=5)
        assert w.instance_id in gen.instance_ids()  # still registered: its request runs on
        assert not s.task.done()
        assert len(await s.done(timeout_s=20)) == 400  # drained to its end
        await stopping
        await wait_until(lambda: w.instance_id not in gen.instance_ids(), timeout_s=5)
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await sub.close()
        await feed.stop()


async def test_a_client_that_leaves_while_the_commit_is_on_its_way_is_aborted_on_the_destination(
    pair, namespace
) -> None:
    """The source's handler is parked in the final stage when the client's CANCEL arrives; the commit succeeds
    anyway (the destination already runs the request): the source forwards an abort there."""
    from components.protocol.migration import MigrateInOp

    a, b, crt = pair
    gen, mig, _ = await clients(crt, namespace)
    assert a.agent is not None
    original = a.agent._call
    commit_answered = asyncio.Event()
    go_on = asyncio.Event()

    async def held_call(component: str, dst: int, msg: Any) -> Any:
        reply = await original(component, dst, msg)
        if msg.op == MigrateInOp.COMMIT:
            commit_answered.set()
            await go_on.wait()  # the commit is done on B; A has not yet handed the stream over
        return reply

    a.agent._call = held_call  # type: ignore[method-assign]
    stream = await gen.direct(gen_request("lv", 200, 3000).to_dict(), a.instance_id)
    await stream.__anext__()
    moving = asyncio.ensure_future(migrate(mig, a.instance_id, MigrateRequest(b.instance_id, request_ids=["lv"])))
    await asyncio.wait_for(commit_answered.wait(), 10)
    await wait_until(lambda: "lv" in b.engine.scheduler.requests)  # type: ignore[attr-defined]
    await stream.aclose()  # the client leaves: its CANCEL reaches A, whose handler is parked
    await wait_until(lambda: a.agent.num_tracked == 0)  # type: ignore[union-attr]
    go_on.set()
    [report] = await asyncio.wait_for(moving, 10)
    assert report.state == "committed"
    await wait_until(lambda: "lv" not in b.engine.scheduler.requests)  # type: ignore[attr-defined]
    await wait_until(lambda: b.engine.scheduler.pool.num_active_blocks == 0)  # type: ignore[attr-defined]
    assert a.agent.num_aborts_forwarded == 1
