"""KV-aware routing: send a request where it gets its first token soonest, counting the prefill its cached prefix
saves and the prefill already queued there in the same unit, time.

For each candidate worker ``i`` (``common.candidates``: not already tried, not stale while a fresh one remains), with
``P`` prompt tokens of which worker ``i`` caches ``c_i`` (its ``overlap_blocks`` times the block size: the router's KV
index, from the workers' KV events)::

    wait_i = prefill_ms_per_token_i * queued_prefill_tokens_i + (step_residual_ms_i if queued_prefill_tokens_i else 0)
    ttft_i = wait_i + prefill_ms_per_token_i * (P - c_i)
    cost_i = ttft_i + successor_weight * prefill_ms_per_token_i * (P - c_i) + decode_weight * decode_step_ms_i

``queued_prefill_tokens_i`` is the prompt work the worker must do before this request's (requests routed there with no
first token yet, or what it reports waiting, whichever is larger), ``prefill_ms_per_token_i`` how fast it gets through
it (from its engine's step-time model, ``types.StepTime``, slowed by the sequences decoding alongside), and
``decode_step_ms_i`` the decode step the request would then share (its inter-token latency there). All are derived by
the router when the worker's counts change (``WorkerSnapshot``), not per decision.

``step_residual_ms_i`` is the part of the step in progress that a new prompt waits out on a worker with prefill
queued: half its fixed cost of a prefill step (``perf.queueing.STEP_RESIDUAL_SHARE``), which the per-token rate,
spread over a full chunk, leaves out. Below capacity a queue is one step of a few hundred to a few thousand tokens,
and its fixed cost (16.5 ms for an 8B model on an H100) is about as much as the ~600-token system prompt a cached
worker saves: without it ``kv`` sent such prompts to busy holders while idle workers would have answered sooner,
and its p99 on short shared system prompts at 8x scale and 0.6x capacity was 1.12x round-robin's; with it 1.08x,
lower on the Mooncake trace at every load and on conversations at 8x scale except at 1.0x capacity (126 -> 140 ms;
docs/router.md).

The middle term is the delay this request's uncached prefill adds to the next request that lands on worker ``i``
(``successor_weight`` 1.0: one such request). Without it the rule is greedy for this request alone: at high load a
worker with a slightly shorter queue takes a prompt it must compute in full, while the worker caching it sits idle
for the next one, and the queues it leaves behind hold more prefill than they needed to. Measured with ``kvmesh bench
routing`` (docs/router.md), against weight 0: TTFT p99 at 0.8 / 1.0 / 1.2x capacity 11% / 26% / 5% lower on multi-turn
conversations, 13-37% lower on long shared documents, 14% higher and 16% lower at 1.0 and 1.2 on the Mooncake trace,
within 7% elsewhere. ``successor_weight`` 0 routes for this request's TTFT
alone.

Workers with a host-memory KV tier (their engines announce its blocks: ``RouteRequest.host_overlap_blocks``) can
load a prefix that continues there past what their device caches, at ``host_load_ms_per_token_i`` a token (from
their announced ``StepTime``) instead of ``prefill_ms_per_token_i``. With ``h_i >= c_i`` tokens held on the device or
in the host tier, the uncached part is ``P - h_i`` and ``h_i - c_i`` tokens are loaded::

    work_i = prefill_ms_per_token_i * (P - h_i) + host_load_ms_per_token_i * (h_i - c_i)
    cost_i = wait_i + (1 + successor_weight) * work_i
             + decode_weight * decode_step_ms_i

(the load holds up the step it happens in, so it delays the next request as a prefill does). Without host tiers
``h_i = c_i`` and this is the cost above.

Why this unit: a cached prefix and queued work are both prompt tokens to compute before the first token, so the
cached worker wins exactly while its queue is shorter than its cache advantage (``queued_i - queued_j < c_i - c_j``
between workers of one speed that both have prefill queued), at any load. Dynamo's cost (``kv_dynamo`` below)
weighs prefill *blocks* to compute against the *decode* blocks of every request in flight: at high load the second
term, which grows with requests that no longer queue anywhere, outweighs any prefix and cached prefixes are ignored
when they matter most.

Steps, in order, each with its reason and ``DecisionKind`` in the decision:
1. **Pin**: ``pinned_instance_id`` wins when it can (``common.pin``).
2. **Busy**: candidates whose fresh metrics exceed ``active_decode_blocks_threshold`` (KV usage) or
   ``active_prefill_tokens_threshold`` (waiting prompt tokens) are dropped while a non-busy one remains.
3. **Imbalance override** (kind ``imbalance``): when the most and least loaded candidates (requests in flight)
   differ by more than ``balance_abs_threshold`` AND the most loaded carries more than ``balance_rel_threshold``
   times the least, the request goes to the least loaded one, overlap ignored (sglang's cache-aware policy's guard).
4. **Cost**: ``router_temperature`` 0 takes the lowest cost, ties broken by the ``random.Random`` passed in. Above 0
   it samples worker ``i`` with probability proportional to ``exp(-(c_i - c_min) / (c_max - c_min) / T)``. The kind
   is ``cache_hit`` when the chosen worker caches more of the prompt than the prefix every worker caches, else
   ``load``.

``kv_dynamo`` is Dynamo's KV router cost with its defaults, kept as the named alternative::

    cost_i = overlap_weight * ((P + active_prefill_tokens_i) / block_size - overlap_blocks_i) + active_blocks_i

Parameters (``RouterConfig``): ``decode_weight`` and ``successor_weight`` (``kv``), ``overlap_weight``
(``kv_dynamo``), and for both ``router_temperature``, ``active_decode_blocks_threshold``,
``active_prefill_tokens_threshold``, ``balance_abs_threshold``, ``balance_rel_threshold``.

Without a block size (``RouteRequest.block_size`` 0: the workers announced none) the policy counts blocks of
``DEFAULT_BLOCK_SIZE`` tokens; with no overlaps (no KV events yet, no hashes) the cost is pure load. Stateless.

``RouteRequest.common_overlap_blocks`` is the prefix every worker of the model caches (a system prompt); only the
workers caching more are in ``overlap_blocks``. Given the router's ``WorkerTable`` at temperature 0, ``lowest_ttft``
finds the lowest cost computing it for those workers and the few whose queues are short enough to compete (the whole
policy ~8 us at 256 workers, warm, on one core of the 2-core EPYC dev VM); otherwise (a plain list, a temperature,
candidates filtered) ``ttft_costs`` computes every candidate's (~57 us). Both give the same decision, to the bit.
``KvPolicy.select`` decides the usual case over a table (nothing pinned, excluded, stale or busy, no host tier,
temperature 0, no imbalance) in one function, ``_lowest_on_table``, without the general steps' ~10 calls: the same
decision, reason and random draws (with the table's ``cost_terms``, the policy took ~18 instead of ~23-28 us at p50
in ``kvmesh bench router``'s flow on the shared 2-core VM at a load of ~10, where a decision's code and data have left
the CPU caches since the last one; docs/router.md, "Cost").

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import (
    DecisionKind,
    Reason,
    RouteDecision,
    RouteRequest,
    WorkerSnapshot,
    WorkerTable,
    lazy_reason,
    queued_wait_ms,
)

DEFAULT_BLOCK_SIZE = 16  # vLLM's default
TTFT = "ttft"
DYNAMO = "dynamo"


def _instance_id(w: WorkerSnapshot) -> int:
    return w.instance_id


def ttft_costs(
    request: RouteRequest, cands: Sequence[WorkerSnapshot], decode_weight: float, successor_weight: float = 0.0
) -> list[float]:
    """``kv``'s cost of each candidate, in ms (module docstring)."""
    if request.host_overlap_blocks or request.common_host_overlap_blocks:
        return _tiered_costs(request, cands, decode_weight, successor_weight)
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    floor = request.common_overlap_blocks
    scale = 1.0 + successor_weight  # the uncached tokens count for this request's TTFT and its successors'
    base = max(1, len(request.token_ids) - floor * bs)  # uncached tokens where only the common prefix is cached
    sbase = scale * base
    costs = [
        w.prefill_ms_per_token * (w.queued_prefill_tokens + sbase)
        + (w.step_residual_ms if w.queued_prefill_tokens else 0.0)
        + decode_weight * w.decode_step_ms
        for w in cands
    ]
    overlaps = request.overlap_blocks
    if len(overlaps) * 8 >= len(cands):
        for i, w in enumerate(cands):
            extra = overlaps.get(w.instance_id, floor) - floor
            if extra > 0:
                costs[i] -= w.prefill_ms_per_token * (scale * min(extra * bs, base - 1))
    else:
        # Few workers hold more than the common prefix: find each by binary search (cands are sorted by id).
        for iid, blocks in overlaps.items():
            i = bisect.bisect_left(cands, iid, key=_instance_id)
            if i < len(cands) and cands[i].instance_id == iid and blocks > floor:
                costs[i] -= cands[i].prefill_ms_per_token * (scale * min((blocks - floor) * bs, base - 1))
    return costs


def tiered_cost(
    request: RouteRequest, w: WorkerSnapshot, device: int, host: int, decode_weight: float, scale: float
) -> float:
    """``kv``'s cost of ``w`` caching ``device`` leading blocks and holding ``host`` in its host tier (module
    docstring); ``scale`` is ``1 + successor_weight``."""
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    n = len(request.token_ids)
    held = max(device, host)
    uncached = max(1, n - held * bs)
    loaded = max(0, min(held * bs, n - 1) - device * bs)
    work = w.prefill_ms_per_token * uncached + w.host_load_ms_per_token * loaded
    return queued_wait_ms(w) + scale * work + decode_weight * w.decode_step_ms


def _tiered_costs(
    request: RouteRequest, cands: Sequence[WorkerSnapshot], decode_weight: float, successor_weight: float
) -> list[float]:
    scale = 1.0 + successor_weight
    floor, host_floor = request.common_overlap_blocks, request.common_host_overlap_blocks
    dev, host = request.overlap_blocks.get, request.host_overlap_blocks.get
    return [
        tiered_cost(request, w, dev(w.instance_id, floor), host(w.instance_id, host_floor), decode_weight, scale)
        for w in cands
    ]


def lowest_ttft(
    request: RouteRequest, table: WorkerTable, decode_weight: float, successor_weight: float = 0.0
) -> tuple[list[int], float] | None:
    """The positions in ``table`` (ascending) of the workers with the lowest ``kv`` cost, and that cost: what
    ``ttft_costs`` followed by ``common.pick_min`` finds, to the bit, computing the cost of only the workers that
    could have it. None where that would read more than a quarter of them (an idle fleet, where all tie) or where
    many workers cache more than the common prefix: there ``ttft_costs`` is cheaper.

    The workers caching more than the common prefix (a few: ``overlap_blocks``) get their cost computed. Every other
    worker's is ``wait + prefill_ms_per_token * s * base + decode_weight * decode_step_ms`` (``wait``:
    ``types.queued_wait_ms``; ``s`` = 1 + ``successor_weight``), at least ``wait + prefill_ms_floor * s * base +
    decode_weight * decode_ms_floor`` (``WorkerTable``): walking ``by_queued_wait()`` in order, the bound only grows,
    so the walk stops at the first worker whose bound exceeds the best cost found (by a relative 1e-9, far above the
    rounding of either side: a worker left out costs more, in floating point too, so the ties are all found). At
    256 workers with queues of different lengths it reads a handful of workers instead of 256 (~4 us instead of ~35
    us for ``ttft_costs`` and ``pick_min``, warm).

    With host tiers the workers holding more than the common prefixes in either tier are computed first, and the
    others' bound uses what every worker holds (``base`` = the prompt less the larger common prefix; a load costs
    more than nothing).
    """
    if request.host_overlap_blocks or request.common_host_overlap_blocks:
        return _lowest_tiered(request, table, decode_weight, successor_weight)
    n = len(table)
    overlaps = request.overlap_blocks
    if len(overlaps) * 8 >= n or decode_weight < 0.0 or successor_weight < 0.0:
        return None
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    floor = request.common_overlap_blocks
    scale = 1.0 + successor_weight
    base = max(1, len(request.token_ids) - floor * bs)
    sbase = scale * base
    cost: dict[int, float] = {}  # position -> cost, as ttft_costs computes it
    best = math.inf
    positions = table.positions
    # The snapshots' four numbers, side by side in the table's ``cost_terms`` (the same values, one cache line a
    # worker); ``q + sbase`` with ``q`` a float is what ``ttft_costs`` computes with the int, and adding the 0.0
    # residual of a worker with nothing queued is adding nothing, so every cost is ``ttft_costs``'s to the bit.
    terms = table.cost_terms
    for iid, blocks in overlaps.items():
        i = positions.get(iid)
        if i is not None:
            k = 4 * i
            rate = terms[k]
            c = rate * (terms[k + 1] + sbase) + terms[k + 2] + decode_weight * terms[k + 3]
            if blocks > floor:
                c -= rate * (scale * min((blocks - floor) * bs, base - 1))
            cost[i] = c
            if c < best:
                best = c
    rest = table.prefill_ms_floor * sbase + decode_weight * table.decode_ms_floor
    stop = best + 1e-9 * best + 1e-9
    budget = max(4, n // 4)
    for wait, i in table.by_queued_wait():
        if wait + rest > stop:
            break
        if i in cost:
            continue
        budget -= 1
        if budget < 0:
            return None
        k = 4 * i
        c = terms[k] * (terms[k + 1] + sbase) + terms[k + 2] + decode_weight * terms[k + 3]
        cost[i] = c
        if c < best:
            best = c
            stop = best + 1e-9 * best + 1e-9
    tied = [i for i, c in cost.items() if c == best]  # positions in the order first computed: sorted if several
    if len(tied) > 1:
        tied.sort()
    return tied, best


def _lowest_tiered(
    request: RouteRequest, table: WorkerTable, decode_weight: float, successor_weight: float
) -> tuple[list[int], float] | None:
    """``lowest_ttft`` with host tiers: every cost from ``tiered_cost``, as ``_tiered_costs`` computes it."""
    n = len(table)
    dev_map, host_map = request.overlap_blocks, request.host_overlap_blocks
    listed = dev_map.keys() | host_map.keys()
    if len(listed) * 8 >= n or decode_weight < 0.0 or successor_weight < 0.0:
        return None
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    floor, host_floor = request.common_overlap_blocks, request.common_host_overlap_blocks
    scale = 1.0 + successor_weight
    cost: dict[int, float] = {}
    best = math.inf
    positions = table.positions
    for iid in listed:
        i = positions.get(iid)
        if i is not None:
            c = tiered_cost(
                request, table[i], dev_map.get(iid, floor), host_map.get(iid, host_floor), decode_weight, scale
            )
            cost[i] = c
            if c < best:
                best = c
    base = max(1, len(request.token_ids) - max(floor, host_floor) * bs)
    rest = table.prefill_ms_floor * scale * base + decode_weight * table.decode_ms_floor
    stop = best + 1e-9 * best + 1e-9
    budget = max(4, n // 4)
    for wait, i in table.by_queued_wait():
        if wait + rest > stop:
            break
        if i in cost:
            continue
        budget -= 1
        if budget < 0:
            return None
        c = tiered_cost(request, table[i], floor, host_floor, decode_weight, scale)
        cost[i] = c
        if c < best:
            best = c
            stop = best + 1e-9 * best + 1e-9
    return sorted(i for i, c in cost.items() if c == best), best


def dynamo_costs(request: RouteRequest, cands: Sequence[WorkerSnapshot], overlap_weight: float) -> list[float]:
    """``kv_dynamo``'s cost of each candidate, in blocks (module docstring)."""
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    per_token = overlap_weight / bs
    floor = request.common_overlap_blocks
    overlaps = request.overlap_blocks
    get = overlaps.get
    base = len(request.token_ids) * per_token - overlap_weight * floor
    if len(overlaps) * 8 >= len(cands):
        return [
            base
            + per_token * w.active_prefill_tokens
            + w.active_blocks
            - overlap_weight * (get(w.instance_id, floor) - floor)
            for w in cands
        ]
    costs = [base + per_token * w.active_prefill_tokens + w.active_blocks for w in cands]
    for iid, blocks in overlaps.items():
        i = bisect.bisect_left(cands, iid, key=_instance_id)
        if i < len(cands) and cands[i].instance_id == iid:
            costs[i] -= overlap_weight * (blocks - floor)
    return costs


def choose(
    request: RouteRequest,
    cands: Sequence[WorkerSnapshot],
    config: RouterConfig,
    rng: random.Random,
    cost: str = TTFT,
) -> tuple[WorkerSnapshot, Reason, int, DecisionKind]:
    """Steps 2-4 over non-empty candidates: (worker, reason, its overlap in blocks, kind). Shared with
    ``kv+autellix``."""
    now = request.now_s
    cands, busy_note = common.not_busy(cands, now, config)
    if len(cands) > 1:
        if isinstance(cands, WorkerTable):
            lo, hi = cands.load_range()
        else:
            loads = [w.active_requests for w in cands]
            lo, hi = min(loads), max(loads)
        if hi - lo > config.balance_abs_threshold and hi > config.balance_rel_threshold * lo:
            loads = [w.active_requests for w in cands]
            i, _ = common.pick_min(loads, rng)
            w = cands[i]
            why = lazy_reason(
                "kv imbalance override: {} vs {} requests in flight, least loaded taken{}", hi, lo, busy_note
            )
            return w, why, request.overlap_of(w.instance_id), DecisionKind.IMBALANCE

    temperature = config.router_temperature
    lowest = temperature <= 0.0 or len(cands) == 1
    unit = "blocks" if cost == DYNAMO else "ms"
    found = None
    if lowest and cost != DYNAMO and isinstance(cands, WorkerTable):
        found = lowest_ttft(request, cands, config.decode_weight, config.successor_weight)
    if found is not None:
        tied, best = found
        ties = len(tied)
        i = tied[rng.randrange(ties)] if ties > 1 else tied[0]  # common.pick_min's draw: the k-th tied, in order
        how = _lowest_of(len(cands), ties)
        return _chosen(request, cands[i], best, unit, how, busy_note)
    if cost == DYNAMO:
        costs = dynamo_costs(request, cands, config.overlap_weight)
    else:
        costs = ttft_costs(request, cands, config.decode_weight, config.successor_weight)
    if lowest:
        i, ties = common.pick_min(costs, rng)
        how = _lowest_of(len(cands), ties)
    else:
        lo_c, hi_c = min(costs), max(costs)
        if hi_c == lo_c:
            i = rng.randrange(len(costs))
        else:
            scale = 1.0 / ((hi_c - lo_c) * temperature)
            weights = [math.exp((lo_c - c) * scale) for c in costs]
            i = rng.choices(range(len(costs)), weights=weights)[0]
        how = lazy_reason("sampled at T={:g} among {}", temperature, len(cands))
    return _chosen(request, cands[i], costs[i], unit, how, busy_note)


def _lowest_of(n: int, ties: int) -> Reason:
    return lazy_reason("lowest of {}, {} tied", n, ties) if ties > 1 else lazy_reason("lowest of {}", n)


def _chosen(
    request: RouteRequest, w: WorkerSnapshot, cost: float, unit: str, how: Reason, busy_note: str
) -> tuple[WorkerSnapshot, Reason, int, DecisionKind]:
    floor = request.common_overlap_blocks
    overlap = request.overlap_blocks.get(w.instance_id, floor)
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    n_blocks = len(request.block_hashes) if request.block_hashes is not None else len(request.token_ids) // bs
    extra = request.host_extra_of(w.instance_id) if unit == "ms" else 0
    if extra:
        kind = (
            DecisionKind.CACHE_HIT
            if overlap + extra > max(floor, request.common_host_overlap_blocks)
            else DecisionKind.LOAD
        )
        why = lazy_reason(
            "kv: {}/{} blocks cached, {} more in host memory, cost {:.1f} {}, {}{}",
            overlap,
            n_blocks,
            extra,
            cost,
            unit,
            how,
            busy_note,
        )
        return w, why, overlap, kind
    kind = DecisionKind.CACHE_HIT if overlap > floor else DecisionKind.LOAD
    why = lazy_reason("kv: {}/{} blocks cached, cost {:.1f} {}, {}{}", overlap, n_blocks, cost, unit, how, busy_note)
    return w, why, overlap, kind


def _lowest_on_table(
    request: RouteRequest, table: WorkerTable, config: RouterConfig, rng: random.Random
) -> RouteDecision | None:
    """``KvPolicy.select``'s decision in the usual case, in one function: a ``WorkerTable`` of 2 or more workers,
    none stale, no pin, none excluded, no host tier, no busy thresholds, temperature 0, no imbalance; None otherwise,
    having drawn nothing from ``rng`` (the caller then takes the general path, which decides as it always did).

    Where it decides, it is the general path's steps with their outcomes known in advance: ``common.prelude`` returns
    the table itself and an empty note (no pin, nothing excluded, ``none_stale``), ``common.not_busy`` the same (no
    thresholds), the imbalance test passes (tested here, as ``choose`` does), temperature 0 takes ``lowest_ttft``
    (or, where it declines, ``ttft_costs`` and ``common.pick_min``, as ``choose``), ``host_extra_of`` is 0 (no host
    overlaps): the same worker, ``rng`` draws, overlap, kind and reason (``_chosen``'s template and arguments). It
    saves the general path's ~10 calls and their checks (~4-8 us of a decision in ``kvmesh bench router``'s flow,
    where a decision's code and data are out of the CPU caches: docs/router.md, "Cost")."""
    if (
        config.active_decode_blocks_threshold is not None
        or config.active_prefill_tokens_threshold is not None
        or config.router_temperature > 0.0
        or request.pinned_instance_id is not None
        or request.excluded_instance_ids
        or request.host_overlap_blocks
        or request.common_host_overlap_blocks
    ):
        return None
    n = len(table)
    if n < 2 or not table.none_stale(request.now_s):
        return None
    lo, hi = table.load_range()
    if hi - lo > config.balance_abs_threshold and hi > config.balance_rel_threshold * lo:
        return None  # the imbalance override: ``choose``'s
    found = lowest_ttft(request, table, config.decode_weight, config.successor_weight)
    if found is not None:
        tied, best = found
        ties = len(tied)
        i = tied[rng.randrange(ties)] if ties > 1 else tied[0]  # common.pick_min's draw: the k-th tied, in order
    else:
        costs = ttft_costs(request, table, config.decode_weight, config.successor_weight)
        i, ties = common.pick_min(costs, rng)
        best = costs[i]
    iid = table[i].instance_id
    floor = request.common_overlap_blocks
    overlap = request.overlap_blocks.get(iid, floor)
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    n_blocks = len(request.block_hashes) if request.block_hashes is not None else len(request.token_ids) // bs
    why = lazy_reason(
        "kv: {}/{} blocks cached, cost {:.1f} {}, {}{}", overlap, n_blocks, best, "ms", _lowest_of(n, ties), ""
    )
    return RouteDecision(iid, why, overlap, DecisionKind.CACHE_HIT if overlap > floor else DecisionKind.LOAD, 0)


class KvPolicy:
    name = "kv"
    uses_kv = True
    uses_inflight = True
    cost = TTFT

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def initial_state(self) -> None:
        return None

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: None, rng: random.Random
    ) -> tuple[RouteDecision, None]:
        if self.cost == TTFT and type(workers) is WorkerTable:
            decision = _lowest_on_table(request, workers, self.config, rng)
            if decision is not None:
                return decision, state
        placed, cands, note = common.prelude(request, workers)
        if placed is not None:
            return placed, state
        w, why, overlap, kind = choose(request, cands, self.config, rng, self.cost)
        host = request.host_extra_of(w.instance_id) if self.cost == TTFT else 0
        return RouteDecision(w.instance_id, common.with_note(why, note), overlap, kind, host), state


class KvDynamoPolicy(KvPolicy):
    """``kv`` with Dynamo's cost: the named alternative, for comparison (module docstring)."""

    name = "kv_dynamo"
    cost = DYNAMO
