"""``kvmesh simulate --graph GRAPH --trace TRACE --out DIR``: the operator's what-if. The graph's workers and router,
simulated on the trace (``components.sim.replay``: the real router over the mock engine's own scheduler on a virtual
clock), before serving it.

Writes into ``--out``: ``requests.csv`` (each request's arrival, lengths, TTFT and mean inter-token latency),
``summary.json`` (also the last line on stdout: TTFT, inter-token and end-to-end percentiles,
SLO attainment against ``--ttft-ms``/``--itl-ms``, output tokens/s, worker-seconds, prefix hit rate, requests refused
for being longer than the engines' ``max_model_len``, as the live frontend refuses them), ``simulate.png`` (offered
load, the fleet's running and waiting requests with its pool sizes, and TTFT over time) and TensorBoard event files
under ``tensorboard/``, so a simulated and a live run open side by side. A progress line on a terminal
(``--no-progress`` turns it off).

The graph's ``planner:`` section runs in the simulation: the live planner's controller
(``components.planner.simulated.SimulatedPlanner``, the function ``kvmesh planner`` calls at every pull) with the
section's config, pulling every ``metric_pulling_interval`` from the first arrival (``--planner-start-s`` later)
until one adjustment interval after the last, so that its answer to the load's end is seen; its resizes go through
the simulator's modelled connector (a new worker registers ``--startup-s`` after it is asked for,
``--connector-delay-s`` after the decision; a removed one leaves routing at once and exits when drained).
The report then lists every scaling action with its reason, worker-seconds come from each worker's span, and the
TensorBoard files are the live planner's own (``PlannerBoard``: ``pull/*`` at every pull, ``adjustment/*`` and the
decisions' text at every adjustment). Without a planner (or with ``--without-planner``) the fleet is static and the
files hold the ``pull/*`` tags at every load-report tick.

The rescheduler runs in the replay (``components.sim.rescheduling.PolicyRescheduler``: the live loop's policies and
the agent's selection) with ``--enable-rescheduling`` and its flags, or, without that flag, from the graph's
``rescheduler:`` section as the deployment would run it; the report's ``rescheduler`` says which (``from``).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from components.cli.overrides import add_override_argument
from components.deploy.errors import DeployError
from components.deploy.graph import load_graph
from components.deploy.whatif import SimulatedDeployment, WhatIfError, simulated_deployment
from components.planner.config import AnyPlannerConfig, PlannerConfig, SlaPlannerConfig, policy_config
from components.planner.main import make_controller
from components.planner.simulated import SimulatedPlanner
from components.rescheduler.config import Policy, ReplicationConfig, ReschedulerConfig
from components.rescheduler.run_config import flag_problems
from components.runtime.flags import add_model_arguments, model_from_args
from components.sim import RunResult, Sample, SimRequest, Workload, replay
from components.sim.dynamics import DECODE, PREFILL
from components.sim.errors import TraceFormatError
from components.sim.replay import MODEL, REQUEST_STATS_INTERVAL_S
from components.sim.replication import PolicyReplicator
from components.sim.report import Slo, summarize
from components.sim.rescheduling import PolicyRescheduler
from components.sim.workloads import from_trace

# Dynamo's SLA planner defaults for its TTFT and ITL targets.
DEFAULT_TTFT_MS = 500.0
DEFAULT_ITL_MS = 50.0


def _positive(text: str) -> float:
    v = float(text)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return v


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v


def _non_negative(text: str) -> float:
    v = float(text)
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", required=True, help="graph file (YAML) to simulate, e.g. graphs/mock_agg.yaml")
    p.add_argument("--trace", required=True, help="request trace: Mooncake jsonl, Azure csv or ShareGPT json")
    add_override_argument(p)
    p.add_argument("--out", required=True, help="directory for summary.json, simulate.png and tensorboard/")
    p.add_argument("--requests", type=int, default=0, help="replay the trace's first N rows (default 0: all of them)")
    p.add_argument(
        "--time-scale",
        type=_positive,
        default=1.0,
        help="multiply the trace's arrival times by S (0.5 replays it twice as fast; default 1: as recorded)",
    )
    p.add_argument(
        "--start-offset-s",
        type=_non_negative,
        default=0.0,
        help="start at this trace time, in seconds of the trace before scaling (kvmesh bench load's flag; default 0)",
    )
    p.add_argument(
        "--max-input-tokens",
        type=_positive_int,
        default=None,
        help="cut prompts to this many tokens, keeping their start, as kvmesh bench load does (default: none; a "
        "prompt longer than the engines' max_model_len is then refused, as the live frontend refuses it)",
    )
    p.add_argument(
        "--max-output-tokens",
        type=_positive_int,
        default=None,
        help="cap every request's output tokens (kvmesh bench load's)",
    )
    p.add_argument("--ttft-ms", type=_positive, default=DEFAULT_TTFT_MS, help="TTFT target in ms (default 500)")
    p.add_argument(
        "--itl-ms", type=_positive, default=DEFAULT_ITL_MS, help="mean inter-token latency target in ms (default 50)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the router and of the trace's token ids (default 0)")
    p.add_argument(
        "--without-planner",
        action="store_true",
        help="replay a graph that has a planner: section with its fleet as it starts (the planner is not simulated)",
    )
    p.add_argument(
        "--startup-s",
        type=float,
        default=30.0,
        help="seconds from the planner asking for a worker until it takes requests (default 30: a vLLM worker "
        "loading its weights; a simulated worker under kvmesh serve takes a few)",
    )
    p.add_argument(
        "--connector-delay-s",
        type=float,
        default=0.0,
        help="seconds from a planner decision until the connector acts on it (default 0)",
    )
    p.add_argument(
        "--planner-start-s",
        type=_finite,
        default=0.0,
        help="the planner's first pull, in seconds after the first arrival (default 0); its adjustments come every "
        "adjustment_interval from there. Negative: the planner (and the fleet it watches) starts before the load, "
        "as a live planner started with its deployment does: its first decision then reads an interval that began "
        "before the first arrival",
    )
    p.add_argument(
        "--request-stats-offset-s",
        type=_non_negative,
        default=0.0,
        help="with a planner: the phase of the simulated frontend's request reports (every 1 s, the frontend's "
        "default), in seconds after the first arrival modulo 1 (default 0: at whole seconds); a live frontend "
        "reports on its own phase, which decides which arrivals a planner's window counts",
    )
    p.add_argument(
        "--staggered-load-reports",
        action="store_true",
        help="each simulated worker's load report on its own phase (seeded by --seed), as live workers publish "
        "from their own start, instead of all of them at one tick: what the planner and the router read is then 0 "
        "to 100 ms old per worker, not one age for all (a planner pulling on a fixed cadence otherwise reads every "
        "report at one fixed age, which decides some of its decisions at a threshold)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--no-png", action="store_true", help="do not draw simulate.png")
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard event files")
    # The rescheduler's flags, as `kvmesh rescheduler` takes them; --enable-rescheduling runs its cycle in the replay
    # (components/sim/rescheduling.py). Where it runs live does not matter here: the colocation switch is left out.
    add_model_arguments(p, ReschedulerConfig, skip={"colocated_rescheduling_mode"})


class _Series:
    """The fleet over time, one entry per load-report tick (``replay``'s observer), and the progress line."""

    def __init__(self, deployment: SimulatedDeployment, total: int, span_s: float, stream: IO[str] | None) -> None:
        self.deployment = deployment
        self.total = total
        self.span_s = span_s
        self.stream = stream
        self.t: list[float] = []
        self.kv_usage: list[float] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.queue: list[int] = []
        self.routed: list[int] = []
        self.prefill: list[int] = []
        self._last_draw = 0.0
        self._last: Sample | None = None
        self._t0 = time.process_time()

    def __call__(self, s: Sample) -> None:
        self.t.append(s.now_s)
        loads = s.loads
        self.kv_usage.append(sum(x.kv_usage for x in loads) / len(loads) if loads else 0.0)
        self.running.append(sum(x.num_running for x in loads))
        self.waiting.append(sum(x.num_waiting for x in loads))
        self.queue.append(s.queue_len)
        self.routed.append(len(loads))
        self.prefill.append(len(s.prefill_loads))
        self._last = s
        if self.stream is not None:
            now = time.monotonic()
            if now - self._last_draw >= 0.5:
                self._last_draw = now
                self._draw(s)

    def _draw(self, s: Sample) -> None:
        assert self.stream is not None
        self.stream.write(
            f"\rsimulate: {s.now_s:9.1f}/{self.span_s:.0f} s of trace  {s.finished:>7}/{self.total} requests done  "
            f"{time.process_time() - self._t0:6.1f} s CPU"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            if self._last is not None:
                self._draw(self._last)  # where the replay ended
            self.stream.write("\n")
            self.stream.flush()


def trace_slice(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> tuple[Workload, int]:
    """The trace as a workload at ``--time-scale``, and how many of its requests are longer than the engines take
    (dropped here: the live frontend answers them 400 before routing)."""
    w = from_trace(
        args.trace,
        args.requests if args.requests > 0 else 10**9,
        vocab_size=vocab_size,
        seed=args.seed,
        start_offset_s=args.start_offset_s,
    )
    kept: list[SimRequest] = []
    t0 = w.requests[0].arrival_s
    cut_in, cut_out = args.max_input_tokens, args.max_output_tokens
    for r in w.requests:
        # Cutting the end of a prompt keeps its shared prefix shared (Mooncake: a prompt is its blocks in order).
        prompt = r.prompt if cut_in is None else r.prompt[:cut_in]
        if len(prompt) > max_model_len:
            continue
        max_tokens = r.max_tokens if cut_out is None else min(r.max_tokens, cut_out)
        kept.append(SimRequest((r.arrival_s - t0) * args.time_scale, prompt, max_tokens, r.program_id))
    if not kept:
        raise WhatIfError(f"every request of {args.trace} is longer than the engines' max_model_len {max_model_len}")
    return Workload(w.name, tuple(kept)), len(w.requests) - len(kept)


def _write_requests(path: Path, workload: Workload, res: RunResult) -> None:
    """One row per request in workload (arrival) order: what a comparison with a live run reads
    (``kvmesh bench simvalidate`` draws the TTFT distributions from it)."""
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "prompt_tokens", "max_tokens", "ttft_s", "mean_itl_s"])
        for r, ttft, itl in zip(workload.requests, res.ttft_by_request_s, res.mean_itl_by_request_s, strict=True):
            w.writerow(
                [f"{r.arrival_s:.6f}", len(r.prompt), r.max_tokens, f"{ttft:.6f}", "" if itl is None else f"{itl:.6f}"]
            )


def _tensorboard(series: _Series, log_dir: Path) -> None:
    from components.planner.board import summary_writer  # imports tensorboardX: only a run that writes event files

    with summary_writer(str(log_dir)) as writer:
        for step, t in enumerate(series.t):
            scalars = {
                "pull/kv_usage": series.kv_usage[step],
                "pull/running_requests": series.running[step],
                "pull/waiting_requests": series.waiting[step],
                "pull/decode_workers": series.routed[step],
                "pull/prefill_workers": series.prefill[step],
                "pull/prefill_queue_size": series.queue[step],
            }
            for tag, v in scalars.items():
                writer.add_scalar(tag, v, step, walltime=t)


def _planner_board(planner: SimulatedPlanner, log_dir: Path) -> None:
    """The live planner's TensorBoard files (``PlannerBoard``), pull by pull; wall time = simulated time."""
    from components.planner.board import PlannerBoard

    board = PlannerBoard(str(log_dir))
    try:
        for step, p in enumerate(planner.pulls, start=1):
            out = p.outcome
            board.pull(step, out.observation, out.figures, out.running, out.waiting, p.now_s)
            if out.sla is not None:
                board.sla(step, out.sla, p.now_s)
            if out.adjustment is not None:
                board.adjustment(step, out.adjustment, p.now_s)
    finally:
        board.close()


def _draw(path: Path, workload: Workload, ttft_by_request: list[float], series: _Series, slo: Slo) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    arrivals = [r.arrival_s for r in workload.requests]
    span = max(arrivals[-1], series.t[-1] if series.t else 0.0, 1e-9)
    window = max(span / 100, 1.0)
    edges = [k * window for k in range(int(span / window) + 2)]
    counts = [bisect.bisect_left(arrivals, b) - bisect.bisect_left(arrivals, a) for a, b in itertools.pairwise(edges)]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    axes[0].step(edges[:-1], [c / window for c in counts], where="post")
    axes[0].set_ylabel("offered load (requests/s)")
    fleet = series.deployment.fleet
    axes[1].plot(series.t, series.running, label="running")
    axes[1].plot(series.t, series.waiting, label="waiting")
    axes[1].step(series.t, series.routed, where="post", color="k", linestyle=":", label="routed workers")
    if fleet.prefill:
        axes[1].step(series.t, series.prefill, where="post", color="grey", linestyle=":", label="prefill workers")
    axes[1].set_ylabel("requests / workers")
    axes[1].legend(loc="upper right", fontsize=8)
    axes[2].scatter(arrivals, [1000 * t for t in ttft_by_request], s=2, alpha=0.4)
    axes[2].axhline(slo.ttft_s * 1000, color="r", linestyle="--", label=f"TTFT target {slo.ttft_s * 1000:g} ms")
    axes[2].set_yscale("log")
    axes[2].set_ylabel("TTFT (ms), by arrival")
    axes[2].set_xlabel("trace time (s)")
    axes[2].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"kvmesh simulate: {workload.name}, {fleet.workers} routed + {fleet.prefill} prefill workers at start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(args: argparse.Namespace, progress: IO[str] | None) -> dict[str, Any]:
    graph = load_graph(args.graph, list(args.overrides))
    if not (args.startup_s >= 0 and args.connector_delay_s >= 0):
        raise WhatIfError("--startup-s and --connector-delay-s must be >= 0")
    if not args.request_stats_offset_s < REQUEST_STATS_INTERVAL_S:
        raise WhatIfError(f"--request-stats-offset-s must be below the reports' interval, {REQUEST_STATS_INTERVAL_S:g}")
    deployment = simulated_deployment(graph)
    fleet = dataclasses.replace(deployment.fleet, startup_s=args.startup_s, connector_delay_s=args.connector_delay_s)
    max_len = min(fleet.engine.max_model_len, fleet.decode_config.max_model_len)
    workload, refused = trace_slice(args, deployment.vocab_size, max_len)
    slo = Slo(args.ttft_ms / 1000.0, args.itl_ms / 1000.0)
    planner: SimulatedPlanner | None = None
    planner_config: AnyPlannerConfig | None = None
    if graph.planner is not None and not args.without_planner:
        # The graph's mode (load or sla) with the fields the section gives, as `kvmesh planner` builds it; the SLA
        # planner's performance model is the one named by profile_results_dir, else the workers' announced ones.
        spec = graph.planner
        policy = set(PlannerConfig.model_fields) | set(SlaPlannerConfig.model_fields)
        planner_config = policy_config(spec.mode, {k: getattr(spec, k) for k in spec.model_fields_set if k in policy})
        last = workload.requests[-1].arrival_s
        planner = SimulatedPlanner(
            planner_config,
            controller=make_controller(planner_config, MODEL),
            start_s=workload.requests[0].arrival_s + args.planner_start_s,
            # Through one more adjustment after the last arrival (its pull at last + interval included).
            until_s=last + planner_config.adjustment_interval + planner_config.metric_pulling_interval,
        )
    rescheduler: PolicyRescheduler | None = None
    rescheduler_config = _rescheduler_config(args)
    rescheduler_from = "flags"
    if not rescheduler_config.enable_rescheduling and graph.rescheduler is not None:
        # No --enable-rescheduling: the graph's rescheduler: section runs as the deployment would run it (its
        # presence is the switch; enable_rescheduling: false keeps it off), with its policy fields.
        section = graph.rescheduler
        rescheduler_config = ReschedulerConfig.model_validate(
            {k: getattr(section, k) for k in ReschedulerConfig.model_fields}
        )
        rescheduler_from = "graph"
    replicator: PolicyReplicator | None = None
    if rescheduler_config.enable_rescheduling:
        rescheduler = PolicyRescheduler(rescheduler_config)
        if Policy.PREFIX_REPLICATION in rescheduler_config.rescheduling_policies:
            # The live loop's replication policy on the simulated router (components/sim/replication.py), at the
            # rescheduler's interval and rate window.
            replicator = PolicyReplicator(
                ReplicationConfig.model_validate(
                    {k: getattr(rescheduler_config, k) for k in ReplicationConfig.model_fields}
                ),
                model=MODEL,
                interval_s=rescheduler_config.interval_s,
                window_s=rescheduler_config.prefix_replication_window_s,
            )
    series = _Series(deployment, len(workload.requests), workload.span_s, progress)
    cpu0 = time.process_time()
    try:
        res = replay(
            workload,
            fleet,
            deployment.router,
            args.seed,
            observer=series,
            scaler=planner,
            rescheduler=rescheduler,
            replicator=replicator,
            request_stats_offset_s=args.request_stats_offset_s,
            staggered_load_reports=args.staggered_load_reports,
        )
    finally:
        series.close()
    cpu_s = time.process_time() - cpu0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "graph": str(args.graph),
        "trace": str(args.trace),
        "time_scale": args.time_scale,
        "seed": args.seed,
        "router_policy": str(deployment.router.router_policy),
        "groups": deployment.groups,
        "refused_too_long": refused,
        **summarize(res, workload, fleet, slo),
        "planner": None if planner_config is None else planner_config.model_dump(mode="json"),
        "planner_mode": None if graph.planner is None or args.without_planner else str(graph.planner.mode),
        "startup_s": args.startup_s,
        "connector_delay_s": args.connector_delay_s,
        "planner_start_s": None if planner is None else args.planner_start_s,
        "request_stats_offset_s": None if planner is None else args.request_stats_offset_s,
        "staggered_load_reports": args.staggered_load_reports,
        "adjustments": None if planner is None else len(planner.adjustments),
        "scaling_actions": [
            {
                "pool": a.pool,
                "decided_s": round(a.decided_s, 3),
                "done_s": None if a.done_s is None else round(a.done_s, 3),
                "direction": a.direction,
                "from": a.before,
                "to": a.target,
                "reason": a.reason,
            }
            for a in res.actions
        ],
        "most_workers": {
            pool: max(series.routed if pool == DECODE else series.prefill, default=0) for pool in (DECODE, PREFILL)
        },
        "simulation_cpu_s": round(cpu_s, 2),
    }
    if rescheduler is not None:
        report["rescheduler"] = {
            "from": rescheduler_from,  # "flags" (--enable-rescheduling) or "graph" (its rescheduler: section)
            "policies": [str(x) for x in rescheduler_config.rescheduling_policies],
            "interval_ms": rescheduler_config.rescheduling_interval_ms,
            **rescheduler.counters(),
            "migrations_landed": res.migrations,
            "migrations_refused": res.migrations_refused,
        }
        if replicator is not None:
            report["rescheduler"]["prefix_copies_landed"] = replicator.copies
    if not args.no_tensorboard:
        if planner is not None:
            _planner_board(planner, out / "tensorboard")
        else:
            _tensorboard(series, out / "tensorboard")
        report["tensorboard"] = str(out / "tensorboard")
    if not args.no_png:
        png = out / "simulate.png"
        report["png"] = str(png) if _draw(png, workload, res.ttft_by_request_s, series, slo) else None
    _write_requests(out / "requests.csv", workload, res)
    report["requests_csv"] = str(out / "requests.csv")
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def _rescheduler_config(args: argparse.Namespace) -> ReschedulerConfig:
    try:
        return model_from_args(ReschedulerConfig, args)
    except ValidationError as e:
        raise WhatIfError(f"rescheduler flags: {flag_problems(e)}") from None


def main(args: argparse.Namespace) -> int:
    progress = None if args.no_progress or not sys.stderr.isatty() else sys.stderr
    try:
        report = run(args, progress)
    except (DeployError, TraceFormatError) as e:
        print(f"kvmesh simulate: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except OSError as e:
        print(f"kvmesh simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
