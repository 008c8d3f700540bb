"""The migration wire contract: what workers say to each other (and a rescheduler or the frontend to them) to move a
running request, and what a worker announces about whether it takes new requests.

Endpoints (``endpoints.py``) served by every worker that can move requests, on the same instance id as its
``generate``:

- ``migrate`` (``MigrateRequest`` -> one ``MigrationReport`` per selected request, then the stream ends): move
  requests from this worker to ``dst_instance_id``. Which requests: ``request_ids`` when given, else the pure
  selection (components/migration/policies/selection.py) with ``select_rule``/``select_value``/``select_order``;
  the rule and order are strings here (readable names or the seed's abbreviations, ``NUM_REQ``, ``LCR``, ...),
  parsed by the migration package, so that this module imports nothing of kvmesh.
- ``migrate_in`` (``MigrateInMessage`` -> one ``MigrateInReply``): the destination's side of one migration, one
  message per step: ``pre_alloc`` (reserve blocks for the KV the source is about to send), ``copy`` (blocks have
  landed), ``commit`` (the request itself, ``MigratingRequest``: from now on it runs here and answers the client on
  its response address), ``abort`` (the source gave up: free what was reserved).
- ``abort`` (``AbortRequest`` -> one ``AbortReply``): end a request wherever it runs now; a worker that moved it
  forwards the abort to the worker it moved it to.

Event-plane topic ``worker_status`` (``WorkerStatus``): a worker whose engine died, or that drains, says it takes
no new requests; routers and the rescheduler stop choosing it at once, long before its registration goes.

Every type round-trips through ``to_dict``/``from_dict`` (msgpack-friendly). Imports: the standard library and this
package's ``messages``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from components.protocol.messages import SamplingParams


class MigrationMode(enum.StrEnum):
    """How a worker's engine moves a running request (``WorkerMetadata.migration_mode``)."""

    LIVE = "live"  # the KV blocks are copied while the request keeps decoding; a short final stage suspends it
    RECOMPUTE = "recompute"  # no KV is copied: the destination computes prompt + outputs again (prefix cache hits)


class MigrateInOp(enum.StrEnum):
    PRE_ALLOC = "pre_alloc"
    COPY = "copy"
    COMMIT = "commit"
    ABORT = "abort"


@dataclasses.dataclass(slots=True)
class MigrateRequest:
    """Ask a worker to move requests to ``dst_instance_id`` (a worker of component ``dst_component``; "" = the same
    component as the asked worker). ``trigger`` names the policy that decided it (logs and counters). ``mode`` ""
    lets the engine use its best (``live`` where it can export KV); ``recompute`` forces recompute (benchmarks)."""

    dst_instance_id: int
    dst_component: str = ""
    select_rule: str = "num_requests"
    select_value: float = 1.0
    select_order: str = "shortest_running"
    trigger: str = ""
    request_ids: list[str] = dataclasses.field(default_factory=list)
    mode: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigrateRequest:
        kwargs = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kwargs["dst_instance_id"] = int(kwargs["dst_instance_id"])
        if "request_ids" in kwargs:
            kwargs["request_ids"] = [str(r) for r in kwargs["request_ids"]]
        if "select_value" in kwargs:
            kwargs["select_value"] = float(kwargs["select_value"])
        return cls(**kwargs)


@dataclasses.dataclass(slots=True)
class MigrationReport:
    """The outcome of one migration, as the source worker saw it. ``state`` is a ``MigrationState`` value
    (``committed``, ``aborted_by_source``, ``aborted_by_destination``); ``downtime_s`` is how long the request was
    suspended (final stage: suspend to commit), ``duration_s`` the whole migration."""

    request_id: str
    state: str
    reason: str = ""
    mode: str = ""
    src_instance_id: int = 0
    dst_instance_id: int = 0
    num_stages: int = 0
    num_blocks_copied: int = 0
    num_blocks_cached: int = 0  # leading blocks the destination's prefix cache held: not copied
    position: int = 0  # output tokens the request had produced when it moved
    downtime_s: float = 0.0
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigrationReport:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass(slots=True)
class MigratingRequest:
    """One request as it crosses to another worker (``migrate_in``'s ``commit``): everything its new engine needs to
    continue it exactly as the old one would have, and where its tokens go.

    - ``prompt_token_ids``, ``output_token_ids``: the client's prompt and every output token produced so far (the
      client has them all: ``position == len(output_token_ids)``);
    - ``sampling``: the client's parameters, stop conditions included; the sampler's state is the seed plus the
      number of tokens already drawn (``len(output_token_ids)``), which engines with a seeded sampler replay;
    - ``num_computed_tokens``: leading tokens whose KV the source copied into the blocks reserved by ``pre_alloc``
      and ``copy`` (0: the destination recomputes everything, prefix cache permitting);
    - ``reply``: the client's response address, as the runtime wrote it (opaque here), and ``next_seq``, the
      frame number the destination's first frame takes on it, so the client's one stream continues;
    - ``arrival_s``: the request's arrival on its first worker (wall clock), kept so that first-come orders still
      see it as old; ``num_cached_tokens``: the prefix-cache hit of its first placement (usage reporting)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    num_computed_tokens: int = 0
    reply: dict[str, Any] = dataclasses.field(default_factory=dict)
    next_seq: int = 0
    arrival_s: float = 0.0
    num_cached_tokens: int = 0

    @property
    def position(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": self.output_token_ids,
            "sampling": self.sampling.to_dict(),
            "num_computed_tokens": self.num_computed_tokens,
            "reply": self.reply,
            "next_seq": self.next_seq,
            "arrival_s": self.arrival_s,
            "num_cached_tokens": self.num_cached_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigratingRequest:
        return cls(
            request_id=str(d["request_id"]),
            prompt_token_ids=list(d["prompt_token_ids"]),
            output_token_ids=list(d["output_token_ids"]),
            sampling=SamplingParams.from_dict(d.get("sampling") or {}),
            num_computed_tokens=int(d.get("num_computed_tokens", 0)),
            reply=dict(d.get("reply") or {}),
            next_seq=int(d.get("next_seq", 0)),
            arrival_s=float(d.get("arrival_s", 0.0)),
            num_cached_tokens=int(d.get("num_cached_tokens", 0)),
        )


@dataclasses.dataclass(slots=True)
class MigrateInMessage:
    """One step of one migration, source -> destination (module docstring). ``migration_id`` names the migration
    (unique per source); ``src_instance_id`` and ``src_subject`` say who the source is, so the destination's
    watchdog can tell whether it is still alive. ``pre_alloc`` and ``copy`` carry the token ids of the blocks they
    concern, blocks ``first_block .. first_block + len(token_ids) // block_size`` of the request (whole blocks; the
    destination hashes them for its prefix cache); ``commit`` carries the request."""

    op: MigrateInOp
    migration_id: str
    request_id: str
    src_instance_id: int = 0
    src_subject: str = ""
    first_block: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    request: MigratingRequest | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": str(self.op),
            "migration_id": self.migration_id,
            "request_id": self.request_id,
            "src_instance_id": self.src_instance_id,
            "src_subject": self.src_subject,
            "first_block": self.first_block,
            "token_ids": self.token_ids,
            "request": None if self.request is None else self.request.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigrateInMessage:
        req = d.get("request")
        return cls(
            op=MigrateInOp(d["op"]),
            migration_id=str(d["migration_id"]),
            request_id=str(d["request_id"]),
            src_instance_id=int(d.get("src_instance_id", 0)),
            src_subject=str(d.get("src_subject", "")),
            first_block=int(d.get("first_block", 0)),
            token_ids=list(d.get("token_ids") or []),
            request=None if req is None else MigratingRequest.from_dict(req),
        )


@dataclasses.dataclass(slots=True)
class MigrateInReply:
    """The destination's answer to one ``MigrateInMessage``: ``ok``, or why not (``reason``). ``num_cached_blocks``
    (``pre_alloc``): leading blocks its own prefix cache already holds, which the source need not send."""

    ok: bool
    reason: str = ""
    num_cached_blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigrateInReply:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass(slots=True)
class AbortRequest:
    """End ``request_id`` wherever it runs now (``hops`` counts forwards, bounded against a forwarding cycle)."""

    request_id: str
    reason: str = ""
    hops: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AbortRequest:
        return cls(str(d["request_id"]), str(d.get("reason", "")), int(d.get("hops", 0)))


@dataclasses.dataclass(slots=True)
class AbortReply:
    """``aborted``: the request was found and ended; ``instance_id``: the worker it ran on (after any forwards)."""

    aborted: bool
    instance_id: int = 0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AbortReply:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass(slots=True)
class WorkerStatus:
    """Published on ``worker_status`` (source id: the worker's instance id) when a worker stops taking new requests
    (``schedulable`` False: its engine died, it drains) and every ``metrics_interval_ms`` after that while it is
    still registered, so a router that starts later learns it too. ``num_requests``: requests it still serves."""

    schedulable: bool
    reason: str = ""
    num_requests: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerStatus:
        return cls(bool(d["schedulable"]), str(d.get("reason", "")), int(d.get("num_requests", 0)))
