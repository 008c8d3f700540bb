"""``kvmesh bench planner``: the planner against fixed fleets under a sinusoidal load, on simulated workers.

The load is the shape of Dynamo's planner benchmark (docs/guides/planner_benchmark in ai-dynamo/dynamo: its
sin_synth generator at ``--request-rate-period 150 --time-duration 600``, rates from 5 to 20 requests/s, i.e. from
25% to 100% of the peak; a 1p1d start against a fixed 2p2d baseline; reported "7.4% less GPU"): the arrival rate at
time t is ``peak * (0.625 - 0.375 * cos(2 pi t / 150 s))`` for 600 s, four periods starting at the trough, Poisson
within it (``scaling.arrival_times``). Here ``peak`` is the measured capacity of the peak fleet: ``--peak-workers``
(8, Dynamo's default ``--max-gpu-budget``) simulated workers, capacity found as ``kvmesh bench routing`` finds it
(``sim.find_capacity``: the highest rate at which round-robin still drains the trace's first
``--capacity-requests`` rows at their own arrival shape). Requests take the trace's lengths in file order
(``scaling.RequestSource``: Azure conversations by default, any Mooncake/Azure/ShareGPT file with ``--trace``; a trace
shorter than the run is cycled, with fresh prompts on each pass).

Fleets, each replaying the same request stream (same arrivals, prompts and router seed) on the virtual clock
(``scaling.simulate``: the real router and the real planner policy over ``VirtualEngine``s; its docstring says what is
modelled and what is left out):

* ``planner``: starts at the size the trough needs (ceil(0.25 x peak workers), ``--start-workers``; Dynamo's
  started at its smallest fleet) and is resized by the planner with ``PlannerConfig`` from the flags: Dynamo's
  load-planner defaults unless given (adjustment every 30 s, pulls every 1 s, decode KV thresholds 0.9 / 0.5),
  ``--max-gpu-budget`` the peak fleet's size unless given;
* ``planner_dynamo_setting`` (unless ``--no-dynamo-setting``): the same with the settings Dynamo's own benchmark ran
  its planner with (adjustment every 10 s, decode KV thresholds 0.6 / 0.3, prefill queue 10 / 0.2): a documented
  alternative, not one tuned here;
* ``fixed_peak``: the peak fleet; ``fixed_mean``: the rounded mean of the *load* in workers (0.625 x peak workers,
  half up: 5 of 8), not of the planner's fleet, so the baseline does not depend on the planner under test. Both run
  the planner with ``--no-operation`` (as Dynamo ran its fixed baseline), which reports what it would have done.

* ``oracle_step_i<I>_u<u>``: the clairvoyant fleets (``clairvoyant.Oracle``): each ``--oracle-utilisation`` u
  (1.0, 0.9, 0.8) at each ``--oracle-intervals`` I (30 and 10 s), resized not by the planner but by a schedule that
  knows the load and the peak fleet's measured capacity per worker and sets the pool ahead of time, under the
  planner's rules (one worker per interval, the start-up, the budget, the one-worker floor, draining): what a
  planner with a perfect signal could do. ``--oracle-loop-rules`` adds ``oracle_loop_*``, which also obey the
  planner loop's pause while a change is in progress and its grace period after an addition.

Beside the simulations, ``schedule_bound`` gives, per rule set, interval, utilisation and start-up (0, 10, 20, 30 s
and ``--startup-s``), the greedy clairvoyant schedule's worker-seconds and a lower bound for any schedule under the
rules that always routes the load's need (``Oracle.least_worker_seconds``); they depend on the load's shape, not on
the trace. ``verdict`` says per rule set and interval whether the goal is within reach: not if the bound leaves less
than 25% to save, whatever the latency; else whether a simulated clairvoyant fleet met it. ``--schedule-only`` prints
the bound and the verdicts alone, with no trace read and no fleet simulated.

Fairness figures (``fairness``): the SLO checks, fixed fleets of the planner's start size and of the mean size at the
same load per worker as the SLO's reference (whether a smaller fleet, as loaded per worker as the peak fleet at its
peak, meets the bound the peak fleet set); and the share of the requests that arrive while the load is within the
fixed mean fleet's capacity.

``--lengths PROMPT:OUTPUT`` replaces the trace with requests of fixed lengths and prompts that share nothing: the shape
of Dynamo's benchmark (3000:150).

Every fleet first serves ``--warmup-s`` (60 s) of load at the trough rate, unwatched and unmeasured, so that the
planner's first interval sees warm engines rather than a cold start (an empty KV cache reads as "scale down").

A new worker holds its GPU from the decision and joins routing ``--startup-s`` later (30 s: the order of a vLLM worker
of an 8B model on an H100 loading its weights from local disk and capturing CUDA graphs; not measured here); a
removed one leaves routing at the decision and holds its GPU until it has finished its requests. Worker-seconds
count every held GPU over the 600 s: starting and draining workers included.

Time compression: the virtual clock runs every timescale (the load, the planner's intervals, start-up, the engines'
steps) at its real value and costs CPU in proportion to the work, so a run at Dynamo's own timescale is the
default (``--time-compression 1``). ``--time-compression K`` divides the period, duration, warm-up, start-up delay
and the planner's two intervals by K (the reference replay's length too) for a cheaper run; the engines' step times
are not compressed, so requests then live K times longer relative to the load's period.

SLOs (the same meaning on any trace): a request meets its SLO when its time to first token and its mean inter-token
latency are at most the ``--slo-quantile`` (p99) of those of the fixed peak fleet replaying the same stream at a
constant load equal to the sinusoid's peak for one period (after the warm-up): what a fleet sized for the peak
delivers to 99% of requests at its design load. Attainment is the fraction of the run's requests that meet both
(each is reported too).

Goal (issue 14): a planner fleet's attainment within 2 points of the fixed peak fleet's, with at least 25% fewer
worker-seconds. Whether the KV rule can do it depends on whether KV use tracks load: the JSON gives the mean KV use
of the reference replay (the peak fleet at its capacity); on a fleet that runs out of compute before memory, KV use
stays below the scale-down threshold until requests queue, and the planner shrinks the fleet until it is overloaded.
docs/planner.md has the measured figures.

``--load NAME`` runs issue 25's benchmark instead (``planner_loads``: four loads, the load planner, the SLA planner
and their clairvoyant schedules against the fixed peak fleet, at each of ``--startups-s``); without it nothing here
changes.

The runs are deterministic, so the planner and its baselines are compared in one run without ABBA rounds (those
counter wall-clock noise; there is none to counter here). JSON is the last line on stdout; a table goes to stderr;
``--png`` (default ``bench-planner.png``) draws the offered load, KV use and pool sizes over time, one panel per fleet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from components import sim
from components.cli.bench.clairvoyant import Oracle
from components.cli.bench.routing import TRACE_DIR
from components.cli.bench.scaling import (
    RequestSource,
    ScalingResult,
    ScalingSpec,
    Sinusoid,
    arrival_times,
    simulate,
    worker_seconds,
)
from components.planner.config import PlannerConfig
from components.router.names import POLICY_NAMES
from components.runtime.flags import add_model_arguments, given_values
from components.sim import FleetSpec, SimRequest, Workload
from components.sim.report import RequestTimes, Slo, attainment, percentile
from components.sim.traces import TraceRow
from components.sim.workloads import from_trace
from components.workers.simulated import MockEngineConfig

DEFAULT_TRACE = "AzureLLMInferenceTrace_conv.csv"
# What Dynamo's planner benchmark ran its planner with (docs/guides/planner_benchmark/benchmark_planner.md at
# ai-dynamo/dynamo 4b1cddfb: --adjustment-interval 10, --metric-pulling-interval 1, decode KV 0.6 / 0.3, prefill
# queue 10 / 0.2).
DYNAMO_SETTING: dict[str, float] = {
    "adjustment_interval": 10.0,
    "metric_pulling_interval": 1.0,
    "decode_kv_scale_up_threshold": 0.6,
    "decode_kv_scale_down_threshold": 0.3,
    "prefill_queue_scale_up_threshold": 10.0,
    "prefill_queue_scale_down_threshold": 0.2,
}
# Start-up delays (s, before time compression) at which the clairvoyant schedule's saving is also reported.
STARTUP_SWEEP_S = (0.0, 10.0, 20.0, 30.0)
GOAL_ATTAINMENT_POINTS = 2.0  # at most this many percentage points below the fixed peak fleet
GOAL_WORKER_SECONDS_SAVING = 0.25  # at least this fraction fewer worker-seconds than the fixed peak fleet
PLANNER_FLEETS = ("planner", "planner_dynamo_setting")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a run needs, decided in the parent and shared with the worker processes (picklable)."""

    trace: str
    lengths: tuple[int, int] | None  # --lengths: every request this many prompt and output tokens (no trace)
    vocab_size: int
    output_tokens: int
    seed: int
    engine: MockEngineConfig
    sinusoid: Sinusoid
    warmup_s: float
    reference_s: float
    startup_s: float
    policy: str
    peak_rps: float


# Rows of a --lengths workload before it cycles (each pass gets fresh prompts: RequestSource).
FIXED_LENGTH_ROWS = 1000


def request_source(
    trace: str, lengths: tuple[int, int] | None, *, vocab_size: int, seed: int, output_tokens: int
) -> RequestSource:
    """The request stream: the trace's rows, or with ``lengths`` (prompt, output) rows of exactly those lengths and
    prompts that share nothing (the shape of Dynamo's sin_synth at ``--isl1/--osl1``; its prompts draw 512-token blocks
    at random from 10,000, which makes shared prefixes rare)."""
    if lengths is None:
        return RequestSource.from_trace(trace, vocab_size=vocab_size, seed=seed, output_tokens=output_tokens)
    isl, osl = lengths
    rows = [TraceRow(index=i, input_length=isl, output_length=osl) for i in range(FIXED_LENGTH_ROWS)]
    return RequestSource(rows, f"fixed_{isl}_{osl}", vocab_size=vocab_size, seed=seed, output_tokens=output_tokens)


def capacity_workload(source: RequestSource, n: int, seed: int) -> Workload:
    """A --lengths stream's first ``n`` requests as the capacity search's workload, Poisson arrivals at a nominal
    1 request/s (the search rescales the rate; a trace is read by ``workloads.from_trace`` with its own arrivals)."""
    rng = random.Random(f"{seed}:arrivals:{source.name}")
    out, t = [], 0.0
    for k in range(n):
        prompt, max_tokens = source.request(k)
        out.append(SimRequest(t, tuple(prompt), max_tokens))
        t += rng.expovariate(1.0)
    return Workload(source.name, tuple(out))


def _source(plan: Plan) -> RequestSource:
    return request_source(
        plan.trace, plan.lengths, vocab_size=plan.vocab_size, seed=plan.seed, output_tokens=plan.output_tokens
    )


def schedule(plan: Plan, sinusoid: Sinusoid) -> list[float]:
    """A warm-up at the rate ``sinusoid`` starts at (its trough; the reference replay's constant rate), then
    ``sinusoid``, as one arrival list on the simulation's clock (t = 0 is the warm-up's start; the measured load starts
    at ``plan.warmup_s``)."""
    warm = Sinusoid(sinusoid.period_s, plan.warmup_s, sinusoid.low, sinusoid.low)
    head = arrival_times(warm, plan.peak_rps, plan.seed + 1) if plan.warmup_s > 0 else []
    return head + [plan.warmup_s + t for t in arrival_times(sinusoid, plan.peak_rps, plan.seed)]


def run_fleet(
    plan: Plan,
    name: str,
    workers: int,
    config: PlannerConfig,
    constant: float | None = None,
    oracle: Oracle | None = None,
) -> dict[str, Any]:
    """One fleet's replay; ``constant``: a replay at that constant fraction of the peak fleet's capacity for
    ``reference_s`` (the SLO's reference at the sinusoid's peak, and the SLO checks); ``oracle``: the clairvoyant
    schedule resizes the fleet instead of the planner."""
    sin = plan.sinusoid
    if constant is not None:
        sin = Sinusoid(sin.period_s, plan.reference_s, constant, constant)
    arrivals = schedule(plan, sin)
    t0 = time.process_time()
    spec = ScalingSpec(plan.engine, workers, config, startup_s=plan.startup_s, policy=plan.policy, controller=oracle)
    res = simulate(
        _source(plan),
        arrivals,
        spec,
        planner_from_s=plan.warmup_s,
        planner_until_s=plan.warmup_s + sin.duration_s,
        seed=plan.seed,
    )
    return {"name": name, "result": res, "cpu_s": round(time.process_time() - t0, 1), "arrivals": len(arrivals)}


def _call(task: tuple[Any, ...]) -> Any:
    fn, *args = task
    return fn(*args)


# --- summaries -------------------------------------------------------------------------------------------------------


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000.0 * x, 1)


def measured(res: ScalingResult, start_s: float, end_s: float) -> list[RequestTimes]:
    """The requests that arrived within the measured load (after the warm-up)."""
    return [r for r in res.requests if start_s <= r.arrival_s < end_s]


def summarize(res: ScalingResult, start_s: float, duration_s: float, slo: Slo | None) -> dict[str, Any]:
    reqs = measured(res, start_s, start_s + duration_s)
    ttft = [r.ttft_s for r in reqs]
    tpot = [r.mean_itl_s for r in reqs if r.mean_itl_s is not None]
    ws = worker_seconds(res.spans, start_s, start_s + duration_s)
    kv = [s.kv_usage for s in res.samples if s.kv_usage is not None]
    ups = [a for a in res.actions if a.direction == "up"]
    downs = [a for a in res.actions if a.direction == "down"]
    out: dict[str, Any] = {
        "requests": len(reqs),
        "ttft_ms": {"p50": _ms(percentile(ttft, 0.5)), "p99": _ms(percentile(ttft, 0.99))},
        "itl_ms": {"p50": _ms(res.gaps.percentile(0.5)), "p99": _ms(res.gaps.percentile(0.99))},
        "mean_itl_per_request_ms": {"p50": _ms(percentile(tpot, 0.5)), "p99": _ms(percentile(tpot, 0.99))},
        "worker_seconds": round(ws, 1),
        "mean_workers": round(ws / duration_s, 3),
        # Most workers holding a GPU at a pull: above the budget when an addition starts while a removed worker
        # still drains (the planner's budget, as Dynamo's, counts the pool, not the draining).
        "most_workers_held": max((x.held for x in res.samples if start_s <= x.t < start_s + duration_s), default=0),
        "kv_usage": {
            "mean": round(sum(kv) / len(kv), 4) if kv else None,
            "max": round(max(kv), 4) if kv else None,
        },
        "scaling_actions": {
            "up": len(ups),
            "down": len(downs),
            "would_have": dict(res.would),
            "actions": [
                {
                    "decided_s": round(a.decided_s - start_s, 1),
                    "done_after_s": None if a.done_s is None else round(a.done_s - a.decided_s, 1),
                    "direction": a.direction,
                    "from": a.before,
                    "to": a.target,
                    "reason": a.reason,
                }
                for a in res.actions
            ],
        },
        "adjustments": res.adjustments,
        "preemptions": res.preemptions,
        "drain_s": round(res.end_s - (start_s + duration_s), 1),
    }
    if slo is not None:
        att = attainment(reqs, slo)
        out["slo_attainment_pct"] = {k: None if v is None else round(100 * v, 2) for k, v in att.items()}
    return out


def judge(fleets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The goal for each planner fleet and each clairvoyant fleet (``oracle_*``) against the fixed peak fleet."""
    peak = fleets["fixed_peak"]
    out: dict[str, Any] = {}
    for name in [*PLANNER_FLEETS, *(n for n in fleets if n.startswith("oracle_"))]:
        f = fleets.get(name)
        if f is None:
            continue
        gap = peak["slo_attainment_pct"]["both"] - f["slo_attainment_pct"]["both"]
        saving = 1.0 - f["worker_seconds"] / peak["worker_seconds"] if peak["worker_seconds"] else 0.0
        out[name] = {
            "attainment_points_below_fixed_peak": round(gap, 2),
            "worker_seconds_saving_vs_fixed_peak": round(saving, 4),
            "target": f"<= {GOAL_ATTAINMENT_POINTS:g} points below, >= {100 * GOAL_WORKER_SECONDS_SAVING:g}% fewer",
            "met": gap <= GOAL_ATTAINMENT_POINTS and saving >= GOAL_WORKER_SECONDS_SAVING,
        }
    return out


# --- output ----------------------------------------------------------------------------------------------------------


def _f(x: float | None, nd: int = 0) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(report: dict[str, Any]) -> str:
    slo = report["slo"]
    load = report["load"]
    head = (
        f"{'fleet':<24} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'SLO both':>8} "
        f"{'TTFT ok':>8} {'ITL ok':>7} {'worker-s':>9} {'workers':>7} {'KV mean':>7} {'up':>3} {'down':>4}"
    )
    lines = [
        f"== {report['workload']['name']}: peak fleet {report['capacity']['peak_workers']} workers, capacity "
        f"{report['capacity']['capacity_rps']:.2f} req/s; load {100 * load['low']:g}-{100 * load['high']:g}% over "
        f"{load['period_s']:g} s periods for {load['duration_s']:g} s ({load['requests']} requests)",
        f"SLO per request: TTFT <= {slo['ttft_ms']:.0f} ms and mean ITL <= {slo['itl_ms']:.1f} ms "
        f"(p{100 * slo['quantile']:g} of the fixed peak fleet at a constant {100 * load['high']:g}% load); "
        f"KV use there: mean {_f(slo['reference_kv_usage_mean'], 3)}",
        head,
        "-" * len(head),
    ]
    for name, f in report["fleets"].items():
        att = f["slo_attainment_pct"]
        lines.append(
            f"{name:<24} {_f(f['ttft_ms']['p50']):>9} {_f(f['ttft_ms']['p99']):>9} {_f(f['itl_ms']['p50'], 1):>8} "
            f"{_f(f['itl_ms']['p99'], 1):>8} {_f(att['both'], 2):>8} {_f(att['ttft'], 2):>8} {_f(att['itl'], 2):>7} "
            f"{f['worker_seconds']:>9.0f} {f['mean_workers']:>7.2f} {_f(f['kv_usage']['mean'], 3):>7} "
            f"{f['scaling_actions']['up']:>3} {f['scaling_actions']['down']:>4}"
        )
    for name, g in report["goal"].items():
        lines.append(
            f"goal {name}: {g['attainment_points_below_fixed_peak']:+.2f} points below fixed_peak, "
            f"{100 * g['worker_seconds_saving_vs_fixed_peak']:.1f}% fewer worker-seconds ({g['target']}): {g['met']}"
        )
    fair = report["fairness"]
    for c in fair["slo_at_full_load_per_worker"]:
        att = c["slo_attainment_pct"]
        both = att if c["reference"] else att["both"]
        lines.append(
            f"SLO check: {c['workers']} workers at a constant {100 * c['load']:g}% of the peak fleet's capacity "
            f"(as loaded per worker as the reference{', the reference itself' if c['reference'] else ''}): "
            f"{_f(both, 2)}% meet the SLO"
        )
    lines.append(
        f"fixed_mean: {fair['fixed_mean_requests_within_capacity_pct']:.1f}% of the requests arrive while the load is "
        "within its capacity"
    )
    return "\n".join([*lines, *bound_lines(report)])


def bound_lines(report: dict[str, Any]) -> list[str]:
    """The table's lines for ``schedule_bound`` and ``verdict``."""
    lines = []
    bound: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for r in report["schedule_bound"]:
        bound.setdefault(f"{r['rules']}_i{r['interval_s']:g}", {}).setdefault(r["utilisation"], []).append(r)
    for key, levels in bound.items():
        ups = "/".join(f"{r['startup_s']:g}" for r in next(iter(levels.values())))
        parts = [f"u={u:g} " + "/".join(f"{100 * r['saving_vs_fixed_peak']:.1f}" for r in rows) + "% (at most "
                 + "/".join(f"{100 * r['most_saving_vs_fixed_peak']:.1f}" for r in rows) + "%)"
                 for u, rows in levels.items()]  # fmt: skip
        lines.append(f"schedule {key}, fewer worker-seconds at start-up {ups} s: " + ", ".join(parts))
    for key, v in report["verdict"].items():
        lines.append(f"verdict {key}: {v}")
    return lines


def oracle_groups(report: dict[str, Any]) -> dict[str, list[str]]:
    """Clairvoyant fleets by rules and uncompressed interval ('step_i30': [names, in the order run])."""
    groups: dict[str, list[str]] = {}
    for name, f in report["fleets"].items():
        if "oracle" in f:
            o = f["oracle"]
            groups.setdefault(f"{o['rules']}_i{o['interval_s_uncompressed']:g}", []).append(name)
    return groups


def plot(report: dict[str, Any], series: dict[str, ScalingResult], plan: Plan, path: str) -> str | None:
    """Offered load and KV use (left axis, fractions) and workers in routing / holding a GPU (right axis) over the
    measured time, one panel per fleet; a planner's panel also draws the pool of the clairvoyant fleet with its
    interval at the first ``--oracle-utilisation``, and each group of clairvoyant fleets (rules, interval) gets one
    panel with all their pools. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sin = plan.sinusoid
    k = report["load"]["time_compression"]
    peak_workers = report["capacity"]["peak_workers"]
    groups = oracle_groups(report)
    fleets = [n for n in series if n not in {m for g in groups.values() for m in g}]
    n_panels = len(fleets) + len(groups)
    fig, axes = plt.subplots(n_panels, 1, figsize=(10, 2.6 * n_panels), sharex=True, squeeze=False)
    twins = []

    def times(res: ScalingResult) -> list[float]:
        return [s.t - plan.warmup_s for s in res.samples]

    def load_axes(ax: Any, res: ScalingResult) -> Any:
        ts = times(res)
        ax.plot(ts, [sin.fraction(t) for t in ts], color="tab:gray", linewidth=1.5, label="offered load (x peak fleet)")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction")
        ax.grid(True, alpha=0.3)
        ax2 = ax.twinx()
        twins.append(ax2)
        ax2.set_ylim(0, peak_workers + 1)
        ax2.set_ylabel("workers")
        return ax2

    for ax, name in zip(axes[: len(fleets), 0], fleets, strict=True):
        res = series[name]
        ts = times(res)
        ax2 = load_axes(ax, res)
        kv = [math.nan if s.kv_usage is None else s.kv_usage for s in res.samples]
        ax.plot(ts, kv, color="tab:red", linewidth=0.8, label="KV use (planner's mean)")
        ax2.step(ts, [s.registered for s in res.samples], where="post", color="tab:blue", label="workers routed to")
        ax2.step(ts, [s.held for s in res.samples], where="post", color="tab:blue", linestyle=":", label="workers held")
        f = report["fleets"][name]
        title = (
            f"{name}: SLO attainment {f['slo_attainment_pct']['both']:.1f}%, {f['worker_seconds']:.0f} worker-s, "
            f"TTFT p99 {f['ttft_ms']['p99']:.0f} ms"
        )
        cfg = f.get("planner_config")
        twin = groups.get(f"step_i{cfg['adjustment_interval'] * k:g}") if cfg else None
        if twin:
            o, of = series[twin[0]], report["fleets"][twin[0]]
            ax2.step(
                times(o),
                [s.registered for s in o.samples],
                where="post",
                color="tab:green",
                linestyle="--",
                label="clairvoyant fleet, same interval: workers routed to",
            )
            title += (
                f"; clairvoyant (u={of['oracle']['utilisation']:g}): {of['slo_attainment_pct']['both']:.1f}%, "
                f"{of['worker_seconds']:.0f} worker-s"
            )
        ax.set_title(title, fontsize=9)
    shades = ["tab:green", "tab:olive", "tab:cyan", "tab:purple", "tab:brown"]
    for ax, (key, names) in zip(axes[len(fleets) :, 0], groups.items(), strict=True):
        ax2 = load_axes(ax, series[names[0]])
        parts = []
        for i, name in enumerate(names):
            res, f = series[name], report["fleets"][name]
            u = f["oracle"]["utilisation"]
            ax2.step(times(res), [s.registered for s in res.samples], where="post", color=shades[i % len(shades)],
                     label=f"u={u:g}: workers routed to")  # fmt: skip
            parts.append(f"u={u:g} {f['slo_attainment_pct']['both']:.1f}% / {f['worker_seconds']:.0f} w-s")
        rules, interval = key.split("_i")
        ax.set_title(f"clairvoyant, {rules} rules, {interval} s interval: " + ", ".join(parts), fontsize=9)
        ax2.legend(fontsize=7, loc="upper right")
    h1, l1 = axes[0, 0].get_legend_handles_labels()
    h2, l2 = twins[0].get_legend_handles_labels()
    axes[0, 0].legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle(
        f"bench planner: {report['workload']['name']}, peak fleet {peak_workers} workers = "
        f"{report['capacity']['capacity_rps']:.1f} req/s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the benchmark ---------------------------------------------------------------------------------------------------


def planner_configs(args: argparse.Namespace) -> dict[str, PlannerConfig]:
    """The planner fleets' configs (flags over Dynamo's defaults; the budget the peak fleet unless given), their
    intervals divided by the time compression."""
    given = given_values(PlannerConfig, args)
    given.pop("no_operation", None)
    given.setdefault("max_gpu_budget", args.peak_workers)
    k = args.time_compression

    def build(values: dict[str, Any]) -> PlannerConfig:
        cfg = PlannerConfig.model_validate(values)
        return cfg.model_copy(
            update={
                "adjustment_interval": cfg.adjustment_interval / k,
                "metric_pulling_interval": cfg.metric_pulling_interval / k,
            }
        )

    out = {"planner": build(given)}
    if args.dynamo_setting:
        out["planner_dynamo_setting"] = build(given | DYNAMO_SETTING)
    return out


def oracles(args: argparse.Namespace, plan: Plan, budget_workers: int) -> dict[str, Oracle]:
    """The clairvoyant fleets, by name: each ``--oracle-utilisation`` at each ``--oracle-intervals`` (divided by the
    time compression, as the planner's), with the step rules, and with the loop rules too under
    ``--oracle-loop-rules``. Names carry the uncompressed interval."""
    out: dict[str, Oracle] = {}
    for loop in (False, True) if args.oracle_loop_rules else (False,):
        for interval in args.oracle_intervals:
            for u in args.oracle_utilisation:
                name = f"oracle_{'loop' if loop else 'step'}_i{interval:g}_u{u:g}"
                out[name] = Oracle(
                    sinusoid=plan.sinusoid,
                    load_start_s=plan.warmup_s,
                    peak_workers=args.peak_workers,
                    utilisation=u,
                    interval_s=interval / args.time_compression,
                    startup_s=plan.startup_s,
                    max_workers=budget_workers,
                    loop_rules=loop,
                    grid_s=0.1 / args.time_compression,
                )
    return out


def need_worker_seconds(oracle: Oracle, step_s: float = 0.01) -> float:
    """The integral of the oracle's need over the measured load: the worker-seconds of a fleet that is always exactly
    the size the load needs at its utilisation (no step limit, no start-up, no drain): what no schedule can beat."""
    n = math.ceil(oracle.sinusoid.duration_s / step_s)
    dt = oracle.sinusoid.duration_s / n
    return sum(oracle.need(oracle.load_start_s + (i + 0.5) * dt) for i in range(n)) * dt


def share_within(sinusoid: Sinusoid, fraction: float, step_s: float = 0.01) -> float:
    """The expected share of the load's requests that arrive while its rate is at most ``fraction`` of the peak fleet's
    capacity (a fixed fleet of that share of the peak fleet's workers is then not overloaded)."""
    n = math.ceil(sinusoid.duration_s / step_s)
    dt = sinusoid.duration_s / n
    rates = [sinusoid.fraction((i + 0.5) * dt) for i in range(n)]
    return sum(r for r in rates if r <= fraction + 1e-12) / sum(rates)


def schedule_bound(
    args: argparse.Namespace, sinusoid: Sinusoid, warmup_s: float, budget_workers: int
) -> list[dict[str, Any]]:
    """Worker-seconds without simulating latency, for both rule sets, every ``--oracle-intervals`` and
    ``--oracle-utilisation``, at ``--startup-s`` and the start-ups of ``STARTUP_SWEEP_S``: the greedy clairvoyant
    schedule's (``Oracle.plan``, a removed worker drained at once: achievable) and a lower bound for any schedule
    under the rules that always routes the load's need (``Oracle.least_worker_seconds``). Both depend on the load's
    shape, the peak fleet's size and the rules only, not on the trace. ``sinusoid`` and ``warmup_s`` are on the
    simulation's (compressed) clock."""
    k = args.time_compression
    t0, t1 = warmup_s, warmup_s + sinusoid.duration_s
    peak_ws = args.peak_workers * sinusoid.duration_s
    rows = []
    for loop in (False, True):
        for interval in args.oracle_intervals:
            for u in args.oracle_utilisation:
                for startup in sorted({*STARTUP_SWEEP_S, args.startup_s}):
                    o = Oracle(
                        sinusoid=sinusoid,
                        load_start_s=warmup_s,
                        peak_workers=args.peak_workers,
                        utilisation=u,
                        interval_s=interval / k,
                        startup_s=startup / k,
                        max_workers=budget_workers,
                        loop_rules=loop,
                        grid_s=0.1 / k,
                    )
                    p = o.plan(t0, t1)
                    least = o.least_worker_seconds(t0, t1)
                    rows.append(
                        {
                            "rules": "loop" if loop else "step",
                            "interval_s": interval,
                            "utilisation": u,
                            "startup_s": startup,
                            "start_workers": p.start,
                            # The greedy clairvoyant schedule: achievable.
                            "worker_seconds": round(p.worker_seconds(t0, t1) * k, 1),
                            "saving_vs_fixed_peak": round(1 - p.worker_seconds(t0, t1) / peak_ws, 4),
                            # No schedule under the rules that always routes the need does better (its proof:
                            # Oracle.least_worker_seconds).
                            "least_worker_seconds": round(least * k, 1),
                            "most_saving_vs_fixed_peak": round(1 - least / peak_ws, 4),
                        }
                    )
    return rows


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    """Per rule set and interval: whether the goal is within reach of a clairvoyant planner, in words. First the
    worker-seconds alone (``schedule_bound`` at the run's start-up): if no schedule that always routes the need can
    save 25% of the peak fleet's, no planner under those rules that keeps up with the load can, whatever its
    latency. Then the simulated clairvoyant fleets (where run): whether one kept its attainment within 2 points of
    the peak fleet's with that saving ("feasible"), or none did ("not reached": the bound leaves room, so that is no
    proof of infeasibility); "undecided" where none was simulated."""
    out: dict[str, str] = {}
    startup = report["load"]["startup_s"] * report["load"]["time_compression"]
    groups = oracle_groups(report)
    keys = dict.fromkeys(f"{r['rules']}_i{r['interval_s']:g}" for r in report["schedule_bound"])
    for key in keys:
        rules, interval = key.split("_i")
        what = "one worker per interval" if rules == "step" else "the planner loop's rules (its pause and grace too)"
        rows = [
            r
            for r in report["schedule_bound"]
            if f"{r['rules']}_i{r['interval_s']:g}" == key and r["startup_s"] == startup
        ]
        # The largest utilisation needs the fewest workers: its bound is the bound for every smaller one too.
        best = max(rows, key=lambda r: r["utilisation"])
        schedule = (
            f"no schedule that always routes enough workers to run them at most {100 * best['utilisation']:g}% of "
            f"their measured capacity saves more than {100 * best['most_saving_vs_fixed_peak']:.1f}% of the peak "
            f"fleet's worker-seconds ({startup:g} s start-up; the greedy clairvoyant schedule "
            f"{100 * best['saving_vs_fixed_peak']:.1f}%)"
        )
        names = groups.get(key, [])
        met = [n for n in names if report["goal"][n]["met"]]
        sims = "; ".join(
            f"simulated u={report['fleets'][n]['oracle']['utilisation']:g}: "
            f"{report['goal'][n]['attainment_points_below_fixed_peak']:.2f} points below, "
            f"{100 * report['goal'][n]['worker_seconds_saving_vs_fixed_peak']:.1f}% fewer"
            for n in names
        )
        sims = f" ({sims})" if sims else ""
        if best["most_saving_vs_fixed_peak"] < GOAL_WORKER_SECONDS_SAVING:
            out[key] = f"infeasible at {interval} s intervals under {what}: {schedule}, below 25% whatever the latency"
        elif met:
            g = report["goal"][max(met, key=lambda n: report["goal"][n]["worker_seconds_saving_vs_fixed_peak"])]
            out[key] = (
                f"feasible at {interval} s intervals under {what}: a clairvoyant fleet comes within "
                f"{g['attainment_points_below_fixed_peak']:.2f} points with "
                f"{100 * g['worker_seconds_saving_vs_fixed_peak']:.1f}% fewer worker-seconds{sims}; a planner's "
                "shortfall here is its signal's and its reactive design's"
            )
        elif names:
            out[key] = (
                f"not reached at {interval} s intervals under {what}: {schedule}, but no simulated clairvoyant "
                f"fleet met the goal{sims}; whether another schedule would is open"
            )
        else:
            out[key] = f"undecided at {interval} s intervals under {what}: {schedule}; no clairvoyant fleet simulated"
    return out


def run_schedule_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--schedule-only``: ``schedule_bound`` and its verdicts without reading a trace or simulating a fleet (the
    bound depends on the load's shape, the peak fleet's size, the budget and the rules only); seconds of CPU."""
    t_start = time.perf_counter()
    k = args.time_compression
    sinusoid = Sinusoid(args.period_s, args.duration_s, args.low, args.high).scaled(k)
    cfg = planner_configs(args)["planner"]
    budget_workers = max(1, cfg.max_gpu_budget // cfg.decode_engine_num_gpu)
    report: dict[str, Any] = {
        "bench": "planner",
        "schedule_only": True,
        "load": {
            "period_s": sinusoid.period_s,
            "duration_s": sinusoid.duration_s,
            "low": sinusoid.low,
            "high": sinusoid.high,
            "peak_workers": args.peak_workers,
            "budget_workers": budget_workers,
            "time_compression": k,
            "startup_s": args.startup_s / k,
        },
        "fleets": {},
        "goal": {},
    }
    report["schedule_bound"] = schedule_bound(args, sinusoid, args.warmup_s / k, budget_workers)
    report["verdict"] = verdicts(report)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print("\n".join(bound_lines(report)), file=sys.stderr, flush=True)
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    k = args.time_compression
    lengths = tuple(args.lengths) if args.lengths else None
    source = request_source(
        args.trace, lengths, vocab_size=args.vocab_size, seed=args.seed, output_tokens=args.output_tokens
    )
    longest = source.longest()
    max_len = max(MockEngineConfig().max_model_len, -(-longest // 1024) * 1024)
    engine = MockEngineConfig(
        max_model_len=max_len,
        num_gpu_blocks=max(args.num_gpu_blocks, -(-max_len // args.block_size) + 1),
        block_size=args.block_size,
    )
    configs = planner_configs(args)
    if lengths is None:
        cap_workload = from_trace(
            args.trace,
            args.capacity_requests,
            vocab_size=args.vocab_size,
            seed=args.seed,
            output_tokens=args.output_tokens,
        )
    else:
        cap_workload = capacity_workload(source, args.capacity_requests, args.seed)
    t0 = time.process_time()
    capacity, probes = sim.find_capacity(cap_workload, FleetSpec(args.peak_workers, engine), args.seed)
    capacity_cpu = time.process_time() - t0
    print(
        f"bench planner: {source.name}: {args.peak_workers} workers drain up to {capacity:.3f} req/s "
        f"({len(probes)} probes)",
        file=sys.stderr,
        flush=True,
    )
    sinusoid = Sinusoid(args.period_s, args.duration_s, args.low, args.high).scaled(k)
    plan = Plan(
        trace=str(args.trace),
        lengths=lengths,
        vocab_size=args.vocab_size,
        output_tokens=args.output_tokens,
        seed=args.seed,
        engine=engine,
        sinusoid=sinusoid,
        warmup_s=args.warmup_s / k,
        reference_s=(args.reference_s if args.reference_s is not None else args.period_s) / k,
        startup_s=args.startup_s / k,
        policy=args.policy,
        peak_rps=capacity,
    )
    mean_workers = max(1, math.floor(sinusoid.mean * args.peak_workers + 0.5))
    start_workers = args.start_workers or max(1, math.ceil(sinusoid.low * args.peak_workers - 1e-9))
    # The fixed fleets' planner reports what the first planner fleet's configuration would have done there.
    fixed = configs["planner"].model_copy(update={"no_operation": True})
    budget_workers = max(1, fixed.max_gpu_budget // fixed.decode_engine_num_gpu)
    clairvoyant = oracles(args, plan, budget_workers)
    oracle_start = {name: o.start_workers(plan.warmup_s) for name, o in clairvoyant.items()}
    # The SLO checks: smaller fixed fleets at the same load per worker as the SLO's reference (the peak fleet at the
    # sinusoid's peak): does a smaller fleet, as loaded per worker, meet the bound the peak fleet set?
    check_sizes = sorted({start_workers, mean_workers} - {args.peak_workers})
    tasks: list[tuple[Any, ...]] = [
        (run_fleet, plan, "reference", args.peak_workers, fixed, sinusoid.high),
        *((run_fleet, plan, name, start_workers, cfg) for name, cfg in configs.items()),
        (run_fleet, plan, "fixed_peak", args.peak_workers, fixed),
        (run_fleet, plan, "fixed_mean", mean_workers, fixed),
        *((run_fleet, plan, name, oracle_start[name], fixed, None, o) for name, o in clairvoyant.items()),
        *((run_fleet, plan, f"slo_check_{n}", n, fixed, sinusoid.high * n / args.peak_workers) for n in check_sizes),
    ]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(args.jobs, len(tasks))) as pool:
        outs = pool.map(_call, tasks, chunksize=1)
    by_name = {o["name"]: o for o in outs}
    ref = by_name.pop("reference")
    checks = {n: by_name.pop(f"slo_check_{n}") for n in check_sizes}
    ref_res: ScalingResult = ref["result"]
    ref_reqs = measured(ref_res, plan.warmup_s, plan.warmup_s + plan.reference_s)
    q = args.slo_quantile
    ttft_slo = percentile([r.ttft_s for r in ref_reqs], q)
    itl_slo = percentile([r.mean_itl_s for r in ref_reqs if r.mean_itl_s is not None], q)
    if ttft_slo is None or itl_slo is None:
        raise SystemExit("kvmesh bench planner: the reference replay finished no request; lengthen --reference-s")
    slo = Slo(ttft_slo, itl_slo)
    ref_kv = [s.kv_usage for s in ref_res.samples if s.kv_usage is not None]
    fleets = {
        name: summarize(o["result"], plan.warmup_s, sinusoid.duration_s, slo) | {"cpu_s": o["cpu_s"]}
        for name, o in by_name.items()
    }
    for name, cfg in configs.items():
        fleets[name]["planner_config"] = cfg.model_dump()
        fleets[name]["start_workers"] = start_workers
        # One worker per change, and after a scale-up the policy waits out the start-up and then a whole interval.
        fleets[name]["most_scale_ups_per_half_period"] = math.floor(
            sinusoid.period_s / 2 / (cfg.adjustment_interval + plan.startup_s) + 1e-9
        )
    fleets["fixed_peak"]["workers"] = args.peak_workers
    fleets["fixed_mean"]["workers"] = mean_workers
    peak_ws = args.peak_workers * sinusoid.duration_s
    for name, o in clairvoyant.items():
        ideal = need_worker_seconds(o)
        fleets[name]["oracle"] = {
            "rules": "loop" if o.loop_rules else "step",
            "utilisation": o.utilisation,
            "interval_s": o.interval_s,
            "interval_s_uncompressed": round(o.interval_s * k, 6),
            "start_workers": oracle_start[name],
            "max_workers": o.max_workers,
            "per_worker_rps": round(capacity / args.peak_workers, 4),
            "need_worker_seconds": round(ideal, 1),
            "need_worker_seconds_saving_vs_fixed_peak": round(1 - ideal / peak_ws, 4),
        }
    slo_checks = [
        {
            "workers": args.peak_workers,
            "load": sinusoid.high,
            "reference": True,
            "slo_attainment_pct": round(100 * (attainment(ref_reqs, slo)["both"] or 0.0), 2),
            "requests": len(ref_reqs),
        }
    ]
    for n, o in checks.items():
        reqs = measured(o["result"], plan.warmup_s, plan.warmup_s + plan.reference_s)
        att = attainment(reqs, slo)
        slo_checks.append(
            {
                "workers": n,
                "load": round(sinusoid.high * n / args.peak_workers, 4),
                "reference": False,
                "slo_attainment_pct": {key: None if v is None else round(100 * v, 2) for key, v in att.items()},
                "requests": len(reqs),
                "ttft_ms": {
                    "p50": _ms(percentile([r.ttft_s for r in reqs], 0.5)),
                    "p99": _ms(percentile([r.ttft_s for r in reqs], 0.99)),
                },
                "cpu_s": o["cpu_s"],
            }
        )
    src_lengths = [source.lengths(i) for i in range(len(source.rows))]
    prompts = sorted(p for p, _ in src_lengths)
    outs_len = sorted(o for _, o in src_lengths)
    report: dict[str, Any] = {
        "bench": "planner",
        "workload": {
            "name": source.name,
            "trace": None if lengths else str(args.trace),
            "lengths": list(lengths) if lengths else None,
            "rows": len(source.rows),
            "prompt_tokens": {"p50": prompts[len(prompts) // 2], "mean": round(sum(prompts) / len(prompts))},
            "output_tokens": {"p50": outs_len[len(outs_len) // 2], "mean": round(sum(outs_len) / len(outs_len))},
        },
        "capacity": {
            "peak_workers": args.peak_workers,
            "capacity_rps": round(capacity, 4),
            "requests": args.capacity_requests,
            "probes": [{"rate_rps": round(p.rate, 4), "drained": p.drained} for p in probes],
            "cpu_s": round(capacity_cpu, 1),
        },
        "load": {
            "period_s": sinusoid.period_s,
            "duration_s": sinusoid.duration_s,
            "low": sinusoid.low,
            "high": sinusoid.high,
            "peak_rps": round(capacity * sinusoid.high, 4),
            "trough_rps": round(capacity * sinusoid.low, 4),
            "requests": len(measured(by_name["fixed_peak"]["result"], plan.warmup_s, 1e18)),
            "warmup_s": plan.warmup_s,
            "time_compression": k,
            "startup_s": plan.startup_s,
            "policy": args.policy,
            # Workers the load's swing from trough to peak asks for, in half a period, if capacity is linear in them.
            "swing_workers": round((sinusoid.high - sinusoid.low) * args.peak_workers, 2),
        },
        "slo": {
            "ttft_ms": round(1000 * slo.ttft_s, 1),
            "itl_ms": round(1000 * slo.itl_s, 2),
            "quantile": q,
            "rule": "a request meets its SLO when its TTFT and its mean inter-token latency are at most the "
            f"p{100 * q:g} of the fixed peak fleet's at a constant {100 * sinusoid.high:g}% load "
            f"({plan.reference_s:g} s after the warm-up)",
            "reference_requests": len(ref_reqs),
            "reference_kv_usage_mean": round(sum(ref_kv) / len(ref_kv), 4) if ref_kv else None,
            "reference_kv_usage_max": round(max(ref_kv), 4) if ref_kv else None,
            "reference_cpu_s": ref["cpu_s"],
        },
        "fairness": {
            # Smaller fixed fleets, as loaded per worker as the SLO's reference: whether the bound is one a fleet of
            # that size can meet at all when it runs at the measured per-worker capacity.
            "slo_at_full_load_per_worker": slo_checks,
            # The fixed mean fleet is over capacity while the load is above its share of the peak fleet's.
            "fixed_mean_requests_within_capacity_pct": round(
                100 * share_within(sinusoid, mean_workers / args.peak_workers), 2
            ),
        },
        "fleets": fleets,
    }
    report["schedule_bound"] = schedule_bound(args, sinusoid, plan.warmup_s, budget_workers)
    report["goal"] = judge(fleets)
    report["goal_met"] = {name: g["met"] for name, g in report["goal"].items()}
    report["verdict"] = verdicts(report)
    report["seed"] = args.seed
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(table(report), file=sys.stderr, flush=True)
    if args.png:
        drawn = plot(report, {name: o["result"] for name, o in by_name.items()}, plan, args.png)
        report["png"] = drawn
        if drawn is None:
            print("bench planner: matplotlib is not installed (pip install 'kvmesh[bench]'): no PNG", file=sys.stderr)
    return report


def _positive(s: str) -> float:
    try:
        x = float(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from e
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s!r}")
    return x


def _fraction(s: str) -> float:
    x = _positive(s)
    if x > 1:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1], got {s!r}")
    return x


def _fractions(s: str) -> tuple[float, ...]:
    return tuple(_fraction(x.strip()) for x in s.split(",") if x.strip())


def _positives(s: str) -> tuple[float, ...]:
    return tuple(_positive(x.strip()) for x in s.split(",") if x.strip())


def _lengths(s: str) -> tuple[int, int]:
    try:
        isl, osl = (int(x) for x in s.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected PROMPT:OUTPUT token counts such as 3000:150, got {s!r}") from e
    if isl < 1 or osl < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1, got {s!r}")
    return isl, osl


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        default=None,
        help=f"a Mooncake, Azure or ShareGPT trace file whose lengths the requests take (default: "
        f"../shared/traces/{DEFAULT_TRACE})",
    )
    p.add_argument("--peak-workers", type=int, default=8, help="simulated workers of the peak fleet (default 8)")
    p.add_argument(
        "--start-workers",
        type=int,
        default=None,
        help="workers the planner fleets start with (default: what the trough needs, ceil(low x peak workers))",
    )
    p.add_argument("--period-s", type=_positive, default=150.0, help="the load's period, in seconds (default 150)")
    p.add_argument("--duration-s", type=_positive, default=600.0, help="measured load, in seconds (default 600)")
    p.add_argument("--low", type=_fraction, default=0.25, help="trough load, x peak capacity (default 0.25)")
    p.add_argument("--high", type=_fraction, default=1.0, help="peak load, x peak capacity (default 1.0)")
    p.add_argument(
        "--time-compression",
        type=_positive,
        default=1.0,
        help="divide the load's period, duration, warm-up, the start-up delay and the planner's intervals by this "
        "(engine step times unchanged; default 1: the virtual clock needs none)",
    )
    p.add_argument(
        "--warmup-s", type=float, default=60.0, help="unmeasured load at the trough rate first, in seconds (default 60)"
    )
    p.add_argument(
        "--startup-s",
        type=float,
        default=30.0,
        help="seconds from a scale-up decision until the new worker takes requests (default 30)",
    )
    p.add_argument("--policy", default="kv", help="router policy of every fleet (default kv, as mock_planner.yaml)")
    p.add_argument(
        "--capacity-requests",
        type=int,
        default=1000,
        help="trace rows the capacity search replays (default 1000, as bench routing)",
    )
    p.add_argument(
        "--slo-quantile",
        type=_fraction,
        default=0.99,
        help="the SLO is this quantile of the fixed peak fleet's TTFT and mean ITL at the peak load (default 0.99)",
    )
    p.add_argument(
        "--reference-s",
        type=float,
        default=None,
        help="length of the constant-peak replay that sets the SLO, in seconds (default: one period)",
    )
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        metavar="PROMPT:OUTPUT",
        help="instead of a trace, every request this many prompt and output tokens, prompts sharing nothing (Dynamo's "
        "planner benchmark: 3000:150)",
    )
    p.add_argument(
        "--oracle-utilisation",
        type=_fractions,
        default=(1.0, 0.9, 0.8),
        help="target load per worker of the clairvoyant fleets, as fractions of the peak fleet's measured capacity "
        "per worker, comma-separated ('' for no clairvoyant fleet; default 1.0,0.9,0.8)",
    )
    p.add_argument(
        "--oracle-intervals",
        type=_positives,
        default=(30.0, 10.0),
        help="decision intervals of the clairvoyant fleets, in seconds before time compression, comma-separated "
        "(default 30,10: the planner's default and Dynamo's benchmark setting)",
    )
    p.add_argument(
        "--oracle-loop-rules",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run each clairvoyant fleet under the planner loop's rules: no decision while a change is in "
        "progress and none removing a worker for 3 decisions after an addition",
    )
    p.add_argument(
        "--schedule-only",
        action="store_true",
        help="print only the schedule bound and its verdicts (worker-seconds of the greedy clairvoyant schedule and a "
        "lower bound for any schedule under the rules, per rule set, --oracle-intervals, --oracle-utilisation and "
        "start-up): no trace read, no fleet simulated",
    )
    p.add_argument(
        "--dynamo-setting",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the planner with the settings of Dynamo's planner benchmark (10 s, KV 0.6/0.3)",
    )
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=MockEngineConfig().num_gpu_blocks,
        help="KV cache blocks per worker (default: the mock engine's; raised to hold the longest request)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--vocab-size", type=int, default=MockEngineConfig().vocab_size, help="token ids of the prompts")
    p.add_argument("--output-tokens", type=int, default=256, help="output length where a trace gives none (ShareGPT)")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrivals, the prompts and the router")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="fleets simulated in parallel")
    p.add_argument("--png", default="bench-planner.png", help="where to draw load, KV use and pools ('' for none)")
    add_model_arguments(p, PlannerConfig, skip={"no_operation"})
    from components.cli.bench import planner_loads  # it imports this module: here, once both are loaded

    planner_loads.add_arguments(p, _positive, _fraction, _lengths)


def main(args: argparse.Namespace) -> int:
    if args.lengths and args.trace:
        print("kvmesh bench planner: give --trace or --lengths, not both", file=sys.stderr)
        return 2
    args.trace = args.trace or str(TRACE_DIR / DEFAULT_TRACE)
    if not args.schedule_only and not args.lengths and not Path(args.trace).is_file():
        print(f"kvmesh bench planner: no trace file at {args.trace}", file=sys.stderr)
        return 2
    problems = []
    if args.peak_workers < 1 or args.jobs < 1:
        problems.append("--peak-workers and --jobs must be >= 1")
    if args.start_workers is not None and not 1 <= args.start_workers <= args.peak_workers:
        problems.append(f"--start-workers must be between 1 and --peak-workers ({args.peak_workers})")
    if args.capacity_requests < 2:
        problems.append("--capacity-requests must be >= 2")
    if args.low > args.high:
        problems.append(f"--low ({args.low}) must not exceed --high ({args.high})")
    if args.warmup_s < 0 or args.startup_s < 0:
        problems.append("--warmup-s and --startup-s must be >= 0")
    if args.reference_s is not None and args.reference_s <= 0:
        problems.append("--reference-s must be > 0")
    if args.policy not in POLICY_NAMES:
        problems.append(f"--policy: unknown policy {args.policy!r}; known: {sorted(POLICY_NAMES)}")
    try:
        planner_configs(args)
    except ValidationError as e:
        problems += [
            f"--{str(err['loc'][0]).replace('_', '-') if err['loc'] else 'planner'}: "
            f"{str(err['msg']).removeprefix('Value error, ')}"
            for err in e.errors()
        ]
    if args.schedule_only and not args.oracle_utilisation:
        problems.append("--schedule-only needs at least one --oracle-utilisation")
    from components.cli.bench import planner_loads

    problems += planner_loads.problems(args)
    if args.load is not None and args.schedule_only:
        problems.append("--load and --schedule-only do not go together")
    if problems:
        print("kvmesh bench planner: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.load is not None:
        print(json.dumps(planner_loads.run(args)), flush=True)
        return 0
    print(json.dumps(run_schedule_only(args) if args.schedule_only else run(args)), flush=True)
    return 0
