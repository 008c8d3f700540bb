"""``kvmesh bench rescheduling``: the rescheduler's policies on the simulator, rescheduling off against on, per
dispatch policy, at stated fractions of the fleet's measured capacity (issue 26's benchmark).

For each workload:

1. **Capacity**: round-robin's steady-state capacity (``sim.find_capacity`` with ``growth_slack``: the highest
   arrival rate at which its queues drain and its backlog grows by at most 2% of the arrivals, ``--capacity-rule
   steady``; ``drain``: the drain test alone, as ``kvmesh bench routing`` measures it), on the first seed's workload;
   loads (default 0.6, 0.8, 1.0, 1.2) are fractions of it, the same rates for every seed and side. The short/long
   mix needs ``--requests 4000``: its longest request alone takes 30 s, and on 400 requests the drain test passed a
   7 s burst at 58.9 req/s, 2.5x what the fleet sustains (docs/rescheduler.md, "TTFT on the short/long mix"); a
   warning says when a replay is too short for the steady-state test (a quarter of it shorter than its longest
   request alone).
2. **Causal floor**: ``sim.causal_ttft_floor_s`` at each rate (each request alone on an idle worker, a cached block
   available only once an earlier request could have computed it): what no dispatch or migration beats.
   With ``--pooled``, also the **pooled fleet** (``sim.pooled_fleet``): each seed's workload at the same rates on
   one engine with the fleet's KV, sequences and token budgets and an even share of each step's compute, no
   rescheduling: what no rescheduler beats (as far as it is optimistic: docs/rescheduler.md, "The pooled reference"),
   queueing included; reported beside the floor, and each TTFT verdict says whether it reaches the goal
   (``reachable_by_pooled``, on the medians and per seed; ``met`` does not change).
3. **Cells**: each dispatch policy (``least_loaded``, ``kv``) with rescheduling off and on, at each load, for each
   seed (the workload's seed and the router's). "On" is ``components.sim.rescheduling.PolicyRescheduler``: the live
   rescheduler's ``policy_planner`` and the migration agent's ``select_requests``, every other knob at
   ``ReschedulerConfig``'s defaults (Llumnix's). Per cell: TTFT p99, preemptions, output tokens/s over the makespan,
   the P95 KV-use imbalance (``kv_imbalance``), the prefix hit rate and the requests migrated. Each figure is the
   median over seeds with its spread (min and max).
4. **Targets** (issue 26, same dispatch, on vs off, on the medians; ``judge``): TTFT p99 at least 1.5x better at 0.8
   and 1.0 on Llumnix's setting, or at least 80% of the way to the causal floor where a 1.5x gain would pass below
   the floor; preemptions at least 50% fewer; throughput at least 98%; imbalance at least 20% lower; hit rate down at
   most 2 points. Each is ``met``, ``not met`` or ``not judged`` (with why: say, no preemption to halve); a
   ``not judged`` is never counted as met.

Workloads: ``llumnix`` (``sim.workloads.short_long_mix``: 90% short outputs, 10% very long ones, no sharing),
``trace`` (a shared trace file, read in place; default the Mooncake conversation trace) and ``documents`` (the
synthetic few-long-documents shape).

The policies run by default: ``neutral_load`` and ``binpacking_mitigation``. Llumnix's default list is
``decode_load`` plus the failovers; the simulated fleet is aggregated (Llumnix's "neutral" role), where
``decode_load`` finds no worker, so its aggregated twin ``neutral_load`` runs, and the failovers have nothing to do
on a fleet where no worker fails. ``binpacking_consolidation`` is left out: it empties lightly loaded workers into
fuller ones for a scale-down, the opposite of balancing a static fleet.

The fleet: ``--workers`` (default 4) mock engines with ``--num-gpu-blocks`` (default 1,280 blocks of 16 = 20,480
tokens of KV each, about LLaMA-7B's KV room on a 24 GB A10, the GPU of Llumnix's evaluation: 24 GB less 13.5 GB of
weights at 512 KiB per token), raised to hold a workload's longest request. A small cache is the point: with the
mock engine's default 262,144 tokens per worker nothing here would ever fill one.

Default size: 400 requests per workload, 3 seeds, 2 processes: 384 s wall on 2 shared cores when it was run (with
the drain test; ``--workloads llumnix --requests 4000 --loads 0.8,1.0``: 108 s)
(``--requests`` and ``--seeds`` shrink it; the end-to-end test runs 40 requests on one worker, one load, two
seeds). JSON is the last line on stdout, a table per workload on stderr, ``--png`` (default
``bench-rescheduling.png``) draws TTFT p99 against load, off (dashed) and on (solid) per dispatch policy, one panel
per workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from components import sim
from components.rescheduler.config import Policy, ReschedulerConfig
from components.sim import FleetSpec, Sample, Workload
from components.sim.rescheduling import PolicyRescheduler
from components.sim.workloads import from_trace, short_long_mix, synthetic
from components.workers.simulated import MockEngineConfig

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
WORKLOADS = ("llumnix", "trace", "documents")
DISPATCH = ("least_loaded", "kv")
LOADS = (0.6, 0.8, 1.0, 1.2)
POLICIES_ON = ("neutral_load", "binpacking_mitigation")
DEFAULT_WORKERS = 4
DEFAULT_GPU_BLOCKS = 1280  # 20,480 tokens: LLaMA-7B's KV room on a 24 GB A10 (module docstring)
DEFAULT_REQUESTS = 400
DEFAULT_SEEDS = 3
# Targets (issue 26).
TTFT_SPEEDUP = 1.5
TTFT_LOADS = (0.8, 1.0)
TTFT_FLOOR_SHARE = 0.8  # of the way from off's p99 to the causal floor
PREEMPTION_CUT = 0.5  # on at most this fraction of off
THROUGHPUT_KEEP = 0.98
IMBALANCE_CUT = 0.8  # on at most this fraction of off
HIT_RATE_DROP = 0.02  # at most this many points (as a fraction) lower
IMBALANCE_Q = 0.95
MET, NOT_MET, NOT_JUDGED = "met", "not met", "not judged"


# --- pure parts ---------------------------------------------------------------------------------------------------


def pct(xs: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (``kvmesh bench routing``'s); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def kv_spread(kv_usage: Sequence[float]) -> float:
    """One instant's KV-use imbalance across workers: max minus min of their KV use (blocks in use over total, 0..1).
    The difference, not max/mean: an idle fleet (every worker near 0) then counts as balanced instead of dividing
    by almost nothing."""
    return max(kv_usage) - min(kv_usage) if kv_usage else 0.0


def kv_imbalance(samples: Sequence[Sequence[float]], q: float = IMBALANCE_Q) -> float | None:
    """The ``q`` quantile (P95) over sampled instants of ``kv_spread``; ``samples`` are the instants' per-worker KV
    uses (the load-report ticks while some request was in flight). None: no instant."""
    return pct([kv_spread(s) for s in samples], q)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    status: str  # MET, NOT_MET or NOT_JUDGED
    why: str

    def to_dict(self) -> dict[str, str]:
        return {"status": self.status, "why": self.why}


def ttft_goal(off: float | None, floor: float | None) -> tuple[float, str] | None:
    """The TTFT p99 (ms) the target asks of the 'on' side given off's: ``off / TTFT_SPEEDUP``, or, where that is below
    the causal floor (no dispatch reaches it), 80% of the way from off to the floor; and how it was set. None: no
    off measured."""
    if off is None or off <= 0:
        return None
    goal = off / TTFT_SPEEDUP
    how = f"{TTFT_SPEEDUP:g}x: <= {goal:.1f} ms"
    if floor is not None and goal < floor:
        goal = off - TTFT_FLOOR_SHARE * (off - floor)
        how = f"1.5x passes below the causal floor {floor:.1f} ms; 80% of the way to it: <= {goal:.1f} ms"
    return goal, how


def judge_ttft(off: float | None, on: float | None, floor: float | None) -> Verdict:
    """TTFT p99 at least ``TTFT_SPEEDUP`` x better (on <= off / 1.5), or, where off / 1.5 is below the causal floor
    (no dispatch reaches it), at least 80% of the way from off to the floor (on <= off - 0.8 (off - floor))."""
    g = ttft_goal(off, floor)
    if g is None or on is None or off is None:
        return Verdict(NOT_JUDGED, "no TTFT measured")
    goal, how = g
    return Verdict(
        MET if on <= goal else NOT_MET, f"off {off:.1f} ms, on {on:.1f} ms ({off / max(on, 1e-9):.2f}x); {how}"
    )


def reachable_by_pooled(off: float | None, floor: float | None, pooled: float | None) -> bool | None:
    """Whether the pooled fleet's TTFT p99 (``sim.pooled_fleet``: the workers as one engine, meant as an optimistic
    reference for any rescheduler) meets the goal ``ttft_goal`` sets from ``off``. False: not even the pooled fleet
    reaches it, so the target is out of reach of every rescheduler as far as that reference is optimistic, which
    it is not everywhere (docs/rescheduler.md, "The pooled reference": on the short/long mix at 0.8, ``kv`` without
    rescheduling beats it); True: the reference does not rule the target out. None: a figure is missing."""
    g = ttft_goal(off, floor)
    if g is None or pooled is None:
        return None
    return pooled <= g[0]


def judge_at_most(what: str, off: float | None, on: float | None, fraction: float) -> Verdict:
    """``on`` at most ``fraction`` of ``off`` (a cut); not judged where off is 0 or missing (nothing to cut)."""
    if off is None or on is None:
        return Verdict(NOT_JUDGED, f"no {what} measured")
    if off <= 0:
        return Verdict(NOT_JUDGED, f"off has no {what} ({off:g}): nothing to cut")
    return Verdict(
        MET if on <= fraction * off else NOT_MET,
        f"off {off:g}, on {on:g} ({on / off:.2f} of off; goal <= {fraction:g})",
    )


def judge_throughput(off: float | None, on: float | None) -> Verdict:
    if off is None or on is None or off <= 0:
        return Verdict(NOT_JUDGED, "no throughput measured")
    return Verdict(
        MET if on >= THROUGHPUT_KEEP * off else NOT_MET,
        f"off {off:g}, on {on:g} tokens/s ({on / off:.3f}; goal >= {THROUGHPUT_KEEP:g})",
    )


def judge_hit_rate(off: float | None, on: float | None) -> Verdict:
    if off is None or on is None:
        return Verdict(NOT_JUDGED, "no hit rate measured")
    return Verdict(
        MET if on >= off - HIT_RATE_DROP - 1e-12 else NOT_MET,
        f"off {100 * off:.2f}%, on {100 * on:.2f}% ({100 * (on - off):+.2f} points; goal >= -2)",
    )


def judge(
    workload: str,
    load: float,
    off: dict[str, Any],
    on: dict[str, Any],
    floor_p99_ms: float | None,
    pooled: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every target for one (workload, dispatch, load): on vs off medians (``off``/``on``: a cell's ``median``).

    ``pooled`` (``--pooled``): the pooled fleet's TTFT p99 at this load, ``{"median": ms, "per_seed": [ms, ...]}``,
    and ``off_per_seed``, off's TTFT p99 of each seed in the same order: the TTFT verdict then says beside ``status``
    whether the pooled reference reaches the goal (``reachable_by_pooled``, on the medians, and per seed); the
    status itself does not change."""
    out: dict[str, dict[str, Any]] = {}
    if workload == "llumnix" and load in TTFT_LOADS:
        out["ttft_p99"] = judge_ttft(off.get("ttft_p99_ms"), on.get("ttft_p99_ms"), floor_p99_ms).to_dict()
        if pooled is not None:
            t = out["ttft_p99"]
            t["pooled_p99_ms"] = pooled.get("median")
            t["reachable_by_pooled"] = reachable_by_pooled(off.get("ttft_p99_ms"), floor_p99_ms, pooled.get("median"))
            t["reachable_by_pooled_per_seed"] = [
                reachable_by_pooled(o, floor_p99_ms, p)
                for o, p in zip(pooled.get("off_per_seed", []), pooled.get("per_seed", []), strict=True)
            ]
    else:
        out["ttft_p99"] = Verdict(NOT_JUDGED, "judged on Llumnix's setting at 0.8 and 1.0 only").to_dict()
    out["preemptions"] = judge_at_most(
        "preemptions", off.get("preemptions"), on.get("preemptions"), PREEMPTION_CUT
    ).to_dict()
    out["throughput"] = judge_throughput(off.get("output_tokens_per_s"), on.get("output_tokens_per_s")).to_dict()
    out["kv_imbalance_p95"] = judge_at_most(
        "KV-use imbalance", off.get("kv_imbalance_p95"), on.get("kv_imbalance_p95"), IMBALANCE_CUT
    ).to_dict()
    out["hit_rate"] = judge_hit_rate(off.get("hit_rate"), on.get("hit_rate")).to_dict()
    return out


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, min and max over seeds (None values left out; all None: None)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# --- workloads and cells ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """How to build one workload for one seed (picklable: every worker process builds its own copy)."""

    name: str  # llumnix, trace or documents
    requests: int
    seed: int
    vocab_size: int
    trace: str = ""


@functools.lru_cache(maxsize=8)
def build(spec: Spec) -> Workload:
    if spec.name == "llumnix":
        return short_long_mix(spec.requests, vocab_size=spec.vocab_size, seed=spec.seed)
    if spec.name == "trace":
        return from_trace(spec.trace, spec.requests, vocab_size=spec.vocab_size, seed=spec.seed)
    if spec.name == "documents":
        return synthetic("documents", spec.requests, vocab_size=spec.vocab_size, seed=spec.seed)
    raise ValueError(f"unknown workload {spec.name!r}; known: {', '.join(WORKLOADS)}")


def fleet_for(ws: Sequence[Workload], workers: int, num_gpu_blocks: int, block_size: int = 16) -> FleetSpec:
    """``workers`` mock engines of ``num_gpu_blocks`` blocks, the context (and the cache) raised to hold the longest
    request of any of the workloads (every seed's: a seed draws other lengths), as ``kvmesh bench routing``'s
    ``fleet_for``."""
    longest = max(len(r.prompt) + r.max_tokens for w in ws for r in w.requests)
    max_len = max(MockEngineConfig().max_model_len, -(-longest // 1024) * 1024)
    blocks = max(num_gpu_blocks, -(-max_len // block_size) + 1)
    engine = MockEngineConfig(max_model_len=max_len, num_gpu_blocks=blocks, block_size=block_size)
    return FleetSpec(workers=workers, engine=engine)


class _KvSamples:
    """The replay's observer: each load-report tick's per-worker KV use while some request is in flight."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, ...]] = []

    def __call__(self, s: Sample) -> None:
        if s.arrived > s.finished and s.loads:
            self.samples.append(tuple(x.kv_usage for x in s.loads))


def _config_field(text: str) -> tuple[str, str]:
    """``FIELD=VALUE`` of ``--set``: a ReschedulerConfig field (checked when the config is built: pydantic's error)."""
    field, sep, value = text.partition("=")
    if not sep or field not in ReschedulerConfig.model_fields:
        raise argparse.ArgumentTypeError(
            f"expected FIELD=VALUE with FIELD one of ReschedulerConfig's: {', '.join(ReschedulerConfig.model_fields)}"
        )
    return field, value


def run_cell(
    spec: Spec,
    fleet: FleetSpec,
    dispatch: str,
    policies: Sequence[str] | None,
    rate: float,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One replay: ``policies`` None = rescheduling off; ``overrides``: ReschedulerConfig fields of the 'on' side
    (``--set``)."""
    w = build(spec).at_rate(rate)
    samples = _KvSamples()
    resched = None
    if policies is not None:
        resched = PolicyRescheduler(
            ReschedulerConfig(
                enable_rescheduling=True, rescheduling_policies=[Policy(p) for p in policies], **dict(overrides or {})
            )
        )
    t0 = time.process_time()
    res = sim.replay(w, fleet, dispatch, spec.seed, observer=samples, rescheduler=resched)
    ttft_p99 = pct(res.ttft_s, 0.99)
    return {
        "ttft_p99_ms": None if ttft_p99 is None else round(1000 * ttft_p99, 1),
        "preemptions": res.preemptions,
        "output_tokens_per_s": round(res.output_tokens / res.makespan_s, 1) if res.makespan_s > 0 else None,
        "kv_imbalance_p95": kv_imbalance(samples.samples),
        "hit_rate": round(res.hit_rate, 4),
        "migrations": res.migrations,
        "migrations_refused": res.migrations_refused,
        "rescheduler": None if resched is None else resched.counters(),
        "cpu_s": round(time.process_time() - t0, 2),
    }


def _capacity(spec: Spec, fleet: FleetSpec, rule: str = "steady") -> dict[str, Any]:
    """``sim.find_capacity`` with ``rule`` ``steady`` (the drain test and the backlog's growth, ``GROWTH_SLACK``) or
    ``drain`` (the drain test alone, this benchmark's rule before: loose on the short/long mix, docs/rescheduler.md)."""
    slack = sim.GROWTH_SLACK if rule == "steady" else None
    w = build(spec)
    capacity, probes = sim.find_capacity(w, fleet, spec.seed, growth_slack=slack)
    return {
        "capacity_rps": capacity,
        "probes": len(probes),
        # The steady-state test leaves the first quarter of the arrivals out as the fleet's filling; a replay whose
        # quarter is shorter than its longest request alone has not filled by then (its capacity errs low).
        "span_s": w.at_rate(capacity).span_s,
        "longest_alone_s": sim.isolated_service_s(w, fleet),
        "probe_detail": [
            {"rate_rps": round(p.rate, 4), "drain_s": round(p.drain_s, 2), "allowed_s": round(p.allowed_s, 2),
             "growth": None if p.growth is None else round(p.growth, 4), "drained": p.drained}
            for p in probes
        ],
    }  # fmt: skip


def _floor(spec: Spec, fleet: FleetSpec, rates: Sequence[float]) -> list[float | None]:
    w = build(spec)
    hashes = sim.PromptBlocks([r.prompt for r in w.requests], fleet.engine.block_size).hashes
    out = []
    for rate in rates:
        p99 = pct(sim.causal_ttft_floor_s(w.at_rate(rate), fleet, hashes), 0.99)
        out.append(None if p99 is None else round(1000 * p99, 1))
    return out


def _pooled(spec: Spec, fleet: FleetSpec, rates: Sequence[float]) -> list[dict[str, Any]]:
    """Per rate, the TTFT p99 and preemptions of the workload replayed on ``sim.pooled_fleet(fleet)`` (one engine
    with the fleet's KV and its compute spread evenly; no dispatch choice, no rescheduling)."""
    w = build(spec)
    pooled = sim.pooled_fleet(fleet)
    out = []
    for rate in rates:
        res = sim.replay(w.at_rate(rate), pooled, "round_robin", spec.seed)
        p99 = pct(res.ttft_s, 0.99)
        out.append({"ttft_p99_ms": None if p99 is None else round(1000 * p99, 1), "preemptions": res.preemptions})
    return out


def _call(task: tuple[Any, ...]) -> Any:
    fn, *args = task
    return fn(*args)


METRICS = ("ttft_p99_ms", "preemptions", "output_tokens_per_s", "kv_imbalance_p95", "hit_rate", "migrations")


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    seeds = list(range(args.seed, args.seed + args.seeds))
    specs = {
        (name, s): Spec(name, args.requests, s, args.vocab_size, args.trace if name == "trace" else "")
        for name in args.workloads
        for s in seeds
    }
    # One fleet per workload, holding every seed's longest request (every seed gets the same engines).
    fleets = {
        name: fleet_for([build(specs[name, s]) for s in seeds], args.workers, args.num_gpu_blocks)
        for name in args.workloads
    }
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(args.jobs) as pool:
        caps = pool.map(
            _call, [(_capacity, specs[n, seeds[0]], fleets[n], args.capacity_rule) for n in args.workloads], chunksize=1
        )
        capacity = {n: c for n, c in zip(args.workloads, caps, strict=True)}
        for n in args.workloads:
            c = capacity[n]
            print(f"bench rescheduling: {n}: capacity {c['capacity_rps']:.3f} req/s", file=sys.stderr, flush=True)
            if c["span_s"] / 4 < c["longest_alone_s"]:
                print(
                    f"bench rescheduling: {n}: a quarter of the replay ({c['span_s'] / 4:.1f} s at capacity) is "
                    f"shorter than its longest request alone ({c['longest_alone_s']:.1f} s): too short for a steady "
                    "state (more --requests)",
                    file=sys.stderr,
                    flush=True,
                )
        sides: list[tuple[str, tuple[str, ...] | None]] = [("off", None), ("on", tuple(args.policies_on))]
        tasks = [
            (n, d, side, load, s)
            for n in args.workloads
            for load in args.loads
            for d in args.dispatch
            for side, _ in sides
            for s in seeds
        ]
        pol = dict(sides)
        jobs: list[tuple[Any, ...]] = [
            (run_cell, specs[n, s], fleets[n], d, pol[side], capacity[n]["capacity_rps"] * load, dict(args.set))
            for n, d, side, load, s in tasks
        ]
        jobs += [
            (_floor, specs[n, seeds[0]], fleets[n], [capacity[n]["capacity_rps"] * x for x in args.loads])
            for n in args.workloads
        ]
        nf = len(tasks) + len(args.workloads)
        if args.pooled:
            jobs += [
                (_pooled, specs[n, s], fleets[n], [capacity[n]["capacity_rps"] * x for x in args.loads])
                for n in args.workloads
                for s in seeds
            ]
        results = pool.map(_call, jobs, chunksize=1)
    floors = {n: f for n, f in zip(args.workloads, results[len(tasks) : nf], strict=True)}
    pooled_runs = (
        dict(zip([(n, s) for n in args.workloads for s in seeds], results[nf:], strict=True)) if args.pooled else {}
    )
    cells: dict[tuple[str, str, str, float], list[dict[str, Any]]] = {}
    for (n, d, side, load, _s), r in zip(tasks, results[: len(tasks)], strict=True):
        cells.setdefault((n, d, side, load), []).append(r)
    report: dict[str, Any] = {"bench": "rescheduling", "workloads": {}}
    counts = {MET: 0, NOT_MET: 0, NOT_JUDGED: 0}
    for n in args.workloads:
        e = fleets[n].engine
        w = build(specs[n, seeds[0]])
        entry: dict[str, Any] = {
            "requests": len(w.requests),
            "capacity_rps": round(capacity[n]["capacity_rps"], 4),
            "capacity_probes": capacity[n]["probes"],
            "capacity_probe_detail": capacity[n]["probe_detail"],
            "capacity_rule": args.capacity_rule,
            "capacity_span_s": round(capacity[n]["span_s"], 1),
            "longest_alone_s": round(capacity[n]["longest_alone_s"], 1),
            "fleet": {
                "workers": fleets[n].workers,
                "num_gpu_blocks": e.num_gpu_blocks,
                "block_size": e.block_size,
                "max_model_len": e.max_model_len,
            },
            "ttft_causal_floor_p99_ms": {f"{x:g}": f for x, f in zip(args.loads, floors[n], strict=True)},
            "points": {},
            "targets": {},
        }
        if args.pooled:
            # The pooled fleet's TTFT p99 and preemptions per load, median and spread over seeds, each seed's in order.
            entry["ttft_pooled_p99_ms"] = {}
            for i, x in enumerate(args.loads):
                runs = [pooled_runs[n, s][i] for s in seeds]
                entry["ttft_pooled_p99_ms"][f"{x:g}"] = {
                    k: None if v is None else round(v, 1) for k, v in spread([r["ttft_p99_ms"] for r in runs]).items()
                } | {
                    "per_seed": [r["ttft_p99_ms"] for r in runs],
                    "preemptions_per_seed": [r["preemptions"] for r in runs],
                }
        for d in args.dispatch:
            entry["points"][d] = {}
            entry["targets"][d] = {}
            for load in args.loads:
                by_side: dict[str, dict[str, Any]] = {}
                for side, _ in sides:
                    runs = cells[n, d, side, load]
                    by_side[side] = {
                        "median": {m: spread([r[m] for r in runs])["median"] for m in METRICS},
                        "spread": {m: spread([r[m] for r in runs]) for m in METRICS},
                        "per_seed": runs,
                    }
                entry["points"][d][f"{load:g}"] = by_side
                pooled = None
                if args.pooled:
                    pooled = entry["ttft_pooled_p99_ms"][f"{load:g}"] | {
                        "off_per_seed": [r["ttft_p99_ms"] for r in by_side["off"]["per_seed"]]
                    }
                verdicts = judge(
                    n,
                    load,
                    by_side["off"]["median"],
                    by_side["on"]["median"],
                    entry["ttft_causal_floor_p99_ms"][f"{load:g}"],
                    pooled,
                )
                entry["targets"][d][f"{load:g}"] = verdicts
                for v in verdicts.values():
                    counts[v["status"]] += 1
        report["workloads"][n] = entry
        print(table(n, entry, args.dispatch, args.loads), file=sys.stderr, flush=True)
    report["target_counts"] = counts
    report["rules"] = {
        "load": "fractions of round-robin's capacity on the first seed's workload: "
        + (
            "the highest rate at which its queues drain and its backlog grows by at most "
            f"{sim.GROWTH_SLACK:g} of the arrivals (sim.find_capacity with growth_slack)"
            if args.capacity_rule == "steady"
            else "the highest rate at which its queues drain, searched as kvmesh bench routing does"
        ),
        "on": f"PolicyRescheduler with policies {list(args.policies_on)}, fields set {dict(args.set)}, every other "
        "ReschedulerConfig field at its default (Llumnix's)",
        "kv_imbalance_p95": "P95 over load-report ticks (every 100 ms, while a request is in flight) of max - min "
        "of the workers' KV use (blocks in use / total)",
        "median": f"over seeds {seeds}; spread: min and max",
        "targets": "on vs off medians, same dispatch; 'not judged' never counts as met",
    }
    if args.pooled:
        report["rules"]["pooled"] = (
            "with --pooled: each seed's workload at the same rates on sim.pooled_fleet (the workers as one engine: "
            "their KV blocks, sequences and token budgets added, decode_base_ms kept, the other step-time "
            "coefficients over N, prefill_ms_per_token_sq over N**2), no rescheduling; reachable_by_pooled: its TTFT "
            "p99 meets the goal the TTFT target sets from off's (medians; per seed: each seed's off and pooled)"
        )
    report.update(
        dispatch=list(args.dispatch), loads=list(args.loads), seeds=seeds, policies_on=list(args.policies_on),
        jobs=args.jobs, wall_s=round(time.perf_counter() - t0, 1),
    )  # fmt: skip
    if args.png:
        drawn = plot(report, args.png)
        report["png"] = drawn
        if drawn is None:
            print(
                "bench rescheduling: matplotlib is not installed (pip install 'kvmesh[bench]'): no PNG", file=sys.stderr
            )
    return report


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(name: str, entry: dict[str, Any], dispatch: Sequence[str], loads: Sequence[float]) -> str:
    lines = [f"== {name}: capacity {entry['capacity_rps']:.3f} req/s, {entry['requests']} requests"]
    lines.append(
        f"{'dispatch':<13}{'load':>5} {'side':<4}{'ttft p99 ms':>12}{'floor':>8}{'pooled':>8}{'preempt':>8}{'tok/s':>9}"
        f"{'imbal95':>8}{'hit':>7}{'migr':>6}"
    )
    for d in dispatch:
        for load in loads:
            key = f"{load:g}"
            for side in ("off", "on"):
                m = entry["points"][d][key][side]["median"]
                floor = entry["ttft_causal_floor_p99_ms"][key]
                pooled = (entry.get("ttft_pooled_p99_ms") or {}).get(key, {}).get("median")
                lines.append(
                    f"{d:<13}{key:>5} {side:<4}{_f(m['ttft_p99_ms']):>12}{_f(floor):>8}{_f(pooled):>8}"
                    f"{_f(m['preemptions'], 0):>8}{_f(m['output_tokens_per_s'], 0):>9}{_f(m['kv_imbalance_p95'], 3):>8}"
                    f"{_f(m['hit_rate'], 3):>7}{_f(m['migrations'], 0):>6}"
                )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str | None:
    """TTFT p99 (median over seeds, bars: min to max) against load, off dashed and on solid per dispatch policy, the
    causal floor dotted, the pooled fleet's (``--pooled``) dash-dotted; one panel per workload. None when matplotlib
    is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(report["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.2), squeeze=False)
    colors = {"least_loaded": "tab:blue", "kv": "tab:orange"}
    for ax, name in zip(axes.flat, names, strict=False):
        entry = report["workloads"][name]
        for d, by_load in entry["points"].items():
            for side, style in (("off", "--"), ("on", "-")):
                xs, ys, lo, hi = [], [], [], []
                for x, cell in by_load.items():
                    s = cell[side]["spread"]["ttft_p99_ms"]
                    if s["median"] is None:
                        continue
                    xs.append(float(x))
                    ys.append(s["median"] / 1000.0)
                    lo.append((s["median"] - s["min"]) / 1000.0)
                    hi.append((s["max"] - s["median"]) / 1000.0)
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, marker="o", capsize=3, color=colors.get(d),
                            label=f"{d}, rescheduling {side}")  # fmt: skip
        floor = entry["ttft_causal_floor_p99_ms"]
        fx = [float(x) for x, v in floor.items() if v is not None]
        fy = [v / 1000.0 for v in floor.values() if v is not None]
        if fx:
            ax.plot(fx, fy, ":", color="black", label="causal floor")
        pooled = entry.get("ttft_pooled_p99_ms") or {}
        px = [float(x) for x, v in pooled.items() if v["median"] is not None]
        py = [v["median"] / 1000.0 for v in pooled.values() if v["median"] is not None]
        if px:
            ax.plot(px, py, "-.", marker="s", color="tab:green", label="pooled fleet (one engine)")
        ax.set_yscale("log")
        ax.set_title(f"{name}\ncapacity {entry['capacity_rps']:.2f} req/s", fontsize=9)
        ax.set_xlabel("offered load (x round-robin capacity)")
        ax.set_ylabel("TTFT p99 (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- flags --------------------------------------------------------------------------------------------------------


def _list(known: Sequence[str] | None, what: str) -> Any:
    def parse(s: str) -> list[str]:
        out = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in out if known is not None and x not in known]
        if not out or bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad or s!r}; known: {', '.join(known or ())}")
        return out

    return parse


def _loads(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from e
    if not out or any(not x > 0 for x in out):
        raise argparse.ArgumentTypeError(f"loads must be > 0, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", type=_list(WORKLOADS, "workload"), default=list(WORKLOADS), help="comma-separated")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="the shared trace of the 'trace' workload")
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per workload (default 400)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per cell (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--loads", type=_loads, default=list(LOADS), help="fractions of measured capacity")
    p.add_argument(
        "--capacity-rule",
        choices=("steady", "drain"),
        default="steady",
        help="steady (default): round-robin's queues drain and its backlog does not grow (sim.GROWTH_SLACK); drain: "
        "the drain test alone (kvmesh bench routing's; before: loose where one request alone outlasts the replay)",
    )
    p.add_argument("--dispatch", type=_list(DISPATCH, "dispatch policy"), default=list(DISPATCH))
    p.add_argument(
        "--policies-on",
        type=_list([str(x) for x in Policy], "rescheduling policy"),
        default=list(POLICIES_ON),
        help="the rescheduling policies of the 'on' side (default neutral_load,binpacking_mitigation)",
    )
    p.add_argument(
        "--set",
        type=_config_field,
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a ReschedulerConfig field of the 'on' side (repeatable), e.g. rescheduling_req_select_rule=num_requests "
        "--set rescheduling_req_select_value=1; every other field keeps its default (Llumnix's)",
    )
    p.add_argument(
        "--pooled",
        action="store_true",
        help="also replay each seed's workload at the same rates on the pooled fleet (sim.pooled_fleet: the workers "
        "as one engine with all their KV, compute spread evenly, no rescheduling): its TTFT p99 is reported beside "
        "the causal floor, and each TTFT verdict says whether it reaches the goal (reachable_by_pooled)",
    )
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="simulated workers (default 4)")
    p.add_argument("--num-gpu-blocks", type=int, default=DEFAULT_GPU_BLOCKS, help="KV blocks per worker (1280)")
    p.add_argument("--vocab-size", type=int, default=MockEngineConfig().vocab_size)
    p.add_argument("--jobs", type=int, default=2, help="simulations run in parallel (default 2)")
    p.add_argument("--png", default="bench-rescheduling.png", help="where to draw TTFT p99 against load ('' none)")


def main(args: argparse.Namespace) -> int:
    if "trace" in args.workloads and not Path(args.trace).is_file():
        print(f"kvmesh bench rescheduling: no trace file at {args.trace}", file=sys.stderr)
        return 2
    if args.requests < 2 or args.seeds < 1 or args.workers < 1 or args.jobs < 1:
        print("kvmesh bench rescheduling: --requests >= 2, --seeds, --workers and --jobs >= 1", file=sys.stderr)
        return 2
    print(json.dumps(run(args)), flush=True)
    return 0
