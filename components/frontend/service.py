"""The request pipeline, without HTTP: OpenAI request -> token ids -> a worker -> text deltas.

``FrontendService.prepare_*`` turns a parsed request into a ``Prepared`` one (model resolved, prompt tokenised, limits
checked, sampling parameters built); ``start`` hands it to a ``Dispatch`` (dispatch.py: the request's attempts, its
retries before the first output and every router bookkeeping call, in one place) and returns a ``Generation`` once
the first output has arrived. The Generation reads the dispatch, never a worker's stream: an upstream that breaks
after that goes to ``Dispatch.resume`` with the position the client has reached, which continues it from another
worker (up to ``migration_limit`` times; then ``UpstreamError``), unseen here, as is a request the workers move.

``Generation`` is the hot path: per chunk from the worker it decodes the new tokens once (no per-token Python work
beyond list extension), checks stop strings on the new text only, and keeps the counters usage and metrics need.
Closing it (``aclose``) closes the dispatch, which cancels the request on its worker; the engine aborts it and frees
its KV blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from array import array
from collections.abc import Mapping
from typing import Any

from components.fleet.request_counts import RequestCounts
from components.frontend.config import FrontendConfig
from components.frontend.dispatch import Dispatch, Interrupted, Suspects
from components.frontend.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from components.frontend.metrics import FrontendMetrics, ModelMetrics
from components.frontend.models import Model, ModelRegistry
from components.frontend.protocol import ChatCompletionRequest, CompletionRequest
from components.frontend.request_stats import RequestStatsBook
from components.frontend.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from components.protocol.kv_hashing import packed_prompt
from components.protocol.messages import SamplingParams
from components.router import Router

logger = logging.getLogger(__name__)

# Routing hints a client may send as headers (the OpenAI body has no room for them, and must not get any).
HEADER_PROGRAM_ID = "x-program-id"  # an agent program / conversation: Autellix's program id
HEADER_SESSION_ID = "x-session-id"  # the same, under the name session-based clients use
HEADER_PROGRAM_END = "x-program-end"  # "1"/"true" on a program's last request: affinity policies forget it after
HEADER_WORKER_PIN = "x-worker-instance-id"  # hex instance id, as `kvmesh status` prints it: send it there (debugging)


@dataclasses.dataclass(slots=True, frozen=True)
class RoutingHints:
    """What the client told the router about a request besides its prompt."""

    program_id: str | None = None
    ends_program: bool = False
    pinned_instance_id: int | None = None


def routing_hints(headers: Mapping[str, str], user: str | None) -> RoutingHints:
    """Hints from request headers (case-insensitive mapping) and the OpenAI ``user`` field.

    The program id is the ``x-program-id`` header, else ``user``, else the ``x-session-id`` header: an explicit
    program beats an end user, who may run several. Raises ``InvalidRequestError`` for a pin that is not a hex id.
    """
    program = headers.get(HEADER_PROGRAM_ID) or user or headers.get(HEADER_SESSION_ID) or None
    ends = headers.get(HEADER_PROGRAM_END, "").strip().lower() in ("1", "true", "yes")
    pin_text = headers.get(HEADER_WORKER_PIN)
    pin = None
    if pin_text:
        try:
            pin = int(pin_text.strip(), 16)
        except ValueError:
            raise InvalidRequestError(
                f"header {HEADER_WORKER_PIN} must be a worker's instance id in hex (as `kvmesh status` shows it), "
                f"got {pin_text!r}"
            ) from None
    return RoutingHints(program, ends, pin)


class Prepared:
    """A validated request, ready to route.

    ``prompt_ids`` is the tokenizer's list (what the worker is sent, and the detokenizer's context);
    ``packed_prompt()`` the same ids packed once per request for a router that hashes them (``Dispatch``).
    """

    __slots__ = (
        "_packed",
        "arrival_s",
        "hints",
        "max_tokens",
        "model",
        "prompt_ids",
        "request_id",
        "sampling",
        "stops",
        "tokenizer",
    )

    def __init__(
        self,
        request_id: str,
        model: Model,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stops: list[str],
        arrival_s: float,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.stops = stops
        self.arrival_s = arrival_s
        self.max_tokens = sampling.max_tokens
        self.hints = RoutingHints()
        self._packed: array[int] | None = None

    def packed_prompt(self) -> array[int]:
        """The prompt's token ids packed (``kv_hashing.packed_prompt``: an ``array('I')`` whose buffer the router
        hashes as it is), packed on the first call and kept: the first attempt, its retries and every failover of the
        request reuse it. ~4.5 ns a token (~38 us for 8k ids, 2-core dev VM), once per request instead of once per
        hashing; only a KV-aware router asks for it (``Dispatch.start``)."""
        packed = self._packed
        if packed is None:
            packed = self._packed = packed_prompt(self.prompt_ids)
        return packed


class Generation:
    """One request running on a worker: an async iterator of ``(text, finish_reason)`` per chunk received.

    ``finish_reason`` is None until the last item. Counters (``num_output_tokens``, timings) are up to date after
    each item.
    """

    def __init__(
        self,
        service: FrontendService,
        prepared: Prepared,
        dispatch: Dispatch,
        first: dict[str, Any],
        stats: RequestCounts | None = None,
    ) -> None:
        self._service = service
        self.prepared = prepared
        self._dispatch = dispatch
        # Its model's request report counts (request_stats.py), TTFT and gaps added per chunk; None: counted nowhere.
        self.stats = stats if stats is not None else RequestCounts()
        self._first: dict[str, Any] | None = first
        self._detok = IncrementalDetokenizer(prepared.tokenizer, prepared.prompt_ids)
        self._stop = StopStringMatcher(prepared.stops) if prepared.stops else None
        self.num_prompt_tokens = len(prepared.prompt_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.first_token_s = 0.0
        self.last_token_s = 0.0
        self.finish_reason: str | None = None
        self._closed = False

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[str, str | None]:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item = self._first
        if item is not None:
            self._first = None
        else:
            try:
                item = await self._dispatch.next_item()
            except Interrupted as e:
                # The upstream broke after the first item: the dispatch decides what follows, from the position the
                # client has reached (a try costs nothing until something is raised).
                item = await self._dispatch.resume(e, self.num_output_tokens)
        return self._process(item)

    def ready(self) -> bool:
        """Whether the next item is here already: a writer can gather what arrived together into one write."""
        return self._first is not None or (self.finish_reason is None and self._dispatch.ready())

    def poll(self) -> tuple[str, str | None] | None:
        """The next ``(text, finish_reason)`` if its item is here already, processed as ``__anext__`` would; None
        when it is not (or the generation has finished): then ``__anext__`` waits for it. A writer takes what
        arrived together this way and writes it in one go, without a coroutine per item."""
        if self.finish_reason is not None:
            return None
        item = self._first
        if item is not None:
            self._first = None
        else:
            item = self._dispatch.poll()
            if item is None:
                return None
        return self._process(item)

    def _process(self, item: dict[str, Any]) -> tuple[str, str | None]:
        ids: list[int] = item["token_ids"]
        finish: str | None = item["finish_reason"]
        if ids:
            now = time.monotonic()
            n = len(ids)
            stats = self.stats
            # The request report's latencies, RequestCounts.add_tokens inlined (once per chunk: no call): TTFT from
            # arrival to the first token handed over for sending, one gap per token after the first.
            if not self.num_output_tokens:
                self.first_token_s = now
                self.num_cached_tokens = item.get("num_cached_tokens", 0)
                gap = now - self.prepared.arrival_s
                stats.ttft_count += 1
                stats.ttft_sum_s += gap
                if gap > stats.ttft_max_s:
                    stats.ttft_max_s = gap
                stats.itl_count += n - 1
            else:
                gap = now - self.last_token_s
                stats.itl_count += n
                stats.itl_sum_s += gap
                if gap > stats.itl_max_s:
                    stats.itl_max_s = gap
            self.last_token_s = now
            self.num_output_tokens += n
            text = self._detok.feed(ids)
        else:
            text = ""
        stop = self._stop
        if stop is not None:
            text = stop.feed(text)
            if stop.stopped:
                finish = "stop"
                # The consumer closes this generation right after the last item, which cancels the rest of the
                # request on the worker (it would otherwise generate past the stop string up to max_tokens).
        if finish is not None:
            if stop is None:
                text += self._detok.flush()
            elif not stop.stopped:
                text += stop.feed(self._detok.flush())
                text += stop.flush()
            self.finish_reason = finish
        return text, finish

    async def aclose(self) -> None:
        """Cancel the request on its worker if it is still running, and settle the router's bookkeeping. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._dispatch.close()
        finally:
            self._service.num_inflight -= 1

    @property
    def route_id(self) -> str:
        return self._dispatch.route_id


class FrontendService:
    def __init__(
        self, config: FrontendConfig, registry: ModelRegistry, router: Router, metrics: FrontendMetrics
    ) -> None:
        self.config = config
        self.registry = registry
        self.router = router
        self.metrics = metrics
        # Request ids: unique per process by the counter, across frontends by the random prefix (the engine refuses a
        # duplicate id, and several frontends may share a worker).
        self._prefix = os.urandom(6).hex()
        self._ids = itertools.count()
        self.num_inflight = 0
        # What the request reports count (request_stats.py); the prefixes: for the rescheduler's prefix_replication.
        self.request_stats = RequestStatsBook(time.monotonic(), config.request_stats_prefixes)
        self.suspects = Suspects()  # processes whose worker just failed: avoided while another can serve

    # --- preparation ------------------------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"{self._prefix}{next(self._ids):x}"

    def resolve_model(self, name: str) -> Model:
        model = self.registry.models.get(name)
        if model is not None:
            return model
        if name in self.registry.seen or not self.registry.models:
            # Its workers left (or none has registered yet): a worker that is starting or restarting may serve it in
            # a moment, so this is "try again", not "does not exist".
            raise ServiceUnavailableError(f"no workers serve model {name!r} right now")
        raise ModelNotFoundError(name, sorted(self.registry.models))

    async def prepare_completion(self, req: CompletionRequest, arrival_s: float) -> Prepared:
        model = self.resolve_model(req.model)
        tok = await model.tokenizer()
        prompt = req.prompt_input()
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        else:
            ids = prompt
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= tok.vocab_size:
                raise InvalidRequestError(
                    f"prompt token ids must lie in [0, {tok.vocab_size}), got {lo if lo < 0 else hi}", param="prompt"
                )
        return self._prepare(req, model, tok, ids, req.max_tokens, "prompt", arrival_s, chat=False)

    async def prepare_chat(self, req: ChatCompletionRequest, arrival_s: float) -> Prepared:
        model = self.resolve_model(req.model)
        tok = await model.tokenizer()
        ids = tok.apply_chat_template(req.conversation())
        return self._prepare(req, model, tok, ids, req.requested_max_tokens, "messages", arrival_s, chat=True)

    def _prepare(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        model: Model,
        tok: Tokenizer,
        ids: list[int],
        max_tokens: int | None,
        prompt_param: str,
        arrival_s: float,
        chat: bool,
    ) -> Prepared:
        sampling, stops = build_sampling(
            req, model, tok, ids, max_tokens, prompt_param, self.config.default_max_tokens, chat
        )
        return Prepared(self.new_request_id(), model, tok, ids, sampling, stops, arrival_s)

    # --- routing and retries: one request's attempts live in dispatch.py -------------------------------------------

    async def start(self, p: Prepared) -> Generation:
        """Route ``p`` and wait for its first output (``Dispatch.start``: retries, errors); the Generation streams the
        rest and, closed, cancels what still runs and settles the router's bookkeeping."""
        mm = self.metrics.model(p.model.name)
        stats = self.request_stats.model(p.model.name)
        dispatch = Dispatch(
            self.config,
            self.registry,
            self.router,
            self.suspects,
            p,
            mm,
            on_retry=self._count_retry,
            on_prefix=stats.carried if self.request_stats.max_prefixes else None,
        )
        stats.arrived(len(p.prompt_ids))
        try:
            first = await dispatch.start()
        except BaseException:  # refused, no worker, timed out, or the client left: an admitted request that failed
            stats.ended(0, failed=True)
            raise
        self.num_inflight += 1
        return Generation(self, p, dispatch, first, stats)

    def _count_retry(self, reason: str) -> None:
        self.metrics.retries.labels(reason=reason).inc()

    # --- completion -------------------------------------------------------------------------------------------------

    def observe(self, gen: Generation, mm: ModelMetrics) -> None:
        """Token counters and latency histograms of a finished (or failed) generation, and its end in the request
        reports: failed when it ended without a finish reason (an error, a timeout, the client left). Once per
        generation."""
        gen.stats.ended(gen.num_output_tokens, failed=gen.finish_reason is None)
        mm.input_tokens.inc(gen.num_prompt_tokens)
        if gen.num_output_tokens:
            mm.output_tokens.inc(gen.num_output_tokens)
            mm.ttft.observe(gen.first_token_s - gen.prepared.arrival_s)
            if gen.num_output_tokens > 1:
                mm.itl.observe((gen.last_token_s - gen.first_token_s) / (gen.num_output_tokens - 1))


def build_sampling(
    req: CompletionRequest | ChatCompletionRequest,
    model: Model,
    tok: Tokenizer,
    ids: list[int],
    max_tokens: int | None,
    prompt_param: str,
    default_max_tokens: int,
    chat: bool,
) -> tuple[SamplingParams, list[str]]:
    """Check the prompt against the model's context and build the worker's sampling parameters (pure).

    Returns them with the stop strings the frontend itself must watch for.
    """
    n = len(ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param=prompt_param)
    limit = model.max_model_len
    if limit and n >= limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens, but the prompt has {n} tokens, which leaves "
            "no room for output. Shorten the prompt.",
            prompt_param,
            n,
            limit,
        )
    if max_tokens is None:
        # OpenAI's defaults: 16 for completions, the rest of the context for chat; never more than fits.
        room = limit - n if limit else default_max_tokens
        max_tokens = room if chat else min(default_max_tokens, room)
    elif limit and n + max_tokens > limit:
        chat_param = isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens, but {n + max_tokens} were requested "
            f"({n} in the prompt, {max_tokens} for the completion). Reduce max_tokens to at most {limit - n}.",
            "max_completion_tokens" if chat_param else "max_tokens",
            n,
            limit,
        )
    stops = req.stop_strings()
    stop_ids = list(req.stop_token_ids or ())
    for s in stops:
        tid = tok.single_token_stop(s)
        if tid is not None and tid not in stop_ids:
            stop_ids.append(tid)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        seed=req.seed,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
    )
    return sampling, stops
