"""The frontends' request reports (components/frontend/request_stats.py) end to end on real etcd and nats-server: a
frontend in this process serves in-process mock workers, and a ``LiveFleet`` (as the planner runs it) sums what it
hears into a ``RequestWindow``. Expected counts are derived from the requests the test sends: token-id prompts (their
length is their token count), chat prompts through the tokenizer's own chat template, and ``ignore_eos`` outputs of
exactly ``max_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from components.fleet.live import LiveFleet
from components.fleet.model import RequestWindow
from components.frontend import Frontend, FrontendConfig
from components.protocol.endpoints import TOPIC_REQUEST_STATS
from components.protocol.messages import RequestStatsReport
from components.runtime import Runtime
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker
from tests.support.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.integration

MODEL_PATH = str(Path(__file__).resolve().parents[2] / "models" / "tiny-llama")
MODEL = "tiny-llama"
INTERVAL_S = 0.2  # the frontend's request_stats_interval_s here: a few reports within a test's seconds


class Served:
    """A frontend, its workers and a live fleet view that follows the request reports, on separate runtimes."""

    def __init__(self, make_runtime: Callable[..., Awaitable[Runtime]], namespace: str) -> None:
        self.make_runtime = make_runtime
        self.namespace = namespace
        self.workers: list[Worker] = []
        self.clients: list[AsyncOpenAI] = []

    async def start(self) -> None:
        self.worker_rt = await self.make_runtime()
        self.frontend = Frontend(
            FrontendConfig(namespace=self.namespace, port=0, request_stats_interval_s=INTERVAL_S),
            await self.make_runtime(),
        )
        self.url = await self.frontend.start()
        self.fleet = LiveFleet(await self.make_runtime(), self.namespace)
        await self.fleet.start()

    async def stop(self) -> None:
        for c in self.clients:
            await c.close()
        await self.fleet.stop()
        await self.frontend.stop()
        for w in self.workers:
            await w.stop()

    async def add_worker(self, model: str = MODEL, **engine: Any) -> Worker:
        values: dict[str, Any] = dict(
            vocab_size=384, eos_token_id=257, max_model_len=2048, block_size=16, num_gpu_blocks=512
        )
        cfg = WorkerConfig(namespace=self.namespace, model=model, model_path=MODEL_PATH, metrics_interval_ms=1000)
        w = Worker(self.worker_rt, cfg, MockEngine(MockEngineConfig(**(values | engine)), name=f"m{len(self.workers)}"))
        await w.start()
        self.workers.append(w)
        n = sum(1 for x in self.workers if x.config.model == model)
        await wait_until(lambda: self._listed(model, n), timeout_s=10.0)
        return w

    def _listed(self, model: str, n: int) -> bool:
        m = self.frontend.registry.models.get(model)
        return m is not None and len(m.instances) == n and not m.loading

    def openai(self) -> AsyncOpenAI:
        client = AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)  # no client retries
        self.clients.append(client)
        return client

    def window(self, since_s: float, model: str = MODEL) -> RequestWindow:
        return self.fleet.snapshot().request_window(model, since_s)

    async def heard(self, model: str = MODEL) -> float:
        """Once the fleet view has heard a report of ``model`` (the subscription is live): the time to count from."""
        t0 = self.fleet.clock()
        await wait_until(lambda: self.window(t0, model).reports > 0, timeout_s=10.0)
        return self.fleet.clock()


@pytest.fixture
async def served(make_runtime, namespace) -> AsyncIterator[Served]:
    s = Served(make_runtime, namespace)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def test_the_window_counts_every_request_its_tokens_and_latencies(served: Served):
    # Imported here, not at the top: AutoTokenizer imports torch (~2-3 s), which collecting the suite
    # paid in every pytest process (both xdist workers and the vLLM run) whether it ran this or not. And before
    # the workers: the import blocks this process's event loop, where the frontend and the workers run, for
    # seconds; after them, a loaded CI run's frontend found no worker to route to and answered 503.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_PATH)
    messages: Any = [{"role": "user", "content": "héllo there"}]
    chat_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = list(tok.encode(chat_text, add_special_tokens=False))  # the template's tokens, as test_frontend derives
    # speedup_ratio 1: the mock engine takes its modelled step times, so TTFT and the gaps are real durations.
    await served.add_worker(speedup_ratio=1.0)
    await served.add_worker(speedup_ratio=1.0)
    t0 = await served.heard()
    client = served.openai()
    # (prompt token count, output tokens) of each request, and the usage the frontend answered with.
    sent: list[tuple[int, int]] = []
    usage_prompts: list[int] = []
    elapsed: list[float] = []
    ignore_eos = {"ignore_eos": True}
    for i, (chat, stream) in enumerate([(False, False), (False, True), (True, False), (True, True)] * 2):
        out = 3 + 2 * i  # 3, 5, ..., 17 tokens
        t = time.monotonic()
        if chat:
            if stream:
                s = await client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=out,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=ignore_eos,
                )
                usage = [c.usage async for c in s][-1]
            else:
                r = await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=out, extra_body=ignore_eos
                )
                usage = r.usage
            prompt = len(chat_ids)
        else:
            ids = [1 + (j * 7 + i) % 200 for j in range(10 + i)]  # 10..17 token ids, each below the vocabulary's 384
            if stream:
                s2 = await client.completions.create(
                    model=MODEL,
                    prompt=ids,
                    max_tokens=out,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=ignore_eos,
                )
                usage = [c.usage async for c in s2][-1]
            else:
                usage = (
                    await client.completions.create(model=MODEL, prompt=ids, max_tokens=out, extra_body=ignore_eos)
                ).usage
            prompt = len(ids)
        elapsed.append(time.monotonic() - t)
        assert usage is not None and usage.completion_tokens == out
        usage_prompts.append(usage.prompt_tokens)
        sent.append((prompt, out))
    n = len(sent)
    await wait_until(lambda: served.window(t0).finished >= n, timeout_s=10.0)
    w = served.window(t0)
    assert w.sources == 1  # one frontend process
    assert (w.requests, w.finished, w.failed) == (n, n, 0)
    assert w.prompt_tokens == sum(p for p, _ in sent) == sum(usage_prompts)
    assert w.output_tokens == sum(o for _, o in sent)
    assert w.ttft_count == n
    assert w.itl_count == sum(o - 1 for _, o in sent)  # one gap per token after the first
    # Each TTFT, and each request's gaps together, lie within what its client waited for the whole request.
    assert 0 < w.ttft_sum_s <= sum(elapsed) and w.ttft_max_s <= max(elapsed)
    assert 0 < w.itl_sum_s <= sum(elapsed) and w.itl_max_s <= max(elapsed)


async def test_a_request_the_worker_refuses_counts_as_finished_and_failed(served: Served):
    # An engine with a smaller vocabulary than the tokenizer's 384 ids: id 350 passes the frontend's check and is
    # refused by the engine, a 400 after the request was handed to a worker (test_frontend has the status).
    await served.add_worker(vocab_size=300)
    t0 = await served.heard()
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": [1, 350], "max_tokens": 2}
        async with session.post(served.url + "/v1/completions", json=body) as r:
            assert r.status == 400
    await wait_until(lambda: served.window(t0).finished >= 1, timeout_s=10.0)
    w = served.window(t0)
    assert (w.requests, w.prompt_tokens, w.finished, w.failed) == (1, 2, 1, 1)
    assert (w.output_tokens, w.ttft_count, w.itl_count) == (0, 0, 0)


async def test_a_served_model_without_traffic_is_reported_with_zeros_and_a_gone_one_is_not(served: Served):
    await served.add_worker(model="a")
    await served.add_worker(model="b")
    t0 = await served.heard("a")
    # Idle: a report per interval for each served model, all zeros (heard, no load).
    await wait_until(lambda: served.window(t0, "a").reports >= 3 and served.window(t0, "b").reports >= 3)
    for model in ("a", "b"):
        w = served.window(t0, model)
        assert (w.sources, w.requests, w.finished, w.output_tokens, w.ttft_count, w.itl_count) == (1, 0, 0, 0, 0, 0)
        heard = served.fleet.snapshot().requests[model]
        assert all(abs(r.report.interval_s - INTERVAL_S) < INTERVAL_S for r in heard)  # about one interval each
    # "b"'s last worker leaves: the frontend stops serving it, and reporting it: after the test saw it go, at most
    # a report published before and its last one (of the interval it left in) arrive, while "a" gets 4.
    await served.workers.pop().stop()
    await wait_until(lambda: "b" not in served.frontend.registry.models, timeout_s=10.0)
    t1 = served.fleet.clock()
    await wait_until(lambda: served.window(t1, "a").reports >= 4, timeout_s=10.0)
    assert served.window(t1, "b").reports <= 2
    assert served.fleet.received[TOPIC_REQUEST_STATS] > 0 and not served.fleet.unparsed[TOPIC_REQUEST_STATS]


async def test_the_fleet_view_names_a_report_by_its_frontends_id_and_counts_one_that_does_not_parse(
    make_runtime, namespace
):
    fleet = LiveFleet(await make_runtime(), namespace)
    await fleet.start()
    events = (await make_runtime()).namespace(namespace).events
    try:
        report = RequestStatsReport(model="m", interval_s=1.0, requests=2, prompt_tokens=30)

        async def heard() -> bool:  # published until the subscription is live (core NATS: only live ones receive)
            await events.publish(TOPIC_REQUEST_STATS, report.to_dict(), source_id=0xABC)
            return fleet.received[TOPIC_REQUEST_STATS] > 0

        await wait_until_async(heard)
        [record, *_] = fleet.snapshot().requests["m"]
        assert (record.source, record.report) == ("abc", report)
        # Not a report (a peer of another version): counted, not applied, and the next one still is.
        await events.publish(TOPIC_REQUEST_STATS, {"model": "m"}, source_id=0xABC)
        await events.publish(TOPIC_REQUEST_STATS, [1, 2], source_id=0xABC)
        before = fleet.received[TOPIC_REQUEST_STATS]
        await events.publish(TOPIC_REQUEST_STATS, report.to_dict(), source_id=0xDEF)
        await wait_until(lambda: fleet.received[TOPIC_REQUEST_STATS] > before)
        assert fleet.unparsed[TOPIC_REQUEST_STATS] == 2
        assert fleet.snapshot().requests["m"][-1].source == "def"
    finally:
        await fleet.stop()
