"""One replay loop: a fleet of simulated engines behind the real router, on a virtual clock. Every benchmark that
replays a workload (``kvmesh bench routing``, ``bench disagg``) runs this function.

One run replays a workload (``Workload``: prompts as token ids, output lengths, arrival times) against
``FleetSpec``'s workers: each worker is a ``VirtualEngine`` (the mock engine's own scheduler: continuous batching,
chunked prefill, prefix cache with LRU eviction, preemption, its step-time model from ``components.perf``), and every
request is placed by ``components.router.Router``, the class the frontend routes with, fed as in a deployment:

* arrival: ``Router.prepare`` (the prompt's block hashes) -> ``select`` -> ``on_routed``, then the chosen engine
  decides where the prompt is prefilled (``decide_prefill``, the rule ``components/workers/disagg.py`` runs) and
  queues it, or reserves room for it and pushes it on the prefill queue;
* a step's tokens become visible when the step ends (its modelled time after it started): the first one calls
  ``on_first_token``, the last ``on_finished``; the step's KV events go to ``apply_kv_events`` at that moment (for
  a policy that reads the KV index: the others decide the same without it, and are spared indexing them);
* every ``metrics_interval_s`` each engine's ``LoadSnapshot`` goes to ``apply_load`` (the workers publish every 100 ms);
* with a scaler (only then: a static replay has nobody to read them), every ``request_stats_interval_s`` one
  ``RequestStatsReport`` of the interval's requests goes to ``apply_request_stats`` at the interval's end, from
  ``SIM_FRONTEND``, as a frontend publishes them (components/frontend/request_stats.py, counted by the same
  ``RequestCounts``): arrivals when admitted (prompt tokens), TTFT at a request's first token, one gap per later
  token, the end with the request's output tokens. Counted as the events happen, never by rescanning requests.

With ``fleet.prefill`` > 0, ``prefill`` prefill engines work a FIFO prefill queue as ``components/workers/disagg.py``
does: each pops ONE item at a time, prefills it (the step that samples the first token ends it: the rest is
aborted), holds it for the KV transfer of the whole prompt (``kv_transfer_time_s``, the perf model's), delivers it
(the decode engine commits the KV and first token, which the client sees then, and decodes on from its next step),
and only then pops the next item. A remote decision whose reservation the decode engine's cache cannot hold is
prefilled locally (``NO_ROOM``). With no prefill engine every prompt is prefilled where it was routed.

What is not simulated: the network and the frontend (a deployment adds a few ms per request and delivers KV events
and load reports a few ms late), and the tokenizer (prompts are token ids). Time is virtual, so a run costs CPU time
proportional to the work (steps, hashed blocks), not to the trace's duration, and two runs of one workload and seed
are identical.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Mapping
from typing import Protocol

from components.fleet.request_counts import RequestCounts
from components.protocol.messages import (
    GenerateRequest,
    LoadSnapshot,
    PrefillQueueReport,
    SamplingParams,
    TokenChunk,
)
from components.protocol.metadata import WorkerRole
from components.router import Router, RouterConfig, RouteRequest
from components.router.policies.disagg import (
    DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
    DEFAULT_MAX_PREFILL_QUEUE_SIZE,
    PrefillKind,
    decide_prefill,
)
from components.sim.replication import PolicyReplicator, PrefixCopy
from components.workers.simulated import MockEngineConfig, StepOutput, VirtualEngine, step_time_of

from .dynamics import (
    DECODE,
    PREFILL,
    Action,
    ModelledConnector,
    PoolState,
    Rescheduler,
    Resize,
    RunningRequest,
    Scaler,
    WorkerSpan,
)
from .workload import Workload

MODEL = "sim"
SIM_FRONTEND = "sim-frontend"  # the source of the simulated frontend's request reports
# Virtual seconds between two request reports: the frontend's default request_stats_interval_s.
REQUEST_STATS_INTERVAL_S = 1.0
NO_ROOM = "no_room"  # a remote decision whose reservation the decode engine's cache could not hold: prefilled locally


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """The simulated fleet: ``workers`` engines the router places requests on (aggregated, or decode engines when
    ``prefill`` > 0) and ``prefill`` prefill engines behind a prefill queue. The thresholds are the decode
    engines' ``WorkerConfig`` fields."""

    workers: int = 8
    engine: MockEngineConfig = dataclasses.field(default_factory=MockEngineConfig)
    metrics_interval_s: float = 0.1
    prefill: int = 0
    # The routed engines' own config where it differs from ``engine`` (the prefill engines'): a disaggregated
    # fleet's decode engines cap their prefill share of a step (``long_prefill_token_threshold``).
    decode_engine: MockEngineConfig | None = None
    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH
    max_prefill_queue_size: int = DEFAULT_MAX_PREFILL_QUEUE_SIZE
    # With a scaler (components/sim/dynamics.py): from a worker being asked for until it registers, and from a
    # scaler's decision until the connector acts on it.
    startup_s: float = 30.0
    connector_delay_s: float = 0.0

    @property
    def decode_config(self) -> MockEngineConfig:
        return self.decode_engine if self.decode_engine is not None else self.engine


@dataclasses.dataclass(slots=True)
class _Track:
    arrival_s: float
    prompt: tuple[int, ...]  # emptied once the request finished
    prompt_len: int
    max_tokens: int
    worker: int  # the engine the request runs on: routed to, or migrated to
    first_s: float = -1.0
    last_s: float = -1.0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    output_tokens: int = 0
    enqueued_s: float = -1.0  # pushed on the prefill queue (remote prompts only)
    landing: GenerateRequest | None = None  # migrating: the request as its destination takes it


class Sink(Protocol):
    """Where ``account_chunk`` appends latencies: a list, or anything with ``append`` (bench planner's histogram)."""

    def append(self, x: float, /) -> None: ...


class Timed(Protocol):
    """What ``account_chunk`` reads and writes of one request's record (the replay's and the planner benchmark's)."""

    arrival_s: float
    first_s: float
    last_s: float
    cached_tokens: int
    host_cached_tokens: int
    output_tokens: int


def account_chunk(
    t: Timed,
    rid: str,
    chunk: TokenChunk,
    now: float,
    router: Router,
    ttft: Sink,
    itl: Sink,
    e2e: Sink,
) -> bool:
    """Record a chunk of request ``rid`` that reached its client at ``now``: its first token (TTFT, the router told),
    else an inter-token gap; its tokens; its end (E2E, the router told). True when the request finished."""
    if t.first_s < 0:
        t.first_s = now
        t.cached_tokens = chunk.num_cached_tokens
        t.host_cached_tokens = chunk.num_host_cached_tokens
        ttft.append(now - t.arrival_s)
        router.on_first_token(rid)
    else:
        itl.append(now - t.last_s)
    t.last_s = now
    t.output_tokens += len(chunk.token_ids)
    if chunk.finish_reason is None:
        return False
    router.on_finished(rid)
    e2e.append(now - t.arrival_s)
    return True


@dataclasses.dataclass
class RunResult:
    """What one simulated replay measured. Times in seconds of virtual time."""

    ttft_s: list[float]
    itl_s: list[float]  # every gap between two consecutive tokens of one request
    e2e_s: list[float]
    prompt_tokens: int
    cached_tokens: int  # served from a prefix cache: the device's, or loaded from the host tier
    host_cached_tokens: int  # of which loaded from the host tier
    output_tokens: int
    first_arrival_s: float
    last_arrival_s: float
    last_finish_s: float
    in_flight_mean: list[float]  # per worker: time average of running + waiting (the load reports)
    computed_tokens: list[int]  # per worker: prompt tokens computed (not served from cache) + output tokens
    preemptions: int
    decision_kinds: dict[str, int]
    # What the prefill side did (empty / 0 without prefill engines):
    prefill_kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # decide_prefill's kinds, plus NO_ROOM
    remote: int = 0  # prompts prefilled by a prefill engine
    queue_wait_s: list[float] = dataclasses.field(default_factory=list)  # per remote prompt: pushed -> popped
    transfer_s: list[float] = dataclasses.field(default_factory=list)  # per remote prompt: the modelled KV transfer
    prefill_busy_s: list[float] = dataclasses.field(default_factory=list)  # per prefill engine: holding an item
    prefill_computed_tokens: list[int] = dataclasses.field(default_factory=list)  # per prefill engine
    max_queue: int = 0  # deepest the prefill queue got
    # Each request's TTFT in the workload's order (``ttft_s`` is in the order the first tokens came): what a per-request
    # comparison (against ``ttft_floor_s``, say) reads.
    ttft_by_request_s: list[float] = dataclasses.field(default_factory=list)
    # Each request's mean inter-token latency (first to last token over its gaps), None with one output token.
    mean_itl_by_request_s: list[float | None] = dataclasses.field(default_factory=list)
    # The worker each request finished on (the routed one, or where a migration took it), in the workload's order.
    worker_by_request: list[int] = dataclasses.field(default_factory=list)
    # With a scaler: each resize as carried out, and every worker's (asked for, exited) span by pool.
    actions: list[Action] = dataclasses.field(default_factory=list)
    spans: dict[str, list[tuple[float, float | None]]] = dataclasses.field(default_factory=dict)
    migrations: int = 0  # requests moved by the rescheduler
    # Running requests the rescheduler selected whose destination had no room for their KV when their source stopped
    # them: refused, they stayed on their source (the live agent's "aborted by destination").
    migrations_refused: int = 0
    # Each request's output tokens as its client received them, in the workload's order.
    output_tokens_by_request: list[int] = dataclasses.field(default_factory=list)
    # When each request's last token came (its finish), in the workload's order: what a backlog over time is read from
    # (``analysis.backlog_growth``).
    finish_by_request_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def drain_s(self) -> float:
        """How long after the last arrival the last request finished."""
        return self.last_finish_s - self.last_arrival_s

    @property
    def hit_rate(self) -> float:
        """Prompt tokens not computed (device cache or host tier) over all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """The part of ``hit_rate`` loaded from the host tier."""
        return self.host_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def makespan_s(self) -> float:
        return self.last_finish_s - self.first_arrival_s


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """The fleet at one load-report tick (every ``metrics_interval_s``), as ``replay``'s observer sees it: what the
    workers publish (their ``LoadSnapshot``s, the routed engines' then the prefill engines'), the prefill queue's
    length, and how many requests have arrived and finished so far."""

    now_s: float
    loads: tuple[LoadSnapshot, ...]
    prefill_loads: tuple[LoadSnapshot, ...]
    queue_len: int
    arrived: int
    finished: int


class _Worker:
    """One simulated worker of either pool, keyed by its instance id."""

    __slots__ = (
        "busy",
        "busy_s",
        "computed",
        "engine",
        "first_token",
        "holding",
        "iid",
        "in_flight_sum",
        "pending",
        "popped_at",
        "samples",
        "span",
    )

    def __init__(self, iid: int, engine: VirtualEngine, span: WorkerSpan) -> None:
        self.iid = iid
        self.engine = engine
        self.span = span
        self.busy = False
        self.pending: StepOutput | None = None
        self.in_flight_sum = 0.0
        self.samples = 0
        self.computed = 0
        self.holding: str | None = None  # prefill workers: the item held
        self.popped_at = 0.0
        self.first_token = 0
        self.busy_s = 0.0


# Event kinds. At one instant events run in the order they were scheduled (the heap's second key is a counter).
_STEP, _ARRIVAL, _REPORT, _PF_STEP, _DELIVER, _READY, _PULL, _RESIZE, _RESCHEDULE, _LAND, _STATS = range(11)
# Hot-prefix replication (components/sim/replication.py): a replicator's cycle, a copy's KV arriving.
_REPLICATE, _IMPORT = 11, 12
# With staggered load reports: one routed worker's own report (payload: its id).
_WORKER_REPORT = 13


def replay(
    workload: Workload,
    fleet: FleetSpec,
    policy: RouterConfig | str = "round_robin",
    seed: int = 0,
    *,
    observer: Callable[[Sample], None] | None = None,
    scaler: Scaler | None = None,
    rescheduler: Rescheduler | None = None,
    replicator: PolicyReplicator | None = None,
    itl_sink: Sink | None = None,
    itl_from_s: float = -math.inf,
    request_stats_interval_s: float = REQUEST_STATS_INTERVAL_S,
    request_stats_offset_s: float = 0.0,
    staggered_load_reports: bool = False,
) -> RunResult:
    """Replay ``workload`` on ``fleet`` with ``policy`` (module docstring); deterministic for a seed. ``observer``
    (read-only: it changes nothing of the replay) is called at every load-report tick with the fleet's ``Sample``.
    ``scaler`` resizes the pools and ``rescheduler`` moves running requests (components/sim/dynamics.py).
    ``itl_sink``: where inter-token gaps go instead of ``RunResult.itl_s`` (a histogram for long runs); gaps of
    requests that arrived before ``itl_from_s`` (a warm-up) are not recorded. ``request_stats_interval_s``: how often
    the simulated frontend's request report reaches the fleet view the scaler reads (with a scaler only);
    ``request_stats_offset_s`` (in ``[0, request_stats_interval_s)``): the phase of those reports, at offset + k x
    the interval (a live frontend reports on its own cadence, from its start: ``kvmesh bench planner-live`` gives the
    simulated side the live one's phase, measured). A scaler that starts before 0 (a live planner started before the
    load) watches a fleet that serves from its start, with load and request reports from then (zero, until the first
    arrival), as a deployment's workers and frontend report before the load. ``staggered_load_reports``: each routed
    worker's load report reaches the fleet view (the router's and the scaler's) every ``metrics_interval_s`` on its
    own phase, drawn (seeded by ``seed``, apart from the router's draws) when it starts, from its registration on, as
    live workers publish from their own start, instead of all of them at the load-report tick: what a reader sees
    is then 0 to ``metrics_interval_s`` old per worker, not one age for all, which a scaler pulling on a fixed
    cadence would otherwise read at one fixed age. The observer's samples stay at the tick.

    Events are (time, order, kind, payload) in one heap, ``order`` a counter, so events at one instant run in the
    order they were scheduled: at one instant step ends before arrivals before load reports, as they were scheduled;
    prefill engines' step ends and deliveries, workers registering, scaler pulls and rescheduler cycles interleave by
    the same rule."""
    spec = fleet
    config = policy if isinstance(policy, RouterConfig) else RouterConfig(router_policy=policy)
    config = config.model_copy(update={"router_seed": seed})
    router = Router(config, rng=random.Random(seed))
    requests = workload.requests
    n_requests = len(requests)
    disagg = spec.prefill > 0
    next_id = [1]

    def new_id() -> int:
        next_id[0] += 1
        return next_id[0] - 1

    connectors = {
        DECODE: ModelledConnector(spec.startup_s, new_id=new_id),
        PREFILL: ModelledConnector(spec.startup_s, new_id=new_id),
    }
    workers: dict[int, _Worker] = {}  # routed workers (aggregated or decode), every one ever started
    prefillers: dict[int, _Worker] = {}
    # The fleet serves from 0, or from the scaler's first pull when that is earlier (docstring).
    fleet_start_s = min(0.0, scaler.start_s) if scaler is not None else 0.0
    # Staggered load reports: each routed worker's phase, drawn from a stream of its own (the router's is unchanged).
    phases = random.Random(f"load-report-phases:{seed}") if staggered_load_reports else None
    for span in connectors[DECODE].start_fleet(spec.workers, fleet_start_s):
        workers[span.worker_id] = _Worker(span.worker_id, VirtualEngine(spec.decode_config), span)
    for span in connectors[PREFILL].start_fleet(spec.prefill, fleet_start_s):
        prefillers[span.worker_id] = _Worker(span.worker_id, VirtualEngine(spec.engine), span)
    step_time = step_time_of(spec.decode_config)
    meta: dict[str, object] = {
        "model": MODEL,
        "block_size": spec.engine.block_size,
        "max_model_len": spec.engine.max_model_len,
        "step_time": step_time,
    }
    if disagg:
        meta["role"] = str(WorkerRole.DECODE)
    if rescheduler is not None:
        # Its workers run a migration agent (the live rescheduler's policies move requests only between those); the
        # replay's migration is a KV transfer of the request's context, as the simulated engines' live mode.
        meta["migration_mode"] = "live"
    # Told when a migration is over (its request landed, or finished before leaving), as a live migrate call returns.
    migration_done: Callable[[str, float], None] | None = getattr(rescheduler, "migration_done", None)
    prefill_meta = {**meta, "role": str(WorkerRole.PREFILL), "step_time": step_time_of(spec.engine)}
    # The routed workers that take requests now, and the prefill workers that pop the queue now, in id order.
    routed: list[_Worker] = list(workers.values())
    serving_prefill: list[_Worker] = list(prefillers.values())

    def membership_changed(now: float) -> None:
        nonlocal routed, serving_prefill
        routed = [w for w in workers.values() if w.span.registered(now)]
        serving_prefill = [p for p in prefillers.values() if p.span.registered(now)]
        members: list[tuple[int, Mapping[str, object]]] = [(w.iid, dict(meta)) for w in routed]
        if disagg:
            members += [(p.iid, dict(prefill_meta)) for p in serving_prefill]
        router.set_workers(MODEL, members)

    membership_changed(fleet_start_s)
    # The router reads its KV index only for a policy that uses it (``select``, ``on_routed`` and ``load_view`` all
    # test ``uses_kv`` first): for the others the engines' KV events change nothing it decides, and are not indexed
    # (an hour of Mooncake trace on 64 workers: ~460k batches of events, ~15% of the replay's CPU time). A scaler or
    # rescheduler reading ``router.index`` under such a policy finds it empty.
    index_kv = router.uses_kv
    reqs: dict[str, _Track] = {}
    ttft: list[float] = []
    itl: list[float] = []
    gaps: Sink = itl if itl_sink is None else itl_sink
    e2e: list[float] = []
    kinds: dict[str, int] = {}
    prefill_kinds: dict[str, int] = {}
    queue_wait: list[float] = []
    transfers: list[float] = []
    queue: collections.deque[str] = collections.deque()  # the prefill queue: request ids, FIFO
    max_queue = 0
    migrating: dict[str, int] = {}  # request id -> destination, stopped at its worker's next step end
    migrations = 0
    migrations_refused = 0  # running requests a destination had no room for: they stayed on their source
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    for i in range(n_requests):
        heap.append((requests[i].arrival_s, seq, _ARRIVAL, i))
        seq += 1
    heapq.heapify(heap)
    # Load reports start with the run: at the first arrival for a static fleet (nothing to report before it), at the
    # fleet's start with a scaler (the fleet it watches serves from then, and its first pulls may come before any
    # arrival).
    if n_requests or scaler is not None:
        first_report_s = requests[0].arrival_s if n_requests else 0.0
        if scaler is not None:
            first_report_s = min(fleet_start_s, first_report_s)
        heapq.heappush(heap, (first_report_s, seq, _REPORT, 0))
        seq += 1
        if phases is not None:
            for w in workers.values():
                first_s = w.span.ready_s + phases.uniform(0, spec.metrics_interval_s)
                heapq.heappush(heap, (first_s, seq, _WORKER_REPORT, w.iid))
                seq += 1
    remaining = n_requests
    last_finish = requests[0].arrival_s if n_requests else 0.0
    until_s = -math.inf
    # The simulated frontend's request counts (module docstring); None without a scaler, which keeps a static
    # replay's events and results exactly what they were before request reports existed.
    stats: RequestCounts | None = None
    if scaler is not None:
        if not request_stats_interval_s > 0:
            raise ValueError(f"request_stats_interval_s must be > 0, got {request_stats_interval_s}")
        if not 0 <= request_stats_offset_s < request_stats_interval_s:
            raise ValueError(
                f"request_stats_offset_s must be within [0, {request_stats_interval_s:g}), got {request_stats_offset_s}"
            )
        stats = RequestCounts()
        # The k-th report at offset + k x the interval (a product, not a running sum: no drift over an hour of 1 s
        # steps), the first after the fleet's start, scheduled before the first pull so that, at an instant they
        # share, the report is in when the scaler reads.
        first_k = math.floor((fleet_start_s - request_stats_offset_s) / request_stats_interval_s) + 1
        heapq.heappush(heap, (request_stats_offset_s + first_k * request_stats_interval_s, seq, _STATS, first_k))
        seq += 1
        until_s = scaler.until_s
        heapq.heappush(heap, (scaler.start_s, seq, _PULL, 0))
        seq += 1
    if rescheduler is not None and n_requests:
        heapq.heappush(heap, (requests[0].arrival_s + rescheduler.interval_s, seq, _RESCHEDULE, 0))
        seq += 1
    pending_copies: list[PrefixCopy] = []  # with a replicator: copies in transit, by index
    if replicator is not None and n_requests:
        heapq.heappush(heap, (requests[0].arrival_s + replicator.interval_s, seq, _REPLICATE, 0))
        seq += 1
    # Scaler bookkeeping: pools with a change in progress, resizes waiting for the connector, actions taken.
    changing: set[str] = set()
    delayed: list[Resize] = []
    actions: list[tuple[Action, list[WorkerSpan]]] = []

    def push(t: float, kind: int, payload: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, payload))
        seq += 1

    def start_step(w: _Worker, now: float) -> None:
        nonlocal seq
        out = w.engine.step(now)
        if not out.num_scheduled_tokens:  # an empty batch
            if w.engine.num_reserved:
                # Its cache is held by prompts being prefilled elsewhere: nothing fits until one is delivered (the
                # delivery starts the next step) or finishes.
                return
            raise RuntimeError(f"simulated worker {w.iid} has work but scheduled nothing at t={now:.3f}")
        w.pending = out
        w.busy = True
        heapq.heappush(heap, (now + out.step_time_s, seq, _STEP, w.iid))  # push(), inlined: once a step
        seq += 1

    def start_prefill_step(p: _Worker, now: float) -> None:
        out = p.engine.step(now)
        p.pending = out
        push(now + out.step_time_s, _PF_STEP, p.iid)

    def emit(rid: str, chunk: TokenChunk, now: float) -> None:
        nonlocal remaining, last_finish
        t = reqs[rid]
        sink = gaps if t.arrival_s >= itl_from_s else _DISCARD
        if stats is not None:  # before account_chunk moves last_s (-1 until the first token)
            stats.add_tokens(len(chunk.token_ids), now, t.arrival_s, t.last_s)
        if account_chunk(t, rid, chunk, now, router, ttft, sink, e2e):
            remaining -= 1
            last_finish = now
            t.prompt = ()  # its tokens are no longer needed (a long replay would hold every prompt)
            if stats is not None:
                stats.ended(t.output_tokens, failed=False)

    def dispatch(now: float) -> None:
        """Idle prefill engines pop the queue's oldest items, one each."""
        for p in serving_prefill:
            if not queue:
                return
            if p.holding is not None:
                continue
            rid = queue.popleft()
            t = reqs[rid]
            p.holding = rid
            p.popped_at = now
            queue_wait.append(now - t.enqueued_s)
            sampling = SamplingParams(max_tokens=t.max_tokens, ignore_eos=True, temperature=0.0)
            p.engine.add(GenerateRequest(f"{rid}@prefill", list(t.prompt), sampling), now)
            start_prefill_step(p, now)

    def prefill_step_ended(p: _Worker, now: float) -> None:
        out = p.pending
        rid = p.holding
        assert out is not None and rid is not None
        p.pending = None
        p.computed += sum(out.num_scheduled_tokens.values())
        p.engine.take_kv_events()  # nobody routes to a prefill engine: its cache events go nowhere
        chunk = out.chunks.get(f"{rid}@prefill")
        if chunk is None:  # one chunk of a prompt longer than a step's budget
            start_prefill_step(p, now)
            return
        p.first_token = chunk.token_ids[0]
        if chunk.finish_reason is None:
            p.engine.abort(f"{rid}@prefill")  # the first token is all a prefill engine produces
        transfer = p.engine.kv_transfer_time_s(reqs[rid].prompt_len)  # the whole prompt, as the worker sends
        transfers.append(transfer)
        push(now + transfer, _DELIVER, p.iid)

    def leave_if_drained(w: _Worker, pool: str, now: float) -> None:
        """A worker asked to leave exits once it holds nothing."""
        span = w.span
        if span.left_s is not None and span.exited_s is None and not w.busy and not w.engine.has_work:
            if w.holding is None:
                connectors[pool].exited(w.iid, now)
                settle(now)

    def deliver(p: _Worker, now: float) -> None:
        rid = p.holding
        assert rid is not None
        p.holding = None
        p.busy_s += now - p.popped_at
        w = workers[reqs[rid].worker]
        committed = w.engine.commit_remote_prefill(rid, p.first_token)
        assert committed is not None, f"{rid} was not reserved on decode engine {w.iid}"
        emit(rid, committed, now)
        events = w.engine.take_kv_events()  # the committed prompt's blocks are now in its prefix cache
        if events and index_kv:
            router.apply_kv_events(w.iid, events)
        if w.engine.has_work and not w.busy:
            start_step(w, now)
        leave_if_drained(p, PREFILL, now)
        dispatch(now)

    # --- scaling -------------------------------------------------------------------------------------------------

    def pools(now: float) -> dict[str, PoolState]:
        out = {}
        for pool, c in connectors.items():
            active = c.active()
            out[pool] = PoolState(
                active=len(active),
                registered=len(c.registered(now)),
                held=c.held(now),
                starting_ready_s=tuple(w.ready_s for w in active if w.ready_s > now),
                settled=pool not in changing and c.change_done(now),
            )
        return out

    def settle(now: float) -> None:
        """Pools whose change finished: the scaler hears it, as a live connector's set_pool_size returns."""
        for pool in sorted(changing):
            if connectors[pool].change_done(now):
                changing.discard(pool)
                if scaler is not None:
                    scaler.resize_done(pool, now)

    def busy(iid: int) -> bool:
        w = workers.get(iid) or prefillers[iid]
        return w.busy or w.engine.has_work or w.holding is not None

    def resize(r: Resize, now: float) -> None:
        """The connector's call, and what the fleet does about it."""
        pool_workers = workers if r.pool == DECODE else prefillers
        config = spec.decode_config if r.pool == DECODE else spec.engine
        added, leaving = connectors[r.pool].set_pool_size(r.target, now, busy)
        for span in added:
            pool_workers[span.worker_id] = _Worker(span.worker_id, VirtualEngine(config), span)
            push(span.ready_s, _READY, span.worker_id)
            if phases is not None and r.pool == DECODE:
                push(span.ready_s + phases.uniform(0, spec.metrics_interval_s), _WORKER_REPORT, span.worker_id)
        if leaving:
            membership_changed(now)
        actions.append((Action(r.pool, now, None, r.direction, r.current, r.target, r.reason), added + leaving))
        changing.add(r.pool)
        settle(now)

    def report_queue(now: float) -> None:
        """Every serving prefill worker reports the queue, as components/workers/disagg.py does."""
        holding = sum(1 for p in serving_prefill if p.holding is not None)
        for p in serving_prefill:
            rep = PrefillQueueReport(MODEL, len(queue), holding, 0.0, 0, 0, p.holding is not None)
            router.fleet.apply_queue(p.iid, rep, now)

    # --- rescheduling --------------------------------------------------------------------------------------------

    def running_requests() -> dict[int, list[RunningRequest]]:
        """Each routed worker's requests: running ones that have a token (arrival order), then its waiting queue
        (queue order, ``waiting=True``: never admitted or preempted, no KV). A preempted request is waiting, not
        running: it holds no KV (before, it was listed as running and a migration sent KV it no longer had)."""
        out: dict[int, list[RunningRequest]] = {w.iid: [] for w in routed}
        for rid, t in reqs.items():
            if (
                t.first_s >= 0
                and t.output_tokens < t.max_tokens
                and t.worker in out
                and rid not in migrating
                and t.landing is None  # in transit: on no worker yet
                and not workers[t.worker].engine.is_waiting(rid)
            ):
                out[t.worker].append(RunningRequest(rid, t.worker, t.prompt_len, t.output_tokens, t.max_tokens))
        for w in routed:
            for q in w.engine.scheduler.waiting:
                t = reqs[q.request_id]
                out[w.iid].append(
                    RunningRequest(q.request_id, w.iid, t.prompt_len, t.output_tokens, t.max_tokens, waiting=True)
                )
        return out

    def move_waiting(rid: str, src: _Worker, dst: _Worker, now: float) -> None:
        """A waiting request (no KV) leaves ``src``'s queue for ``dst``'s at once, in arrival order: nothing to
        transfer; ``dst`` computes its prompt, and a preempted request's tokens so far, when it admits it."""
        nonlocal migrations
        t = reqs[rid]
        src.engine.abort(rid)
        t.worker = dst.iid
        request = GenerateRequest(
            rid,
            [*t.prompt, *([0] * t.output_tokens)],
            SamplingParams(max_tokens=t.max_tokens - t.output_tokens, ignore_eos=True, temperature=0.0),
        )
        dst.engine.add_by_arrival(request, now, t.arrival_s)
        migrations += 1
        if not dst.busy:
            start_step(dst, now)
        if migration_done is not None:
            migration_done(rid, now)

    def stop_migrating(w: _Worker, now: float) -> None:
        """At a step boundary: the worker's requests marked for migration leave it, their KV in transit. As the live
        agent does (components/migration/agent.py: ``pre_alloc`` before the source suspends the request), the
        destination reserves blocks for the request's whole context first; a destination without room refuses, and
        the request stays on its source, decoding on as if it had not been selected (``migrations_refused``).
        Before, the source let the request go first and a destination without room recomputed it: a preemption in
        all but name, which no engine counted."""
        nonlocal migrations_refused
        for rid in [r for r, dst in migrating.items() if reqs[r].worker == w.iid]:
            t = reqs[rid]
            dst = migrating.pop(rid)
            if t.output_tokens < t.max_tokens and w.engine.is_waiting(rid):  # preempted since: it has no KV to send
                move_waiting(rid, w, workers[dst], now)
                continue
            if t.output_tokens >= t.max_tokens:
                if migration_done is not None:
                    migration_done(rid, now)
                continue  # it finished in this step
            request = GenerateRequest(
                rid,
                [*t.prompt, *([0] * t.output_tokens)],
                SamplingParams(max_tokens=t.max_tokens - t.output_tokens, ignore_eos=True, temperature=0.0),
            )
            d = workers[dst].engine
            if not d.reserve_remote_prefill(request, now):
                migrations_refused += 1  # aborted by destination: no room for its KV
                if migration_done is not None:
                    migration_done(rid, now)
                continue
            if not w.engine.abort(rid):  # not running here after all: give the reservation back
                d.abort(rid)
                if migration_done is not None:
                    migration_done(rid, now)
                continue
            t.worker = dst
            t.landing = request
            push(now + w.engine.kv_transfer_time_s(t.prompt_len + t.output_tokens), _LAND, int(rid[1:]))

    def land(rid: str, now: float) -> None:
        """The request's KV arrived in the blocks its destination reserved when its source stopped it: it decodes on
        there."""
        nonlocal migrations
        t = reqs[rid]
        assert t.landing is not None
        t.landing = None
        w = workers[t.worker]
        migrations += 1
        chunk = w.engine.commit_remote_prefill(rid, 0)
        assert chunk is not None
        emit(rid, chunk, now)
        events = w.engine.take_kv_events()
        if events and index_kv:
            router.apply_kv_events(w.iid, events)
        if w.engine.has_work and not w.busy:
            start_step(w, now)
        if migration_done is not None:
            migration_done(rid, now)

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == _STEP:  # a decode (or aggregated) engine's step ends
            w = workers[payload]
            out = w.pending
            assert out is not None
            w.pending = None
            w.busy = False
            w.computed += out.num_prefill_tokens + out.num_decode_seqs  # a decode computes one token
            for rid, chunk in out.chunks.items():
                t = reqs[rid]
                if t.first_s >= 0 and chunk.finish_reason is None:
                    # Neither first nor last: what account_chunk does with it, inlined (nearly every step's case).
                    if t.arrival_s >= itl_from_s:
                        gaps.append(now - t.last_s)
                    if stats is not None:  # RequestCounts.add_tokens after the first token, inlined
                        gap = now - t.last_s
                        stats.itl_count += len(chunk.token_ids)
                        stats.itl_sum_s += gap
                        if gap > stats.itl_max_s:
                            stats.itl_max_s = gap
                    t.last_s = now
                    t.output_tokens += len(chunk.token_ids)
                else:
                    emit(rid, chunk, now)
            if migrating:
                stop_migrating(w, now)
            events = w.engine.take_kv_events()
            if events and index_kv:
                router.apply_kv_events(w.iid, events)
            if w.engine.has_work:
                start_step(w, now)
            elif w.span.left_s is not None:
                leave_if_drained(w, DECODE, now)
        elif kind == _ARRIVAL:  # routed to a decode engine, which decides where its prompt is prefilled
            r = requests[payload]
            rid = f"r{payload}"
            req = router.prepare(RouteRequest(r.prompt, MODEL, now, program_id=r.program_id))
            decision = router.select(req)
            router.on_routed(rid, decision, req)
            if replicator is not None and req.block_hashes is not None:
                replicator.observe(req.block_hashes, now)
            kinds[str(decision.kind)] = kinds.get(str(decision.kind), 0) + 1
            if decision.instance_id is None:
                raise RuntimeError(f"no worker to route request {payload} to at t={now:.3f}: {decision.reason}")
            w = workers[decision.instance_id]
            reqs[rid] = t = _Track(now, r.prompt, len(r.prompt), r.max_tokens, w.iid)
            if stats is not None:
                stats.arrived(t.prompt_len)
            sampling = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
            request = GenerateRequest(rid, list(r.prompt), sampling)
            where = decide_prefill(
                len(r.prompt),
                w.engine.cached_prefix_tokens(request.token_ids) if disagg else 0,
                queue_size=len(queue),
                prefill_workers=len(serving_prefill),
                max_local_prefill_length=spec.max_local_prefill_length,
                max_prefill_queue_size=spec.max_prefill_queue_size,
            )
            what = str(where.kind)
            if where.kind is PrefillKind.REMOTE and not w.engine.reserve_remote_prefill(request, now):
                what = NO_ROOM
            prefill_kinds[what] = prefill_kinds.get(what, 0) + 1
            if what == str(PrefillKind.REMOTE):
                t.enqueued_s = now
                queue.append(rid)
                max_queue = max(max_queue, len(queue))
                dispatch(now)
            else:
                w.engine.add(request, now)
                if not w.busy:
                    start_step(w, now)
        elif kind == _REPORT:  # every metrics interval: the routed engines' load reports
            snaps = []
            apply_load = router.fleet.apply_load  # router.apply_load's own call, one fewer per report
            for w in routed:
                snap = w.engine.snapshot(now)
                snaps.append(snap)
                w.in_flight_sum += snap.num_running + snap.num_waiting
                w.samples += 1
                if phases is None:  # staggered: each worker's own _WORKER_REPORT applies it
                    apply_load(w.iid, snap, now)
            if scaler is not None and disagg:
                report_queue(now)
            if observer is not None:
                done = n_requests - remaining
                pf = tuple(p.engine.snapshot(now) for p in serving_prefill)
                observer(Sample(now, tuple(snaps), pf, len(queue), len(reqs), done))
            if remaining > 0 or now < until_s:
                push(now + spec.metrics_interval_s, _REPORT, 0)
        elif kind == _PF_STEP:
            prefill_step_ended(prefillers[payload], now)
        elif kind == _DELIVER:  # a prefill engine delivers its item (KV and first token), then pops the next
            deliver(prefillers[payload], now)
        elif kind == _WORKER_REPORT:  # staggered load reports: one routed worker's, on its own phase
            w = workers[payload]
            if w.span.left_s is not None and w.span.left_s <= now:
                continue  # left routing: it reports no more (the tick's reports skip it too)
            if w.span.registered(now):
                router.fleet.apply_load(w.iid, w.engine.snapshot(now), now)
            if remaining > 0 or now < until_s:
                push(now + spec.metrics_interval_s, _WORKER_REPORT, payload)
        elif kind == _READY:  # a started worker registers: it joins routing (or the prefill queue's pollers)
            membership_changed(now)
            settle(now)
            if payload in prefillers:
                dispatch(now)
        elif kind == _PULL:
            assert scaler is not None
            for rs in scaler.pull(now, router.fleet.snapshot(now), pools(now)):
                if rs.pool not in connectors:
                    raise ValueError(f"a scaler resized an unknown pool {rs.pool!r}")
                if rs.target == rs.current:
                    continue
                if spec.connector_delay_s > 0:
                    changing.add(rs.pool)
                    delayed.append(rs)
                    push(now + spec.connector_delay_s, _RESIZE, len(delayed) - 1)
                else:
                    resize(rs, now)
            if now + scaler.interval_s < until_s:
                push(now + scaler.interval_s, _PULL, 0)
        elif kind == _RESIZE:  # the connector acts on a decision connector_delay_s old
            resize(delayed[payload], now)
        elif kind == _RESCHEDULE:
            assert rescheduler is not None
            for m in rescheduler.cycle(now, router.fleet.snapshot(now), running_requests()):
                mt = reqs.get(m.request_id)
                if mt is None or mt.worker != m.src or m.dst not in workers or not workers[m.dst].span.registered(now):
                    raise ValueError(f"bad migration {m}: the request does not run on {m.src}, or {m.dst} is no worker")
                if m.request_id in migrating or mt.output_tokens >= mt.max_tokens:
                    continue
                if workers[m.src].engine.is_waiting(m.request_id):
                    move_waiting(m.request_id, workers[m.src], workers[m.dst], now)
                else:
                    migrating[m.request_id] = m.dst
            if remaining > 0:
                push(now + rescheduler.interval_s, _RESCHEDULE, 0)
        elif kind == _STATS:  # the simulated frontend's request report of the interval ending now
            assert stats is not None
            router.fleet.apply_request_stats(SIM_FRONTEND, stats.report(MODEL, request_stats_interval_s), now)
            stats.reset()
            if remaining > 0 or now < until_s:
                push(request_stats_offset_s + (payload + 1) * request_stats_interval_s, _STATS, payload + 1)
        elif kind == _REPLICATE:
            assert replicator is not None
            free = {w.iid: w.engine.num_free_blocks for w in routed}
            for c in replicator.cycle(now, router, free):
                pending_copies.append(c)
                dst_engine = workers[c.dst].engine
                transfer_s = dst_engine.kv_transfer_time_s(len(c.block_hashes) * dst_engine.block_size)
                push(now + transfer_s, _IMPORT, len(pending_copies) - 1)
            if remaining > 0:
                push(now + replicator.interval_s, _REPLICATE, 0)
        elif kind == _IMPORT:  # a replicated prefix's KV arrived: cached free on its destination, announced
            assert replicator is not None
            c = pending_copies[payload]
            dst = workers[c.dst]
            got = dst.engine.import_prefix(c.block_hashes) if dst.span.registered(now) else None
            imported = -1 if got is None else got
            events = dst.engine.take_kv_events()
            if events and index_kv:
                router.apply_kv_events(dst.iid, events)
            replicator.copy_done(c, now, imported)
        else:  # _LAND: a migrated request's KV arrived at its destination
            land(f"r{payload}", now)
    if remaining:
        raise RuntimeError(f"{remaining} requests never finished")  # a simulator bug: every event chain ends
    ids = sorted(workers)
    pf_ids = sorted(prefillers)
    order = [reqs[f"r{i}"] for i in range(n_requests)]
    return RunResult(
        ttft_s=ttft,
        ttft_by_request_s=[t.first_s - t.arrival_s for t in order],
        mean_itl_by_request_s=[_mean_itl(t) for t in order],
        worker_by_request=[t.worker for t in order],
        output_tokens_by_request=[t.output_tokens for t in order],
        finish_by_request_s=[t.last_s for t in order],
        itl_s=itl if itl_sink is None else [],
        e2e_s=e2e,
        prompt_tokens=sum(t.prompt_len for t in order),
        cached_tokens=sum(t.cached_tokens for t in order),
        host_cached_tokens=sum(t.host_cached_tokens for t in order),
        output_tokens=sum(t.output_tokens for t in order),
        first_arrival_s=requests[0].arrival_s if n_requests else 0.0,
        last_arrival_s=requests[-1].arrival_s if n_requests else 0.0,
        last_finish_s=last_finish,
        in_flight_mean=[workers[i].in_flight_sum / workers[i].samples if workers[i].samples else 0.0 for i in ids],
        computed_tokens=[workers[i].computed for i in ids],
        preemptions=sum(w.engine.scheduler.num_preemptions for w in [*workers.values(), *prefillers.values()]),
        decision_kinds=kinds,
        prefill_kinds=prefill_kinds,
        remote=prefill_kinds.get(str(PrefillKind.REMOTE), 0),
        queue_wait_s=queue_wait,
        transfer_s=transfers,
        prefill_busy_s=[prefillers[i].busy_s for i in pf_ids],
        prefill_computed_tokens=[prefillers[i].computed for i in pf_ids],
        max_queue=max_queue,
        actions=[dataclasses.replace(a, done_s=_done_s(a, spans)) for a, spans in actions],
        spans={DECODE: connectors[DECODE].spans(), PREFILL: connectors[PREFILL].spans()},
        migrations=migrations,
        migrations_refused=migrations_refused,
    )


def _done_s(a: Action, spans: list[WorkerSpan]) -> float | None:
    """When a resize finished: the added workers registered, or the removed ones drained (None: not by the end)."""
    if not spans:
        return a.decided_s
    ends = [s.ready_s if a.direction == "up" else s.exited_s for s in spans]
    return None if any(e is None for e in ends) else max(e for e in ends if e is not None)


class _Discard:
    def append(self, x: float, /) -> None:
        pass


_DISCARD = _Discard()


def simulate(workload: Workload, policy: RouterConfig | str, fleet: FleetSpec, seed: int = 0) -> RunResult:
    """``replay`` with the arguments in the routing benchmark's order."""
    return replay(workload, fleet, policy, seed)


def _mean_itl(t: _Track) -> float | None:
    return (t.last_s - t.first_s) / (t.output_tokens - 1) if t.output_tokens > 1 else None
