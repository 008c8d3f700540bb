"""Properties of a workload on a fleet, shared by the benchmarks that replay it (and by anything asking what no
router could do better): they are properties of the workload and the engine's performance model, not of a policy.

* ``oracle_reuse``: the fraction of prompt tokens an infinite prefix cache on one worker would have served (at the
  engine's block granularity, at most all but one token of a prompt): the ceiling a hit rate is read against;
* ``ttft_floor_s`` and ``causal_ttft_floor_s``: each request's TTFT alone on an idle worker holding the infinite
  cache's prefix, and the same where a block exists only once an earlier request could have computed it: floors no
  router can beat, so a target above their bound is out of every router's reach. Both price a prefill with the
  engine's performance model (``components.perf``, the model the simulated engines and the router's cost use);
* ``without_cached_prefixes``: the workload with every prompt cut to what the infinite one-worker cache does not
  serve: replayed on a fleet, what any routing would see if every worker held every prefix ever computed, at once
  and for free (the queueing no cache can take away);
* ``pooled_fleet``: the fleet as one engine with all its KV and its compute spread evenly over its engines: replayed,
  what any rescheduler would see if migration were free and instant and made the workers one pool (the queueing for
  KV that no move between workers can take away);
* ``derive_programs``: program (conversation) ids from Mooncake hash ids alone, for the affinity policies;
* ``find_capacity``: the arrival rate at which round-robin's queues stop draining (``replay``); with
  ``growth_slack``, also the rate above which its backlog grows (``backlog_growth``: the steady-state capacity).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from components.protocol.kv_hashing import block_hashes
from components.workers.simulated import MockEngineConfig

from .replay import FleetSpec, RunResult, simulate
from .workload import Workload

# The share of the infinite cache's reuse that defines a workload's working set (``PromptBlocks.working_set``).
WORKING_SET_FRACTION = 0.9
DRAIN_SLACK = (
    0.02  # backlog left at the last arrival, as a fraction of the replay's length, that still counts as drained
)
# How much the backlog (requests arrived, not finished) may grow over the second half of the arrivals, as a fraction
# of the requests that arrived in it, for a replay to count as drained (``backlog_growth``): the same 2% as
# ``DRAIN_SLACK``, counted in requests instead of time. Below capacity the backlog at the last arrival and at the
# middle one are two draws of one steady-state backlog (the difference is noise); above it the backlog grows by
# (1 - capacity / rate) of the arrivals.
GROWTH_SLACK = 0.02


# --- the cache oracles ----------------------------------------------------------------------------------------


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


def backlog_growth(arrivals_s: Sequence[float], finishes_s: Sequence[float]) -> float:
    """How fast the backlog grows, per arriving request: the mean backlog over the last quarter of the arrivals less
    the mean over the second quarter, over the arrivals from one quarter to the other (half of them). The backlog
    ``B_k`` is what request ``k`` finds on arriving: the requests arrived before it and not finished. A fleet above
    capacity falls behind by ``1 - capacity / rate`` of each arrival (the backlog grows by that much per request);
    below capacity the two means are two estimates of one steady-state backlog. 0 for fewer than four requests.

    Why a growth and not the backlog left at the end: a fleet below capacity holds a steady-state backlog (Little's
    law: the rate times the mean time in the system), which outputs of thousands of tokens make large; ``probe``'s
    older test (the last finish within ``DRAIN_SLACK`` of the span plus the longest request alone) allowed for it with
    one isolated request, which on a short replay of such a workload (a span of seconds against one request of 30 s)
    passes a burst that the fleet could not sustain. The first quarter is left out (the fleet fills from empty), and
    means over quarters, not two instants, because a heavy-tailed backlog swings by tens of requests. A replay too
    short for its first quarter to fill the steady state counts the filling as growth: it errs low, never high."""
    n = len(arrivals_s)
    q = n // 4
    if q < 1:
        return 0.0
    arr = sorted(arrivals_s)
    fin = sorted(finishes_s)

    def mean_backlog(lo: int, hi: int) -> float:
        # requests arrived strictly before arr[k] (k of them, ties aside) less those finished by then
        return sum(bisect.bisect_left(arr, arr[k]) - bisect.bisect_right(fin, arr[k]) for k in range(lo, hi)) / (
            hi - lo
        )

    early = mean_backlog(q, 2 * q)
    late = mean_backlog(n - q, n)
    # the two windows' centres are (n - q/2) - (1.5 q) requests apart
    return (late - early) / ((n - q / 2) - 1.5 * q)


@dataclasses.dataclass
class Probe:
    rate: float
    drain_s: float
    allowed_s: float
    growth: float | None = None  # ``backlog_growth`` of the replay (None: not measured)
    growth_slack: float | None = None  # the most ``growth`` may be (None: the drain test alone)

    @property
    def drained_by_time(self) -> bool:
        """The drain test: the last finish within ``allowed_s`` of the last arrival."""
        return self.drain_s <= self.allowed_s

    @property
    def drained(self) -> bool:
        """The drain test and, where ``growth_slack`` is set, the backlog's growth at most that."""
        if self.growth_slack is None:
            return self.drained_by_time
        return self.drained_by_time and self.growth is not None and self.growth <= self.growth_slack


def _ms_per_s(engine: MockEngineConfig) -> float:
    """Modelled milliseconds per second of the simulation's time: 1000 at ``speedup_ratio`` 1; an engine at 0.2x
    takes five times as long for the same modelled work (``VirtualEngine`` divides by the ratio)."""
    return 1000.0 * engine.speedup_ratio


def isolated_service_s(workload: Workload, fleet: FleetSpec) -> float:
    """The longest time any one request of the workload takes alone on an idle worker (its prefill in full chunks,
    then one decode step per output token): the part of a drain that no rate can shorten."""
    m = fleet.engine.step_time_model
    per_s = _ms_per_s(fleet.engine)
    worst = 0.0
    for r in workload.requests:
        n = len(r.prompt)
        ms = m.chunked_prefill_ms(n)
        ms += (r.max_tokens - 1) * m.decode_ms(1, n + r.max_tokens)  # an upper bound: the longest context
        worst = max(worst, ms / per_s)
    return worst


def ttft_floor_s(workload: Workload, fleet: FleetSpec, cached_tokens: Sequence[int]) -> list[float]:
    """Each request's time to first token alone on an idle worker that caches ``cached_tokens[i]`` of its prompt
    (``PromptBlocks.hits_per_prompt``: the infinite one-worker cache's): the rest prefilled in full chunks. No policy
    can beat these; their p99 against round-robin's says how much better than round-robin any router could be."""
    m = fleet.engine.step_time_model
    per_s = _ms_per_s(fleet.engine)
    return [
        m.chunked_prefill_ms(len(r.prompt) - cached) / per_s
        for r, cached in zip(workload.requests, cached_tokens, strict=True)
    ]


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
    return [t for t, _, _ in _causal_plan(workload, fleet, hashes)]


def _causal_plan(
    workload: Workload, fleet: FleetSpec, hashes: Sequence[Sequence[int]]
) -> list[tuple[float, int, float]]:
    """``causal_ttft_floor_s``'s computation, with each request's choice: ``(ttft_s, k, ready_s)``, where the best
    first token waits for the first ``k`` blocks of the prompt (0: computes all of it) until ``ready_s`` (the
    arrival where ``k`` is 0, or where those blocks were available at arrival already)."""
    c = fleet.engine
    m = c.step_time_model
    bs = c.block_size
    per_s = _ms_per_s(c)
    slope_s = min(m.prefill_ms(n) / n for n in range(1, m.max_num_batched_tokens + 1)) / per_s

    def own_s(n: int) -> float:
        return m.chunked_prefill_ms(n) / per_s

    avail: dict[int, float] = {}  # block hash -> the earliest time it can exist
    out = []
    for r, hs in zip(workload.requests, hashes, strict=True):
        n = len(r.prompt)
        a = r.arrival_s
        usable = (n - 1) // bs  # at most all but the last token from a cache, as ``PromptBlocks``
        best = own_s(n)
        best_k, best_ready = 0, a
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
                v = ready - a + own_s(n - k * bs)
                if v < best:
                    best, best_k, best_ready = v, k, ready
        out.append((best, best_k, best_ready))
        for i in range(k, len(hs)):  # first computed by r: available from its earliest possible computation
            avail[hs[i]] = start + slope_s * (i + 1) * bs
    return out


def with_causal_cold_start(
    workload: Workload, fleet: FleetSpec, hashes: Sequence[Sequence[int]]
) -> tuple[Workload, list[int], list[float]]:
    """``without_cached_prefixes`` with the cold start kept: each request as the causal floor (``causal_ttft_floor_s``)
    serves it best, either waiting for the first ``k`` blocks of its prompt to exist somewhere and then computing the
    rest (it arrives at the time they exist, its prompt cut by those ``k`` blocks), or computing all of it from its
    arrival (its prompt whole). Replayed on a fleet, what any routing would see if every block reached every worker
    the moment any worker could first have computed it (free, instant copies to all: the most replication could
    do), with the fleet's queueing kept: a request arriving ``d`` into the first computation of its document's
    ``P`` waits ``P - d`` or computes the document cold, the choice the floor makes for it.

    Returns the workload sorted by its new arrival times, each of its requests' index in ``workload``, and each one's
    delay (new arrival less the original: add it to the replay's TTFT). Optimistic as ``without_cached_prefixes`` is,
    and more: a block's availability is the floor's, as if its first computation had started on arrival on an idle
    worker at the engine's best per-token rate, while in the replay that request queues like any other."""
    bs = fleet.engine.block_size
    plan = _causal_plan(workload, fleet, hashes)
    moved = []
    for i, (r, (_, k, ready)) in enumerate(zip(workload.requests, plan, strict=True)):
        if k:
            r = dataclasses.replace(r, arrival_s=ready, prompt=r.prompt[k * bs :])
        moved.append((r.arrival_s, i, r))
    moved.sort(key=lambda x: (x[0], x[1]))
    index = [i for _, i, _ in moved]
    delays = [r.arrival_s - workload.requests[i].arrival_s for _, i, r in moved]
    return dataclasses.replace(workload, requests=tuple(r for _, _, r in moved)), index, delays


def without_cached_prefixes(workload: Workload, block_size: int) -> Workload:
    """``workload`` with each prompt cut to the tokens the infinite one-worker cache does not serve
    (``PromptBlocks.hits_per_prompt``: the leading blocks some earlier prompt had, at most all but one token).

    Replayed on a fleet it is an optimistic reference for any router on the full workload: every prefix any earlier
    request carried is cached on every worker already (no cold start, no eviction, no copy), so a request computes
    only its own new text, and what is left of its TTFT is the queueing and batching the fleet's load makes. The
    cut prompts also hold less KV while they run (fewer preemptions) and give shorter decode contexts: optimistic
    again. A target that no policy reaches on it is out of reach of that policy on the full workload (for every
    policy, it is a judgement: another assignment of the same requests might queue less)."""
    blocks = PromptBlocks([r.prompt for r in workload.requests], block_size)
    hits = blocks.hits_per_prompt()
    requests = tuple(
        dataclasses.replace(r, prompt=r.prompt[h:]) if h else r for r, h in zip(workload.requests, hits, strict=True)
    )
    return dataclasses.replace(workload, requests=requests)


def pooled_fleet(fleet: FleetSpec) -> FleetSpec:
    """``fleet``'s ``workers`` engines as ONE engine: their KV blocks, running sequences and step token budgets added
    up, and a step time that is what one of them takes on an even share of the pooled step's batch, less what the
    fleet's parallelism hides of a prefill:

    * decode: ``decode_base_ms`` kept (each engine reads its weights once per step, in parallel with the others: not
      divided), ``decode_ms_per_seq`` and ``decode_ms_per_kv_token`` over N (each engine decodes 1/N of the
      sequences and their KV);
    * prefill: ``prefill_base_ms`` and ``prefill_ms_per_token`` over N, ``prefill_ms_per_token_sq`` over N**2: a
      prompt is prefilled on one engine, whose sequences wait for it while the other N - 1 engines' do not, so its
      cost falls on the fleet's sequences at 1/N of it on average; and N tokens' worth of quadratic cost split in N
      parts costs 1/N**2 each (``StepTimeModel.prefill_ms`` is convex in the tokens).

    Replayed with one worker it is meant as an optimistic reference for any rescheduler on ``fleet``
    (docs/rescheduler.md, "The pooled reference"): every request sees the whole fleet's free KV at once, nothing
    waits for a migration or pays for one, no worker is fuller than another, and a lone prompt is prefilled faster
    than on any engine. It is not optimistic in some respects: one FIFO queue with preempted requests at its front
    (arrivals wait behind them, where a fleet's router sends them to a worker with room: on the short/long mix at
    0.8 of capacity a 4-worker fleet with ``kv`` dispatch beats it), every sequence decoding at one speed, and every
    prefill's cost spread over every sequence (a fleet could keep prompts off some engines). The per-step decode fixed
    cost is kept whole: dividing it too (the real step at the pooled batch over N) gives an engine that decodes a
    lone sequence N times as fast as any engine can, holds KV for a fraction of the time and bounds nothing (TTFT
    p99 below the causal floor)."""
    n = fleet.workers
    if n < 1:
        raise ValueError(f"a pooled fleet needs at least one worker (got {n})")
    if fleet.prefill:
        raise ValueError("pooled_fleet pools an aggregated fleet; this one has prefill engines")
    e = fleet.engine
    # Validated anew, not ``model_copy``: a copy would keep the original's cached ``step_time_model``.
    engine = MockEngineConfig.model_validate(
        e.model_dump()
        | {
            "num_gpu_blocks": n * e.num_gpu_blocks,
            "max_num_seqs": n * e.max_num_seqs,
            "max_num_batched_tokens": n * e.max_num_batched_tokens,
            "num_host_blocks": n * e.num_host_blocks,
            "prefill_base_ms": e.prefill_base_ms / n,
            "prefill_ms_per_token": e.prefill_ms_per_token / n,
            "prefill_ms_per_token_sq": e.prefill_ms_per_token_sq / (n * n),
            "decode_base_ms": e.decode_base_ms,
            "decode_ms_per_seq": e.decode_ms_per_seq / n,
            "decode_ms_per_kv_token": e.decode_ms_per_kv_token / n,
        }
    )
    return dataclasses.replace(fleet, workers=1, engine=engine, decode_engine=None)


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
    growth_slack: float | None = None,
) -> Probe:
    """Replay at ``rate`` with ``policy`` (or with ``simulator``, which then replaces ``simulate``; ``fleet`` still
    sizes the isolated-request allowance): drained when the last request finished within ``DRAIN_SLACK`` of the
    replay's length (plus the longest isolated request) after the last arrival, and, with ``growth_slack``, the
    backlog grew by at most that fraction of the arrivals (``backlog_growth``; ``GROWTH_SLACK`` is the steady-state
    test's value)."""
    w = workload.at_rate(rate)
    res = simulator(w) if simulator is not None else simulate(w, policy, fleet, seed)
    allowed = DRAIN_SLACK * w.span_s + isolated_service_s(w, fleet)
    growth = None
    if len(res.finish_by_request_s) == len(w.requests):
        growth = backlog_growth([r.arrival_s for r in w.requests], res.finish_by_request_s)
    elif growth_slack is not None:
        raise ValueError("growth_slack needs each request's finish time (RunResult.finish_by_request_s)")
    return Probe(rate, res.drain_s, allowed, growth, growth_slack)


def model_estimate(workload: Workload, fleet: FleetSpec) -> float:
    """A first guess of the fleet's capacity in requests/s from the step-time model: every prompt token computed in
    full chunks, every output token in a decode step shared by a batch of 64."""
    c = fleet.engine
    n = len(workload.requests)
    prompt = sum(len(r.prompt) for r in workload.requests) / n
    out = sum(r.max_tokens for r in workload.requests) / n
    m = c.step_time_model
    per_token_ms = m.prefill_ms(m.max_num_batched_tokens) / m.max_num_batched_tokens
    ms = prompt * per_token_ms + out * m.decode_ms(64, 64 * int(prompt)) / 64
    return fleet.workers * _ms_per_s(c) / ms


def find_capacity(
    workload: Workload,
    fleet: FleetSpec,
    seed: int = 0,
    rel_tol: float = 0.04,
    max_probes: int = 14,
    *,
    simulator: Simulator | None = None,
    growth_slack: float | None = None,
) -> tuple[float, list[Probe]]:
    """The highest arrival rate (requests per second) at which round-robin still drains the workload (``probe``),
    by bracketing from the step-time model's estimate and bisecting geometrically to ``rel_tol``. ``simulator``:
    the same search for another fleet (``probe``). ``growth_slack`` (``GROWTH_SLACK``): also require the backlog not
    to grow (``backlog_growth``), the steady-state capacity; None (the default, what the benchmarks that predate it
    measure): the drain test alone, which a workload whose longest request alone outlasts the replay's span passes
    at rates the fleet cannot sustain (docs/rescheduler.md, "TTFT on the short/long mix")."""
    probes: list[Probe] = []
    guess = model_estimate(workload, fleet)
    lo = hi = None
    rate = guess
    while len(probes) < max_probes and (lo is None or hi is None):
        p = probe(workload, fleet, rate, seed, simulator=simulator, growth_slack=growth_slack)
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
        p = probe(workload, fleet, mid, seed, simulator=simulator, growth_slack=growth_slack)
        probes.append(p)
        if p.drained:
            lo = mid
        else:
            hi = mid
    return lo, probes
