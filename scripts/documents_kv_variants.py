"""`kv` on the documents shape with the variants tried for its cold start (docs/router.md, "2026-11-30, seventh
session"): hot-prefix replication from the rescheduler's policy (``repT``: ``PolicyReplicator`` with
``prefix_replication_target_ttft_ms`` T), a larger provisional-block cap (``capN``: the router's
``MAX_PROVISIONAL_BLOCKS`` set to N for this process only), or both (``capN+repT``); ``base`` is `kv` as it is. The
workload and fleet are `kvmesh bench routing`'s (1,000 requests, 8 workers, device caches only); the rates are
``load`` times ``--capacity``, round-robin's capacity as the bench measured it (its JSON's
``capacity.capacity_rps``, all digits: the p99 moves with the fourth).

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python scripts/documents_kv_variants.py --seed 4 \\
        --capacity 61.45659571691171 --variants base,rep100 [--tail]

Prints each run's TTFT p99 (the bench's: the 11th slowest of 1,000), the p99 after the first 50 requests (the cold
start left out; a diagnostic) and the copies that landed; ``--tail`` also the 11 slowest requests as (TTFT ms, index,
arrival ms, worker, document, prompt tokens, L for the first of its document or d<ms after it>@w<its worker>).
A diagnostic, not a test or a benchmark.
"""

from __future__ import annotations

import argparse
import importlib
import time

from components.cli.bench import routing as br
from components.rescheduler.config import ReplicationConfig
from components.router import adapter
from components.sim.replication import PolicyReplicator
from components.workers.simulated import MockEngineConfig

replay_module = importlib.import_module("components.sim.replay")  # the package exports the function under its name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--capacity", type=float, required=True, help="round-robin's capacity, requests/s")
    ap.add_argument("--loads", default="0.8,1")
    ap.add_argument("--variants", default="base", help="comma-separated: base, capN, repT, capN+repT")
    ap.add_argument("--tail", action="store_true")
    a = ap.parse_args()
    spec = br.WorkloadSpec("synthetic", "documents", 1000, a.seed, MockEngineConfig().vocab_size, 256, 1.0)
    fleet = br.fleet_for(spec, 8, MockEngineConfig().num_gpu_blocks, 16, 0)
    w = br.build(spec)
    default_cap = adapter.MAX_PROVISIONAL_BLOCKS
    for load in [float(x) for x in a.loads.split(",")]:
        wl = w.at_rate(a.capacity * load)
        for v in a.variants.split(","):
            adapter.MAX_PROVISIONAL_BLOCKS = default_cap
            rep = None
            for part in v.split("+"):
                if part.startswith("cap"):
                    adapter.MAX_PROVISIONAL_BLOCKS = int(part[3:])
                elif part.startswith("rep"):
                    cfg = ReplicationConfig(prefix_replication_target_ttft_ms=float(part[3:]))
                    rep = PolicyReplicator(cfg, model=replay_module.MODEL)
                elif part != "base":
                    raise SystemExit(f"unknown variant {part!r}")
            t0 = time.time()
            r = replay_module.replay(wl, fleet, "kv", a.seed, replicator=rep)
            tt = r.ttft_by_request_s
            if a.tail:
                ids: dict[tuple[int, ...], int] = {}
                doc = [ids.setdefault(tuple(q.prompt[:32]), len(ids)) for q in wl.requests]
                first: dict[int, int] = {}
                for i, d in enumerate(doc):
                    first.setdefault(d, i)
                rows = []
                for i in sorted(range(len(tt)), key=lambda i: -tt[i])[:11]:
                    f = first[doc[i]]
                    lead = "L" if f == i else f"d{round((wl.requests[i].arrival_s - wl.requests[f].arrival_s) * 1000)}"
                    lead += "" if f == i else f"@w{r.worker_by_request[f]}"
                    arrival_ms = round(wl.requests[i].arrival_s * 1000)
                    n = len(wl.requests[i].prompt)
                    rows.append((round(tt[i] * 1000), i, arrival_ms, r.worker_by_request[i], doc[i], n, lead))
                print("  tail:", rows)
            print(
                f"seed {a.seed} load {load:g} {v}: kv p99 {br._ms(br._pct(tt, 0.99))} ms, p99 after 50 "
                f"{br._ms(br._pct(tt[50:], 0.99))}, copies {rep.copies if rep else 0}, {time.time() - t0:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
