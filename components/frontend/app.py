"""The HTTP side of the frontend (aiohttp): routes, OpenAI response bodies, server-sent events, API key, and the
one table that turns the frontend's typed errors into HTTP statuses. No other kvmesh module names a status code.

Routes: GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics. Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``.

Streaming: response headers go out only after the first output has arrived, so an error before it (no workers,
a timeout, a refused request) still gets its real status. Like vLLM's server, every worker output that carried tokens
becomes a chunk, with empty text while a multi-byte character is incomplete, so the first chunk leaves with the first
token. After the first output, a failure ends the stream with an ``error`` event (which the ``openai`` client raises
as ``APIError``). SSE chunks are assembled from byte strings prepared once per request around the one ``json.dumps``
of the new text, rather than serialising a fresh dict per chunk.

Client disconnects: the server runs with aiohttp's ``handler_cancellation``, so a client that goes away cancels its
handler task; the generation's ``aclose`` then cancels the request on the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from components.frontend.config import FrontendConfig
from components.frontend.errors import (
    AuthenticationError,
    FrontendError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelUnavailableError,
    ServiceUnavailableError,
    UpstreamError,
    UpstreamTimeoutError,
)
from components.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from components.frontend.models import ModelRegistry
from components.frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from components.frontend.replicas import REPLICA_ENV, REPLICAS_ENV
from components.frontend.service import FrontendService, Generation, Prepared, routing_hints

logger = logging.getLogger(__name__)

_dumps = json.dumps
# What ``json.dumps`` of a str returns with its default arguments (``ensure_ascii``), called without the two Python
# frames ``dumps`` -> ``JSONEncoder.encode`` put around the C function: once per streamed chunk.
_dumps_str = json.encoder.encode_basestring_ascii

# Most specific first: the first matching class decides (status, OpenAI error type).
_STATUS: list[tuple[type[FrontendError], int, str]] = [
    (InvalidRequestError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "authentication_error"),
    (ModelNotFoundError, 404, "invalid_request_error"),
    (ServiceUnavailableError, 503, "service_unavailable_error"),
    (UpstreamTimeoutError, 504, "timeout_error"),
    (UpstreamError, 502, "server_error"),
    (ModelUnavailableError, 500, "server_error"),
    (FrontendError, 500, "server_error"),
]
# At most about this many bytes of chunks share one write (a stream that fell far behind still reaches the client in
# pieces). 16 chunks until 2026-11-30: ~3.5 KB of ~220-byte chat chunks, so 64 tokens that had all arrived took 4
# writes, one syscall each (docs/frontend.md, "Fewer writes per stream"); 32 KiB holds ~150 such chunks, well under
# a socket's send buffer.
_MAX_GATHERED_BYTES = 32 * 1024
_CLIENT_CLOSED = 499  # nginx's code for "the client went away first", used only as a metrics label
_PUBLIC_PATHS = {"/health"}


class _EventStream(web.StreamResponse):
    """An SSE response whose status line and headers leave with its first bytes of body, in one write.

    aiohttp's ``StreamResponse`` writes its headers as ``prepare`` returns (one ``writelines`` syscall on its own);
    a plain ``Response`` holds them back and sends them with its body (``_send_headers_immediately``, aiohttp >= 3.12,
    aio-libs/aiohttp#10991; older versions do not read it and send them at once, as before). A stream's client reads
    nothing before its first chunk anyway, so holding them saves one write per request (their own write was 2.6% of a
    ``kv`` frontend's py-spy samples; docs/frontend.md, "Fewer writes per stream"). They leave with the first token's
    chunk, not before it: a client sees the status line at its first token rather than at once.
    """

    _send_headers_immediately = False


def status_of(e: FrontendError) -> tuple[int, str]:
    for cls, status, kind in _STATUS:
        if isinstance(e, cls):
            return status, kind
    return 500, "server_error"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class FrontendApp:
    def __init__(
        self,
        config: FrontendConfig,
        service: FrontendService,
        registry: ModelRegistry,
        metrics: FrontendMetrics,
    ) -> None:
        self.config = config
        self.service = service
        self.registry = registry
        self.metrics = metrics
        self._api_key = config.api_key
        # Which of the processes sharing the port this is (``kvmesh frontend --replicas N``), told in /health: a
        # connection reaches one replica, so whoever waits for the frontend (kvmesh serve) must see every one ready.
        replica, replicas = os.environ.get(REPLICA_ENV), os.environ.get(REPLICAS_ENV)
        self._replica: dict[str, int] = (
            {"replica": int(replica), "replicas": int(replicas)} if replica and replicas and int(replicas) > 1 else {}
        )

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.config.max_request_body_bytes)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_handler)
        return app

    # --- errors and authentication ----------------------------------------------------------------------------------

    def error_response(self, e: FrontendError) -> web.Response:
        status, kind = status_of(e)
        headers = {}
        if status == 503:
            headers["Retry-After"] = str(self.config.retry_after_s)
        elif status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        body = error_body(e.message, kind, e.param, e.code)
        return web.json_response(body, status=status, headers=headers)

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self._api_key is not None and request.path not in _PUBLIC_PATHS:
            auth = request.headers.get("Authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self._api_key}".encode()):
                return self.error_response(
                    AuthenticationError("Missing or incorrect API key: send 'Authorization: Bearer <key>'.")
                )
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own answers (unknown route, wrong method, body too large)
            if e.status < 400:
                raise
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            keep = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
            body = error_body(f"{e.reason}: {request.method} {request.path}", kind)
            return web.json_response(body, status=e.status, headers=keep)  # keeps Allow on a 405

    # --- plain endpoints --------------------------------------------------------------------------------------------

    def _known_model_in(self, body: bytes) -> str:
        """The model a refused request named, if this frontend serves it or has served it (a label value must never
        be a client's free text); "" otherwise. Only on the error path: a body that failed validation is parsed
        again."""
        if not body:
            return ""
        try:
            name = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return ""
        return name if isinstance(name, str) and name in self.registry.seen else ""

    def _listed(self) -> list[str]:
        """Models a client may see: served, with their tokenizer loaded (or failed to load: then it says why)."""
        return sorted(n for n, m in self.registry.models.items() if not m.loading)

    async def health(self, request: web.Request) -> web.Response:
        """200 once every discovered model's tokenizer is loaded; 503 while one loads (``kvmesh serve`` and
        orchestrators wait for this, so the first request after READY does not wait for a tokenizer)."""
        loading = sorted(n for n, m in self.registry.models.items() if m.loading)
        body = {
            "status": "loading" if loading else "healthy",
            "models": self._listed(),
            "num_workers": self.registry.num_workers(),
            **self._replica,
        }
        if loading:
            body["loading"] = loading
        return web.json_response(body, status=503 if loading else 200)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _model_card(self, name: str) -> dict[str, Any]:
        m = self.registry.models[name]
        return {
            "id": name,
            "object": "model",
            "created": m.created,
            "owned_by": "kvmesh",
            "max_model_len": m.max_model_len,
        }

    async def list_models(self, request: web.Request) -> web.Response:
        cards = [self._model_card(n) for n in self._listed()]
        return web.json_response({"object": "list", "data": cards})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self._listed():
            return self.error_response(ModelNotFoundError(name, self._listed()))
        return web.json_response(self._model_card(name))

    # --- generation -------------------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival_s = time.monotonic()
        endpoint = "chat_completions" if chat else "completions"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s if self.config.request_timeout_s else None
        model_label = ""  # a known model's name only: client-chosen names must not become label values
        status = 200
        body = b""
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    body = await request.read()
                    req: CompletionRequest | ChatCompletionRequest
                    if chat:
                        req = parse_request(ChatCompletionRequest, body)
                    else:
                        req = parse_request(CompletionRequest, body)
                    if req.model in self.registry.seen:
                        # Counted under its model from here on, also when the request is refused (too long, bad
                        # parameters, its workers gone for now: a 503); a name no worker ever served never becomes a
                        # label value (``seen`` only grows with discovered models).
                        model_label = req.model
                    hints = routing_hints(request.headers, req.user)
                    if isinstance(req, ChatCompletionRequest):
                        prepared = await self.service.prepare_chat(req, arrival_s)
                    else:
                        prepared = await self.service.prepare_completion(req, arrival_s)
                    prepared.hints = hints
                    model_label = prepared.model.name
                    gen = await self.service.start(prepared)
            except TimeoutError:
                raise UpstreamTimeoutError(
                    f"the request took longer than {self.config.request_timeout_s:g} s (request_timeout_s)"
                ) from None
            mm = self.metrics.model(model_label)
            mm.inflight.inc()
            try:
                if req.stream:
                    response, status = await self._stream(request, req, prepared, gen, chat, deadline)
                    return response
                return await self._complete(req, prepared, gen, chat, deadline)
            finally:
                mm.inflight.dec()
                self.service.observe(gen, mm)
                mm.e2e.observe(time.monotonic() - arrival_s)
                await gen.aclose()
        except FrontendError as e:
            if not model_label:
                model_label = self._known_model_in(body)
            response = self.error_response(e)
            status = response.status
            if status >= 500:
                logger.info("%s failed with %d: %s", endpoint, status, e.message)
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):  # the client left; aclose() cancelled its request
            status = _CLIENT_CLOSED
            raise
        finally:
            self.metrics.count_request(endpoint, model_label, status)

    async def _complete(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        p: Prepared,
        gen: Generation,
        chat: bool,
        deadline: float | None,
    ) -> web.Response:
        pieces: list[str] = []
        try:
            async with asyncio.timeout_at(deadline):
                async for text, _ in gen:
                    if text:
                        pieces.append(text)
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"the request took longer than {self.config.request_timeout_s:g} s (request_timeout_s)"
            ) from None
        text = "".join(pieces)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
        body = {
            "id": ("chatcmpl-" if chat else "cmpl-") + p.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": p.model.name,
            "choices": [choice],
            "usage": _usage(gen),
        }
        return web.Response(body=_dumps(body).encode(), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        req: CompletionRequest | ChatCompletionRequest,
        p: Prepared,
        gen: Generation,
        chat: bool,
        deadline: float | None,
    ) -> tuple[web.StreamResponse, int]:
        enc = _ChunkEncoder(p, chat, req.include_usage, req.continuous_usage)
        response = _EventStream(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        await response.prepare(request)
        write = response.write
        status = 200
        pending: list[bytes] = []  # chunks read but not written yet: what arrived together goes out in one write
        try:
            async with asyncio.timeout_at(deadline):
                # A chunk per worker output that carried tokens, even when its text is empty (bytes of an unfinished
                # UTF-8 character, text held back by a stop string), as vLLM's server streams: with a byte-level
                # tokenizer a token is often part of a character, and skipping it made the first chunk wait for the
                # tokens that complete it (issue 4; measured in docs/vllm-cpu.md, "Benchmark: kvmesh bench vs-vllm").
                # Chunks whose outputs were already here when the previous one was read share one write (and one
                # syscall): never a wait, only less work when the frontend falls behind the workers. The last chunk
                # (it carries the finish reason) waits for nothing either: it leaves below, in one write with the
                # usage chunk, [DONE] and the end of the body, where they took three more.
                # What is here already is taken with ``gen.poll()`` (no coroutine per item); the ``async for``
                # waits for the rest.
                num_sent = 0
                gathered = 0  # bytes in pending
                async for text, finish in gen:
                    while True:
                        if text or finish is not None or gen.num_output_tokens != num_sent:
                            num_sent = gen.num_output_tokens
                            chunk = enc.chunk(text, finish, gen)
                            pending.append(chunk)
                            gathered += len(chunk)
                        if finish is not None:
                            break
                        if gathered >= _MAX_GATHERED_BYTES:
                            await write(b"".join(pending))
                            pending.clear()
                            gathered = 0
                        polled = gen.poll()
                        if polled is None:
                            break
                        text, finish = polled
                    if finish is None and pending:
                        await write(pending[0] if len(pending) == 1 else b"".join(pending))
                        pending.clear()
                        gathered = 0
            if req.include_usage:
                pending.append(enc.usage(gen))
        except FrontendError as e:
            status, kind = status_of(e)
            pending.append(self._error_event(error_body(e.message, kind, e.param, e.code)))
        except TimeoutError:
            status, kind = status_of(UpstreamTimeoutError(""))
            msg = f"the request took longer than {self.config.request_timeout_s:g} s (request_timeout_s)"
            pending.append(self._error_event(error_body(msg, kind, None, UpstreamTimeoutError.code)))
        pending.append(b"data: [DONE]\n\n")
        await response.write_eof(b"".join(pending))
        return response, status

    @staticmethod
    def _error_event(body: dict[str, Any]) -> bytes:
        """The event that ends a stream after an error (it follows the chunks read before the error)."""
        logger.info("stream ended with an error: %s", body["error"]["message"])
        return b"data: " + _dumps(body).encode() + b"\n\n"


def _usage(gen: Generation) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": gen.num_prompt_tokens,
        "completion_tokens": gen.num_output_tokens,
        "total_tokens": gen.num_prompt_tokens + gen.num_output_tokens,
    }
    if gen.num_cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": gen.num_cached_tokens}
    return usage


class _ChunkEncoder:
    """One request's SSE chunks: the constant parts are encoded once, each chunk adds its text and finish reason."""

    __slots__ = ("_after", "_continuous", "_first", "_head", "_tail_null", "_usage_head")

    def __init__(self, p: Prepared, chat: bool, include_usage: bool, continuous_usage: bool) -> None:
        rid = ("chatcmpl-" if chat else "cmpl-") + p.request_id
        obj = "chat.completion.chunk" if chat else "text_completion"
        common = f'{{"id":{_dumps(rid)},"object":"{obj}","created":{int(time.time())},"model":{_dumps(p.model.name)}'
        self._usage_head = ("data: " + common + ',"choices":[]').encode()
        head = "data: " + common + ',"choices":[{"index":0,'
        if chat:
            self._first: bytes | None = (head + '"delta":{"role":"assistant","content":').encode()
            self._head = (head + '"delta":{"content":').encode()
            self._after = b'},"logprobs":null,"finish_reason":'
        else:
            self._first = None
            self._head = (head + '"text":').encode()
            self._after = b',"logprobs":null,"finish_reason":'
        # OpenAI: with include_usage, every chunk but the last carries "usage": null.
        self._tail_null = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"
        self._continuous = continuous_usage

    def chunk(self, text: str, finish: str | None, gen: Generation) -> bytes:
        head = self._head
        if self._first is not None:
            head, self._first = self._first, None
        fr = b"null" if finish is None else f'"{finish}"'.encode()
        if self._continuous:
            tail = b'}],"usage":' + _dumps(_usage(gen)).encode() + b"}\n\n"
        else:
            tail = self._tail_null
        return b"".join((head, _dumps_str(text).encode(), self._after, fr, tail))

    def usage(self, gen: Generation) -> bytes:
        return self._usage_head + b',"usage":' + _dumps(_usage(gen)).encode() + b"}\n\n"
