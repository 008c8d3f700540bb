"""``kvmesh bench routing-live``: routing quality on a live deployment (``kvmesh bench routing`` is the
capacity-calibrated sweep on a simulated fleet; this one runs the real frontend, NATS and workers). One slice of the
Mooncake conversation trace, replayed against a fresh deployment of simulated workers once per policy, same seed,
same slice: TTFT, prefix-cache hit rate, throughput and per-worker balance in one table (JSON on stdout's last line,
a human table on stderr).

Per policy (``round_robin``, ``random``, ``power_of_two``, ``least_loaded``, ``autellix``, ``kv``, ``kv+autellix``):

1. ``kvmesh serve graphs/mock_agg.yaml --detach`` in a state directory of its own, with ``frontend.router_policy`` set
   to the policy and ``router_seed`` to ``--seed``: a new etcd, NATS, frontend and workers, so every policy starts
   with cold caches and an empty router.
2. This process subscribes to the workers' ``load_metrics`` and ``kv_events`` topics (the same feeds the router reads).
3. ``run_load`` (``kvmesh bench load``'s engine) replays the slice open-loop on its timestamps times ``--time-scale``:
   Mooncake ``hash_ids`` expanded into 512-token blocks (equal ids, equal blocks, so conversations share prefixes),
   prompts cut to ``--max-input-tokens`` keeping their start (tiny-llama's 2048-token context: a cut prefix stays a
   shared prefix), each conversation named in the OpenAI ``user`` field (``hash_ids[1]``: block 0 is a system prompt
   every row of this trace shares) so Autellix can follow programs.
4. ``kvmesh stop``.

**The fleet, and why.** 8 workers (2 processes of 4). The mock engine models an 8B model on an H100 (its step-time
polynomial); ``--speedup-ratio 0.15`` runs it 6.7x slower than real time (a GPU that much slower, or a larger
model), so a 1984-token prefill step costs ~320 ms of wall time and prefill, which a cache hit saves, dominates TTFT.
``--time-scale 0.1`` replays the first 2,000 requests (669 trace seconds) in ~67 s: 30 requests/s, in bursts of up
to ~25 in one trace second, ~1,800 prompt tokens each after the cut. Per worker that is ~6.8k prompt tokens/s, of
which round-robin must compute ~70% (it hits little but the system prompt, 512 of every prompt's tokens), ~4.8k/s,
against a capacity of ~5.5k (one prompt per step) to ~7k (full 8,192-token steps) tokens/s: round-robin runs at
70-90% prefill utilisation on average and above 100% in the slice's busier minutes, so its queues grow; a policy
that computes fewer tokens or avoids the queues stays below saturation. That is the regime routing exists for; on
an idle fleet every policy's TTFT is one prefill. ``--num-gpu-blocks 4096`` (65k tokens per worker) puts the caches
under pressure: a conversation comes back after ~96 trace seconds (the median), when ~290 other prompts (~520k
tokens, one worker's cache per worker even with perfect placement) have arrived, so only placement that partitions
conversations keeps their prefixes; round-robin's workers run at up to 86% KV usage and preempt.
``--max-output-tokens 64`` bounds the decode phase (Mooncake's median is 350): the quantity under test is prefill,
and 350 tokens per request would make the replay a test of this 2-core machine's frontend. Autellix's
``locality_threshold_tokens`` is set to 1024: with prompts cut to 2048 its default of 2048 would call every request
short and make ``autellix`` plain least-loaded. A full run (7 policies) takes ~9 minutes.

**Measurements.** TTFT, end-to-end latency and throughput are the load generator's (client side, streamed). The
prefix-cache hit rate is the workers' own count: the frontend returns each request's cached prompt tokens in
``usage.prompt_tokens_details.cached_tokens`` (the engine's prefix hit at admission) and the hit rate is their sum
over the sum of prompt tokens. Per-worker load, from the workers' feeds during the replay: *requests in flight*
(running + waiting, the time average of the 100 ms ``load_metrics`` samples: by Little's law the arrival rate a
worker was given times the time it kept each request) and *computed tokens* (``BlockStored`` blocks times the block
size: prefill and decode work actually done, cache hits excluded). Balance is max / mean over the workers. Each row
also says how many CPU cores this benchmark used and how many the rest of the host did while it ran: on a small
shared machine other work can set the tail latencies, so compare policies across runs where "other" stayed low.

Targets (issue 6): ``kv`` beats ``round_robin`` by >= 2x on TTFT p99 with no loss of throughput (output tokens/s
within 5%, as many requests completed), and no policy's busiest worker carries more than 1.5x the mean load
(requests in flight). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from components.cli.bench.loadgen import LoadConfig, run_load
from components.deploy.state import ServeState, read_state, resolve_state_dir
from components.protocol.endpoints import ENDPOINT_GENERATE, TOPIC_KV_EVENTS, TOPIC_LOAD_METRICS
from components.protocol.messages import KvEventKind
from components.runtime import EventSubscription, Runtime, RuntimeConfig

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
POLICIES = ("round_robin", "random", "power_of_two", "least_loaded", "autellix", "kv", "kv+autellix")
TARGET_TTFT_P99_RATIO = 2.0
TARGET_MAX_OVER_MEAN_LOAD = 1.5
THROUGHPUT_TOLERANCE = 0.05
# tiny-llama's context (the graph's max_model_len): prompt + max_tokens must fit, or the frontend answers 400.
MODEL_CONTEXT_TOKENS = 2048


@dataclasses.dataclass
class WorkerFeed:
    """What one worker reported while the window was open."""

    in_flight_samples: list[int] = dataclasses.field(default_factory=list)
    kv_usage_samples: list[float] = dataclasses.field(default_factory=list)
    preemptions: list[int] = dataclasses.field(default_factory=list)  # cumulative counter: first and last seen
    blocks_stored: int = 0


class FeedCollector:
    """Subscribes to the workers' load metrics and KV events; counts only while ``open``."""

    def __init__(self) -> None:
        self.workers: dict[int, WorkerFeed] = {}
        self.open = False
        self._subs: list[EventSubscription[Any]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def _feed(self, iid: int) -> WorkerFeed:
        f = self.workers.get(iid)
        if f is None:
            f = self.workers[iid] = WorkerFeed()
        return f

    async def start(self, rt: Runtime, namespace: str) -> None:
        events = rt.namespace(namespace).events
        metrics: EventSubscription[Any] = await events.subscribe(TOPIC_LOAD_METRICS)
        kv: EventSubscription[Any] = await events.subscribe(TOPIC_KV_EVENTS)
        self._subs += [metrics, kv]
        self._tasks.append(asyncio.create_task(self._metrics(metrics), name="bench-routing-metrics"))
        self._tasks.append(asyncio.create_task(self._kv(kv), name="bench-routing-kv-events"))

    async def _metrics(self, sub: EventSubscription[Any]) -> None:
        async for ev in sub:
            if self.open:
                p = ev.payload
                f = self._feed(ev.source_id)
                f.in_flight_samples.append(int(p["num_running"]) + int(p["num_waiting"]))
                f.kv_usage_samples.append(float(p["kv_usage"]))
                f.preemptions.append(int(p["num_preemptions"]))

    async def _kv(self, sub: EventSubscription[Any]) -> None:
        stored = str(KvEventKind.BLOCK_STORED)
        async for ev in sub:
            if self.open:
                f = self._feed(ev.source_id)
                f.blocks_stored += sum(len(e.get("block_hashes") or ()) for e in ev.payload if e["kind"] == stored)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        # gather, not await-each under suppress(CancelledError): a cancelled stop() stays cancelled.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in self._subs:
            try:
                await sub.close()
            except Exception as e:  # noqa: BLE001 - the deployment is going away anyway; release the rest
                print(f"bench routing: closing {sub.topic}: {e}", file=sys.stderr)


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return total - idle, total


def _balance(values: list[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0.0
    return round(max(values) / mean, 3) if mean > 0 else None


def worker_summary(worker_ids: list[int], feeds: dict[int, WorkerFeed], block_size: int) -> dict[str, Any]:
    in_flight = []
    computed = []
    usage = []
    preempted = 0
    for iid in worker_ids:
        f = feeds.get(iid, WorkerFeed())
        s = f.in_flight_samples
        in_flight.append(sum(s) / len(s) if s else 0.0)
        usage.append(sum(f.kv_usage_samples) / len(f.kv_usage_samples) if f.kv_usage_samples else 0.0)
        computed.append(float(f.blocks_stored * block_size))
        if f.preemptions:
            preempted += f.preemptions[-1] - f.preemptions[0]
    return {
        "mean_in_flight": [round(x, 2) for x in in_flight],
        "computed_tokens": [int(x) for x in computed],
        "mean_kv_usage": [round(x, 3) for x in usage],
        "in_flight_max_over_mean": _balance(in_flight),
        "computed_tokens_max_over_mean": _balance(computed),
        "preemptions": preempted,
    }


def run_kvmesh(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvmesh ARGV...`` as a child process of this interpreter from the repository root, output captured
    (``kvmesh serve --detach`` / ``kvmesh stop`` for the live benchmarks, ``kvmesh simulate`` for simvalidate)."""
    return subprocess.run(
        [sys.executable, "-m", "components.cli.main", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def serve_overrides(policy: str, args: argparse.Namespace) -> list[str]:
    per_process, rest = divmod(args.workers, args.worker_processes)
    if rest:
        raise ValueError(f"--workers {args.workers} is not a multiple of --worker-processes {args.worker_processes}")
    sets = [
        "frontend.port=0",
        f"frontend.router_policy={policy}",
        f"frontend.router_seed={args.seed}",
        f"frontend.locality_threshold_tokens={args.locality_threshold_tokens}",
        f"workers[0].replicas={args.worker_processes}",
        f"workers[0].num_workers={per_process}",
        f"workers[0].speedup_ratio={args.speedup_ratio}",
        f"workers[0].num_gpu_blocks={args.num_gpu_blocks}",
        f"workers[0].block_size={args.block_size}",
        f"workers[0].seed={args.seed}",
    ]
    sets += [f"frontend.{kv}" for kv in args.router_arg]
    return [x for s in sets for x in ("--set", s)]


def _dir_name(policy: str) -> str:
    return policy.replace("+", "_")


@dataclasses.dataclass(frozen=True)
class LiveDeployment:
    """A graph served for a benchmark (``live_deployment``)."""

    state: ServeState
    url: str  # the frontend's
    runtime: Runtime  # connected to the deployment's etcd and NATS
    worker_ids: list[int]  # sorted


@contextlib.asynccontextmanager
async def live_deployment(
    graph: Path, state_dir: Path, overrides: list[str], workers: int, name: str
) -> AsyncIterator[LiveDeployment]:
    """``kvmesh serve GRAPH --detach`` in ``state_dir`` with ``overrides`` (``--set`` pairs), yielded once its first
    ``workers`` workers have registered, with a runtime named ``name``. On exit the runtime shuts down and ``kvmesh
    stop`` ends the deployment (a failed stop is printed)."""
    state_dir = resolve_state_dir(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    started = await asyncio.to_thread(
        run_kvmesh, "serve", str(graph), "--detach", "--state-dir", str(state_dir), *overrides
    )
    if started.returncode != 0:
        raise RuntimeError(f"kvmesh serve {graph} failed: {started.stdout[-2000:]}{started.stderr[-2000:]}")
    namespace = ""
    rt: Runtime | None = None
    try:
        state = read_state(next(state_dir.glob("*.json")))
        namespace = state.namespace
        url = state.frontend_url
        if not url:
            raise RuntimeError("the graph has no running frontend")
        rt = await Runtime.connect(
            RuntimeConfig(etcd_endpoints=state.etcd_endpoints, nats_url=state.nats_url), name=name
        )
        client = await rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        worker_ids = sorted(await client.wait_for_instances(workers, timeout_s=60))
        yield LiveDeployment(state, url, rt, worker_ids)
    finally:
        if rt is not None:
            await rt.shutdown(drain_timeout_s=1)
        if namespace:
            stopped = await asyncio.to_thread(run_kvmesh, "stop", namespace, "--state-dir", str(state_dir))
            if stopped.returncode != 0:
                print(f"{name}: kvmesh stop {namespace}: {stopped.stderr[-1000:]}", file=sys.stderr)


async def run_policy(policy: str, args: argparse.Namespace, state_root: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    collector = FeedCollector()
    async with live_deployment(
        ROOT / args.graph, state_root / _dir_name(policy), serve_overrides(policy, args), args.workers, "bench-routing"
    ) as live:
        state, worker_ids = live.state, live.worker_ids
        try:
            await collector.start(live.runtime, state.namespace)
            await asyncio.sleep(args.settle_s)  # the frontend's registry and router see every worker
            setup_s = time.perf_counter() - t0
            collector.open = True
            cpu0 = host_cpu_ticks()
            load = await run_load(
                LoadConfig(
                    url=live.url,
                    model=args.model,
                    trace=str(args.trace),
                    start_offset_s=args.start_offset_s,
                    time_scale=args.time_scale,
                    max_requests=args.max_requests,
                    duration_s=args.duration_s,
                    drain_timeout_s=args.drain_timeout_s,
                    request_timeout_s=args.drain_timeout_s + args.duration_s,
                    max_input_tokens=max_input_tokens(args),
                    max_output_tokens=args.max_output_tokens,
                    program_id_block=1,
                    seed=args.seed,
                    pids=[proc.pid for proc in state.all_processes()],
                    progress=False,
                )
            )
            collector.open = False
            cpu1 = host_cpu_ticks()
            await asyncio.sleep(0.2)  # events already in flight are not counted; the window closed with the load
        finally:
            await collector.stop()
    prompt = load["input_tokens"]
    own = own_cpu_cores(load)
    host_cores = (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]) * (os.cpu_count() or 1) if cpu1[1] > cpu0[1] else None
    return {
        "policy": policy,
        "requests_sent": load["requests_sent"],
        "requests_completed": load["requests_completed"],
        "errors": load["errors"],
        "ttft_ms": load["ttft_ms"],
        "e2e_ms": load["e2e_ms"],
        "prefix_cache_hit_rate": round(load["cached_input_tokens"] / prompt, 4) if prompt else None,
        "input_tokens": prompt,
        "cached_input_tokens": load["cached_input_tokens"],
        "duration_s": load["duration_s"],
        "requests_per_s": load["requests_per_s"],
        "output_tokens_per_s": load["output_tokens_per_s"],
        "input_tokens_per_s": load["input_tokens_per_s"],
        "max_in_flight": load["max_in_flight"],
        "dispatch_lag_ms_p99": (load.get("dispatch_lag_ms") or {}).get("p99"),
        "workers": worker_summary(worker_ids, collector.workers, args.block_size),
        # CPU while the slice ran: cores this benchmark used (the deployment's processes and this load generator),
        # and cores the rest of the host used. On a small machine shared with other work, a busy host, not the
        # simulated GPUs, can set the tail latencies: compare policies only across runs where "other" stayed low.
        "own_cpu_cores": own,
        "other_cpu_cores": None if own is None or host_cores is None else round(max(0.0, host_cores - own), 3),
        "setup_s": round(setup_s, 1),
        "policy_wall_s": round(time.perf_counter() - t0, 1),
    }


def own_cpu_cores(load: dict[str, Any]) -> float | None:
    cpu = load["cpu"]
    pid_ms = [p["cpu_ms"] for p in cpu["pids"].values()]
    if not load["duration_s"] or any(ms is None for ms in pid_ms):
        return None
    return round((sum(pid_ms) + cpu["loadgen_cpu_ms"]) / 1000 / load["duration_s"], 3)


def max_input_tokens(args: argparse.Namespace) -> int:
    return args.max_input_tokens or MODEL_CONTEXT_TOKENS - args.max_output_tokens


def check_targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv, rr = rows.get("kv"), rows.get("round_robin")
    if kv is not None and rr is not None:
        kv_p99, rr_p99 = kv["ttft_ms"]["p99"], rr["ttft_ms"]["p99"]
        ratio = round(rr_p99 / kv_p99, 3) if kv_p99 and rr_p99 else None
        tput = round(kv["output_tokens_per_s"] / rr["output_tokens_per_s"], 3) if rr["output_tokens_per_s"] else None
        no_loss = (
            tput is not None
            and tput >= 1 - THROUGHPUT_TOLERANCE
            and kv["requests_completed"] >= rr["requests_completed"]
        )
        out["kv_ttft_p99_speedup_over_round_robin"] = {
            "target": TARGET_TTFT_P99_RATIO,
            "measured": ratio,
            "met": None if ratio is None else ratio >= TARGET_TTFT_P99_RATIO,
        }
        out["kv_throughput_over_round_robin"] = {
            "target": f">= {1 - THROUGHPUT_TOLERANCE:g} (output tokens/s) and as many requests completed",
            "measured": tput,
            "met": no_loss,
        }
    worst = {p: r["workers"]["in_flight_max_over_mean"] for p, r in rows.items()}
    known = [v for v in worst.values() if v is not None]
    out["max_over_mean_load"] = {
        "target": TARGET_MAX_OVER_MEAN_LOAD,
        "measured": worst,
        "met": None if not known else max(known) <= TARGET_MAX_OVER_MEAN_LOAD,
    }
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'policy':<13} {'TTFT p50':>9} {'TTFT p99':>9} {'hit rate':>8} {'req/s':>7} {'out tok/s':>9} "
        f"{'load max/mean':>13} {'work max/mean':>13} {'done':>6} {'errors':>6} {'CPU own/other':>13}"
    )
    lines = [head, "-" * len(head)]
    for p, r in rows.items():
        t = r["ttft_ms"]
        hit = r["prefix_cache_hit_rate"]
        w = r["workers"]
        lines.append(
            f"{p:<13} {_fmt(t['p50']):>9} {_fmt(t['p99']):>9} {_fmt(None if hit is None else 100 * hit, '%'):>8} "
            f"{r['requests_per_s']:>7.2f} {r['output_tokens_per_s']:>9.1f} "
            f"{_fmt(w['in_flight_max_over_mean'], 'x', 2):>13} {_fmt(w['computed_tokens_max_over_mean'], 'x', 2):>13} "
            f"{r['requests_completed']:>6} {sum(r['errors'].values()):>6} "
            f"{_fmt(r['own_cpu_cores'], '', 2) + '/' + _fmt(r['other_cpu_cores'], '', 2):>13}"
        )
    return "\n".join(lines) + "\n(TTFT in ms; load: requests in flight; work: computed tokens; CPU in cores)"


def _fmt(x: float | None, unit: str = "", nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    temporary = not args.state_dir
    state_root = Path(args.state_dir or tempfile.mkdtemp(prefix="kvmesh-bench-routing-"))
    rows: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for policy in args.policies:
        try:
            rows[policy] = await run_policy(policy, args, state_root)
        except BaseException:
            print(f"bench routing: {policy} failed; its state and logs are in {state_root}", file=sys.stderr)
            raise
        if temporary:
            # A deployment's state directory holds etcd's preallocated WAL (64 MB) and the logs: ~60 MB per policy.
            await asyncio.to_thread(shutil.rmtree, state_root / _dir_name(policy), ignore_errors=True)
        r = rows[policy]
        print(
            f"bench routing: {policy}: TTFT p50/p99 {r['ttft_ms']['p50']}/{r['ttft_ms']['p99']} ms, hit rate "
            f"{r['prefix_cache_hit_rate']}, {r['requests_completed']}/{r['requests_sent']} done, "
            f"{r['policy_wall_s']} s",
            file=sys.stderr,
            flush=True,
        )
    print(table(rows), file=sys.stderr, flush=True)
    if temporary:
        await asyncio.to_thread(shutil.rmtree, state_root, ignore_errors=True)
    return {
        "bench": "routing",
        "trace": str(args.trace),
        "slice": {
            "start_offset_s": args.start_offset_s,
            "max_requests": args.max_requests,
            "time_scale": args.time_scale,
            "max_input_tokens": max_input_tokens(args),
            "max_output_tokens": args.max_output_tokens,
        },
        "fleet": {
            "graph": args.graph,
            "workers": args.workers,
            "worker_processes": args.worker_processes,
            "speedup_ratio": args.speedup_ratio,
            "num_gpu_blocks": args.num_gpu_blocks,
            "block_size": args.block_size,
        },
        "router": {
            "seed": args.seed,
            "locality_threshold_tokens": args.locality_threshold_tokens,
            "router_args": list(args.router_arg),
        },
        "policies": rows,
        "targets": check_targets(rows),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _policy_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (default: ../shared/traces/...)")
    p.add_argument("--policies", type=_policy_list, default=list(POLICIES), help="policies, comma-separated")
    p.add_argument("--graph", default="graphs/mock_agg.yaml", help="graph to serve (relative to the repository)")
    p.add_argument("--model", default="tiny-llama", help="model name the graph serves")
    p.add_argument("--workers", type=int, default=8, help="simulated workers")
    p.add_argument("--worker-processes", type=int, default=2, help="processes the workers are spread over")
    p.add_argument("--speedup-ratio", type=float, default=0.15, help="mock engine time vs wall time (see above)")
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="KV cache blocks per worker")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--start-offset-s", type=float, default=0.0, help="slice start, in trace seconds")
    p.add_argument("--max-requests", type=int, default=2000, help="slice length, in requests")
    p.add_argument("--time-scale", type=float, default=0.1, help="0.1 replays the slice 10x faster")
    p.add_argument("--duration-s", type=float, default=300.0, help="no request is sent after this long (wall)")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="then requests in flight get this long")
    p.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        help=f"cut prompts, keeping their start (default: {MODEL_CONTEXT_TOKENS} - --max-output-tokens)",
    )
    p.add_argument("--max-output-tokens", type=int, default=64, help="cap each request's output")
    p.add_argument("--locality-threshold-tokens", type=int, default=1024, help="autellix's short/long split")
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a RouterConfig field for every policy's frontend, e.g. overlap_weight=2 (repeatable)",
    )
    p.add_argument("--settle-s", type=float, default=1.0, help="wait after the workers register, before the load")
    p.add_argument("--seed", type=int, default=0, help="seeds the router, the engines and the prompts")
    p.add_argument("--state-dir", default=None, help="parent of each policy's state directory (default: a temp dir)")


def main(args: argparse.Namespace) -> int:
    if not Path(args.trace).is_file():
        print(f"kvmesh bench routing: no trace at {args.trace}", file=sys.stderr)
        return 2
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0
