"""One streaming OpenAI request, timed: the only module of the load generator that speaks HTTP.

A request is ``POST /v1/completions`` (token-id prompt) or ``/v1/chat/completions`` (text prompt) with ``stream=true``
and ``stream_options.include_usage``. Server-sent events are read as they arrive:

* TTFT is the time from sending to the first chunk that carries output (see ``_chunk_has_output``: text, content,
  token ids, or an empty text that is no finish marker); end-to-end latency is the time to ``data: [DONE]``.
* Inter-token latency is one sample per later output chunk: the gap since the previous output chunk divided by the
  tokens the chunk carries. Chunks do not say how many tokens they carry; when a server sends running usage in every
  chunk (vLLM's ``continuous_usage_stats``) the difference of ``completion_tokens`` is used, otherwise the request's
  ``usage.completion_tokens`` spread evenly over its output chunks (a server that streams one token per chunk, as
  vLLM does, makes that exact).
* Output tokens come from the final ``usage``; without it, output chunks are counted (``usage_missing`` in the result).
  Prompt tokens served from the server's prefix cache come from ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's
  field; kvmesh's frontend sets it, vLLM with ``--enable-prompt-tokens-details``); absent counts as 0.

Every failure is returned as a ``RequestResult`` with an error kind, never raised: ``http_<status>``, ``timeout``,
``connection``, ``stream_error`` (an ``{"error": ...}`` event inside a 200 stream) and ``protocol``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from .stats import ErrorKind, RequestResult, http_error_kind
from .traces import RequestSpec


def request_body(
    spec: RequestSpec, model: str, ignore_eos: bool, extra: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the streaming request for ``spec``; ``extra``'s fields are added first (the request's own
    fields win)."""
    body: dict[str, Any] = dict(extra) if extra else {}
    body |= {"model": model, "max_tokens": spec.max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    if spec.user is not None:
        body["user"] = spec.user
    if isinstance(spec.prompt, str):
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def _chunk_has_output(choice: dict[str, Any]) -> bool:
    """Whether a choice stands for generated tokens.

    Not only non-empty text: vLLM streams one completions chunk per token, and a token that decodes to nothing yet
    (a byte of an unfinished UTF-8 character, common with tiny-llama's byte tokenizer) comes as ``"text": ""``.
    Not output: a chat preamble (``delta`` with a ``role``) and a bare finish marker (empty, with ``finish_reason``).
    """
    if choice.get("token_ids"):
        return True
    unfinished = choice.get("finish_reason") is None
    if "text" in choice:
        return bool(choice["text"]) or unfinished
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
        return True
    return delta.get("content") == "" and "role" not in delta and unfinished


def _error_message(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(obj)


class _Stream:
    """State of one SSE stream as its events arrive."""

    __slots__ = ("chunk_tokens", "done", "first_choice_at", "gaps", "last_output_at", "t0", "ttft", "usage", "usage_ct")

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.ttft: float | None = None
        self.first_choice_at: float | None = None
        self.last_output_at = 0.0
        self.gaps: list[float] = []  # gap before each output chunk after the first
        self.chunk_tokens: list[int | None] = []  # tokens of each output chunk, when running usage tells
        self.usage: dict[str, Any] | None = None
        self.usage_ct = 0  # completion_tokens at the previous output chunk (running usage)
        self.done = False

    def event(self, data: str, now: float) -> str | None:
        """Handle one event's data; returns an error message for an error event."""
        if data == "[DONE]":
            self.done = True
            return None
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError(f"event is not a JSON object: {data[:100]!r}")
        if "error" in obj or obj.get("object") == "error":
            return _error_message(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices") or []
        if not choices:
            return None
        if self.first_choice_at is None:
            self.first_choice_at = now
        if not any(_chunk_has_output(c) for c in choices):
            return None
        tokens: int | None = None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            tokens = usage["completion_tokens"] - self.usage_ct
            self.usage_ct = usage["completion_tokens"]
        if self.ttft is None:
            self.ttft = now - self.t0
        else:
            self.gaps.append(now - self.last_output_at)
        self.chunk_tokens.append(tokens)
        self.last_output_at = now
        return None

    def finish(self, result: RequestResult, now: float, prompt_tokens: int | None) -> None:
        result.e2e_s = now - self.t0
        result.ttft_s = self.ttft
        if result.ttft_s is None and self.first_choice_at is not None:
            # Every chunk had empty text (a byte tokenizer holds back partial UTF-8): the first chunk is the answer.
            result.ttft_s = self.first_choice_at - self.t0
        n_chunks = len(self.chunk_tokens)
        usage = self.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            result.output_tokens = usage["completion_tokens"]
            result.usage_reported = True
        else:
            result.output_tokens = n_chunks
        result.prompt_tokens = (
            usage["prompt_tokens"] if isinstance(usage.get("prompt_tokens"), int) else (prompt_tokens or 0)
        )
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            result.cached_tokens = details["cached_tokens"]
        if n_chunks and result.output_tokens:
            even = result.output_tokens / n_chunks
            for gap, tokens in zip(self.gaps, self.chunk_tokens[1:], strict=True):
                result.itl_s.append(gap / (tokens if tokens else even))


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    spec: RequestSpec,
    *,
    model: str,
    ignore_eos: bool,
    timeout_s: float,
    extra_body: dict[str, Any] | None = None,
) -> RequestResult:
    """Send ``spec`` as one streaming request and time it; failures come back as ``result.error``."""
    path, body = request_body(spec, model, ignore_eos, extra_body)
    result = RequestResult(index=spec.index)
    t0 = time.perf_counter()
    stream = _Stream(t0)
    try:
        async with asyncio.timeout(timeout_s), session.post(base_url + path, json=body) as resp:
            if resp.status != 200:
                text = await resp.text(errors="replace")
                try:
                    message = _error_message(json.loads(text))
                except json.JSONDecodeError:
                    message = text
                result.error, result.error_message = http_error_kind(resp.status), message[:300]
                return result
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                result.error = ErrorKind.PROTOCOL
                result.error_message = f"expected text/event-stream, got {resp.headers.get('Content-Type')!r}"
                return result
            data: list[str] = []
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
                    continue
                if line or not data:
                    continue  # a comment (':'), an 'event:'/'id:' field, or a blank line between events
                error = stream.event("\n".join(data), time.perf_counter())
                data.clear()
                if error is not None:
                    result.error, result.error_message = ErrorKind.STREAM_ERROR, error
                    return result
                if stream.done:
                    break
            if data and not stream.done:  # the last event was not followed by a blank line
                error = stream.event("\n".join(data), time.perf_counter())
                if error is not None:
                    result.error, result.error_message = ErrorKind.STREAM_ERROR, error
                    return result
            if not stream.done:
                result.error, result.error_message = ErrorKind.PROTOCOL, "stream ended without data: [DONE]"
                return result
            stream.finish(result, time.perf_counter(), spec.prompt_tokens)
            return result
    except TimeoutError:
        # Before the connection errors: aiohttp's ServerTimeoutError is both a TimeoutError and a ClientError.
        result.error, result.error_message = ErrorKind.TIMEOUT, f"no end of stream after {timeout_s} s"
    except aiohttp.ClientError as e:
        result.error, result.error_message = ErrorKind.CONNECTION, f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:  # unparsable JSON (JSONDecodeError is a ValueError), odd shapes
        result.error, result.error_message = ErrorKind.PROTOCOL, f"{type(e).__name__}: {e}"
    return result
