"""A fleet of simulated engines behind the real router, on a virtual clock: what ``kvmesh bench routing`` measures.

One run replays a workload (``Workload``: prompts as token ids, output lengths, arrival times) against ``FleetSpec``'s
workers: each worker is a ``VirtualEngine`` (the mock engine's own scheduler: continuous batching, chunked prefill,
prefix cache with LRU eviction, preemption, its step-time model), and every request is placed by
``components.router.Router``, the class the frontend routes with, fed as in a deployment:

* arrival: ``Router.prepare`` (the prompt's block hashes) -> ``select`` -> ``on_routed``, then the engine queues it;
* a step's tokens become visible when the step ends (its modelled time after it started): the first one calls
  ``on_first_token``, the last ``on_finished``; the step's KV events go to ``apply_kv_events`` at that moment;
* every ``metrics_interval_s`` each engine's ``LoadSnapshot`` goes to ``apply_load`` (the workers publish every 100 ms).

What is not simulated: the network and the frontend (a deployment adds a few ms per request and delivers KV events
and load reports a few ms late), and the tokenizer (prompts are token ids). Time is virtual, so a run costs CPU time
proportional to the work (steps, hashed blocks), not to the trace's duration, and two runs of one workload and seed
are identical.

Also here, because they are properties of a workload rather than of a policy:

* ``oracle_reuse``: the fraction of prompt tokens an infinite prefix cache on one worker would have served (at the
  engine's block granularity, at most all but one token of a prompt): the ceiling a hit rate is read against;
* ``ttft_floor_s`` and ``causal_ttft_floor_s``: each request's TTFT alone on an idle worker holding the infinite
  cache's prefix, and the same where a block exists only once an earlier request could have computed it: floors no
  router can beat, so a target above their bound is out of every router's reach;
* ``derive_programs``: program (conversation) ids from Mooncake hash ids alone, for the affinity policies;
* ``find_capacity``: the arrival rate at which round-robin's queues stop draining.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.router import Router, RouterConfig, RouteRequest
from components.workers.simulated import MockEngineConfig, VirtualEngine

MODEL = "sim"
# The share of the infinite cache's reuse that defines a workload's working set (``PromptBlocks.working_set``).
WORKING_SET_FRACTION = 0.9
DRAIN_SLACK = (
    0.02  # backlog left at the last arrival, as a fraction of the replay's length, that still counts as drained
)


@dataclasses.dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload: its arrival in trace seconds (relative to the first), prompt and output length."""

    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    program_id: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[SimRequest, ...]

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests per trace second."""
        n = len(self.requests)
        return (n - 1) / self.span_s if n > 1 and self.span_s > 0 else math.inf

    def at_rate(self, rate: float) -> Workload:
        """The same requests, inter-arrival times scaled so that the mean rate is ``rate`` (the burst shape kept)."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        scale = self.rate / rate if math.isfinite(self.rate) else 0.0
        t0 = self.requests[0].arrival_s if self.requests else 0.0
        return Workload(
            self.name,
            tuple(dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * scale) for r in self.requests),
        )


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """The simulated fleet: ``workers`` engines of one configuration."""

    workers: int = 8
    engine: MockEngineConfig = dataclasses.field(default_factory=MockEngineConfig)
    metrics_interval_s: float = 0.1


@dataclasses.dataclass(slots=True)
class _Track:
    arrival_s: float
    prompt_tokens: int
    worker: int
    first_s: float = -1.0
    last_s: float = -1.0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    output_tokens: int = 0


class Sink(Protocol):
    """Where ``account_chunk`` appends latencies: a list, or anything with ``append`` (bench planner's histogram)."""

    def append(self, x: float, /) -> None: ...


class Timed(Protocol):
    """What ``account_chunk`` reads and writes of one request's record (fleetsim's and bench disagg's)."""

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


def simulate(workload: Workload, policy: RouterConfig | str, fleet: FleetSpec, seed: int = 0) -> RunResult:
    """Replay ``workload`` on ``fleet`` with ``policy``; deterministic for a seed."""
    config = policy if isinstance(policy, RouterConfig) else RouterConfig(router_policy=policy)
    config = config.model_copy(update={"router_seed": seed})
    router = Router(config, rng=random.Random(seed))
    engines = [VirtualEngine(fleet.engine) for _ in range(fleet.workers)]
    ids = list(range(1, fleet.workers + 1))
    meta = {
        "model": MODEL,
        "block_size": fleet.engine.block_size,
        "max_model_len": fleet.engine.max_model_len,
        "step_time": engines[0].step_time,
    }
    router.set_workers(MODEL, [(iid, dict(meta)) for iid in ids])
    tracks: dict[str, _Track] = {}
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    kinds: dict[str, int] = {}
    busy = [False] * fleet.workers
    pending: list[Any] = [None] * fleet.workers  # the StepOutput of each engine's step in progress
    in_flight_sum = [0.0] * fleet.workers
    computed = [0] * fleet.workers
    samples = 0
    # Events: (time, order, kind, payload). At one instant: step ends (0) before arrivals (1) before reports (2).
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

    def start_step(w: int, now: float) -> None:
        nonlocal seq
        out = engines[w].step(now)
        if out.batch_size == 0:  # cannot schedule anything (it never happens with a cache that holds one sequence)
            raise RuntimeError(f"simulated worker {w} has work but scheduled nothing at t={now:.3f}")
        pending[w] = out
        busy[w] = True
        heapq.heappush(heap, (now + out.step_time_s, seq, 0, w))
        seq += 1

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == 0:
            w = payload
            out = pending[w]
            pending[w] = None
            busy[w] = False
            computed[w] += sum(out.num_scheduled_tokens.values())
            for rid, chunk in out.chunks.items():
                if account_chunk(tracks[rid], rid, chunk, now, router, ttft, itl, e2e):
                    remaining -= 1
                    last_finish = now
            events = engines[w].take_kv_events()
            if events:
                router.apply_kv_events(ids[w], events)
            if engines[w].has_work:
                start_step(w, now)
        elif kind == 1:
            r = workload.requests[payload]
            rid = f"r{payload}"
            req = router.prepare(RouteRequest(r.prompt, MODEL, now, program_id=r.program_id))
            decision = router.select(req)
            router.on_routed(rid, decision, req)
            kinds[str(decision.kind)] = kinds.get(str(decision.kind), 0) + 1
            w = ids.index(decision.instance_id) if decision.instance_id is not None else 0
            tracks[rid] = _Track(now, len(r.prompt), w)
            sampling = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0)
            engines[w].add(GenerateRequest(rid, list(r.prompt), sampling), now)
            if not busy[w]:
                start_step(w, now)
        else:
            samples += 1
            for w, e in enumerate(engines):
                snap = e.snapshot(now)
                in_flight_sum[w] += snap.num_running + snap.num_waiting
                router.apply_load(ids[w], snap, now)
            if remaining > 0:
                heapq.heappush(heap, (now + fleet.metrics_interval_s, seq, 2, 0))
                seq += 1
    prompt_tokens = sum(t.prompt_tokens for t in tracks.values())
    return RunResult(
        ttft_s=ttft,
        itl_s=itl,
        e2e_s=e2e,
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(t.cached_tokens for t in tracks.values()),
        host_cached_tokens=sum(t.host_cached_tokens for t in tracks.values()),
        output_tokens=sum(t.output_tokens for t in tracks.values()),
        first_arrival_s=workload.requests[0].arrival_s if workload.requests else 0.0,
        last_arrival_s=workload.requests[-1].arrival_s if workload.requests else 0.0,
        last_finish_s=last_finish,
        in_flight_mean=[s / samples if samples else 0.0 for s in in_flight_sum],
        computed_tokens=computed,
        preemptions=sum(e.scheduler.num_preemptions for e in engines),
        decision_kinds=kinds,
    )


# --- properties of a workload ----------------------------------------------------------------------------------------


def oracle_reuse(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int | None = None) -> float:
    """The fraction of prompt tokens a prefix cache on one worker would have served, prompts taken in order: each
    prompt hits the longest prefix of whole blocks in the cache (at most all but its last token, as an engine must
    compute one), then its blocks become the most recently used. ``capacity_blocks`` None: an infinite cache (every
    earlier prompt's blocks); otherwise one LRU cache of that many blocks."""
    return PromptBlocks(prompts, block_size).reuse(capacity_blocks)


class PromptBlocks:
    """A workload's prompts as block hashes, hashed once, for the cache oracles (``reuse``, ``working_set``)."""

    def __init__(self, prompts: Sequence[Sequence[int]], block_size: int) -> None:
        self.block_size = block_size
        self.hashes = [block_hashes(list(p), block_size) for p in prompts]
        self.lengths = [len(p) for p in prompts]

    def reuse(self, capacity_blocks: int | None = None) -> float:
        """``oracle_reuse`` of these prompts."""
        bs = self.block_size
        cache: OrderedDict[int, None] = OrderedDict()
        hit = total = 0
        for hashes, n in zip(self.hashes, self.lengths, strict=True):
            usable = (n - 1) // bs
            k = 0
            while k < usable and hashes[k] in cache:
                k += 1
            hit += k * bs
            total += n
            if capacity_blocks is None:
                cache.update(dict.fromkeys(hashes))
                continue
            move = cache.move_to_end
            for h in reversed(hashes):  # a prefix's first blocks most recent: evicted last, as engines do
                cache[h] = None
                move(h)
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
        return hit / total if total else 0.0

    def hits_per_prompt(self) -> list[int]:
        """Tokens of each prompt the infinite one-worker cache serves (``reuse(None)``'s per-prompt counts)."""
        bs = self.block_size
        seen: set[int] = set()
        out = []
        for hashes, n in zip(self.hashes, self.lengths, strict=True):
            usable = (n - 1) // bs
            k = 0
            while k < usable and hashes[k] in seen:
                k += 1
            out.append(k * bs)
            seen.update(hashes)
        return out

    def working_set(self, fraction: float = WORKING_SET_FRACTION, rel_tol: float = 1 / 16) -> int:
        """The reuse working set: the fewest blocks one LRU cache needs to serve ``fraction`` of what the infinite
        cache serves (``reuse``), found by doubling then bisecting to ``rel_tol``; 0 where nothing is reused. Cache
        memory smaller than this loses reuse to evictions whatever the routing; a fleet holds it only if its
        workers' caches split it between them."""
        target = fraction * self.reuse(None)
        if target <= 0:
            return 0
        hi = 64
        while self.reuse(hi) < target:
            hi *= 2
        lo = hi // 2 if hi > 64 else 0
        while hi - lo > max(1, int(rel_tol * hi)):
            mid = (lo + hi) // 2
            if self.reuse(mid) >= target:
                hi = mid
            else:
                lo = mid
        return hi


def derive_programs(rows: Sequence[Sequence[int]], min_share: float = 0.5) -> list[str]:
    """A program id per Mooncake row from its hash ids alone: a row continues the program of the earlier row it shares
    its longest prefix with, when that prefix is more than ``min_share`` of its blocks (a conversation's next turn
    carries its whole history); otherwise it starts a program. No block position is assumed to be a system prompt or
    a conversation id, so a prefix every row shares (a system prompt) joins nothing by itself."""
    owner: dict[int, int] = {}  # chained prefix key -> program number of the latest row that had that prefix
    out: list[str] = []
    programs = 0
    for ids in rows:
        key = 0
        best_len, best = 0, -1
        keys = []
        for k, h in enumerate(ids, 1):
            key = hash((key, h))
            keys.append(key)
            p = owner.get(key)
            if p is None:
                break
            best_len, best = k, p
        if best >= 0 and best_len > min_share * len(ids):
            program = best
        else:
            program = programs
            programs += 1
        key = keys[-1] if keys else 0
        for k in keys:
            owner[k] = program
        for h in ids[len(keys) :]:
            key = hash((key, h))
            owner[key] = program
        out.append(f"p{program}")
    return out


# --- capacity --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Probe:
    rate: float
    drain_s: float
    allowed_s: float

    @property
    def drained(self) -> bool:
        return self.drain_s <= self.allowed_s


def isolated_service_s(workload: Workload, fleet: FleetSpec) -> float:
    """The longest time any one request of the workload takes alone on an idle worker (its prefill in full chunks,
    then one decode step per output token): the part of a drain that no rate can shorten."""
    c = fleet.engine
    chunk = c.max_num_batched_tokens
    worst = 0.0
    for r in workload.requests:
        n = len(r.prompt)
        full, rest = divmod(n, chunk)
        ms = full * _prefill_ms(c, chunk) + _prefill_ms(c, rest)
        ms += (r.max_tokens - 1) * _decode_ms(c, 1, n + r.max_tokens)  # an upper bound: the longest context
        worst = max(worst, ms / 1000.0)
    return worst


def ttft_floor_s(workload: Workload, fleet: FleetSpec, cached_tokens: Sequence[int]) -> list[float]:
    """Each request's time to first token alone on an idle worker that caches ``cached_tokens[i]`` of its prompt
    (``PromptBlocks.hits_per_prompt``: the infinite one-worker cache's): the rest prefilled in full chunks. No policy
    can beat these; their p99 against round-robin's says how much better than round-robin any router could be."""
    c = fleet.engine
    chunk = c.max_num_batched_tokens
    out = []
    for r, cached in zip(workload.requests, cached_tokens, strict=True):
        full, rest = divmod(max(1, len(r.prompt) - cached), chunk)
        out.append((full * _prefill_ms(c, chunk) + _prefill_ms(c, rest)) / 1000.0)
    return out


def causal_ttft_floor_s(workload: Workload, fleet: FleetSpec, hashes: Sequence[Sequence[int]]) -> list[float]:
    """``ttft_floor_s`` with causality: a cached block exists only once some earlier request has computed it.

    ``ttft_floor_s`` lets each request find the infinite cache's blocks ready, including the first requests of a
    document that nobody has computed yet; at a cold start (a few long shared documents) that makes its p99 the
    p99 of the cached case, which no fleet reaches. Here every request still runs alone on an idle worker of its own
    (infinitely many: no queueing, no eviction), but a block is *available* only from the earliest time any request
    could have finished computing it, and a request either waits for the first ``k`` blocks of its prompt to be
    available and computes the rest, or computes all of it, whichever gives the earlier first token. A block first
    appears in request ``r`` (``hashes[r]``, its prompt's chained block hashes); ``r`` computes blocks ``u..`` (those
    no earlier request had) after waiting for ``k <= u`` available ones, so block ``i >= u`` is available from
    ``min_k ready_k + prefill(blocks k..i)``, where ``ready_k`` is ``r``'s arrival or the latest availability of its
    first ``k`` blocks. Every later request containing the block arrives later, so it cannot make it earlier.

    ``prefill(x tokens)`` for availability is taken at the lowest per-token rate any chunk of at most
    ``max_num_batched_tokens`` tokens reaches (``min_n prefill_ms(n) / n``): a lower bound on the time of any
    chunked prefill of ``x`` tokens, which keeps the availability times lower bounds and this a floor that no router
    on any fleet of these engines can beat. A request's own remaining prefill is the chunked one of ``ttft_floor_s``.
    """
    c = fleet.engine
    bs = c.block_size
    chunk = c.max_num_batched_tokens
    slope_s = min(_prefill_ms(c, n) / n for n in range(1, chunk + 1)) / 1000.0

    def own_s(n: int) -> float:
        full, rest = divmod(max(1, n), chunk)
        return (full * _prefill_ms(c, chunk) + _prefill_ms(c, rest)) / 1000.0

    avail: dict[int, float] = {}  # block hash -> the earliest time it can exist
    out = []
    for r, hs in zip(workload.requests, hashes, strict=True):
        n = len(r.prompt)
        a = r.arrival_s
        usable = (n - 1) // bs  # at most all but the last token from a cache, as ``PromptBlocks``
        best = own_s(n)
        ready = a
        # min over k of ready_k - slope * k * bs: where r's own computation of later blocks can start from
        start = a
        k = 0
        while k < len(hs):
            t = avail.get(hs[k])
            if t is None:
                break
            if t > ready:
                ready = t
            k += 1
            start = min(start, ready - slope_s * k * bs)
            if k <= usable:
                best = min(best, ready - a + own_s(n - k * bs))
        out.append(best)
        for i in range(k, len(hs)):  # first computed by r: available from its earliest possible computation
            avail[hs[i]] = start + slope_s * (i + 1) * bs
    return out


def _prefill_ms(c: MockEngineConfig, n: int) -> float:
    return c.prefill_base_ms + c.prefill_ms_per_token * n + c.prefill_ms_per_token_sq * n * n if n else 0.0


def _decode_ms(c: MockEngineConfig, seqs: int, kv: int) -> float:
    return c.decode_base_ms + c.decode_ms_per_seq * seqs + c.decode_ms_per_kv_token * kv


# Replays a workload (already at its rate) on some fleet: ``kvmesh bench disagg`` passes its disaggregated fleet's.
Simulator = Callable[[Workload], RunResult]


def probe(
    workload: Workload,
    fleet: FleetSpec,
    rate: float,
    seed: int = 0,
    policy: str = "round_robin",
    *,
    simulator: Simulator | None = None,
) -> Probe:
    """Replay at ``rate`` with ``policy`` (or with ``simulator``, which then replaces ``simulate``; ``fleet`` still
    sizes the isolated-request allowance): drained when the last request finished within ``DRAIN_SLACK`` of the
    replay's length (plus the longest isolated request) after the last arrival."""
    w = workload.at_rate(rate)
    res = simulator(w) if simulator is not None else simulate(w, policy, fleet, seed)
    allowed = DRAIN_SLACK * w.span_s + isolated_service_s(w, fleet)
    return Probe(rate, res.drain_s, allowed)


def model_estimate(workload: Workload, fleet: FleetSpec) -> float:
    """A first guess of the fleet's capacity in requests/s from the step-time model: every prompt token computed in
    full chunks, every output token in a decode step shared by a batch of 64."""
    c = fleet.engine
    n = len(workload.requests)
    prompt = sum(len(r.prompt) for r in workload.requests) / n
    out = sum(r.max_tokens for r in workload.requests) / n
    per_token_ms = _prefill_ms(c, c.max_num_batched_tokens) / c.max_num_batched_tokens
    ms = prompt * per_token_ms + out * _decode_ms(c, 64, 64 * int(prompt)) / 64
    return fleet.workers * 1000.0 / ms


def find_capacity(
    workload: Workload,
    fleet: FleetSpec,
    seed: int = 0,
    rel_tol: float = 0.04,
    max_probes: int = 14,
    *,
    simulator: Simulator | None = None,
) -> tuple[float, list[Probe]]:
    """The highest arrival rate (requests per second) at which round-robin still drains the workload (``probe``),
    by bracketing from the step-time model's estimate and bisecting geometrically to ``rel_tol``. ``simulator``:
    the same search for another fleet (``probe``)."""
    probes: list[Probe] = []
    guess = model_estimate(workload, fleet)
    lo = hi = None
    rate = guess
    while len(probes) < max_probes and (lo is None or hi is None):
        p = probe(workload, fleet, rate, seed, simulator=simulator)
        probes.append(p)
        if p.drained:
            lo = rate
            rate *= 2.0
        else:
            hi = rate
            rate /= 2.0
    if lo is None or hi is None:
        raise RuntimeError(f"capacity not bracketed in {max_probes} probes: {probes}")
    while hi / lo > 1 + rel_tol and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        p = probe(workload, fleet, mid, seed, simulator=simulator)
        probes.append(p)
        if p.drained:
            lo = mid
        else:
            hi = mid
    return lo, probes
