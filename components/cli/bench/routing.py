"""``kvmesh bench routing``: routing quality that means the same on any trace, at stated fractions of the fleet's
measured capacity.

For each workload (a trace file of any supported format, or a synthetic prefix-sharing shape;
``components/sim/workloads.py``):

1. **Oracle reuse**: the fraction of prompt tokens an infinite prefix cache on one worker would have served
   (``sim.oracle_reuse``): what a hit rate is read against. Beside it, the same for one LRU cache as large as
   the whole fleet's KV memory (``oracle_reuse_lru``): what the fleet's memory allows a policy that never wastes a
   block; a hit rate above it means the policy partitioned the working set across the workers.
2. **Capacity**: the arrival rate (requests/s) at which round-robin's queues stop draining, found by a short search
   on the simulated fleet (``sim.find_capacity``: bracket from the step-time model's estimate, then geometric
   bisection to 4%). A replay at rate r drains when its last request finishes within 2% of the replay's length, plus
   the longest time any one of its requests takes alone, after its last arrival. The trace's own inter-arrival
   shape (bursts) is kept; only its time axis is scaled.
3. **Sweep**: every policy at each load (default 0.6, 0.8, 1.0, 1.2 x capacity), same workload, same seeds:
   TTFT p50/p99, inter-token p99, end-to-end p99, prefix-cache hit rate (the engines' own count of cached prompt
   tokens at admission), output tokens/s over the makespan, balance (max / mean over workers of the time-averaged
   requests in flight and of the tokens computed), preemptions, and how many decisions were of each kind.
4. **Targets** (issue 12, restated by issue 28): at 0.8 and 1.0, ``kv``'s TTFT p99 speedup over round-robin at least
   min(2x, the speedup of a p99 80% of the way from round-robin's to the causal floor's) where the oracle reuse is
   at least 20% (the plain 2x is reported beside it); ``kv``'s hit rate at least 70% of the oracle at 0.8 (judged
   where the oracle is at least 5%: below, a trace has no sharing to speak of and only "kv does not lose" applies);
   at every load ``kv``'s p99 within 1.1x of the best load-only policy's (``LOAD_ONLY``), its throughput within 5%.
   With ``--ideal``, each p99 target also says whether an ideal reference reaches it: the workload replayed at the
   target loads without the prefixes an infinite one-worker cache serves (``sim.without_cached_prefixes``: every
   worker holds every prefix already), the best p99 of ``IDEAL_POLICIES`` (``reachable_by_ideal``); and a second
   one that keeps the cold start (``sim.with_causal_cold_start``: a request waits for its prefix to exist somewhere,
   as the causal floor chooses, or computes it cold; then every worker has it), the best p99 of the same policies
   (``reachable_by_ideal_cold_start``).
5. **Replicates** (issue 28): every workload runs at each of ``--seeds`` (default 0, 1, 2), a trace in successive
   slices of ``--requests`` rows (``slice_start``), on each of ``--fleets`` (with the host-memory KV tier, and
   device caches only); each figure is reported per replicate and as median, min and max; ratios are read per
   replicate against round-robin and against the best load-only policy of that replicate and load; a target holds on
   a workload and fleet only where it is met on every replicate that judges it (``targets_over_seeds``).
   ``--held-out`` synthetic shapes, whose parameters are drawn (``components.sim.workloads.draw_params``) and whose
   seeds were never used while the ``kv`` cost's constants were tuned, are reported apart (``held_out``).

The fleet is simulated (``components.sim``): the real ``Router`` places every request on engines that are the mock
engine's own scheduler on a virtual clock, so a sweep of seven policies at four loads over an hour of trace costs
minutes of CPU, runs in parallel over ``--jobs`` processes, and gives the same numbers on every run. The engines take
the trace's real lengths: ``max_model_len`` is raised to the workload's longest prompt plus output, which the mock
engine allows (it needs no weights). What the simulation leaves out is said in ``components.sim.replay``'s docstring.

The default fleet is 8 workers of the mock engine's defaults (an 8B model on an H100: its step-time fit, 16,384
blocks of 16 tokens = 262,144 tokens of KV cache each); ``--num-gpu-blocks`` and ``--workers`` change it. With a
working set larger than the fleet's memory no policy can reach the oracle; the LRU oracle says how far the memory
allows.

JSON is the last line on stdout; a table per workload and fleet goes to stderr; ``--png`` (default
``bench-routing.png``) draws TTFT p99 against load (median over replicates, bars from min to max), one line per
policy, one panel per workload and fleet; ``--markdown`` writes the tables of docs/router.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from components import sim
from components.sim import FleetSpec, RunResult, Workload
from components.sim.workloads import SHAPES, ShapeParams, count_rows, draw_params, from_trace, synthetic
from components.workers.simulated import MockEngineConfig

ROOT = Path(__file__).resolve().parents[3]
TRACE_DIR = ROOT.parent / "shared" / "traces"
DEFAULT_TRACES = (
    "mooncake_conversation_trace.jsonl",
    "AzureLLMInferenceTrace_conv.csv",
    "sharegpt_v3_filtered_500.json",
)
POLICIES = ("round_robin", "power_of_two", "least_loaded", "autellix", "kv", "kv+autellix", "kv_dynamo")
# The policies that look at load only, never at a cache: the best of those that ran, at each load and seed, is what
# "kv" is read against beside round-robin, so that cache reuse and load awareness are told apart.
LOAD_ONLY = ("round_robin", "random", "power_of_two", "least_loaded")
LOADS = (0.6, 0.8, 1.0, 1.2)
# The policies replayed on the workload without its cached prefixes (``--ideal``, ``sim.without_cached_prefixes``): the
# best of their TTFT p99s is the ideal reference a p99 target is read against.
IDEAL_POLICIES = ("round_robin", "least_loaded", "kv")
TARGET_P99_SPEEDUP = 2.0
# Issue 28's restatement: kv's p99 speedup over round-robin at least min(2x, the speedup that goes this share of the
# way from round-robin's p99 to the causal floor's): a 2x no router can reach is not asked for.
TARGET_FLOOR_SHARE = 0.8
TARGET_P99_LOADS = (0.8, 1.0)
TARGET_ORACLE_MIN = 0.20
TARGET_HIT_OF_ORACLE = 0.70
TARGET_HIT_LOAD = 0.8
# Below this oracle reuse a workload has no prefix sharing to speak of (ShareGPT's first turns: 0.4%, a few
# identical openings); the issue asks only that kv "not lose" there, so the hit-rate ratio is reported, not judged.
TARGET_HIT_ORACLE_MIN = 0.05
TARGET_P99_VS_LOAD_ONLY = 1.1
THROUGHPUT_TOLERANCE = 0.05
# A synthetic shape larger than its base gets this many times the requests (``synthetic_requests``).
LARGE_REQUESTS_FACTOR = 3
# The host-memory KV tier of each simulated worker (``MockEngineConfig.num_host_blocks``): 65,536 blocks of 2 MiB =
# 128 GiB, half a DGX H100 GPU's share of its 2 TiB of host DRAM, 4x the device cache.
DEFAULT_HOST_KV_BLOCKS = 65_536
FLEETS = ("host", "device")  # with the host-memory tier (--host-kv-blocks), and device caches only
DEFAULT_SEEDS = (0, 1, 2)
# Held-out shapes (--held-out): seeds from here on were never used while the kv cost's constants were tuned (seed 0,
# the nine default workloads), and each shape's parameters are drawn (``draw_params``) from a generator seeded by
# the shape's index.
HELD_OUT_SEED_BASE = 1_000_003


# --- workloads ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """How to build a workload (picklable, so that every worker process builds and caches its own copy)."""

    kind: str  # "trace" or "synthetic"
    source: str  # a path, or a shape name
    requests: int
    seed: int
    vocab_size: int
    output_tokens: int
    scale: float = 1.0  # synthetic shapes: the shared working set, in multiples of the base shape's
    skip_rows: int = 0  # traces: the slice starts after this many rows
    params: ShapeParams | None = None  # synthetic shapes: other parameters than the base shape's
    name: str | None = None  # the workload's label when it is not derived from the source

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        if self.kind == "trace":
            return Path(self.source).stem
        return f"synthetic_{self.source}" if self.scale == 1 else f"synthetic_{self.source}_x{self.scale:g}"


@functools.lru_cache(maxsize=4)
def build(spec: WorkloadSpec) -> Workload:
    if spec.kind == "trace":
        return from_trace(
            spec.source,
            spec.requests,
            vocab_size=spec.vocab_size,
            seed=spec.seed,
            output_tokens=spec.output_tokens,
            skip_rows=spec.skip_rows,
        )
    return synthetic(
        spec.source,
        spec.requests,
        vocab_size=spec.vocab_size,
        seed=spec.seed,
        scale=spec.scale,
        params=spec.params,
        name=spec.name,
    )


def slice_start(index: int, requests: int, total_rows: int, slices: str) -> int:
    """The first row of replicate ``index`` of a trace of ``total_rows`` rows: with ``slices`` "rows", rows
    ``index * requests`` on, where the trace has that many more rows; else (or with "seed") its first rows again,
    under the replicate's seed only (ShareGPT's 500 rows give one slice of 1,000: its replicates differ in the
    seeded Poisson arrivals and the router's seed)."""
    start = index * requests
    return start if slices == "rows" and start + requests <= total_rows else 0


def oracle_reuse_lru(prompts: Sequence[Sequence[int]], block_size: int, capacity_blocks: int) -> float:
    """``sim.oracle_reuse`` for one LRU cache of ``capacity_blocks`` blocks (the fleet's whole KV memory)."""
    return sim.oracle_reuse(prompts, block_size, capacity_blocks)


def fleet_for(
    spec: WorkloadSpec,
    workers: int,
    num_gpu_blocks: int,
    block_size: int,
    num_host_blocks: int = 0,
    in_batch_prefix_caching: bool = False,
) -> FleetSpec:
    """The simulated fleet for a workload: the mock engine's defaults, a context long enough for its longest
    request (rounded up to a multiple of 1024), a cache that holds at least that request, a host-memory tier of
    ``num_host_blocks`` per worker, and the engines' ``enable_in_batch_prefix_caching`` (off: vLLM's behaviour)."""
    w = build(spec)
    longest = max(len(r.prompt) + r.max_tokens for r in w.requests)
    max_len = max(MockEngineConfig().max_model_len, -(-longest // 1024) * 1024)
    blocks = max(num_gpu_blocks, -(-max_len // block_size) + 1)
    engine = MockEngineConfig(
        max_model_len=max_len,
        num_gpu_blocks=blocks,
        block_size=block_size,
        num_host_blocks=num_host_blocks,
        enable_in_batch_prefix_caching=in_batch_prefix_caching,
    )
    return FleetSpec(workers=workers, engine=engine)


# --- one run ----------------------------------------------------------------------------------------------------------


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000.0 * x, 1)


def _balance(values: Sequence[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0.0
    return round(max(values) / mean, 3) if mean > 0 else None


def summarize(res: RunResult, rate: float) -> dict[str, Any]:
    makespan = res.makespan_s
    return {
        "rate_rps": round(rate, 4),
        "requests": len(res.e2e_s),
        "ttft_ms": {"p50": _ms(_pct(res.ttft_s, 0.5)), "p99": _ms(_pct(res.ttft_s, 0.99))},
        "itl_ms": {"p50": _ms(_pct(res.itl_s, 0.5)), "p99": _ms(_pct(res.itl_s, 0.99))},
        "e2e_ms": {"p50": _ms(_pct(res.e2e_s, 0.5)), "p99": _ms(_pct(res.e2e_s, 0.99))},
        "hit_rate": round(res.hit_rate, 4),
        "host_hit_rate": round(res.host_hit_rate, 4),
        "output_tokens_per_s": round(res.output_tokens / makespan, 1) if makespan > 0 else None,
        "drain_s": round(res.drain_s, 2),
        "balance": {
            "in_flight_max_over_mean": _balance(res.in_flight_mean),
            "computed_tokens_max_over_mean": _balance([float(x) for x in res.computed_tokens]),
        },
        "preemptions": res.preemptions,
        "decision_kinds": dict(sorted(res.decision_kinds.items())),
    }


def _capacity_task(spec: WorkloadSpec, fleet: FleetSpec, seed: int) -> dict[str, Any]:
    w = build(spec)
    t0 = time.process_time()
    capacity, probes = sim.find_capacity(w, fleet, seed)
    return {
        "capacity_rps": capacity,
        "model_estimate_rps": round(sim.model_estimate(w, fleet), 4),
        "probes": [
            {"rate_rps": round(p.rate, 4), "drain_s": round(p.drain_s, 2), "allowed_s": round(p.allowed_s, 2)}
            for p in probes
        ],
        "cpu_s": round(time.process_time() - t0, 1),
    }


def _oracle_task(spec: WorkloadSpec, fleet: FleetSpec) -> dict[str, Any]:
    w = build(spec)
    prompts = [r.prompt for r in w.requests]
    e = fleet.engine
    bs = e.block_size
    blocks = sim.PromptBlocks(prompts, bs)
    lengths = sorted(len(p) for p in prompts)
    outs = sorted(r.max_tokens for r in w.requests)
    worker_memory = e.num_gpu_blocks + e.num_host_blocks
    fleet_memory = fleet.workers * worker_memory
    working_set = blocks.working_set()
    floor = sim.ttft_floor_s(w, fleet, blocks.hits_per_prompt())
    return {
        "requests": len(prompts),
        "trace_rate_rps": round(w.rate, 4),
        "prompt_tokens": {
            "p50": lengths[len(lengths) // 2],
            "max": lengths[-1],
            "mean": round(sum(lengths) / len(lengths)),
        },
        "output_tokens": {"p50": outs[len(outs) // 2], "max": outs[-1]},
        "programs": len({r.program_id for r in w.requests if r.program_id is not None}),
        "oracle_reuse": round(blocks.reuse(None), 4),
        "oracle_reuse_fleet_memory": round(blocks.reuse(fleet_memory), 4),
        "oracle_reuse_fleet_device_memory": round(blocks.reuse(fleet.workers * e.num_gpu_blocks), 4),
        "working_set": {
            "blocks": working_set,
            "over_worker_device": round(working_set / e.num_gpu_blocks, 3),
            "over_worker_memory": round(working_set / worker_memory, 3),
            "over_fleet_memory": round(working_set / fleet_memory, 3),
            "regime": regime(working_set, e.num_gpu_blocks, worker_memory, fleet_memory),
        },
        "ttft_floor_ms": {"p50": _ms(_pct(floor, 0.5)), "p99": _ms(_pct(floor, 0.99))},
    }


def regime(working_set: int, device: int, worker_memory: int, fleet_memory: int) -> str:
    """Where a workload's reuse working set fits (``sim.PromptBlocks.working_set``), which bounds what routing
    can do: in one worker's device cache, every worker can hold all of it and routing only saves each worker's first
    misses; in one worker's device cache and host tier, the same at the cost of loading from host memory; in the
    fleet's memory only if the workers split it between them, which only cache-aware routing does; beyond the fleet's
    memory, no routing keeps it."""
    if working_set <= device:
        return "fits one worker's device cache"
    if working_set <= worker_memory:
        return "fits one worker's device cache and host tier"
    if working_set <= fleet_memory:
        return "fits the fleet's memory, split between workers"
    return "exceeds the fleet's memory"


def _causal_floor_task(spec: WorkloadSpec, fleet: FleetSpec, rates: Sequence[float]) -> list[dict[str, Any]]:
    """``sim.causal_ttft_floor_s``'s p50 and p99 at each replay rate (it depends on the arrival times)."""
    w = build(spec)
    hashes = sim.PromptBlocks([r.prompt for r in w.requests], fleet.engine.block_size).hashes
    out = []
    for rate in rates:
        floor = sim.causal_ttft_floor_s(w.at_rate(rate), fleet, hashes)
        out.append({"p50": _ms(_pct(floor, 0.5)), "p99": _ms(_pct(floor, 0.99))})
    return out


def _ideal_task(spec: WorkloadSpec, fleet: FleetSpec, rates: Sequence[float], seed: int) -> list[dict[str, Any]]:
    """Per replay rate, the TTFT p99 of each of ``IDEAL_POLICIES`` on the workload without its cached prefixes
    (``sim.without_cached_prefixes``: every worker holds every prefix already), and the best of them; under
    ``cold_start``, the same on the workload with the cold start kept (``cold_start_ttft_s``)."""
    full = build(spec)
    w = sim.without_cached_prefixes(full, fleet.engine.block_size)
    hashes = sim.PromptBlocks([r.prompt for r in full.requests], fleet.engine.block_size).hashes
    out = []
    for rate in rates:
        by_policy = {p: _ms(_pct(sim.simulate(w.at_rate(rate), p, fleet, seed).ttft_s, 0.99)) for p in IDEAL_POLICIES}
        best = min((v, p) for p, v in by_policy.items() if v is not None)
        cold = {
            p: _ms(_pct(cold_start_ttft_s(full.at_rate(rate), fleet, hashes, p, seed), 0.99)) for p in IDEAL_POLICIES
        }
        best_cold = min((v, p) for p, v in cold.items() if v is not None)
        out.append(
            {
                "p99": best[0],
                "policy": best[1],
                "by_policy": by_policy,
                "cold_start": {"p99": best_cold[0], "policy": best_cold[1], "by_policy": cold},
            }
        )
    return out


def cold_start_ttft_s(
    workload: Workload, fleet: FleetSpec, hashes: Sequence[Sequence[int]], policy: str, seed: int
) -> list[float]:
    """Each request's TTFT (in ``workload``'s order) on the ideal reference that keeps the cold start: ``workload``
    (already at its rate) through ``sim.with_causal_cold_start`` (a request waits for the first blocks of its prompt
    to exist somewhere or computes them itself, as the causal floor chooses; then every worker holds them), replayed
    on ``fleet`` under ``policy``, each TTFT counted from the request's own arrival (its wait added)."""
    moved, index, delays = sim.with_causal_cold_start(workload, fleet, hashes)
    res = sim.simulate(moved, policy, fleet, seed)
    out = [0.0] * len(index)
    for j, i in enumerate(index):
        out[i] = res.ttft_by_request_s[j] + delays[j]
    return out


def _run_task(spec: WorkloadSpec, fleet: FleetSpec, policy: str, rate: float, seed: int) -> dict[str, Any]:
    w = build(spec).at_rate(rate)
    t0 = time.process_time()
    out = summarize(sim.simulate(w, policy, fleet, seed), rate)
    out["cpu_s"] = round(time.process_time() - t0, 1)
    return out


def _call(task: tuple[Any, ...]) -> Any:
    fn, *args = task
    return fn(*args)


# --- targets ----------------------------------------------------------------------------------------------------------


def check_targets(entry: dict[str, Any], loads: Sequence[float]) -> dict[str, Any]:
    """The issue's targets for one workload; ``met`` is None where the policies needed were not run, or where the
    target is not judged on this workload (``judged`` False)."""
    pts: dict[str, dict[str, dict[str, Any]]] = entry["points"]
    oracle = entry["oracle_reuse"]
    out: dict[str, Any] = {}

    def p99(policy: str, load: float) -> float | None:
        row = pts.get(policy, {}).get(f"{load:g}")
        return None if row is None else row["ttft_ms"]["p99"]

    floor_p99 = (entry.get("ttft_floor_ms") or {}).get("p99")
    causal_floor = entry.get("ttft_causal_floor_ms") or {}
    ideal = entry.get("ttft_ideal_ms") or {}
    for load in TARGET_P99_LOADS:
        judged = oracle >= TARGET_ORACLE_MIN
        kv, rr = p99("kv", load), p99("round_robin", load)
        ratio = rr / kv if kv and rr else None
        causal_p99 = (causal_floor.get(f"{load:g}") or {}).get("p99")
        target = causal_target(rr, causal_p99) if rr and causal_p99 else TARGET_P99_SPEEDUP
        out[f"kv_p99_speedup_over_round_robin_at_{load:g}"] = {
            "target": round(target, 3),
            "rule": f"min({TARGET_P99_SPEEDUP:g}x, {TARGET_FLOOR_SHARE:g} of the way from round-robin's p99 to the "
            f"causal floor's), where the oracle reuse is >= {TARGET_ORACLE_MIN:g}",
            "measured": None if ratio is None else round(ratio, 3),
            "met": None if ratio is None or not judged else ratio >= target - 1e-9,
            "judged": judged,
            # The issue-12 target as it was: 2x, whatever the floor.
            "met_2x": None if ratio is None or not judged else ratio >= TARGET_P99_SPEEDUP,
            # round-robin's p99 over the p99 of TTFTs no router can beat: each request alone on an idle worker
            # with the infinite cache ("bound"), and the same where a block exists only once an earlier request
            # could have computed it ("causal_bound", sim.causal_ttft_floor_s): the most any router could gain here.
            "bound": round(rr / floor_p99, 3) if rr and floor_p99 else None,
            "causal_bound": round(rr / causal_p99, 3) if rr and causal_p99 else None,
        }
        ideal_p99 = (ideal.get(f"{load:g}") or {}).get("p99")
        if ideal_p99 and rr:
            # ``--ideal``: round-robin's p99 over the best p99 of the workload replayed without its cached prefixes
            # (``_ideal_task``). Below the target, not even a fleet where every worker already holds every prefix
            # meets it with the policies tried: the target is out of reach as far as measured (a judgement, not a
            # bound: another assignment might queue less), and the verdict says so beside ``met``.
            entry_out = out[f"kv_p99_speedup_over_round_robin_at_{load:g}"]
            entry_out["ideal_speedup"] = round(rr / ideal_p99, 3)
            entry_out["reachable_by_ideal"] = rr / ideal_p99 >= target - 1e-9
            # The same with the cold start kept (``cold_start_ttft_s``): the tighter of the two where prefixes are
            # long and first computed while their followers arrive (the documents shape).
            cold_p99 = ((ideal.get(f"{load:g}") or {}).get("cold_start") or {}).get("p99")
            if cold_p99:
                entry_out["ideal_cold_start_speedup"] = round(rr / cold_p99, 3)
                entry_out["reachable_by_ideal_cold_start"] = rr / cold_p99 >= target - 1e-9
    kv_hit = pts.get("kv", {}).get(f"{TARGET_HIT_LOAD:g}")
    if kv_hit is not None:
        share = round(kv_hit["hit_rate"] / oracle, 3) if oracle > 0 else None
        judged = share is not None and oracle >= TARGET_HIT_ORACLE_MIN
        out[f"kv_hit_rate_over_oracle_at_{TARGET_HIT_LOAD:g}"] = {
            "target": TARGET_HIT_OF_ORACLE if judged else f"none: oracle reuse below {TARGET_HIT_ORACLE_MIN:g}",
            "measured": share,
            # Not judged (too little reuse for a share of it to mean anything) is neither met nor not met: it was
            # counted as met until issue 28.
            "met": share >= TARGET_HIT_OF_ORACLE if judged and share is not None else None,
            "judged": judged,
        }
    worst_p99: float | None = None
    worst_tput: float | None = None
    complete = True
    for load in loads:
        kv_row = pts.get("kv", {}).get(f"{load:g}")
        base = [pts[p][f"{load:g}"] for p in LOAD_ONLY if f"{load:g}" in pts.get(p, {})]
        if kv_row is None or not base:
            complete = False
            continue
        best_p99 = min(b["ttft_ms"]["p99"] for b in base)
        best_tput = max(b["output_tokens_per_s"] for b in base)
        r = kv_row["ttft_ms"]["p99"] / best_p99 if best_p99 else math.inf
        t = kv_row["output_tokens_per_s"] / best_tput if best_tput else 1.0
        worst_p99 = r if worst_p99 is None else max(worst_p99, r)
        worst_tput = t if worst_tput is None else min(worst_tput, t)
    out["kv_p99_over_best_load_only_worst_load"] = {
        "target": f"<= {TARGET_P99_VS_LOAD_ONLY}",
        "measured": None if worst_p99 is None else round(worst_p99, 3),
        "met": None if worst_p99 is None or not complete else worst_p99 <= TARGET_P99_VS_LOAD_ONLY,
    }
    out["kv_throughput_over_best_load_only_worst_load"] = {
        "target": f">= {1 - THROUGHPUT_TOLERANCE:g}",
        "measured": None if worst_tput is None else round(worst_tput, 3),
        "met": None if worst_tput is None or not complete else worst_tput >= 1 - THROUGHPUT_TOLERANCE,
    }
    return out


def causal_target(rr_p99: float, causal_floor_p99: float) -> float:
    """The p99 speedup over round-robin asked of ``kv``: ``TARGET_P99_SPEEDUP``, or less where that is beyond
    reach: the speedup of a p99 ``TARGET_FLOOR_SHARE`` of the way from round-robin's down to the causal floor's
    (``rr / (rr - share * (rr - floor))``). A floor at or above round-robin's p99 asks for no speedup at all (<= 1)."""
    reach = rr_p99 - TARGET_FLOOR_SHARE * (rr_p99 - causal_floor_p99)
    return min(TARGET_P99_SPEEDUP, rr_p99 / reach) if reach > 0 else TARGET_P99_SPEEDUP


def summarize_targets(verdicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts of the targets met, not met, not judged (``judged`` False) and not measured (a policy not run);
    ``targets_met``: every judged target met, None when one could not be measured or none was judged. A target not
    judged is never counted as met."""
    judged = [v for v in verdicts if v.get("judged", True)]
    unmeasured = [v for v in judged if v["met"] is None]
    met = sum(1 for v in judged if v["met"] is True)
    return {
        "targets_met": None if unmeasured or not judged else met == len(judged),
        "targets_count": {
            "met": met,
            "not_met": sum(1 for v in judged if v["met"] is False),
            "not_judged": len(verdicts) - len(judged),
            "not_measured": len(unmeasured),
        },
    }


# --- seeds: spread, ratios, targets over replicates ---------------------------------------------------------------


def spread(values: Sequence[float | None], nd: int = 3) -> dict[str, Any]:
    """The per-seed values with their median, min and max (of those measured: a None is kept in ``values`` and
    left out of the rest; all None gives None for each)."""
    got = [v for v in values if v is not None]
    return {
        "values": list(values),
        "median": round(statistics.median(got), nd) if got else None,
        "min": round(min(got), nd) if got else None,
        "max": round(max(got), nd) if got else None,
    }


def best_load_only(points: dict[str, dict[str, Any]], load: str) -> tuple[str, float] | None:
    """The load-only policy (``LOAD_ONLY``) with the lowest TTFT p99 at ``load`` among those run, and that p99."""
    run_here = [(points[p][load]["ttft_ms"]["p99"], p) for p in LOAD_ONLY if load in points.get(p, {})]
    run_here = [(v, p) for v, p in run_here if v is not None]
    if not run_here:
        return None
    v, p = min(run_here)
    return p, v


def compare(replicates: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per policy and load, over the replicates (seeds or slices) of one workload on one fleet: TTFT p99 and p50,
    hit rate and output tokens/s, and the p99 speedups over round-robin and over the best load-only policy of the
    same replicate and load (``best_load_only``; the policy named per replicate), each as ``spread``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    policies = list(dict.fromkeys(p for r in replicates for p in r["points"]))
    for policy in policies:
        loads = list(dict.fromkeys(x for r in replicates for x in r["points"].get(policy, {})))
        out[policy] = {}
        for load in loads:
            rows = [r["points"].get(policy, {}).get(load) for r in replicates]
            p99 = [None if row is None else row["ttft_ms"]["p99"] for row in rows]
            rr = [
                None
                if load not in r["points"].get("round_robin", {})
                else r["points"]["round_robin"][load]["ttft_ms"]["p99"]
                for r in replicates
            ]
            best = [best_load_only(r["points"], load) for r in replicates]
            out[policy][load] = {
                "ttft_p99_ms": spread(p99, 1),
                "ttft_p50_ms": spread([None if row is None else row["ttft_ms"]["p50"] for row in rows], 1),
                "hit_rate": spread([None if row is None else row["hit_rate"] for row in rows], 4),
                "output_tokens_per_s": spread([None if row is None else row["output_tokens_per_s"] for row in rows], 1),
                "p99_speedup_over_round_robin": spread([_ratio(a, b) for a, b in zip(rr, p99, strict=True)]),
                "p99_speedup_over_best_load_only": spread(
                    [_ratio(None if b is None else b[1], v) for b, v in zip(best, p99, strict=True)]
                ),
                "best_load_only": [None if b is None else b[0] for b in best],
            }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets_over_seeds(per_seed: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each target over the replicates of one workload on one fleet: ``met`` True only where it was judged on at
    least one replicate and met on every replicate where it was judged (a replicate whose oracle reuse is below a
    target's threshold does not judge it), False where it failed on any, None where a judged replicate could not
    measure it or none judged it (``judged`` False then)."""
    out: dict[str, dict[str, Any]] = {}
    keys = list(dict.fromkeys(k for t in per_seed for k in t))
    for k in keys:
        vs = [t.get(k) for t in per_seed]
        judged = [v for v in vs if v is not None and v.get("judged", True)]
        if not judged:
            met: bool | None = None
        elif any(v["met"] is False for v in judged):
            met = False
        elif any(v["met"] is None for v in judged):
            met = None
        else:
            met = True
        targets = [None if v is None else v["target"] for v in vs]
        out[k] = {
            "met": met,
            "judged": bool(judged),
            "met_count": sum(1 for v in judged if v["met"] is True),
            "judged_count": len(judged),
            "met_per_seed": [None if v is None else v["met"] for v in vs],
            "measured": spread([None if v is None else v["measured"] for v in vs]),
            "target": spread(targets) if all(isinstance(x, (int, float)) for x in targets) else targets,
        }
        if any(v is not None and "met_2x" in v for v in vs):
            out[k]["met_2x_per_seed"] = [None if v is None else v.get("met_2x") for v in vs]
        if any(v is not None and "ideal_speedup" in v for v in vs):
            out[k]["ideal_speedup"] = spread([None if v is None else v.get("ideal_speedup") for v in vs])
            out[k]["reachable_by_ideal_per_seed"] = [None if v is None else v.get("reachable_by_ideal") for v in vs]
        if any(v is not None and "ideal_cold_start_speedup" in v for v in vs):
            out[k]["ideal_cold_start_speedup"] = spread(
                [None if v is None else v.get("ideal_cold_start_speedup") for v in vs]
            )
            out[k]["reachable_by_ideal_cold_start_per_seed"] = [
                None if v is None else v.get("reachable_by_ideal_cold_start") for v in vs
            ]
    return out


# --- output -----------------------------------------------------------------------------------------------------------


def _f(x: float | None, nd: int = 0, unit: str = "") -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def table(name: str, fleet: str, agg: dict[str, Any]) -> str:
    """One workload on one fleet over its replicates: medians, [min-max] where the replicates differ."""

    def sp(x: dict[str, Any] | None, nd: int = 0, scale: float = 1.0) -> str:
        if not x or x["median"] is None:
            return "-"
        med, lo, hi = (scale * x[k] for k in ("median", "min", "max"))
        return f"{med:.{nd}f}" if lo == hi else f"{med:.{nd}f} [{lo:.{nd}f}-{hi:.{nd}f}]"

    head = (
        f"{'policy':<13} {'load':>4} {'TTFT p99 ms':>22} {'TTFT p50 ms':>16} {'hit %':>18} "
        f"{'p99 speedup vs RR':>20} {'vs best load-only':>20}"
    )
    lines = [
        f"== {name} on the {fleet} fleet, {len(agg['replicates'])} replicates (seeds {agg['seeds']}"
        + (f", rows from {[r['rows'][0] for r in agg['replicates']]}" if agg["replicates"][0].get("rows") else "")
        + f"): capacity {sp(agg['capacity_rps'], 2)} req/s, oracle reuse {sp(agg['oracle_reuse'], 1, 100)}%, "
        "causal floor p99 " + ", ".join(f"{sp(f)} ms at {x}" for x, f in agg["ttft_causal_floor_p99_ms"].items()),
        head,
        "-" * len(head),
    ]
    for policy, by_load in agg["summary"].items():
        for load, r in by_load.items():
            lines.append(
                f"{policy:<13} {load:>4} {sp(r['ttft_p99_ms']):>22} {sp(r['ttft_p50_ms']):>16} "
                f"{sp(r['hit_rate'], 1, 100):>18} {sp(r['p99_speedup_over_round_robin'], 2):>20} "
                f"{sp(r['p99_speedup_over_best_load_only'], 2):>20}"
            )
    for k, v in agg["targets"].items():
        verdict = (
            "not judged"
            if not v["judged"]
            else f"{v['met']} (met on {v['met_count']} of {v['judged_count']} replicates judged)"
        )
        target = v["target"]
        if "ideal_speedup" in v:
            verdict += f"; ideal reference {sp(v['ideal_speedup'], 3)}"
        if "ideal_cold_start_speedup" in v:
            verdict += f"; with the cold start {sp(v['ideal_cold_start_speedup'], 3)}"
        lines.append(
            f"target {k}: measured {sp(v['measured'], 3)} (target "
            f"{sp(target, 3) if isinstance(target, dict) else target[0]}): {verdict}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str | None:
    """TTFT p99 against load, one line per policy (the median over replicates, bars from min to max), one panel per
    workload and fleet, the held-out shapes last; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [
        (f"{'held out: ' if group == 'held_out' else ''}{name}", fleet, agg)
        for group in ("workloads", "held_out")
        for name, w in report[group].items()
        for fleet, agg in w["fleets"].items()
    ]
    if not panels:
        return None
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, fleet, agg) in zip(axes.flat, panels, strict=False):
        n = len(agg["summary"])
        for i, (policy, by_load) in enumerate(agg["summary"].items()):
            pts = [(float(x), r["ttft_p99_ms"]) for x, r in by_load.items() if r["ttft_p99_ms"]["median"] is not None]
            xs = [x + 0.006 * (i - (n - 1) / 2) for x, _ in pts]  # side by side, so that the bars do not overlap
            ys = [v["median"] / 1000.0 for _, v in pts]
            err = [
                [(v["median"] - v["min"]) / 1000.0 for _, v in pts],
                [(v["max"] - v["median"]) / 1000.0 for _, v in pts],
            ]
            style = "--" if policy in LOAD_ONLY else "-"
            ax.errorbar(
                xs, ys, yerr=err, fmt=style, marker="o", markersize=3, capsize=3, label=policy,
                linewidth=2.2 if policy == "kv" else 1.2,
            )  # fmt: skip
        causal = agg["ttft_causal_floor_p99_ms"]
        if causal:
            xs = [float(x) for x, f in causal.items() if f["median"] is not None]
            ys = [f["median"] / 1000.0 for f in causal.values() if f["median"] is not None]
            ax.plot(xs, ys, ":", color="black", label="causal floor (no router beats)", linewidth=1.5)
        ax.set_yscale("log")
        ax.set_title(
            f"{name} ({fleet} fleet, {len(agg['replicates'])} seeds)\noracle reuse "
            f"{100 * (agg['oracle_reuse']['median'] or 0):.0f}%, capacity {agg['capacity_rps']['median']:.2f} req/s",
            fontsize=8,
        )
        ax.set_xlabel("offered load (x round-robin capacity)", fontsize=8)
        ax.set_ylabel("TTFT p99 (s), median, min-max", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(report: dict[str, Any]) -> str:
    """The routing tables of docs/router.md from a report: per workload and fleet, load 0.8 first, medians with
    [min-max] over the replicates, ratios against round-robin and the best load-only policy, then the targets."""

    def sp(x: dict[str, Any] | None, nd: int = 0, scale: float = 1.0) -> str:
        if not x or x["median"] is None:
            return "-"
        med, lo, hi = (scale * x[k] for k in ("median", "min", "max"))
        return f"{med:.{nd}f}" if lo == hi else f"{med:.{nd}f} [{lo:.{nd}f}-{hi:.{nd}f}]"

    loads = [f"{x:g}" for x in report["loads"]]
    order = [x for x in ("0.8",) if x in loads] + [x for x in loads if x != "0.8"]
    policies = report["policies"]
    out = []
    for group, title in (("workloads", "Workloads"), ("held_out", "Held-out synthetic shapes")):
        if not report[group]:
            continue
        out.append(f"**{title}** (TTFT p99 ms, median [min-max] over the replicates)\n")
        out.append(
            "| workload | fleet | load | oracle reuse | causal floor p99 | "
            + " | ".join(policies)
            + " | kv hit | kv speedup vs RR | kv speedup vs best load-only (which) |"
        )
        out.append("|" + "---|" * (8 + len(policies)))
        for name, w in report[group].items():
            for fleet, agg in w["fleets"].items():
                for load in order:
                    kv = agg["summary"].get("kv", {}).get(load)
                    best = "-"
                    if kv:
                        names = sorted({b for b in kv["best_load_only"] if b}, key=kv["best_load_only"].count)
                        best = f"{sp(kv['p99_speedup_over_best_load_only'], 2)} ({'/'.join(reversed(names))})"
                    out.append(
                        f"| {name} | {fleet} | {load} | {sp(agg['oracle_reuse'], 1, 100)}% | "
                        f"{sp(agg['ttft_causal_floor_p99_ms'].get(load))} | "
                        + " | ".join(sp(agg["summary"].get(p, {}).get(load, {}).get("ttft_p99_ms")) for p in policies)
                        + f" | {sp(kv and kv['hit_rate'], 1, 100)}% | "
                        f"{sp(kv and kv['p99_speedup_over_round_robin'], 2)} | {best} |"
                    )
        out.append("")
        out.append(f"**{title}: targets** (met on every replicate where judged; per replicate in order)\n")
        out.append("| workload | fleet | target | measured median [min-max] | target median [min-max] | verdict |")
        out.append("|---|---|---|---|---|---|")
        for name, w in report[group].items():
            for fleet, agg in w["fleets"].items():
                for k, v in agg["targets"].items():
                    t = v["target"]
                    tt = sp(t, 3) if isinstance(t, dict) else str(t[0])
                    per = "/".join({True: "y", False: "n", None: "-"}[m] for m in v["met_per_seed"])
                    verdict = (
                        "not judged"
                        if not v["judged"]
                        else f"{'met' if v['met'] else 'NOT met' if v['met'] is False else 'unmeasured'} ({per})"
                    )
                    if "met_2x_per_seed" in v and v["judged"]:
                        verdict += "; plain 2x " + "/".join(
                            {True: "y", False: "n", None: "-"}[m] for m in v["met_2x_per_seed"]
                        )
                    if "ideal_speedup" in v and v["judged"]:
                        verdict += f"; ideal reference {sp(v['ideal_speedup'], 3)}, reachable " + "/".join(
                            {True: "y", False: "n", None: "-"}[m] for m in v["reachable_by_ideal_per_seed"]
                        )
                    if "ideal_cold_start_speedup" in v and v["judged"]:
                        verdict += (
                            f"; with the cold start {sp(v['ideal_cold_start_speedup'], 3)}, reachable "
                            + "/".join(
                                {True: "y", False: "n", None: "-"}[m]
                                for m in v["reachable_by_ideal_cold_start_per_seed"]
                            )
                        )
                    out.append(f"| {name} | {fleet} | {k} | {sp(v['measured'], 3)} | {tt} | {verdict} |")
        out.append("")
    return "\n".join(out)


# --- the sweep --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Planned:
    """One workload of the sweep and its replicates (one spec per seed or slice)."""

    group: str  # "workloads" or "held_out"
    label: str
    replicates: tuple[WorkloadSpec, ...]


def plan(args: argparse.Namespace) -> list[Planned]:
    """The workloads and their replicates: each trace in ``len(args.seeds)`` slices (``slice_start``), each synthetic
    shape and scale at each seed, and ``args.held_out`` held-out shapes (``draw_params``) at seeds never tuned on."""
    seeds = list(args.seeds)
    n = args.requests
    out: list[Planned] = []
    for t in args.trace:
        total = count_rows(t) if args.slices == "rows" else 0
        reps = tuple(
            WorkloadSpec(
                "trace",
                str(t),
                n,
                seed,
                args.vocab_size,
                args.output_tokens,
                skip_rows=slice_start(i, n, total, args.slices),
            )
            for i, seed in enumerate(seeds)
        )
        out.append(Planned("workloads", reps[0].label, reps))
    for shape in args.synthetic:
        for scale in args.synthetic_scales:
            reps = tuple(
                WorkloadSpec(
                    "synthetic", shape, synthetic_requests(n, scale), seed, args.vocab_size, args.output_tokens, scale
                )
                for seed in seeds
            )
            out.append(Planned("workloads", reps[0].label, reps))
    for j in range(args.held_out):
        shape = SHAPES[j % len(SHAPES)]
        params = draw_params(shape, random.Random(f"held-out:{j}"))
        label = f"heldout{j}_{shape}"
        reps = tuple(
            WorkloadSpec(
                "synthetic",
                shape,
                n,
                HELD_OUT_SEED_BASE + 1000 * j + i,
                args.vocab_size,
                args.output_tokens,
                params=params,
                name=label,
            )
            for i in range(len(seeds))
        )
        out.append(Planned("held_out", label, reps))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    planned = plan(args)
    host_blocks = {"host": args.host_kv_blocks, "device": 0}
    pairs = [(s, f) for p in planned for s in p.replicates for f in args.fleets]
    in_batch = args.enable_in_batch_prefix_caching
    fleets = {
        (s, f): fleet_for(s, args.workers, args.num_gpu_blocks, args.block_size, host_blocks[f], in_batch)
        for s, f in pairs
    }
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(args.jobs) as pool:
        facts = pool.map(
            _call,
            [(_oracle_task, s, fleets[s, f]) for s, f in pairs]
            + [(_capacity_task, s, fleets[s, f], s.seed) for s, f in pairs],
            chunksize=1,
        )
        oracle = dict(zip(pairs, facts[: len(pairs)], strict=True))
        capacity = dict(zip(pairs, facts[len(pairs) :], strict=True))
        for s, f in pairs:
            print(
                f"bench routing: {s.label} seed {s.seed} rows from {s.skip_rows} on the {f} fleet: capacity "
                f"{capacity[s, f]['capacity_rps']:.3f} req/s ({len(capacity[s, f]['probes'])} probes), oracle reuse "
                f"{oracle[s, f]['oracle_reuse']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        tasks = [(s, f, policy, load) for s, f in pairs for load in args.loads for policy in args.policies]
        calls: list[tuple[Any, ...]] = [
            (_run_task, s, fleets[s, f], p, capacity[s, f]["capacity_rps"] * load, s.seed) for s, f, p, load in tasks
        ]
        calls += [
            (_causal_floor_task, s, fleets[s, f], [capacity[s, f]["capacity_rps"] * x for x in args.loads])
            for s, f in pairs
        ]
        ideal_loads = [x for x in args.loads if x in TARGET_P99_LOADS] if args.ideal else []
        if ideal_loads:
            calls += [
                (_ideal_task, s, fleets[s, f], [capacity[s, f]["capacity_rps"] * x for x in ideal_loads], s.seed)
                for s, f in pairs
            ]
        results = []
        for i, r in enumerate(pool.imap(_call, calls, chunksize=1)):
            results.append(r)
            if (i + 1) % max(1, len(calls) // 20) == 0:
                print(
                    f"bench routing: {i + 1} of {len(calls)} runs, {time.perf_counter() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        causal = dict(zip(pairs, results[len(tasks) : len(tasks) + len(pairs)], strict=True))
        ideal = dict(zip(pairs, results[len(tasks) + len(pairs) :], strict=True)) if ideal_loads else {}
        results = results[: len(tasks)]
    entries: dict[tuple[WorkloadSpec, str], dict[str, Any]] = {}
    for s, f in pairs:
        e = fleets[s, f].engine
        entries[s, f] = {
            "seed": s.seed,
            "rows": [s.skip_rows, s.skip_rows + oracle[s, f]["requests"]] if s.kind == "trace" else None,
            **oracle[s, f],
            "capacity_rps": round(capacity[s, f]["capacity_rps"], 4),
            "capacity": capacity[s, f],
            "fleet": {
                "workers": fleets[s, f].workers,
                "num_gpu_blocks": e.num_gpu_blocks,
                "num_host_blocks": e.num_host_blocks,
                "block_size": e.block_size,
                "max_model_len": e.max_model_len,
                "kv_tokens_per_worker": e.num_gpu_blocks * e.block_size,
                "host_kv_tokens_per_worker": e.num_host_blocks * e.block_size,
                "enable_in_batch_prefix_caching": e.enable_in_batch_prefix_caching,
            },
            "ttft_causal_floor_ms": {f"{x:g}": c for x, c in zip(args.loads, causal[s, f], strict=True)},
            "points": {p: {} for p in args.policies},
        }
        if ideal_loads:
            entries[s, f]["ttft_ideal_ms"] = {f"{x:g}": c for x, c in zip(ideal_loads, ideal[s, f], strict=True)}
    for (s, f, policy, load), r in zip(tasks, results, strict=True):
        entries[s, f]["points"][policy][f"{load:g}"] = r
    report: dict[str, Any] = {"bench": "routing", "workloads": {}, "held_out": {}}
    verdicts: dict[str, dict[str, list[dict[str, Any]]]] = {
        g: {f: [] for f in args.fleets} for g in ("workloads", "held_out")
    }
    for p in planned:
        first = p.replicates[0]
        w: dict[str, Any] = {
            "kind": first.kind,
            "source": first.source,
            "scale": first.scale,
            "params": None if first.params is None else dataclasses.asdict(first.params.resolved(first.source)),
            "fleets": {},
        }
        for f in args.fleets:
            reps = [entries[s, f] for s in p.replicates]
            for r in reps:
                r["targets"] = check_targets(r, args.loads)
            agg = aggregate(reps)
            w["fleets"][f] = agg
            verdicts[p.group][f] += agg["targets"].values()
            print(table(p.label, f, agg), file=sys.stderr, flush=True)
        report[p.group][p.label] = w
    report["targets"] = {g: {f: summarize_targets(v) for f, v in by.items()} for g, by in verdicts.items()}
    report.update(summarize_targets([v for by in verdicts["workloads"].values() for v in by]))
    report["rules"] = {
        "load": "fractions of round-robin's capacity, the highest rate at which its queues drain (searched per "
        "replicate and fleet)",
        "replicates": f"{len(args.seeds)} per workload and fleet: synthetic shapes at seeds {list(args.seeds)}; "
        f"traces in slices of --requests rows (--slices {args.slices}: rows i*N.. where the trace has them, else its "
        "first rows under the replicate's seed); medians, min and max over them; a target holds on a workload only "
        "where met on every replicate that judges it",
        "fleets": "host: --host-kv-blocks of host-memory KV tier per worker; device: device caches only",
        "held_out": "synthetic shapes whose parameters are drawn from a generator seeded by their index "
        f"(components.sim.workloads.draw_params), run at seeds {HELD_OUT_SEED_BASE} + 1000 * index + replicate, "
        "never used while the kv cost was tuned; their targets are summarized apart",
        "best_load_only": f"per replicate and load, the lowest TTFT p99 among the load-only policies run ({LOAD_ONLY})",
        "p99_target": f"kv's p99 speedup over round-robin at {TARGET_P99_LOADS} >= min({TARGET_P99_SPEEDUP:g}, "
        f"rr / (rr - {TARGET_FLOOR_SHARE:g} * (rr - causal floor p99))) where the oracle reuse >= "
        f"{TARGET_ORACLE_MIN:g}",
        "ideal": "with --ideal: the best TTFT p99 of "
        f"{list(IDEAL_POLICIES)} on the workload without the prefixes an infinite one-worker cache serves "
        "(sim.without_cached_prefixes), at the target loads; reachable_by_ideal: round-robin's p99 over it is at least "
        "the p99 target; cold_start (ideal_cold_start_speedup, reachable_by_ideal_cold_start): the same with the cold "
        "start kept (sim.with_causal_cold_start: a request waits until the first blocks of its prompt could exist "
        "somewhere, as the causal floor chooses, or computes them itself; from then every worker holds them), TTFT "
        "counted from each request's arrival",
        "host_kv_blocks_per_worker": args.host_kv_blocks,
        "enable_in_batch_prefix_caching": "every engine (capacity search and floors' fleets included) holds a waiting "
        "request whose next uncached block a running request computes until it is stored"
        if in_batch
        else "off (vLLM's behaviour: requests admitted together compute a shared prefix each)",
        "synthetic_scales": list(args.synthetic_scales),
        "synthetic_requests": f"--requests at scale 1, {LARGE_REQUESTS_FACTOR}x above",
        "working_set": f"the fewest blocks one LRU cache needs to serve {sim.WORKING_SET_FRACTION:g} of what the "
        "infinite one-worker cache serves; its regime is read against one worker's device cache, one worker's "
        "device cache and host tier, and the fleet's memory",
        "hit_rate": "prompt tokens not computed (device cache hits and host-tier loads) over all prompt tokens; "
        "host_hit_rate: the host-tier loads",
        "ttft_floor": "each request alone on an idle worker holding what the infinite cache would (a bound no "
        "policy beats)",
        "ttft_causal_floor": "the same, where a cached block exists only from the earliest time an earlier request "
        "could have computed it (per load: it depends on the arrival times); bound and causal_bound: round-robin's "
        "p99 over these floors' p99s, the most any router could gain",
    }
    report["policies"] = list(args.policies)
    report["loads"] = list(args.loads)
    report["seeds"] = list(args.seeds)
    report["fleets"] = list(args.fleets)
    report["jobs"] = args.jobs
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.png:
        drawn = plot(report, args.png)
        report["png"] = drawn
        if drawn is None:
            print("bench routing: matplotlib is not installed (pip install 'kvmesh[bench]'): no PNG", file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
        report["markdown"] = args.markdown
    return report


def aggregate(replicates: list[dict[str, Any]]) -> dict[str, Any]:
    """One workload on one fleet over its replicates (each a single-seed entry with its ``targets``)."""
    loads = list(dict.fromkeys(x for r in replicates for x in r["ttft_causal_floor_ms"]))
    return {
        "seeds": [r["seed"] for r in replicates],
        "oracle_reuse": spread([r["oracle_reuse"] for r in replicates], 4),
        "capacity_rps": spread([r["capacity_rps"] for r in replicates], 3),
        "ttft_causal_floor_p99_ms": {
            x: spread([(r["ttft_causal_floor_ms"].get(x) or {}).get("p99") for r in replicates], 1) for x in loads
        },
        "summary": compare(replicates),
        "targets": targets_over_seeds([r["targets"] for r in replicates]),
        "replicates": replicates,
    }


def synthetic_requests(requests: int, scale: float) -> int:
    """Requests of a synthetic workload at ``scale``: ``requests``, times ``LARGE_REQUESTS_FACTOR`` above scale 1,
    so that a larger working set is reused, not only touched once (a conversation shape ``scale`` times as wide needs
    several turns of each live conversation to reach its steady state)."""
    return requests if scale <= 1 else requests * LARGE_REQUESTS_FACTOR


def _positive_floats(what: str) -> Callable[[str], list[float]]:
    def parse(s: str) -> list[float]:
        try:
            out = [float(x) for x in s.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from e
        if not out or any(not x > 0 for x in out):
            raise argparse.ArgumentTypeError(f"{what} must be > 0, got {s!r}")
        return out

    return parse


_floats = _positive_floats("loads")


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct seeds, got {s!r}")
    return out


def _fleets(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out or any(x not in FLEETS for x in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"fleets are {', '.join(FLEETS)} (comma-separated, each once), got {s!r}")
    return out


def _policies(s: str) -> list[str]:
    from components.router.names import POLICY_NAMES

    out = [x.strip() for x in s.split(",") if x.strip()]
    unknown = [p for p in out if p not in POLICY_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown polic{'y' if len(unknown) == 1 else 'ies'} {unknown}; known: {sorted(POLICY_NAMES)}"
        )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        action="append",
        default=None,
        help="a Mooncake, Azure or ShareGPT trace file (repeatable; default: the three in ../shared/traces, "
        "plus every synthetic shape unless --synthetic is given)",
    )
    p.add_argument(
        "--synthetic",
        action="append",
        default=None,
        choices=SHAPES,
        help="a synthetic prefix-sharing shape (repeatable)",
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per workload (a trace's first N rows)")
    p.add_argument("--policies", type=_policies, default=list(POLICIES), help="comma-separated")
    p.add_argument("--loads", type=_floats, default=list(LOADS), help="fractions of measured capacity, comma-separated")
    p.add_argument("--workers", type=int, default=8, help="simulated workers")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=MockEngineConfig().num_gpu_blocks,
        help="KV cache blocks per worker (default: the mock engine's; raised to hold the longest request)",
    )
    p.add_argument(
        "--host-kv-blocks",
        type=int,
        default=DEFAULT_HOST_KV_BLOCKS,
        help="host-memory KV tier per worker in blocks (loaded back at PCIe speed instead of recomputed; default: "
        "128 GiB, half a DGX H100 GPU's share of host DRAM); 0: device cache only",
    )
    p.add_argument(
        "--synthetic-scales",
        type=_positive_floats("scales"),
        default=None,
        help="sizes of each synthetic shape's shared working set, in multiples of the base shape's (default: 1 and "
        "--workers, i.e. the base and one as wide as the fleet)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--enable-in-batch-prefix-caching",
        action="store_true",
        help="every simulated engine holds a waiting request whose next uncached block a running request is "
        "computing until that block is stored, then admits it with the longer hit (MockEngineConfig."
        "enable_in_batch_prefix_caching, SGLang's in-batch prefix caching; off: vLLM's behaviour, as before). The "
        "capacity search runs on the same engines, so loads are fractions of this fleet's own capacity",
    )
    p.add_argument("--vocab-size", type=int, default=MockEngineConfig().vocab_size, help="token ids of the prompts")
    p.add_argument("--output-tokens", type=int, default=256, help="output length where a trace gives none (ShareGPT)")
    p.add_argument(
        "--seeds",
        type=_ints,
        default=list(DEFAULT_SEEDS),
        help="comma-separated: one replicate per seed (seeds the router, the prompts and the synthetic shapes; a "
        "trace's replicates are also different row slices, --slices)",
    )
    p.add_argument(
        "--slices",
        choices=("rows", "seed"),
        default="rows",
        help="a trace's replicates: rows: replicate i replays rows i*--requests on where the trace has them (else its "
        "first rows under the replicate's seed); seed: always its first rows, under each seed",
    )
    p.add_argument(
        "--fleets",
        type=_fleets,
        default=list(FLEETS),
        help="comma-separated: host (with the --host-kv-blocks tier), device (device caches only)",
    )
    p.add_argument(
        "--held-out",
        type=int,
        default=None,
        help="synthetic shapes with drawn parameters and seeds never tuned on, reported apart (default: 3 when no "
        "workload is named, else 0; given alone: these shapes only)",
    )
    p.add_argument(
        "--ideal",
        action="store_true",
        help="also replay each workload at the target loads (0.8, 1) without its cached prefixes, as if every worker "
        f"held every prefix already, under {', '.join(IDEAL_POLICIES)}: the best p99 is the ideal reference each p99 "
        "target is read against (reachable or not, beside the verdict); and again with the cold start kept (a request "
        "waits for its prefix to exist somewhere, or computes it, as the causal floor chooses)",
    )
    p.add_argument("--markdown", default="", help="also write the routing tables as Markdown to this file")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations run in parallel")
    p.add_argument("--png", default="bench-routing.png", help="where to draw TTFT p99 against load ('' for none)")


def main(args: argparse.Namespace) -> int:
    if args.trace is None and args.synthetic is None and args.held_out is None:
        args.trace = [str(TRACE_DIR / t) for t in DEFAULT_TRACES]
        args.synthetic = list(SHAPES)
        args.held_out = len(SHAPES)
    if args.held_out is None:
        args.held_out = 0
    args.trace = args.trace or []
    args.synthetic = args.synthetic or []
    if args.synthetic_scales is None:
        args.synthetic_scales = sorted({1.0, float(args.workers)})
    if args.host_kv_blocks < 0:
        print("kvmesh bench routing: --host-kv-blocks must be >= 0", file=sys.stderr)
        return 2
    missing = [t for t in args.trace if not Path(t).is_file()]
    if missing:
        print(f"kvmesh bench routing: no trace file at {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.held_out < 0:
        print("kvmesh bench routing: --held-out must be >= 0", file=sys.stderr)
        return 2
    if not args.trace and not args.synthetic and not args.held_out:
        print("kvmesh bench routing: no workload", file=sys.stderr)
        return 2
    if args.requests < 2 or args.workers < 1 or args.jobs < 1:
        print("kvmesh bench routing: --requests must be >= 2, --workers and --jobs >= 1", file=sys.stderr)
        return 2
    print(json.dumps(run(args)), flush=True)
    return 0
