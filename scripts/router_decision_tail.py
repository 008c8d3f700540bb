"""What the slowest ``kv`` decisions of ``kvmesh bench router`` are: its decision loop, unchanged (the same requests,
load reports, bookkeeping and untimed re-hashing between decisions), with each decision's thread CPU time recorded
beside what it did, then the distribution by category.

    PYTHONPATH=. python scripts/router_decision_tail.py [--policy kv] [bench router args]

Per decision: whether the prompt continues a cached conversation or starts a new one, how many block hashes
``select`` read, how many 64-block chunks the memo of prompt-chunk hashes lacked (each chained anew), and whether
a cyclic garbage collection ran inside the timed region (``gc.callbacks``; its generation and thread CPU time).
Everything recorded goes into lists of ints, which the collector does not track, so the recording adds no
collections of its own. Prints one JSON object: percentiles overall and per category, the collections, the slowest
1% (how many overlapped a collection, how many were conversation hits, how many lie within two decisions of another
of them: slow decisions that come in bursts point at the machine, not at the request), and p50 per tenth of the run.
"""

import argparse
import gc
import json
import random
import time
from collections import deque
from typing import Any

from components.cli.bench import router as bench
from components.cli.bench.loadgen.stats import percentile
from components.protocol import kv_hashing
from components.protocol.kv_hashing import PromptHashes
from components.router import RouteRequest


def _pcts(values_ns: list[int]) -> dict[str, float | int | None]:
    v = sorted(x / 1000 for x in values_ns)
    out: dict[str, float | int | None] = {"n": len(v)}
    for p in (50, 90, 99):
        x = percentile(v, p)
        out[f"p{p}"] = None if x is None else round(x, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)
    p.add_argument("--policy", default="kv", help="a KV-aware policy (kv, kv+autellix, kv_dynamo)")
    p.add_argument(
        "--list-prompts",
        action="store_true",
        help="hand each decision its prompt as a list of ints (trees before the prompt came packed do, always)",
    )
    p.set_defaults(workers=[256], ingest_blocks=0)
    args = p.parse_args()
    bs = args.block_size
    rng = random.Random(args.seed)
    fleet = bench.build_fleet(args.workers[0], args, rng)
    router = bench.new_router(args.policy, fleet, args.seed, bs, args.prompt_hash_cache_blocks)
    bench.load_index(router, fleet, bs)
    bench.replay_previous_turns(router, fleet)
    # A conversation's next turn carries its history's token objects (bench.next_prompt): tell them apart by identity.
    n_shared = len(fleet.shared)
    family_marks = {id(f[n_shared]) for f in fleet.families if len(f) > n_shared}

    workers = fleet.worker_ids
    now = time.monotonic()
    for w in workers:
        router.apply_load(w, bench._load_snapshot(now, rng), now)
    reports_per_decision = len(workers) / bench.METRICS_INTERVAL_S / args.arrival_rate
    credit = 0.0
    reporter = 0
    in_flight_target = args.in_flight_per_worker * len(workers)
    prefilling: deque[str] = deque()
    decoding: deque[str] = deque()
    prompt_rng = random.Random(args.seed + 2)

    # Per decision, ints only (untracked by the collector).
    cpu: list[int] = []
    wall: list[int] = []
    conv: list[int] = []
    hashed: list[int] = []
    misses: list[int] = []
    gc_in: list[int] = []  # collections that started inside the timed region
    gc_cpu: list[int] = []  # their thread CPU time, ns
    gc_gen: list[int] = []  # the oldest generation collected inside, -1 if none
    gc_state = [0, 0, 0, -1]  # collections so far, thread CPU in collections so far, start of the current, generation

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_state[2] = time.thread_time_ns()
            gc_state[3] = max(gc_state[3], int(info["generation"]))
        else:
            gc_state[0] += 1
            gc_state[1] += time.thread_time_ns() - gc_state[2]

    all_collections: list[int] = []  # generation of every collection during the loop, timed or not
    gc.collect()
    gc.callbacks.append(on_gc)
    memo = None
    pack = None if args.list_prompts else getattr(kv_hashing, "packed_prompt", None)
    try:
        for i in range(args.warmup + args.decisions):
            credit += reports_per_decision
            while credit >= 1.0:
                credit -= 1.0
                t = time.monotonic()
                router.apply_load(workers[reporter], bench._load_snapshot(t, rng), t)
                reporter = (reporter + 1) % len(workers)
            prompt = bench.next_prompt(fleet.shared, fleet.families, args, prompt_rng)
            is_conv = len(prompt) > n_shared and id(prompt[n_shared]) in family_marks
            # Packed untimed, as the benchmark and the frontend do (kv_hashing.packed_prompt; absent in older trees).
            routed = prompt if pack is None else pack(prompt)
            request = RouteRequest(routed, bench.MODEL, time.monotonic())
            if memo is None:
                memo = router.hash_memo(bs)
            misses0 = memo.misses if memo is not None else 0
            n0, g0 = gc_state[0], gc_state[1]
            gc_state[3] = -1
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            prepared = router.prepare(request)
            decision = router.select(prepared)
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            n1, g1, gen = gc_state[0], gc_state[1], gc_state[3]
            if memo is None:
                memo = router.hash_memo(bs)
            if i >= args.warmup:
                cpu.append(c1 - c0)
                wall.append(t1 - t0)
                conv.append(1 if is_conv else 0)
                k = prepared.block_hashes.num_computed if isinstance(prepared.block_hashes, PromptHashes) else 0
                hashed.append(k)
                misses.append((memo.misses if memo is not None else 0) - misses0)
                gc_in.append(n1 - n0)
                gc_cpu.append(g1 - g0)
                gc_gen.append(gen if n1 > n0 else -1)
            rid = f"r{i}"
            router.on_routed(rid, decision, prepared)
            prefilling.append(rid)
            if len(prefilling) > in_flight_target // 4:
                first = prefilling.popleft()
                router.on_first_token(first)
                decoding.append(first)
            if len(decoding) > in_flight_target - in_flight_target // 4:
                router.on_finished(decoding.popleft())
            if isinstance(prepared.block_hashes, PromptHashes):  # as the benchmark does, untimed
                again = PromptHashes(prepared.token_ids, prepared.block_size)
                again.ensure(prepared.block_hashes.num_computed)
                del again
            del request, prepared, prompt, routed
            all_collections.append(gc_state[0])
    finally:
        gc.callbacks.remove(on_gc)

    n = len(cpu)
    order = sorted(range(n), key=cpu.__getitem__)
    top = order[n - max(1, n // 100) :]
    top_set = set(top)
    bursty = sum(1 for j in top if any(k in top_set for k in (j - 2, j - 1, j + 1, j + 2)))

    def cat(pred: Any) -> dict[str, float | int | None]:
        return _pcts([cpu[j] for j in range(n) if pred(j)])

    tenth = max(1, n // 10)
    out = {
        "policy": args.policy,
        "decisions": n,
        "decision_cpu_us": _pcts(cpu),
        "decision_us": _pcts(wall),
        "by_category_cpu_us": {
            "conversation, every chunk from the memo": cat(lambda j: conv[j] and misses[j] == 0),
            "conversation, a chunk chained": cat(lambda j: conv[j] and misses[j] > 0),
            "new conversation": cat(lambda j: not conv[j]),
            "no collection inside": cat(lambda j: gc_in[j] == 0),
        },
        "mean_hashed_blocks": {
            "conversation": round(sum(hashed[j] for j in range(n) if conv[j]) / max(1, sum(conv)), 1),
            "new": round(sum(hashed[j] for j in range(n) if not conv[j]) / max(1, n - sum(conv)), 1),
        },
        "collections": {
            "during_the_loop": all_collections[-1] if all_collections else 0,
            "inside_timed_decisions": sum(gc_in),
            "decisions_with_one": sum(1 for x in gc_in if x),
            "their_cpu_us": sorted(round(gc_cpu[j] / 1000) for j in range(n) if gc_in[j]),
            "generations": sorted(gc_gen[j] for j in range(n) if gc_in[j]),
        },
        "slowest_1pct": {
            "n": len(top),
            "from_us": round(cpu[top[0]] / 1000, 1),
            "with_a_collection": sum(1 for j in top if gc_in[j]),
            "conversation_hits": sum(conv[j] for j in top),
            "with_a_chained_chunk": sum(1 for j in top if misses[j]),
            "within_2_decisions_of_another": bursty,
            "within_2_if_spread_evenly": round(len(top) * (1 - (1 - len(top) / n) ** 4), 1),
            "slowest_5": [
                {
                    "decision": j,
                    "cpu_us": round(cpu[j] / 1000, 1),
                    "conversation": bool(conv[j]),
                    "hashed_blocks": hashed[j],
                    "chained_chunks": misses[j],
                    "collection_cpu_us": round(gc_cpu[j] / 1000),
                }
                for j in reversed(order[-5:])
            ],
        },
        "p50_per_tenth_us": [
            round((percentile(sorted(cpu[a : a + tenth]), 50) or 0) / 1000, 1) for a in range(0, n - tenth + 1, tenth)
        ],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
