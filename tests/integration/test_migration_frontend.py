"""Migration as a client of the OpenAI frontend sees it, over real etcd and nats-server: requests moved live between
workers, and requests whose worker dies (SIGKILL, engine death) re-issued elsewhere up to ``--migration-limit``.
The client's text must equal what an unmoved run produces (nothing lost, repeated or reordered).

Expected texts come from a MockEngine of the workers' config in this process, decoded with the model's tokenizer
(the simulated engine's output is a pure function of its config and the request). Prompts are token ids, so no
tokenisation stands between the test and the engine. Loads are bounded (a fixed number of requests, a fixed
concurrency) and every wait is for an event.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from components.protocol.endpoints import ENDPOINT_MIGRATE
from components.protocol.messages import GenerateRequest, SamplingParams
from components.protocol.migration import MigrateRequest, MigrationReport
from components.workers.engines.mock import MockEngine
from tests.integration.test_frontend import (  # noqa: F401 - make_stack is a fixture
    MODEL,
    MODEL_PATH,
    ROOT,
    Stack,
    engine_config,
    make_stack,
    metric,
    metrics_text,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

# speedup 1: ~5 ms a decode step, so requests are mid-decode when they are moved or their worker dies.
REAL_TIME = {"speedup_ratio": 1.0}


def prompt_ids(i: int, n: int = 40) -> list[int]:
    return [(11 * i + 3 * j) % 250 + 1 for j in range(n)]


async def expected_text(stack: Stack, prompt: list[int], max_tokens: int) -> str:
    ref = MockEngine(engine_config(), name="reference")
    await ref.start()
    try:
        req = GenerateRequest("ref", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        ids = [t async for c in ref.generate(req) for t in c.token_ids]
    finally:
        await ref.shutdown()
    assert len(ids) == max_tokens
    return stack.decode(ids)


class ClientStream:
    """One streaming completion, read in the background: its text, token count (usage) and error."""

    def __init__(self, client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> None:
        self.prompt = prompt
        self.text = ""
        self.chunks = 0
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._run(client, prompt, max_tokens))

    async def _run(self, client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> None:
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices:
                    self.text += chunk.choices[0].text
                    self.chunks += 1
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e


async def migrate(stack: Stack, src: int, req: MigrateRequest) -> list[MigrationReport]:
    client = await stack.worker_rt.namespace(stack.namespace).component("backend").endpoint(ENDPOINT_MIGRATE).client()
    try:
        return [MigrationReport.from_dict(x) async for x in await client.direct(req.to_dict(), src)]
    finally:
        await client.close()


async def test_requests_moved_live_back_and_forth_reach_the_client_whole(
    make_stack: Callable[..., Awaitable[Stack]],  # noqa: F811 - the fixture imported above
):
    stack = await make_stack()
    a = await stack.add_worker(**REAL_TIME)
    b = await stack.add_worker(**REAL_TIME)
    client = stack.openai()
    prompts = [prompt_ids(i, 30 + 200 * i) for i in range(4)]  # up to 630 tokens: pre-copied in stages
    streams = [ClientStream(client, p, 400) for p in prompts]
    await wait_until(lambda: all(s.chunks >= 2 for s in streams), timeout_s=20)
    reports: list[MigrationReport] = []
    for round_ in range(6):  # bounded: every request on the source moves each round
        src, dst = (a, b) if round_ % 2 == 0 else (b, a)
        reports += await migrate(stack, src.instance_id, MigrateRequest(dst.instance_id, select_value=-1))
    await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 60)
    for s, p in zip(streams, prompts, strict=True):
        assert s.error is None, s.error
        assert s.completion_tokens == 400
        assert s.text == await expected_text(stack, p, 400)
    committed = [r for r in reports if r.state == "committed"]
    assert len(committed) >= 6, [(r.state, r.reason) for r in reports]
    text = await metrics_text(stack.url)
    assert metric(text, "kvmesh_frontend_migrations_total", kind="live") == len(committed)
    assert metric(text, "kvmesh_frontend_migrations_total", kind="failover") == 0
    # The router's count of requests followed them: nothing left on either worker.
    router = stack.frontend.router
    assert router.active_requests(a.instance_id) == 0 and router.active_requests(b.instance_id) == 0


async def test_a_request_whose_engine_dies_goes_on_elsewhere_and_the_dead_worker_is_chosen_no_more(
    make_stack: Callable[..., Awaitable[Stack]],  # noqa: F811 - the fixture imported above
):
    stack = await make_stack()
    # The engine dies 1.5 s after it starts: mid-way through 600 tokens at ~5 ms a step.
    doomed = await stack.add_worker(fail_after_s=1.5, **REAL_TIME)
    await stack.add_worker(**REAL_TIME)
    client = stack.openai()
    prompts = [prompt_ids(i) for i in range(4)]
    streams = [ClientStream(client, p, 600) for p in prompts]
    await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 60)
    for s, p in zip(streams, prompts, strict=True):
        assert s.error is None, s.error
        assert (s.completion_tokens, s.text) == (600, await expected_text(stack, p, 600))
    text = await metrics_text(stack.url)
    assert metric(text, "kvmesh_frontend_migrations_total", kind="failover") >= 1
    assert not stack.frontend.router.is_schedulable(doomed.instance_id)
    stack.workers.remove(doomed)


# --- SIGKILL under load (worker processes) --------------------------------------------------------------------------


def worker_process(runtime_config: Any, namespace: str) -> subprocess.Popen[str]:
    env = os.environ | {
        "KVMESH_ETCD_ENDPOINTS": runtime_config.etcd_endpoints[0],
        "KVMESH_NATS_URL": runtime_config.nats_url,
    }
    cfg = engine_config(**REAL_TIME)
    flags = ["--namespace", namespace, "--model", MODEL, "--model-path", MODEL_PATH]
    for name in ("vocab_size", "eos_token_id", "max_model_len", "block_size", "num_gpu_blocks", "speedup_ratio"):
        flags += ["--" + name.replace("_", "-"), str(getattr(cfg, name))]
    cmd = [sys.executable, "-m", "components.cli.main", "--log-level", "WARNING", "worker", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


async def ready_instance_id(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
    assert line.startswith("READY 1 workers: "), line
    return int(line.split(": ")[1], 16)


async def kill_under_load(stack: Stack, runtime_config: Any, n_requests: int = 24, concurrency: int = 12) -> Any:
    """Three worker processes; ``n_requests`` streaming requests of 300 tokens, ``concurrency`` at a time; the
    worker holding most of the first wave SIGKILLed once every request of it is streaming. Returns the streams,
    their prompts, the dead worker's id, the kill's instant and every (instant, worker) the router placed a request
    on."""
    procs = [worker_process(runtime_config, stack.namespace) for _ in range(3)]
    stack.procs = procs  # type: ignore[attr-defined]
    ids = [await ready_instance_id(p) for p in procs]
    await stack.wait_for_workers(MODEL, 3, timeout_s=30)
    router = stack.frontend.router
    routed: list[tuple[float, int]] = []
    on_routed = router.on_routed

    def spy(request_id: str, decision: Any, request: Any) -> None:
        routed.append((time.monotonic(), decision.instance_id))
        on_routed(request_id, decision, request)

    router.on_routed = spy  # type: ignore[method-assign]
    client = stack.openai()
    prompts = [prompt_ids(i) for i in range(n_requests)]
    gate = asyncio.Semaphore(concurrency)
    streams: list[ClientStream] = []

    async def one(p: list[int]) -> None:
        async with gate:
            s = ClientStream(client, p, 300)
            streams.append(s)
            await s.task

    load = asyncio.ensure_future(asyncio.gather(*(one(p) for p in prompts)))
    await wait_until(lambda: len(streams) >= concurrency and all(s.chunks >= 2 for s in streams), timeout_s=30)
    # The victim is the worker the router placed most of the first wave on (at least 4 of 12 by pigeonhole), so the
    # kill always cuts streams: a CI run that killed the first worker found it holding none (failover count 0).
    placed = Counter(iid for _, iid in routed)
    victim = max(range(len(procs)), key=lambda k: placed.get(ids[k], 0))
    killed_at = time.monotonic()
    procs[victim].kill()
    await asyncio.wait_for(load, 90)
    return streams, prompts, ids[victim], killed_at, routed


def stop_processes(stack: Stack) -> None:
    for p in getattr(stack, "procs", []):
        if p.poll() is None:
            p.kill()
        p.wait(10)


async def test_sigkill_under_load_with_migration_limit_3_fails_nothing_and_loses_or_repeats_no_token(
    make_stack: Callable[..., Awaitable[Stack]],  # noqa: F811 - the fixture imported above
    runtime_config: Any,
):
    stack = await make_stack(migration_limit=3)
    try:
        streams, prompts, dead, killed_at, routed = await kill_under_load(stack, runtime_config)
        assert len(streams) == len(prompts)
        failed = [s.error for s in streams if s.error is not None]
        assert failed == []
        for s in streams:
            assert s.completion_tokens == 300
            assert s.text == await expected_text(stack, s.prompt, 300)
        text = await metrics_text(stack.url)
        assert metric(text, "kvmesh_frontend_migrations_total", kind="failover") >= 1  # the dead one held some
        # Its death was detected within a second of the kill (its streams' connections closed: probed at once), and
        # from that moment it got no request.
        router = stack.frontend.router
        down_at = router.down_since(dead)
        assert down_at is not None and down_at - killed_at < 1.0, (down_at, killed_at)
        assert [t for t, iid in routed if iid == dead and t >= down_at] == []
    finally:
        stop_processes(stack)


async def test_sigkill_under_load_with_migration_limit_0_fails_the_affected_requests_with_a_clear_error(
    make_stack: Callable[..., Awaitable[Stack]],  # noqa: F811 - the fixture imported above
    runtime_config: Any,
):
    stack = await make_stack(migration_limit=0)
    try:
        streams, prompts, _dead, _killed_at, _routed = await kill_under_load(stack, runtime_config)
        failed = [s for s in streams if s.error is not None]
        assert failed, "the killed worker held none of the first wave"
        for s in failed:
            assert isinstance(s.error, openai.APIError)
            assert "not re-issued elsewhere: migration_limit is 0" in str(s.error), s.error
        ok = [s for s in streams if s.error is None]
        assert len(ok) + len(failed) == len(prompts)
        for s in ok:
            assert s.completion_tokens == 300
        text = await metrics_text(stack.url)
        assert metric(text, "kvmesh_frontend_migration_failures_total", reason="limit") == len(failed)
        assert metric(text, "kvmesh_frontend_migrations_total", kind="failover") == 0
    finally:
        stop_processes(stack)
