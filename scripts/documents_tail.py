"""What the documents shape's TTFT tail is made of: the 10 slowest requests of one `kvmesh bench routing` replay
(1,000 requests, 8 workers, device caches only; the bench's p99 is the 11th slowest), each with its document,
arrival, worker, time queued before admission and prompt tokens served from the cache, classified as

* cold, first of its document: no request of its document was routed anywhere before it;
* cold copy: an earlier request of its document was routed to another worker, and this one computed it again here;
* cold, behind a same-document request routed to its worker earlier (nothing stored yet when it was admitted);
* follower (hit): it got at least half of its prompt from the cache.

Then, over the whole run: admissions with nothing cached, and the requests that got a partial hit of their document
(they recomputed part of it beside or after its holder on the same worker: what in-batch prefix caching removes)
with the document tokens recomputed that way.

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python scripts/documents_tail.py --seed 3 --load 0.8 --capacity 57.7388 \\
        [--in-batch] [--provisional-blocks 256] [--policy kv]

``--capacity`` is round-robin's capacity in requests/s as the bench measured it (its stderr says it); the replay runs
at ``load`` times it. ``--provisional-blocks`` sets the router's ``MAX_PROVISIONAL_BLOCKS`` for this process only (a
diagnostic: the router's constant is 256). A diagnostic that wraps ``Scheduler.step`` to see every admission; not a
test, not a benchmark.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from components.cli.bench import routing as br
from components.router import adapter
from components.workers.engines.mock import scheduler as sched_module
from components.workers.simulated import MockEngineConfig

replay_module = importlib.import_module("components.sim.replay")  # the package exports the function under its name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--load", type=float, required=True)
    ap.add_argument("--capacity", type=float, required=True, help="round-robin's capacity, requests/s")
    ap.add_argument("--in-batch", action="store_true", help="enable_in_batch_prefix_caching on every engine")
    ap.add_argument("--provisional-blocks", type=int, default=adapter.MAX_PROVISIONAL_BLOCKS)
    ap.add_argument("--policy", default="kv")
    a = ap.parse_args()
    adapter.MAX_PROVISIONAL_BLOCKS = a.provisional_blocks
    spec = br.WorkloadSpec("synthetic", "documents", 1000, a.seed, MockEngineConfig().vocab_size, 256, 1.0)
    fleet = br.fleet_for(spec, 8, MockEngineConfig().num_gpu_blocks, 16, 0, a.in_batch)
    engines: dict[int, int] = {}  # id(scheduler) -> worker index, in creation order (the fleet's order)
    log: dict[str, dict[str, Any]] = {}
    windows: dict[int, list[tuple[float, dict[str, int]]]] = {}
    step = sched_module.Scheduler.step

    def logged_step(self: sched_module.Scheduler, now_s: float) -> sched_module.StepOutput:
        worker = engines.setdefault(id(self), len(engines))
        running = {r.request_id for r in self.running}
        out = step(self, now_s)
        for rid in out.num_scheduled_tokens:
            d = log.setdefault(rid, {"worker": worker})
            if rid not in running and "admit_s" not in d:
                d["admit_s"] = now_s
        for rid, chunk in out.chunks.items():
            if chunk.position == 0:
                log[rid]["cached"] = chunk.num_cached_tokens
        windows.setdefault(worker, []).append((now_s, dict(out.num_scheduled_tokens)))
        return out

    sched_module.Scheduler.step = logged_step  # type: ignore[method-assign]
    workload = br.build(spec).at_rate(a.capacity * a.load)
    res = replay_module.replay(workload, fleet, a.policy, a.seed)
    ttft = res.ttft_by_request_s
    reqs = workload.requests
    ids: dict[tuple[int, ...], int] = {}
    doc = [ids.setdefault(tuple(r.prompt[:32]), len(ids)) for r in reqs]
    # Each document's length: the common prefix of its requests, in whole blocks.
    common: dict[int, tuple[list[int], int]] = {}
    for i, r in enumerate(reqs):
        if doc[i] not in common:
            common[doc[i]] = (list(r.prompt), len(r.prompt))
            continue
        q, n = common[doc[i]]
        m = 0
        while m < min(n, len(r.prompt)) and q[m] == r.prompt[m]:
            m += 1
        common[doc[i]] = (q, m)
    doc_len = {d: n // 16 * 16 for d, (_, n) in common.items()}
    routed_on: dict[tuple[int, int], float] = {}  # (document, worker) -> first arrival of that document routed there
    for i, r in enumerate(reqs):
        k = (doc[i], log[f"r{i}"]["worker"])
        routed_on[k] = min(routed_on.get(k, 1e9), r.arrival_s)
    p99 = br._pct(res.ttft_s, 0.99) or 0.0  # the bench's p99: the 11th slowest of 1,000
    print(
        f"seed {a.seed} load {a.load:g} {a.policy} in-batch {'on' if a.in_batch else 'off'} provisional blocks "
        f"{a.provisional_blocks}: TTFT p99 {1000 * p99:.1f} ms, hit rate {res.hit_rate:.4f}"
    )
    kinds: dict[str, int] = {}
    for i in sorted(range(len(reqs)), key=lambda j: -ttft[j])[:10]:
        d = log[f"r{i}"]
        n, cached, arrival = len(reqs[i].prompt), d.get("cached", 0), reqs[i].arrival_s
        elsewhere = sorted(w for (dd, w), t in routed_on.items() if dd == doc[i] and t < arrival and w != d["worker"])
        if cached >= n // 2:
            kind = "follower (hit)"
        elif routed_on.get((doc[i], d["worker"]), 1e9) < arrival:
            kind = "cold, behind a same-document request routed to its worker earlier"
        elif elsewhere:
            kind = "cold copy"
        else:
            kind = "cold, first of its document"
        kinds[kind] = kinds.get(kind, 0) + 1
        print(
            f"  r{i:<4d} doc {doc[i]} ({n:6d} tokens) arrived {arrival:7.3f} s  TTFT {1000 * ttft[i]:6.1f} ms  worker "
            f"{d['worker']}  queued {1000 * (d['admit_s'] - arrival):6.1f} ms  cached {cached:6d}  {kind}"
            + (f" (document routed before to workers {elsewhere})" if elsewhere else "")
        )
    partial = [
        doc_len[doc[i]] - log[f"r{i}"].get("cached", 0)
        for i in range(len(reqs))
        if 0 < log[f"r{i}"].get("cached", 0) < doc_len[doc[i]] - 16
    ]
    cold = sum(1 for i in range(len(reqs)) if log[f"r{i}"].get("cached", 0) == 0)
    print(f"  the 10: {kinds}")
    print(
        f"  whole run: {cold} admissions with nothing cached; {len(partial)} partial hits of their document "
        f"({sum(partial)} document tokens recomputed); document lengths {sorted(doc_len.values())}"
    )


if __name__ == "__main__":
    main()
