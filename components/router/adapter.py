"""``Router``: the stateful side of routing. It keeps, per model, the live workers, what they report and what has been
sent to each, builds ``WorkerSnapshot``s and asks a pure policy (``components.router.policies``, chosen by readable
name) where to go.

Membership, load reports, staleness and schedulability are the fleet view's (``components.fleet``): the router
reads a ``FleetState`` (its own, or one it is given: the frontend shares its live view's) and keeps no copy of them.
It keeps only what is its own: its routing decisions (requests in flight per worker, its own and its replicas'), the
KV index, and the per-model tables its policies read, rebuilt from the fleet's listener calls
(``fleet_members``/``fleet_load``/``fleet_schedulability``) as changes arrive, never on the decision's path.

Fed by its owner, with no I/O of its own (``feed.RouterFeed`` and ``components.fleet.live.LiveFleet`` do the I/O:
event plane, discovery, resyncs):

- membership: ``set_workers(model, [(instance id, metadata)])`` from discovery, handed to the fleet
  (``FleetState.set_members``). A worker in no model any more is forgotten: its KV blocks leave the index and the
  fleet drops its metrics; its events that still arrive (a draining worker) are ignored until it registers again;
- load: ``apply_load(instance id, LoadSnapshot, now_s)`` from the ``load_metrics`` topic, into the fleet, which
  learns each worker's publishing interval from the arrivals, so a worker whose reports stop is presumed dead after
  a few of its own intervals (``components.fleet.rules``, the one staleness rule; the policies skip it);
- KV cache: ``apply_kv_events`` / ``begin_resync`` / ``load_kv_state`` into a ``KvIndex``. ``apply_kv_events``
  returns False on an event-id gap: the owner fetches the worker's ``kv_state`` snapshot. With ``router_kv_events``
  off (approximate mode) the index is predicted from the router's own assignments instead, for ``router_ttl_s``.
  With events on, ``on_routed`` records the blocks the chosen worker will compute as *provisional* there (and sends
  them in its sync message, so every replica records them too) until the worker's events confirm them or
  ``router_provisional_ttl_s`` passes: a request sharing the prefix that comes before those events, to this router
  or another replica, sees the holder (without them, the holder's queued prefill made the ``kv`` cost send it
  elsewhere);
- requests: ``on_routed`` -> ``on_first_token`` -> ``on_finished``, so load is exact between metric updates: a
  request adds its prompt's blocks (decode load) and its uncached prompt tokens (prefill load) when it is routed,
  the prefill part leaves at its first token, the rest at its end;
- replicas: every assignment change is offered to ``sync_listeners`` (as a ``protocol`` sync message) and
  ``apply_sync`` applies other replicas' messages, so several routers count each other's requests;
- schedulability (the fleet's one rule): ``set_schedulable`` from the ``worker_status`` topic (a worker whose engine
  died or that drains says so before its registration goes), ``mark_down`` from the owner (the frontend saw the
  worker's process gone: no responders, a stream cut). Either keeps ``select`` off the worker at once; a worker
  marked down is taken back only by a load report received ``DOWN_HOLD_S`` after the mark (a dead process sends
  none; a report already in flight when it died arrives sooner), or when it registers again; one that left is
  forgotten with the rest;
- ``on_migrated``: a running request moved to another worker; its load goes with it.

Snapshots are kept ready: every method that changes a worker's counts or report (``apply_load``, ``on_routed``,
``on_first_token``, ``on_finished``, ``on_migrated``, ``apply_sync``, ``drop_replica``) rebuilds that worker's
``WorkerSnapshot`` and its place in the ``WorkerTable`` before it returns (``_flush``), off the decision's path: at
256 workers and 1,000 requests/s that is ~5 snapshots per decision (the workers a request was routed to, got its first
token on and finished on, and ~2.5 load reports), ~3-4 us each, which ``select`` rebuilt itself before (main at
64fcae8); ``select`` still flushes what another path left changed (``set_workers``). The CPU time is the same, spent
where the event arrives rather than where the next request waits; what a snapshot derives from the report and from
the step-time model is kept in ``_Load`` until its inputs change.

Hot path: ``select`` searches the KV index once (KV policies only) with the prompt's
lazily computed hashes (``prepare`` wraps them in a ``PromptHashes``: only the blocks the search reads are hashed)
and the model's workers as a group, so a prefix every one of them caches comes back as one number
(``RouteRequest.common_overlap_blocks``) rather than one entry per worker. ``prepare`` backs the hashes with the
router's memo of prompt-chunk hashes (``HashMemo``, ``RouterConfig.prompt_hash_cache_blocks``), so a prefix it has
hashed before (a conversation's history) is not chained again. At 256 workers, 1M indexed blocks and 8k-token prompts
(``kvmesh bench router``'s workload, 2-core EPYC dev VM under a load of ~7) a ``kv`` decision takes ~150 us at p50
(thread CPU): ~60 us hashing (packing the 8k token ids, ~37 us of it; the memo's chunks; one chained), ~35-40 us
searching the index, ~25 us in the policy (``kv.lowest_ttft`` reads a handful of workers) and ~15 us preparing and
copying the request (docs/router.md, "Cost"). The packing is gone from the decision where the prompt comes packed
(``RouteRequest.token_ids`` an ``array('I')``, ``kv_hashing.packed_prompt``), as the frontend hands it over: it
packs the tokenizer's ids once per request (``Prepared.packed_prompt``) and the hashing reads that buffer.

Single-threaded: every method is called from the event loop, none awaits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import random
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from components.fleet.model import LoadRecord
from components.fleet.rules import DOWN_HOLD_S, LOAD_REPORTS, StaleRule
from components.fleet.state import FleetState
from components.protocol.kv_hashing import HASH_SCHEME_VERSION, HashMemo, PromptHashes
from components.protocol.messages import KV_MEDIUM_HOST, KvEvent, KvStateSnapshot, LoadSnapshot
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.protocol.migration import WorkerStatus
from components.router.config import RouterConfig
from components.router.errors import NoWorkersError, RouterProtocolError, UnknownPolicyError
from components.router.kv_index import KvIndex
from components.router.policies import ALIASES, POLICIES, canonical_name, common
from components.router.policies.kv import DEFAULT_BLOCK_SIZE
from components.router.protocol import Assignment
from components.router.types import (
    DEFAULT_STEP_TIME,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    StepTime,
    WorkerSnapshot,
    WorkerTable,
)

logger = logging.getLogger(__name__)

SyncListener = Callable[[dict[str, Any]], None]
MembershipListener = Callable[[set[int], set[int]], None]

__all__ = ["DOWN_HOLD_S", "Router", "RouterStats", "make_policy"]  # DOWN_HOLD_S: the fleet's rule, named here too
# A worker's snapshot fields from kv_usage to metrics_stale_after_s, in WorkerSnapshot's order (``_Load.report``):
# kv_usage, num_running, num_waiting, num_waiting_prefill_tokens, metrics_received_s, metrics_interval_s,
# metrics_stale_after_s; and their values before a first report.
_Report = tuple[float | None, int | None, int | None, int | None, float | None, float | None, float]
_NO_REPORT: _Report = (None, None, None, None, None, None, math.inf)
_new_tuple = tuple.__new__
_medium = operator.attrgetter("medium")  # a named tuple from its fields in order, without its Python-level __new__

# ``select`` and ``prepare`` copy the request on every decision. ``dataclasses.replace`` walks the fields in Python
# and calls the keyword __init__ (~4 us for RouteRequest's 12 fields, ~10 us on a busy core); reading every field
# with one attrgetter and calling __init__ positionally does the same in ~1.5 us.
_REQUEST_FIELDS = [f.name for f in dataclasses.fields(RouteRequest)]
assert all(f.init for f in dataclasses.fields(RouteRequest)), "_with_fields passes every field to __init__"
_request_values = operator.attrgetter(*_REQUEST_FIELDS)
_AT_BLOCK_SIZE = _REQUEST_FIELDS.index("block_size")
_AT_BLOCK_HASHES = _REQUEST_FIELDS.index("block_hashes")
_AT_OVERLAP_BLOCKS = _REQUEST_FIELDS.index("overlap_blocks")
_AT_COMMON_OVERLAP = _REQUEST_FIELDS.index("common_overlap_blocks")
_AT_HOST_OVERLAP_BLOCKS = _REQUEST_FIELDS.index("host_overlap_blocks")
_AT_COMMON_HOST_OVERLAP = _REQUEST_FIELDS.index("common_host_overlap_blocks")


def _with_fields(request: RouteRequest, i: int, a: Any, j: int, b: Any) -> RouteRequest:
    """``request`` with fields number ``i`` and ``j`` set to ``a`` and ``b``: ``dataclasses.replace``, faster."""
    values = list(_request_values(request))
    values[i] = a
    values[j] = b
    return RouteRequest(*values)


def _with_overlaps(
    request: RouteRequest, overlaps: dict[int, int], floor: int, host: dict[int, int], host_floor: int
) -> RouteRequest:
    """``request`` with its device and host-tier overlaps."""
    values = list(_request_values(request))
    values[_AT_OVERLAP_BLOCKS] = overlaps
    values[_AT_COMMON_OVERLAP] = floor
    values[_AT_HOST_OVERLAP_BLOCKS] = host
    values[_AT_COMMON_HOST_OVERLAP] = host_floor
    return RouteRequest(*values)


# At most this many provisional blocks per routed request (``on_routed``), the first ones past what the worker holds:
# 256 blocks (4k tokens at 16 a block), ~2.3 KB of msgpack in the sync message (9 bytes a 64-bit hash) and ~60 bytes
# a block in each replica's index while they wait for the worker's events. A longer prompt's later blocks are
# seen at its worker's BLOCK_STORED like any other, and the leading ones are what a prompt sharing its prefix reads.
MAX_PROVISIONAL_BLOCKS = 256


def _to_compute(hashes: Sequence[int] | None, held: int) -> tuple[int | None, list[int]]:
    """(the parent of the first block to compute, the hashes of the blocks to compute): the prompt's full blocks past
    the ``held`` leading ones its worker holds, at most ``MAX_PROVISIONAL_BLOCKS``."""
    if hashes is None:
        return None, []
    end = min(len(hashes), held + MAX_PROVISIONAL_BLOCKS)
    if end <= held:
        return None, []
    if isinstance(hashes, PromptHashes):
        hs = hashes.ensure(end)  # an array('Q'): its slice's tolist() gives ints in C
        return (hs[held - 1] if held else None), hs[held:end].tolist()
    return (int(hashes[held - 1]) if held else None), [int(h) for h in hashes[held:end]]


def make_policy(config: RouterConfig | str) -> RoutingPolicy[Any]:
    name = config if isinstance(config, str) else config.router_policy
    factory = POLICIES.get(canonical_name(name))
    if factory is None:
        raise UnknownPolicyError(name, [*POLICIES, *ALIASES])
    return factory(config if isinstance(config, RouterConfig) else RouterConfig(router_policy=name))


class _Load:
    """One worker's counters (from assignments, local and remote), and the fleet's record of its last load report
    (``record``: the fleet's own object, not a copy; set by ``set_report`` from the fleet's listener call).

    Also what ``Router._snapshot`` derives from them, kept until its inputs change (a snapshot is rebuilt at every
    change of the worker, ~5 times per decision at 256 workers, see ``Router._flush``): ``report``, the snapshot
    fields that come from the record, and the two step-time rates for the ``rates_at`` (StepTime, requests, prompt
    tokens) they were computed at. A load report or a first token leaves the rates as they were; only
    ``on_routed``/``on_finished`` move them.
    """

    __slots__ = (
        "active_blocks",
        "active_prefill_tokens",
        "active_prompt_tokens",
        "active_requests",
        "decode_step_ms",
        "prefill_ms_per_token",
        "rates_at",
        "record",
        "report",
        "step_residual_ms",
    )

    def __init__(self) -> None:
        self.active_requests = 0
        self.active_prompt_tokens = 0
        self.active_prefill_tokens = 0
        self.active_blocks = 0
        self.record: LoadRecord | None = None
        self.report: _Report = _NO_REPORT
        self.rates_at: tuple[StepTime, int, int] | None = None
        self.prefill_ms_per_token = 0.0
        self.decode_step_ms = 0.0
        self.step_residual_ms = 0.0

    def idle(self) -> bool:
        return self.active_requests == 0 and self.record is None

    def set_report(self, record: LoadRecord | None) -> None:
        self.record = record
        if record is None:
            self.report = _NO_REPORT
        else:
            m = record.snapshot
            self.report = (
                m.kv_usage,
                m.num_running,
                m.num_waiting,
                m.num_waiting_prefill_tokens,
                record.received_s,
                record.interval_s,
                record.stale_at_s,
            )


@dataclasses.dataclass(slots=True)
class _ModelState:
    metadata: dict[int, Mapping[str, Any]]
    block_size: int
    policy_state: Any
    workers: WorkerTable = dataclasses.field(default_factory=lambda: WorkerTable(()))
    position: dict[int, int] = dataclasses.field(default_factory=dict)
    # The KV index bits of the model's workers (0: one has none yet) and the index's bits_version they were read at;
    # the same in the host-tier index.
    kv_group: int = 0
    kv_group_version: int = -1
    host_group: int = 0
    host_group_version: int = -1


@dataclasses.dataclass(slots=True)
class RouterStats:
    num_decisions: int = 0
    num_prompt_blocks: int = 0  # full prompt blocks of the requests placed (KV policies)
    num_cached_blocks: int = 0  # of which the chosen worker held (the router's predicted prefix-cache hits)
    num_host_cached_blocks: int = 0  # and of the rest, those its host-memory tier held (predicted loads)
    num_resyncs_requested: int = 0
    num_sync_messages: int = 0


def _block_size(metadata: Iterable[Mapping[str, Any]]) -> int:
    """The block size most of the model's workers announce (they should all agree); vLLM's 16 if none does."""
    sizes = Counter(WorkerMetadata.from_dict(m).block_size for m in metadata)
    for size, _ in sizes.most_common():
        if isinstance(size, int) and size > 0:
            if len(sizes) > 1:
                logger.warning("workers announce different block sizes %s; hashing prompts with %d", dict(sizes), size)
            return size
    return DEFAULT_BLOCK_SIZE


class Router:
    def __init__(
        self,
        config: RouterConfig | str | None = None,
        *,
        rng: random.Random | None = None,
        replica_id: int | None = None,
        fleet: FleetState | None = None,
    ) -> None:
        """``fleet``: the fleet view to read (shared with its live feed, or with a simulator); None: a new one,
        with ``config``'s staleness numbers (``metrics_stale_intervals``, ``metrics_stale_min_s``)."""
        if config is None:
            config = RouterConfig()
        self.policy = make_policy(config)
        if isinstance(config, str):
            config = RouterConfig(router_policy=config)
        self.config = config
        self.rng = rng if rng is not None else random.Random(config.router_seed)
        # Identifies this router's messages on the sync topic; the standalone router uses its instance id.
        self.replica_id = replica_id if replica_id is not None else secrets.randbits(63)
        # The workers' host-memory tiers, made at the first event of that medium (``apply_kv_events``).
        self.host_index: KvIndex | None = None
        self.uses_kv = self.policy.uses_kv
        self.approximate = self.uses_kv and not config.router_kv_events
        # KV events on: the blocks a routed request's worker will compute count as held until its events confirm them
        # (``KvIndex.record_routed``; ``router_provisional_ttl_s``).
        self.provisional = self.uses_kv and not self.approximate and config.router_provisional_ttl_s > 0
        ttl_s = config.router_ttl_s if self.approximate else config.router_provisional_ttl_s
        self.index = KvIndex(approx_ttl_s=ttl_s)
        self.stats = RouterStats()
        self.sync_listeners: list[SyncListener] = []
        self.membership_listeners: list[MembershipListener] = []
        # The per-model tables the policies read (derived from the fleet's members and this router's bookkeeping),
        # and which of those models each worker is in.
        self._models: dict[str, _ModelState] = {}
        self._member_of: dict[int, set[str]] = {}
        self._loads: dict[int, _Load] = {}
        self._dirty: set[int] = set()
        self._inflight: dict[str, Assignment] = {}
        self._remote: dict[int, dict[str, Assignment]] = {}
        self._remote_seen: dict[int, float] = {}
        # Workers announcing another KV hash scheme (``kv_hash_scheme`` in their metadata): their events could
        # never match this router's prompt hashes, so they are not indexed.
        self._foreign_hashes: set[int] = set()
        self._step_time: dict[int, StepTime] = {}  # instance id -> its announced step-time model, parsed
        # Block size -> the hashes of recently seen prompt chunks (``prepare``); one per block size a model uses.
        self._hash_memos: dict[int, HashMemo] = {}
        if fleet is None:
            rule = StaleRule(
                intervals=config.metrics_stale_intervals,
                floor_s=config.metrics_stale_min_s,
                first_report_s=LOAD_REPORTS.first_report_s,
                smoothing=LOAD_REPORTS.smoothing,
            )
            fleet = FleetState(rule)
        self.fleet = fleet
        # The fleet's unschedulable workers (its own frozenset, replaced at each change), for select's hot path.
        self._blocked: frozenset[int] = fleet.blocked
        fleet.add_listener(self)
        for iid, record in fleet.loads().items():  # a shared fleet that already knows workers
            self._load(iid).set_report(record)
        for model in fleet.models():
            self.fleet_members(model, set(fleet.members(model)), set())

    # --- membership -------------------------------------------------------------------------------------------------

    def set_workers(self, model: str, workers: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        """Replace the set of workers that serve ``model`` ((instance id, metadata) pairs); empty removes the model.
        Handed to the fleet (``FleetState.set_members``), whose listener call rebuilds this router's table.

        Counts of requests still in flight on a worker that left are kept until those requests finish, so a worker
        that re-registers under the same id is not seen as idle while it still serves them.
        """
        self.fleet.set_members(model, workers)

    # --- the fleet's listener calls (components.fleet.state.FleetListener) ------------------------------------------

    def fleet_members(self, model: str, joined: set[int], left: set[int]) -> None:
        """``model``'s workers changed in the fleet: rebuild its table from the fleet's members (prefill workers
        left out: clients' requests never go to them)."""
        fleet = self.fleet
        meta: dict[int, Mapping[str, Any]] = {}
        for iid, md in fleet.members(model).items():
            reg = fleet.registration(iid)
            if reg is None or reg.role != WorkerRole.PREFILL:
                meta[iid] = md
        old = self._models.get(model)
        for iid, md in meta.items():
            self._step_time[iid] = StepTime.from_mapping(md.get("step_time"))
        if not meta:
            self._models.pop(model, None)
        else:
            policy_state = old.policy_state if old is not None else self.policy.initial_state()
            state = _ModelState(meta, _block_size(meta.values()), policy_state)
            state.workers = WorkerTable(self._snapshot(iid, md) for iid, md in sorted(meta.items()))
            state.position = {w.instance_id: i for i, w in enumerate(state.workers)}
            self._models[model] = state
        added: set[int] = set()
        removed: set[int] = set()
        for iid in old.metadata if old is not None else ():
            if iid not in meta:
                models = self._member_of.get(iid)
                if models is not None:
                    models.discard(model)
                    if not models:
                        del self._member_of[iid]
                        removed.add(iid)
        for iid, md in meta.items():
            announced = WorkerMetadata.from_dict(md).kv_hash_scheme
            scheme = HASH_SCHEME_VERSION if announced is None else announced
            if scheme != HASH_SCHEME_VERSION and iid not in self._foreign_hashes:
                logger.warning(
                    "worker %x hashes KV blocks with scheme %r, this router with %d: its KV events are ignored "
                    "(upgrade the fleet to one kvmesh version)",
                    iid,
                    scheme,
                    HASH_SCHEME_VERSION,
                )
                self._foreign_hashes.add(iid)
                self.index.remove_worker(iid)
                if self.host_index is not None:
                    self.host_index.remove_worker(iid)
            models = self._member_of.get(iid)
            if models is None:
                self._member_of[iid] = {model}
                added.add(iid)
            else:
                models.add(model)
        for iid in removed:
            self._forget(iid)
        if added or removed:
            logger.info(
                "model %s: %d workers (joined: %s; left: %s)",
                model,
                len(meta),
                ", ".join(f"{i:x}" for i in sorted(added)) or "-",
                ", ".join(f"{i:x}" for i in sorted(removed)) or "-",
            )
            for cb in self.membership_listeners:
                cb(added, removed)

    def fleet_load(self, instance_id: int, record: LoadRecord | None) -> None:
        """A worker's load record changed in the fleet (None: it left; its report is dropped)."""
        if record is None:
            load = self._loads.get(instance_id)
            if load is not None:
                load.set_report(None)
                if load.idle() and instance_id not in self._member_of:
                    del self._loads[instance_id]
                self._dirty.add(instance_id)
            return
        load = self._loads.get(instance_id)
        if load is None:
            load = self._loads[instance_id] = _Load()
        load.set_report(record)
        if self._dirty:
            self._dirty.add(instance_id)
            self._flush()
        else:  # what _flush does with this one worker dirty, without the set (a load report: ~1 per 100 ms a worker)
            self._refresh(instance_id)

    def fleet_schedulability(self, instance_id: int) -> None:
        self._blocked = self.fleet.blocked

    def _forget(self, iid: int) -> None:
        """What the router itself keeps of a worker that left: its KV blocks, its parsed step-time model."""
        self.index.remove_worker(iid)
        if self.host_index is not None:
            self.host_index.remove_worker(iid)
        self._step_time.pop(iid, None)
        self._foreign_hashes.discard(iid)
        load = self._loads.get(iid)
        if load is not None and load.idle():
            del self._loads[iid]

    def models(self) -> list[str]:
        return sorted(self._models)

    def is_member(self, instance_id: int) -> bool:
        return instance_id in self._member_of

    def members(self) -> list[int]:
        return sorted(self._member_of)

    def worker_metadata(self) -> dict[str, dict[int, Mapping[str, Any]]]:
        """Each model's workers and the metadata they registered with (a copy, for ``/metrics``'s worker info)."""
        return {model: dict(state.metadata) for model, state in self._models.items()}

    def workers(self, model: str) -> list[WorkerSnapshot]:
        """The snapshots a policy would see for ``model`` right now."""
        state = self._models.get(model)
        if state is None:
            return []
        self._flush()
        return list(state.workers)

    def routable(self, model: str, now_s: float) -> list[int]:
        """Workers of ``model`` a policy may choose at ``now_s`` (``common.candidates``: the stale ones skipped, and
        those unschedulable or marked down)."""
        workers = self.workers(model)
        cands, _ = common.candidates(RouteRequest((), model, now_s, excluded_instance_ids=self._blocked), workers)
        return [w.instance_id for w in cands]

    # --- schedulability ---------------------------------------------------------------------------------------------

    def set_schedulable(self, instance_id: int, schedulable: bool, reason: str = "") -> None:
        """A worker says whether it takes new requests (``WorkerStatus``); False keeps ``select`` off it. Into the
        fleet, whose rule decides."""
        self.fleet.apply_status(instance_id, WorkerStatus(schedulable, reason))

    def mark_down(self, instance_id: int, now_s: float, reason: str = "") -> bool:
        """The owner saw the worker's process gone: keep ``select`` off it (class docstring). True when newly
        marked. Into the fleet (``FleetState.mark_down``)."""
        return self.fleet.mark_down(instance_id, now_s, reason)

    def down_since(self, instance_id: int) -> float | None:
        """When the owner marked the worker down (its ``now_s``), None if it is not marked."""
        return self.fleet.down_since(instance_id)

    def is_schedulable(self, instance_id: int) -> bool:
        """Whether ``select`` may choose it: not blocked (``unschedulable``), and not a worker that left."""
        return self.fleet.is_schedulable(instance_id)

    def unschedulable(self) -> dict[int, str]:
        """Workers ``select`` avoids now and why (``worker_status``'s reason, or "down")."""
        return self.fleet.unschedulable()

    # --- snapshots --------------------------------------------------------------------------------------------------

    def _snapshot(self, iid: int, metadata: Mapping[str, Any]) -> WorkerSnapshot:
        load = self._loads.get(iid)
        step = self._step_time.get(iid, DEFAULT_STEP_TIME)
        if load is None:
            return WorkerSnapshot(
                iid,
                metadata,
                prefill_ms_per_token=step.prefill_ms_per_prompt_token(0, 0),
                decode_step_ms=step.decode_ms(1, 0),
                host_load_ms_per_token=step.host_load_ms_per_token,
                step_residual_ms=step.step_residual_ms(),
            )
        seqs = load.active_requests
        kv_tokens = load.active_prompt_tokens
        at = (step, seqs, kv_tokens)
        if load.rates_at != at:
            load.rates_at = at
            load.prefill_ms_per_token = step.prefill_ms_per_prompt_token(seqs, kv_tokens)
            load.decode_step_ms = step.decode_ms(seqs + 1, kv_tokens + kv_tokens // max(1, seqs))
            load.step_residual_ms = step.step_residual_ms()
        report = load.report
        prefill = load.active_prefill_tokens
        queued = prefill
        waiting = report[3]  # num_waiting_prefill_tokens: other routers' requests are queued there too
        if waiting is not None and waiting > queued:
            queued = waiting
        # The fields in WorkerSnapshot's order, made with tuple.__new__ (its own __new__ is a Python call of 18
        # arguments: ~0.45 us against ~0.25; keywords cost ~0.7 us more; ~5 snapshots a decision, one a load report);
        # the order is checked by tests/unit/router/test_router_adapter.py.
        return _new_tuple(
            WorkerSnapshot,
            (
                iid,
                metadata,
                seqs,
                kv_tokens,
                prefill,
                load.active_blocks,
                *report,
                queued,
                load.prefill_ms_per_token,
                load.decode_step_ms,
                step.host_load_ms_per_token,
                load.step_residual_ms,
            ),
        )

    def _flush(self) -> None:
        """Rebuild the snapshots of the workers that changed, and (KV policies) re-sort their queued waits."""
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        for iid in dirty:
            self._refresh(iid)

    def _refresh(self, iid: int) -> None:
        """Rebuild worker ``iid``'s snapshot in the table of each model it serves."""
        for model in self._member_of.get(iid, ()):
            state = self._models[model]
            state.workers.replace(state.position[iid], self._snapshot(iid, state.metadata[iid]))
            if self.uses_kv:
                state.workers.settle()

    def _load(self, iid: int) -> _Load:
        load = self._loads.get(iid)
        if load is None:
            load = self._loads[iid] = _Load()
        return load

    # --- placement --------------------------------------------------------------------------------------------------

    def prepare(self, request: RouteRequest) -> RouteRequest:
        """The request with its prompt's block hashes, for KV-aware policies (others: unchanged). Call it once per
        request and reuse the result for retries. The hashes are lazy (``PromptHashes``): ``select`` computes only
        as many as the KV index search reads (all 512 of an 8k-token prompt cost ~75 us). A prompt given packed
        (``kv_hashing.packed_prompt``) is hashed from its buffer, without packing its ints again (~38 us for 8k);
        a list is packed as the hashing reads it, to the same hashes."""
        if not self.uses_kv or request.block_hashes is not None:
            return request
        state = self._models.get(request.model)
        bs = state.block_size if state is not None else DEFAULT_BLOCK_SIZE
        memo = self._hash_memos.get(bs)
        if memo is None:
            memo = self._hash_memos[bs] = HashMemo(bs, self.config.prompt_hash_cache_blocks)
        return _with_fields(request, _AT_BLOCK_SIZE, bs, _AT_BLOCK_HASHES, PromptHashes(request.token_ids, bs, memo))

    def hash_memo(self, block_size: int) -> HashMemo | None:
        """The memo of prompt-chunk hashes for ``block_size`` (``prepare``); None before a prompt of that size."""
        return self._hash_memos.get(block_size)

    def select(self, request: RouteRequest) -> RouteDecision:
        """Ask the policy; raise ``NoWorkersError`` when it places the request nowhere."""
        state = self._models.get(request.model)
        if state is None:
            raise NoWorkersError(request.model, f"no workers serve model {request.model!r}")
        if self._dirty:
            self._flush()
        blocked = self._blocked
        if blocked and not blocked <= request.excluded_instance_ids:
            request = dataclasses.replace(request, excluded_instance_ids=request.excluded_instance_ids | blocked)
        if self.uses_kv:
            if request.block_hashes is None:
                request = self.prepare(request)
            if self.approximate or self.provisional:
                self.index.expire(request.now_s)
            assert request.block_hashes is not None
            index = self.index
            if state.kv_group_version != index.bits_version:
                state.kv_group = index.bits_of(state.metadata)
                state.kv_group_version = index.bits_version
            overlaps, floor = index.overlaps_with_floor(request.block_hashes, state.kv_group)
            host = self.host_index
            if host is not None:
                if state.host_group_version != host.bits_version:
                    state.host_group = host.bits_of(state.metadata)
                    state.host_group_version = host.bits_version
                host_overlaps, host_floor = host.overlaps_with_floor(request.block_hashes, state.host_group)
                if host_overlaps or host_floor:
                    request = _with_overlaps(request, overlaps, floor, host_overlaps, host_floor)
                elif overlaps or floor:
                    request = _with_fields(request, _AT_OVERLAP_BLOCKS, overlaps, _AT_COMMON_OVERLAP, floor)
            elif overlaps or floor:
                request = _with_fields(request, _AT_OVERLAP_BLOCKS, overlaps, _AT_COMMON_OVERLAP, floor)
        decision, state.policy_state = self.policy.select(request, state.workers, state.policy_state, self.rng)
        if decision.instance_id is None:
            raise NoWorkersError(request.model, decision.reason)
        self.stats.num_decisions += 1
        if request.block_hashes is not None:
            self.stats.num_prompt_blocks += len(request.block_hashes)
            self.stats.num_cached_blocks += decision.overlap_blocks
            self.stats.num_host_cached_blocks += decision.host_overlap_blocks
        return decision

    def end_program(self, model: str, program_id: str) -> bool:
        """Forget a program's worker assignment (affinity policies); False if the policy keeps none or the model is
        unknown."""
        state = self._models.get(model)
        end = getattr(self.policy, "end_program", None)
        if state is None or end is None:
            return False
        state.policy_state = end(state.policy_state, program_id)
        return True

    def policy_state(self, model: str) -> Any:
        """The policy's state for ``model`` (e.g. Autellix's program table and statistics); None if unknown."""
        state = self._models.get(model)
        return None if state is None else state.policy_state

    # --- bookkeeping of requests ------------------------------------------------------------------------------------

    def _add(self, a: Assignment) -> None:
        load = self._load(a.instance_id)
        load.active_requests += 1
        load.active_prompt_tokens += a.prompt_tokens
        load.active_blocks += a.blocks
        if not a.first_token_seen:
            load.active_prefill_tokens += a.prefill_tokens
        self._dirty.add(a.instance_id)

    def _sub(self, a: Assignment) -> None:
        load = self._loads.get(a.instance_id)
        if load is None:
            return
        load.active_requests -= 1
        load.active_prompt_tokens -= a.prompt_tokens
        load.active_blocks -= a.blocks
        if not a.first_token_seen:
            load.active_prefill_tokens -= a.prefill_tokens
        if load.idle() and a.instance_id not in self._member_of:
            del self._loads[a.instance_id]
        self._dirty.add(a.instance_id)

    def _first_token(self, a: Assignment) -> None:
        if a.first_token_seen:
            return
        a.first_token_seen = True
        load = self._loads.get(a.instance_id)
        if load is not None:
            load.active_prefill_tokens -= a.prefill_tokens
            self._dirty.add(a.instance_id)

    def _emit(self, msg: dict[str, Any]) -> None:
        for cb in self.sync_listeners:
            cb(msg)

    def on_routed(self, request_id: str, decision: RouteDecision, request: RouteRequest) -> None:
        """``request`` was sent to ``decision.instance_id`` (the request as given to ``select``, or prepared)."""
        assert decision.instance_id is not None
        iid = decision.instance_id
        state = self._models.get(request.model)
        bs = request.block_size or (state.block_size if state is not None else DEFAULT_BLOCK_SIZE)
        n = len(request.token_ids)
        cached = decision.overlap_blocks + decision.host_overlap_blocks
        a = Assignment(request_id, iid, n, max(0, n - cached * bs), -(-n // bs))
        old = self._inflight.pop(request_id, None)
        if old is not None:
            self._sub(old)
        self._inflight[request_id] = a
        self._add(a)
        extra: tuple[str, Any] | None = None
        if self.approximate:
            if request.block_hashes is None:
                request = self.prepare(request)
            hashes = list(request.block_hashes or ())
            self.index.record_routed(iid, hashes, request.now_s)
            extra = ("hashes", hashes)
        elif self.provisional:
            if request.block_hashes is None:
                request = self.prepare(request)
            parent, todo = _to_compute(request.block_hashes, decision.overlap_blocks)
            if todo:
                self.index.record_routed(iid, todo, request.now_s, parent)
                extra = ("pv", [parent, todo])
        if self.sync_listeners:  # the message only for replicas (``to_list`` per request costs ~1 us)
            msg: dict[str, Any] = {"op": "routed", "a": a.to_list()}
            if extra is not None:
                msg[extra[0]] = extra[1]
            self._emit(msg)
        self._flush()  # eagerly: this worker's snapshot, off the next decision's path (class docstring)

    def _table_of(self, request_id: str, first: dict[str, Assignment] | None = None) -> dict[str, Assignment] | None:
        """The table (this router's, or a replica's) that holds ``request_id``, looking in ``first`` first."""
        if first is not None and request_id in first:
            return first
        if request_id in self._inflight:
            return self._inflight
        for table in self._remote.values():
            if request_id in table:
                return table
        return None

    def on_migrated(self, request_id: str, instance_id: int) -> None:
        """A running request now runs on ``instance_id`` (moved by migration): its load leaves the old worker and
        joins the new one (prompt and blocks as routed; its prefill is done). Unknown ids are ignored."""
        old = self._inflight.get(request_id)
        if old is None or old.instance_id == instance_id:
            return
        self._sub(old)
        a = dataclasses.replace(old, instance_id=instance_id, first_token_seen=True)
        self._inflight[request_id] = a
        self._add(a)
        if self.sync_listeners:
            self._emit({"op": "routed", "a": a.to_list()})
        self._flush()

    def on_first_token(self, request_id: str) -> None:
        """The request's first token arrived. It may be another replica's request (a standalone router's caller
        reports to any replica): the report is applied and shared all the same."""
        table = self._table_of(request_id)
        if table is None or table[request_id].first_token_seen:
            return
        self._first_token(table[request_id])
        if self.sync_listeners:
            self._emit({"op": "first_token", "rid": request_id})
        self._flush()

    def on_finished(self, request_id: str) -> None:
        """The request ended on its worker (finished, failed, or cancelled); unknown ids are ignored. Like
        ``on_first_token``, it settles another replica's request too, and that replica hears of it."""
        table = self._table_of(request_id)
        if table is None:
            return
        self._sub(table.pop(request_id))
        if self.sync_listeners:
            self._emit({"op": "finished", "rid": request_id})
        self._flush()

    def provisional_summary(self) -> dict[str, Any]:
        """What became of the provisional blocks so far (``KvIndex.record_routed``): how many were predicted,
        confirmed by the workers' events (and how long that took, ms, over the latest confirmations), expired
        unconfirmed, or ended by a removal, clear, snapshot or departure first."""
        st = self.index.stats
        lat = sorted(st.confirm_latency_s)

        def pct(p: float) -> float | None:
            return round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 1) if lat else None

        return {
            "predicted": st.num_routed,
            "confirmed": st.num_routed_confirmed,
            "expired": st.num_routed_expired,
            "dropped": st.num_routed_dropped,
            "confirm_ms_p50": pct(0.5),
            "confirm_ms_p99": pct(0.99),
            "confirm_ms_max": round(1000 * lat[-1], 1) if lat else None,
        }

    def is_inflight(self, request_id: str) -> bool:
        """Whether this router counts ``request_id`` as in flight (routed here or by a replica)."""
        return self._table_of(request_id) is not None

    def active_requests(self, instance_id: int) -> int:
        load = self._loads.get(instance_id)
        return 0 if load is None else load.active_requests

    def load_view(self) -> dict[str, dict[int, tuple[int, int | None]]]:
        """Per model and worker: the requests in flight there as this router counts them (its own and, with replica
        sync, its replicas'), and the KV blocks its index holds for the worker (None for a policy without KV)."""
        return {
            model: {
                iid: (self.active_requests(iid), self.index.num_blocks(iid) if self.uses_kv else None)
                for iid in state.metadata
            }
            for model, state in self._models.items()
        }

    # --- event plane ------------------------------------------------------------------------------------------------

    def apply_load(self, instance_id: int, snapshot: LoadSnapshot, now_s: float) -> None:
        """A worker's load report arrived at ``now_s`` (the router's monotonic clock): into the fleet, whose listener
        call refreshes the worker's snapshot here."""
        self.fleet.apply_load(instance_id, snapshot, now_s)

    def apply_kv_events(self, instance_id: int, events: list[KvEvent], now_s: float | None = None) -> bool:
        """Apply a batch of a worker's KV events; False: a gap, fetch its ``kv_state`` and call ``load_kv_state``.
        ``now_s``: when it arrived (the clock of ``RouteRequest.now_s``), for how long provisional blocks waited for
        their confirmation (``KvIndex.stats``).

        Events of a host-memory tier (``KvEvent.is_host``) go to ``host_index``, made at the first one; from then on
        it sees every event, so that it counts the ids of the device's too (``KvIndex``'s media)."""
        if instance_id in self._foreign_hashes or self.fleet.has_departed(instance_id):
            return True
        host = self.host_index
        if host is None and KV_MEDIUM_HOST in map(_medium, events):  # a C loop (``any(e.is_host ...)``: a call each)
            host = self.host_index = KvIndex(approx_ttl_s=self.config.router_ttl_s, host=True)
        ok = self.index.apply(instance_id, events, now_s)
        if host is not None:
            ok = host.apply(instance_id, events) and ok
        return ok

    def begin_resync(self, instance_id: int) -> None:
        """A snapshot fetch starts: buffer the worker's events until it arrives."""
        self.stats.num_resyncs_requested += 1
        self.index.mark_stale(instance_id)
        if self.host_index is not None:
            self.host_index.mark_stale(instance_id)

    def load_kv_state(self, instance_id: int, snapshot: KvStateSnapshot) -> bool:
        """Replace the worker's blocks with its snapshot and replay the events buffered since; False when those
        events had a gap of their own (fetch again)."""
        if instance_id in self._foreign_hashes or self.fleet.has_departed(instance_id):
            return True
        if self.host_index is None and snapshot.host_block_hashes:
            self.host_index = KvIndex(approx_ttl_s=self.config.router_ttl_s, host=True)
        self.index.load_snapshot(instance_id, snapshot)
        ok = not self.index.is_stale(instance_id)
        if self.host_index is not None:
            self.host_index.load_snapshot(instance_id, snapshot)
            ok = not self.host_index.is_stale(instance_id) and ok
        return ok

    # --- replicas ---------------------------------------------------------------------------------------------------

    def apply_sync(self, replica_id: int, msg: Mapping[str, Any], now_s: float) -> None:
        """Apply another router's sync message (``protocol`` module docstring). Raises ``RouterProtocolError`` for
        one that does not parse; this router's own messages are ignored."""
        if replica_id == self.replica_id:
            return
        if isinstance(msg, Mapping) and msg.get("op") == "batch":  # several changes in one (RouterFeed gathers them)
            ops = msg.get("ops")
            if not isinstance(ops, list):
                raise RouterProtocolError(f"malformed sync batch from {replica_id:x}: ops is {type(ops).__name__}")
            for op in ops:
                if not isinstance(op, Mapping):
                    raise RouterProtocolError(f"malformed sync batch from {replica_id:x}: an op is {op!r}")
                self.apply_sync(replica_id, op, now_s)
            return
        self.stats.num_sync_messages += 1
        if replica_id not in self._remote_seen:
            logger.info("router replica %x joined", replica_id)
        self._remote_seen[replica_id] = now_s
        table = self._remote.setdefault(replica_id, {})
        try:
            op = msg["op"]
            if op == "routed":
                a = Assignment.from_list(msg["a"])
                old = table.pop(a.request_id, None)
                if old is not None:
                    self._sub(old)
                table[a.request_id] = a
                self._add(a)
                hashes = msg.get("hashes")
                if hashes and self.approximate:
                    self.index.record_routed(a.instance_id, [int(h) for h in hashes], now_s)
                pv = msg.get("pv")
                iid = a.instance_id
                if pv and self.provisional and iid not in self._foreign_hashes and not self.fleet.has_departed(iid):
                    parent, todo = pv
                    self.index.record_routed(
                        iid, [int(h) for h in todo], now_s, None if parent is None else int(parent)
                    )
            elif op in ("first_token", "finished"):
                # Usually the sender's own request; but a replica reports whatever its caller told it, so the request
                # may be this router's or a third one's. Request ids are unique across routers.
                rid = str(msg["rid"])
                holder = self._table_of(rid, first=table)
                if holder is not None:
                    if op == "finished":
                        self._sub(holder.pop(rid))
                    else:
                        self._first_token(holder[rid])
            elif op == "state":
                fresh = [Assignment.from_list(v) for v in msg["inflight"]]
                for old in table.values():
                    self._sub(old)
                table.clear()
                for a in fresh:
                    table[a.request_id] = a
                    self._add(a)
            elif op == "bye":
                self.drop_replica(replica_id)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, RouterProtocolError):
                raise
            raise RouterProtocolError(f"malformed sync message from {replica_id:x}: {e!r}") from None
        finally:
            self._flush()

    def sync_state(self) -> dict[str, Any]:
        """This router's whole in-flight table as a ``state`` sync message."""
        return {"op": "state", "inflight": [a.to_list() for a in self._inflight.values()]}

    def drop_replica(self, replica_id: int) -> None:
        """Forget another router and every assignment it made (it said bye, or fell silent)."""
        table = self._remote.pop(replica_id, None)
        self._remote_seen.pop(replica_id, None)
        if table is None:
            return
        for a in table.values():
            self._sub(a)
        logger.info("router replica %x left; dropped its %d requests in flight", replica_id, len(table))
        self._flush()

    def expire_replicas(self, now_s: float, timeout_s: float) -> list[int]:
        """Drop the replicas not heard from for ``timeout_s``; returns their ids."""
        gone = [r for r, seen in self._remote_seen.items() if now_s - seen > timeout_s]
        for r in gone:
            self.drop_replica(r)
        return gone

    def replicas(self) -> list[int]:
        return sorted(self._remote_seen)
