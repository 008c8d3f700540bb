"""The load generator's one configuration model (STYLE.md habit 8): the CLI flags of ``kvmesh bench load`` are derived
from it, and other benchmarks build it in Python and call ``run_load(config)``.

Also owns the target check: loads go to loopback addresses only unless ``allow_remote`` is set, so that a typo in
``--url`` cannot point a benchmark at somebody else's service.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from .errors import LoadgenError, RemoteTargetError

TraceFormat = Literal["auto", "mooncake", "azure", "sharegpt"]


class LoadConfig(BaseModel):
    """Load generator: fixed concurrency or a trace replayed on its timestamps, against an OpenAI-compatible URL."""

    url: str = Field(
        default="http://127.0.0.1:8000",
        description="Base URL of the OpenAI-compatible server (a trailing /v1 is accepted); loopback only unless "
        "allow_remote.",
    )
    model: str = Field(description="Model name sent in every request (as listed by GET /v1/models).")
    api_key: str | None = Field(default=None, description="Sent as 'Authorization: Bearer <key>' when set.")
    allow_remote: bool = Field(
        default=False, description="Allow a URL whose host is not a loopback address (127.0.0.0/8, ::1, localhost)."
    )

    # --- What to send ----------------------------------------------------------------------------------------------
    trace: str | None = Field(
        default=None,
        description="Trace or prompt file (Mooncake jsonl, Azure csv, ShareGPT json); none: synthetic token-id "
        "prompts of prompt_tokens.",
    )
    trace_format: TraceFormat = Field(default="auto", description="Format of the trace; auto: sniffed from its start.")
    prompt_tokens: int = Field(
        default=256,
        ge=1,
        description="Length of a synthetic prompt, in tokens (characters of a text prompt: one token each with a "
        "byte-level tokenizer such as tiny-llama's, which the chat template adds a few to).",
    )
    synthetic_prompt: Literal["tokens", "text"] = Field(
        default="tokens",
        description="Synthetic prompts as token ids sent to /v1/completions (no tokeniser work on the server), or "
        "as text in one user message sent to /v1/chat/completions (the server renders its chat template and "
        "tokenises, as for real chat traffic). Text is random lowercase words, a pure function of the seed.",
    )
    shared_prefix_tokens: int = Field(
        default=0,
        ge=0,
        description="Synthetic prompts: the first this many tokens (characters) are one of num_shared_prefixes "
        "prefixes, picked per request at random (seeded), the rest unique, so that a KV-aware router has cached "
        "prefixes to find; 0: every prompt is unique from its first token. At most prompt_tokens.",
    )
    num_shared_prefixes: int = Field(
        default=1, ge=1, description="How many distinct shared prefixes synthetic prompts draw from."
    )
    max_tokens: int = Field(
        default=64, ge=1, description="Output tokens per request where the trace has none (synthetic, ShareGPT)."
    )
    max_input_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Cut token-id prompts to this many tokens, keeping their start so shared prefixes stay shared "
        "(Mooncake's p50 prompt is 6.9k tokens; tiny-llama's context is 2048).",
    )
    max_output_tokens: int | None = Field(default=None, ge=1, description="Cap every request's max_tokens.")
    ignore_eos: bool = Field(
        default=True,
        description="Send ignore_eos=true (a vLLM/kvmesh/Dynamo extension) so each request produces exactly its "
        "max_tokens; --no-ignore-eos for servers that reject unknown fields.",
    )
    extra_body: dict[str, Any] | None = Field(
        default=None,
        description="Fields added to every request's JSON body (a server's extensions, e.g. Dynamo's 'nvext'); the "
        "request's own fields (model, prompt or messages, max_tokens, stream) win.",
    )
    vocab_size: int = Field(
        default=256,
        ge=2,
        description="Token-id prompts draw ids from [0, vocab_size). 256 = tiny-llama's byte tokens (its ids 256-258 "
        "are BOS/EOS/PAD, up to 384 reserved) and a valid id range in every larger vocabulary.",
    )
    seed: int = Field(default=0, description="Seeds every synthetic prompt and Mooncake block: same seed, same bytes.")
    program_id_block: int | None = Field(
        default=None,
        ge=0,
        description="Mooncake rows: send the OpenAI 'user' field as 'conv-<hash_ids[k]>', naming the row's "
        "conversation so program-affinity routers (Autellix) can follow it; rows with fewer blocks send none. 1 for "
        "the conversation trace, whose block 0 (a system prompt) every row shares. Unset: no 'user' field.",
    )

    shard_count: int = Field(
        default=1,
        ge=1,
        description="Several load generators splitting one workload: this one sends only the rows whose index modulo "
        "shard_count is shard_index (same seed everywhere: the same shared prefixes, disjoint prompts); "
        "max_requests counts this shard's.",
    )
    shard_index: int = Field(default=0, ge=0, description="This load generator's shard, below shard_count.")

    # --- When to send ----------------------------------------------------------------------------------------------
    concurrency: int | None = Field(
        default=None,
        ge=1,
        description="Closed loop: this many requests in flight, each sent when one finishes (trace timestamps are "
        "then ignored). Unset: a trace with timestamps is replayed open-loop on them, anything else runs at 16.",
    )
    time_scale: float = Field(
        default=1.0, gt=0, description="Multiplies the trace's inter-arrival times: 0.1 replays 10x faster."
    )
    start_offset_s: float = Field(
        default=0.0, ge=0, description="Start the replay at this trace time, in seconds of the trace (before scaling)."
    )
    max_requests: int = Field(default=1000, ge=1, description="Send at most this many requests.")
    duration_s: float = Field(default=600.0, gt=0, description="Send no request after this many seconds of wall time.")
    drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="After the last send, requests still in flight get this long, then are cancelled and counted "
        "as cancelled; a run takes at most duration_s + drain_timeout_s.",
    )
    request_timeout_s: float = Field(
        default=300.0, gt=0, description="A request that has not finished after this long counts as a timeout."
    )

    # --- What to measure -------------------------------------------------------------------------------------------
    pids: list[int] = Field(
        default_factory=list, description="Processes whose CPU time (utime+stime from /proc) is reported per request."
    )
    pids_include_children: bool = Field(
        default=False,
        description="Add each pid's live descendants and its reaped children (cutime+cstime) to its CPU time.",
    )
    progress: bool = Field(default=True, description="Progress bar on stderr (only when stderr is a terminal).")

    @model_validator(mode="after")
    def _shard_fits(self) -> LoadConfig:
        if self.shard_index >= self.shard_count:
            raise ValueError(f"shard_index ({self.shard_index}) must be below shard_count ({self.shard_count})")
        return self

    @model_validator(mode="after")
    def _prefix_fits(self) -> LoadConfig:
        if self.shared_prefix_tokens > self.prompt_tokens:
            raise ValueError(
                f"shared_prefix_tokens ({self.shared_prefix_tokens}) cannot exceed prompt_tokens ({self.prompt_tokens})"
            )
        return self

    @field_validator("duration_s", "time_scale", "request_timeout_s", "drain_timeout_s", "start_offset_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        # pydantic accepts "inf"; every bound of a run must be finite (bounded count AND wall time, always).
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v


DEFAULT_CONCURRENCY = 16


def is_loopback_host(host: str) -> bool:
    """True for 'localhost', any 127.0.0.0/8 address, ::1 and their IPv4-mapped forms. No DNS lookup: a name that
    merely resolves to a loopback address is not trusted, because what it resolves to can change."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def base_url(url: str, allow_remote: bool) -> str:
    """The URL without a trailing '/' or '/v1', after checking its scheme and, unless allowed, its host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadgenError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    if not allow_remote and not is_loopback_host(parts.hostname):
        raise RemoteTargetError(url, parts.hostname)
    base = url.rstrip("/")
    return base.removesuffix("/v1")
