"""KV-aware routing: send a request where its prompt's prefix is cached, unless that worker is too loaded for the
saved prefill to pay off.

For each candidate worker ``i`` (``common.candidates``: not already tried, not stale while a fresh one remains)::

    prefill_blocks_to_compute_i = (prompt_tokens + active_prefill_tokens_i) / block_size - overlap_blocks_i
    cost_i = overlap_weight * prefill_blocks_to_compute_i + active_blocks_i

``overlap_blocks_i`` is how many leading blocks of the prompt worker ``i`` caches (``RouteRequest.overlap_of``: the
router's KV index, from the workers' KV events), ``active_prefill_tokens_i`` the prompt tokens of requests routed
there that have no first token yet (prefill queued ahead of this one: TTFT), ``active_blocks_i`` the KV blocks of
requests in flight there (decode load: ITL). This is Dynamo's KV router cost with its defaults; the lowest cost wins.

Steps, in order, each with its reason in the decision:
1. **Pin**: ``pinned_instance_id`` wins when it can (``common.pin``).
2. **Busy**: candidates whose fresh metrics exceed ``active_decode_blocks_threshold`` (KV usage) or
   ``active_prefill_tokens_threshold`` (waiting prompt tokens) are dropped while a non-busy one remains.
3. **Imbalance override**: when the most and least loaded candidates (requests in flight) differ by more than
   ``balance_abs_threshold`` AND the most loaded carries more than ``balance_rel_threshold`` times the least, the
   request goes to the least loaded one, overlap ignored. A system prompt every request shares makes one worker's
   overlap the best for every request; the cost's load term only pushes back once the imbalance outweighs
   ``overlap_weight * overlap``, which for a 4k-token shared prefix (256 blocks) is hundreds of blocks. Dynamo users
   hit exactly this herding (its issues #737 and #7836); the override caps it at the thresholds.
4. **Cost**: ``router_temperature`` 0 takes the lowest cost, ties broken by the ``random.Random`` passed in (equal
   costs are exactly equal: with ``overlap_weight`` 1 and power-of-two block sizes every term is a float that holds
   an integer or a multiple of 1/16 exactly). Above 0 it samples worker ``i`` with probability proportional to
   ``exp(-(c_i - c_min) / (c_max - c_min) / T)``: costs normalised to [0, 1], so the spread of the fleet's costs,
   not their scale, sets how adventurous ``T`` is.

Parameters (``RouterConfig``): ``overlap_weight``, ``router_temperature``, ``active_decode_blocks_threshold``,
``active_prefill_tokens_threshold``, ``balance_abs_threshold``, ``balance_rel_threshold``.

Without a block size (``RouteRequest.block_size`` 0: the workers announced none) the policy counts blocks of
``DEFAULT_BLOCK_SIZE`` tokens; with no overlaps (no KV events yet, no hashes) the cost is pure load. Stateless.

``RouteRequest.common_overlap_blocks`` is the prefix every worker of the model caches (a system prompt); only the
workers caching more are in ``overlap_blocks``, so with a shared system prompt the cost is one list comprehension
over the candidates plus a binary search per listed worker. Cost: ~35-45 us at 256 workers on one core of the
2-core EPYC dev machine; the router's share around it (hashing an 8k-token prompt ~60 us, the KV index search
25-50 us) is larger.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import RouteDecision, RouteRequest, WorkerSnapshot

DEFAULT_BLOCK_SIZE = 16  # vLLM's default


def _instance_id(w: WorkerSnapshot) -> int:
    return w.instance_id


def choose(
    request: RouteRequest, cands: Sequence[WorkerSnapshot], config: RouterConfig, rng: random.Random
) -> tuple[WorkerSnapshot, str, int]:
    """Steps 2-4 over non-empty candidates: (worker, reason, its overlap in blocks). Shared with ``kv+autellix``."""
    now = request.now_s
    cands, busy_note = common.not_busy(cands, now, config)
    overlaps = request.overlap_blocks
    get = overlaps.get
    if len(cands) > 1:
        loads = [w.active_requests for w in cands]
        lo, hi = min(loads), max(loads)
        if hi - lo > config.balance_abs_threshold and hi > config.balance_rel_threshold * lo:
            i, _ = common.pick_min(loads, rng)
            w = cands[i]
            why = f"kv imbalance override: {hi} vs {lo} requests in flight, least loaded taken{busy_note}"
            return w, why, request.overlap_of(w.instance_id)

    bs = request.block_size or DEFAULT_BLOCK_SIZE
    weight = config.overlap_weight
    per_token = weight / bs
    floor = request.common_overlap_blocks  # every candidate caches this much; overlaps lists those caching more
    base = len(request.token_ids) * per_token - weight * floor
    if len(overlaps) * 8 >= len(cands):
        # Many workers hold more than the common prefix: one lookup per candidate.
        costs = [
            base + per_token * w.active_prefill_tokens + w.active_blocks - weight * (get(w.instance_id, floor) - floor)
            for w in cands
        ]
    else:
        costs = [base + per_token * w.active_prefill_tokens + w.active_blocks for w in cands]
        # Few hold more (or none): find each by binary search (cands are sorted by id) rather than a dict lookup per
        # candidate, ~8 us less at 256 workers.
        for iid, blocks in overlaps.items():
            i = bisect.bisect_left(cands, iid, key=_instance_id)
            if i < len(cands) and cands[i].instance_id == iid:
                costs[i] -= weight * (blocks - floor)

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
    overlap = get(w.instance_id, floor)
    n_blocks = len(request.block_hashes) if request.block_hashes is not None else len(request.token_ids) // bs
    why = f"kv: {overlap}/{n_blocks} blocks cached, cost {costs[i]:.1f}, {how}{busy_note}"
    return w, why, overlap


class KvPolicy:
    name = "kv"
    uses_kv = True

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
        w, why, overlap = choose(request, cands, self.config, rng)
        return RouteDecision(w.instance_id, f"{why}{note}", overlap), state
