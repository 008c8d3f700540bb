"""``kvmesh bench router``: what one routing decision costs, and how fast the KV index ingests the workers' events.

In-process, no mesh: a ``components.router.Router`` is fed the way ``RouterFeed`` feeds it and asked the way the
frontend asks it, so the measured code is the production code path and nothing else.

**Decision cost.** For each fleet size (8, 64, 256, 1,024 workers by default) and policy, ``--decisions`` requests of
``--prompt-tokens`` (8,192) token ids are placed, one ``perf_counter_ns`` pair around each decision exactly as
``FrontendService`` makes it: ``Router.prepare`` (wraps the prompt in a lazy ``PromptHashes`` backed by the router's
memo of prompt-chunk hashes; KV policies only) then ``Router.select`` (searches the KV index once, hashing the prompt
as far as the search reads it, runs the pure policy over the workers' snapshots). ``kv`` is the
policy under test; ``round_robin`` and ``least_loaded`` are measured in the same run as the floor (no hashing, no
index). Every KV-aware policy listed (``kv``, ``kv+autellix``, ``kv_dynamo``) gets its own router with the same index
loaded. Bookkeeping the frontend does after the decision (``on_routed``, ``on_first_token``, ``on_finished``) and the
load reports that arrive between decisions run between timed regions and are timed on their own
(``bookkeeping_cpu_us``: their thread CPU time before each decision): they rebuild the snapshots of the workers they
change, as in production (``Router``'s docstring; until main at 64fcae8 the next ``select`` rebuilt them, inside
``decision_us``). Freeing the request is untimed too (the next decision would otherwise pay for freeing the previous
prompt's 8k ints).

Every decision's prompt is new (``next_prompt``, built untimed, as a tokenizer would: fresh ints of a 128k vocabulary,
then packed for KV policies as the frontend packs the tokenizer's ids, ``kv_hashing.packed_prompt``: untimed for the
decision, timed apart as ``pack_us`` and ``pack_cpu_us``), never a repeat: a cached conversation's next turn (its
history, then a new 512-token turn) or a new conversation. Before timing, each router hashes every cached conversation's
previous turn (``replay_previous_turns``): the workers cache those conversations because a router placed their earlier
turns, and a router that has been running remembers those turns' chunk hashes
(``RouterConfig.prompt_hash_cache_blocks``), so a turn chains only its new chunk. That is a single router (or frontends
with session affinity); a frontend that never saw a conversation's earlier turns hashes it in full:
``--prompt-hash-cache-blocks 0`` measures that case.

What ``decision_us`` includes, for KV policies: hashing the prompt's blocks. The frontend hashes nothing itself
(``prepare`` only wraps the token ids; the first hash is computed inside ``select``), so in production this is work
on the request's path that the routing decision causes, and it stays in the figure. Packing the token ids is not in
it: the frontend packs them once per request, right after tokenizing (``Prepared.packed_prompt``; ~38 us for 8k ids
on the dev VM, a third of a decision until the router took the prompt packed), so every hashing of the prompt reads
that buffer; the request still pays it once, reported as ``pack_us``. Reported beside it:
``decision_cpu_us`` (the thread's CPU time over the same calls: without the time another process held the core, so on
a shared machine its tail is the code's own), ``prepare_us`` and ``select_us`` (the two timed calls; they sum to
``decision_us``), ``hashed_blocks`` (how many block hashes ``select`` read, on average: up to a 64-block chunk past
the deepest cached block for a conversation hit, 64 for a new conversation), ``hash_memo`` (chunks found in the memo
and hashed anew, blocks reused per decision) and ``hashing_us`` (chaining that many blocks of the same prompt again
without a memo, timed apart after the decision: what hashing would cost a router that never saw the prefix; from
the packed prompt, so without packing).

The KV index holds ``--indexed-blocks`` (1,000,000) (worker, block) entries before any decision, loaded through
``Router.apply_kv_events`` as ``BlockStored`` batches. Its contents follow what the Mooncake conversation trace shows
(``../shared/traces``): every one of its 12,031 requests starts with the same 512-token block (a system prompt), so
every worker holds that prefix (``--shared-prefix-tokens``); ``--families`` conversations of 8k tokens are each cached
on ``--replicas`` workers, each copy a prefix of 64..512 blocks (a conversation's earlier turns, cut where its worker
evicted it); the rest of each worker's share is other conversations' blocks, which no request matches. A request is
a cached conversation with a new 512-token turn (``--hit-fraction`` of them: some workers hold up to 480 of its 512
blocks, the rest only the shared prefix) or a new conversation (the shared prefix only). The shared prefix is the
costly case for the index: at 1,024 workers all 1,024 bits drop out at once where it ends (the router reports it as
the model's common floor, ``RouteRequest.common_overlap_blocks``, instead of 1,024 entries).

Between decisions the workers' load reports arrive as they would at ``--arrival-rate`` requests/s with a report
every 100 ms from each worker (``n_workers * 10 / arrival_rate`` reports per decision, round-robin over the workers),
so the router rebuilds their snapshots as it does in production (in ``bookkeeping_cpu_us``). The garbage collector
stays on, with the frontend process's young-generation threshold (``--gc-young-threshold``, 20,000; CPython's 700
until 2026-11-29). With KV events on (the default), the router records each routed request's blocks as provisional
(``Router.provisional``); the workers' ``BLOCK_STORED`` confirms them ``--confirm-after-ms`` of arrivals later and
each worker evicts as many blocks no request reads, tail first (``filler_blocks``), so the index stays at
``--indexed-blocks`` and every worker's cache prefix-closed: until 2026-11-29 nothing confirmed them and the index
grew by every prediction during the run (to ~1.3M entries). Applying those events is timed apart
(``provisional.kv_events_cpu_us``: the feed's work, which runs in the same process between decisions).

**Ingest.** With 256 workers and the index at ``--indexed-blocks``, batches of ``BlockStored``/``BlockRemoved`` events
(a batch per worker message, as ``RouterFeed`` receives it from the ``kv_events`` topic) go through
``Router.apply_kv_events``; each worker evicts its oldest blocks as it stores new ones, so the index stays at its
size. Two profiles: ``mixed`` (30% of stored events are prefill runs of 16..512 blocks, 70% single decode blocks; one
eviction event per batch) and ``single_block`` (every event stores or removes one block: decode-heavy engines, the
per-event worst case). Each is measured on ``KvEvent`` objects (the index alone) and on the events' wire dicts
(``KvEvent.from_dict`` + apply: the feed's work after msgpack). "Block events" are blocks stored plus blocks removed.

Targets (issue 6): p99 <= 200 us per ``kv`` decision at 256 workers and 1M blocks; >= 300k block events/s on one core.
Measured on the 2-core EPYC dev VM in alternating ABBA rounds against main at 64fcae8 (timed by this benchmark, 6 runs
each, medians; docs/router.md, "Cost", has the tables), with other work holding the load average at 7-8: a ``kv``
decision took 189 -> 149 us of thread CPU time at p50 and 347 -> 284 us at p99 (wall-clock p99 was the scheduler's,
~4.2 ms, for A and B); the bookkeeping between decisions, which now rebuilds the snapshots of the workers it changes,
28 -> 62 us at p50. The p99 target is not shown met. Of a decision's ~150 us (thread CPU, p50): ~75 us hashing
(packing the 8k token ids, ~37 us of it: every token up to the deepest cached block must be read; the memo's chunks;
chaining the new one), ~45 us searching the index (gallop and bisect over prefix-closed workers,
``components.router.kv_index``), ~25 us in the policy, ~6 us preparing the request. Round 3 (against main at
b9b476f, load ~1-2.6, 16 ABBA runs each): p50 ~132 us, p99 207 us (164-443): still not met. The p99 is made of
conversation hits, of the young garbage collections (main: 3 per run, all inside decisions, 0.4-0.8 ms each, now 1 of
~0.2 ms: the memo keeps bytes, not tuples of ints) and above all of the host's slow stretches (the p50 of parts of a
run 1.3-1.9x the rest): runs without one are at 155-223 us (``scripts/router_decision_tail.py``).
Ingest (an earlier, quiet measurement): ~0.7M single-block events/s (decode blocks naming their parent), ~2M blocks/s
in prefill-sized events.
The last line printed is one JSON object; ``--workers 8,64 --indexed-blocks 20000 --decisions 200`` runs in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import sys
import time
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any

from components.cli.bench.loadgen.stats import percentile
from components.protocol.kv_hashing import PromptHashes, block_hashes, packed_prompt
from components.protocol.messages import KvEvent, KvEventKind, LoadSnapshot
from components.router import Router, RouterConfig, RouteRequest

MODEL = "bench-model"
TARGET_DECISION_P99_US = 200.0
TARGET_AT_WORKERS = 256
TARGET_AT_BLOCKS = 1_000_000
TARGET_INGEST_BLOCKS_PER_S = 300_000
INGEST_WORKERS = 256
POLICIES = ("kv", "round_robin", "least_loaded")
# A new conversation turn: one Mooncake block (512 tokens), appended to a cached conversation's prefix.
NEW_TURN_TOKENS = 512
METRICS_INTERVAL_S = 0.1  # the workers' default load-report interval (WorkerConfig.metrics_interval_ms)
# The frontend process's youngest-generation threshold while serving (``components.frontend.main.GC_YOUNG_THRESHOLD``,
# where the router runs; tests/unit/cli/test_bench_router.py checks the two agree): importing that module here would
# bring aiohttp and the runtime's clients into the measured process (~20k more objects for the collector to walk).
GC_YOUNG_THRESHOLD = 20_000
VOCAB = 128_256  # Llama 3's vocabulary: token ids are ints of up to 17 bits, each its own object


def _stats_us(samples_ns: Sequence[int]) -> dict[str, float | None]:
    v = sorted(x / 1000 for x in samples_ns)
    out = {f"p{p}": _r(percentile(v, p)) for p in (50, 90, 99)}
    out["mean"] = _r(sum(v) / len(v)) if v else None
    out["max"] = _r(v[-1]) if v else None
    return out


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


@dataclasses.dataclass
class Fleet:
    """The workload of one fleet size: workers, what each caches (block hashes in storing order), the prompts."""

    worker_ids: list[int]
    held: dict[int, list[int]]  # every worker's blocks, oldest first
    runs: dict[int, list[tuple[list[int], int | None]]]  # the same as chained runs: (hashes, parent of the first)
    shared: list[int]  # the system prompt every request starts with
    families: list[list[int]]  # the cached conversations (8k tokens each)
    requests: list[list[int]]  # sample prompts for measure_overlaps (decisions draw fresh ones: next_prompt)
    indexed_blocks: int


def _fresh(rng: random.Random, n: int) -> list[int]:
    """``n`` new token ids, as a tokenizer would produce: ints of a 128k vocabulary, new objects."""
    return [x % VOCAB for x in array("I", rng.randbytes(4 * n))]


def build_fleet(n_workers: int, args: argparse.Namespace, rng: random.Random) -> Fleet:
    """Who holds what, and sample prompts (see the module docstring); hashes are the real chained hashes."""
    bs = args.block_size
    n_tokens = args.prompt_tokens
    worker_ids = sorted(rng.sample(range(1, 2**63), n_workers))  # instance ids are random 63-bit ints in etcd
    shared = _fresh(rng, args.shared_prefix_tokens)
    shared_hashes = block_hashes(shared, bs)
    families = [shared + _fresh(rng, n_tokens - len(shared)) for _ in range(args.families)]
    family_hashes = [block_hashes(f, bs) for f in families]
    n_blocks = n_tokens // bs
    # Each worker's share; the first (indexed_blocks % n_workers) get one more, so the shares sum to indexed_blocks.
    base, extra = divmod(args.indexed_blocks, n_workers)
    budget = {w: base + (i < extra) for i, w in enumerate(worker_ids)}
    # Each worker's cache as chained runs (hashes, parent of the first), stored in this order by load_index.
    runs: dict[int, list[tuple[list[int], int | None]]] = {w: [(list(shared_hashes), None)] for w in worker_ids}
    n_held = dict.fromkeys(worker_ids, len(shared_hashes))
    n_shared = len(shared_hashes)
    for fh in family_hashes:
        for w in rng.sample(worker_ids, min(args.replicas, n_workers)):
            length = rng.randint(min(64, n_blocks), n_blocks)
            if length > n_shared:
                runs[w].append((fh[n_shared:length], fh[n_shared - 1] if n_shared else None))
                n_held[w] += length - n_shared
    for w in worker_ids:
        short = budget[w] - n_held[w]
        if short > 0:
            # Other conversations' blocks (chains of random hashes): no request matches them.
            for i in range(0, short, n_blocks):
                runs[w].append(([rng.getrandbits(64) for _ in range(min(n_blocks, short - i))], None))
    held = {w: [h for run, _ in rs for h in run] for w, rs in runs.items()}
    samples = [next_prompt(shared, families, args, rng) for _ in range(args.request_pool)]
    return Fleet(worker_ids, held, runs, shared, families, samples, sum(len(h) for h in held.values()))


def next_prompt(
    shared: list[int], families: list[list[int]], args: argparse.Namespace, rng: random.Random
) -> list[int]:
    """One request's prompt, never sent before: a cached conversation's next turn (its history, then a new
    ``NEW_TURN_TOKENS`` turn; ``--hit-fraction`` of them) or a new conversation (the system prompt, then new text)."""
    n_tokens = args.prompt_tokens
    if families and rng.random() < args.hit_fraction:
        return rng.choice(families)[: n_tokens - NEW_TURN_TOKENS] + _fresh(rng, NEW_TURN_TOKENS)
    return shared + _fresh(rng, n_tokens - len(shared))


def previous_turn(family: list[int]) -> list[int]:
    """The prompt of a cached conversation's previous turn: the history that the requests continuing it carry
    (``next_prompt``) less its last ``NEW_TURN_TOKENS`` (the previous answer and message)."""
    return family[: max(0, len(family) - 2 * NEW_TURN_TOKENS)]


def _load_snapshot(now_s: float, rng: random.Random) -> LoadSnapshot:
    running = rng.randrange(1, 64)
    return LoadSnapshot(
        now_s=now_s,
        kv_usage=rng.random(),
        num_total_blocks=16384,
        num_active_blocks=rng.randrange(16384),
        num_running=running,
        num_waiting=rng.randrange(8),
        num_waiting_prefill_tokens=rng.randrange(16384),
        num_preemptions=0,
        batch_size=running,
        num_kv_tokens=running * 4096,
    )


def new_router(policy: str, fleet: Fleet, seed: int, bs: int, memo_blocks: int | None = None) -> Router:
    config = RouterConfig(router_policy=policy, router_seed=seed)
    if memo_blocks is not None:
        config = config.model_copy(update={"prompt_hash_cache_blocks": memo_blocks})
    router = Router(config)
    router.set_workers(MODEL, [(w, {"model": MODEL, "block_size": bs}) for w in fleet.worker_ids])
    return router


def replay_previous_turns(router: Router, fleet: Fleet) -> None:
    """Place nothing, but hash every cached conversation's previous turn as ``select`` would have when this router
    placed it (its workers cache it because a router placed its earlier turns): what a router that has been running
    holds in its memo of prompt-chunk hashes (``Router.prepare``). Untimed. A no-op for policies that hash nothing."""
    now = time.monotonic()
    for family in fleet.families:
        prepared = router.prepare(RouteRequest(previous_turn(family), MODEL, now))
        if prepared.block_hashes is not None:
            list(prepared.block_hashes)


def load_index(router: Router, fleet: Fleet, bs: int, chunk: int = 512) -> dict[int, int]:
    """Store every worker's blocks through ``apply_kv_events`` (chained runs, at most ``chunk`` blocks per event, each
    naming its parent as engines do); returns each worker's next event id."""
    next_id: dict[int, int] = {}
    for w, runs in fleet.runs.items():
        eid = 0
        for hashes, parent in runs:
            for i in range(0, len(hashes), chunk):
                first_parent = parent if i == 0 else hashes[i - 1]
                ev = KvEvent(eid, KvEventKind.BLOCK_STORED, hashes[i : i + chunk], first_parent, bs)
                if not router.apply_kv_events(w, [ev]):
                    raise AssertionError("a gap in generated event ids")  # pragma: no cover - ids are consecutive
                eid += 1
        next_id[w] = eid
    return next_id


def filler_blocks(fleet: Fleet) -> dict[int, deque[int]]:
    """Each worker's blocks that no request reads (its other conversations', ``build_fleet``) in the order it evicts
    them in ``measure_decisions`` as it stores what it was routed: the oldest conversation first, each from its last
    block back, as an engine frees a sequence's blocks (vLLM's prefix cache puts a request's blocks on its free queue
    tail first), so that no held block loses its parent and the worker's cache stays prefix-closed (the index's
    fast search, ``KvIndex._search``)."""
    out: dict[int, deque[int]] = {}
    for w, runs in fleet.runs.items():
        out[w] = deque(h for hashes, parent in runs[1:] if parent is None for h in reversed(hashes))
    return out


def measure_decisions(
    router: Router,
    fleet: Fleet,
    args: argparse.Namespace,
    rng: random.Random,
    next_id: dict[int, int] | None = None,
    update_held: bool = False,
) -> dict[str, Any]:
    """Time ``prepare`` + ``select`` per request; returns percentiles in microseconds and what the decisions saw.

    With provisional blocks (``Router.provisional``: KV events on), each routed request's worker confirms the blocks
    the router predicted ``--confirm-after-ms`` of arrivals later (a ``BLOCK_STORED``, as the engine would once it
    computed them) and evicts as many blocks that no request reads (a ``BLOCK_REMOVED``), so that the index stays at
    ``--indexed-blocks`` instead of growing by every prediction; both are bookkeeping (untimed for the decision,
    in ``bookkeeping_cpu_us``). ``next_id``: the workers' next event ids (``load_index``), advanced here;
    ``update_held``: ``fleet.held`` follows those events (for a later ingest measurement on this router's index)."""
    workers = fleet.worker_ids
    confirm = bool(getattr(router, "provisional", False)) and next_id is not None
    predicted: list[tuple[int | None, list[int]]] = []
    due: deque[tuple[int, int, int | None, list[int]]] = deque()  # (decision index, worker, parent, hashes)
    filler = filler_blocks(fleet) if confirm else {}
    confirm_after = max(1, round(args.confirm_after_ms / 1000.0 * args.arrival_rate))
    if confirm:

        def on_sync(msg: dict[str, Any]) -> None:
            pv = msg.get("pv")
            if pv is not None:
                predicted.append((pv[0], pv[1]))

        router.sync_listeners.append(on_sync)
    confirmed = evicted = 0
    events_ns: list[int] = []  # applying the workers' KV events before each decision (the feed's work)
    stored_by: dict[int, list[int]] = {}
    gone_by: dict[int, set[int]] = {}
    now = time.monotonic()
    for w in workers:  # every worker has reported once: fresh metrics, as in a running fleet
        router.apply_load(w, _load_snapshot(now, rng), now)
    reports_per_decision = len(workers) / METRICS_INTERVAL_S / args.arrival_rate
    report_credit = 0.0
    next_reporter = 0
    in_flight_target = args.in_flight_per_worker * len(workers)
    prefilling: deque[str] = deque()
    decoding: deque[str] = deque()
    total_ns: list[int] = []
    cpu_ns: list[int] = []
    prepare_ns: list[int] = []
    pack_ns: list[int] = []  # packing each prompt, untimed for the decision (the frontend's step, once per request)
    pack_cpu_ns: list[int] = []
    book_ns: list[int] = []  # the bookkeeping before each decision (load reports, on_routed ... on_finished)
    book = 0
    hashing_ns: list[int] = []
    hashed_blocks = 0
    overlap_blocks = 0
    prompt_blocks = 0
    n = args.warmup + args.decisions
    prompt_rng = random.Random(args.seed + 2)
    memo = router.hash_memo(args.block_size) if hasattr(router, "hash_memo") else None
    memo_at_start = (memo.hits, memo.misses, memo.blocks_reused) if memo is not None else None
    gc.collect()
    for i in range(n):
        # Untimed: load reports that arrived since the last decision (the event loop interleaves them).
        b0 = time.thread_time_ns()
        report_credit += reports_per_decision
        while report_credit >= 1.0:
            report_credit -= 1.0
            t = time.monotonic()
            router.apply_load(workers[next_reporter], _load_snapshot(t, rng), t)
            next_reporter = (next_reporter + 1) % len(workers)
        book += time.thread_time_ns() - b0
        e0 = time.thread_time_ns()
        while due and due[0][0] <= i:  # the workers' KV events for requests routed --confirm-after-ms ago
            _, w, parent, hashes = due.popleft()
            assert next_id is not None
            fifo = filler[w]
            gone = [fifo.popleft() for _ in range(min(len(hashes), len(fifo)))]
            eid = next_id[w]
            events = [KvEvent(eid, KvEventKind.BLOCK_STORED, hashes, parent, args.block_size)]
            if gone:
                events.append(KvEvent(eid + 1, KvEventKind.BLOCK_REMOVED, gone))
            next_id[w] = eid + len(events)
            router.apply_kv_events(w, events, time.monotonic())
            confirmed += len(hashes)
            evicted += len(gone)
            if update_held:
                stored_by.setdefault(w, []).extend(hashes)
                gone_by.setdefault(w, set()).update(gone)
        if confirm and i >= args.warmup:
            events_ns.append(time.thread_time_ns() - e0)
        if i == args.warmup and memo is not None:
            memo_at_start = (memo.hits, memo.misses, memo.blocks_reused)
        prompt = next_prompt(fleet.shared, fleet.families, args, prompt_rng)  # untimed: the tokenizer's work
        routed: Sequence[int] = prompt
        if router.uses_kv:
            # Untimed for the decision, timed apart (``pack_us``): the frontend packs the tokenizer's ids once per
            # request, right after tokenizing, and hands the router the packed prompt (``Prepared.packed_prompt``).
            pc0 = time.thread_time_ns()
            p0 = time.perf_counter_ns()
            routed = packed_prompt(prompt)
            p1 = time.perf_counter_ns()
            pc1 = time.thread_time_ns()
            if i >= args.warmup:
                pack_ns.append(p1 - p0)
                pack_cpu_ns.append(pc1 - pc0)
        request = RouteRequest(routed, MODEL, time.monotonic())
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        prepared = router.prepare(request)
        t1 = time.perf_counter_ns()
        decision = router.select(prepared)
        t2 = time.perf_counter_ns()
        c2 = time.thread_time_ns()
        if i >= args.warmup:
            book_ns.append(book)
        # Untimed: the frontend's bookkeeping; about a quarter of the requests in flight are still prefilling.
        b0 = time.thread_time_ns()
        rid = f"r{i}"
        router.on_routed(rid, decision, prepared)
        if predicted:
            parent, hashes = predicted.pop()
            assert decision.instance_id is not None
            due.append((i + confirm_after, decision.instance_id, parent, hashes))
        prefilling.append(rid)
        if len(prefilling) > in_flight_target // 4:
            first = prefilling.popleft()
            router.on_first_token(first)
            decoding.append(first)
        if len(decoding) > in_flight_target - in_flight_target // 4:
            router.on_finished(decoding.popleft())
        book = time.thread_time_ns() - b0
        if i >= args.warmup:
            total_ns.append(t2 - t0)
            cpu_ns.append(c2 - c0)
            prepare_ns.append(t1 - t0)
            overlap_blocks += decision.overlap_blocks
            prompt_blocks += len(prepared.token_ids) // args.block_size
            if isinstance(prepared.block_hashes, PromptHashes):
                # Untimed for the decision: the hashes select read, chained again without a memo (what they cost
                # where no earlier prompt shared their chunks).
                k = prepared.block_hashes.num_computed
                again = PromptHashes(prepared.token_ids, prepared.block_size)
                t3 = time.perf_counter_ns()
                again.ensure(k)
                hashing_ns.append(time.perf_counter_ns() - t3)
                hashed_blocks += k
                del again
        # Untimed: the request ends here, as it would once answered. Without this, the next decision's ``prepare``
        # would drop the last reference to this prompt and pay for freeing its 8k token ints (~8 us) in its time.
        del request, prepared, prompt, routed
    if confirm:
        router.sync_listeners.remove(on_sync)
    for w, gone_set in gone_by.items():
        fleet.held[w] = [h for h in fleet.held[w] if h not in gone_set]
    for w, new in stored_by.items():
        fleet.held[w].extend(new)
    out: dict[str, Any] = {
        "decision_us": _stats_us(total_ns),
        "decision_cpu_us": _stats_us(cpu_ns),
        "bookkeeping_cpu_us": _stats_us(book_ns),
    }
    if router.uses_kv:
        out["prepare_us"] = _stats_us(prepare_ns)
        out["select_us"] = _stats_us([a - b for a, b in zip(total_ns, prepare_ns, strict=True)])
        if pack_ns:
            out["pack_us"] = _stats_us(pack_ns)
            out["pack_cpu_us"] = _stats_us(pack_cpu_ns)
        if hashing_ns:
            out["hashing_us"] = _stats_us(hashing_ns)
            out["hashed_blocks"] = round(hashed_blocks / len(hashing_ns), 1)
        out["routed_cached_fraction"] = round(overlap_blocks / prompt_blocks, 3) if prompt_blocks else None
        if confirm:
            out["provisional"] = {
                "confirm_after_decisions": confirm_after,
                "blocks_confirmed": confirmed,
                "blocks_evicted": evicted,
                "index_blocks_at_end": router.index.num_blocks(),
                "kv_events_cpu_us": _stats_us(events_ns),
            }
        if memo is not None and memo_at_start is not None and total_ns:
            hits, misses, reused = (
                now_ - then
                for now_, then in zip((memo.hits, memo.misses, memo.blocks_reused), memo_at_start, strict=True)
            )
            out["hash_memo"] = {
                "max_blocks": memo.max_blocks,
                "chunk_hits": hits,
                "chunk_misses": misses,
                "blocks_reused_per_decision": round(reused / len(total_ns), 1),
            }
    return out


def measure_overlaps(router: Router, fleet: Fleet, bs: int) -> dict[str, float | None]:
    """The index walk alone, over the same requests (hashed beforehand). Plain ``overlaps``: every worker holding
    the shared prefix is listed, where ``select`` asks ``overlaps_with_floor`` and gets only those holding more, so
    this is an upper bound on the search inside a decision."""
    hashed = [block_hashes(t, bs) for t in fleet.requests]
    samples = []
    overlaps = router.index.overlaps
    for _ in range(max(1, 1000 // len(hashed))):
        for h in hashed:
            t0 = time.perf_counter_ns()
            overlaps(h)
            samples.append(time.perf_counter_ns() - t0)
    return _stats_us(samples)


# --- ingest -----------------------------------------------------------------------------------------------------------


def ingest_batches(
    fleet: Fleet, next_id: dict[int, int], profile: str, blocks: int, bs: int, rng: random.Random
) -> list[tuple[int, list[KvEvent]]]:
    """Batches of events (one per worker message) storing new blocks and evicting each worker's oldest ones, until
    ``blocks`` block events (stored + removed) are generated. Mutates ``fleet.held`` and ``next_id`` so a later call
    continues where this one stopped."""
    held = {w: deque(h) for w, h in fleet.held.items()}
    workers = fleet.worker_ids
    out: list[tuple[int, list[KvEvent]]] = []
    total = 0
    k = 0
    while total < blocks:
        w = workers[k % len(workers)]
        k += 1
        fifo = held[w]
        eid = next_id[w]
        events: list[KvEvent] = []
        if profile == "single_block":
            for _ in range(8):
                h = rng.getrandbits(64)
                parent = fifo[-1] if fifo else None  # a decode step extends the worker's newest chain
                fifo.append(h)
                events.append(KvEvent(eid, KvEventKind.BLOCK_STORED, [h], parent, bs))
                events.append(KvEvent(eid + 1, KvEventKind.BLOCK_REMOVED, [fifo.popleft()]))
                eid += 2
                total += 2
        else:
            stored = 0
            for _ in range(8):
                n = rng.randint(16, 512) if rng.random() < 0.3 else 1
                hs = [rng.getrandbits(64) for _ in range(n)]
                parent = fifo[-1] if n == 1 and fifo else None  # decode blocks extend a chain, prefills start one
                fifo.extend(hs)
                events.append(KvEvent(eid, KvEventKind.BLOCK_STORED, hs, parent, bs))
                eid += 1
                stored += n
            events.append(KvEvent(eid, KvEventKind.BLOCK_REMOVED, [fifo.popleft() for _ in range(stored)]))
            eid += 1
            total += 2 * stored
        next_id[w] = eid
        out.append((w, events))
    for w, fifo in held.items():
        fleet.held[w] = list(fifo)
    return out


def measure_ingest(router: Router, fleet: Fleet, next_id: dict[int, int], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    bs = args.block_size
    profiles: dict[str, Any] = {}
    for profile in ("mixed", "single_block"):
        result: dict[str, Any] = {}
        for path in ("index", "with_decode"):
            batches = ingest_batches(fleet, next_id, profile, args.ingest_blocks, bs, rng)
            n_events = sum(len(evs) for _, evs in batches)
            n_blocks = sum(len(e.block_hashes) for _, evs in batches for e in evs)
            apply = router.apply_kv_events
            gc.collect()
            if path == "index":
                t0 = time.perf_counter()
                for w, evs in batches:
                    if not apply(w, evs):
                        raise AssertionError("a gap in generated event ids")  # pragma: no cover
                dt = time.perf_counter() - t0
            else:
                payloads = [(w, [e.to_dict() for e in evs]) for w, evs in batches]
                del batches
                from_dict = KvEvent.from_dict
                t0 = time.perf_counter()
                for w, payload in payloads:
                    if not apply(w, [from_dict(e) for e in payload]):
                        raise AssertionError("a gap in generated event ids")  # pragma: no cover
                dt = time.perf_counter() - t0
            result[path] = {
                "events": n_events,
                "block_events": n_blocks,
                "seconds": round(dt, 3),
                "events_per_s": round(n_events / dt),
                "block_events_per_s": round(n_blocks / dt),
            }
        profiles[profile] = result
    return {"workers": len(fleet.worker_ids), "indexed_blocks": router.index.num_blocks(), "profiles": profiles}


# --- run --------------------------------------------------------------------------------------------------------------


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    bs = args.block_size
    results: list[dict[str, Any]] = []
    ingest: dict[str, Any] | None = None
    for n_workers in args.workers:
        rng = random.Random(args.seed)
        t0 = time.perf_counter()
        fleet = build_fleet(n_workers, args, rng)
        kv = new_router("kv", fleet, args.seed, bs, args.prompt_hash_cache_blocks)
        next_id = load_index(kv, fleet, bs)
        next_id_at_load = dict(next_id)
        entry: dict[str, Any] = {
            "workers": n_workers,
            "indexed_blocks": fleet.indexed_blocks,
            "distinct_hashes": kv.index.num_blocks(),
            "setup_s": round(time.perf_counter() - t0, 1),
            "policies": {},
        }
        for policy in args.policies:
            if policy == "kv":
                router = kv
            else:
                router = new_router(policy, fleet, args.seed, bs, args.prompt_hash_cache_blocks)
                if router.uses_kv:  # the same cache contents as kv's (without them no search, no hashing past block 32)
                    load_index(router, fleet, bs)
            replay_previous_turns(router, fleet)
            # kv's own event ids (its index goes on to the ingest measurement); another KV router's from the same start
            ids = next_id if router is kv else dict(next_id_at_load)
            thresholds = gc.get_threshold()
            if args.gc_young_threshold > 0:  # the young generation's size as the frontend process serves
                gc.set_threshold(args.gc_young_threshold, *thresholds[1:])
            try:
                entry["policies"][policy] = measure_decisions(
                    router, fleet, args, random.Random(args.seed), ids, update_held=router is kv
                )
            finally:
                gc.set_threshold(*thresholds)
            del router
        entry["kv_overlaps_only_us"] = measure_overlaps(kv, fleet, bs)
        results.append(entry)
        print(f"bench router: {n_workers} workers: {json.dumps(entry['policies'])}", file=sys.stderr, flush=True)
        if args.ingest_blocks and (n_workers == INGEST_WORKERS or (ingest is None and n_workers == args.workers[-1])):
            ingest = measure_ingest(kv, fleet, next_id, args)
        del kv, fleet
        gc.collect()

    p99_at_target = None
    for e in results:
        if e["workers"] == TARGET_AT_WORKERS and e["indexed_blocks"] >= TARGET_AT_BLOCKS and "kv" in e["policies"]:
            p99_at_target = e["policies"]["kv"]["decision_us"]["p99"]
    ingest_rate = None
    if ingest is not None:
        ingest_rate = min(p["index"]["block_events_per_s"] for p in ingest["profiles"].values())
    return {
        "bench": "router",
        "prompt_tokens": args.prompt_tokens,
        "block_size": bs,
        "decisions": args.decisions,
        "arrival_rate_per_s": args.arrival_rate,
        "in_flight_per_worker": args.in_flight_per_worker,
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "families": args.families,
        "replicas": args.replicas,
        "hit_fraction": args.hit_fraction,
        "prompt_hash_cache_blocks": args.prompt_hash_cache_blocks,
        "results": results,
        "ingest": ingest,
        "targets": {
            "kv_decision_p99_us_at_256_workers_1m_blocks": {
                "target": TARGET_DECISION_P99_US,
                "measured": p99_at_target,
                "met": None if p99_at_target is None else p99_at_target <= TARGET_DECISION_P99_US,
            },
            "ingest_block_events_per_s": {
                "target": TARGET_INGEST_BLOCKS_PER_S,
                "measured": ingest_rate,
                "profile": "slowest of mixed and single_block, index path",
                "met": None if ingest_rate is None else ingest_rate >= TARGET_INGEST_BLOCKS_PER_S,
            },
        },
        "machine": {"python": platform.python_version(), "cpu": _cpu_model(), "cpus": os.cpu_count()},
    }


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _policy_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=_int_list, default=[8, 64, 256, 1024], help="fleet sizes, comma-separated")
    p.add_argument("--policies", type=_policy_list, default=list(POLICIES), help="policies to time, comma-separated")
    p.add_argument("--indexed-blocks", type=int, default=1_000_000, help="(worker, block) entries in the KV index")
    p.add_argument("--prompt-tokens", type=int, default=8192, help="tokens per request")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--decisions", type=int, default=2000, help="timed decisions per fleet size and policy")
    p.add_argument("--warmup", type=int, default=200, help="untimed decisions first")
    p.add_argument("--families", type=int, default=256, help="cached 8k-token conversations in the fleet")
    p.add_argument("--replicas", type=int, default=4, help="workers caching a prefix of each conversation")
    p.add_argument("--shared-prefix-tokens", type=int, default=512, help="system prompt every worker caches")
    p.add_argument("--hit-fraction", type=float, default=0.8, help="requests continuing a cached conversation")
    p.add_argument("--request-pool", type=int, default=256, help="sample prompts for kv_overlaps_only_us")
    p.add_argument("--in-flight-per-worker", type=int, default=4, help="requests in flight per worker (load counts)")
    p.add_argument("--arrival-rate", type=float, default=1000.0, help="requests/s that set load reports per decision")
    p.add_argument(
        "--gc-young-threshold",
        type=int,
        default=GC_YOUNG_THRESHOLD,
        help="the garbage collector's youngest-generation threshold while deciding: the frontend process's "
        f"(components.frontend.main, {GC_YOUNG_THRESHOLD:,}) by default; 0: leave CPython's (700)",
    )
    p.add_argument(
        "--confirm-after-ms",
        type=float,
        default=200.0,
        help="with provisional blocks: a routed request's worker stores the predicted blocks (and evicts as many it "
        "will never be asked for) this many ms of arrivals later (at --arrival-rate); the router's measured "
        "confirmation latency was 70-816 ms at p50",
    )
    p.add_argument("--ingest-blocks", type=int, default=2_000_000, help="block events per ingest measurement; 0: skip")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload and the routers")
    p.add_argument(
        "--prompt-hash-cache-blocks",
        type=int,
        default=None,
        help="the routers' memo of prompt-chunk hashes (RouterConfig.prompt_hash_cache_blocks; default: its "
        "default); 0: every prompt is hashed in full, as a router that never saw the conversations' earlier turns",
    )


def main(args: argparse.Namespace) -> int:
    print(json.dumps(run(args)), flush=True)
    return 0
