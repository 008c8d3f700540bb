"""``kvmesh bench rescheduling-live``: an imbalanced live fleet converges under the rescheduler, losing nothing.

1. ``kvmesh serve GRAPH --detach`` (default graphs/mock_rescheduler.yaml: embedded etcd and NATS, the frontend on a
   free loopback port, ONE simulated worker, the rescheduler as a watcher with ``neutral_load``) with the threshold,
   interval, KV cache and speed set by flags (``--set``).
2. ``--requests`` streams through the OpenAI API (``/v1/completions``, token-id prompts of ``--prompt-tokens``,
   ``ignore_eos``, ``--max-tokens`` each, sampling seed = the stream's index): all on the one worker.
3. When that worker's projected KV use reaches ``--add-at``, ``--add-workers`` more are started through the planner's
   local connector (``LocalConnector.set_pool_size``, the way the planner scales): the new workers are empty and the
   old one is full, the scale-up imbalance Llumnix motivates.
4. The fleet is read as the rescheduler reads it (a ``LiveFleet`` of the namespace, ``instance_views``, projected KV
   use as the policies compute it) every ``--sample-ms``. ``joined_s``: the first sample that has every worker with a
   load report. ``converged_s``: the first sample from then on at which no worker is a source any more (projected
   use below the threshold), also in rescheduler cycles (``ceil((converged - joined) / interval)``).
5. The rescheduler's own account (its status key, ``kvmesh status``'s source): cycles, pairs, migrations by outcome.
6. Integrity: every stream ends without an error with ``usage.completion_tokens`` = ``--max-tokens``, and its text
   equals the text of the same request on an unmoved in-process ``MockEngine`` of the graph's worker config,
   detokenised as the frontend does (``IncrementalDetokenizer``). The mock engine's token ``i`` is a hash of every
   token before it (components/workers/engines/mock/scheduler.py), so a token lost or repeated anywhere changes
   every later token, and the text with it.
7. ``--sim`` (default on): the same start in ``replay`` with ``PolicyRescheduler`` (components/sim/rescheduling.py:
   the live loop's planner and the agent's selection), in this process: the same graph and settings, the same
   requests at t = 0 on one worker, the scale-up asked for on the live side's trigger (a worker's projected use reaches
   ``--add-at``, not the live clock's ``add_s``: a busy machine delays the live side without the simulated streams
   being further along) with the live start-up (``joined_s - add_s``) (``simulate_same_start``); the same convergence
   rule on its load reports, compared: agreement = the two convergences within ``--agree-cycles`` cycles.

JSON on stdout's last line (also ``--out``/rescheduling-live.json); ``--png``: projected KV use per worker over time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from components.cli.bench.migration import prompt_of
from components.cli.bench.planner_live import ROOT, _kvmesh
from components.deploy.graph import load_graph
from components.deploy.state import read_state, resolve_state_dir
from components.fleet.live import LiveFleet
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.rescheduler.policies.common import projected_kv_use
from components.rescheduler.status import status_prefix
from components.rescheduler.views import instance_views
from components.runtime import Runtime, RuntimeConfig

PROMPT_VOCAB = 256  # prompt ids are bytes: the tiny tokenizer decodes them


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` flags of both sides (serve and simulate)."""
    sets = [
        "frontend.port=0",
        f"workers[0].num_gpu_blocks={args.num_gpu_blocks}",
        f"workers[0].speedup_ratio={args.speedup_ratio}",
        f"rescheduler.rescheduling_neutral_load_threshold={args.threshold}",
        f"rescheduler.rescheduling_interval_ms={args.interval_ms}",
    ]
    return [x for s in sets for x in ("--set", s)]


def convergence(samples: list[dict[str, Any]], fleet_size: int, threshold: float, interval_s: float) -> dict[str, Any]:
    """``samples`` (``{"t": s, "use": {worker: projected use}}``, in time order) -> when every one of ``fleet_size``
    workers is first seen (``joined_s``) and the first sample from then on with no worker at or above
    ``threshold`` (``converged_s``, None if none), with the cycles between them."""
    joined = next((s for s in samples if len(s["use"]) >= fleet_size), None)
    if joined is None:
        return {"joined_s": None, "converged_s": None, "cycles": None, "max_use_at_join": None}
    after = [s for s in samples if s["t"] >= joined["t"]]
    conv = next((s for s in after if max(s["use"].values()) < threshold), None)
    dt = None if conv is None else conv["t"] - joined["t"]
    # After converging, how long some worker was a source again (growing outputs push a worker back over the
    # threshold; the rescheduler may or may not find a request to move), each sample counting until the next.
    again = 0.0
    if conv is not None:
        later = [s for s in after if s["t"] >= conv["t"]]
        again = sum(b["t"] - a["t"] for a, b in itertools.pairwise(later) if max(a["use"].values()) >= threshold)
    return {
        "joined_s": round(joined["t"], 3),
        "max_use_at_join": round(max(joined["use"].values()), 4),
        "converged_s": None if conv is None else round(conv["t"], 3),
        "seconds": None if dt is None else round(dt, 3),
        "cycles": None if dt is None else math.ceil(dt / interval_s - 1e-9),
        "source_again_s": round(again, 3),
    }


async def _stream(session: Any, url: str, args: argparse.Namespace, i: int, started: set[int]) -> dict[str, Any]:
    import aiohttp

    body = {
        "model": args.model,
        "prompt": prompt_of(args.prompt_tokens, i, PROMPT_VOCAB),
        "max_tokens": args.max_tokens,
        "stream": True,
        "ignore_eos": True,
        "seed": i,
        "stream_options": {"include_usage": True},
    }
    out: dict[str, Any] = {"index": i, "error": None, "tokens": None, "text": ""}
    parts: list[str] = []
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = str(event["error"].get("message", ""))[:200]
                    return out
                started.add(i)
                for c in event.get("choices", []):
                    parts.append(c.get("text", ""))
                if event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
    except aiohttp.ClientError as e:
        out["error"] = repr(e)
    out["text"] = "".join(parts)
    return out


async def unmoved_texts(args: argparse.Namespace) -> dict[int, str]:
    """Each stream's text on an unmoved in-process MockEngine of the graph's worker config (module docstring, 6)."""
    from components.frontend.tokenizer import IncrementalDetokenizer, load_tokenizer
    from components.protocol.messages import GenerateRequest, SamplingParams
    from components.workers.config import EngineKind, build_engine
    from components.workers.simulated import MockEngineConfig

    group = load_graph(ROOT / args.graph, overrides(args)[1::2]).workers[0]
    fields = {k: v for k, v in group.model_dump().items() if k in MockEngineConfig.model_fields}
    engine = build_engine(EngineKind.MOCK, MockEngineConfig(**{**fields, "speedup_ratio": float("inf")}), "unmoved")
    tok = await asyncio.to_thread(load_tokenizer, str(group.model_path))
    await engine.start()
    try:
        texts = {}
        for i in range(args.requests):
            prompt = prompt_of(args.prompt_tokens, i, PROMPT_VOCAB)
            req = GenerateRequest(
                f"unmoved-{i}", prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i)
            )
            detok = IncrementalDetokenizer(tok, prompt)
            parts = [detok.feed(c.token_ids) async for c in engine.generate(req) if c.token_ids]
            texts[i] = "".join(parts) + detok.flush()
        return texts
    finally:
        await engine.shutdown()


async def _live(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import aiohttp

    from components.planner.connectors.local import LocalConnector
    from components.planner.policy import Pool

    state_dir = resolve_state_dir(out / "state")
    state_dir.mkdir(parents=True, exist_ok=True)
    started = await asyncio.to_thread(
        _kvmesh, "serve", str(ROOT / args.graph), "--detach", "--state-dir", str(state_dir), *overrides(args)
    )
    if started.returncode != 0:
        raise RuntimeError(f"kvmesh serve failed: {started.stdout[-2000:]}{started.stderr[-2000:]}")
    namespace = ""
    samples: list[dict[str, Any]] = []
    try:
        state = read_state(next(state_dir.glob("*.json")))
        namespace = state.namespace
        if not state.frontend_url:
            raise RuntimeError("the graph has no running frontend")
        rt = await Runtime.connect(
            RuntimeConfig(etcd_endpoints=state.etcd_endpoints, nats_url=state.nats_url), name="bench-resched-live"
        )
        fleet = LiveFleet(rt, namespace, follow_queues=False, follow_requests=False)
        await fleet.start()
        t0 = time.monotonic()
        wall0 = time.time()

        def sample() -> dict[str, Any]:
            snap = fleet.snapshot()
            use = {}
            for v in instance_views(snap):
                u = projected_kv_use(v)
                if u is not None:
                    use[f"{v.instance_id:x}"] = u
            s = {"t": time.monotonic() - t0, "use": use}
            samples.append(s)
            return s

        async def sampler() -> None:
            while True:
                sample()
                await asyncio.sleep(args.sample_ms / 1e3)

        sampling = asyncio.ensure_future(sampler())
        add_s = added_s = math.nan
        results: list[dict[str, Any]] = []
        try:
            client = await rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
            await client.wait_for_instances(1, timeout_s=60)
            streaming: set[int] = set()
            # The clock starts with the load (the simulated side's t = 0); earlier samples have t < 0.
            shift = time.monotonic() - t0
            for s in samples:
                s["t"] -= shift
            t0 += shift
            wall0 += shift
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout_s)) as session:
                load = asyncio.ensure_future(
                    asyncio.gather(
                        *(_stream(session, state.frontend_url, args, i, streaming) for i in range(args.requests))
                    )
                )
                # Wait for the one worker to fill to --add-at (every stream on it), then add workers.
                deadline = time.monotonic() + 120
                while not (samples and samples[-1]["use"] and max(samples[-1]["use"].values()) >= args.add_at):
                    if time.monotonic() > deadline or load.done():
                        raise RuntimeError(f"the worker did not reach projected KV use {args.add_at}")
                    await asyncio.sleep(args.sample_ms / 1e3)
                add_s = time.monotonic() - t0
                connector = LocalConnector(rt, namespace, args.model, state_dir)
                await connector.set_pool_size(Pool.DECODE, 1 + args.add_workers)
                added_s = time.monotonic() - t0
                results = await load
            ended_s = time.monotonic() - t0
            # The rescheduler's account: its status key, rewritten at least every 5 s; wait for one written after
            # the last stream ended.
            status: dict[str, Any] | None = None
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                listing = await rt.discovery.get_prefix(status_prefix(namespace))
                rows = [json.loads(v) for v in listing.values()]
                if rows and rows[0]["walltime"] >= wall0 + ended_s:
                    status = rows[0]
                    break
                await asyncio.sleep(0.5)
        finally:
            sampling.cancel()
            await fleet.stop()
            await rt.shutdown(drain_timeout_s=1)
    finally:
        if namespace:
            stopped = await asyncio.to_thread(_kvmesh, "stop", namespace, "--state-dir", str(state_dir))
            if stopped.returncode != 0:
                print(f"bench rescheduling-live: kvmesh stop {namespace}: {stopped.stderr[-1000:]}", file=sys.stderr)
    return {
        "add_s": round(add_s, 3),
        "added_s": round(added_s, 3),
        "ended_s": round(ended_s, 3),
        "samples": samples,
        "results": results,
        "status": status,
    }


def integrity(results: list[dict[str, Any]], expected: dict[int, str], max_tokens: int) -> dict[str, Any]:
    failed = [r for r in results if r["error"]]
    short = [r for r in results if not r["error"] and r["tokens"] != max_tokens]
    differ = [r["index"] for r in results if not r["error"] and r["text"] != expected[r["index"]]]
    return {
        "requests": len(results),
        "completed": len(results) - len(failed) - len(short),
        "failed": len(failed),
        "failures": sorted({str(r["error"]) for r in failed})[:3],
        "wrong_token_count": [(r["index"], r["tokens"]) for r in short],
        "text_differs_from_unmoved": differ,
        # The comparison has teeth only if the unmoved texts are non-empty and tell the streams apart.
        "unmoved_texts_distinct": len({t for t in expected.values() if t}) == len(expected),
        "intact": not failed and not short and not differ,
    }


def migrations_of(status: dict[str, Any] | None) -> dict[str, Any]:
    if status is None:
        return {"status_read": False}
    totals = status.get("totals", {})
    return {
        "status_read": True,
        "num_cycles": status.get("num_cycles"),
        "pairs_by_policy": status.get("pairs_by_policy"),
        "totals": totals,
    }


class _JoinAt:
    """A ``Scaler`` (components/sim/dynamics.py) that asks once for ``target`` workers, on the live side's trigger:
    the first pull at which a worker's projected KV use (as the rescheduler's views compute it) reaches ``add_at``.
    The trigger is the fleet's state, not the live side's clock: a slow live start (a busy machine) moves the live
    ``add_s`` later without the simulated streams being any further along. ``decided_s``: when it asked."""

    interval_s = 0.01
    start_s = 0.0

    def __init__(self, add_at: float, target: int, until_s: float) -> None:
        self.add_at = add_at
        self.target = target
        self.until_s = until_s  # replay pulls (and reports) until then: the live run's end
        self.decided_s: float | None = None

    def pull(self, now_s: float, fleet: Any, pools: Any) -> list[Any]:
        from components.sim.dynamics import DECODE, Resize

        if self.decided_s is not None:
            return []
        uses = [u for v in instance_views(fleet) if (u := projected_kv_use(v)) is not None]
        if not uses or max(uses) < self.add_at:
            return []
        self.decided_s = now_s
        return [Resize(DECODE, pools[DECODE].active, self.target, "bench: the live side's scale-up")]

    def resize_done(self, pool: str, now_s: float) -> None:
        pass


def simulate_same_start(
    args: argparse.Namespace, live_add_s: float, live_joined_s: float, live_ended_s: float
) -> dict[str, Any]:
    """The live start in ``replay`` with the rescheduler's policies (``PolicyRescheduler``): the same worker config
    and rescheduler settings (the graph with the same ``--set``s), the same requests at t = 0 on one worker, the
    scale-up asked for when a worker's projected use reaches ``--add-at`` (``_JoinAt``, the live trigger) with the
    live start-up (``joined_s - add_s``), pulling until the live run's end (``ended_s``). Samples at every load
    report (0.1 s): projected KV use per routed worker, as ``projected_kv_use`` reads a view (blocks in use plus the
    waiting prompt's, over all)."""
    import dataclasses

    from components.rescheduler.config import ReschedulerConfig
    from components.sim.replay import FleetSpec, Sample, replay
    from components.sim.rescheduling import PolicyRescheduler
    from components.sim.workload import SimRequest, Workload
    from components.workers.simulated import MockEngineConfig

    graph = load_graph(ROOT / args.graph, overrides(args)[1::2])
    group = graph.workers[0]
    if graph.rescheduler is None:
        raise RuntimeError(f"{args.graph} has no rescheduler section: nothing to simulate")
    fields = {k: v for k, v in group.model_dump().items() if k in MockEngineConfig.model_fields}
    engine = MockEngineConfig(**fields)
    workload = Workload(
        "rescheduling-live",
        tuple(
            SimRequest(0.0, tuple(prompt_of(args.prompt_tokens, i, PROMPT_VOCAB)), args.max_tokens)
            for i in range(args.requests)
        ),
    )
    startup_s = max(0.0, live_joined_s - live_add_s)
    spec = dataclasses.replace(
        FleetSpec(workers=1, engine=engine, metrics_interval_s=0.1), startup_s=startup_s, connector_delay_s=0.0
    )
    samples: list[dict[str, Any]] = []

    def observe(s: Sample) -> None:
        use = {}
        for i, ld in enumerate(s.loads):
            if ld.num_total_blocks:
                waiting = math.ceil(ld.num_waiting_prefill_tokens / engine.block_size)
                use[f"w{i}"] = (ld.num_active_blocks + waiting) / ld.num_total_blocks
        samples.append({"t": s.now_s, "use": use})

    # The graph's section holds ReschedulerConfig's fields (and where it runs, which the simulator has no use for).
    section = graph.rescheduler.model_dump()
    config = ReschedulerConfig(**{k: v for k, v in section.items() if k in ReschedulerConfig.model_fields})
    resched = PolicyRescheduler(config)
    scaler = _JoinAt(args.add_at, 1 + args.add_workers, live_ended_s)
    result = replay(
        workload,
        spec,
        graph.frontend.router_policy,
        args.seed,
        observer=observe,
        scaler=scaler,
        rescheduler=resched,
    )
    return {
        "startup_s": round(startup_s, 3),
        "add_s": None if scaler.decided_s is None else round(scaler.decided_s, 3),
        "rescheduler": resched.counters(),
        "migrations": result.migrations,
        "output_tokens_by_request": result.output_tokens_by_request,
        "samples": samples,
    }


def _draw(path: Path, live: list[dict[str, Any]], sim: list[dict[str, Any]] | None, threshold: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [("live (kvmesh serve)", live)] + ([("simulated", sim)] if sim else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (title, samples) in zip(axes[0], panels, strict=True):
        workers = sorted({w for s in samples for w in s["use"]})
        for w in workers:
            pts = [(s["t"], s["use"][w]) for s in samples if w in s["use"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"worker {w}", lw=1.2)
        ax.axhline(threshold, color="k", ls="--", lw=0.8, label=f"threshold {threshold}")
        ax.set_title(title)
        ax.set_xlabel("seconds since the first stream")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("projected KV use")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    interval_s = args.interval_ms / 1e3
    live = asyncio.run(_live(args, out))
    expected = asyncio.run(unmoved_texts(args))
    conv = convergence(live["samples"], 1 + args.add_workers, args.threshold, interval_s)
    report: dict[str, Any] = {
        "graph": args.graph,
        "settings": {
            k: getattr(args, k)
            for k in (
                "requests",
                "prompt_tokens",
                "max_tokens",
                "add_workers",
                "add_at",
                "threshold",
                "interval_ms",
                "num_gpu_blocks",
                "speedup_ratio",
                "sample_ms",
            )
        },
        "live": {
            "add_s": live["add_s"],
            "added_s": live["added_s"],
            "ended_s": live["ended_s"],
            "convergence": conv,
            "migrations": migrations_of(live["status"]),
            "integrity": integrity(live["results"], expected, args.max_tokens),
            "final_use": {w: round(u, 4) for w, u in live["samples"][-1]["use"].items()} if live["samples"] else {},
        },
    }
    (out / "live-samples.json").write_text(json.dumps(live["samples"]))
    sim_samples = None
    if args.sim and conv["joined_s"] is not None:
        sim = simulate_same_start(args, live["add_s"], conv["joined_s"], live["ended_s"])
        sim_samples = sim.pop("samples")
        sconv = convergence(sim_samples, 1 + args.add_workers, args.threshold, interval_s)
        sim["convergence"] = sconv
        report["simulated"] = sim
        agree = (
            conv["cycles"] is not None
            and sconv["cycles"] is not None
            and abs(conv["cycles"] - sconv["cycles"]) <= args.agree_cycles
        )
        report["agreement"] = {
            "criterion": f"live and simulated convergence within {args.agree_cycles} rescheduler cycles",
            "live_cycles": conv["cycles"],
            "sim_cycles": sconv["cycles"],
            "agree": agree,
        }
    if args.png:
        report["png"] = (
            str(out / "rescheduling-live.png")
            if _draw(out / "rescheduling-live.png", live["samples"], sim_samples, args.threshold)
            else None
        )
    (out / "rescheduling-live.json").write_text(json.dumps(report, indent=1))
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", default="graphs/mock_rescheduler.yaml", help="graph to serve (relative to the root)")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--out", default="runs/bench-rescheduling-live", help="directory of the JSON, PNG, state, logs")
    p.add_argument("--requests", type=int, default=16, help="streams, all on the one worker")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1000)
    p.add_argument("--add-workers", type=int, default=3, help="workers added once the first is loaded")
    p.add_argument("--add-at", type=float, default=0.3, help="the first worker's projected KV use that adds them")
    p.add_argument("--threshold", type=float, default=0.25, help="neutral_load's threshold (projected KV use)")
    p.add_argument("--interval-ms", type=int, default=500, help="the rescheduler's cycle")
    p.add_argument("--num-gpu-blocks", type=int, default=2048, help="each worker's KV cache (16-token blocks)")
    p.add_argument("--speedup-ratio", type=float, default=0.25, help="the simulated engines' speed (1: modelled)")
    p.add_argument("--sample-ms", type=int, default=250, help="how often the fleet is read")
    p.add_argument("--request-timeout-s", type=float, default=300)
    p.add_argument("--agree-cycles", type=int, default=2, help="live and simulated convergence agree within this")
    p.add_argument("--sim", action=argparse.BooleanOptionalAction, default=True, help="also run the simulated side")
    p.add_argument("--seed", type=int, default=0, help="the simulated side's seed")
    p.add_argument("--png", action=argparse.BooleanOptionalAction, default=True)


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(json.dumps(report))
    live = report["live"]
    ok = live["integrity"]["intact"] and live["convergence"]["converged_s"] is not None
    return 0 if ok else 1
