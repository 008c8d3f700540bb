"""``kvmesh bench planner --load NAME``: the planners against the fixed peak fleet and the clairvoyant schedule on the
loads of issue 25 ("Benchmark"), at each worker start-up of ``--startups-s``, judged against the issue's targets.

Loads (``loads.py``; each relative to the peak fleet's *measured* capacity, found as ``kvmesh bench planner`` finds it,
``sim.find_capacity`` with the load's own request mix):

1. ``sinusoid``: Dynamo's (period 150 s over ``--duration-s`` 600 s, 25-100% of capacity);
2. ``slow``: 25-100% with a period of 20 x the longest start-up run (``--slow-period-s``; 600 s at 30 s), two periods
   (``--slow-periods``);
3. ``trace``: ``--trace``'s own arrival times (Azure conversations by default), its first ``--trace-rows`` rows (all
   by default), time scaled so their **mean** rate is ``--trace-mean`` (0.5) of capacity; the peak of 10 s windows
   (``--trace-window-s``) is reported;
4. ``step``: issue 10528's, 1 -> 24 -> 1 requests/s as 1/24 -> 1 -> 1/24 of capacity (``--step-high`` x capacity at
   the top), up at a quarter of ``--duration-s`` and down at three quarters, requests of ``--step-lengths``
   8000:1000 tokens (10528's ISL/OSL), capacity measured with that mix.

Sides, each replaying the same requests (same arrivals, prompts and router seed) after the same unmeasured warm-up
at the load's starting level (``--warmup-s``):

* ``fixed_peak``: ``--peak-workers`` workers (its planner in ``--no-operation``); the start-up does not matter to it,
  so it runs once per load;
* ``planner``: the load planner with its defaults (``PlannerConfig`` from the flags, as ``kvmesh bench planner``'s
  ``planner`` fleet), starting at what the load's start needs, ``ceil(start x peak workers)``;
* ``sla``: the SLA planner (``components.planner.sla``: ``SlaController`` through ``SimulatedPlanner``) with its
  defaults (``SlaPlannerConfig``: TTFT 500 ms, ITL 50 ms, adjustment every 30 s, Kalman predictor), the peak fleet as
  its budget, the side's start-up as its start-up lead (``worker_startup_s``), same start; it reads the simulated
  frontend's request reports (every virtual second, divided by the compression);
* ``clairvoyant_planner``: the clairvoyant schedule (``clairvoyant.Oracle``, utilisation 1.0 of the measured
  capacity per worker) under the load planner's rules: one worker per adjustment interval, its loop's pause and
  grace period, the same start-up and budget;
* ``clairvoyant_sla``: the same schedule under the SLA planner's decision interval with any number of workers per
  decision and no pause (the most a schedule deciding that often can save);
* ``sla+resched`` (with ``--enable-rescheduling``, off by default): the ``sla`` side with the rescheduler's
  policies running beside it (``components.sim.rescheduling.PolicyRescheduler``, as ``kvmesh simulate`` runs it),
  configured by ``kvmesh rescheduler``'s own flags (``--rescheduling-policies``, ``--rescheduling-interval-ms``
  divided by the compression, ...): e.g. ``--enable-rescheduling --rescheduling-policies waiting_fit`` moves the
  queue that piles on the workers alive during a start-up to the new ones once they register. Judged as ``sla``;
  its ``rescheduler`` reports the requests moved;
* ``reactive_sla`` (the step's, and every load's with ``--reactive-bound``): the ``clairvoyant_sla`` schedule on
  the load seen a start-up late (``Delayed``): it adds workers the moment the load changes, no sooner. On the step
  (flat before and after one instant, which falls on a decision) that is the most any planner without a forecast
  can do under these rules: the goodput target's reachability, reported beside the verdict
  (``reactive_bound_share_of_fixed_peak``, ``reactive_bound_points_below_fixed_peak``). On a load that changes
  within an interval the schedule still knows the interval after each decision (it plans a start-up plus an
  interval ahead on the delayed load), so there it is a reference, not a bound (``--reactive-bound``).

A clairvoyant schedule routes the load's need at 100% of the measured capacity per worker: under targets looser than
what the fixed peak fleet delivers at its peak, a smaller fleet may still meet them, so a planner can save more than
it; the saving it reports is the bound of a schedule that never runs a worker past its measured capacity.

SLO: a request meets it when its TTFT is at most ``--slo-ttft-ms`` (500) and its mean inter-token latency at most
``--slo-itl-ms`` (50): the SLA planner's default targets (Dynamo's ``--ttft`` / ``--itl``). ``--time-compression``
divides the load's times, the start-up and the planners' intervals, not the engines' step times, so a TTFT or ITL is
in the engines' own time at any compression and the targets are not scaled.

Per side: SLO attainment, goodput (requests meeting both targets per second of the load), worker-seconds (every GPU
held during the load, starting and draining workers included), saving against the fixed peak fleet, and, for a
planner, the saving of the clairvoyant schedule under its rules (the simulated fleet's, and the bound no schedule
under the rules that always routes the need can beat, ``Oracle.least_worker_seconds``). Verdicts (``verdicts``)
against issue 25's targets: attainment within 2 points of the fixed peak fleet's on every load; on loads 1-3 a
worker-seconds saving of at least 80% of the clairvoyant schedule's; on load 4 goodput at least 90% of the fixed
peak fleet's. A target not met is reported as not met, with its numbers.

JSON is the last line on stdout; a table goes to stderr; ``--png`` (a path, its stem gets ``-<load>``) draws per load
the offered load, every side's pool and the TTFT p99 of 10 s windows over time, one column per start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from components import sim
from components.cli.bench.clairvoyant import Oracle
from components.cli.bench.loads import STEP_LENGTHS, Step, TraceLoad, dynamo_sinusoid, slow_sinusoid
from components.cli.bench.planner import (
    _call,
    capacity_workload,
    measured,
    planner_configs,
    request_source,
    summarize,
)
from components.cli.bench.scaling import (
    LoadShape,
    RequestSource,
    ScalingResult,
    ScalingSpec,
    Sinusoid,
    arrival_times,
    simulate,
)
from components.planner.config import LoadPredictorName, PlannerConfig
from components.planner.sla.config import SlaPlannerConfig
from components.rescheduler.config import ReschedulerConfig
from components.rescheduler.run_config import flag_problems
from components.runtime.flags import add_model_arguments, model_from_args
from components.sim import FleetSpec
from components.sim.replay import REQUEST_STATS_INTERVAL_S
from components.sim.report import Slo, percentile
from components.sim.workloads import from_trace
from components.workers.simulated import MockEngineConfig

LOADS = ("sinusoid", "slow", "trace", "step")
SIDES = ("fixed_peak", "planner", "sla", "sla+resched", "clairvoyant_planner", "clairvoyant_sla", "reactive_sla")
# The SLA planner with the rescheduler beside it (--enable-rescheduling), judged as the SLA side.
SLA_RESCHED = "sla+resched"


@dataclasses.dataclass(frozen=True, slots=True)
class Delayed:
    """``shape`` seen ``delay_s`` late (its start before that): the load a schedule plans for when it learns of each
    change only as it happens. A clairvoyant schedule on it adds a start-up ahead of the delayed load, i.e. at the
    moment the real load changes: the best any planner without a forecast can do under the same rules."""

    shape: LoadShape
    delay_s: float

    @property
    def duration_s(self) -> float:
        return self.shape.duration_s

    @property
    def high(self) -> float:
        return self.shape.high

    @property
    def start(self) -> float:
        return self.shape.start

    @property
    def mean(self) -> float:
        return self.shape.mean

    def fraction(self, t: float) -> float:
        return self.shape.start if t < self.delay_s else self.shape.fraction(t - self.delay_s)


# The issue's targets.
TARGET_ATTAINMENT_POINTS = 2.0  # at most this many points below the fixed peak fleet, on every load
TARGET_CLAIRVOYANT_SHARE = 0.8  # loads 1-3: at least this share of the clairvoyant schedule's saving
TARGET_GOODPUT_SHARE = 0.9  # load 4: at least this share of the fixed peak fleet's goodput
SAVING_LOADS = ("sinusoid", "slow", "trace")
GOODPUT_LOADS = ("step",)
# The SLA planner's default targets (Dynamo's --ttft 500 ms, --itl 50 ms).
SLO_TTFT_MS, SLO_ITL_MS = 500.0, 50.0
# A simulated worker's median registration time on this machine (`kvmesh bench startup --kinds simulated --runs 3`,
# 2 shared cores at a load average of 6: 1.18 / 1.23 / 1.55 s; docs/planner.md); the bench also runs 30 s.
MEASURED_STARTUP_S = 1.23
DEFAULT_STARTUPS_S = (MEASURED_STARTUP_S, 30.0)
TTFT_WINDOW_S = 10.0  # the PNG's TTFT p99 windows, before compression


@dataclasses.dataclass(frozen=True)
class LoadRun:
    """One load's replay inputs, decided in the parent and shared with the worker processes (picklable)."""

    name: str
    shape: LoadShape
    source: RequestSource
    arrivals: tuple[float, ...]  # on the simulation's clock, the warm-up first
    order: tuple[int, ...]  # request k of the replay is request order[k] of ``source``
    engine: MockEngineConfig
    warmup_s: float
    capacity_rps: float
    seed: int
    policy: str
    request_stats_interval_s: float  # the simulated frontend's request reports (1 s, divided by the compression)


class OrderedSource(RequestSource):
    """``source`` with its requests taken in ``order``: the trace load pairs each arrival with its own row, and its
    warm-up with rows of a second pass (fresh prompts: ``RequestSource``)."""

    def __init__(self, source: RequestSource, order: Sequence[int]) -> None:
        super().__init__(
            source.rows,
            source.name,
            vocab_size=source.vocab_size,
            seed=source.seed,
            output_tokens=source.output_tokens,
        )
        self.order = list(order)

    def request(self, k: int) -> tuple[list[int], int]:
        return super().request(self.order[k])


def warmup_arrivals(shape: LoadShape, warmup_s: float, capacity_rps: float, seed: int) -> list[float]:
    """Poisson arrivals at the load's starting level for ``warmup_s`` (``scaling.arrival_times`` on a flat shape)."""
    if warmup_s <= 0:
        return []
    flat = Sinusoid(warmup_s, warmup_s, shape.start, shape.start)
    return arrival_times(flat, capacity_rps, seed + 1)


def simulate_side(run: LoadRun, name: str, workers: int, config: PlannerConfig | SlaPlannerConfig, startup_s: float,
                  oracle: Oracle | None = None,
                  rescheduler: ReschedulerConfig | None = None) -> dict[str, Any]:  # fmt: skip
    """One side's replay of ``run`` (the planner resizes it unless ``oracle`` does; a fixed fleet's planner is in
    no-operation; ``rescheduler``: its policies run beside, on the simulation's clock)."""
    t0 = time.process_time()
    # The frontend's request reports every virtual second, divided by the time compression as the intervals are.
    spec = ScalingSpec(run.engine, workers, config, startup_s=startup_s, policy=run.policy, controller=oracle,
                       request_stats_interval_s=run.request_stats_interval_s, rescheduler=rescheduler)  # fmt: skip
    res = simulate(
        OrderedSource(run.source, run.order),
        run.arrivals,
        spec,
        planner_from_s=run.warmup_s,
        planner_until_s=run.warmup_s + run.shape.duration_s,
        seed=run.seed,
    )
    return {"name": name, "startup_s": startup_s, "result": res, "cpu_s": round(time.process_time() - t0, 1)}


# --- building the loads ----------------------------------------------------------------------------------------------


def _engine(longest: int, args: argparse.Namespace) -> MockEngineConfig:
    max_len = max(MockEngineConfig().max_model_len, -(-longest // 1024) * 1024)
    return MockEngineConfig(
        max_model_len=max_len,
        num_gpu_blocks=max(args.num_gpu_blocks, -(-max_len // args.block_size) + 1),
        block_size=args.block_size,
    )


def measure_capacity(args: argparse.Namespace, source: RequestSource, lengths: tuple[int, int] | None,
                     engine: MockEngineConfig) -> tuple[float, dict[str, Any]]:  # fmt: skip
    """The peak fleet's capacity with this request mix, as ``kvmesh bench planner`` measures it."""
    if lengths is None:
        workload = from_trace(args.trace, args.capacity_requests, vocab_size=args.vocab_size, seed=args.seed,
                              output_tokens=args.output_tokens)  # fmt: skip
    else:
        workload = capacity_workload(source, args.capacity_requests, args.seed)
    t0 = time.process_time()
    capacity, probes = sim.find_capacity(workload, FleetSpec(args.peak_workers, engine), args.seed)
    info = {
        "peak_workers": args.peak_workers,
        "capacity_rps": round(capacity, 4),
        "requests": args.capacity_requests,
        "mix": source.name,
        "probes": len(probes),
        "cpu_s": round(time.process_time() - t0, 1),
    }
    print(f"bench planner --load: {source.name}: {args.peak_workers} workers drain up to {capacity:.3f} req/s",
          file=sys.stderr, flush=True)  # fmt: skip
    return capacity, info


def startups(args: argparse.Namespace) -> tuple[float, ...]:
    return tuple(args.startups_s)


def build_load(name: str, args: argparse.Namespace, caps: dict[str, tuple[float, dict[str, Any]]]) -> LoadRun:
    """One load on the simulation's clock (compressed by ``--time-compression``), with its request stream and the
    peak fleet's capacity at its mix (measured once per mix: ``caps``)."""
    k = args.time_compression
    lengths = args.step_lengths if name == "step" else None
    source = request_source(args.trace, lengths, vocab_size=args.vocab_size, seed=args.seed,
                            output_tokens=args.output_tokens)  # fmt: skip
    if name == "trace" and args.trace_rows is not None:
        source = RequestSource(source.rows[: args.trace_rows], source.name, vocab_size=args.vocab_size,
                               seed=args.seed, output_tokens=args.output_tokens)  # fmt: skip
    engine = _engine(source.longest(), args)
    key = source.name if lengths is None else f"fixed_{lengths[0]}_{lengths[1]}"
    if key not in caps:
        caps[key] = measure_capacity(args, source, lengths, engine)
    capacity = caps[key][0]
    warmup_s = args.warmup_s / k
    shape: LoadShape
    if name == "trace":
        stamps = [r.timestamp_s for r in source.rows]
        if any(t is None for t in stamps):
            raise SystemExit(f"kvmesh bench planner --load trace: {args.trace} has no timestamps")
        full = TraceLoad.from_timestamps([float(t or 0.0) for t in stamps], capacity, args.trace_mean,
                                         args.trace_window_s)  # fmt: skip
        shape = full.scaled(k, args.seed)
        head = warmup_arrivals(shape, warmup_s, capacity, args.seed)
        n = len(source.rows)
        # The warm-up takes rows of a second pass (fresh prompts), the load each arrival's own row.
        order = tuple([n + i for i in range(len(head))] + list(shape.rows))
        arrivals = tuple(head + [warmup_s + t for t in shape.arrivals_s])
        return LoadRun(name, shape, source, arrivals, order, engine, warmup_s, capacity, args.seed, args.policy,
                       REQUEST_STATS_INTERVAL_S / k)  # fmt: skip
    if name == "sinusoid":
        shape = dynamo_sinusoid(args.duration_s).scaled(k)
    elif name == "slow":
        shape = slow_sinusoid(max(startups(args)), args.slow_period_s, args.slow_periods).scaled(k)
    else:
        shape = Step.issue_10528(args.duration_s, args.step_high).scaled(k)
    head = warmup_arrivals(shape, warmup_s, capacity, args.seed)
    arrivals = tuple(head + [warmup_s + t for t in arrival_times(shape, capacity, args.seed)])
    return LoadRun(name, shape, source, arrivals, tuple(range(len(arrivals))), engine, warmup_s, capacity, args.seed,
                   args.policy, REQUEST_STATS_INTERVAL_S / k)  # fmt: skip


def describe(run: LoadRun, k: float) -> dict[str, Any]:
    """The load's shape in the JSON: its times on the simulation's clock and uncompressed."""
    s = run.shape
    out: dict[str, Any] = {
        "duration_s": round(s.duration_s, 3),
        "duration_s_uncompressed": round(s.duration_s * k, 3),
        "start": round(s.start, 4),
        "mean": round(s.mean, 4),
        "high": round(s.high, 4),
        "capacity_rps": round(run.capacity_rps, 4),
        "mean_rps": round(s.mean * run.capacity_rps, 4),
        "requests": sum(1 for t in run.arrivals if t >= run.warmup_s),
        "warmup_s": run.warmup_s,
        "time_compression": k,
    }
    if isinstance(s, Sinusoid):
        out |= {"kind": "sinusoid", "period_s": s.period_s, "period_s_uncompressed": round(s.period_s * k, 3),
                "low": s.low}  # fmt: skip
    elif isinstance(s, Step):
        out |= {"kind": "step", "low": round(s.low, 5), "up_s": s.up_s, "down_s": s.down_s,
                "low_rps": round(s.low * run.capacity_rps, 4), "high_rps": round(s.high * run.capacity_rps, 4),
                "levels_rps_10528": [1.0, 24.0],
                "scaling": "10528's 24 rps is the peak fleet's measured capacity at this mix x --step-high, its 1 rps "
                "a 24th of that"}  # fmt: skip
    elif isinstance(s, TraceLoad):
        out |= {"kind": "trace", "rows": len(run.source.rows), "time_scale": round(s.time_scale, 5),
                "window_s": s.window_s, "scaled_to": "mean", "peak_over_mean": round(s.high / s.mean, 3)}  # fmt: skip
    return out


# --- summaries and verdicts -----------------------------------------------------------------------------------------


def side_summary(res: ScalingResult, run: LoadRun, slo: Slo) -> dict[str, Any]:
    """``planner.summarize`` plus goodput, without the per-action list's reasons repeated (kept: the actions)."""
    out = summarize(res, run.warmup_s, run.shape.duration_s, slo)
    reqs = measured(res, run.warmup_s, run.warmup_s + run.shape.duration_s)
    good = sum(1 for r in reqs if r.ttft_s <= slo.ttft_s and (r.mean_itl_s is None or r.mean_itl_s <= slo.itl_s))
    out["goodput_rps"] = round(good / run.shape.duration_s, 4)
    out["good_requests"] = good
    return out


OSCILLATION_INTERVALS = 3  # issue 25: never up, down and up again (or down, up, down) within three intervals


def oscillations(actions: Sequence[dict[str, Any]], interval_s: float, shape: LoadShape) -> dict[str, Any]:
    """Reversals in a side's pool changes (``summarize``'s ``scaling_actions.actions``, times from the load's start):
    three consecutive changes up, down, up (or down, up, down) whose first and last were decided within
    ``OSCILLATION_INTERVALS`` adjustment intervals. ``at_constant_load``: those whose three changes fall within one
    stretch of constant offered load (a step's levels; a sinusoid or a trace has none), which issue 25 forbids;
    the others are reported, not judged (a pool following a changing load may turn)."""
    window_s = OSCILLATION_INTERVALS * interval_s
    bounds = shape.constant_spans() if isinstance(shape, Step) else ()
    found = []
    for a, b, c in zip(actions, actions[1:], actions[2:], strict=False):
        dirs = (a["direction"], b["direction"], c["direction"])
        if dirs not in (("up", "down", "up"), ("down", "up", "down")):
            continue
        if c["decided_s"] - a["decided_s"] > window_s + 1e-9:
            continue
        constant = any(lo <= a["decided_s"] and c["decided_s"] < hi for lo, hi in bounds)
        found.append(
            {
                "decided_s": [a["decided_s"], b["decided_s"], c["decided_s"]],
                "sizes": [a["from"], a["to"], b["to"], c["to"]],
                "at_constant_load": constant,
            }
        )
    return {
        "within_s": round(window_s, 6),
        "count": len(found),
        "at_constant_load": sum(1 for f in found if f["at_constant_load"]),
        "found": found,
    }


def saving(ws: float, fixed_ws: float) -> float:
    return 1.0 - ws / fixed_ws if fixed_ws > 0 else 0.0


def verdict(
    load: str, side: dict[str, Any], fixed: dict[str, Any], clairvoyant: dict[str, Any] | None
) -> dict[str, Any]:
    """One side against issue 25's targets (module docstring), each with its numbers; ``clairvoyant``: the
    clairvoyant schedule under the side's rules (its simulated fleet's saving and the bound's)."""
    gap = fixed["slo_attainment_pct"]["both"] - side["slo_attainment_pct"]["both"]
    out: dict[str, Any] = {
        "attainment": {
            "fixed_peak_pct": fixed["slo_attainment_pct"]["both"],
            "side_pct": side["slo_attainment_pct"]["both"],
            "points_below_fixed_peak": round(gap, 2),
            "target": f"<= {TARGET_ATTAINMENT_POINTS:g} points below the fixed peak fleet",
            "met": gap <= TARGET_ATTAINMENT_POINTS,
        }
    }
    s = saving(side["worker_seconds"], fixed["worker_seconds"])
    if load in GOODPUT_LOADS:
        ratio = side["goodput_rps"] / fixed["goodput_rps"] if fixed["goodput_rps"] > 0 else None
        out["goodput"] = {
            "fixed_peak_rps": fixed["goodput_rps"],
            "side_rps": side["goodput_rps"],
            "share_of_fixed_peak": None if ratio is None else round(ratio, 4),
            "target": f">= {100 * TARGET_GOODPUT_SHARE:g}% of the fixed peak fleet's goodput",
            "met": ratio is not None and ratio >= TARGET_GOODPUT_SHARE,
        }
        out["worker_seconds"] = {"saving_vs_fixed_peak": round(s, 4), "target": None}
    else:
        c = None if clairvoyant is None else clairvoyant["saving_vs_fixed_peak"]
        out["worker_seconds"] = {
            "saving_vs_fixed_peak": round(s, 4),
            "clairvoyant_saving_vs_fixed_peak": c,
            "bound_most_saving_vs_fixed_peak": None if clairvoyant is None else clairvoyant["bound_most_saving"],
            "share_of_clairvoyant_saving": None if not c else round(s / c, 4),
            "target": f">= {100 * TARGET_CLAIRVOYANT_SHARE:g}% of the clairvoyant schedule's saving under the same "
            "start-up and decision rules",
            "met": c is not None and s >= TARGET_CLAIRVOYANT_SHARE * c - 1e-12,
        }
        if c is not None and c <= 0:
            # The clairvoyant schedule saves nothing under these rules: the target then asks for no saving at all.
            out["worker_seconds"]["note"] = "the clairvoyant schedule saves nothing here: the target is empty"
    parts = [out["attainment"]["met"], (out["goodput"] if "goodput" in out else out["worker_seconds"])["met"]]
    out["met"] = all(parts)
    return out


# --- the run --------------------------------------------------------------------------------------------------------


def oracle_for(run: LoadRun, args: argparse.Namespace, interval_s: float, budget: int, startup_s: float, *,
               loop_rules: bool, step_workers: int | None) -> Oracle:  # fmt: skip
    """The clairvoyant schedule for ``run`` at utilisation 1.0 of the measured capacity per worker, under a side's
    rules (``interval_s`` on the simulation's clock)."""
    return Oracle(
        sinusoid=run.shape,
        load_start_s=run.warmup_s,
        peak_workers=args.peak_workers,
        utilisation=1.0,
        interval_s=interval_s,
        startup_s=startup_s,
        max_workers=budget,
        loop_rules=loop_rules,
        grid_s=0.1 / args.time_compression,
        step_workers=step_workers,
    )


def sla_config(
    args: argparse.Namespace, startup_s: float, run: LoadRun | None = None, warmup_trace: str | None = None
) -> SlaPlannerConfig:
    """The SLA planner's defaults, with the peak fleet as its budget (as the load planner's), the side's start-up as
    its start-up lead (``worker_startup_s``: it is start-up aware, told the measured value), and its two intervals
    divided by the time compression; both on the simulation's clock. ``--sla-load-predictor``, ``--sla-season``
    (``period``: the load's period in adjustment intervals) and a warm-up trace (``warm_start_trace``) as asked."""
    cfg = SlaPlannerConfig(max_gpu_budget=args.peak_workers, worker_startup_s=startup_s)
    k = args.time_compression
    update: dict[str, Any] = {
        "adjustment_interval": cfg.adjustment_interval / k,
        "metric_pulling_interval": cfg.metric_pulling_interval / k,
    }
    if args.sla_load_predictor is not None:
        update["load_predictor"] = args.sla_load_predictor
    if args.sla_season is not None:
        season = args.sla_season
        if season == "period":
            period = None if run is None else recurrence_s(run.shape)
            season = None if period is None else max(2, round(period / update["adjustment_interval"]))
        update["load_predictor_season"] = None if season is None else int(season)
    if warmup_trace is not None:
        update["load_predictor_warmup_trace"] = warmup_trace
    return SlaPlannerConfig.model_validate(cfg.model_dump() | update)


def rescheduler_config(args: argparse.Namespace) -> ReschedulerConfig | None:
    """The ``sla+resched`` side's rescheduler: ``kvmesh rescheduler``'s flags as given (every other field at its
    default), its interval divided by the time compression (whole milliseconds, at least 1); None without
    ``--enable-rescheduling``. Raises pydantic's ``ValidationError`` on a bad flag (``problems`` reports it)."""
    cfg = model_from_args(ReschedulerConfig, args)
    if not cfg.enable_rescheduling:
        return None
    k = args.time_compression
    if k != 1:
        cfg = cfg.model_copy(update={"rescheduling_interval_ms": max(1, round(cfg.rescheduling_interval_ms / k))})
    return cfg


def recurrence_s(shape: LoadShape) -> float | None:
    """How often the load repeats, for ``--sla-season period`` and ``--sla-warm-start-periods``: a sinusoid's period;
    the step's whole run (a step that comes at the same time every day, as a nightly batch or a working day's start
    does: the run is one "day"); None for the trace, which does not repeat."""
    if isinstance(shape, Sinusoid):
        return shape.period_s
    if isinstance(shape, Step):
        return shape.duration_s
    return None


def _previous_periods(shape: LoadShape, periods: float, capacity_rps: float, seed: int) -> list[float]:
    """Arrivals of ``periods`` periods of a repeating load, on [0, periods x period), phase continuing into the run's
    start: a sinusoid is drawn whole; a step (one period per run) is drawn once per period, each with its own seed."""
    if isinstance(shape, Sinusoid):
        return arrival_times(dataclasses.replace(shape, duration_s=periods * shape.period_s), capacity_rps, seed)
    period = recurrence_s(shape)
    assert period is not None
    whole = math.ceil(periods - 1e-9)
    cut = (whole - periods) * period  # a fractional count keeps the last part of the first period
    out = [i * period + t for i in range(whole) for t in arrival_times(shape, capacity_rps, seed + 104729 * i)]
    return [t - cut for t in out if t >= cut]


def warm_start_trace(run: LoadRun, periods: float, directory: Path) -> tuple[str, dict[str, Any]] | None:
    """``--sla-warm-start-periods``: "yesterday", the same repeating load over ``periods`` periods just before this
    run (its phase continues into the run's start; ``recurrence_s``), drawn with another seed (Poisson arrivals of
    their own, lengths from the source's rows after the run's), written as an Azure-format trace the SLA planner
    warm-starts from (``load_predictor_warmup_trace``, the live planner's flag). None for the trace, which does not
    repeat."""
    period = recurrence_s(run.shape)
    if periods <= 0 or period is None:
        return None
    shape = run.shape
    times = _previous_periods(shape, periods, run.capacity_rps, run.seed + 7919)
    duration_s = periods * period
    # ``interval_series`` counts whole intervals from the first arrival to the last: one more row, a span after the
    # first arrival, closes the last whole interval (it starts the partial one that is left out), so the series is
    # every interval of the periods and the live planner's first interval continues its phase.
    times.append(times[0] + duration_s)
    base = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    path = directory / f"yesterday-{run.name}-seed{run.seed}.csv"
    with open(path, "w", encoding="utf-8") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for i, t in enumerate(times):
            isl, osl = run.source.lengths(len(run.arrivals) + i)
            f.write(f"{(base + datetime.timedelta(seconds=t)).isoformat()},{isl},{osl}\n")
    info = {
        "periods": periods,
        "duration_s": round(duration_s, 3),
        "requests": len(times) - 1,
        "seed": run.seed + 7919,
        "rule": "the same load's previous periods, ending where the run starts, with arrivals of another seed",
    }
    return str(path), info


# Each clairvoyant side: the planner side whose rules it takes, and those rules in words.
CLAIRVOYANT = {
    "clairvoyant_planner": (
        "planner",
        "the load planner's: one worker per adjustment interval, the loop's pause and grace period",
    ),
    "clairvoyant_sla": (
        "sla",
        "the SLA planner's adjustment interval, any number of workers per decision, no pause (the SLA planner "
        "pauses while a change runs: the schedule may only save more than it could)",
    ),
}


def _label(startup_s: float) -> str:
    return f"startup_{startup_s:g}s"


def _start_workers(run: LoadRun, peak_workers: int) -> int:
    return max(1, math.ceil(run.shape.start * peak_workers - 1e-9))


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    k = args.time_compression
    names = LOADS if args.load == "all" else (args.load,)
    caps: dict[str, tuple[float, dict[str, Any]]] = {}
    runs = {name: build_load(name, args, caps) for name in names}
    cfg = planner_configs(args)["planner"]
    fixed_cfg = cfg.model_copy(update={"no_operation": True})
    slo = Slo(args.slo_ttft_ms / 1000.0, args.slo_itl_ms / 1000.0)
    ups = [s / k for s in startups(args)]
    tasks: list[tuple[Any, ...]] = []
    oracles: dict[tuple[str, float, str], Oracle] = {}
    tmp = tempfile.TemporaryDirectory(prefix="kvmesh-bench-planner-")
    warm = {name: warm_start_trace(r, args.sla_warm_start_periods, Path(tmp.name)) for name, r in runs.items()}
    paths = {name: (None if w is None else w[0]) for name, w in warm.items()}
    infos = {name: (None if w is None else w[1]) for name, w in warm.items()}
    slas = {(name, up): sla_config(args, up, r, paths[name]) for name, r in runs.items() for up in ups}
    resched = rescheduler_config(args)
    for name, r in runs.items():
        start = _start_workers(r, args.peak_workers)
        tasks.append((simulate_side, r, "fixed_peak", args.peak_workers, fixed_cfg, ups[0]))
        for up in ups:
            sla = slas[(name, up)]
            tasks.append((simulate_side, r, "planner", start, cfg, up))
            tasks.append((simulate_side, r, "sla", start, sla, up))
            if resched is not None:
                tasks.append((simulate_side, r, SLA_RESCHED, start, sla, up, None, resched))
            planner_budget = max(1, cfg.max_gpu_budget // cfg.decode_engine_num_gpu)
            sla_budget = max(1, sla.max_gpu_budget // sla.decode_engine_num_gpu)
            oracles[(name, up, "clairvoyant_planner")] = oracle_for(
                r, args, cfg.adjustment_interval, planner_budget, up, loop_rules=True, step_workers=1
            )
            oracles[(name, up, "clairvoyant_sla")] = oracle_for(
                r, args, sla.adjustment_interval, sla_budget, up, loop_rules=False, step_workers=None
            )
            if name in GOODPUT_LOADS or args.reactive_bound:
                # The reachability bound for a planner without a forecast (Delayed).
                reactive = dataclasses.replace(r, shape=Delayed(r.shape, up))
                oracles[(name, up, "reactive_sla")] = oracle_for(
                    reactive, args, sla.adjustment_interval, sla_budget, up, loop_rules=False, step_workers=None
                )
            for side in (*CLAIRVOYANT, "reactive_sla"):
                o = oracles.get((name, up, side))
                if o is not None:
                    tasks.append((simulate_side, r, side, o.start_workers(r.warmup_s), fixed_cfg, up, o))
    ctx = multiprocessing.get_context("fork")
    try:
        with ctx.Pool(min(args.jobs, len(tasks))) as pool:
            outs = pool.map(_call, tasks, chunksize=1)
    finally:
        tmp.cleanup()
    # Tasks and outputs are in the same order: each task's load is its run's name.
    by_load: dict[str, list[dict[str, Any]]] = {}
    for task, o in zip(tasks, outs, strict=True):
        by_load.setdefault(task[1].name, []).append(o)
    loads_out: dict[str, Any] = {}
    series: dict[str, dict[str, dict[str, ScalingResult]]] = {}
    for name, r in runs.items():
        done = by_load[name]
        fixed_o = next(o for o in done if o["name"] == "fixed_peak")
        fixed = side_summary(fixed_o["result"], r, slo) | {"workers": args.peak_workers, "cpu_s": fixed_o["cpu_s"]}
        per_startup: dict[str, Any] = {}
        series[name] = {}
        for up in ups:
            label = _label(up * k)
            sides: dict[str, Any] = {"fixed_peak": fixed}
            series[name][label] = {"fixed_peak": fixed_o["result"]}
            for out in done:
                if out["name"] == "fixed_peak" or out["startup_s"] != up:
                    continue
                sides[out["name"]] = side_summary(out["result"], r, slo) | {"cpu_s": out["cpu_s"]}
                if out["result"].rescheduler is not None:
                    sides[out["name"]]["rescheduler"] = {
                        "migrations": out["result"].migrations,
                        **out["result"].rescheduler,
                    }
                series[name][label][out["name"]] = out["result"]
            t0, t1 = r.warmup_s, r.warmup_s + r.shape.duration_s
            fixed_ws = fixed["worker_seconds"]
            verdicts: dict[str, Any] = {}
            for side, (planner_side, rules) in CLAIRVOYANT.items():
                orc = oracles[(name, up, side)]
                least = orc.least_worker_seconds(t0, t1)
                clair = {
                    "rules": rules,
                    "interval_s": orc.interval_s,
                    "interval_s_uncompressed": round(orc.interval_s * k, 6),
                    "step_workers": orc.step_workers,
                    "utilisation": orc.utilisation,
                    "start_workers": orc.start_workers(r.warmup_s),
                    "saving_vs_fixed_peak": round(saving(sides[side]["worker_seconds"], fixed_ws), 4),
                    "bound_least_worker_seconds": round(least, 1),
                    "bound_most_saving": round(saving(least, fixed_ws), 4),
                    # With no limit per decision the bound is the need held a start-up ahead: it ignores the
                    # interval (Oracle.least_worker_seconds), so it is looser than with one worker per decision.
                    "bound_rule": "Oracle.least_worker_seconds: "
                    + (
                        "the need held a start-up ahead (the interval not counted)"
                        if orc.step_workers is None
                        else "one worker per decision, the start-up and the interval counted"
                    ),
                }
                sides[side]["clairvoyant"] = clair
                sides[planner_side]["start_workers"] = _start_workers(r, args.peak_workers)
                verdicts[planner_side] = verdict(name, sides[planner_side], fixed, clair)
                if planner_side == "sla" and SLA_RESCHED in sides:
                    sides[SLA_RESCHED]["start_workers"] = sides["sla"]["start_workers"]
                    verdicts[SLA_RESCHED] = verdict(name, sides[SLA_RESCHED], fixed, clair)
            sla_sides = [x for x in ("sla", SLA_RESCHED) if x in sides]
            for x in sla_sides:
                if "reactive_sla" in sides:
                    gap = fixed["slo_attainment_pct"]["both"] - sides["reactive_sla"]["slo_attainment_pct"]["both"]
                    verdicts[x]["attainment"]["reactive_bound_points_below_fixed_peak"] = round(gap, 2)
                if "reactive_sla" in sides and "goodput" in verdicts[x]:
                    g = sides["reactive_sla"]["goodput_rps"]
                    verdicts[x]["goodput"]["reactive_bound_share_of_fixed_peak"] = (
                        round(g / fixed["goodput_rps"], 4) if fixed["goodput_rps"] > 0 else None
                    )
                    verdicts[x]["goodput"]["reactive_bound_rule"] = (
                        "the clairvoyant schedule under the SLA planner's rules on the load seen a start-up late: it "
                        "adds workers the moment the load changes, as no planner without a forecast can beat"
                    )
            for side, interval in (
                ("planner", cfg.adjustment_interval),
                *((x, slas[(name, up)].adjustment_interval) for x in sla_sides),
            ):
                sides[side]["oscillations"] = oscillations(sides[side]["scaling_actions"]["actions"], interval, r.shape)
            for x in sla_sides:
                sides[x]["sla_config"] = slas[(name, up)].model_dump(mode="json")
                sides[x]["warm_start"] = infos[name]
            if resched is not None:
                sides[SLA_RESCHED]["rescheduler"]["config"] = resched.model_dump(mode="json")
            per_startup[label] = {
                "startup_s": round(up * k, 3),
                "startup_s_simulated": round(up, 4),
                "sides": {n: sides[n] for n in SIDES if n in sides},
                "verdict": verdicts,
            }
        loads_out[name] = {"shape": describe(r, k), "runs": per_startup}
    report: dict[str, Any] = {
        "bench": "planner",
        "loads": loads_out,
        "capacity": {key: info for key, (_, info) in caps.items()},
        "slo": {
            "ttft_ms": args.slo_ttft_ms,
            "itl_ms": args.slo_itl_ms,
            "rule": "a request meets its SLO when its TTFT and its mean inter-token latency are at most these (the "
            "SLA planner's default targets; engine step times are not compressed, so neither are they)",
        },
        "targets": {
            "attainment_points_below_fixed_peak": TARGET_ATTAINMENT_POINTS,
            "clairvoyant_saving_share": TARGET_CLAIRVOYANT_SHARE,
            "saving_loads": list(SAVING_LOADS),
            "goodput_share_of_fixed_peak": TARGET_GOODPUT_SHARE,
            "goodput_loads": list(GOODPUT_LOADS),
        },
        "startups_s": list(startups(args)),
        "peak_workers": args.peak_workers,
        "seed": args.seed,
    }
    if args.png:
        report["png"] = {name: plot(name, report, runs[name], series[name], args.png) for name in runs}
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(table(report), file=sys.stderr, flush=True)
    return report


# --- output ---------------------------------------------------------------------------------------------------------


def _f(x: float | None, nd: int = 0) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(report: dict[str, Any]) -> str:
    slo = report["slo"]
    lines = [f"SLO per request: TTFT <= {slo['ttft_ms']:g} ms and mean ITL <= {slo['itl_ms']:g} ms"]
    head = (
        f"{'side':<22} {'SLO both':>8} {'goodput':>8} {'worker-s':>9} {'saving':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'up':>3} {'down':>4}"
    )
    for name, load in report["loads"].items():
        s = load["shape"]
        lines.append(
            f"== {name}: {s['requests']} requests over {s['duration_s']:g} s, mean {100 * s['mean']:.1f}% / peak "
            f"{100 * s['high']:.1f}% of capacity {s['capacity_rps']:.2f} req/s"
        )
        for label, run in load["runs"].items():
            lines += [f"-- {label}", head, "-" * len(head)]
            fixed_ws = run["sides"]["fixed_peak"]["worker_seconds"]
            for side, f in run["sides"].items():
                lines.append(
                    f"{side:<22} {_f(f['slo_attainment_pct']['both'], 2):>8} {f['goodput_rps']:>8.2f} "
                    f"{f['worker_seconds']:>9.0f} {100 * saving(f['worker_seconds'], fixed_ws):>6.1f}% "
                    f"{_f(f['ttft_ms']['p50']):>9} {_f(f['ttft_ms']['p99']):>9} {f['scaling_actions']['up']:>3} "
                    f"{f['scaling_actions']['down']:>4}"
                )
            for side, v in run["verdict"].items():
                a = v["attainment"]
                parts = [f"attainment {a['points_below_fixed_peak']:+.2f} points below fixed ({a['met']})"]
                if "goodput" in v:
                    g = v["goodput"]
                    parts.append(f"goodput {_f(g['share_of_fixed_peak'], 3)} of fixed ({g['met']})")
                else:
                    w = v["worker_seconds"]
                    parts.append(
                        f"saving {100 * w['saving_vs_fixed_peak']:.1f}% vs clairvoyant "
                        f"{_f(None if w['clairvoyant_saving_vs_fixed_peak'] is None else 100 * w['clairvoyant_saving_vs_fixed_peak'], 1)}% "  # noqa: E501
                        f"(bound {_f(None if w['bound_most_saving_vs_fixed_peak'] is None else 100 * w['bound_most_saving_vs_fixed_peak'], 1)}%) "  # noqa: E501
                        f"({w['met']})"
                    )
                lines.append(f"verdict {side}: " + "; ".join(parts) + f": {'met' if v['met'] else 'NOT met'}")
    return "\n".join(lines)


def ttft_windows(res: ScalingResult, start_s: float, end_s: float, window_s: float) -> tuple[list[float], list[float]]:
    """The p99 TTFT of the requests arriving in each ``window_s`` window of the load (window middles, seconds)."""
    n = max(1, math.ceil((end_s - start_s) / window_s))
    buckets: list[list[float]] = [[] for _ in range(n)]
    for r in res.requests:
        if start_s <= r.arrival_s < end_s:
            buckets[min(n - 1, int((r.arrival_s - start_s) / window_s))].append(r.ttft_s)
    ts, ps = [], []
    for i, b in enumerate(buckets):
        p = percentile(b, 0.99)
        if p is not None:
            ts.append((i + 0.5) * window_s)
            ps.append(p)
    return ts, ps


def plot(name: str, report: dict[str, Any], run: LoadRun, series: dict[str, dict[str, ScalingResult]],
         path: str) -> str | None:  # fmt: skip
    """One PNG per load (``path`` with ``-<load>`` before its suffix): per start-up a column with the offered load and
    every side's pool (workers routed to) above, the TTFT p99 of 10 s windows (log scale, the target dashed) below.
    None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    p = Path(path)
    out = str(p.with_name(f"{p.stem}-{name}{p.suffix or '.png'}"))
    labels = list(series)
    k = report["loads"][name]["shape"]["time_compression"]
    peak = report["peak_workers"]
    fig, axes = plt.subplots(2, len(labels), figsize=(7 * len(labels), 6.5), sharex=True, squeeze=False)
    colours = {"fixed_peak": "tab:gray", "planner": "tab:blue", "sla": "tab:red", "clairvoyant_planner": "tab:green",
               "clairvoyant_sla": "tab:olive", "reactive_sla": "tab:cyan", SLA_RESCHED: "tab:brown"}  # fmt: skip
    t0, t1 = run.warmup_s, run.warmup_s + run.shape.duration_s
    for col, label in enumerate(labels):
        top, bottom = axes[0, col], axes[1, col]
        grid = [t0 + (t1 - t0) * i / 600 for i in range(601)]
        top.plot([t - t0 for t in grid], [run.shape.fraction(t - t0) * peak for t in grid], color="black",
                 linewidth=1.2, label="offered load (x capacity per worker)")  # fmt: skip
        for side, res in series[label].items():
            sam = [s for s in res.samples if t0 <= s.t < t1]
            if side == "fixed_peak":
                top.axhline(peak, color=colours[side], linestyle=":", label="fixed_peak pool")
            else:
                top.step([s.t - t0 for s in sam], [s.registered for s in sam], where="post",
                         color=colours.get(side, "tab:purple"), label=f"{side} pool")  # fmt: skip
            ts, ps = ttft_windows(res, t0, t1, TTFT_WINDOW_S / k)
            bottom.plot(ts, [1000 * x for x in ps], color=colours.get(side, "tab:purple"), label=side)
        bottom.axhline(report["slo"]["ttft_ms"], color="black", linestyle="--", linewidth=0.8, label="TTFT target")
        bottom.set_yscale("log")
        top.set_ylim(0, peak + 1)
        top.set_ylabel("workers")
        bottom.set_ylabel("TTFT p99 (ms)")
        bottom.set_xlabel("time (s, simulated clock)")
        verdicts = report["loads"][name]["runs"][label]["verdict"]
        said = ", ".join(f"{side} {'meets' if v['met'] else 'misses'}" for side, v in verdicts.items())
        top.set_title(f"{name}, {label}: {said} the targets", fontsize=9)
        top.grid(True, alpha=0.3)
        bottom.grid(True, alpha=0.3)
        top.legend(fontsize=7, loc="upper right")
        bottom.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --- flags ----------------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, positive: Any, fraction: Any, lengths: Any) -> None:
    """The ``--load`` flags (``kvmesh bench planner``'s others apply too: peak fleet, trace, compression, warm-up,
    seed, jobs, the planner's config)."""
    p.add_argument(
        "--load",
        choices=[*LOADS, "all"],
        default=None,
        help="run issue 25's benchmark on this load (sinusoid, slow, trace, step) or on all of them, with the sides "
        "fixed peak, load planner, SLA planner and clairvoyant, judged against the issue's targets (default: none, "
        "the planner-vs-fixed-fleets benchmark)",
    )
    p.add_argument(
        "--startups-s",
        type=lambda s: tuple(positive(x.strip()) for x in s.split(",") if x.strip()),
        default=DEFAULT_STARTUPS_S,
        help=f"--load: worker start-ups to run, seconds, comma-separated (default {MEASURED_STARTUP_S:g},30: the "
        "simulated worker's measured registration time here, and 30 s)",
    )
    p.add_argument(
        "--slow-period-s",
        type=positive,
        default=None,
        help="--load slow: the period, seconds (default 20 x the longest --startups-s; at least that)",
    )
    p.add_argument("--slow-periods", type=positive, default=2.0, help="--load slow: periods to run (default 2)")
    p.add_argument(
        "--trace-mean",
        type=fraction,
        default=0.5,
        help="--load trace: the replayed rows' mean rate, as a fraction of capacity (default 0.5)",
    )
    p.add_argument("--trace-rows", type=int, default=None, help="--load trace: replay the first N rows (default all)")
    p.add_argument(
        "--trace-window-s",
        type=positive,
        default=10.0,
        help="--load trace: window of the rate the clairvoyant schedule and the peak read, seconds (default 10)",
    )
    p.add_argument(
        "--step-lengths",
        type=lengths,
        default=STEP_LENGTHS,
        metavar="PROMPT:OUTPUT",
        help="--load step: every request's prompt and output tokens (default 8000:1000, issue 10528's)",
    )
    p.add_argument(
        "--step-high",
        type=fraction,
        default=1.0,
        help="--load step: the top level (10528's 24 req/s) as a fraction of capacity; the bottom is 1/24 of it "
        "(default 1.0)",
    )
    p.add_argument(
        "--reactive-bound",
        action="store_true",
        help="--load: also replay the reactive_sla side on every load, not only the step's. On a load that changes "
        "within an interval it still knows the interval ahead of each decision: a reference, not a bound (the step, "
        "flat after its instant, gains nothing from that) (default: the step only)",
    )
    p.add_argument(
        "--sla-load-predictor",
        choices=[x.value for x in LoadPredictorName],
        default=None,
        help="--load: the SLA planner's --load-predictor (default: its own, kalman)",
    )
    p.add_argument(
        "--sla-season",
        type=lambda v: v if v == "period" else int(v),
        default=None,
        help="--load: the SLA planner's --load-predictor-season, in adjustment intervals, or 'period': the load's "
        "recurrence over the interval (sinusoid and slow: the period; step: the run, a step that recurs daily; none "
        "for the trace) (default: unset)",
    )
    p.add_argument(
        "--sla-warm-start-periods",
        type=float,
        default=0.0,
        help="--load: warm-start the SLA planner's predictors (--load-predictor-warmup-trace) with this many periods "
        "of the same load just before the run, drawn with another seed: an operator's yesterday (sinusoid, slow "
        "and step, whose period is the run; not the trace; default 0: cold)",
    )
    p.add_argument("--slo-ttft-ms", type=positive, default=SLO_TTFT_MS, help="--load: TTFT target, ms (default 500)")
    p.add_argument("--slo-itl-ms", type=positive, default=SLO_ITL_MS, help="--load: mean ITL target, ms (default 50)")
    # kvmesh rescheduler's flags: --enable-rescheduling adds the sla+resched side (module docstring), the others
    # configure its rescheduler. Where it runs live does not matter here: the colocation switch is left out.
    add_model_arguments(p, ReschedulerConfig, skip={"colocated_rescheduling_mode"})


def problems(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    if args.load is None:
        if args.enable_rescheduling:
            out.append("--enable-rescheduling runs the sla+resched side of --load: give --load")
        return out
    if not args.startups_s:
        out.append("--startups-s needs at least one start-up")
    elif args.slow_period_s is not None and args.slow_period_s < 20 * max(args.startups_s) - 1e-9:
        out.append(f"--slow-period-s must be at least 20 start-ups ({20 * max(args.startups_s):g} s)")
    if args.trace_rows is not None and args.trace_rows < 2:
        out.append("--trace-rows must be >= 2")
    if args.sla_warm_start_periods < 0:
        out.append("--sla-warm-start-periods must be >= 0")
    if args.sla_season is not None and args.sla_season != "period" and args.sla_season < 2:
        out.append("--sla-season must be at least 2 intervals (or 'period')")
    if args.lengths:
        out.append("--load takes its request mix from --trace (and --step-lengths), not --lengths")
    try:
        rescheduler_config(args)
    except ValidationError as e:
        out.append(f"rescheduler flags: {flag_problems(e)}")
    return out


__all__ = ["LOADS", "LoadRun", "add_arguments", "problems", "run", "verdict"]
