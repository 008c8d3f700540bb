"""Hot-prefix replication on the documents shape: TTFT p99 of round-robin, kv, and kv with replication, at loads
relative to round-robin's measured capacity, as `kvmesh bench routing` measures them (its workload, fleet and
``find_capacity``; 1,000 requests, 8 workers, its default KV blocks and host tier), for several seeds.

    PYTHONPATH=$PWD .venv/bin/python scripts/replication_documents.py --seeds 0,1,2 --loads 0.8,1.0 --targets 500,100

Prints one line per run and, per load and target, the median and range over seeds of round-robin's p99 over kv's
and over kv with replication's. ``p99 after 50``: the p99 of requests after the first 50 (the cold start's burst,
where no holder exists yet, left out), a diagnostic only.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

from components.cli.bench import routing as br
from components.rescheduler.config import ReplicationConfig
from components.sim.analysis import find_capacity
from components.sim.replication import PolicyReplicator
from components.workers.simulated import MockEngineConfig

replay_module = importlib.import_module("components.sim.replay")  # the package exports the function under its name


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--loads", default="0.8,1.0")
    ap.add_argument("--targets", default="500", help="prefix_replication_target_ttft_ms values")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    targets = [float(x) for x in args.targets.split(",")]
    ratios: dict[tuple[float, str], list[float]] = {}
    for seed in seeds:
        spec = br.WorkloadSpec("synthetic", "documents", 1000, seed, MockEngineConfig().vocab_size, 256, 1.0)
        fleet = br.fleet_for(spec, 8, MockEngineConfig().num_gpu_blocks, 16, br.DEFAULT_HOST_KV_BLOCKS)
        w = br.build(spec)
        cap, _ = find_capacity(w, fleet, seed)
        for load in loads:
            wl = w.at_rate(cap * load)
            runs = {policy: replay_module.replay(wl, fleet, policy, seed) for policy in ("round_robin", "kv")}
            copies = {}
            for t in targets:
                rep = PolicyReplicator(
                    ReplicationConfig(prefix_replication_target_ttft_ms=t), model=replay_module.MODEL
                )
                runs[f"kv+rep{t:g}"] = replay_module.replay(wl, fleet, "kv", seed, replicator=rep)
                copies[f"kv+rep{t:g}"] = rep.copies
            rr = p99(runs["round_robin"].ttft_s)
            for name, r in runs.items():
                assert r is not None
                after = p99(r.ttft_by_request_s[50:])
                print(
                    f"seed {seed} capacity {cap:.2f} load {load} {name}: p99 {1000 * p99(r.ttft_s):.1f} ms, "
                    f"p99 after 50 {1000 * after:.1f} ms, hit {r.hit_rate:.3f}, copies {copies.get(name, '-')}",
                    flush=True,
                )
                if name != "round_robin":
                    ratios.setdefault((load, name), []).append(rr / p99(r.ttft_s))
    for (load, name), xs in sorted(ratios.items()):
        print(
            f"load {load} round-robin p99 / {name} p99: median {statistics.median(xs):.3f}, "
            f"range {min(xs):.3f}-{max(xs):.3f} over {len(xs)} seeds"
        )


if __name__ == "__main__":
    main()
