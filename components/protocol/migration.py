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

Event-plane topic ``migration_counters`` (``MigrationCountersReport``): a worker's migration counters by direction,
outcome and mode, for frontends to export (``kvmesh_worker_migrations_total``).

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
    # Stop-and-copy through the engine's KV connector (vLLM's NIXL): the request is suspended, the source makes its
    # whole KV pullable, the destination's engine pulls it and computes only the last token. Named as
    # ``RemotePrefillMode.KV_TRANSFER``, the same mechanism for a remotely prefilled prompt.
    KV_TRANSFER = "kv_transfer"
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
      and ``copy``, or (kv_transfer) made pullable (0: the destination recomputes everything, prefix cache
      permitting);
    - ``kv_transfer_params``: kv_transfer only: the source engine's hand-off naming the KV of every token
      (``all_token_ids``) for the destination's engine to pull (vLLM's ``kv_transfer_params``; opaque here). None:
      no KV to pull;
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
    kv_transfer_params: dict[str, Any] | None = None

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
            "kv_transfer_params": self.kv_transfer_params,
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
            kv_transfer_params=None if d.get("kv_transfer_params") is None else dict(d["kv_transfer_params"]),
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
    (``pre_alloc``): leading blocks its own prefix cache already holds, which the source need not send. ``mode``
    (``pre_alloc`` and ``commit``; "" from an older peer): how the destination takes the request, a
    ``MigrationMode`` value: its engine's mode on ``pre_alloc`` (a kv_transfer source facing a recompute destination
    exports nothing), and on ``commit`` the one that ran (``recompute`` where it could not use the hand-off)."""

    ok: bool
    reason: str = ""
    num_cached_blocks: int = 0
    mode: str = ""

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


# ``WorkerStatus.reason`` of a worker that was told to leave (SIGTERM: a planner's scale-down, a person's stop) and
# drains with a healthy engine; any other reason (its engine died, an owner saw it gone) is a failure. The rescheduler
# tells the two apart: a leaving worker's node or unit is healthy and may take its requests (docs/rescheduler.md,
# "Migration-assisted scale-down").
DRAINING_REASON = "draining"


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


@dataclasses.dataclass(frozen=True, slots=True)
class MigrationOutcomeCount:
    """How many migrations of one kind ended one way on a worker: ``direction`` (``out``: it was the source, ``in``:
    the destination), ``outcome`` (a terminal ``MigrationState`` value, or ``refused``: turned away at the cap
    before it began), ``mode`` (the ``MigrationMode`` value that ran for a committed one, the one tried for an
    abort; "" for ``refused``)."""

    direction: str
    outcome: str
    mode: str
    count: int


@dataclasses.dataclass(slots=True)
class MigrationCountersReport:
    """Published on ``migration_counters`` (source id: the worker's instance id) by a worker that runs a migration
    agent: its counters since it started, cumulative (a frontend exports them as Prometheus counters, so a restarted
    worker, a new instance id, starts new series). ``mode``: the worker's own ``migration_mode``.

    ``kv_pull_failures``: kv_transfer migrations this worker took (committed, counted in ``in``/``committed``/
    ``kv_transfer``) whose pull failed, so that its engine computed the request again instead (vLLM's
    ``kv_load_failure_policy=recompute``); ``aborts_forwarded``: aborts sent on to where a request went;
    ``uncertain_commits``: commits that got no answer (the request ended here with a recoverable error)."""

    model: str
    mode: str
    outcomes: list[MigrationOutcomeCount] = dataclasses.field(default_factory=list)
    kv_pull_failures: int = 0
    aborts_forwarded: int = 0
    uncertain_commits: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mode": self.mode,
            "outcomes": [[o.direction, o.outcome, o.mode, o.count] for o in self.outcomes],
            "kv_pull_failures": self.kv_pull_failures,
            "aborts_forwarded": self.aborts_forwarded,
            "uncertain_commits": self.uncertain_commits,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigrationCountersReport:
        """Raises ``KeyError``/``TypeError``/``ValueError`` for a payload that is not one."""
        outcomes = [MigrationOutcomeCount(str(a), str(b), str(c), int(n)) for a, b, c, n in d.get("outcomes") or []]
        return cls(
            model=str(d["model"]),
            mode=str(d.get("mode", "")),
            outcomes=outcomes,
            kv_pull_failures=int(d.get("kv_pull_failures", 0)),
            aborts_forwarded=int(d.get("aborts_forwarded", 0)),
            uncertain_commits=int(d.get("uncertain_commits", 0)),
        )
