"""ABBA in one process: ``kv`` decisions alternate between another tree's way of deciding (A) and this tree's (B), on
one router, one index and one stream of ``kvmesh bench router`` requests, so that the load of a shared machine falls
on both alike (separate benchmark runs on the 2-core dev VM vary by +-30% from run to run at a load average of 7-14,
more than the differences measured here).

    PYTHONPATH=. python scripts/router_decision_ab.py --baseline /work/main [--pattern ABBA] [bench router args]

A: the baseline tree's ``KvIndex._search``/``_split`` (bound to this tree's index: the index's data is the same) and
its ``PromptHashes`` over its own ``HashMemo`` (each side's memo holds the cached conversations' previous turns, as
``kvmesh bench router``'s routers do, and the chunks of its own decisions), and snapshots rebuilt lazily, by the
decision (the bookkeeping before an A decision only marks workers changed, as main at 64fcae8 did: see
docs/router.md); with ``--eager-a``, A's snapshots are rebuilt by the bookkeeping as B's (a baseline at or after
5f99b84), so that A and B differ only in the search and the hashing. B: this tree's code as it is. Everything else
is this tree's. Each decision is timed as ``kvmesh bench router`` times it (the request wrapped with its lazy
hashes, then ``Router.select``), in thread CPU time; so is the bookkeeping before it (load reports,
``on_routed``/``on_first_token``/``on_finished``: untimed in ``kvmesh bench router``), where B rebuilds the snapshots
(and A too with ``--eager-a``). Prints one JSON object: per side, the decisions and p50/p90/p99 of the decision and
of decision plus bookkeeping.
"""

import argparse
import gc
import importlib.util
import json
import random
import sys
import time
import types
from collections import deque
from pathlib import Path

from components.cli.bench import router as bench
from components.protocol import kv_hashing
from components.router import RouteRequest, adapter, kv_index


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)
    p.add_argument("--baseline", required=True, help="the other tree's root (its components/ is read, not imported)")
    p.add_argument("--pattern", default="ABBA", help="which side takes decision i: pattern[i % len(pattern)]")
    p.add_argument(
        "--eager-a",
        action="store_true",
        help="A's snapshots rebuilt by the bookkeeping too, as B's (a baseline at or after 5f99b84, e.g. main at "
        "b9b476f): A and B then differ only in the index search and the prompt hashing",
    )
    p.set_defaults(workers=[256], decisions=4000, ingest_blocks=0)
    args = p.parse_args()
    root = Path(args.baseline)
    base_index = _load("baseline_kv_index", root / "components/router/kv_index.py")
    base_hashing = _load("baseline_kv_hashing", root / "components/protocol/kv_hashing.py")
    n_workers = args.workers[0]
    bs = args.block_size
    rng = random.Random(args.seed)
    fleet = bench.build_fleet(n_workers, args, rng)
    router = bench.new_router("kv", fleet, args.seed, bs, args.prompt_hash_cache_blocks)
    bench.load_index(router, fleet, bs)
    bench.replay_previous_turns(router, fleet)
    index = router.index
    memo = router.hash_memo(bs)
    # A's memo, of A's class (main at b9b476f keeps tuples of ints, this tree bytes), holding what B's holds.
    memo_a = base_hashing.HashMemo(bs, memo.max_blocks if memo is not None else 0)
    for family in fleet.families:
        list(base_hashing.PromptHashes(bench.previous_turn(family), bs, memo_a))
    memos = {"A": memo_a, "B": memo}
    sides = {
        "A": (base_index.KvIndex._search, base_index.KvIndex._split, base_hashing.PromptHashes),
        "B": (kv_index.KvIndex._search, kv_index.KvIndex._split, kv_hashing.PromptHashes),
    }
    workers = fleet.worker_ids
    now = time.monotonic()
    for w in workers:
        router.apply_load(w, bench._load_snapshot(now, rng), now)
    in_flight_target = args.in_flight_per_worker * len(workers)
    prefilling: deque[str] = deque()
    decoding: deque[str] = deque()
    reports_per_decision = len(workers) / bench.METRICS_INTERVAL_S / args.arrival_rate
    credit = 0.0
    reporter = 0
    prompt_rng = random.Random(args.seed + 2)
    samples: dict[str, list[int]] = {"A": [], "B": []}
    totals: dict[str, list[int]] = {"A": [], "B": []}
    book = 0  # thread CPU of the bookkeeping since the last decision

    def noop() -> None:
        pass

    gc.collect()
    for i in range(args.warmup + args.decisions):
        side = args.pattern[i % len(args.pattern)]
        lazy_a = not args.eager_a
        if side == "A" and lazy_a:
            router._flush = noop  # type: ignore[method-assign]  # lazily: select rebuilds what changed
        b0 = time.thread_time_ns()
        credit += reports_per_decision
        while credit >= 1.0:
            credit -= 1.0
            t = time.monotonic()
            router.apply_load(workers[reporter], bench._load_snapshot(t, rng), t)
            reporter = (reporter + 1) % len(workers)
        book += time.thread_time_ns() - b0
        if side == "A" and lazy_a:
            del router._flush
        prompt = bench.next_prompt(fleet.shared, fleet.families, args, prompt_rng)
        search, split, prompt_hashes = sides[side]
        index._search = types.MethodType(search, index)  # type: ignore[method-assign]
        index._split = types.MethodType(split, index)  # type: ignore[method-assign]
        kv_index.PromptHashes = prompt_hashes  # type: ignore[misc]  # the search's isinstance test
        request = RouteRequest(prompt, bench.MODEL, time.monotonic())
        c0 = time.thread_time_ns()
        prepared = adapter._with_fields(
            request, adapter._AT_BLOCK_SIZE, bs, adapter._AT_BLOCK_HASHES, prompt_hashes(prompt, bs, memos[side])
        )
        decision = router.select(prepared)
        c1 = time.thread_time_ns()
        if i >= args.warmup:
            samples[side].append(c1 - c0)
            totals[side].append(c1 - c0 + book)
        nxt = args.pattern[(i + 1) % len(args.pattern)]
        if nxt == "A" and lazy_a:
            router._flush = noop  # type: ignore[method-assign]
        b0 = time.thread_time_ns()
        rid = f"r{i}"
        router.on_routed(rid, decision, prepared)
        prefilling.append(rid)
        if len(prefilling) > in_flight_target // 4:
            first = prefilling.popleft()
            router.on_first_token(first)
            decoding.append(first)
        if len(decoding) > in_flight_target - in_flight_target // 4:
            router.on_finished(decoding.popleft())
        book = time.thread_time_ns() - b0
        if nxt == "A" and lazy_a:
            del router._flush
        del request, prepared, prompt
    out = {
        "workers": n_workers,
        "indexed_blocks": fleet.indexed_blocks,
        "pattern": args.pattern,
        "baseline": str(root),
        "prompt_hash_cache_blocks": args.prompt_hash_cache_blocks,
    }
    for side, v in samples.items():
        out[side] = {
            "decisions": len(v),
            "decision_cpu_us": bench._stats_us(v),
            "with_bookkeeping_cpu_us": bench._stats_us(totals[side]),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
