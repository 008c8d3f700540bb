"""The messages every kvmesh process exchanges about generation: requests, streamed tokens, load and KV-cache events.

Token ids in, token ids out: tokenisation belongs to the frontend. Every type is a plain dataclass that round-trips
through ``to_dict``/``from_dict`` (msgpack-friendly: only ints, floats, strings, lists, dicts, None), so a worker can
put them on the wire without knowing its engine, and a router, planner or rescheduler can read them without importing
an engine.

This module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """What the frontend asks of the sampler. Defaults follow the OpenAI API."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def to_dict(self) -> dict[str, Any]:
        # Spelled out: dataclasses.asdict walks the fields and deep-copies recursively, ~10x the cost, once per
        # request on the frontend's hot path. tests/unit/protocol checks that every field is here.
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass(slots=True)
class GenerateRequest:
    """One generation: prompt token ids, sampling parameters and a request id unique in the fleet.

    ``num_output_tokens`` > 0 makes it a *continuation* (a request re-issued on another worker after its worker
    died, or moved there by recompute): the last ``num_output_tokens`` of ``token_ids`` are outputs an earlier
    holder already produced and the client already has. The engine counts them against ``max_tokens`` and the stop
    conditions, continues the sampler's state after them (a seeded sampler resumes as if it had drawn them), and
    numbers its output from that position (``TokenChunk.position``)."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    num_output_tokens: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        """The client's prompt: ``token_ids`` without the outputs of a continuation."""
        n = self.num_output_tokens
        return self.token_ids[: len(self.token_ids) - n] if n else self.token_ids

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "sampling": self.sampling.to_dict(),
        }
        if self.num_output_tokens:
            d["num_output_tokens"] = self.num_output_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerateRequest:
        token_ids = list(d["token_ids"])
        n = int(d.get("num_output_tokens") or 0)
        if not 0 <= n < max(1, len(token_ids)):
            raise ValueError(f"num_output_tokens {n} must lie in [0, {len(token_ids)}) (the prompt cannot be empty)")
        return cls(
            request_id=d["request_id"],
            token_ids=token_ids,
            sampling=SamplingParams.from_dict(d.get("sampling") or {}),
            num_output_tokens=n,
        )


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the client or the worker


@dataclasses.dataclass(slots=True)
class TokenChunk:
    """New output tokens since the previous chunk; the last chunk of a request carries ``finish_reason``.

    ``position`` is the index of ``token_ids[0]`` in the request's whole output (0 for the first token), so a
    reader can splice the chunks of one request coming from several workers (a migrated or re-issued request): a
    chunk below the position it has reached repeats tokens it already has, one above it means tokens were lost."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0  # set on the first chunk
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, set on the first chunk
    position: int = 0
    # of which were loaded from the engine's host-memory tier (KV_MEDIUM_HOST) rather than found on the device
    num_host_cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        # The counters are zero on every chunk but the first: left out then (``from_dict`` and every reader take a
        # missing one as 0), so a streamed token's frame is a 3-key map, not 6: the frontend unpacks one per token.
        d: dict[str, Any] = {
            "token_ids": self.token_ids,
            "finish_reason": None if self.finish_reason is None else str(self.finish_reason),
            "position": self.position,
        }
        if self.num_prompt_tokens:
            d["num_prompt_tokens"] = self.num_prompt_tokens
        if self.num_cached_tokens:
            d["num_cached_tokens"] = self.num_cached_tokens
        if self.num_host_cached_tokens:
            d["num_host_cached_tokens"] = self.num_host_cached_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenChunk:
        fr = d.get("finish_reason")
        return cls(
            token_ids=list(d["token_ids"]),
            finish_reason=None if fr is None else FinishReason(fr),
            num_prompt_tokens=d.get("num_prompt_tokens", 0),
            num_cached_tokens=d.get("num_cached_tokens", 0),
            position=d.get("position", 0),
            num_host_cached_tokens=d.get("num_host_cached_tokens", 0),
        )


@dataclasses.dataclass(slots=True)
class LoadSnapshot:
    """An engine's load at one instant. ``now_s`` is the engine's monotonic clock when it was taken."""

    now_s: float
    kv_usage: float  # active blocks / total blocks, 0..1
    num_total_blocks: int
    num_active_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_prefill_tokens: int  # prompt tokens not yet prefilled, over waiting and partially prefilled requests
    num_preemptions: int  # cumulative since the engine started
    batch_size: int  # sequences in the last step (a TPOT predictor's input)
    num_kv_tokens: int  # tokens attended in the last decode step (a TPOT predictor's input)
    # Prompt tokens computed in the last step (its prefill chunk), None where the engine does not say. With
    # ``batch_size`` and ``num_kv_tokens`` it is the whole shape of the step: a step's time is its decode part plus
    # this chunk's, and the queue (``num_waiting_prefill_tokens``) is what is left after the chunk was taken, so it
    # does not show a step's own chunk (docs/sla-planner.md, "The ITL the tokens see").
    num_prefill_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadSnapshot:
        """From ``to_dict``'s payload; a field with a default may be absent (a worker from before it was added)."""
        fields = dataclasses.fields(cls)
        return cls(**{f.name: d[f.name] for f in fields if f.name in d or f.default is dataclasses.MISSING})


# Where a KV event's blocks live, with vLLM's names for its tiers (``vllm.distributed.kv_events``' ``medium``):
# the device's prefix cache, or a host-memory tier the engine offloads blocks to and loads them back from (vLLM's
# offloading connector, LMCache, Dynamo's KVBM, the Mooncake store). An event without a medium is the device's.
KV_MEDIUM_DEVICE = "GPU"
KV_MEDIUM_HOST = "CPU"


class KvEventKind(enum.StrEnum):
    BLOCK_STORED = "stored"
    BLOCK_REMOVED = "removed"
    ALL_CLEARED = "cleared"


_KV_EVENT_KINDS: dict[str, KvEventKind] = {str(k): k for k in KvEventKind}


@dataclasses.dataclass(slots=True)
class KvEvent:
    """One change to an engine's prefix cache, as a real engine emits it.

    ``event_id`` increases by one per event and per engine, so a subscriber can detect a gap. ``BLOCK_STORED`` carries
    the chained hashes of consecutive full blocks (see ``components.protocol.kv_hashing``), the hash of the block before
    the first one (``parent_hash``, None at the start of a sequence) and the number of tokens per block.

    ``medium`` says which of the engine's caches changed: None or ``KV_MEDIUM_DEVICE`` its device prefix cache,
    ``KV_MEDIUM_HOST`` its host-memory tier. One engine's events of both media share one sequence of ids.
    """

    event_id: int
    kind: KvEventKind
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    parent_hash: int | None = None
    num_tokens_per_block: int = 0
    medium: str | None = None

    @property
    def is_host(self) -> bool:
        return self.medium == KV_MEDIUM_HOST

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "event_id": self.event_id,
            "kind": str(self.kind),
            "block_hashes": self.block_hashes,
            "parent_hash": self.parent_hash,
            "num_tokens_per_block": self.num_tokens_per_block,
        }
        if self.medium is not None:
            d["medium"] = self.medium
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvEvent:
        # A router parses every event of every worker (~7 per request served): the kind through a dict rather than
        # the enum's call, the fields positionally, and a list of hashes (msgpack's) kept as it is, not copied.
        kind = _KV_EVENT_KINDS.get(d["kind"])
        if kind is None:
            kind = KvEventKind(d["kind"])  # raises ValueError, as before
        hashes = d.get("block_hashes")
        return cls(
            d["event_id"],
            kind,
            hashes if type(hashes) is list else list(hashes or ()),
            d.get("parent_hash"),
            d.get("num_tokens_per_block", 0),
            d.get("medium"),
        )


@dataclasses.dataclass(slots=True)
class KvStateSnapshot:
    """Every block an engine's prefix cache holds right now, and the id of the last event already reflected in it.

    A router that saw a gap in event ids replaces its view of this worker with this snapshot, then applies events with
    ``event_id > last_event_id``. ``block_hashes`` are the device's blocks, ``host_block_hashes`` its host-memory
    tier's (empty without one).
    """

    last_event_id: int
    block_size: int
    block_hashes: list[int]
    host_block_hashes: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvStateSnapshot:
        return cls(
            last_event_id=d["last_event_id"],
            block_size=d["block_size"],
            block_hashes=list(d["block_hashes"]),
            host_block_hashes=list(d.get("host_block_hashes") or []),
        )


@dataclasses.dataclass(slots=True)
class RemotePrefillRequest:
    """A prefill queue item (disaggregated serving): prefill ``request`` and deliver the result to the decode worker
    ``decode_instance`` through its ``prefill_result`` endpoint (component ``decode_component``).

    ``deadline_s`` is wall-clock (``time.time()``): after it the decode worker has stopped waiting and prefilled the
    prompt itself, so a prefill worker that pops the item later drops it unprefilled. ``enqueued_s`` is when the
    decode worker pushed it (wall clock), for the queue-wait figures."""

    request: GenerateRequest
    decode_instance: int
    decode_component: str
    deadline_s: float
    enqueued_s: float
    # The decode worker will pull the prompt's KV (its engine's remote_prefill_mode is kv_transfer): the prefill
    # worker's engine keeps the blocks and names them in the result. False: it would never pull them, and kept
    # blocks would wait out their lease for nothing.
    kv_transfer: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request.to_dict(),
            "decode_instance": self.decode_instance,
            "decode_component": self.decode_component,
            "deadline_s": self.deadline_s,
            "enqueued_s": self.enqueued_s,
            "kv_transfer": self.kv_transfer,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemotePrefillRequest:
        return cls(
            request=GenerateRequest.from_dict(d["request"]),
            decode_instance=int(d["decode_instance"]),
            decode_component=str(d["decode_component"]),
            deadline_s=float(d["deadline_s"]),
            enqueued_s=float(d.get("enqueued_s", 0.0)),
            kv_transfer=bool(d.get("kv_transfer", False)),
        )


@dataclasses.dataclass(slots=True)
class RemotePrefillResult:
    """What a prefill worker delivers to the decode worker: the first output token (``token_ids``, one id; more
    never), how many prompt tokens it computed and how many its own prefix cache held, the KV's block count, the
    time the KV transfer took (a simulated engine's modelled transfer), and ``error`` instead of all that when the
    prompt could not be prefilled there (the decode worker then prefills it itself, and reports the engine's own
    error if the prompt is bad).

    ``kv_transfer_params``: where a vLLM decode engine pulls the KV from (vLLM's own hand-off: the prefill engine's
    id and handshake address, its request id, block ids, token count; components/workers/engines/vllm/nixl.py);
    None when the prefill engine kept no KV for a pull. Opaque to everything but the engine that pulls; plain
    msgpack values."""

    request_id: str
    prefill_instance: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_blocks: int = 0
    transfer_s: float = 0.0
    error: str = ""
    kv_transfer_params: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemotePrefillResult:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass(frozen=True, slots=True)
class RequestStatsReport:
    """One frontend's requests for one model over its last report interval (``interval_s`` seconds, ending when it was
    published on ``TOPIC_REQUEST_STATS``; source id: the frontend's). The SLA planner sums every frontend's reports
    over its own interval (``components.fleet.model.RequestWindow``): arrival rate, prompt and output lengths for its
    predictors, observed TTFT and ITL for its correction factors. Counts are of events inside the interval, so a
    long request counts in the interval it arrived (``requests``, ``prompt_tokens``), the one its first token was
    sent (``ttft_*``), those its tokens were sent (``itl_*``) and the one it ended (``finished``, ``output_tokens``).
    The simulator builds the same reports from its requests (components.sim.replay)."""

    model: str
    interval_s: float
    requests: int = 0  # requests admitted (handed to a worker) in the interval
    prompt_tokens: int = 0  # their prompt tokens
    finished: int = 0  # requests that ended in the interval, completed or failed
    failed: int = 0  # of those, ended with an error
    output_tokens: int = 0  # tokens the finished requests generated in all
    ttft_count: int = 0  # first tokens sent in the interval
    ttft_sum_s: float = 0.0  # their times from arrival, summed
    ttft_max_s: float = 0.0
    itl_count: int = 0  # gaps between consecutive tokens of one request, ended in the interval
    itl_sum_s: float = 0.0
    itl_max_s: float = 0.0
    # The prefixes the interval's admitted requests carried, most requests first (hot-prefix replication's input;
    # empty unless the frontend's --request-stats-prefixes is set and its router hashes prompts).
    prefixes: tuple[PrefixCount, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestStatsReport:
        fields = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d and f.name != "prefixes"}
        prefixes = tuple(PrefixCount.from_dict(p) for p in d.get("prefixes") or ())
        return cls(**fields, prefixes=prefixes)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixCount:
    """Requests of one report's interval that began with the same block: ``block_hashes``, the chained hashes
    (``kv_hashing``) of the full blocks they all shared from the start (the first one's, shortened by each later
    one: on the documents shape, the document), and how many such ``requests`` were admitted. The prefix's name is
    its last hash, which names the whole chain."""

    block_hashes: tuple[int, ...]
    requests: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefixCount:
        return cls(tuple(int(h) for h in d["block_hashes"]), int(d["requests"]))


@dataclasses.dataclass(slots=True)
class PrefillQueueReport:
    """One prefill worker's view of its model's prefill queue, published every ``metrics_interval_ms`` on
    ``TOPIC_PREFILL_QUEUE`` (source id: the prefill worker): the queue's ``QueueStats`` plus whether this worker is
    prefilling an item now. The planner scales prefill workers on it; decode workers count the prefill workers
    alive from who reports; frontends export it on ``/metrics``. ``stats_error`` is set (and the counts 0) when the
    worker could not read the queue's state."""

    model: str
    waiting: int
    in_flight: int
    oldest_age_s: float
    pullers: int
    redelivered: int
    busy: bool
    items_done: int = 0  # items this worker acked since it started (delivered, dropped or given up)
    stats_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillQueueReport:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
