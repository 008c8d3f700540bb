"""The OpenAI frontend in-process on a real port, over real etcd and nats-server, against in-process mock workers that
serve the tiny-llama tokenizer. Good requests go through the official ``openai`` client; every bad one through raw
aiohttp, so the status, headers and error body are checked as sent.

Expected texts are derived independently of the frontend: the same GenerateRequest is sent straight to a worker
through the runtime and its tokens decoded with the tokenizer (the mock engine's output depends only on the prompt and
the seed, so the frontend must reproduce it exactly).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from components.frontend import Frontend, FrontendConfig
from components.frontend.tokenizer import Tokenizer, load_tokenizer
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import GenerateRequest, SamplingParams
from components.runtime import Runtime
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.worker import Worker
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL_PATH = str(ROOT / "models" / "tiny-llama")
MODEL = "tiny-llama"
MAX_MODEL_LEN = 2048
EOS = 257


def engine_config(**overrides: Any) -> MockEngineConfig:
    values: dict[str, Any] = dict(
        vocab_size=384,
        eos_token_id=EOS,
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        num_gpu_blocks=512,
        speedup_ratio=float("inf"),
    )
    return MockEngineConfig(**(values | overrides))


class Stack:
    """A frontend and the workers behind it, all in this process."""

    def __init__(self, worker_rt: Runtime, frontend: Frontend, url: str, namespace: str) -> None:
        self.worker_rt = worker_rt
        self.namespace = namespace
        self.frontend = frontend
        self.url = url
        self.workers: list[Worker] = []
        # Imported here, not at the top: AutoTokenizer imports torch (~2-3 s), which collecting the suite
        # paid in every pytest process (both xdist workers and the vLLM run) whether it ran this or not.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(MODEL_PATH)
        self._direct = 0
        self.clients: list[AsyncOpenAI] = []

    async def add_worker(self, model: str = MODEL, wait: bool = True, **engine: Any) -> Worker:
        cfg = WorkerConfig(namespace=self.namespace, model=model, model_path=MODEL_PATH, metrics_interval_ms=1000)
        w = Worker(self.worker_rt, cfg, MockEngine(engine_config(**engine), name=f"m{len(self.workers)}"))
        await w.start()
        self.workers.append(w)
        if wait:
            await self.wait_for_workers(model, sum(1 for x in self.workers if x.config.model == model))
        return w

    async def remove_worker(self, w: Worker) -> None:
        self.workers.remove(w)
        await w.stop()

    async def wait_for_workers(self, model: str, n: int, timeout_s: float = 10.0) -> None:
        async def wait() -> None:
            while True:
                m = self.frontend.registry.models.get(model)
                if (m is not None and len(m.instances) == n and not m.loading) or (m is None and n == 0):
                    return  # listed: its workers are known and its tokenizer loaded
                await asyncio.sleep(0.02)

        await asyncio.wait_for(wait(), timeout_s)

    def openai(self, api_key: str = "unused") -> AsyncOpenAI:
        # max_retries=0: a retry by the client would hide the frontend's own behaviour.
        client = AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)
        self.clients.append(client)
        return client

    async def expected_tokens(self, prompt_ids: list[int], max_tokens: int, **sampling: Any) -> list[int]:
        """What a worker generates for this prompt, asked directly over the runtime (no frontend involved)."""
        client = (
            await self.worker_rt.namespace(self.namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        )
        try:
            self._direct += 1
            req = GenerateRequest(f"direct-{self._direct}", prompt_ids, SamplingParams(max_tokens, **sampling))
            out: list[int] = []
            async for item in await client.generate(req.to_dict()):
                out += item["token_ids"]
            return out
        finally:
            await client.close()

    def decode(self, ids: list[int]) -> str:
        # What a client receives: the text, less replacement characters of a character the output stopped inside
        # (the frontend, as vLLM's server, sends none for those bytes).
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)).rstrip("\ufffd")

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture
async def make_stack(make_runtime, namespace) -> AsyncIterator[Any]:
    made: list[Stack] = []

    async def make(**config: Any) -> Stack:
        worker_rt = await make_runtime()
        frontend_rt = await make_runtime()
        frontend = Frontend(FrontendConfig(namespace=namespace, port=0, **config), frontend_rt)
        url = await frontend.start()
        stack = Stack(worker_rt, frontend, url, namespace)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        for client in stack.clients:
            await client.close()
        await stack.frontend.stop()
        for w in list(stack.workers):
            with contextlib.suppress(Exception):
                await w.stop()


@pytest.fixture
async def stack(make_stack) -> Stack:
    s: Stack = await make_stack()
    await s.add_worker()
    await s.add_worker()
    return s


def mock(w: Worker) -> MockEngine:
    assert isinstance(w.engine, MockEngine)
    return w.engine


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            text = await r.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return r.status, dict(r.headers), parsed


def assert_error(body: Any, kind: str, param: str | None, code: str | None) -> str:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (kind, param, code), err
    assert isinstance(err["message"], str) and err["message"]
    return str(err["message"])


async def metrics_text(url: str, headers: dict[str, str] | None = None) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics", headers=headers) as r:
        assert r.status == 200
        return await r.text()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition; 0 if absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"^(\S+?)(\{.*\})? (\S+)$", line)
        assert m is not None
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if m.group(1) == name and all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


# --- good requests through the openai client ---------------------------------------------------------------------


async def test_completions_match_the_workers_tokens_with_and_without_streaming(stack: Stack):
    prompt = "The quick brown fox"
    ids = list(stack.tokenizer.encode(prompt))
    expected = stack.decode(await stack.expected_tokens(ids, 24, ignore_eos=True))
    client = stack.openai()

    r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 24, len(ids) + 24)

    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere


async def test_the_first_chunk_goes_out_with_the_first_token_even_when_it_is_half_a_character(stack: Stack):
    # Regression (issue 4, +6 ms TTFT p50 over vLLM): tiny-llama's tokenizer is byte-level, so a token is often one
    # byte of a multi-byte UTF-8 character and decodes to nothing yet. The frontend used to send no chunk for it, so
    # the first chunk waited for the tokens that complete the character. Like vLLM's server it now sends one chunk
    # per worker output that carried tokens, with empty text where the character is not complete.
    ids = list(stack.tokenizer.encode("The quick brown fox"))
    # A sampling seed whose first output token is half a character (about 1 in 3 of the 384 ids is a byte >= 0x80).
    for seed in range(200):
        out = await stack.expected_tokens(ids, 8, ignore_eos=True, seed=seed)
        if stack.tokenizer.decode(out[:1]) == "\ufffd":
            break
    else:
        raise AssertionError("no seed in 0..199 starts with half a character")
    stream = await stack.openai().completions.create(
        model=MODEL, prompt=ids, max_tokens=8, seed=seed, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text == "" and chunks[0].choices[0].finish_reason is None
    assert "".join(c.choices[0].text for c in chunks) == stack.decode(out)
    # Every output token is accounted for by a chunk (the mock worker streams one token per output here).
    assert len(chunks) == len(out)


async def test_chat_applies_the_template_and_streams_usage_last(stack: Stack):
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo, 日本"}]
    ids = stack.chat_ids(messages)
    assert ids[0] == 256 and ids[-1] == 261  # <|bos|> ... <|assistant|>: the template, not the raw text
    expected = stack.decode(await stack.expected_tokens(ids, 40, ignore_eos=True))
    client = stack.openai()

    r = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 40)

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        len(ids),
        40,
        len(ids) + 40,
    )


async def test_the_last_chunk_usage_and_done_end_the_body_in_one_http_chunk(stack: Stack):
    # The end of a stream costs one write (one syscall), not four: the chunk with the finish reason, the usage chunk,
    # [DONE] and the body's end leave together. The SSE bytes are those of one write per event.
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    http_chunks: list[bytes] = []
    async with aiohttp.ClientSession() as session, session.post(stack.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        buf = b""
        async for data, end_of_http_chunk in r.content.iter_chunks():
            buf += data
            if end_of_http_chunk:
                http_chunks.append(buf)
                buf = b""
        assert buf == b""
    events = [e for c in http_chunks for e in c.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    usage = json.loads(events[-2].removeprefix(b"data: "))
    finished = json.loads(events[-3].removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert finished["choices"][0]["finish_reason"] == "length" and finished["usage"] is None
    last = [e for e in [c for c in http_chunks if c][-1].split(b"\n\n") if e]
    assert last[-3:] == events[-3:]  # finish, usage, [DONE]: one HTTP chunk, one write


async def test_chat_without_max_tokens_may_use_the_rest_of_the_context(stack: Stack):
    # The mock engine stops at EOS (id 257, about 1 in 384 draws); without ignore_eos the answer ends with 'stop'
    # or, failing that, 'length' at max_model_len - prompt tokens.
    messages: Any = [{"role": "user", "content": "go on"}]
    ids = stack.chat_ids(messages)
    expected_ids = await stack.expected_tokens(ids, MAX_MODEL_LEN - len(ids))
    r = await stack.openai().chat.completions.create(model=MODEL, messages=messages)
    assert r.usage is not None and r.usage.completion_tokens == len(expected_ids)
    assert r.choices[0].finish_reason == ("stop" if expected_ids[-1] == EOS else "length")
    assert r.choices[0].message.content == stack.decode(expected_ids)


async def test_token_id_prompts_are_accepted_as_a_list_or_a_list_of_one_list(stack: Stack):
    ids = [104, 195, 169, 108, 108, 111, 32, 119]
    expected = stack.decode(await stack.expected_tokens(ids, 16, ignore_eos=True))
    client = stack.openai()
    for prompt in (ids, [ids]):
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, extra_body={"ignore_eos": True})
        assert r.choices[0].text == expected
        assert r.usage is not None and r.usage.prompt_tokens == len(ids)


async def test_stop_strings_cut_the_text_and_finish_with_stop(stack: Stack):
    prompt = "Once upon a time"
    ids = list(stack.tokenizer.encode(prompt))
    out_ids = await stack.expected_tokens(ids, 200, ignore_eos=True)
    full = stack.decode(out_ids)
    # A 3-character stop string from the middle of the output, free of replacement characters, so that it is text the
    # detokeniser really emits; the frontend must cut right before its first occurrence.
    start = next(i for i in range(40, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]
    cut = full.find(stop)
    client = stack.openai()

    r = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=200, stop=[stop, "never-there"], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens < 200

    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=200, stop=stop, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_a_single_token_stop_is_enforced_by_the_worker(stack: Stack):
    prompt = "abc"
    ids = list(stack.tokenizer.encode(prompt))
    out_ids = await stack.expected_tokens(ids, 300, ignore_eos=True)
    # The first plain ASCII letter in the output: one byte-level token whose text is exactly that letter.
    k, tid = next((i, t) for i, t in enumerate(out_ids) if 97 <= t <= 122)
    letter = chr(tid)
    r = await stack.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=300, stop=letter, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "stop"
    # The worker stopped at that token (it is the k+1-th generated), not somewhere later.
    assert r.usage is not None and r.usage.completion_tokens == k + 1
    # Raw: bytes before the stop letter that do not form a character are invalid there (the letter follows), not an
    # output cut inside a character, so their replacement characters are part of the text.
    assert r.choices[0].text == stack.tokenizer.decode(out_ids[:k], skip_special_tokens=True)


# --- models come and go with their workers -----------------------------------------------------------------------


async def test_models_appear_with_their_first_worker_and_disappear_with_their_last(make_stack):
    s: Stack = await make_stack()
    client = s.openai()
    assert (await client.models.list()).data == []

    a = await s.add_worker()
    models = (await client.models.list()).data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra == {"max_model_len": MAX_MODEL_LEN}
    other = await s.add_worker(model="other-model")
    assert sorted(m.id for m in (await client.models.list()).data) == sorted([MODEL, "other-model"])
    b = await s.add_worker()
    assert len(s.frontend.registry.models[MODEL].instances) == 2

    await s.remove_worker(a)
    await s.wait_for_workers(MODEL, 1)
    assert MODEL in [m.id for m in (await client.models.list()).data]
    await s.remove_worker(b)
    await s.wait_for_workers(MODEL, 0)
    assert [m.id for m in (await client.models.list()).data] == ["other-model"]

    # A model that was served and lost its workers may come back: 503, not 404.
    status, headers, body = await post(s.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503 and headers["Retry-After"] == "2"
    assert_error(body, "service_unavailable_error", None, "no_workers")
    # A name never served while others are: 404 model_not_found, as OpenAI answers.
    status, _, body = await post(s.url + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert "other-model" in assert_error(body, "invalid_request_error", "model", "model_not_found")
    await s.remove_worker(other)


async def test_a_model_whose_tokenizer_cannot_load_is_listed_but_answers_500(make_stack, tmp_path):
    s: Stack = await make_stack()
    cfg = WorkerConfig(namespace=s.namespace, model="broken", model_path=str(tmp_path / "missing"))
    w = Worker(s.worker_rt, cfg, MockEngine(engine_config()))
    await w.start()
    s.workers.append(w)
    await s.wait_for_workers("broken", 1)
    assert [m.id for m in (await s.openai().models.list()).data] == ["broken"]
    status, _, body = await post(s.url + "/v1/completions", {"model": "broken", "prompt": "x"})
    assert status == 500
    assert "missing" in assert_error(body, "server_error", None, "model_unavailable")


async def test_no_workers_at_all_is_503_with_retry_after(make_stack):
    s: Stack = await make_stack(retry_after_s=7)
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        status, headers, got = await post(s.url + path, body)
        assert status == 503 and headers["Retry-After"] == "7"
        assert_error(got, "service_unavailable_error", None, "no_workers")


# --- bad input: status and body, and no harm to others ------------------------------------------------------------

LONG_PROMPT = "a" * MAX_MODEL_LEN  # byte-level: one token per character


BAD_REQUESTS: list[tuple[str, str, Any, int, str, str | None, str | None]] = [
    # (name, path, body, status, type, param, code)
    ("malformed json", "/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, "invalid_request_error", None,
     "invalid_json"),
    ("not an object", "/v1/completions", [1, 2], 400, "invalid_request_error", None, None),
    ("missing model", "/v1/completions", {"prompt": "x"}, 400, "invalid_request_error", "model",
     "missing_required_parameter"),
    ("max_tokens as string", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400,
     "invalid_request_error", "max_tokens", "invalid_value"),
    ("temperature out of range", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 3}, 400,
     "invalid_request_error", "temperature", "invalid_value"),
    ("prompt of wrong type", "/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "invalid_request_error",
     "prompt", "invalid_type"),
    ("stop of wrong type", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": 5}, 400,
     "invalid_request_error", "stop", "invalid_type"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "invalid_request_error", "model",
     "model_not_found"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "invalid_request_error",
     "prompt", "context_length_exceeded"),
    ("max_tokens beyond the context", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2047}, 400,
     "invalid_request_error", "max_tokens", "context_length_exceeded"),
    ("chat max_completion_tokens beyond the context", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4000}, 400,
     "invalid_request_error", "max_completion_tokens", "context_length_exceeded"),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "invalid_request_error", "n",
     "unsupported_parameter"),
    ("logprobs", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "invalid_request_error",
     "logprobs", "unsupported_parameter"),
    ("best_of", "/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "invalid_request_error",
     "best_of", "unsupported_parameter"),
    ("batch of prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "invalid_request_error",
     "prompt", "unsupported_parameter"),
    ("unknown field", "/v1/completions", {"model": MODEL, "prompt": "x", "temprature": 0.5}, 400,
     "invalid_request_error", "temprature", "unsupported_parameter"),
    ("token id outside the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 999]}, 400,
     "invalid_request_error", "prompt", None),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "invalid_request_error", "prompt", None),
    ("tools", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "invalid_request_error", "tools", "unsupported_parameter"),
    ("json response format", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, "invalid_request_error", "response_format", "unsupported_parameter"),
    ("image content", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "invalid_request_error", "messages[0].content[0]", "unsupported_parameter"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "invalid_request_error",
     "messages", "invalid_value"),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_request_error", "messages[0].role", "invalid_value"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "param", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_requests_get_their_status_and_an_openai_error_body(stack, path, body, status, kind, param, code):
    got_status, headers, got = await post(stack.url + path, body)
    assert got_status == status
    assert headers["Content-Type"].startswith("application/json")
    assert_error(got, kind, param, code)


async def test_bad_requests_do_not_disturb_a_stream_in_flight(stack: Stack):
    prompt = "steady"
    ids = list(stack.tokenizer.encode(prompt))
    expected = stack.decode(await stack.expected_tokens(ids, 1500, ignore_eos=True))
    client = stack.openai()
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = []
    bad_statuses: list[int] = []
    async for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if len(bad_statuses) < len(BAD_REQUESTS):  # one bad request between chunks while the stream runs
            _, path, body, *_ = BAD_REQUESTS[len(bad_statuses)]
            bad_statuses.append((await post(stack.url + path, body))[0])
    assert "".join(pieces) == expected
    assert bad_statuses == [case[3] for case in BAD_REQUESTS[: len(bad_statuses)]]
    assert len(bad_statuses) > 3  # the stream really was interleaved with them


async def test_unknown_routes_and_methods_answer_with_an_openai_error_body(stack: Stack):
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/v1/nothing") as r:
            assert r.status == 404
            assert_error(await r.json(), "invalid_request_error", None, None)
        async with session.get(stack.url + "/v1/completions") as r:
            assert r.status == 405
            assert_error(await r.json(), "invalid_request_error", None, None)


async def test_a_body_over_the_limit_is_413(make_stack):
    s: Stack = await make_stack(max_request_body_bytes=4096)
    await s.add_worker()
    status, _, body = await post(s.url + "/v1/completions", {"model": MODEL, "prompt": "x" * 5000})
    assert status == 413
    assert_error(body, "invalid_request_error", None, None)


# --- api key ------------------------------------------------------------------------------------------------------


async def test_api_key_guards_everything_but_health(make_stack):
    s: Stack = await make_stack(api_key="sesame")
    await s.add_worker()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        status, got_headers, got = await post(s.url + "/v1/completions", body, headers)
        assert status == 401 and got_headers["WWW-Authenticate"] == "Bearer"
        assert_error(got, "authentication_error", None, "invalid_api_key")
    async with aiohttp.ClientSession() as session:
        async with session.get(s.url + "/health") as r:
            assert r.status == 200 and (await r.json())["models"] == [MODEL]
        async with session.get(s.url + "/metrics") as r:
            assert r.status == 401
        async with session.get(s.url + "/v1/models") as r:
            assert r.status == 401
    with pytest.raises(openai.AuthenticationError):
        await s.openai("wrong").completions.create(model=MODEL, prompt="hi", max_tokens=4)
    done = await s.openai("sesame").completions.create(
        model=MODEL, prompt="hi", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 4
    assert "kvmesh_frontend_requests_total" in await metrics_text(s.url, {"Authorization": "Bearer sesame"})


# --- failures and cancellation ------------------------------------------------------------------------------------


async def test_a_client_that_disconnects_mid_stream_frees_its_request_on_the_worker(make_stack):
    s: Stack = await make_stack()
    # Real time (speedup 1): ~5 ms per decode step, so 1500 tokens would take ~8 s.
    w = await s.add_worker(speedup_ratio=1.0)
    body = {"model": MODEL, "prompt": "hold on", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(s.url + "/v1/completions", json=body)
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: {")
        assert w.engine.snapshot().num_running == 1
        resp.close()  # drop the connection without reading the rest

    async def freed() -> None:
        while w.engine.snapshot().num_running or w.engine.snapshot().num_waiting:  # noqa: ASYNC110 - no event
            await asyncio.sleep(0.02)

    await asyncio.wait_for(freed(), 5)
    assert s.frontend.router.active_requests(w.instance_id) == 0
    text = await metrics_text(s.url)
    assert metric(text, "kvmesh_frontend_requests_total", endpoint="completions", status="499") == 1
    assert metric(text, "kvmesh_frontend_inflight_requests", model=MODEL) == 0


async def test_a_client_that_gives_up_on_a_non_streaming_request_frees_it_too(make_stack):
    s: Stack = await make_stack()
    w = await s.add_worker(speedup_ratio=1.0)
    body = {"model": MODEL, "prompt": "hold on", "max_tokens": 1500, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(s.url + "/v1/completions", json=body)

    async def freed() -> None:
        while w.engine.snapshot().num_running or w.engine.snapshot().num_waiting:  # noqa: ASYNC110 - no event
            await asyncio.sleep(0.02)

    await asyncio.wait_for(freed(), 5)
    assert s.frontend.service.num_inflight == 0


async def test_a_draining_worker_is_skipped_before_the_first_token(stack: Stack):
    draining, healthy = stack.workers
    # The worker still looks registered but refuses new requests (the window between a drain starting and its
    # deregistration reaching this frontend): the frontend must retry elsewhere, invisibly to the client.
    draining._served[-1].server.draining = True
    client = stack.openai()
    for _ in range(4):
        r = await client.completions.create(model=MODEL, prompt="hi", max_tokens=8, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 8
    assert mock(draining).num_steps == 0
    assert mock(healthy).num_steps > 0
    text = await metrics_text(stack.url)
    assert metric(text, "kvmesh_frontend_retries_total", reason="InstanceDrainingError") >= 1


async def test_a_worker_whose_engine_died_is_skipped_before_the_first_token(stack: Stack):
    dead, alive = stack.workers
    await mock(dead).shutdown()  # still registered, but every generate() now raises EngineDeadError
    for _ in range(3):
        r = await stack.openai().completions.create(
            model=MODEL, prompt="hi", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None and r.usage.completion_tokens == 4
    text = await metrics_text(stack.url)
    assert metric(text, "kvmesh_frontend_retries_total", reason="RemoteHandlerError") >= 1
    assert mock(alive).num_steps > 0


async def test_a_request_the_engine_refuses_is_a_400_with_its_reason(make_stack):
    s: Stack = await make_stack()
    # An engine with a smaller vocabulary than the tokenizer's 384 ids: id 350 passes the frontend's check and is
    # refused by the engine (EngineRequestError); another worker would refuse it too, so no retry, and a 400.
    await s.add_worker(vocab_size=300, eos_token_id=257)
    status, _, body = await post(s.url + "/v1/completions", {"model": MODEL, "prompt": [1, 350], "max_tokens": 2})
    assert status == 400
    assert "[0, 300)" in assert_error(body, "invalid_request_error", None, None)
    assert metric(await metrics_text(s.url), "kvmesh_frontend_retries_total", reason="RemoteHandlerError") == 0


async def test_all_workers_failing_before_the_first_token_is_a_503(stack: Stack):
    for w in stack.workers:
        w._served[-1].server.draining = True
    status, headers, body = await post(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503 and "Retry-After" in headers
    assert "draining" in assert_error(body, "service_unavailable_error", None, "no_workers")


async def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(make_stack):
    # migration_limit 0: a request whose worker breaks mid-stream is not re-issued elsewhere (test_migration_frontend
    # has the re-issues).
    s: Stack = await make_stack(migration_limit=0)
    w = await s.add_worker(speedup_ratio=1.0)
    stream = await s.openai().completions.create(
        model=MODEL, prompt="doomed", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    received = 0
    with pytest.raises(openai.APIError, match="aborted the request; not re-issued elsewhere: migration_limit is 0"):
        async for _chunk in stream:
            received += 1
            if received == 1:
                (rid,) = list(mock(w).scheduler.requests)
                await mock(w).abort(rid)
    assert received >= 1
    text = await metrics_text(s.url)
    assert metric(text, "kvmesh_frontend_requests_total", endpoint="completions", status="502") == 1


# --- metrics --------------------------------------------------------------------------------------------------------


async def test_metrics_count_requests_tokens_and_latencies(stack: Stack):
    client = stack.openai()
    for max_tokens in (5, 7):
        await client.completions.create(
            model=MODEL, prompt="abcd", max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for _ in stream:
        pass
    await post(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x", "n": 3})
    await post(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6})  # too long
    await post(stack.url + "/v1/completions", {"model": "no-such-model", "prompt": "x"})
    chat_prompt = len(stack.chat_ids([{"role": "user", "content": "x"}]))

    text = await metrics_text(stack.url)
    assert metric(text, "kvmesh_frontend_requests_total", endpoint="completions", model=MODEL, status="200") == 2
    assert metric(text, "kvmesh_frontend_requests_total", endpoint="chat_completions", model=MODEL, status="200") == 1
    # Refused requests are counted under the model they named when it is served (an unsupported parameter, a
    # context too long); a name no worker serves never becomes a label value.
    assert metric(text, "kvmesh_frontend_requests_total", endpoint="completions", model=MODEL, status="400") == 2
    assert metric(text, "kvmesh_frontend_requests_total", endpoint="completions", model="", status="404") == 1
    assert "no-such-model" not in text
    assert metric(text, "kvmesh_frontend_output_tokens_total", model=MODEL) == 5 + 7 + 3
    assert metric(text, "kvmesh_frontend_input_tokens_total", model=MODEL) == 4 + 4 + chat_prompt
    assert metric(text, "kvmesh_frontend_time_to_first_token_seconds_count", model=MODEL) == 3
    assert metric(text, "kvmesh_frontend_inter_token_latency_seconds_count", model=MODEL) == 3
    assert metric(text, "kvmesh_frontend_request_duration_seconds_count", model=MODEL) == 3
    assert metric(text, "kvmesh_frontend_inflight_requests", model=MODEL) == 0


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric in a Prometheus exposition: sorted labels -> value."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def per_worker(text: str, name: str) -> dict[str, float]:
    """A per-worker counter of MODEL: worker label (hex instance id) -> value."""
    out: dict[str, float] = {}
    for labels, value in series(text, name).items():
        d = dict(labels)
        assert set(d) == {"model", "worker"}
        if d["model"] == MODEL:
            out[d["worker"]] = value
    return out


def decisions(text: str) -> dict[tuple[str, str], float]:
    """Routing decisions of MODEL: (policy, kind) -> count."""
    out: dict[tuple[str, str], float] = {}
    for labels, value in series(text, "kvmesh_frontend_routing_decisions_total").items():
        d = dict(labels)
        if d["model"] == MODEL:
            out[d["policy"], d["kind"]] = value
    return out


def served(w: Worker) -> int:
    """Generate requests this worker's endpoint answered (counted by the worker, not by the frontend)."""
    return sum(s.server.num_served for s in w._served if s.info.endpoint == ENDPOINT_GENERATE)


async def test_per_worker_counters_add_up_to_the_requests_and_prompt_tokens_sent(stack: Stack):
    a, b = stack.workers
    client = stack.openai()
    rng = random.Random(5)
    # Six prompts of 20..25 random ids (no shared block: nothing cached), round robin over two workers.
    lengths = [20 + i for i in range(6)]
    for n in lengths:
        ids = [rng.randrange(1, 256) for _ in range(n)]
        r = await client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens == n
    # And one pinned to a (the header takes the instance id in hex, as `kvmesh status` and these labels print it).
    pin = {"x-worker-instance-id": f"{a.instance_id:x}"}
    await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_headers=pin)

    text = await metrics_text(stack.url)
    requests = per_worker(text, "kvmesh_frontend_worker_requests_total")
    prompt_tokens = per_worker(text, "kvmesh_frontend_worker_prompt_tokens_total")
    # Labelled with the workers' hex instance ids, and each count is what that worker itself served.
    assert requests == {f"{a.instance_id:x}": served(a), f"{b.instance_id:x}": served(b)}
    assert requests == {f"{a.instance_id:x}": 3 + 1, f"{b.instance_id:x}": 3}  # round robin alternates; a the pin
    assert sum(prompt_tokens.values()) == sum(lengths) + 3 == 135 + 3
    assert sum(per_worker(text, "kvmesh_frontend_worker_cached_tokens_total").values()) == 0
    assert decisions(text) == {("round_robin", "rotation"): 6, ("round_robin", "pinned"): 1}


async def test_kv_routing_counts_a_repeated_prompt_as_a_cache_hit_on_the_worker_holding_it(make_stack):
    s: Stack = await make_stack(router_policy="kv")
    workers = [await s.add_worker(), await s.add_worker()]
    client = s.openai()
    prompt = [random.Random(7).randrange(1, 256) for _ in range(640)]  # 40 blocks of 16
    first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage is not None and first.usage.prompt_tokens_details is None  # nothing cached anywhere yet
    [home] = [w for w in workers if served(w) == 1]
    # The router learns the worker's blocks from its KV events, asynchronously: wait until it holds all 40.
    await wait_until(lambda: s.frontend.router.index.overlaps(block_hashes(prompt, 16)).get(home.instance_id) == 40)
    cached = 0
    for _ in range(3):
        again = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        cached += again.usage.prompt_tokens_details.cached_tokens or 0
    # The engine serves at most 639 of the 640 tokens from its cache (the last is computed for its logits): 39 whole
    # blocks of 16 per repeat.
    assert cached == 3 * 39 * 16

    text = await metrics_text(s.url)
    assert per_worker(text, "kvmesh_frontend_worker_requests_total") == {f"{home.instance_id:x}": 4}
    assert per_worker(text, "kvmesh_frontend_worker_prompt_tokens_total") == {f"{home.instance_id:x}": 4 * 640}
    assert per_worker(text, "kvmesh_frontend_worker_cached_tokens_total") == {f"{home.instance_id:x}": cached}
    # The first placement had no cache advantage anywhere (load decided it); the repeats were cache hits.
    assert decisions(text) == {("kv", "load"): 1, ("kv", "cache_hit"): 3}


async def test_a_model_is_listed_and_healthy_only_once_its_tokenizer_is_loaded(make_runtime, namespace):
    # The tokenizer's load is held until the test has seen /health while it loads (a real load of the tiny model's
    # tokenizer takes a few ms: too short a window to observe reliably), then let go.
    release = threading.Event()
    started = threading.Event()

    def gated_loader(path: str) -> Tokenizer:
        started.set()
        assert release.wait(30), "the test never released the tokenizer load"
        return load_tokenizer(path)

    worker_rt, frontend_rt = await make_runtime(), await make_runtime()
    frontend = Frontend(FrontendConfig(namespace=namespace, port=0), frontend_rt, tokenizer_loader=gated_loader)
    s = Stack(worker_rt, frontend, await frontend.start(), namespace)
    try:
        async with aiohttp.ClientSession() as session:

            async def health() -> tuple[int, dict[str, Any]]:
                async with session.get(s.url + "/health") as r:
                    return r.status, await r.json()

            await s.add_worker(wait=False)
            await wait_until(started.is_set, timeout_s=20)
            status, body = await health()
            assert status == 503 and body["status"] == "loading" and body["loading"] == [MODEL]
            assert body["models"] == []  # not listed while its tokenizer loads
            async with session.get(s.url + "/v1/models") as r:
                assert (await r.json())["data"] == []
            release.set()
            await wait_until(lambda: s.frontend.registry.models[MODEL].tokenizer_task.done(), timeout_s=20)
            status, body = await health()
            assert status == 200 and body["status"] == "healthy" and body["models"] == [MODEL]
            async with session.get(s.url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    finally:
        release.set()
        await frontend.stop()
        for w in list(s.workers):
            await w.stop()


async def test_health_lists_models_and_workers(stack: Stack):
    async with aiohttp.ClientSession() as session, session.get(stack.url + "/health") as r:
        assert r.status == 200
        assert await r.json() == {"status": "healthy", "models": [MODEL], "num_workers": 2}


# --- the kvmesh frontend command ----------------------------------------------------------------------------------


async def test_kvmesh_frontend_command_serves_until_sigterm(runtime_config, make_runtime, namespace):
    worker_rt = await make_runtime()
    w = Worker(
        worker_rt, WorkerConfig(namespace=namespace, model=MODEL, model_path=MODEL_PATH), MockEngine(engine_config())
    )
    await w.start()
    cmd = [sys.executable, "-m", "components.cli.main", "--log-level", "INFO", "frontend", "--namespace", namespace]
    cmd += ["--port", "0", "--etcd", runtime_config.etcd_endpoints[0], "--nats", runtime_config.nats_url]
    cmd += ["--api-key", "k"]
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("READY http://127.0.0.1:"), line
        url = line.split()[1]
        client = AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        try:
            for _ in range(100):  # the model appears once the frontend's watch has seen the worker
                if (await client.models.list()).data:
                    break
                await asyncio.sleep(0.05)
            r = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
            assert r.usage is not None and r.usage.completion_tokens == 3
        finally:
            await client.close()
        proc.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(proc.stdout.read(), 30)).decode()
        assert await proc.wait() == 0
        assert rest.strip().endswith("STOPPED")
        # Its start-up heap was frozen before READY (eventloop.freeze_startup_heap).
        assert "start-up heap frozen: " in (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await w.stop()
