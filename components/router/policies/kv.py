"""KV-aware routing: send a request where it gets its first token soonest, counting the prefill its cached prefix
saves and the prefill already queued there in the same unit, time.

For each candidate worker ``i`` (``common.candidates``: not already tried, not stale while a fresh one remains), with
``P`` prompt tokens of which worker ``i`` caches ``c_i`` (its ``overlap_blocks`` times the block size: the router's KV
index, from the workers' KV events)::

    ttft_i = prefill_ms_per_token_i * (queued_prefill_tokens_i + P - c_i)
    cost_i = ttft_i + decode_weight * decode_step_ms_i

``queued_prefill_tokens_i`` is the prompt work the worker must do before this request's (requests routed there with no
first token yet, or what it reports waiting, whichever is larger), ``prefill_ms_per_token_i`` how fast it gets through
it (from its engine's step-time model, ``types.StepTime``, slowed by the sequences decoding alongside), and
``decode_step_ms_i`` the decode step the request would then share (its inter-token latency there). All three are
derived by the router when the worker's counts change (``WorkerSnapshot``), so a decision is one list comprehension.

Why this unit: a cached prefix and queued work are both prompt tokens to compute before the first token, so the
cached worker wins exactly while its queue is shorter than its cache advantage (``queued_i - queued_j < c_i - c_j``
between workers of one speed), at any load. Dynamo's cost (``kv_dynamo`` below) weighs prefill *blocks* to compute
against the *decode* blocks of every request in flight: at high load the second term, which grows with requests that
no longer queue anywhere, outweighs any prefix and cached prefixes are ignored when they matter most.

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

Parameters (``RouterConfig``): ``decode_weight`` (``kv``), ``overlap_weight`` (``kv_dynamo``), and for both
``router_temperature``, ``active_decode_blocks_threshold``, ``active_prefill_tokens_threshold``,
``balance_abs_threshold``, ``balance_rel_threshold``.

Without a block size (``RouteRequest.block_size`` 0: the workers announced none) the policy counts blocks of
``DEFAULT_BLOCK_SIZE`` tokens; with no overlaps (no KV events yet, no hashes) the cost is pure load. Stateless.

``RouteRequest.common_overlap_blocks`` is the prefix every worker of the model caches (a system prompt); only the
workers caching more are in ``overlap_blocks``, so the cost is one list comprehension over the candidates plus a
binary search per listed worker: ~35-45 us at 256 workers on one core of the 2-core EPYC dev machine.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import DecisionKind, RouteDecision, RouteRequest, WorkerSnapshot

DEFAULT_BLOCK_SIZE = 16  # vLLM's default
TTFT = "ttft"
DYNAMO = "dynamo"


def _instance_id(w: WorkerSnapshot) -> int:
    return w.instance_id


def ttft_costs(request: RouteRequest, cands: Sequence[WorkerSnapshot], decode_weight: float) -> list[float]:
    """``kv``'s cost of each candidate, in ms (module docstring)."""
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    floor = request.common_overlap_blocks
    base = max(1, len(request.token_ids) - floor * bs)  # uncached tokens where only the common prefix is cached
    costs = [
        w.prefill_ms_per_token * (w.queued_prefill_tokens + base) + decode_weight * w.decode_step_ms for w in cands
    ]
    overlaps = request.overlap_blocks
    if len(overlaps) * 8 >= len(cands):
        for i, w in enumerate(cands):
            extra = overlaps.get(w.instance_id, floor) - floor
            if extra > 0:
                costs[i] -= w.prefill_ms_per_token * min(extra * bs, base - 1)
    else:
        # Few workers hold more than the common prefix: find each by binary search (cands are sorted by id).
        for iid, blocks in overlaps.items():
            i = bisect.bisect_left(cands, iid, key=_instance_id)
            if i < len(cands) and cands[i].instance_id == iid and blocks > floor:
                costs[i] -= cands[i].prefill_ms_per_token * min((blocks - floor) * bs, base - 1)
    return costs


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
) -> tuple[WorkerSnapshot, str, int, DecisionKind]:
    """Steps 2-4 over non-empty candidates: (worker, reason, its overlap in blocks, kind). Shared with
    ``kv+autellix``."""
    now = request.now_s
    cands, busy_note = common.not_busy(cands, now, config)
    if len(cands) > 1:
        loads = [w.active_requests for w in cands]
        lo, hi = min(loads), max(loads)
        if hi - lo > config.balance_abs_threshold and hi > config.balance_rel_threshold * lo:
            i, _ = common.pick_min(loads, rng)
            w = cands[i]
            why = f"kv imbalance override: {hi} vs {lo} requests in flight, least loaded taken{busy_note}"
            return w, why, request.overlap_of(w.instance_id), DecisionKind.IMBALANCE

    if cost == DYNAMO:
        costs = dynamo_costs(request, cands, config.overlap_weight)
        unit = "blocks"
    else:
        costs = ttft_costs(request, cands, config.decode_weight)
        unit = "ms"
    temperature = config.router_temperature
    if temperature <= 0.0 or len(cands) == 1:
        i, ties = common.pick_min(costs, rng)
        how = f"lowest of {len(cands)}" + (f", {ties} tied" if ties > 1 else "")
    else:
        lo_c, hi_c = min(costs), max(costs)
        if hi_c == lo_c:
            i = rng.randrange(len(costs))
        else:
            scale = 1.0 / ((hi_c - lo_c) * temperature)
            weights = [math.exp((lo_c - c) * scale) for c in costs]
            i = rng.choices(range(len(costs)), weights=weights)[0]
        how = f"sampled at T={temperature:g} among {len(cands)}"
    w = cands[i]
    floor = request.common_overlap_blocks
    overlap = request.overlap_blocks.get(w.instance_id, floor)
    bs = request.block_size or DEFAULT_BLOCK_SIZE
    n_blocks = len(request.block_hashes) if request.block_hashes is not None else len(request.token_ids) // bs
    kind = DecisionKind.CACHE_HIT if overlap > floor else DecisionKind.LOAD
    why = f"kv: {overlap}/{n_blocks} blocks cached, cost {costs[i]:.1f} {unit}, {how}{busy_note}"
    return w, why, overlap, kind


class KvPolicy:
    name = "kv"
    uses_kv = True
    cost = TTFT

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def initial_state(self) -> None:
        return None

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: None, rng: random.Random
    ) -> tuple[RouteDecision, None]:
        placed, cands, note = common.prelude(request, workers)
        if placed is not None:
            return placed, state
        w, why, overlap, kind = choose(request, cands, self.config, rng, self.cost)
        return RouteDecision(w.instance_id, f"{why}{note}", overlap, kind), state


class KvDynamoPolicy(KvPolicy):
    """``kv`` with Dynamo's cost: the named alternative, for comparison (module docstring)."""

    name = "kv_dynamo"
    cost = DYNAMO
