"""``kvmesh bench scale-down``: how long removing a worker with long outputs in flight takes, drain by waiting vs
migration-assisted (issue 26; docs/rescheduler.md, "Migration-assisted scale-down").

Real processes on loopback: etcd and nats-server (started here unless ``--etcd``/``--nats``), two ``kvmesh worker``
processes of simulated engines in real time (``--speedup-ratio``), and on the migration side a ``kvmesh rescheduler``
process with its defaults (500 ms cycles, the default policy list: the leaving aggregated worker is emptied by
``neutral_failover``). Each round:

1. start the two workers (and the rescheduler on the migration side) in a namespace of their own;
2. stream ``--requests`` requests of ``--prompt-tokens`` + ``--output-tokens`` to the worker that will leave (a
   scale-down picks its victim; pinning the load to it makes every request a request in flight during the
   scale-down), wait until each has ``--warm-tokens`` outputs, then a further random part of one rescheduling
   interval (``--seed``), so that the decision falls at a random phase of the rescheduler's cycle as a planner's
   would (the bench's steps take nearly the same time each round, so without it every round would find the
   rescheduler at the same phase and the spread would hide the wait of up to one interval);
3. the decision: SIGTERM to the leaving worker's process, as the planner's local connector sends it a few ms after
   its decision (components/planner/connectors/local.py, which then polls for the exit every 0.2 s and removes the
   watcher: the same on both sides, left out here so that the figure is the worker's own, to the ms); right after,
   ``--new-requests`` requests arrive at the staying worker (where a router sends new work during the scale-down);
4. the scale-down time: from the SIGTERM to the process's exit (``waitpid``); then every stream is read to its end.

Per round it records the scale-down time, how many in-flight requests were still running at the exit, the
rescheduler's committed migrations (its /metrics), the in-flight requests' inter-token gaps between the SIGTERM and
the exit and their largest gap at any time after the SIGTERM (a migrated request's pause would show there), the new
requests' TTFT, and the failures: a stream that raised, ended short, or whose chunk positions skipped or repeated a
token. Sides alternate ABBA (drain, migrate, migrate, drain, ...) for ``--rounds`` pairs, so a drift of the shared
machine falls on both. JSON on stdout's last line: every round, each side's median and spread, the ratio of the
medians and of each ABBA pair; ``--png``: the scale-down times per round.

Bounded: at most ``--rounds`` x 2 rounds, each limited by ``--round-timeout-s``; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from components.cli.bench.mesh import add_mesh_arguments, mesh_servers
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.runtime import Runtime, RuntimeConfig

ROOT = Path(__file__).resolve().parents[3]
DRAIN, MIGRATE = "drain", "migrate"
VOCAB = 1000


# --- pure pieces ----------------------------------------------------------------------------------------------------


def abba(rounds: int) -> list[str]:
    """The sides in ABBA order: ``rounds`` pairs, drain first in every even pair."""
    out: list[str] = []
    for r in range(rounds):
        out += [DRAIN, MIGRATE] if r % 2 == 0 else [MIGRATE, DRAIN]
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def stream_figures(failures: list[str], during: list[float], after: list[float], ttfts: list[float]) -> dict[str, Any]:
    """What a round's clients saw (both ``--via`` modes): failures, the inter-token gaps (s) between the SIGTERM and
    the exit, the largest gap after the SIGTERM, and the new requests' TTFTs (ms)."""
    return {
        "failed": len(failures),
        "failures": sorted(set(failures))[:3],
        "itl_during_p50_ms": round(statistics.median(during) * 1000, 2) if during else None,
        "itl_during_p99_ms": round(p * 1000, 2) if (p := percentile(during, 99)) is not None else None,
        "max_gap_ms": round(max(after) * 1000, 1) if after else None,
        "new_ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
        "new_ttft_max_ms": round(max(ttfts), 1) if ttfts else None,
    }


def gaps_in(times: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive chunk arrival ``times`` whose later chunk arrived within [start, end]."""
    return [b - a for a, b in itertools.pairwise(times) if start <= b <= end]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each side's scale-down times (median, min, max), failures, and the drain/migrate ratios: of the medians and
    of each ABBA pair (round 2k with 2k+1)."""
    out: dict[str, Any] = {}
    for side in (DRAIN, MIGRATE):
        rs = [r for r in rounds if r["side"] == side]
        times = [r["scale_down_s"] for r in rs]

        def median_of(key: str, rs: list[dict[str, Any]] = rs) -> float | None:
            values = [r[key] for r in rs if r[key] is not None]
            return statistics.median(values) if values else None

        out[side] = {
            "scale_down_s": times,
            "median_s": statistics.median(times) if times else None,
            "min_s": min(times, default=None),
            "max_s": max(times, default=None),
            "failed": sum(r["failed"] for r in rs),
            "requests": sum(r["requests"] + r["new_requests"] for r in rs),
            "itl_during_p50_ms": median_of("itl_during_p50_ms"),
            "itl_during_p99_ms": max((r["itl_during_p99_ms"] for r in rs if r["itl_during_p99_ms"] is not None),
                                     default=None),
            "max_gap_ms": max((r["max_gap_ms"] for r in rs if r["max_gap_ms"] is not None), default=None),
            "new_ttft_p50_ms": median_of("new_ttft_p50_ms"),
        }  # fmt: skip
        if any(r.get("pairs_cycle_s") is not None for r in rs):  # the rescheduler's record: wait, then migrations
            out[side]["pairs_cycle_at_s"] = [r["pairs_cycle_at_s"] for r in rs]
            out[side]["pairs_cycle_s"] = [r["pairs_cycle_s"] for r in rs]
        if rs and all("set_pool_size_s" in r for r in rs):  # --via serve: the connector's whole call too
            out[side]["set_pool_size_s"] = [r["set_pool_size_s"] for r in rs]
            out[side]["set_pool_size_median_s"] = median_of("set_pool_size_s")
    d, m = out[DRAIN]["median_s"], out[MIGRATE]["median_s"]
    out["ratio_of_medians"] = round(d / m, 2) if d and m else None
    pairs = []
    for k in range(0, len(rounds) - 1, 2):
        a, b = rounds[k], rounds[k + 1]
        by = {a["side"]: a["scale_down_s"], b["side"]: b["scale_down_s"]}
        if set(by) == {DRAIN, MIGRATE} and by[MIGRATE] > 0:
            pairs.append(round(by[DRAIN] / by[MIGRATE], 2))
    out["ratio_per_pair"] = pairs
    out["failed"] = out[DRAIN]["failed"] + out[MIGRATE]["failed"]
    return out


# --- one round ------------------------------------------------------------------------------------------------------


class _Timing:
    """What a round reads of one stream: when it was sent, when each chunk arrived, how many tokens, why it failed."""

    max_tokens: int
    t_sent: float
    times: list[float]
    num_tokens: int
    error: str | None
    task: asyncio.Future[None]

    @property
    def failed(self) -> bool:
        return self.error is not None or self.num_tokens != self.max_tokens

    @property
    def ttft_ms(self) -> float | None:
        return (self.times[0] - self.t_sent) * 1000 if self.times else None


class TimedStream(_Timing):
    """One request's stream read in the background: arrival time and position of every chunk, positions checked."""

    def __init__(self, stream: Any, max_tokens: int) -> None:
        self.stream = stream
        self.max_tokens = max_tokens
        self.t_sent = time.monotonic()
        self.times: list[float] = []
        self.num_tokens = 0
        self.error: str | None = None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for item in self.stream:
                chunk = TokenChunk.from_dict(item)
                if chunk.position != self.num_tokens:
                    self.error = f"position {chunk.position} after {self.num_tokens} tokens"
                    return
                self.num_tokens += len(chunk.token_ids)
                self.times.append(time.monotonic())
        except Exception as e:  # noqa: BLE001 - a failed request is a result of the bench, counted
            self.error = f"{type(e).__name__}: {e}"


def _env(cfg: RuntimeConfig) -> dict[str, str]:
    return os.environ | {"KVMESH_ETCD_ENDPOINTS": cfg.etcd_endpoints[0], "KVMESH_NATS_URL": cfg.nats_url}


def _spawn(cfg: RuntimeConfig, *argv: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "components.cli.main", "--log-level", "WARNING", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(cfg), stdout=subprocess.PIPE, text=True)


async def _ready(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    assert proc.stdout is not None
    async with asyncio.timeout(timeout_s):
        line = await asyncio.to_thread(proc.stdout.readline)
    if not line.startswith("READY "):
        raise RuntimeError(f"process did not start: {line!r}")
    return line.strip()


def _worker(cfg: RuntimeConfig, ns: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    return _spawn(
        cfg,
        "worker",
        "--namespace",
        ns,
        "--speedup-ratio",
        str(args.speedup_ratio),
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--vocab-size",
        str(VOCAB),
        "--eos-token-id",
        str(VOCAB - 1),
    )


async def _stop(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.to_thread(proc.wait, timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def _request(rid: str, prompt_tokens: int, max_tokens: int, salt: int) -> GenerateRequest:
    prompt = [(31 * i + 7 * salt) % (VOCAB - 1) for i in range(prompt_tokens)]
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _migrations_committed(metrics_url: str) -> float | None:
    """``kvmesh_rescheduler_migrations_succeeded_total`` summed over its labels, from the rescheduler's /metrics."""
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s, s.get(metrics_url) as r:
            text = await r.text()
    except aiohttp.ClientError:
        return None
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvmesh_rescheduler_migrations_succeeded_total")
    )


async def _last_pairs_cycle(rt: Runtime, ns: str) -> dict[str, Any] | None:
    """The rescheduler's ``last_pairs_cycle`` from its status key (components/rescheduler/status.py)."""
    from components.rescheduler.status import status_prefix

    for raw in (await rt.discovery.get_prefix(status_prefix(ns))).values():
        cycle = json.loads(raw).get("last_pairs_cycle")
        if cycle:
            return dict(cycle)
    return None


async def one_round(
    cfg: RuntimeConfig, args: argparse.Namespace, index: int, side: str, rng: random.Random
) -> dict[str, Any]:
    ns = f"scaledown{os.getpid()}r{index}"
    leaving, staying = _worker(cfg, ns, args), _worker(cfg, ns, args)
    procs = [leaving, staying]
    rt: Runtime | None = None
    try:
        leaving_id = int((await _ready(leaving)).split(": ")[1], 16)
        staying_id = int((await _ready(staying)).split(": ")[1], 16)
        metrics_url = ""
        if side == MIGRATE:
            interval = str(args.rescheduling_interval_ms)
            resched = _spawn(cfg, "rescheduler", "--namespace", ns, "--rescheduling-interval-ms", interval)
            procs.append(resched)
            metrics_url = (await _ready(resched)).rsplit(" ", 1)[1]
        rt = await Runtime.connect(cfg)
        gen = await rt.namespace(ns).component("backend").endpoint("generate").client()
        await gen.wait_for_instances(2, timeout_s=30)
        n, out = args.requests, args.output_tokens
        streams = [
            TimedStream(
                await gen.direct(_request(f"r{index}-{i}", args.prompt_tokens, out, i).to_dict(), leaving_id), out
            )
            for i in range(n)
        ]
        deadline = time.monotonic() + args.round_timeout_s
        while not all(s.num_tokens >= args.warm_tokens or s.task.done() for s in streams):
            if time.monotonic() > deadline:
                raise RuntimeError("the requests did not start decoding")
            await asyncio.sleep(0.01)
        # The decision falls anywhere in the rescheduler's cycle (its loop runs on its own clock): without this the
        # bench's fixed sequence of steps would land it at nearly the same phase every round.
        await asyncio.sleep(rng.uniform(0.0, args.rescheduling_interval_ms / 1000))
        tokens_at_sigterm = [s.num_tokens for s in streams]
        t_term, wall_term = time.monotonic(), time.time()
        leaving.send_signal(signal.SIGTERM)
        new = []
        for i in range(args.new_requests):
            req = _request(f"n{index}-{i}", args.prompt_tokens, args.new_output_tokens, 100 + i)
            new.append(TimedStream(await gen.direct(req.to_dict(), staying_id), args.new_output_tokens))
        rc = await asyncio.to_thread(leaving.wait, args.round_timeout_s)
        t_exit = time.monotonic()
        in_flight_at_exit = sum(not s.task.done() for s in streams)
        async with asyncio.timeout(args.round_timeout_s):
            await asyncio.gather(*(s.task for s in streams + new))
        committed = await _migrations_committed(metrics_url) if metrics_url else None
        cycle = await _last_pairs_cycle(rt, ns) if side == MIGRATE else None
        during = [g for s in streams for g in gaps_in(s.times, t_term, t_exit)]
        after = [g for s in streams for g in gaps_in(s.times, t_term, float("inf"))]
        ttfts = [t for s in new if (t := s.ttft_ms) is not None]
        failures = [s.error or f"{s.num_tokens} of {s.max_tokens} tokens" for s in streams + new if s.failed]
        return {
            "round": index,
            "side": side,
            "scale_down_s": round(t_exit - t_term, 3),
            "exit_code": rc,
            "requests": n,
            "new_requests": len(new),
            "in_flight_at_exit": in_flight_at_exit,
            "tokens_at_sigterm": [min(tokens_at_sigterm), max(tokens_at_sigterm)],
            "migrations_committed": committed,
            # The rescheduler's own record of its last cycle that ran pairs (its status for kvmesh status): when its
            # migrate call began after the SIGTERM, and how long the cycle took (the migrations, one at a time).
            "pairs_cycle_at_s": round(cycle["walltime"] - wall_term, 3) if cycle else None,
            "pairs_cycle_s": cycle["duration_s"] if cycle else None,
            **stream_figures(failures, during, after, ttfts),
        }
    finally:
        if rt is not None:
            with contextlib.suppress(Exception):
                await rt.shutdown(drain_timeout_s=1.0)
        for proc in reversed(procs):
            await _stop(proc)


# --- one round through kvmesh serve and the planner's connector ------------------------------------------------------


class SseStream(_Timing):
    """One completion streamed from the frontend (OpenAI SSE): arrival time of every event with text, the usage's
    token count, an error event or HTTP status as the failure."""

    def __init__(self, session: Any, url: str, body: dict[str, Any]) -> None:
        self.max_tokens = int(body["max_tokens"])
        self.t_sent = time.monotonic()
        self.times: list[float] = []
        self.num_tokens = 0
        self.error: str | None = None
        self.task = asyncio.ensure_future(self._read(session, url, body))

    async def _read(self, session: Any, url: str, body: dict[str, Any]) -> None:
        import aiohttp

        try:
            async with session.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    self.error = f"HTTP {r.status}"
                    return
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = str(event["error"].get("message", event["error"]))[:200]
                        return
                    if event.get("choices"):
                        self.times.append(time.monotonic())
                    if event.get("usage"):
                        self.num_tokens = int(event["usage"]["completion_tokens"])
        except (aiohttp.ClientError, TimeoutError) as e:
            self.error = f"{type(e).__name__}: {e}"


def _kvmesh(*argv: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "components.cli.main", *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


async def serve_round(args: argparse.Namespace, index: int, side: str, rng: random.Random) -> dict[str, Any]:
    """``kvmesh serve`` of ``--graph`` (its rescheduler section on or off), ``--requests`` streams per worker through
    the frontend (round robin), then the planner's decision: ``LocalConnector.set_pool_size(decode, 1)``, timed to
    the victim's exit (its pid polled every 5 ms) and to the call's return (the watcher removed, serve's state
    refreshed)."""
    import tempfile

    import aiohttp

    from components.deploy.state import read_state
    from components.planner.connectors.local import LocalConnector
    from components.planner.policy import Pool

    ns = f"scaledown{os.getpid()}s{index}"
    with tempfile.TemporaryDirectory(prefix="kvmesh-scale-down-") as tmp:
        state_dir = Path(tmp)
        sets = [
            f"namespace={ns}",
            f"rescheduler.enable_rescheduling={'true' if side == MIGRATE else 'false'}",
            f"rescheduler.rescheduling_interval_ms={args.rescheduling_interval_ms}",
            f"workers[0].speedup_ratio={args.speedup_ratio}",
            f"workers[0].num_gpu_blocks={args.num_gpu_blocks}",
        ]
        if args.colocated:
            sets.append("rescheduler.colocated_rescheduling_mode=true")
        flags = [x for v in sets for x in ("--set", v)]
        started = await asyncio.to_thread(
            _kvmesh, "serve", str(ROOT / args.graph), "--detach", "--state-dir", tmp, *flags
        )
        if started.returncode != 0:
            raise RuntimeError(f"kvmesh serve failed: {started.stdout[-1500:]}{started.stderr[-1500:]}")
        rt: Runtime | None = None
        try:
            state = read_state(state_dir / f"{ns}.json")
            workers = [w for w in state.watchers if w.kind == "worker"]
            victim = workers[-1]  # the connector removes the pool's last active watcher
            pid = victim.processes[0].pid
            rt = await Runtime.connect(RuntimeConfig(etcd_endpoints=state.etcd_endpoints, nats_url=state.nats_url))
            gen = await rt.namespace(ns).component("backend").endpoint("generate").client()
            await gen.wait_for_instances(len(workers), timeout_s=60)
            model = workers[0].model
            if model is None:
                raise RuntimeError(f"{args.graph}: its worker group names no model")

            def body(i: int, max_tokens: int) -> dict[str, Any]:
                prompt = [1 + (31 * k + 7 * i) % 250 for k in range(args.prompt_tokens)]
                return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                        "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip

            url = str(state.frontend_url)
            timeout = aiohttp.ClientTimeout(total=args.round_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                n = args.requests * len(workers)
                streams = [SseStream(session, url, body(i, args.output_tokens)) for i in range(n)]
                deadline = time.monotonic() + args.round_timeout_s
                while not all(len(s.times) >= args.warm_tokens or s.task.done() for s in streams):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the requests did not start decoding")
                    await asyncio.sleep(0.01)
                await asyncio.sleep(rng.uniform(0.0, args.rescheduling_interval_ms / 1000))
                connector = LocalConnector(rt, ns, model, state_dir)
                t0 = time.monotonic()
                change = asyncio.ensure_future(connector.set_pool_size(Pool.DECODE, len(workers) - 1))
                new = [SseStream(session, url, body(100 + i, args.new_output_tokens)) for i in range(args.new_requests)]
                while not _gone(pid):
                    if time.monotonic() - t0 > args.round_timeout_s:
                        raise RuntimeError(f"{victim.name} did not exit")
                    await asyncio.sleep(0.005)
                t_exit = time.monotonic()
                in_flight_at_exit = sum(not s.task.done() for s in streams)
                await change
                t_done = time.monotonic()
                async with asyncio.timeout(args.round_timeout_s):
                    await asyncio.gather(*(s.task for s in streams + new))
            during = [g for s in streams for g in gaps_in(s.times, t0, t_exit)]
            after = [g for s in streams for g in gaps_in(s.times, t0, float("inf"))]
            ttfts = [t for s in new if (t := s.ttft_ms) is not None]
            failures = [s.error or f"{s.num_tokens} of {s.max_tokens} tokens" for s in streams + new if s.failed]
            return {
                "round": index,
                "side": side,
                "via": "serve",
                "scale_down_s": round(t_exit - t0, 3),
                "set_pool_size_s": round(t_done - t0, 3),
                "requests": n,
                "new_requests": len(new),
                "in_flight_at_exit": in_flight_at_exit,
                **stream_figures(failures, during, after, ttfts),
            }
        finally:
            if rt is not None:
                with contextlib.suppress(Exception):
                    await rt.shutdown(drain_timeout_s=1.0)
            stopped = await asyncio.to_thread(_kvmesh, "stop", ns, "--state-dir", tmp)
            if stopped.returncode != 0:
                print(f"bench scale-down: kvmesh stop {ns}: {stopped.stderr[-500:]}", file=sys.stderr)


# --- the command ----------------------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for side, marker in ((DRAIN, "o"), (MIGRATE, "s")):
        rs = [r for r in report["rounds"] if r["side"] == side]
        ax.plot([r["round"] for r in rs], [r["scale_down_s"] for r in rs], marker, label=f"{side}", markersize=8)
    ax.set_yscale("log")
    ax.set_xlabel("round (ABBA order)")
    ax.set_ylabel("SIGTERM to process exit (s)")
    s = report["summary"]
    tokens = report["settings"]["output_tokens"]
    ax.set_title(f"Scale-down, {tokens}-token outputs: drain / migrate medians {s['ratio_of_medians']}x")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.via == "serve":
        return await run_serve(args)
    with mesh_servers(args.etcd, args.nats) as (etcd, nats_url):
        cfg = RuntimeConfig(etcd_endpoints=[etcd], nats_url=nats_url)
        rng = random.Random(args.seed)
        rounds = []
        for i, side in enumerate(abba(args.rounds)):
            r = await one_round(cfg, args, i, side, rng)
            rounds.append(r)
            print(
                f"round {i} {side}: scale-down {r['scale_down_s']:.2f} s, {r['in_flight_at_exit']} of {r['requests']} "
                f"still running at exit, {r['failed']} failed, largest gap {r['max_gap_ms']} ms",
                file=sys.stderr,
            )
        return {"bench": "scale-down", "settings": _settings(args), "rounds": rounds, "summary": summarize(rounds)}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    names = ("via", "rounds", "requests", "prompt_tokens", "output_tokens", "warm_tokens", "new_requests",
             "new_output_tokens", "speedup_ratio", "num_gpu_blocks", "rescheduling_interval_ms", "seed")  # fmt: skip
    return {k: getattr(args, k) for k in names} | (
        {"graph": args.graph, "colocated": args.colocated} if args.via == "serve" else {}
    )


async def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    rounds = []
    for i, side in enumerate(abba(args.rounds)):
        r = await serve_round(args, i, side, rng)
        rounds.append(r)
        print(
            f"round {i} {side} (serve): decision to exit {r['scale_down_s']:.2f} s (set_pool_size returned after "
            f"{r['set_pool_size_s']:.2f} s), {r['in_flight_at_exit']} of {r['requests']} still running at exit, "
            f"{r['failed']} failed",
            file=sys.stderr,
        )
    return {"bench": "scale-down", "settings": _settings(args), "rounds": rounds, "summary": summarize(rounds)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--via",
        choices=("processes", "serve"),
        default="processes",
        help="processes: worker and rescheduler processes of the bench's own, SIGTERM timed to exit; serve: kvmesh "
        "serve of --graph, the planner's local connector's set_pool_size timed to the victim's exit",
    )
    p.add_argument("--graph", default="graphs/mock_scale_down.yaml", help="--via serve: the graph (2 worker watchers)")
    p.add_argument(
        "--colocated", action="store_true", help="--via serve: the rescheduler runs in the frontend's process"
    )
    p.add_argument("--rounds", type=int, default=2, help="ABBA pairs (each: one drain round, one migration round)")
    p.add_argument(
        "--requests",
        type=int,
        default=8,
        help="long-output requests in flight on the leaving worker (serve: per worker)",
    )
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of every request")
    p.add_argument("--output-tokens", type=int, default=1500, help="outputs of each in-flight request")
    p.add_argument("--warm-tokens", type=int, default=16, help="outputs every request has before the SIGTERM")
    p.add_argument("--new-requests", type=int, default=4, help="requests sent to the staying worker at the SIGTERM")
    p.add_argument("--new-output-tokens", type=int, default=100, help="outputs of each new request")
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="the simulated engines' speed (1: real time)")
    p.add_argument("--num-gpu-blocks", type=int, default=2048, help="KV blocks of each worker")
    p.add_argument(
        "--rescheduling-interval-ms", type=int, default=500, help="the rescheduler's cycle (its default: 500 ms)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds where in the rescheduler's cycle each SIGTERM falls")
    p.add_argument("--round-timeout-s", type=float, default=120.0, help="bound of each wait in a round")
    p.add_argument("--png", default="bench-scale-down.png", help="where to draw the rounds ('' for none)")
    add_mesh_arguments(p)


def main(args: argparse.Namespace) -> int:
    report = asyncio.run(run(args))
    if args.png:
        drawn = plot(report, args.png)
        report["png"] = args.png if drawn else None
        if not drawn:
            print(
                "bench scale-down: matplotlib is not installed (pip install 'kvmesh[bench]'): no PNG", file=sys.stderr
            )
    print(json.dumps(report))
    return 0
