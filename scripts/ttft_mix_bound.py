"""TTFT on the short/long mix (docs/rescheduler.md, "TTFT on the short/long mix: capacity and reachability"): the
off side's TTFT tail taken apart, and how much it moves by itself, at the loads of ``kvmesh bench rescheduling
--workloads llumnix --requests 4000`` (its workload, fleet and steady-state capacity on seed 0).

    PYTHONPATH=$PWD .venv/bin/python scripts/ttft_mix_bound.py --part bound      # KV never binds; where waiting is
    PYTHONPATH=$PWD .venv/bin/python scripts/ttft_mix_bound.py --part perturb    # off and on at rate x (1 + k / 1e4)

``bound``, per (dispatch, load, seed), off side: TTFT p99; the same with 1,000,000 KV blocks a worker (KV never
binds); per load-report tick (0.1 s) each worker's waiting requests x 0.1 s, split into "none" (its free blocks
cover its waiting prompts' blocks: waiting behind prefills), "imbalance" (they do not, the fleet's do) and "fleet"
(the fleet's do not either); and, for the requests at or above the run's p99, the mean share of the ticks between
arrival and first token at which the fleet was short. ``perturb``: TTFT p99 off and on (Llumnix's defaults, and
``rescheduling_neutral_load_threshold`` 0.7) at the bench's rates times ``1 + k / 10,000``; side ``pooled``: the
workload on ``sim.pooled_fleet(FLEET)`` (one engine, no dispatch choice: reported once per seed, dispatch "-").
``--capacity RPS`` skips the capacity search (7.5 min under load) with a rate already measured. One JSON line per run.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import statistics
from typing import Any

from components import sim
from components.cli.bench.rescheduling import POLICIES_ON, Spec, build, fleet_for, pct, run_cell
from components.sim import FleetSpec, Sample
from components.workers.simulated import MockEngineConfig

N = 4000
VOCAB = MockEngineConfig().vocab_size
BENCH_SEEDS = (0, 1, 2)
FLEET = fleet_for([build(Spec("llumnix", N, s, VOCAB)) for s in BENCH_SEEDS], 4, 1280)
NEVER_BINDS = FleetSpec(workers=4, engine=FLEET.engine.model_copy(update={"num_gpu_blocks": 1_000_000}))
SIDES: dict[str, dict[str, Any] | None] = {
    "off": None,
    "on": {},
    "on07": {"rescheduling_neutral_load_threshold": 0.7},
}


def capacity() -> float:
    return sim.find_capacity(build(Spec("llumnix", N, 0, VOCAB)), FLEET, 0, growth_slack=sim.GROWTH_SLACK)[0]


def bound(task: tuple[str, float, int, float]) -> dict[str, Any]:
    dispatch, load, seed, cap = task
    w = build(Spec("llumnix", N, seed, VOCAB)).at_rate(cap * load)
    bs = FLEET.engine.block_size
    waiting = {"none": 0.0, "imbalance": 0.0, "fleet": 0.0}
    ticks: list[tuple[float, bool]] = []

    def observe(s: Sample) -> None:
        if not s.loads:
            return
        free = [x.num_total_blocks - x.num_active_blocks for x in s.loads]
        need = [math.ceil(x.num_waiting_prefill_tokens / bs) for x in s.loads]
        fleet_short = sum(need) > sum(free)
        ticks.append((s.now_s, fleet_short))
        for x, f, n in zip(s.loads, free, need, strict=True):
            if x.num_waiting:
                key = "none" if n <= f else ("fleet" if fleet_short else "imbalance")
                waiting[key] += x.num_waiting * 0.1

    res = sim.replay(w, FLEET, dispatch, seed, observer=observe)
    p99 = pct(res.ttft_s, 0.99) or 0.0
    times = [t for t, _ in ticks]
    shares = []
    for r, t in zip(w.requests, res.ttft_by_request_s, strict=True):
        if t >= p99:
            window = [short for _, short in ticks[bisect.bisect_left(times, r.arrival_s) : bisect.bisect_right(
                times, r.arrival_s + t)]]  # fmt: skip
            if window:
                shares.append(sum(window) / len(window))
    free_res = sim.replay(w, NEVER_BINDS, dispatch, seed)
    return {
        "dispatch": dispatch, "load": load, "seed": seed, "ttft_p99_ms": round(1000 * p99, 1),
        "never_binds_p99_ms": round(1000 * (pct(free_res.ttft_s, 0.99) or 0.0), 1),
        "waiting_request_s": {k: round(v, 1) for k, v in waiting.items()},
        "tail_wait_fleet_short": round(statistics.mean(shares), 3) if shares else None,
    }  # fmt: skip


def perturb(task: tuple[str, float, int, str, int, float]) -> dict[str, Any]:
    dispatch, load, seed, side, k, cap = task
    if side == "pooled":
        res = sim.replay(
            build(Spec("llumnix", N, seed, VOCAB)).at_rate(cap * load * (1 + k * 1e-4)),
            sim.pooled_fleet(FLEET),
            "round_robin",
            seed,
        )
        p99 = pct(res.ttft_s, 0.99)
        return {"dispatch": "-", "load": load, "seed": seed, "side": side, "k": k,
                "ttft_p99_ms": None if p99 is None else round(1000 * p99, 1), "preemptions": res.preemptions,
                "migrations": 0}  # fmt: skip
    overrides = SIDES[side]
    r = run_cell(Spec("llumnix", N, seed, VOCAB), FLEET, dispatch, None if overrides is None else POLICIES_ON,
                 cap * load * (1 + k * 1e-4), overrides)  # fmt: skip
    return {"dispatch": dispatch, "load": load, "seed": seed, "side": side, "k": k, "ttft_p99_ms": r["ttft_p99_ms"],
            "preemptions": r["preemptions"], "migrations": r["migrations"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("bound", "perturb"), required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--ks", default="-2,-1,0,1,2", help="perturb: the k of rate x (1 + k / 10,000)")
    p.add_argument("--sides", default="off,on,on07", help="perturb: off, on (Llumnix's defaults), on07, pooled")
    p.add_argument("--capacity", type=float, default=0.0, help="req/s measured before (default: search it)")
    args = p.parse_args()
    cap = args.capacity or capacity()
    print(json.dumps({"capacity_rps": cap}), flush=True)
    cells = [(d, load, s) for d in ("least_loaded", "kv") for load in (0.8, 1.0) for s in BENCH_SEEDS]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        if args.part == "bound":
            for row in pool.imap(bound, [(*c, cap) for c in cells], chunksize=1):
                print(json.dumps(row), flush=True)
        else:
            ks = [int(x) for x in args.ks.split(",")]
            pooled_cells = [("-", load, s) for load in (0.8, 1.0) for s in BENCH_SEEDS]
            tasks = [
                (*c, side, k, cap)
                for side in args.sides.split(",")
                for c in (pooled_cells if side == "pooled" else cells)
                for k in ks
            ]
            for row in pool.imap(perturb, tasks, chunksize=1):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
