"""What a routing policy sees and returns: plain dataclasses, no I/O.

A policy is a pure function ``select(request, workers, state, rng) -> (RouteDecision, state)`` over these (STYLE.md
habit 1); ``components.router.adapter.Router`` builds them from discovery, the workers' load metrics and KV events, and
its own bookkeeping of requests in flight. Time comes in as ``RouteRequest.now_s`` and randomness as the
``random.Random`` argument: a policy reads no clock and no global random state.

"Unknown" is a value here, not an exception: a worker that has not reported load metrics yet has ``kv_usage`` etc.
None, and a policy decides what that means (see ``policies/common.py``).

This module imports only the standard library and ``components.perf`` (the step-time model, standard library only).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import math
import random
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar, overload

from components.perf import queueing
from components.perf.model import StepTimeModel


@dataclasses.dataclass(slots=True, frozen=True)
class RouteRequest:
    """One request to place. ``now_s`` is the caller's monotonic clock (a policy never reads one itself).

    ``block_hashes`` (the prompt's chained block hashes, ``components.protocol.kv_hashing``) and ``overlap_blocks`` are
    filled in by the ``Router`` for KV-aware policies: hashes once per request (``Router.prepare``), overlaps at each
    ``select`` from the KV index. ``overlap_blocks`` is a mapping on the request rather than a field of each
    ``WorkerSnapshot`` because it changes with every request: rebuilding 256 snapshots per decision would cost
    ~300 us, more than the whole decision budget (200 us at 256 workers).
    """

    # The prompt: a list of ints, or packed (``kv_hashing.packed_prompt``: an ``array('I')``, as the frontend hands it
    # over), whose buffer the prompt's hashing reads as it is instead of packing 8k int objects (~38 us) per decision.
    token_ids: Sequence[int]
    model: str
    now_s: float
    program_id: str | None = None  # a multi-turn conversation or agent program, for affinity policies
    ends_program: bool = False  # the program's last request: affinity policies forget it once it is placed
    pinned_instance_id: int | None = None  # the caller insists on this worker (a migration, a debugging client)
    excluded_instance_ids: frozenset[int] = frozenset()  # workers already tried for this request (retries)
    block_size: int = 0  # tokens per KV block of the model's workers; 0: not hashed (non-KV policies)
    block_hashes: Sequence[int] | None = None  # chained hashes of the full blocks; None: not computed
    # instance id -> leading blocks of the prompt that worker caches (absent: common_overlap_blocks)
    overlap_blocks: Mapping[int, int] = dataclasses.field(default_factory=dict)
    # leading blocks every worker of the model caches (a shared system prompt): only workers caching more are listed
    # in overlap_blocks, so a decision does not build and read one entry per worker. Read a worker's overlap with
    # ``overlap_of``.
    common_overlap_blocks: int = 0
    # The same two for the workers' host-memory KV tiers (engines that announce one: events with medium host):
    # leading blocks of the prompt each worker's host tier holds. Empty and 0 where no worker announces a tier.
    host_overlap_blocks: Mapping[int, int] = dataclasses.field(default_factory=dict)
    common_host_overlap_blocks: int = 0

    def overlap_of(self, instance_id: int) -> int:
        """Leading blocks of the prompt this worker caches."""
        return self.overlap_blocks.get(instance_id, self.common_overlap_blocks)

    def host_overlap_of(self, instance_id: int) -> int:
        """Leading blocks of the prompt this worker's host-memory tier holds."""
        return self.host_overlap_blocks.get(instance_id, self.common_host_overlap_blocks)

    def host_extra_of(self, instance_id: int) -> int:
        """Blocks past the ones this worker caches that its host-memory tier holds: it loads them, not computes."""
        if not self.host_overlap_blocks and not self.common_host_overlap_blocks:
            return 0
        return max(0, self.host_overlap_of(instance_id) - self.overlap_of(instance_id))


@dataclasses.dataclass(slots=True, frozen=True)
class StepTime(StepTimeModel):
    """How long one step of a worker's engine takes, in ms, as a function of its shape: the model the ``kv`` cost
    predicts times to first token with. The formula, its fields and their defaults (Llama-3-8B on an H100, the mock
    engine's) are ``components.perf.model.StepTimeModel``'s, written once; this adds what only the router asks of it.
    A worker announces its coefficients in its metadata (``step_time``); a worker that announces none gets the
    defaults. Between workers of one model only the ratios matter: a uniform error in scale changes no decision.
    """

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> StepTime:
        """From a worker's ``step_time`` metadata; missing, negative or non-numeric fields keep their defaults (no
        announcement: the one ``DEFAULT_STEP_TIME``, so cached rates keyed by it are shared)."""
        if not d:
            return DEFAULT_STEP_TIME
        parsed = StepTimeModel.from_mapping(d)
        return cls(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed)})

    def step_residual_ms(self) -> float:
        """What a new prompt waits out of the prefill step in progress (``perf.queueing.STEP_RESIDUAL_SHARE`` of its
        fixed cost; ``components.perf.queueing``, the model the SLA planner predicts TTFT with too)."""
        return queueing.step_residual_ms(self)

    def prefill_ms_per_prompt_token(self, decoding_seqs: int, kv_tokens: int) -> float:
        """ms per prompt token while ``decoding_seqs`` sequences decode alongside: each step carries the rest of the
        token budget as prefill and costs that prefill plus the decode. The rate at which a worker works through
        its prefill queue, so its queue's wait is this times the queued tokens (``components.perf.queueing``)."""
        return queueing.prefill_ms_per_prompt_token(self, decoding_seqs, kv_tokens)


DEFAULT_STEP_TIME = StepTime()
_IDLE_PREFILL_MS_PER_TOKEN = DEFAULT_STEP_TIME.prefill_ms_per_prompt_token(0, 0)
_IDLE_DECODE_STEP_MS = DEFAULT_STEP_TIME.decode_ms(1, 0)

# The share of a prefill step's fixed cost (``StepTime.prefill_base_ms``) that a new prompt waits out, on average, on
# a worker with prefill in progress: it cannot join the step already running, and arriving at a random moment of it,
# it waits half of it (``WorkerSnapshot.step_residual_ms``). The per-token rate (``prefill_ms_per_prompt_token``)
# spreads the fixed cost over a full chunk (16.5 ms over 8,192 tokens: 0.002 ms a token), which misses it for the
# queues of a few hundred to a few thousand tokens that a fleet below capacity has: there one step in progress,
# 16.5 ms of fixed cost plus ~15 ms for 1,000 tokens, is most of the wait. 0.5 is the expected residual, not a fitted
# value. Tried on scratch code over ``components.sim.replay`` (docs/router.md): 0.5 and 1.0 both bring ``kv``'s p99 on
# short shared system prompts at 8x scale and 0.6x capacity within 1.1x of round-robin's; 0.35-0.8 keep conversations
# at 8x scale and 1.2x capacity at 140-167 ms p99, and 1.0 (the whole step, as if every arrival came at its start)
# tipped them into recomputing histories (2.4 s). The constant lives in ``components.perf.queueing``, with the
# wait formula the router and the SLA planner share.


def queued_wait_ms(w: WorkerSnapshot) -> float:
    """How long a new prompt waits on worker ``w`` before its own prefill: the queued prefill tokens at the worker's
    rate, plus, while any are queued, the rest of the step in progress (``step_residual_ms``):
    ``components.perf.queueing.queued_wait_ms`` on the rates the router keeps per worker."""
    return queueing.queued_wait_ms(w.queued_prefill_tokens, w.prefill_ms_per_token, w.step_residual_ms)


class WorkerSnapshot(NamedTuple):
    """One worker as the router knows it at ``RouteRequest.now_s``.

    Immutable, and a named tuple rather than a frozen dataclass: the router rebuilds ~5 of them per decision at 256
    workers (the workers that a routed request, a first token, a finish or a load report changed), and a frozen
    dataclass's ``__init__`` (one ``object.__setattr__`` per field) took ~2 us of each, a named tuple ~0.3 us
    (rebuilding 4: ~14 vs ~6 us, thread CPU time on the 2-core dev VM). Reading a field costs about the same.

    Counted by the router from its own assignments (and, with replica sync, its replicas'): exact between metric
    updates, never stale.
    - ``active_requests``: requests routed here and not finished;
    - ``active_prompt_tokens``: their prompt tokens;
    - ``active_prefill_tokens``: prompt tokens still to prefill, of the requests that have no first token yet (the
      cached prefix at routing time is not counted);
    - ``active_blocks``: KV blocks those requests hold (their prompts, rounded up to whole blocks): the "active
      decode blocks" of the kv cost.

    Reported by the worker (``LoadSnapshot`` on the event plane), None until its first report:
    ``kv_usage`` (0..1), ``num_running``, ``num_waiting``, ``num_waiting_prefill_tokens``.
    ``metrics_received_s`` is when the last report arrived (router's clock), ``metrics_interval_s`` the worker's
    observed publishing interval, ``metrics_stale_after_s`` the instant from which the report counts as stale
    (the fleet's one rule, ``components.fleet.rules.stale_at``; ``inf`` while there is no report).

    Derived once per change of the worker (not per decision: a decision may read them for every worker), from its
    ``StepTime`` and the counts above:
    - ``queued_prefill_tokens``: prompt tokens it must compute before a new request's, the larger of this router's
      ``active_prefill_tokens`` and the worker's reported ``num_waiting_prefill_tokens`` (other routers' requests);
    - ``prefill_ms_per_token``: how fast it works through them, given the sequences decoding alongside
      (``StepTime.prefill_ms_per_prompt_token`` at ``active_requests`` sequences over ``active_prompt_tokens``);
    - ``decode_step_ms``: its decode step with one more sequence of the mean context: the inter-token latency a new
      request would see there;
    - ``host_load_ms_per_token``: how long loading a token's KV from its host-memory tier takes (its ``StepTime``);
    - ``step_residual_ms``: what of the step in progress a new prompt waits out while prefill is queued there
      (``perf.queueing.STEP_RESIDUAL_SHARE`` of its ``StepTime.prefill_base_ms``; ``queued_wait_ms``).
    """

    instance_id: int
    metadata: Mapping[str, Any]
    active_requests: int = 0
    active_prompt_tokens: int = 0
    active_prefill_tokens: int = 0
    active_blocks: int = 0
    kv_usage: float | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    num_waiting_prefill_tokens: int | None = None
    metrics_received_s: float | None = None
    metrics_interval_s: float | None = None
    metrics_stale_after_s: float = math.inf
    queued_prefill_tokens: int = 0
    prefill_ms_per_token: float = _IDLE_PREFILL_MS_PER_TOKEN
    decode_step_ms: float = _IDLE_DECODE_STEP_MS
    host_load_ms_per_token: float = DEFAULT_STEP_TIME.host_load_ms_per_token
    step_residual_ms: float = DEFAULT_STEP_TIME.step_residual_ms()

    def has_fresh_metrics(self, now_s: float) -> bool:
        return self.metrics_received_s is not None and now_s < self.metrics_stale_after_s


def _cost_terms(w: WorkerSnapshot) -> tuple[float, float, float, float]:
    """``WorkerTable.cost_terms``'s four numbers for ``w``."""
    return (
        w.prefill_ms_per_token,
        float(w.queued_prefill_tokens),
        w.step_residual_ms if w.queued_prefill_tokens else 0.0,
        w.decode_step_ms,
    )


class WorkerTable(Sequence[WorkerSnapshot]):
    """A model's workers as the router hands them to a policy: their snapshots in ascending ``instance_id``, plus
    what a decision would otherwise walk every snapshot for, kept up to date as the router replaces one snapshot at a
    time (``replace``: ~5 per decision at 256 workers, where a decision reads 256).

    - ``positions``: instance id -> position, a dict (read it, do not modify it);
    - ``none_stale(now_s)``: whether no worker's ``metrics_stale_after_s`` has passed, for ``common.candidates``, in
      O(1) almost always: the table keeps a lower bound of the earliest ``metrics_stale_after_s`` (a report only
      moves a worker's later, so the bound stays one) and finds the exact earliest only when ``now_s`` reaches the
      bound: about once per publishing interval (100 ms), not per decision, as an exact minimum would need (the
      worker holding it is the next to report, so it moves with nearly every report: ~4 us a decision at 256);
    - ``load_range()``: the fewest and most ``active_requests``, for the ``kv`` imbalance test (a count per value,
      and the two ends kept as snapshots are replaced: found again only when the last worker at an end leaves it);
    - ``cost_terms``: per position ``i``, at ``4 * i`` to ``4 * i + 3``, the snapshot's ``prefill_ms_per_token``,
      ``queued_prefill_tokens`` (as a float: the value ``int + float`` converts it to), ``step_residual_ms`` where
      prefill is queued (else 0.0) and ``decode_step_ms``, in one ``array('d')`` (read it, do not modify it): the
      four numbers of the ``kv`` cost side by side, 32 bytes a worker, so that a worker's four are one CPU cache line
      (8 KB at 256 workers). A snapshot's fields are separate float objects of a tuple rebuilt at the worker's last
      change, out of the caches by the time a decision asks (four misses a worker); four arrays of one number each
      (until main at ad3b26b) still cost four lines a worker, ~6 workers a decision (``policies/kv.py``,
      ``lowest_ttft``), where the load reports and KV events between decisions have evicted them;
    - ``by_queued_wait()``: ``(queued_wait_ms, position)`` pairs, ascending, where ``queued_wait_ms`` is how long
      the worker's prefill queue holds a new prompt (``queued_wait_ms(w)``), with
      ``prefill_ms_floor`` and ``decode_ms_floor``, the least ``prefill_ms_per_token`` and ``decode_step_ms`` any
      snapshot of this table has had (they only go down, so they stay lower bounds). A request's ``kv`` cost on a
      worker caching no more than the common prefix is at least ``queued_wait_ms + prefill_ms_floor * tokens +
      decode_weight * decode_ms_floor``, so ``kv`` computes costs in this order and stops where the bound passes
      the best cost found (``policies/kv.py``).

    A plain list of snapshots is a valid ``workers`` argument too (tests build them): a policy reads these only when
    it is given a table, and decides the same either way.
    """

    __slots__ = (
        "_load_hi",
        "_load_lo",
        "_loads",
        "_stale",
        "_stale_lo",
        "_wait",
        "_wait_keys",
        "_wait_order",
        "_wait_stale",
        "_workers",
        "cost_terms",
        "decode_ms_floor",
        "positions",
        "prefill_ms_floor",
    )

    def __init__(self, workers: Iterable[WorkerSnapshot]) -> None:
        ws = self._workers = list(workers)
        self.positions = {w.instance_id: i for i, w in enumerate(ws)}  # instance id -> position (read only)
        self._stale = [w.metrics_stale_after_s for w in ws]
        self._stale_lo = min(self._stale, default=math.inf)  # at most the earliest of _stale
        self._loads: dict[int, int] = {}
        for w in ws:
            self._loads[w.active_requests] = self._loads.get(w.active_requests, 0) + 1
        self._load_lo = self._load_hi = -1  # the ends of ``_loads``'s keys; -1: to be found (``load_range``)
        self._wait = [queued_wait_ms(w) for w in ws]
        # by_queued_wait as two parallel lists (bisecting floats is ~2x faster than bisecting (float, int) pairs)
        self._wait_order = sorted(range(len(ws)), key=self._wait.__getitem__)
        self._wait_keys = [self._wait[i] for i in self._wait_order]
        self._wait_stale: set[int] = set()  # positions replaced since by_queued_wait last sorted them
        self.prefill_ms_floor = min((w.prefill_ms_per_token for w in ws), default=0.0)
        self.decode_ms_floor = min((w.decode_step_ms for w in ws), default=0.0)
        self.cost_terms = array("d", [x for w in ws for x in _cost_terms(w)])

    def __len__(self) -> int:
        return len(self._workers)

    @overload
    def __getitem__(self, i: int) -> WorkerSnapshot: ...

    @overload
    def __getitem__(self, i: slice) -> list[WorkerSnapshot]: ...

    def __getitem__(self, i: int | slice) -> WorkerSnapshot | list[WorkerSnapshot]:
        return self._workers[i]

    def __iter__(self) -> Iterator[WorkerSnapshot]:
        return iter(self._workers)

    def __repr__(self) -> str:
        return f"WorkerTable({self._workers!r})"

    def replace(self, i: int, w: WorkerSnapshot) -> None:
        """Put ``w`` at position ``i`` (the same worker's new snapshot: the order stays by ``instance_id``)."""
        old = self._workers[i]
        self._workers[i] = w
        s = w.metrics_stale_after_s
        self._stale[i] = s
        if s < self._stale_lo:
            self._stale_lo = s
        n, old_n = w.active_requests, old.active_requests
        if n != old_n:
            loads = self._loads
            if loads[old_n] == 1:
                del loads[old_n]
                if old_n == self._load_lo or old_n == self._load_hi:
                    self._load_lo = -1  # an end left: found again when next asked
            else:
                loads[old_n] -= 1
            loads[n] = loads.get(n, 0) + 1
            if self._load_lo >= 0:
                if n < self._load_lo:
                    self._load_lo = n
                elif n > self._load_hi:
                    self._load_hi = n
        self._wait_stale.add(i)  # re-sorted when next asked (``by_queued_wait``: kv only)
        self.cost_terms[4 * i : 4 * i + 4] = array("d", _cost_terms(w))
        if w.prefill_ms_per_token < self.prefill_ms_floor:
            self.prefill_ms_floor = w.prefill_ms_per_token
        if w.decode_step_ms < self.decode_ms_floor:
            self.decode_ms_floor = w.decode_step_ms

    def by_queued_wait(self) -> Iterator[tuple[float, int]]:
        """``(queued_wait_ms, position)`` of every worker, ascending by wait (see the class docstring)."""
        if self._wait_stale:
            self.settle()
        return zip(self._wait_keys, self._wait_order, strict=True)

    def settle(self) -> None:
        """Put the workers replaced since the last call in their places in ``by_queued_wait``'s order (which calls
        it; the router calls it as it replaces them, so that a decision finds the order ready)."""
        if self._wait_stale:
            ws, waits, keys, order = self._workers, self._wait, self._wait_keys, self._wait_order
            for i in self._wait_stale:
                w = ws[i]
                wait = queued_wait_ms(w)
                old = waits[i]
                if wait != old:
                    waits[i] = wait
                    j = order.index(i, bisect.bisect_left(keys, old))  # among equal waits, in C
                    del keys[j], order[j]
                    j = bisect.bisect_right(keys, wait)
                    keys.insert(j, wait)
                    order.insert(j, i)
            self._wait_stale.clear()

    def min_stale_after_s(self) -> float:
        """The earliest instant a worker's metrics go stale (``inf`` with no workers). O(n): ``none_stale`` is the
        hot path's question."""
        lo = self._stale_lo = min(self._stale, default=math.inf)
        return lo

    def none_stale(self, now_s: float) -> bool:
        """Whether every worker's metrics are still fresh at ``now_s`` (``metrics_stale_after_s > now_s``)."""
        if self._stale_lo > now_s:
            return True
        return self.min_stale_after_s() > now_s

    def load_range(self) -> tuple[int, int]:
        """The fewest and the most requests in flight on a worker (0, 0 with no workers)."""
        if self._load_lo < 0:
            loads = self._loads
            if not loads:
                return 0, 0
            self._load_lo, self._load_hi = min(loads), max(loads)
        return self._load_lo, self._load_hi


class DecisionKind(enum.StrEnum):
    """What decided a placement, in a word: a Prometheus label value (``kvmesh_router_decisions_total{kind=...}``),
    where the reason is free text for logs."""

    PINNED = "pinned"  # the caller's pinned worker
    CACHE_HIT = "cache_hit"  # a KV-aware cost chose a worker caching more of the prompt than the others
    LOAD = "load"  # the load (or a cost with no cache advantage anywhere) chose it
    IMBALANCE = "imbalance"  # the imbalance override: least loaded, cached prefixes ignored
    AFFINITY = "affinity"  # the request's program stays on its worker (Autellix locality)
    ROTATION = "rotation"  # round robin's turn, or a uniformly random pick
    NOWHERE = "nowhere"  # no candidate


# A decision's reason: the text, or a function that formats it. Policies pass a function (usually a
# ``functools.partial`` over a module-level formatter, which binds the values when the decision is made): most
# decisions' reasons are never read (the frontend counts ``kind``), and formatting one costs ~1-2 us of a decision's
# budget. ``RouteDecision.reason`` formats it on first read.
Reason = str | Callable[[], str]


def reason_text(reason: Reason) -> str:
    """The text of a ``Reason`` (formats a lazy one)."""
    return reason if isinstance(reason, str) else reason()


def lazy_reason(template: str, *args: object) -> Reason:
    """A ``Reason`` that is ``template.format(*args)`` once read. A callable argument (another lazy reason, a
    ``partial`` that formats a value) is called first, at that time. The arguments are bound now, so the text says
    what held when the decision was made."""
    return functools.partial(_format_reason, template, args)


def _format_reason(template: str, args: tuple[object, ...]) -> str:
    return template.format(*[a() if callable(a) else a for a in args])


@dataclasses.dataclass(slots=True, frozen=True)
class RouteDecision:
    """Where to send a request, and why. ``instance_id`` None means "nowhere": the reason says what was missing.

    ``overlap_blocks`` is how many leading prompt blocks the chosen worker caches (0 for non-KV policies), and
    ``host_overlap_blocks`` how many more, past those, its host-memory tier holds (loaded, not computed): the router
    counts only the rest as prefill work on that worker. ``kind`` says in one word what decided it (``DecisionKind``).

    ``reason`` is free text for logs and errors, formatted only when read: the constructor's second argument
    (``why``) is the text or a function returning it (``Reason``). Equality compares the placement (instance,
    overlap, kind), not the wording of its reason.
    """

    instance_id: int | None
    why: Reason = dataclasses.field(compare=False)
    overlap_blocks: int = 0
    kind: DecisionKind = DecisionKind.LOAD
    host_overlap_blocks: int = 0

    @property
    def reason(self) -> str:
        why = self.why
        if isinstance(why, str):
            return why
        text = why()
        object.__setattr__(self, "why", text)  # formatted once; the decision is otherwise immutable
        return text

    def __repr__(self) -> str:
        host = f", host_overlap_blocks={self.host_overlap_blocks!r}" if self.host_overlap_blocks else ""
        return (
            f"RouteDecision(instance_id={self.instance_id!r}, reason={self.reason!r}, "
            f"overlap_blocks={self.overlap_blocks!r}, kind={self.kind!r}{host})"
        )


S = TypeVar("S")


class RoutingPolicy(Protocol[S]):
    """A routing policy: a readable ``name``, whether it needs prefix overlaps, and a pure ``select``.

    ``workers`` come in ascending ``instance_id`` order, so a policy that walks them is deterministic given its state
    and ``rng``; the router passes a ``WorkerTable``, whose summaries a policy may use to skip that walk, deciding as
    it would over a plain list. ``uses_kv``: the router hashes the prompt and fills ``RouteRequest.overlap_blocks``
    only for policies that read them (hashing an 8k-token prompt costs ~115 us). ``uses_inflight``: it reads what the
    router counts in flight per worker (requests, prompt tokens, blocks, prefill tokens), so routers that place
    requests on the same workers (frontend replicas) must share their assignments for its decisions to be right;
    a policy that reads none of it (round robin, random) gains nothing from that sharing.
    """

    name: str
    uses_kv: bool
    uses_inflight: bool

    def initial_state(self) -> S: ...

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: S, rng: random.Random
    ) -> tuple[RouteDecision, S]: ...
