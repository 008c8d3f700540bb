"""The load generator against a fake OpenAI streaming server on 127.0.0.1 (aiohttp, in this process).

The fake server answers like vLLM: one token per SSE chunk, a usage chunk, ``data: [DONE]``. Its delays are fixed
(TTFT_S before the first token, ITL_S between tokens), so the measured percentiles have known lower bounds and,
on an idle machine, sit just above them. Every ``FAIL_EVERY``-th request (counted by the server) gets a 500 and the
one after it an error event mid-stream, so errors by kind are exact.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from components.cli.bench.loadgen import LoadConfig, run_load

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

TTFT_S = 0.05
ITL_S = 0.01
FAIL_EVERY = 10  # request n (1-based) with n % 10 == 3 -> HTTP 500; n % 10 == 4 -> error event after 2 tokens


@dataclass
class FakeOpenAI:
    """Records what it received; behaviour switches are plain attributes a test may set."""

    api_key: str | None = None
    hang: bool = False  # accept the request, then never answer
    failures: bool = True
    n: int = 0
    bodies: list[dict] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.n += 1
        n = self.n
        self.arrivals.append(time.monotonic())
        self.paths.append(request.path)
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        if self.hang:
            await asyncio.sleep(3600)
        if self.failures and n % FAIL_EVERY == 3:
            return web.json_response({"error": {"message": "internal", "code": 500}}, status=500)
        chat = request.path.endswith("/chat/completions")
        prompt_tokens = len(body["prompt"]) if not chat else len(body["messages"][0]["content"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(TTFT_S)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(ITL_S)
            if self.failures and n % FAIL_EVERY == 4 and i == 2:
                await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                return resp
            choice = {"index": 0, "delta": {"content": "t"}} if chat else {"index": 0, "text": "t"}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeOpenAI, str]]:
    server = FakeOpenAI()
    app = web.Application()
    app.router.add_post("/v1/completions", server.handle)
    app.router.add_post("/v1/chat/completions", server.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def config(url: str, **kw) -> LoadConfig:
    return LoadConfig(url=url, model="fake", progress=False, **kw)


async def test_concurrency_run_counts_latencies_and_errors_by_kind(fake):
    server, url = fake
    # 40 requests: n % 10 == 3 -> 4 x HTTP 500, n % 10 == 4 -> 4 x stream error, 32 complete with 8 tokens each.
    out = await run_load(
        config(url, concurrency=8, max_requests=40, prompt_tokens=100, max_tokens=8, pids=[os.getpid()])
    )
    assert (out["requests_sent"], out["requests_completed"], out["requests_failed"]) == (40, 32, 8)
    assert out["requests_cancelled"] == 0 and out["mode"] == "concurrency" and out["max_in_flight"] == 8
    assert out["errors"] == {"http_500": 4, "stream_error": 4}
    assert out["error_examples"] == {"http_500": "internal", "stream_error": "engine died"}
    assert (out["output_tokens"], out["input_tokens"], out["usage_missing"]) == (32 * 8, 32 * 100, 0)

    # Lower bounds are exact (the server sleeps at least that long); upper bounds leave room for a busy machine.
    ttft, itl, e2e = out["ttft_ms"], out["itl_ms"], out["e2e_ms"]
    assert 1000 * TTFT_S <= ttft["p50"] <= ttft["p90"] <= ttft["p99"] < 1000 * TTFT_S + 150
    assert 1000 * ITL_S * 0.9 <= itl["p50"] <= itl["p90"] <= itl["p99"] < 1000 * ITL_S + 100
    e2e_min = 1000 * (TTFT_S + 7 * ITL_S)  # 8 tokens: TTFT, then 7 gaps = 120 ms
    assert e2e_min <= e2e["p50"] <= e2e["p99"] < e2e_min + 250
    # 32 completions in (at least) 5 rounds of 8 requests of >= 120 ms each.
    assert out["requests_per_s"] == pytest.approx(32 / out["duration_s"], rel=1e-3)
    assert out["output_tokens_per_s"] == pytest.approx(32 * 8 / out["duration_s"], rel=1e-3)
    assert out["duration_s"] >= 5 * 0.12 * 0.9

    # Token-id prompts of the configured length and vocabulary, all different; vLLM's ignore_eos is sent.
    prompts = [b["prompt"] for b in server.bodies]
    assert all(len(p) == 100 and 0 <= min(p) and max(p) < 256 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 40
    assert all(
        b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in server.bodies
    )

    # CPU: the pid is this process, which also runs the server and the load generator.
    cpu = out["cpu"]
    assert cpu["loadgen_cpu_ms"] > 0 and cpu["loadgen_cpu_ms_per_request"] > 0
    assert cpu["pids"][str(os.getpid())]["cpu_ms"] >= 0 and cpu["pids_cpu_ms_per_request"] is not None


async def test_mooncake_replay_follows_the_scaled_timestamps_and_shares_prefixes(fake, tmp_path):
    server, url = fake
    server.failures = False
    trace = tmp_path / "mc.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 300, "output_length": 2, "hash_ids": [5]},
        {"timestamp": 3000, "input_length": 512, "output_length": 2, "hash_ids": [0]},
        {"timestamp": 60000, "input_length": 10, "output_length": 2, "hash_ids": [9]},  # beyond duration_s
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # time_scale 0.2: sends at 0, 0.2, 0.4, 0.6 s; the last row (12 s) is past duration_s=2.
    out = await run_load(config(url, trace=str(trace), time_scale=0.2, duration_s=2.0, max_requests=100))
    assert (out["mode"], out["source"], out["requests_sent"], out["requests_completed"]) == ("replay", "mooncake", 4, 4)
    gaps = [b - a for a, b in zip(server.arrivals, server.arrivals[1:], strict=False)]
    assert all(0.15 < g < 0.35 for g in gaps), gaps
    assert out["dispatch_lag_ms"]["p99"] < 50

    p = [b["prompt"] for b in server.bodies]
    assert [len(x) for x in p] == [600, 1100, 300, 512]
    assert [b["max_tokens"] for b in server.bodies] == [2, 3, 2, 2]
    assert p[0][:600] == p[1][:600]  # blocks 0, 1 shared
    assert p[3] == p[0][:512]  # block 0 alone
    assert p[2][:300] != p[0][:300]
    assert set(server.paths) == {"/v1/completions"}
    assert out["input_tokens"] == 600 + 1100 + 300 + 512 and out["output_tokens"] == 9


async def test_sharegpt_prompts_go_to_chat_at_fixed_concurrency_with_the_api_key(fake, tmp_path):
    server, url = fake
    server.failures = False
    server.api_key = "sekret"
    data = [{"conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(5)]
    (tmp_path / "s.json").write_text(json.dumps(data))
    out = await run_load(
        config(url + "/v1", trace=str(tmp_path / "s.json"), max_tokens=3, api_key="sekret", ignore_eos=False)
    )
    # The file has 5 prompts, fewer than max_requests: the run ends with the file.
    assert (out["mode"], out["concurrency"], out["requests_completed"], out["errors"]) == ("concurrency", 16, 5, {})
    assert set(server.paths) == {"/v1/chat/completions"}
    assert sorted(b["messages"][0]["content"] for b in server.bodies) == [f"question {i}" for i in range(5)]
    assert not any("ignore_eos" in b for b in server.bodies)
    assert out["input_tokens"] == 5 * len("question 0")  # from the server's usage

    out = await run_load(config(url, max_requests=2, api_key="wrong"))
    assert out["errors"] == {"http_401": 2} and out["error_examples"]["http_401"] == "bad key"


async def test_timeouts_drain_and_connection_errors(fake, unused_tcp_port):
    server, url = fake
    server.hang = True
    # Each request times out after 0.2 s; 4 requests at concurrency 2.
    out = await run_load(config(url, concurrency=2, max_requests=4, request_timeout_s=0.2))
    assert out["errors"] == {"timeout": 4} and out["requests_completed"] == 0

    # A hung request still in flight at duration_s + drain_timeout_s is cancelled, bounding the wall time.
    t0 = time.monotonic()
    out = await run_load(config(url, concurrency=1, max_requests=5, duration_s=0.3, drain_timeout_s=0.2))
    assert time.monotonic() - t0 < 2.0
    assert (out["requests_sent"], out["requests_cancelled"], out["requests_failed"]) == (1, 1, 0)

    out = await run_load(config(f"http://127.0.0.1:{unused_tcp_port}", concurrency=2, max_requests=3))
    assert out["errors"] == {"connection": 3}


async def test_cli_prints_json_last_and_writes_the_output_file(fake, tmp_path):
    server, url = fake
    server.failures = False
    out_file = tmp_path / "r.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "components.cli.main", "bench", "load", "--url", url, "--model", "fake",
        "--concurrency", "4", "--max-requests", "8", "--max-tokens", "4", "--output", str(out_file),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    last = stdout.decode().strip().splitlines()[-1]
    result = json.loads(last)
    assert result["requests_completed"] == 8 and result["output_tokens"] == 32
    assert json.loads(out_file.read_text()) == result
    assert b"\r" not in stderr  # stderr is a pipe, not a terminal: no progress bar
