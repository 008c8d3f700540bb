"""The simulated engine's scheduler: vLLM V1's continuous batching, minus the GPU.

NOTE on the scheduling algorithm (after vLLM V1's ``Scheduler.schedule``): there are no separate prefill and decode
phases. Every request has ``num_computed_tokens`` (whose KV is in its blocks) and ``num_tokens`` (prompt plus the
outputs sampled so far); a step gives each scheduled request up to ``num_tokens - num_computed_tokens`` new tokens
out of a budget of ``max_num_batched_tokens``. A request whose computed tokens catch up with its tokens samples one
output token at the end of the step. So a decode is simply "one new token", a prefill chunk is "many", and a request
preempted mid-answer recomputes prompt and outputs in one go.

One step:

Prefill share: with ``long_prefill_token_threshold`` > 0 and more than one request running or waiting, a request is
given at most that many tokens in one step (vLLM's rule, applied before the budget; a lone request is not capped).

1. Running requests, oldest first, each get ``min(remaining, budget)`` tokens. When their blocks cannot be allocated,
   the newest running request is preempted by recompute: its blocks are freed (full ones stay in the prefix cache,
   so recomputing them is usually a cache hit), its computed tokens reset to 0, its sampled outputs kept, and it
   goes to the front of the waiting queue. The request being scheduled may be the one preempted.
2. Only if nothing was preempted: waiting requests, first come first served, while the budget lasts and fewer than
   ``max_num_seqs`` run. Admission first looks the request's chained block hashes up in the prefix cache: hit blocks
   are shared (reference counted) and their tokens not recomputed, capped so that at least one token is computed
   (the step needs it to produce logits, as in vLLM). Without chunked prefill a prompt that does not fit the budget
   whole waits (head of line: later requests wait behind it). A block is cached only once computed, so two requests
   sharing a prefix that are admitted before either has stored it both compute it (vLLM's behaviour). With
   ``enable_in_batch_prefix_caching`` (off by default; SGLang's in-batch prefix caching) a waiting request whose
   first uncached block a running request is computing is held, keeping its place, and the queue behind it is looked
   at; it is admitted, hitting the longer prefix, once no running request computes that block any more.
3. Bookkeeping: blocks that became full get their hashes (a ``BLOCK_STORED`` event), requests that caught up sample
   a token, and finished requests free their blocks.

With a host-memory tier (``num_host_blocks``), admission continues the prefix lookup there past the device's hits:
those blocks get fresh device blocks and count as computed (``num_cached_tokens`` includes them,
``num_host_cached_tokens`` says how many), and the step that admits them takes their load time on top of its compute
(``host_kv_latency_ms`` + bytes at ``host_kv_bandwidth_gbps``): the batch waits for the copy, as an engine whose
connector loads KV before the forward pass does. A finished or preempted request marks its blocks used in the tier.
Remote prefill (disaggregation) looks at the device cache only.

Output tokens are a pure function of (config seed, request sampling seed, every token before them): token ``i`` is
``xxh3_64(all tokens before i, seed=request_seed) % vocab_size``, computed with one streaming hasher per request.
Identical requests get identical answers on every engine, and a request re-sent with its first ``k`` outputs appended
to its prompt (migration) continues with the same tokens. Temperature, top-p and top-k are accepted and ignored.

Migration (components/migration/engine.py): a request can be *suspended* (taken out of the queues with its blocks
and state kept, ``resume`` puts it back) and another engine's request *committed* here: with KV, into blocks
reserved beforehand (``reserve_migration``/``extend_migration``, sharing the prefix cache), it joins the running
batch decoding; without, it waits at the front of the queue and recomputes prompt and outputs (prefix cache hits
included). Its outputs, sampling seed and stop conditions carry over, so it produces the tokens it would have.

Pure: no asyncio, no clock (``now_s`` is an argument), no I/O. Imports the engine contract, this package, the
protocol's ``kv_hashing`` and messages, the migration package's pure types, and xxhash.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque

import xxhash

from components.migration.engine import KvExtent
from components.migration.types import RequestTable, RequestView
from components.protocol.errors import ErrorCode
from components.protocol.kv_hashing import block_hashes, pack_token_ids
from components.protocol.messages import (
    FinishReason,
    GenerateRequest,
    KvEvent,
    KvStateSnapshot,
    LoadSnapshot,
    SamplingParams,
    TokenChunk,
)
from components.protocol.migration import MigratingRequest

from ..base import EngineError, EngineRequestError
from .block_pool import BlockPool
from .config import MockEngineConfig
from .perf_model import transfer_time_s

__all__ = [
    "DuplicateRequestError",
    "MigrationRoomError",
    "PromptTooLongError",
    "Request",
    "RequestStatus",
    "Scheduler",
    "StepOutput",
]


class PromptTooLongError(EngineRequestError):
    """The prompt has more tokens than ``max_model_len``."""

    wire_param = "prompt"

    def __init__(self, request_id: str, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"request {request_id!r}: prompt of {num_prompt_tokens} tokens is longer than the maximum model "
            f"length of {max_model_len} tokens"
        )
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len

    def __reduce__(self) -> tuple[type, tuple[str, int, int]]:
        # Rebuilt from its fields, not from the message (pickle's default calls cls(*args)): a simulation sweep's
        # worker process sends it to the parent, whose pool hung on the failed unpickling instead of raising it.
        return type(self), (self.request_id, self.num_prompt_tokens, self.max_model_len)


class MigrationRoomError(EngineError):
    """No room for a migrating request's last blocks: the destination refuses the commit (the request stays on its
    source)."""


class DuplicateRequestError(EngineRequestError):
    """A request with this id is already in the engine."""

    wire_code = ErrorCode.INTERNAL  # a frontend reused an id: not the client's to fix

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} is already running or waiting in this engine")
        self.request_id = request_id

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return type(self), (self.request_id,)


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, at the front of the queue, after being preempted
    REMOTE_PREFILL = "remote_prefill"  # holds blocks for its prompt while another engine prefills it (not scheduled)
    SUSPENDED = "suspended"  # taken off the queues by a migration's final stage, blocks and state kept
    MIGRATING_IN = "migrating_in"  # blocks reserved for a request another engine is sending (not yet a request here)
    FINISHED = "finished"


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One request's scheduling state. ``all_token_ids`` is the prompt followed by the outputs sampled so far."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    all_token_ids: list[int]
    sampler: xxhash.xxh3_64  # has consumed exactly all_token_ids
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # Chained hashes of the full blocks of all_token_ids, extended lazily (only with prefix caching on).
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    num_stored_blocks: int = 0  # leading blocks whose hashes the pool already holds for this request
    num_cached_tokens: int | None = None  # prefix-cache hit at the first admission (device and host tier)
    num_host_cached_tokens: int = 0  # of which loaded from the host tier
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    suspended_from: RequestStatus | None = None  # the status a suspended request had (``resume`` restores it)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_decoding(self) -> bool:
        """True when the next step computes just the last sampled token (a decode, not a prefill chunk)."""
        return bool(self.output_token_ids) and self.num_computed_tokens == len(self.all_token_ids) - 1

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens still to be computed before this request decodes; 0 while decoding."""
        return 0 if self.is_decoding else len(self.all_token_ids) - self.num_computed_tokens


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one step did: the unit-testable result of ``Scheduler.step``."""

    now_s: float
    step_time_s: float  # modelled duration, before speedup_ratio (host-tier loads included)
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step, in scheduling order
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_kv_tokens: int
    chunks: dict[str, TokenChunk]  # request id -> the token it sampled (with finish_reason when it finished)
    preempted_ids: list[str]
    num_host_loaded_blocks: int = 0  # blocks loaded from the host tier for the requests this step admitted

    @property
    def batch_size(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def finished(self) -> dict[str, FinishReason]:
        return {rid: c.finish_reason for rid, c in self.chunks.items() if c.finish_reason is not None}


class Scheduler:
    """Waiting and running queues over a ``BlockPool``; ``step(now_s)`` runs one simulated forward pass."""

    def __init__(self, config: MockEngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(
            config.num_gpu_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            num_host_blocks=config.num_host_blocks,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting, running, reserved or suspended
        self.remote: dict[str, Request] = {}  # reserved for a remote prefill (REMOTE_PREFILL), by id
        self.suspended: dict[str, Request] = {}  # suspended by a migration's final stage (SUSPENDED), by id
        self.incoming: dict[str, Request] = {}  # blocks reserved for a migration coming in (MIGRATING_IN), by its id
        self.num_preemptions = 0  # cumulative
        self.num_steps = 0
        self._last_batch_size = 0
        self._last_decode_kv_tokens = 0
        self._last_prefill_tokens = 0
        self._host_loading = 0  # blocks the step being scheduled loads from the host tier
        # The config is frozen: what every step reads of it, read once (a simulated fleet runs ~180 steps a second
        # of CPU per engine, and each pydantic attribute read or cached_property lookup is ~50 ns).
        self._model = config.step_time_model
        self._caching = config.enable_prefix_caching
        self._vocab_size = config.vocab_size
        self._max_model_len = config.max_model_len
        self._eos_token_id = config.eos_token_id
        self._budget = config.max_num_batched_tokens
        self._long_prefill_cap = config.long_prefill_token_threshold
        self._in_batch_caching = config.enable_in_batch_prefix_caching and config.enable_prefix_caching

    # --- requests in and out ----------------------------------------------------------------------------------------

    def validate(self, request: GenerateRequest) -> None:
        """Raise ``EngineRequestError`` (or a subclass) if the request can never be served."""
        cfg = self.config
        rid = request.request_id
        n = len(request.token_ids)
        if n == 0:
            raise EngineRequestError(f"request {rid!r}: the prompt is empty")
        if n > cfg.max_model_len:
            raise PromptTooLongError(rid, n, cfg.max_model_len)
        lo, hi = min(request.token_ids), max(request.token_ids)
        if lo < 0 or hi >= cfg.vocab_size:
            raise EngineRequestError(
                f"request {rid!r}: token ids must lie in [0, {cfg.vocab_size}), got min {lo} and max {hi}"
            )
        if request.sampling.max_tokens < 1:
            raise EngineRequestError(f"request {rid!r}: max_tokens must be >= 1, got {request.sampling.max_tokens}")
        if request.num_output_tokens >= request.sampling.max_tokens:
            raise EngineRequestError(
                f"request {rid!r}: a continuation of {request.num_output_tokens} output tokens has nothing left to "
                f"produce under max_tokens = {request.sampling.max_tokens}"
            )
        if rid in self.requests:
            raise DuplicateRequestError(rid)

    def add_request(self, request: GenerateRequest, now_s: float) -> Request:
        """Validate and queue a request at the back of the waiting queue."""
        self.validate(request)
        req = self._new_request(request, now_s)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req

    def add_request_by_arrival(self, request: GenerateRequest, now_s: float, arrival_s: float) -> Request:
        """Validate and queue a request that arrived at ``arrival_s`` elsewhere (a waiting request another engine
        handed over), in arrival order: behind the preempted requests at the front of the queue (they keep vLLM's
        front-of-queue rule) and behind every waiting request that arrived at or before it, ahead of the later
        ones. Llumnix's llumlet does the same (``add_waiting_request`` sorts its waiting queue first come first
        served), so a migrated request neither jumps the destination's queue nor goes to its back."""
        self.validate(request)
        req = self._new_request(request, now_s)
        self.requests[req.request_id] = req
        self._queue_by_arrival(req, arrival_s)
        return req

    def _queue_by_arrival(self, req: Request, arrival_s: float) -> None:
        """Put ``req`` (waiting, no KV) in the queue by ``arrival_s``: behind the preempted requests and every
        waiting request that arrived at or before it (``add_request_by_arrival``)."""
        req.arrival_s = arrival_s
        at = len(self.waiting)
        for i, r in enumerate(self.waiting):
            if r.status is not RequestStatus.PREEMPTED and r.arrival_s > arrival_s:
                at = i
                break
        self.waiting.insert(at, req)

    def is_waiting(self, request_id: str) -> bool:
        """True when ``request_id`` is in the waiting queue (never admitted, or preempted): it holds no KV."""
        req = self.requests.get(request_id)
        return req is not None and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def _new_request(self, request: GenerateRequest, now_s: float) -> Request:
        seed_material = f"{self.config.seed}/{request.sampling.seed}".encode()
        sampler = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(seed_material))
        # A continuation's outputs are hashed as its own sampled tokens were (4 bytes each, as pack_token_ids packs
        # the prompt), so the sampler resumes exactly where the earlier engine's stopped.
        sampler.update(pack_token_ids(request.token_ids))
        n = request.num_output_tokens
        return Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            arrival_s=now_s,
            all_token_ids=list(request.token_ids),
            sampler=sampler,
            output_token_ids=list(request.token_ids[-n:]) if n else [],
        )

    def abort(self, request_id: str) -> bool:
        """Remove a waiting or running request and free its blocks; False if the id is unknown (or finished)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.REMOTE_PREFILL:
            del self.remote[request_id]
        elif req.status is RequestStatus.SUSPENDED:
            del self.suspended[request_id]
        else:
            self.waiting.remove(req)
        self._release(req, FinishReason.ABORT)
        return True

    def abort_all(self) -> list[str]:
        """Abort every unfinished request; returns their ids."""
        ids = list(self.requests)
        for rid in ids:
            self.abort(rid)
        return ids

    def has_unfinished_requests(self) -> bool:
        """Whether a step has anything to do: requests waiting or running (one waiting for its remote prefill has
        nothing to compute here until ``commit_remote_prefill``)."""
        return bool(self.waiting or self.running)

    # --- remote prefill (disaggregated serving: this engine decodes, another prefills) ------------------------------

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of a prompt this engine's prefix cache holds (whole blocks, at most ``len - 1`` tokens, as
        admission would count them); pure lookup, touches nothing."""
        if not self.pool.enable_caching or not token_ids:
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        return len(self.pool.lookup_prefix(block_hashes(token_ids[: max_blocks * bs], bs))) * bs

    def reserve_remote_prefill(self, request: GenerateRequest, now_s: float) -> Request | None:
        """Validate ``request`` and give it the blocks its whole prompt needs (sharing the cached prefix) without
        scheduling it: another engine computes the prompt and ``commit_remote_prefill`` hands over its first token.
        None, changing nothing, when the pool cannot hold the prompt now (the caller prefills locally instead)."""
        self.validate(request)
        req = self._new_request(request, now_s)
        hits = self._prefix_hits(req)
        if not self._allocate_slots(req, req.num_tokens - len(hits) * self.block_size, hits):
            return None
        req.num_stored_blocks = len(hits)
        req.num_cached_tokens = len(hits) * self.block_size
        req.status = RequestStatus.REMOTE_PREFILL
        self.requests[req.request_id] = req
        self.remote[req.request_id] = req
        return req

    def commit_remote_prefill(self, request_id: str, first_token: int) -> TokenChunk | None:
        """The prompt's KV arrived in the reserved blocks and ``first_token`` was sampled by the prefill engine: the
        request joins the running batch, decoding next step. Returns the first token's chunk (with a finish reason
        when that token ends it); None when the request is no longer reserved (aborted meanwhile)."""
        req = self.remote.pop(request_id, None)
        if req is None:
            return None
        req.num_computed_tokens = req.num_tokens
        if self.pool.enable_caching:
            self._store_full_blocks(req)
        chunk = self._sample(req, first_token)
        if chunk.finish_reason is not None:
            del self.requests[request_id]
            self._release(req, chunk.finish_reason)
            return chunk
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return chunk

    def cancel_remote_prefill(self, request_id: str) -> bool:
        """Prefill a reserved request here after all (the remote prefill failed or took too long): its blocks go
        back, and it waits at the back of the queue as if just added. False if it is no longer reserved."""
        req = self.remote.pop(request_id, None)
        if req is None:
            return False
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_stored_blocks = 0
        req.num_cached_tokens = None
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        return True

    # --- migration (components/migration/engine.py: the source's and the destination's sides) ----------------------

    def request_table(self) -> RequestTable:
        """Running requests in admission order, waiting ones in queue order, for request selection."""

        def view(r: Request) -> RequestView:
            return RequestView(r.request_id, r.num_prompt_tokens, len(r.output_token_ids), r.arrival_s)

        return RequestTable(
            running=tuple(view(r) for r in self.running),
            waiting=tuple(view(r) for r in self.waiting),
            kv_capacity_tokens=self.pool.num_blocks * self.block_size,
        )

    def kv_extent(self, request_id: str) -> KvExtent | None:
        """The blocks of KV ``request_id`` has now (whole ones and their tokens, and all with the partial one)."""
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.REMOTE_PREFILL:
            return None
        bs = self.block_size
        full = req.num_computed_tokens // bs
        return KvExtent(full, -(-req.num_computed_tokens // bs), req.all_token_ids[: full * bs])

    def suspend(self, request_id: str) -> Request | None:
        """Take a waiting or running request off the queues, keeping its blocks and state; None when it is unknown,
        finished, or not in a queue (reserved for a remote prefill, already suspended)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        else:
            return None
        req.suspended_from = req.status
        req.status = RequestStatus.SUSPENDED
        self.suspended[request_id] = req
        return req

    def resume(self, request_id: str) -> bool:
        """Put a suspended request back where it was (the end of the running batch, or the front of the queue)."""
        req = self.suspended.pop(request_id, None)
        if req is None:
            return False
        if req.suspended_from is RequestStatus.RUNNING:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        else:
            req.status = req.suspended_from or RequestStatus.WAITING
            self.waiting.appendleft(req)
        req.suspended_from = None
        return True

    def migration_state(self, request_id: str) -> MigratingRequest | None:
        """A suspended request as it crosses to another engine (``reply``/``next_seq`` are the agent's to fill)."""
        req = self.suspended.get(request_id)
        if req is None:
            return None
        return MigratingRequest(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            sampling=req.sampling,
            num_computed_tokens=req.num_computed_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
        )

    def reserve_migration(self, migration_id: str, request_id: str, token_ids: list[int], now_s: float) -> int | None:
        """Blocks for the whole blocks ``token_ids`` of a request another engine is sending, sharing the leading ones
        this pool's prefix cache holds; returns how many it shares (the sender skips them), None (changing
        nothing) without room."""
        if migration_id in self.incoming:
            raise EngineRequestError(f"migration {migration_id!r} already has blocks reserved here")
        bs = self.block_size
        n = len(token_ids) // bs
        hashes = block_hashes(token_ids[: n * bs], bs) if self.pool.enable_caching else []
        hits = self.pool.lookup_prefix(hashes)
        if n - len(hits) + self.pool.num_reactivated(hits) > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        blocks = hits + self.pool.allocate(n - len(hits))
        self.incoming[migration_id] = Request(
            request_id=request_id,
            prompt_token_ids=[],
            sampling=SamplingParams(),
            arrival_s=now_s,
            all_token_ids=list(token_ids[: n * bs]),
            sampler=xxhash.xxh3_64(),
            status=RequestStatus.MIGRATING_IN,
            block_ids=blocks,
            block_hashes=hashes,
            num_stored_blocks=len(hits),
        )
        return len(hits)

    def extend_migration(self, migration_id: str, token_ids: list[int]) -> bool:
        """More whole blocks (a later pre-copy stage's), after those already reserved; False without room (the
        reservation is kept: the sender aborts it)."""
        ph = self.incoming.get(migration_id)
        if ph is None:
            return False
        n = len(token_ids) // self.block_size
        if n > self.pool.num_free_blocks:
            return False
        ph.block_ids.extend(self.pool.allocate(n))
        ph.all_token_ids.extend(token_ids[: n * self.block_size])
        return True

    def cancel_migration(self, migration_id: str) -> bool:
        """Free an incoming migration's reserved blocks; False if none are reserved under that id."""
        ph = self.incoming.pop(migration_id, None)
        if ph is None:
            return False
        self.pool.free(ph.block_ids)
        ph.block_ids = []
        return True

    def commit_migration(
        self, migration_id: str | None, incoming: MigratingRequest, now_s: float, arrival_s: float | None = None
    ) -> Request:
        """Make a request another engine suspended a request of this one. With ``migration_id`` its KV for
        ``num_computed_tokens`` tokens is in the blocks reserved under it (plus, allocated now, those of the final
        stage): it runs, decoding next step. Without, it waits and recomputes: queued by ``arrival_s`` (its arrival
        on its first engine, on this scheduler's clock) as ``add_request_by_arrival`` queues a waiting request
        another engine handed over (the simulator's move of a waiting or preempted request does the same), or,
        with no arrival known, at the front of the queue as a preempted request. Raises ``EngineRequestError`` for
        a request this engine cannot serve and ``MigrationRoomError`` without room (the reservation, if any, is
        freed in both cases)."""
        outputs = incoming.output_token_ids
        request = GenerateRequest(
            incoming.request_id, incoming.all_token_ids, incoming.sampling, num_output_tokens=len(outputs)
        )
        ph = self.incoming.pop(migration_id, None) if migration_id is not None else None
        try:
            if migration_id is not None and ph is None:
                raise EngineRequestError(f"migration {migration_id!r} has no blocks reserved here (freed by timeout?)")
            self.validate(request)
            req = self._new_request(request, now_s)
            req.num_cached_tokens = incoming.num_cached_tokens
            if ph is not None:
                computed = incoming.num_computed_tokens
                have = len(ph.all_token_ids)
                if req.all_token_ids[:have] != ph.all_token_ids or computed < have or computed >= req.num_tokens:
                    raise EngineRequestError(
                        f"migration {migration_id!r}: the committed request does not match the blocks sent "
                        f"({have} tokens sent, {computed} computed of {req.num_tokens})"
                    )
                need = -(-computed // self.block_size) - len(ph.block_ids)
                if need > self.pool.num_free_blocks:
                    raise MigrationRoomError(f"no room for the last {need} blocks of migration {migration_id!r}")
                req.block_ids = ph.block_ids + self.pool.allocate(max(0, need))
                ph.block_ids = []
                req.block_hashes = ph.block_hashes
                req.num_stored_blocks = ph.num_stored_blocks
                req.num_computed_tokens = computed
                if self.pool.enable_caching:
                    self._store_full_blocks(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            elif arrival_s is not None:
                self._queue_by_arrival(req, arrival_s)  # recompute, first come first served
            else:
                req.status = RequestStatus.PREEMPTED  # recompute: first in line, as a preempted request is
                self.waiting.appendleft(req)
        except BaseException:
            if ph is not None and ph.block_ids:
                self.pool.free(ph.block_ids)
            raise
        self.requests[req.request_id] = req
        return req

    # --- the step ---------------------------------------------------------------------------------------------------

    def step(self, now_s: float) -> StepOutput:
        """Schedule one batch, account its modelled time, and apply its results (tokens, stored blocks, finishes)."""
        scheduled, preempted, num_prefill, num_decode, kv_tokens = self._schedule()
        ms = self._model.step_ms(num_prefill, num_decode, kv_tokens)  # perf_model.step_time_ms, without 2 lookups
        loaded, self._host_loading = self._host_loading, 0
        if loaded:
            cfg = self.config
            ms += 1e3 * transfer_time_s(
                loaded,
                bytes_per_block=cfg.kv_bytes_per_block,
                bandwidth_gbps=cfg.host_kv_bandwidth_gbps,
                latency_ms=cfg.host_kv_latency_ms,
            )
        num_scheduled: dict[str, int] = {}
        chunks: dict[str, TokenChunk] = {}
        any_finished = False
        caching = self._caching
        bs = self.block_size
        for req, n in scheduled:
            rid = req.request_id
            num_scheduled[rid] = n
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if caching and computed // bs > req.num_stored_blocks:  # _store_full_blocks' own test, not to call it
                self._store_full_blocks(req)
            if computed < len(req.all_token_ids):
                continue  # a prefill chunk that does not reach the end of the prompt samples nothing
            chunk = chunks[rid] = self._sample(req)
            if chunk.finish_reason is not None:
                del self.requests[rid]
                self._release(req, chunk.finish_reason)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self.num_steps += 1
        self._last_batch_size = len(scheduled)
        self._last_decode_kv_tokens = kv_tokens
        self._last_prefill_tokens = num_prefill
        # Positional, in StepOutput's field order: keywords cost ~0.7 us more, once a step.
        return StepOutput(
            now_s,
            ms / 1000.0,  # step_time_s
            num_scheduled,
            num_prefill,
            num_decode,
            kv_tokens,
            chunks,
            [r.request_id for r in preempted] if preempted else [],
            loaded,  # num_host_loaded_blocks
        )

    def _schedule(self) -> tuple[list[tuple[Request, int]], list[Request], int, int, int]:
        """The step's batch ((request, tokens to compute) in scheduling order), the requests it preempted, and its
        shape for the step-time model: prefill tokens, decoding sequences, and the KV tokens those attend to (each
        its whole context, the token being computed included)."""
        budget = self._budget
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        num_prefill = num_decode = kv_tokens = 0
        running = self.running  # the list itself: preemption pops from it
        waiting = self.waiting
        # vLLM's long_prefill_token_threshold: a prefill's share of one step, unless it is the only request (then
        # nobody waits on the step and it may use the whole budget, as vLLM 0.32's scheduler does).
        cap = self._long_prefill_cap if len(running) + len(waiting) > 1 else 0

        # 1. Running requests, oldest first.
        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens = len(req.all_token_ids)
            computed = req.num_computed_tokens
            n = num_tokens - computed
            if 0 < cap < n:
                n = cap
            if n > budget:
                n = budget
            # Blocks already holding the new tokens (a decode between block boundaries) are what _allocate_slots
            # would find, without its call.
            if -(-(computed + n) // bs) > len(req.block_ids):
                got_blocks = True
                while not self._allocate_slots(req, n):
                    victim = running.pop()  # the newest running request
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        got_blocks = False
                        break
                if not got_blocks:
                    break  # req was the newest: everything before it is scheduled, nothing after it runs
            scheduled.append((req, n))
            if computed == num_tokens - 1 and req.output_token_ids:  # req.is_decoding
                num_decode += 1
                kv_tokens += num_tokens
            else:
                num_prefill += n
            budget -= n
            i += 1

        # 2. Waiting requests, first come first served; none in a step that had to preempt (memory is short).
        if preempted or not waiting:
            return scheduled, preempted, num_prefill, num_decode, kv_tokens
        cfg = self.config
        holding = self._in_batch_caching
        i = 0  # the queue position looked at: past the requests held this step (only with in-batch prefix caching)
        while i < len(waiting) and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[i]
            hits = self._prefix_hits(req)
            loaded = self._host_hits(req, len(hits))
            if holding and self._next_block_in_flight(req, len(hits) + loaded):
                i += 1  # held: it keeps its place, and the requests behind it are looked at
                continue
            n = req.num_tokens - (len(hits) + loaded) * bs
            if 0 < cap < n:
                n = cap
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            # The loaded blocks need device blocks as much as computed ones do.
            if not self._allocate_slots(req, n + loaded * bs, hits):
                break
            if i:
                del waiting[i]
            else:
                waiting.popleft()
            req.num_computed_tokens = (len(hits) + loaded) * bs
            req.num_stored_blocks = len(hits)
            if loaded:
                self._host_loading += loaded
            if req.num_cached_tokens is None:
                req.num_cached_tokens = req.num_computed_tokens
                req.num_host_cached_tokens = loaded * bs
            req.status = RequestStatus.RUNNING
            running.append(req)
            scheduled.append((req, n))
            num_prefill += n
            budget -= n
        return scheduled, preempted, num_prefill, num_decode, kv_tokens

    def _prefix_hits(self, req: Request) -> list[int]:
        if not self.pool.enable_caching:
            return []
        # At most num_tokens - 1 tokens from the cache: the last one must be computed to get logits.
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._ensure_hashes(req, max_blocks)
        return self.pool.lookup_prefix(req.block_hashes[:max_blocks])

    def _next_block_in_flight(self, req: Request, num_held: int) -> bool:
        """In-batch prefix caching: whether a running request is computing ``req``'s block ``num_held`` (the first
        one past its cache hits) and has not stored it yet. Chained hashes make equal hashes at one position an equal
        prefix, so that request stores exactly the block ``req`` would compute. Only running requests hold one back:
        a preempted, aborted or suspended holder leaves the queue's requests free to be admitted."""
        if num_held >= (req.num_tokens - 1) // self.block_size:
            return False  # nothing more could come from the cache (the last token is always computed)
        h = req.block_hashes[num_held]
        for r in self.running:
            hashes = r.block_hashes
            if r.num_stored_blocks <= num_held < len(hashes) and hashes[num_held] == h:
                return True
        return False

    def _host_hits(self, req: Request, device_hits: int) -> int:
        """Blocks of ``req``'s prefix the host tier holds right after the ``device_hits`` the device cache holds (at
        most all but the last token's, like device hits)."""
        if not self.pool.num_host_blocks:
            return 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.host_lookup(req.block_hashes[:max_blocks], device_hits)

    def _allocate_slots(self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens (after ``hit_blocks``); False, changing nothing,
        if the pool cannot."""
        hits = hit_blocks or []
        bs = self.block_size
        num_computed = req.num_computed_tokens + len(hits) * bs
        num_blocks_needed = -(-(num_computed + num_new_tokens) // bs)
        num_new_blocks = max(0, num_blocks_needed - len(req.block_ids) - len(hits))
        # Touching a cached free hit block takes it out of the free count too.
        if num_new_blocks + self.pool.num_reactivated(hits) > self.pool.num_free_blocks:
            return False
        if hits:
            self.pool.touch(hits)
            req.block_ids.extend(hits)
        if num_new_blocks:
            req.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def _preempt(self, req: Request) -> None:
        self._host_touch(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_stored_blocks = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _host_touch(self, req: Request) -> None:
        if self.pool.num_host_blocks and req.num_stored_blocks:
            self.pool.host_touch(req.block_hashes[: req.num_stored_blocks])

    def _release(self, req: Request, reason: FinishReason) -> None:
        self._host_touch(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def _ensure_hashes(self, req: Request, num_blocks: int) -> None:
        have = len(req.block_hashes)
        if have >= num_blocks:
            return
        bs = self.block_size
        parent = req.block_hashes[-1] if have else None
        req.block_hashes.extend(block_hashes(req.all_token_ids[have * bs : num_blocks * bs], bs, parent))

    def _store_full_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.block_size
        start = req.num_stored_blocks
        if full <= start:
            return
        self._ensure_hashes(req, full)
        parent = req.block_hashes[start - 1] if start else None
        self.pool.cache_full_blocks(req.block_ids[start:full], req.block_hashes[start:full], parent)
        req.num_stored_blocks = full

    def _sample(self, req: Request, token: int | None = None) -> TokenChunk:
        """Sample ``req``'s next token (or take ``token``, sampled by the engine that prefilled it remotely)."""
        sampler = req.sampler
        if token is None:
            token = sampler.intdigest() % self._vocab_size
        sampler.update(token.to_bytes(4, "little"))
        req.all_token_ids.append(token)
        outputs = req.output_token_ids
        outputs.append(token)
        position = len(outputs) - 1
        if position:
            # Positional, in TokenChunk's field order (token_ids, finish_reason): one per output token.
            return TokenChunk([token], self._stop_reason(req, token), 0, 0, position, 0)
        return TokenChunk(
            token_ids=[token],
            finish_reason=self._stop_reason(req, token),
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            position=0,
            num_host_cached_tokens=req.num_host_cached_tokens,
        )

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        # vLLM V1's check_stop order: length caps first, then EOS, then stop token ids.
        sp = req.sampling
        if len(req.all_token_ids) >= self._max_model_len or len(req.output_token_ids) >= sp.max_tokens:
            return FinishReason.LENGTH
        if not sp.ignore_eos and token == self._eos_token_id:
            return FinishReason.STOP
        if sp.stop_token_ids and token in sp.stop_token_ids:
            return FinishReason.STOP
        return None

    # --- observation ------------------------------------------------------------------------------------------------

    def take_kv_events(self) -> list[KvEvent]:
        return self.pool.take_events()

    def kv_state(self) -> KvStateSnapshot:
        return self.pool.kv_state()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def snapshot(self, now_s: float) -> LoadSnapshot:
        pool = self.pool
        active = pool.num_active_blocks
        total = pool.num_blocks
        if not self.requests:
            # Idle: nothing waits or runs, and the last step's batch says nothing about an engine that has gone idle.
            # Positional, in LoadSnapshot's field order: an idle engine reports every 100 ms as a busy one does.
            return LoadSnapshot(now_s, active / total, total, active, 0, 0, 0, self.num_preemptions, 0, 0, 0)
        pending = 0
        for r in self.waiting:
            pending += len(r.all_token_ids) - r.num_computed_tokens
        for r in self.running:
            pending += r.num_pending_prefill_tokens
        return LoadSnapshot(
            now_s,
            active / total,  # kv_usage (pool.usage)
            total,
            active,
            # num_running: a reserved request decodes here next; a suspended one still holds its blocks here.
            len(self.running) + len(self.remote) + len(self.suspended),
            len(self.waiting),
            pending,  # num_waiting_prefill_tokens
            self.num_preemptions,
            self._last_batch_size,
            self._last_decode_kv_tokens,  # num_kv_tokens
            self._last_prefill_tokens,  # num_prefill_tokens
        )
