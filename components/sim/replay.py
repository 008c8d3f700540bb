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
* every ``metrics_interval_s`` each engine's ``LoadSnapshot`` goes to ``apply_load`` (the workers publish every 100 ms).

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
import random
from collections.abc import Callable
from typing import Protocol

from components.protocol.messages import GenerateRequest, LoadSnapshot, SamplingParams, TokenChunk
from components.router import Router, RouterConfig, RouteRequest
from components.router.policies.disagg import (
    DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
    DEFAULT_MAX_PREFILL_QUEUE_SIZE,
    PrefillKind,
    decide_prefill,
)
from components.workers.simulated import MockEngineConfig, StepOutput, VirtualEngine

from .workload import Workload

MODEL = "sim"
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

    @property
    def decode_config(self) -> MockEngineConfig:
        return self.decode_engine if self.decode_engine is not None else self.engine


@dataclasses.dataclass(slots=True)
class _Track:
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    worker: int  # the engine the request was routed to
    first_s: float = -1.0
    last_s: float = -1.0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    output_tokens: int = 0
    enqueued_s: float = -1.0  # pushed on the prefill queue (remote prompts only)


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


def replay(
    workload: Workload,
    fleet: FleetSpec,
    policy: RouterConfig | str = "round_robin",
    seed: int = 0,
    *,
    observer: Callable[[Sample], None] | None = None,
) -> RunResult:
    """Replay ``workload`` on ``fleet`` with ``policy`` (module docstring); deterministic for a seed. ``observer``
    (read-only: it changes nothing of the replay) is called at every load-report tick with the fleet's ``Sample``.

    Events are (time, order, kind, payload) in one heap, ``order`` a counter, so events at one instant run in the
    order they were scheduled: at one instant step ends (0) before arrivals (1) before load reports (2), as they
    were scheduled; prefill engines' step ends (3) and deliveries (4) interleave by the same rule."""
    spec = fleet
    config = policy if isinstance(policy, RouterConfig) else RouterConfig(router_policy=policy)
    config = config.model_copy(update={"router_seed": seed})
    router = Router(config, rng=random.Random(seed))
    engines = [VirtualEngine(spec.decode_config) for _ in range(spec.workers)]
    prefillers = [VirtualEngine(spec.engine) for _ in range(spec.prefill)]
    ids = list(range(1, spec.workers + 1))
    meta = {
        "model": MODEL,
        "block_size": spec.engine.block_size,
        "max_model_len": spec.engine.max_model_len,
        "step_time": engines[0].step_time,
    }
    router.set_workers(MODEL, [(iid, dict(meta)) for iid in ids])
    # The router reads its KV index only for a policy that uses it (``select``, ``on_routed`` and ``load_view`` all
    # test ``uses_kv`` first): for the others the engines' KV events change nothing it decides, and are not indexed
    # (an hour of Mooncake trace on 64 workers: ~460k batches of events, ~15% of the replay's CPU time).
    index_kv = router.uses_kv
    reqs: dict[str, _Track] = {}
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    kinds: dict[str, int] = {}
    prefill_kinds: dict[str, int] = {}
    queue_wait: list[float] = []
    transfers: list[float] = []
    busy = [False] * spec.workers
    pending: list[StepOutput | None] = [None] * spec.workers
    in_flight_sum = [0.0] * spec.workers
    computed = [0] * spec.workers
    samples = 0
    queue: collections.deque[str] = collections.deque()  # the prefill queue: request ids, FIFO
    max_queue = 0
    holding: list[str | None] = [None] * spec.prefill  # the item each prefill engine holds
    popped_at = [0.0] * spec.prefill
    first_token = [0] * spec.prefill
    pf_pending: list[StepOutput | None] = [None] * spec.prefill
    pf_busy_s = [0.0] * spec.prefill
    pf_computed = [0] * spec.prefill
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    for i, r in enumerate(workload.requests):
        heap.append((r.arrival_s, seq, 1, i))
        seq += 1
    heapq.heapify(heap)
    if workload.requests:
        heapq.heappush(heap, (workload.requests[0].arrival_s, seq, 2, 0))
        seq += 1
    remaining = len(workload.requests)
    last_finish = workload.requests[0].arrival_s if workload.requests else 0.0

    def push(t: float, kind: int, payload: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, payload))
        seq += 1

    def start_step(w: int, now: float) -> None:
        nonlocal seq
        out = engines[w].step(now)
        if not out.num_scheduled_tokens:  # an empty batch
            if engines[w].num_reserved:
                # Its cache is held by prompts being prefilled elsewhere: nothing fits until one is delivered (the
                # delivery starts the next step) or finishes.
                return
            raise RuntimeError(f"simulated worker {w} has work but scheduled nothing at t={now:.3f}")
        pending[w] = out
        busy[w] = True
        heapq.heappush(heap, (now + out.step_time_s, seq, 0, w))  # push(), inlined: once a step
        seq += 1

    def start_prefill_step(p: int, now: float) -> None:
        out = prefillers[p].step(now)
        pf_pending[p] = out
        push(now + out.step_time_s, 3, p)

    def emit(rid: str, chunk: TokenChunk, now: float) -> None:
        nonlocal remaining, last_finish
        if account_chunk(reqs[rid], rid, chunk, now, router, ttft, itl, e2e):
            remaining -= 1
            last_finish = now

    def dispatch(now: float) -> None:
        """Idle prefill engines pop the queue's oldest items, one each."""
        for p in range(spec.prefill):
            if not queue:
                return
            if holding[p] is not None:
                continue
            rid = queue.popleft()
            t = reqs[rid]
            holding[p] = rid
            popped_at[p] = now
            queue_wait.append(now - t.enqueued_s)
            sampling = SamplingParams(max_tokens=t.max_tokens, ignore_eos=True, temperature=0.0)
            prefillers[p].add(GenerateRequest(f"{rid}@prefill", list(t.prompt), sampling), now)
            start_prefill_step(p, now)

    def prefill_step_ended(p: int, now: float) -> None:
        out = pf_pending[p]
        rid = holding[p]
        assert out is not None and rid is not None
        pf_pending[p] = None
        pf_computed[p] += sum(out.num_scheduled_tokens.values())
        prefillers[p].take_kv_events()  # nobody routes to a prefill engine: its cache events go nowhere
        chunk = out.chunks.get(f"{rid}@prefill")
        if chunk is None:  # one chunk of a prompt longer than a step's budget
            start_prefill_step(p, now)
            return
        first_token[p] = chunk.token_ids[0]
        if chunk.finish_reason is None:
            prefillers[p].abort(f"{rid}@prefill")  # the first token is all a prefill engine produces
        transfer = prefillers[p].kv_transfer_time_s(len(reqs[rid].prompt))  # the whole prompt, as the worker sends
        transfers.append(transfer)
        push(now + transfer, 4, p)

    def deliver(p: int, now: float) -> None:
        rid = holding[p]
        assert rid is not None
        holding[p] = None
        pf_busy_s[p] += now - popped_at[p]
        w = reqs[rid].worker
        committed = engines[w].commit_remote_prefill(rid, first_token[p])
        assert committed is not None, f"{rid} was not reserved on decode engine {w}"
        emit(rid, committed, now)
        events = engines[w].take_kv_events()  # the committed prompt's blocks are now in its prefix cache
        if events and index_kv:
            router.apply_kv_events(ids[w], events)
        if engines[w].has_work and not busy[w]:
            start_step(w, now)
        dispatch(now)

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == 0:  # a decode (or aggregated) engine's step ends
            w = payload
            out = pending[w]
            assert out is not None
            pending[w] = None
            busy[w] = False
            computed[w] += out.num_prefill_tokens + out.num_decode_seqs  # a decode computes one token
            for rid, chunk in out.chunks.items():
                t = reqs[rid]
                if t.first_s >= 0 and chunk.finish_reason is None:
                    # Neither first nor last: what account_chunk does with it, inlined (nearly every step's case).
                    itl.append(now - t.last_s)
                    t.last_s = now
                    t.output_tokens += len(chunk.token_ids)
                else:
                    emit(rid, chunk, now)
            events = engines[w].take_kv_events()
            if events and index_kv:
                router.apply_kv_events(ids[w], events)
            if engines[w].has_work:
                start_step(w, now)
        elif kind == 1:  # an arrival: routed to a decode engine, which decides where its prompt is prefilled
            r = workload.requests[payload]
            rid = f"r{payload}"
            req = router.prepare(RouteRequest(r.prompt, MODEL, now, program_id=r.program_id))
            decision = router.select(req)
            router.on_routed(rid, decision, req)
            kinds[str(decision.kind)] = kinds.get(str(decision.kind), 0) + 1
            w = ids.index(decision.instance_id) if decision.instance_id is not None else 0
            reqs[rid] = t = _Track(now, r.prompt, r.max_tokens, w)
            sampling = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
            request = GenerateRequest(rid, list(r.prompt), sampling)
            where = decide_prefill(
                len(r.prompt),
                engines[w].cached_prefix_tokens(request.token_ids) if spec.prefill else 0,
                queue_size=len(queue),
                prefill_workers=spec.prefill,
                max_local_prefill_length=spec.max_local_prefill_length,
                max_prefill_queue_size=spec.max_prefill_queue_size,
            )
            what = str(where.kind)
            if where.kind is PrefillKind.REMOTE and not engines[w].reserve_remote_prefill(request, now):
                what = NO_ROOM
            prefill_kinds[what] = prefill_kinds.get(what, 0) + 1
            if what == str(PrefillKind.REMOTE):
                t.enqueued_s = now
                queue.append(rid)
                max_queue = max(max_queue, len(queue))
                dispatch(now)
            else:
                engines[w].add(request, now)
                if not busy[w]:
                    start_step(w, now)
        elif kind == 2:  # every metrics interval: the decode engines' load reports
            samples += 1
            snaps = []
            apply_load = router.fleet.apply_load  # router.apply_load's own call, one fewer per report
            for w, e in enumerate(engines):
                snap = e.snapshot(now)
                snaps.append(snap)
                in_flight_sum[w] += snap.num_running + snap.num_waiting
                apply_load(ids[w], snap, now)
            if observer is not None:
                done = len(workload.requests) - remaining
                pf = tuple(p.snapshot(now) for p in prefillers)
                observer(Sample(now, tuple(snaps), pf, len(queue), len(reqs), done))
            if remaining > 0:
                push(now + spec.metrics_interval_s, 2, 0)
        elif kind == 3:  # a prefill engine's step ends
            prefill_step_ended(payload, now)
        else:  # kind 4: a prefill engine delivers its item (KV and first token) to the decode engine, then pops
            deliver(payload, now)
    if remaining:
        raise RuntimeError(f"{remaining} requests never finished")  # a simulator bug: every event chain ends
    return RunResult(
        ttft_s=ttft,
        ttft_by_request_s=[reqs[f"r{i}"].first_s - reqs[f"r{i}"].arrival_s for i in range(len(workload.requests))],
        mean_itl_by_request_s=[_mean_itl(reqs[f"r{i}"]) for i in range(len(workload.requests))],
        itl_s=itl,
        e2e_s=e2e,
        prompt_tokens=sum(len(t.prompt) for t in reqs.values()),
        cached_tokens=sum(t.cached_tokens for t in reqs.values()),
        host_cached_tokens=sum(t.host_cached_tokens for t in reqs.values()),
        output_tokens=sum(t.output_tokens for t in reqs.values()),
        first_arrival_s=workload.requests[0].arrival_s if workload.requests else 0.0,
        last_arrival_s=workload.requests[-1].arrival_s if workload.requests else 0.0,
        last_finish_s=last_finish,
        in_flight_mean=[s / samples if samples else 0.0 for s in in_flight_sum],
        computed_tokens=computed,
        preemptions=sum(e.scheduler.num_preemptions for e in engines + prefillers),
        decision_kinds=kinds,
        prefill_kinds=prefill_kinds,
        remote=prefill_kinds.get(str(PrefillKind.REMOTE), 0),
        queue_wait_s=queue_wait,
        transfer_s=transfers,
        prefill_busy_s=pf_busy_s,
        prefill_computed_tokens=pf_computed,
        max_queue=max_queue,
    )


def simulate(workload: Workload, policy: RouterConfig | str, fleet: FleetSpec, seed: int = 0) -> RunResult:
    """``replay`` with the arguments in the routing benchmark's order."""
    return replay(workload, fleet, policy, seed)


def _mean_itl(t: _Track) -> float | None:
    return (t.last_s - t.first_s) / (t.output_tokens - 1) if t.output_tokens > 1 else None
