"""In-batch prefix caching (``MockEngineConfig.enable_in_batch_prefix_caching``) off and on, at the same arrival
rates: TTFT p99 of each policy on `kvmesh bench routing`'s synthetic shapes, workload and fleet (1,000 requests at
scale 1, 8 workers, its default KV blocks; ``--fleets device`` device caches only, ``host`` with its host tier), at
loads relative to round-robin's capacity measured with the option OFF (``sim.find_capacity``, once per shape, seed
and fleet), so that both settings replay the very same arrivals.

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python scripts/in_batch_prefix_caching.py \\
        --shapes conversations,system_prompts --seeds 0,1,2 --loads 0.8,1 --fleets device --jobs 2

Prints one line per run and, per shape, fleet, load and setting, kv's p99 speedup over round-robin and over the best
load-only policy run (median [min-max] over seeds, and per seed), then JSON (every run) as the last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any

from components.cli.bench import routing as br
from components.sim import FleetSpec
from components.sim.analysis import find_capacity
from components.workers.simulated import MockEngineConfig


def fleet(shape: str, seed: int, where: str, on: bool) -> tuple[br.WorkloadSpec, FleetSpec]:
    spec = br.WorkloadSpec("synthetic", shape, 1000, seed, MockEngineConfig().vocab_size, 256, 1.0)
    host = br.DEFAULT_HOST_KV_BLOCKS if where == "host" else 0
    return spec, br.fleet_for(spec, 8, MockEngineConfig().num_gpu_blocks, 16, host, on)


def capacity_task(shape: str, seed: int, where: str) -> float:
    spec, f = fleet(shape, seed, where, False)
    return find_capacity(br.build(spec), f, seed)[0]


def run_task(shape: str, seed: int, where: str, on: bool, policy: str, rate: float) -> dict[str, Any]:
    spec, f = fleet(shape, seed, where, on)
    return br._run_task(spec, f, policy, rate, seed)


def call(task: tuple[Any, ...]) -> Any:
    fn, *args = task
    return fn(*args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="documents")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--loads", default="0.8,1")
    ap.add_argument("--fleets", default="device")
    ap.add_argument("--policies", default="round_robin,least_loaded,kv")
    ap.add_argument("--jobs", type=int, default=1)
    a = ap.parse_args()
    shapes, fleets, policies = a.shapes.split(","), a.fleets.split(","), a.policies.split(",")
    seeds = [int(x) for x in a.seeds.split(",")]
    loads = [float(x) for x in a.loads.split(",")]
    t0 = time.perf_counter()
    keys = [(s, seed, f) for s in shapes for seed in seeds for f in fleets]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(a.jobs) as pool:
        caps = dict(zip(keys, pool.map(call, [(capacity_task, *k) for k in keys], chunksize=1), strict=True))
        for k, c in caps.items():
            print(f"capacity {k}: {c:.3f} req/s ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        runs = [(k, on, p, x) for k in keys for x in loads for on in (False, True) for p in policies]
        results = pool.map(call, [(run_task, *k, on, p, caps[k] * x) for k, on, p, x in runs], chunksize=1)
    rows = []
    for (k, on, p, x), r in zip(runs, results, strict=True):
        rows.append({"shape": k[0], "seed": k[1], "fleet": k[2], "in_batch": on, "policy": p, "load": x, **r})
        print(
            f"{k[0]} seed {k[1]} {k[2]} load {x:g} in_batch {'on ' if on else 'off'} {p}: p99 "
            f"{r['ttft_ms']['p99']} ms p50 {r['ttft_ms']['p50']} hit {r['hit_rate']} preemptions {r['preemptions']}",
            file=sys.stderr,
        )
    p99 = {
        (r["shape"], r["seed"], r["fleet"], r["in_batch"], r["policy"], r["load"]): r["ttft_ms"]["p99"] for r in rows
    }
    summary = []
    for shape in shapes:
        for f in fleets:
            for x in loads:
                for on in (False, True):
                    vs_rr, vs_best = [], []
                    for seed in seeds:
                        kv = p99[shape, seed, f, on, "kv", x]
                        load_only = [p99[shape, seed, f, on, p, x] for p in policies if p in br.LOAD_ONLY]
                        vs_rr.append(p99[shape, seed, f, on, "round_robin", x] / kv)
                        vs_best.append(min(load_only) / kv)
                    rr_seeds = [round(v, 3) for v in vs_rr]
                    best_seeds = [round(v, 3) for v in vs_best]
                    line = {"shape": shape, "fleet": f, "load": x, "in_batch": on}
                    summary.append({**line, "kv_over_rr": rr_seeds, "kv_over_best_load_only": best_seeds})
                    print(
                        f"{shape} {f} load {x:g} in_batch {'on ' if on else 'off'}: kv speedup over RR median "
                        f"{statistics.median(vs_rr):.3f} [{min(vs_rr):.3f}-{max(vs_rr):.3f}] per seed {rr_seeds}; "
                        f"over best load-only {statistics.median(vs_best):.3f} [{min(vs_best):.3f}-{max(vs_best):.3f}] "
                        f"per seed {best_seeds}",
                        file=sys.stderr,
                    )
    caps_out = [{"shape": k[0], "seed": k[1], "fleet": k[2], "capacity_rps": round(c, 4)} for k, c in caps.items()]
    out = {"capacities": caps_out, "runs": rows, "summary": summary, "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
