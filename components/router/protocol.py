"""Names and wire formats of the router on the mesh: the standalone router's endpoints and the replica-sync topic.

Endpoints of ``kvmesh router`` (component ``router`` by default; every replica serves both):

- ``route``: body ``RouteCall.to_dict()``; stream: one ``RouteDecision`` as ``decision_to_dict``. With a
  ``request_id`` the assignment is recorded (and shared with the other replicas) until ``report`` says it finished;
  without one the decision is a dry run. "No worker" is a decision (``instance_id`` None, with its reason), not an
  error.
- ``report``: body ``{"request_id": str, "event": "first_token" | "finished"}`` or
  ``{"event": "program_end", "model": str, "program_id": str}``; stream: one ``{"known": bool}``.

Topic ``router_sync`` (event plane, source id = the router replica's id), payloads (msgpack dicts, ``op`` first):

- ``{"op": "routed", "a": Assignment.to_list(), "hashes": [...]?, "pv": [parent, [...]]?}``: a request was placed.
  ``hashes``, its prompt's block hashes, only from routers in approximate mode, whose KV index is predicted from
  assignments; ``pv``, from routers with KV events on, the blocks its worker will compute (the prompt's full blocks
  past those the worker held, at most ``adapter.MAX_PROVISIONAL_BLOCKS``) and the hash of the held block before them
  (None: from the start), which receivers record as provisional for that worker (``KvIndex.record_routed``);
- ``{"op": "first_token", "rid": str}`` / ``{"op": "finished", "rid": str}``;
- ``{"op": "state", "inflight": [Assignment.to_list(), ...]}``: the replica's whole in-flight table, every
  ``router_sync_interval_s``; receivers replace their view of that replica with it, which heals lost messages and
  teaches a replica that joined late;
- ``{"op": "bye"}``: the replica is shutting down; forget its assignments;
- ``{"op": "batch", "ops": [message, ...]}``: several of the above from one replica, applied in order (routers
  gather the changes of a few milliseconds into one message).

Unknown ops are ignored, so a newer router can add some without breaking older replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from components.router.errors import RouterProtocolError
from components.router.types import DecisionKind, RouteDecision

ENDPOINT_ROUTE = "route"
ENDPOINT_REPORT = "report"
TOPIC_ROUTER_SYNC = "router_sync"

EVENT_FIRST_TOKEN = "first_token"
EVENT_FINISHED = "finished"
EVENT_PROGRAM_END = "program_end"


@dataclasses.dataclass(slots=True)
class Assignment:
    """One request in flight on a worker, as routers count it (and share it with their replicas)."""

    request_id: str
    instance_id: int
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens the worker must compute (its cached prefix excluded)
    blocks: int  # KV blocks the request holds: its prompt rounded up to whole blocks
    first_token_seen: bool = False

    def to_list(self) -> list[Any]:
        return [
            self.request_id,
            self.instance_id,
            self.prompt_tokens,
            self.prefill_tokens,
            self.blocks,
            self.first_token_seen,
        ]

    @classmethod
    def from_list(cls, v: Sequence[Any]) -> Assignment:
        try:
            rid, iid, prompt, prefill, blocks, first = v
            return cls(str(rid), int(iid), int(prompt), int(prefill), int(blocks), bool(first))
        except (TypeError, ValueError) as e:
            raise RouterProtocolError(f"malformed assignment {v!r}: {e}") from None


@dataclasses.dataclass(slots=True, frozen=True)
class RouteCall:
    """The body of a ``route`` call: what the caller knows about the request."""

    model: str
    token_ids: list[int]
    request_id: str | None = None  # set: record the assignment (report its end); None: a dry run
    program_id: str | None = None
    ends_program: bool = False
    pinned_instance_id: int | None = None
    excluded_instance_ids: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RouteCall:
        try:
            pinned = d.get("pinned_instance_id")
            return cls(
                model=str(d["model"]),
                token_ids=[int(t) for t in d["token_ids"]],
                request_id=None if d.get("request_id") is None else str(d["request_id"]),
                program_id=None if d.get("program_id") is None else str(d["program_id"]),
                ends_program=bool(d.get("ends_program", False)),
                pinned_instance_id=None if pinned is None else int(pinned),
                excluded_instance_ids=[int(i) for i in d.get("excluded_instance_ids") or ()],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RouterProtocolError(f"malformed route call: {e!r}") from None


def decision_to_dict(d: RouteDecision) -> dict[str, Any]:
    return {"instance_id": d.instance_id, "reason": d.reason, "overlap_blocks": d.overlap_blocks, "kind": str(d.kind)}


def decision_from_dict(d: Mapping[str, Any]) -> RouteDecision:
    iid = d.get("instance_id")
    try:
        kind = DecisionKind(d.get("kind", DecisionKind.LOAD))
    except ValueError:
        kind = DecisionKind.LOAD  # a kind this version does not know
    return RouteDecision(
        None if iid is None else int(iid), str(d.get("reason", "")), int(d.get("overlap_blocks", 0)), kind
    )
