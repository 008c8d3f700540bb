"""``kvmesh bench frontend``: what a request costs the frontend, and what one and several frontend processes serve,
measured side by side in alternating rounds on the same workers.

1. ``kvmesh serve`` runs the graph's workers (``graphs/mock_agg.yaml`` by default: simulated engines at infinite
   speed, so engine time is ~0 and the control plane's cost is what remains), without its frontend, in a temporary
   state directory.
2. Sides, each started fresh for every round and stopped after it (so an idle side costs the other nothing):
   ``1`` (``kvmesh frontend --replicas 1``), ``N`` (``--replicas N``, N = the usable cores, at least 2; ``--replicas``
   to choose), ``baseline`` (``--compare-tree DIR``: one frontend run from another
   checkout's code, e.g. an older commit, to measure a change before/after; with ``--compare-replicas 1,8`` sides
   ``baseline-1`` and ``baseline-8``, that checkout's frontend with those replicas), and ``external`` (``--url``: any
   OpenAI-compatible endpoint already running, e.g. Dynamo's frontend on its own simulated workers, with the CPU of
   the processes ``--url-pids`` names). The kvmesh sides are started with the command line ``kvmesh serve`` would
   give the graph's frontend (``components.deploy.plan.plan_frontend``).
3. Each side: wait until it is healthy, warm up (``--warmup-requests`` requests that are not measured: the first
   request's lazy work, such as compiling the chat template, and any tokenizer still loading in a replica land
   there), then ``--requests`` streamed requests at ``--concurrency``, with the CPU time (/proc) of the frontend
   processes (every replica), the worker processes, nats-server and etcd read before and after.
4. Rounds alternate the order of the sides (A B, B A, ...: ABBA), so a drift of the shared machine's load hits
   every side alike; the summary gives each side's medians and, per other side, the median of its per-round ratios
   to side ``1``. The load average is recorded per window: compare runs only at similar load.

Prompts: by default synthetic chat prompts (``--synthetic-prompt text``: ~``--prompt-tokens`` characters of words,
one token each with tiny-llama's byte-level tokenizer, plus the chat template's), each starting with one of
``--num-shared-prefixes`` prefixes of ``--shared-prefix-tokens``, so KV-aware routing has prefixes to find; every
(round, side) draws its own prefixes and prompts, so no side finds what another one cached. Hit rate = cached prompt
tokens / prompt tokens, as the server's usage reports them.

Targets, checked in the output (``targets``): N processes against one, at the same settings, serve at least 1.5x the
requests/s with a lower TTFT p99 and a KV hit rate within 2 points; one process against ``--compare-tree`` spends
at most 0.8x the frontend CPU per request; kvmesh against ``--url`` serves at least 1.2x the requests/s at no worse
TTFT p99 and lower total CPU per request.

Load generators: ``--loadgen-procs N`` splits each measured window over N processes
(``loadgen.procs.run_load_procs``: the same prompts' prefixes, disjoint prompts, the concurrency and requests shared
out), since one Python process parsing the streams caps a many-core run at about one core's worth of requests; their
results are merged (percentiles over every request, requests/s summed, the CPU of each counted). Warm-ups use one.

The last line printed is one JSON object; ``--png`` draws requests/s, TTFT p99 and CPU per request per side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import psutil

from components.cli.bench.loadgen import LoadConfig, run_load
from components.cli.bench.loadgen.procs import run_load_procs
from components.deploy.graph import load_graph
from components.deploy.local import healthy
from components.deploy.plan import plan_frontend
from components.deploy.state import ServerState, read_state, resolve_state_dir, state_path
from components.frontend.config import usable_cores
from components.runtime.servers import free_port

ROOT = Path(__file__).resolve().parents[3]
ROLES = ("frontend", "workers", "nats", "etcd")
START_TIMEOUT_S = 180.0  # a frontend on a busy 2-core machine imports transformers and loads a tokenizer per replica
STOP_TIMEOUT_S = 60.0
# The workers of the comparison: 4 simulated workers in one process, engine time ~0.
DEFAULT_SET = ("workers[0].replicas=1", "workers[0].num_workers=4", "workers[0].speedup_ratio=inf")


def overrides_of(args: argparse.Namespace) -> list[str]:
    return list(args.set) if args.set else list(DEFAULT_SET)


@dataclasses.dataclass
class Side:
    """One way of serving the requests: a kvmesh frontend started per round, or an endpoint already running."""

    name: str
    replicas: int | None = None  # kvmesh: --replicas (None: the tree's own default, for a tree without the flag)
    tree: Path | None = None  # kvmesh: run this checkout's code (None: this one)
    url: str | None = None  # external: its base URL
    pids: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # external: role -> pids
    extra_body: dict[str, Any] | None = None  # external: fields added to each request (--url-extra-body)

    @property
    def external(self) -> bool:
        return self.url is not None


# --- processes and CPU -----------------------------------------------------------------------------------------------


def with_descendants(pids: Iterable[int]) -> list[int]:
    """``pids`` and every live descendant of each (a frontend's replicas, an engine's subprocesses)."""
    out: list[int] = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out += [pid, *(c.pid for c in proc.children(recursive=True))]
        except psutil.Error:
            continue
    return list(dict.fromkeys(out))


def parse_pids(spec: str) -> dict[str, list[int]]:
    """``frontend=12,workers=34,workers=35,nats=56`` -> role -> pids (roles: frontend, workers, nats, etcd)."""
    out: dict[str, list[int]] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        role, _, pid = item.partition("=")
        if role not in ROLES or not pid.isdigit():
            raise ValueError(f"--url-pids takes ROLE=PID items with ROLE one of {', '.join(ROLES)}; got {item!r}")
        out.setdefault(role, []).append(int(pid))
    return out


class KvmeshFrontend:
    """A ``kvmesh frontend`` process (and its replicas) started for one round, in this process's session."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.cmd = cmd
        self.env = env
        self.cwd = cwd
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self._log_file: IO[str] | None = None

    def start(self, model: str) -> str:
        self._log_file = open(self.log, "a", encoding="utf-8")
        self._log_file.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(self.cmd)}\n")
        self._log_file.flush()
        self.proc = subprocess.Popen(
            self.cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=self._log_file, text=True
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        url = ""
        for line in self.proc.stdout:  # READY comes once every replica listens
            if line.startswith("READY "):
                url = line.split()[1]
                break
        if not url:
            raise RuntimeError(f"the frontend exited before READY ({self.proc.wait()}); its log: {self.log}")
        ready: set[int] = set()  # replicas seen healthy: every one must be
        while not healthy(url + "/health", [model], ready):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the frontend at {url} did not become healthy; its log: {self.log}")
            time.sleep(0.1)
        return url

    def pids(self) -> list[int]:
        return with_descendants([self.proc.pid]) if self.proc is not None else []

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc is not None and proc.stdout is not None:
                proc.stdout.close()
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None


def _kvmesh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "components.cli.main", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


# --- one window ----------------------------------------------------------------------------------------------------


def load_config(
    args: argparse.Namespace,
    url: str,
    seed: int,
    requests: int,
    pids: list[int],
    warm: bool,
    extra_body: dict[str, Any] | None = None,
) -> LoadConfig:
    return LoadConfig(
        url=url,
        extra_body=extra_body,
        model=args.model,
        concurrency=args.concurrency,
        synthetic_prompt=args.synthetic_prompt,
        prompt_tokens=args.prompt_tokens,
        # Warm-up prompts share nothing with the measured ones: they must not pre-cache the measured prefixes.
        shared_prefix_tokens=0 if warm else args.shared_prefix_tokens,
        num_shared_prefixes=args.num_shared_prefixes,
        max_tokens=args.max_tokens,
        max_requests=requests,
        duration_s=args.max_window_s,
        pids=pids,
        progress=False,
        seed=seed,
    )


def machine_cpu() -> tuple[int, int, int] | None:
    """(busy, total) jiffies of all CPUs since boot and the number of CPUs, from /proc/stat; None without it."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    head = lines[0].split() if lines else []
    if not head or head[0] != "cpu" or len(head) < 6:
        return None
    ticks = [int(x) for x in head[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return sum(ticks) - idle, sum(ticks), cpus


def cores_busy(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    """How many of the machine's CPUs were busy on average between two ``machine_cpu`` readings (every process on
    the machine: the servers, the load generator and anything else running)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]) * after[2], 2)


async def measure(
    args: argparse.Namespace, side: Side, url: str, roles: dict[str, list[int]], seed: int
) -> dict[str, Any]:
    """Warm up, then one measured window of ``args.requests`` requests; CPU by role."""
    if args.warmup_requests:
        warm = await run_load(
            load_config(args, url, seed + 500_000, args.warmup_requests, [], warm=True, extra_body=side.extra_body)
        )
        if not warm["requests_completed"]:
            raise RuntimeError(f"side {side.name}: no warm-up request completed: {warm['error_examples']}")
    role_of = {pid: role for role, pids in roles.items() for pid in pids}
    load_before = os.getloadavg()[0]
    cpu_before = machine_cpu()
    out = await run_load_procs(
        load_config(args, url, seed, args.requests, list(role_of), warm=False, extra_body=side.extra_body),
        args.loadgen_procs,
    )
    cpu_after = machine_cpu()
    load_after = os.getloadavg()[0]
    done = out["requests_completed"]
    cpu_ms = dict.fromkeys(roles, 0.0)
    for pid, v in out["cpu"]["pids"].items():
        if v["cpu_ms"] is not None:
            cpu_ms[role_of[int(pid)]] += v["cpu_ms"]
    per_request = {role: round(ms / done, 3) if done else None for role, ms in cpu_ms.items()}
    total = sum(v for v in per_request.values() if v is not None)
    return {
        "side": side.name,
        "requests_completed": done,
        "errors": out["errors"],
        "error_examples": out["error_examples"],
        "requests_per_s": out["requests_per_s"],
        "ttft_ms": out["ttft_ms"],
        "itl_ms_p50": out["itl_ms"]["p50"],
        "hit_rate": round(out["cached_input_tokens"] / out["input_tokens"], 4) if out["input_tokens"] else None,
        "prompt_tokens_per_request": round(out["input_tokens"] / done, 1) if done else None,
        "cpu_ms_per_request": per_request | {"total": round(total, 3)},
        "processes": {role: len(pids) for role, pids in roles.items()},
        "loadgen_cpu_ms_per_request": out["cpu"]["loadgen_cpu_ms_per_request"],
        "loadgen_procs": out.get("loadgen_procs", 1),
        "loadgen_cpu_ms_per_proc": out["cpu"].get("loadgen_cpu_ms_per_proc", [out["cpu"]["loadgen_cpu_ms"]]),
        "load_average": [round(load_before, 2), round(load_after, 2)],
        # Whether the machine had a core to spare: every process's CPU over the window (a side whose servers and
        # load generator keep all cores busy is bound by the machine, not by its frontend).
        "machine_cores_busy": cores_busy(cpu_before, cpu_after),
        "machine_cores": cpu_after[2] if cpu_after else None,
    }


# --- sides and rounds ----------------------------------------------------------------------------------------------


def sides_of(args: argparse.Namespace) -> list[Side]:
    n = args.replicas or max(2, usable_cores())
    sides = [Side("1", replicas=1), Side(str(n), replicas=n)] if n > 1 else [Side("1", replicas=1)]
    if args.compare_tree:
        tree = Path(args.compare_tree).resolve()
        if args.compare_replicas:
            for k in (int(x) for x in args.compare_replicas.split(",") if x.strip()):
                sides.append(Side(f"baseline-{k}", replicas=k, tree=tree))
        else:
            sides.append(Side("baseline", tree=tree))
    if args.url:
        extra = json.loads(args.url_extra_body) if args.url_extra_body else None
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"--url-extra-body takes a JSON object; got {args.url_extra_body!r}")
        sides.append(Side("external", url=args.url, pids=parse_pids(args.url_pids or ""), extra_body=extra))
    if args.sides:
        wanted = [s.strip() for s in args.sides.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {s.name for s in sides})
        if unknown:
            raise ValueError(f"--sides: no side {unknown}; the sides are {[s.name for s in sides]}")
        sides = [s for s in sides if s.name in wanted]
    return sides


def side_order(sides: list[Side], round_index: int) -> list[Side]:
    """Round ``round_index``'s order of the sides: as given in even rounds, reversed in odd ones (ABBA), so a drift
    of the shared machine's load hits every side alike over two rounds."""
    return list(sides) if round_index % 2 == 0 else sides[::-1]


async def run_policy(
    args: argparse.Namespace, policy: str, sides: list[Side], state_dir: Path, deployment: dict[str, Any]
) -> dict[str, Any]:
    graph = load_graph(ROOT / args.graph, [*overrides_of(args), f"frontend.router_policy={policy}"])
    rounds: list[list[dict[str, Any]]] = []
    for r in range(args.rounds):
        order = side_order(sides, r)
        results = []
        for side in order:
            seed = args.seed * 1_000_000 + r * 1000 + sides.index(side) * 10
            if side.external:
                assert side.url is not None
                roles = {role: with_descendants(pids) for role, pids in side.pids.items()}
                results.append(await measure(args, side, side.url, roles, seed))
                _progress(policy, r, args.rounds, side, results[-1])
                continue
            port = free_port()
            plan = plan_frontend(
                graph,
                etcd_endpoints=deployment["etcd_endpoints"],
                nats_url=deployment["nats_url"],
                frontend_port=port,
                log_dir=state_dir / "logs",
            )
            cmd = list(plan.cmd)
            env = os.environ | plan.env
            cwd = ROOT
            if side.replicas is not None:
                cmd += ["--replicas", str(side.replicas)]
            if side.tree is not None:
                env["PYTHONPATH"] = str(side.tree)
                cwd = side.tree
            fe = KvmeshFrontend(cmd, env, cwd, state_dir / "logs" / f"bench-frontend-{side.name}.log")
            try:
                url = await asyncio.to_thread(fe.start, args.model)
                roles = {
                    "frontend": fe.pids(),
                    "workers": deployment["worker_pids"],
                    "nats": deployment["nats_pids"],
                    "etcd": deployment["etcd_pids"],
                }
                results.append(await measure(args, side, url, roles, seed))
            finally:
                await asyncio.to_thread(fe.stop)
            _progress(policy, r, args.rounds, side, results[-1])
        rounds.append(results)
    return {"router_policy": policy, "rounds": rounds, **summarize(rounds, [s.name for s in sides], pairs_of(sides))}


def _progress(policy: str, r: int, rounds: int, side: Side, result: dict[str, Any]) -> None:
    print(f"bench frontend: {policy} round {r + 1}/{rounds} side {side.name}: {json.dumps(_brief(result))}",
          file=sys.stderr, flush=True)  # fmt: skip


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "rps": r["requests_per_s"],
        "ttft_p99": r["ttft_ms"]["p99"],
        "cpu": r["cpu_ms_per_request"],
        "hit": r["hit_rate"],
        "load": r["load_average"],
        "cores_busy": r["machine_cores_busy"],
    }


# --- summary -------------------------------------------------------------------------------------------------------

METRICS = {
    "requests_per_s": lambda r: r["requests_per_s"],
    "ttft_ms_p50": lambda r: r["ttft_ms"]["p50"],
    "ttft_ms_p99": lambda r: r["ttft_ms"]["p99"],
    "frontend_cpu_ms_per_request": lambda r: r["cpu_ms_per_request"].get("frontend"),
    "workers_cpu_ms_per_request": lambda r: r["cpu_ms_per_request"].get("workers"),
    "nats_cpu_ms_per_request": lambda r: r["cpu_ms_per_request"].get("nats"),
    "total_cpu_ms_per_request": lambda r: r["cpu_ms_per_request"].get("total"),
    "hit_rate": lambda r: r["hit_rate"],
    "loadgen_cpu_ms_per_request": lambda r: r.get("loadgen_cpu_ms_per_request"),
    "machine_cores_busy": lambda r: r.get("machine_cores_busy"),
}


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 4) if vals else None


def summarize(rounds: list[list[dict[str, Any]]], names: list[str], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Per side: the median of each metric over the rounds; per pair (a, b): the median over rounds of a's value
    over b's in the same round (the hit rate as a difference, in points)."""
    by_side = {n: [next(x for x in rnd if x["side"] == n) for rnd in rounds] for n in names}
    medians = {n: {m: _median([f(x) for x in rs]) for m, f in METRICS.items()} for n, rs in by_side.items()}
    for n, rs in by_side.items():
        medians[n]["load_average"] = _median([x["load_average"][0] for x in rs])
        medians[n]["errors"] = sum(sum(x["errors"].values()) for x in rs)
    paired: dict[str, dict[str, float | None]] = {}
    for a_name, b_name in pairs:
        ratios: dict[str, float | None] = {}
        for m, f in METRICS.items():
            vals = []
            for a, b in zip(by_side[a_name], by_side[b_name], strict=True):
                x, y = f(a), f(b)
                if x is None or y is None:
                    continue
                if m == "hit_rate":
                    vals.append(100 * (x - y))
                elif y:
                    vals.append(x / y)
            ratios[m if m != "hit_rate" else "hit_rate_points"] = _median(vals)
        paired[f"{a_name}_over_{b_name}"] = ratios
    return {"medians": medians, "paired_ratios": paired}


def pairs_of(sides: list[Side]) -> list[tuple[str, str]]:
    """The comparisons: N processes over 1, 1 over the baseline tree, every kvmesh side over the external one."""
    names = [s.name for s in sides]
    kvmesh = [s.name for s in sides if s.replicas is not None and s.tree is None]
    out = [(n, "1") for n in kvmesh if n != "1" and "1" in names]
    if "baseline" in names:
        out += [(n, "baseline") for n in kvmesh]
    # --compare-replicas: each baseline side over the baseline's one process, and this tree's side of the same
    # replicas over the baseline's.
    base = {s.replicas: s.name for s in sides if s.tree is not None and s.replicas is not None}
    out += [(n, base[1]) for k, n in base.items() if k != 1 and 1 in base]
    out += [(str(k), n) for k, n in base.items() if str(k) in kvmesh]
    if "external" in names:
        out += [(n, "external") for n in kvmesh]
    return out


def targets(result: dict[str, Any], sides: list[Side]) -> dict[str, Any]:
    """The issue's targets, judged on the paired medians of each policy (None: not measured)."""
    out: dict[str, Any] = {}
    kvmesh = [s.name for s in sides if s.replicas is not None and s.tree is None]
    for pol in result["policies"]:
        paired = pol["paired_ratios"]
        t: dict[str, Any] = {}
        for n in kvmesh:
            if (r := paired.get(f"{n}_over_1")) is not None:
                t[f"{n}_over_1"] = {
                    "requests_per_s_ratio": r["requests_per_s"],
                    "requests_per_s_at_least_1_5": _ge(r["requests_per_s"], 1.5),
                    "ttft_p99_ratio": r["ttft_ms_p99"],
                    "ttft_p99_lower": _lt(r["ttft_ms_p99"], 1.0),
                    "hit_rate_points": r["hit_rate_points"],
                    "hit_rate_within_2_points": None
                    if r["hit_rate_points"] is None
                    else abs(r["hit_rate_points"]) <= 2.0,
                }
            if (r := paired.get(f"{n}_over_baseline")) is not None:
                t[f"{n}_over_baseline"] = {
                    "frontend_cpu_ms_per_request_ratio": r["frontend_cpu_ms_per_request"],
                    "at_most_0_8": _le(r["frontend_cpu_ms_per_request"], 0.8) if n == "1" else None,
                }
            if (r := paired.get(f"{n}_over_external")) is not None:
                t[f"{n}_over_external"] = {
                    "requests_per_s_ratio": r["requests_per_s"],
                    "requests_per_s_at_least_1_2": _ge(r["requests_per_s"], 1.2),
                    "ttft_p99_ratio": r["ttft_ms_p99"],
                    "ttft_p99_no_worse": _le(r["ttft_ms_p99"], 1.0),
                    "total_cpu_ms_per_request_ratio": r["total_cpu_ms_per_request"],
                    "total_cpu_lower": _lt(r["total_cpu_ms_per_request"], 1.0),
                }
        out[pol["router_policy"]] = t
    return out


def _ge(x: float | None, bound: float) -> bool | None:
    return None if x is None else x >= bound


def _le(x: float | None, bound: float) -> bool | None:
    return None if x is None else x <= bound


def _lt(x: float | None, bound: float) -> bool | None:
    return None if x is None else x < bound


def plot(result: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies = result["policies"]
    panels = [
        ("requests_per_s", "requests/s"),
        ("ttft_ms_p99", "TTFT p99 (ms)"),
        ("frontend_cpu_ms_per_request", "frontend CPU-ms / request"),
        ("total_cpu_ms_per_request", "all servers' CPU-ms / request"),
        ("machine_cores_busy", "machine cores busy"),
    ]
    fig, axes = plt.subplots(len(policies), len(panels), figsize=(4 * len(panels), 3.2 * len(policies)), squeeze=False)
    for row, pol in zip(axes, policies, strict=True):
        names = list(pol["medians"])
        for ax, (metric, label) in zip(row, panels, strict=True):
            vals = [pol["medians"][n][metric] or 0 for n in names]
            ax.bar(names, vals, color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"][: len(names)])
            ax.set_title(f"{pol['router_policy']}: {label}", fontsize=9)
            for i, v in enumerate(vals):
                ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(
        f"kvmesh bench frontend: medians of {result['rounds']} ABBA rounds, {result['requests']} requests each, "
        f"concurrency {result['concurrency']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _server_pids(server: ServerState | None) -> list[int]:
    return [server.process.pid] if server is not None and server.process is not None else []


# --- the run -------------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sides = sides_of(args)
    state_dir = resolve_state_dir(args.state_dir or tempfile.mkdtemp(prefix="kvmesh-bench-frontend-"))
    overrides = [*overrides_of(args), "frontend.enabled=false"]
    served = await asyncio.to_thread(
        _kvmesh, "serve", str(ROOT / args.graph), "--detach", "--state-dir", str(state_dir),
        *(x for o in overrides for x in ("--set", o)),
    )  # fmt: skip
    if served.returncode != 0:
        raise RuntimeError(f"kvmesh serve failed ({served.returncode}): {served.stdout[-2000:]}{served.stderr[-2000:]}")
    namespace = ""
    try:
        state = read_state(next(state_dir.glob("*.json")))
        namespace = state.namespace
        deployment = {
            "etcd_endpoints": state.etcd_endpoints,
            "nats_url": state.nats_url,
            "worker_pids": with_descendants(p.pid for w in state.watchers if w.kind == "worker" for p in w.processes),
            "nats_pids": _server_pids(state.embedded_nats),
            "etcd_pids": _server_pids(state.embedded_etcd),
        }
        policies = []
        for policy in (p.strip() for p in args.router_policies.split(",") if p.strip()):
            policies.append(await run_policy(args, policy, sides, state_dir, deployment))
    finally:
        if namespace:
            await asyncio.to_thread(_kvmesh, "stop", namespace, "--state-dir", str(state_dir))
    result: dict[str, Any] = {
        "bench": "frontend",
        "graph": args.graph,
        "overrides": overrides,
        "cores": len(os.sched_getaffinity(0)),
        "sides": {s.name: dataclasses.asdict(s) | {"tree": str(s.tree) if s.tree else None} for s in sides},
        "rounds": args.rounds,
        "requests": args.requests,
        "warmup_requests": args.warmup_requests,
        "concurrency": args.concurrency,
        "loadgen_procs": args.loadgen_procs,
        "synthetic_prompt": args.synthetic_prompt,
        "prompt_tokens": args.prompt_tokens,
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "num_shared_prefixes": args.num_shared_prefixes,
        "max_tokens": args.max_tokens,
        "policies": policies,
        "state_dir": str(state_dir),
        "state_file": str(state_path(state_dir, namespace)) if namespace else None,
    }
    result["targets"] = targets(result, sides)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", default="graphs/mock_agg.yaml", help="graph whose workers serve (not its frontend)")
    p.add_argument(
        "--set",
        action="append",
        default=None,
        help=f"graph override (repeatable; default: {' '.join(DEFAULT_SET)}: 4 simulated workers in one process at "
        "infinite speed; giving one replaces the defaults)",
    )
    p.add_argument("--model", default="tiny-llama", help="model name the graph serves")
    p.add_argument("--router-policies", default="round_robin,kv", help="comma-separated; each gets its own rounds")
    p.add_argument(
        "--replicas", type=int, default=None, help="frontend processes of side N (default: usable cores, at least 2)"
    )
    p.add_argument("--sides", default=None, help="run only these sides (comma-separated names, e.g. 1,baseline)")
    p.add_argument("--compare-tree", default=None, help="also run a frontend from this checkout's code")
    p.add_argument(
        "--compare-replicas",
        default=None,
        help="with --compare-tree: run its frontend with these --replicas (comma-separated, e.g. 1,8), as sides "
        "baseline-1, baseline-8 (default: one side 'baseline' with that tree's default)",
    )
    p.add_argument("--url", default=None, help="also load this OpenAI endpoint, already running (e.g. Dynamo's)")
    p.add_argument(
        "--url-pids", default=None, help="its processes by role for CPU: frontend=PID,workers=PID,nats=PID,etcd=PID"
    )
    p.add_argument(
        "--url-extra-body",
        default=None,
        help="a JSON object whose fields are added to every request sent to --url (e.g. Dynamo's nvext annotations; "
        "docs/frontend.md)",
    )
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs every side once, order alternating")
    p.add_argument("--requests", type=int, default=3000, help="measured requests per side and round")
    p.add_argument("--warmup-requests", type=int, default=300, help="unmeasured requests before each window")
    p.add_argument("--max-window-s", type=float, default=300.0, help="no request is sent after this long in a window")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streams (over all load generators)")
    p.add_argument(
        "--loadgen-procs",
        type=int,
        default=1,
        help="load-generator processes sharing --concurrency and --requests (one caps a many-core run at ~1 core of "
        "SSE parsing); latency percentiles over every request, requests/s summed, each one's CPU counted",
    )
    p.add_argument("--synthetic-prompt", choices=("text", "tokens"), default="text", help="chat text or token ids")
    p.add_argument("--prompt-tokens", type=int, default=1240, help="prompt length in tokens (characters of text)")
    p.add_argument("--shared-prefix-tokens", type=int, default=1000, help="shared prefix length (0: unique prompts)")
    p.add_argument("--num-shared-prefixes", type=int, default=64, help="distinct shared prefixes per window")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument("--state-dir", default=None, help="where the served graph keeps its state (default: a temp dir)")
    p.add_argument("--png", default="", help="draw the medians per side to this PNG ('' for none)")


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    if args.png:
        result["png"] = args.png if plot(result, args.png) else None
    print(json.dumps(result))
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    return 0
