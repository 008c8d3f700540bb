"""``kvmesh bench disagg``: aggregated vs disaggregated prefill/decode with the same number of simulated workers, at
stated fractions of the aggregated fleet's measured capacity.

Fleets of ``VirtualEngine``s (the mock engine's own scheduler on a virtual clock, as in ``kvmesh bench routing``;
the docstring of ``components.sim.replay``, the one replay loop, says what that leaves out), same engines, same
router policy (``--policy``, default ``round_robin``: the policy the capacity is defined with, so that the
comparison measures where prefills run and not where requests are placed), same workload, same seed:

* **aggregated**: ``N`` engines; the router places each request on one, which prefills and decodes it
  (the routing benchmark's fleet: the same replay loop, ``components.sim.replay``, with no prefill workers);
* **disaggregated**: ``P`` prefill + ``D`` decode engines, ``P + D = N``, with Dynamo's conditional
  disaggregation at the worker flags' defaults. As in ``components/workers/disagg.py``: the router places the
  request on a decode engine, which asks ``decide_prefill`` (its own prefix cache's hit, ``queue_size`` = items in
  the prefill queue not yet popped, ``prefill_workers`` = ``P``, thresholds ``--max-local-prefill-length`` 1000
  tokens / ``--max-prefill-queue-size`` 3 items); remote: the decode engine reserves blocks for the whole prompt
  (``reserve_remote_prefill``; no room -> local after all) and the item joins a FIFO queue. Each prefill engine pops
  ONE item at a time, prefills it (a normal request with the request's sampling; the step that samples the first
  token ends it: the rest is aborted), holds it for the KV transfer of the whole prompt's blocks
  (``perf_model.transfer_time_s``: 1 ms + 2 MiB per 16-token block at 400 Gb/s with the defaults), delivers it (the
  decode engine commits the KV and first token, which the client sees now, and decodes on from its next step), and
  only then pops the next item. Short prompts, and long ones while the queue is full, are prefilled by the decode
  engine itself, in its decode batches;
* **disaggregated_full**: the same engines with every prompt that has an uncached token prefilled remotely
  (``max_local_prefill_length`` 0, as SGLang's and Mooncake's disaggregation do) while fewer than
  ``--full-queue-per-prefill-worker`` (4) items per prefill engine wait (``FULL_QUEUE_PER_PREFILL_WORKER`` says why):
  the configuration for inter-token latency, where the conditional one is for time to first token;
* **aggregated_capped** (a control, replayed only with ``--decode-long-prefill-threshold`` N): the decode engines of
  both disaggregated fleets then give one prompt at most N tokens per step (vLLM's ``long_prefill_token_threshold``)
  and this aggregated fleet gets the same cap, so a reader can tell a gain of disaggregation from one of capping
  prefill chunks alone, and see what the cap costs in TTFT and capacity.

Per workload:

1. **Capacity** of the aggregated fleet, as the routing benchmark measures it (``sim.find_capacity``: the
   highest arrival rate at which round-robin still drains, found by bracketing and geometric bisection to 4%).
   The other fleets' capacities are searched the same way (same drain rule) and reported beside it.
2. **Replays** of every fleet at each load (default 0.5, 0.7, 0.9 x the aggregated capacity; above 1.0 the
   aggregated fleet does not drain and its latencies grow with the replay's length, measuring the replay rather
   than the fleet): TTFT p50/p99 (arrival to the first token the client sees: for a remote prefill, its delivery),
   inter-token latency p50/p99 (every gap between two consecutive tokens of a request), end-to-end p50/p99, output
   tokens/s over the makespan, whether the replay drained (the capacity search's rule), and for the disaggregated
   fleet the fraction prefilled remotely, the decisions by kind, the queue wait p50/p99 (push to pop), the
   transfer time and each prefill engine's busy fraction.
3. **Ratios** of each fleet over the aggregated one at each load, and the **target** (issue 13) for each
   disaggregated fleet: ITL p99 at least 1.5x better than aggregated at equal throughput (output tokens/s within
   5%), judged per load.

Workloads (``workloads.from_trace``): by default the first ``--requests`` rows with a prompt of at least
``--min-prompt-tokens`` (512) tokens of the Azure conversation trace and of the Mooncake conversation trace, plus
the ShareGPT file as a check on data the defaults were not chosen on (``held_out``: true). One slice rule for every
trace: 512 tokens drops the short chat turns that stall no decode batch much (Azure's p10 prompt is 207 tokens: a
~20 ms step) while the slice still holds prompts on both sides of the rule's 1000-token threshold (15% of Azure's
slice, 9% of Mooncake's and 25% of ShareGPT's stay below it), so both of its branches are exercised;
``--min-prompt-tokens 0`` replays the whole distribution. The first 1000 kept rows are 20 to 40 s of Azure's slice
and 150 to 300 s of Mooncake's at these loads.

JSON is the last line on stdout; a table per workload goes to stderr; ``--png`` (default ``bench-disagg.png``)
draws the TTFT and ITL CDFs of every fleet at each load, one row per workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from components import sim
from components.cli.bench.routing import TRACE_DIR, _floats, _ms, _pct
from components.router.names import POLICY_NAMES
from components.router.policies.disagg import DEFAULT_MAX_LOCAL_PREFILL_LENGTH, DEFAULT_MAX_PREFILL_QUEUE_SIZE
from components.sim import FleetSpec, RunResult, Workload, replay
from components.sim.workloads import from_trace
from components.workers.simulated import MockEngineConfig

DEFAULT_TRACES = ("AzureLLMInferenceTrace_conv.csv", "mooncake_conversation_trace.jsonl")
HELD_OUT_TRACES = ("sharegpt_v3_filtered_500.json",)
LOADS = (0.5, 0.7, 0.9)
MIN_PROMPT_TOKENS = 512
TARGET_ITL_P99_SPEEDUP = 1.5
THROUGHPUT_TOLERANCE = 0.05  # "equal throughput": disaggregated output tokens/s within 5% of aggregated
# Quantile levels the CDFs are drawn at: every percent, then the tail finer (on a logit axis, where p99 shows).
CDF_LEVELS = (*(k / 100 for k in range(1, 100)), 0.995, 0.999)


# --- the simulated fleets ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DisaggSpec:
    """A fleet of ``prefill`` prefill engines and ``decode`` engines the router places requests on; ``prefill = 0``
    is an aggregated fleet of ``decode`` engines. The thresholds are the decode engines' ``WorkerConfig`` fields."""

    prefill: int
    decode: int
    engine: MockEngineConfig = dataclasses.field(default_factory=MockEngineConfig)
    metrics_interval_s: float = 0.1
    # The decode (or aggregated) engines' own config where it differs from ``engine`` (the prefill engines'): a
    # disaggregated fleet's decode engines cap their prefill share of a step (``long_prefill_token_threshold``).
    decode_engine: MockEngineConfig | None = None
    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH
    max_prefill_queue_size: int = DEFAULT_MAX_PREFILL_QUEUE_SIZE

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def decode_config(self) -> MockEngineConfig:
        return self.decode_engine if self.decode_engine is not None else self.engine

    def fleet(self) -> FleetSpec:
        """The simulator's description of this fleet: the router places requests on the ``decode`` engines."""
        return FleetSpec(
            workers=self.decode,
            engine=self.engine,
            metrics_interval_s=self.metrics_interval_s,
            prefill=self.prefill,
            decode_engine=self.decode_engine,
            max_local_prefill_length=self.max_local_prefill_length,
            max_prefill_queue_size=self.max_prefill_queue_size,
        )


# The replay's result: with prefill engines its prefill fields say what the prefill side did.
DisaggResult = RunResult


def simulate_fleet(workload: Workload, spec: DisaggSpec, policy: str = "round_robin", seed: int = 0) -> DisaggResult:
    """Replay ``workload`` on ``spec``'s fleet: the simulator's one replay loop (``components.sim.replay``)."""
    return replay(workload, spec.fleet(), policy, seed)


# --- workloads and fleets -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """How to build a workload (picklable: every worker process builds and caches its own copy)."""

    source: str  # a trace file
    requests: int
    min_prompt_tokens: int
    seed: int
    vocab_size: int
    output_tokens: int
    held_out: bool = False

    @property
    def label(self) -> str:
        return Path(self.source).stem


@functools.lru_cache(maxsize=4)
def build(spec: WorkloadSpec) -> Workload:
    return from_trace(
        spec.source,
        spec.requests,
        vocab_size=spec.vocab_size,
        seed=spec.seed,
        output_tokens=spec.output_tokens,
        min_prompt_tokens=spec.min_prompt_tokens,
    )


def engine_for(w: Workload, num_gpu_blocks: int, block_size: int) -> MockEngineConfig:
    """The mock engine's defaults with a context long enough for the workload's longest request (rounded up to a
    multiple of 1024) and a cache that holds at least that request: the rule ``routing.fleet_for`` applies."""
    longest = max(len(r.prompt) + r.max_tokens for r in w.requests)
    max_len = max(MockEngineConfig().max_model_len, -(-longest // 1024) * 1024)
    blocks = max(num_gpu_blocks, -(-max_len // block_size) + 1)
    return MockEngineConfig(max_model_len=max_len, num_gpu_blocks=blocks, block_size=block_size)


AGGREGATED = "aggregated"
CONDITIONAL = "disaggregated"  # Dynamo's conditional disaggregation with the worker flags' defaults
FULL = "disaggregated_full"  # every prompt with an uncached token prefilled remotely, a deeper queue bound
# The control: the aggregated fleet with the disaggregated decode engines' prefill cap on every engine (replayed only
# when --decode-long-prefill-threshold is set). It answers "is the ITL gain disaggregation's, or the cap's alone?".
CONTROL = "aggregated_capped"
DISAGGREGATED = (CONDITIONAL, FULL)
# The full configuration's queue bound, per prefill worker: a prompt falls back to its decode engine only when four
# prompts per prefill engine are queued ahead of it. A stated setting, not derived from any trace: deep enough that a
# burst of long prompts does not spill into decode batches, shallow enough that a fleet whose prefill engines cannot
# keep up still drains (an unbounded queue made Azure's slice at 0.9 wait 3 s at p99).
FULL_QUEUE_PER_PREFILL_WORKER = 4


def fleets_for(engine: MockEngineConfig, args: argparse.Namespace) -> dict[str, DisaggSpec]:
    """The fleets one workload is replayed on, aggregated first (every ratio's denominator)."""
    threshold = min(args.decode_long_prefill_threshold, engine.max_model_len)
    capped = engine.model_copy(update={"long_prefill_token_threshold": threshold}) if threshold else None
    out = {
        AGGREGATED: DisaggSpec(0, args.workers, engine),
        CONDITIONAL: DisaggSpec(
            args.prefill,
            args.decode,
            engine,
            decode_engine=capped,
            max_local_prefill_length=args.max_local_prefill_length,
            max_prefill_queue_size=args.max_prefill_queue_size,
        ),
    }
    if args.full_queue_per_prefill_worker > 0:
        out[FULL] = DisaggSpec(
            args.prefill,
            args.decode,
            engine,
            decode_engine=capped,
            max_local_prefill_length=0,
            max_prefill_queue_size=args.full_queue_per_prefill_worker * args.prefill,
        )
    if capped is not None:
        out[CONTROL] = DisaggSpec(0, args.workers, engine, decode_engine=capped)
    return out


# --- tasks (run in worker processes) ----------------------------------------------------------------------------------


def _replay(w: Workload, spec: DisaggSpec, policy: str, seed: int) -> DisaggResult:
    return simulate_fleet(w, spec, policy, seed)


def _capacity_task(ws: WorkloadSpec, spec: DisaggSpec, policy: str, seed: int) -> dict[str, Any]:
    w = build(ws)
    t0 = time.process_time()
    fleet = FleetSpec(workers=spec.workers, engine=spec.decode_config, metrics_interval_s=spec.metrics_interval_s)
    simulator = functools.partial(_replay, spec=spec, policy=policy, seed=seed)
    capacity, probes = sim.find_capacity(w, fleet, seed, simulator=simulator)
    return {
        "capacity_rps": capacity,
        "probes": [
            {"rate_rps": round(p.rate, 4), "drain_s": round(p.drain_s, 2), "allowed_s": round(p.allowed_s, 2)}
            for p in probes
        ],
        "cpu_s": round(time.process_time() - t0, 1),
    }


def _quantiles(xs: Sequence[float]) -> list[float]:
    s = sorted(xs)
    if not s:
        return []
    return [round(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 6) for q in CDF_LEVELS]


def summarize(res: DisaggResult, rate: float, allowed_s: float) -> dict[str, Any]:
    makespan = res.makespan_s
    n = len(res.e2e_s)
    out: dict[str, Any] = {
        "rate_rps": round(rate, 4),
        "requests": n,
        "ttft_ms": {"p50": _ms(_pct(res.ttft_s, 0.5)), "p99": _ms(_pct(res.ttft_s, 0.99))},
        "itl_ms": {"p50": _ms(_pct(res.itl_s, 0.5)), "p99": _ms(_pct(res.itl_s, 0.99))},
        "e2e_ms": {"p50": _ms(_pct(res.e2e_s, 0.5)), "p99": _ms(_pct(res.e2e_s, 0.99))},
        "output_tokens": res.output_tokens,
        "output_tokens_per_s": round(res.output_tokens / makespan, 1) if makespan > 0 else None,
        "drain_s": round(res.drain_s, 2),
        "drained": res.drain_s <= allowed_s,
        "hit_rate": round(res.hit_rate, 4),
        "preemptions": res.preemptions,
    }
    if res.prefill_busy_s:
        out["prefill"] = {
            "remote_fraction": round(res.remote / n, 4) if n else None,
            "decisions": dict(sorted(res.prefill_kinds.items())),
            "queue_wait_ms": {"p50": _ms(_pct(res.queue_wait_s, 0.5)), "p99": _ms(_pct(res.queue_wait_s, 0.99))},
            "max_queue": res.max_queue,
            "transfer_ms": {"p50": _ms(_pct(res.transfer_s, 0.5)), "p99": _ms(_pct(res.transfer_s, 0.99))},
            "prefill_busy_fraction": [round(b / makespan, 3) if makespan > 0 else None for b in res.prefill_busy_s],
        }
    return out


def _run_task(ws: WorkloadSpec, spec: DisaggSpec, policy: str, rate: float, seed: int) -> dict[str, Any]:
    w = build(ws).at_rate(rate)
    t0 = time.process_time()
    res = simulate_fleet(w, spec, policy, seed)
    fleet = FleetSpec(workers=spec.workers, engine=spec.decode_config)
    allowed = sim.DRAIN_SLACK * w.span_s + sim.isolated_service_s(w, fleet)
    out = summarize(res, rate, allowed)
    out["cpu_s"] = round(time.process_time() - t0, 1)
    out["_cdf"] = {"ttft_s": _quantiles(res.ttft_s), "itl_s": _quantiles(res.itl_s)}  # for the PNG, not the JSON
    return out


def _call(task: tuple[Any, ...]) -> Any:
    fn, *args = task
    return fn(*args)


# --- ratios and the target --------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(entry: dict[str, Any], loads: Sequence[float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per disaggregated fleet and load: its figures over the aggregated fleet's (TTFT, ITL, throughput) and the ITL
    target; for the capped control, the same ratios (no target: it is not a disaggregated fleet)."""
    ratios: dict[str, Any] = {}
    target: dict[str, Any] = {}
    for fleet in entry["points"]:
        if fleet == AGGREGATED:
            continue
        for load in loads:
            key = f"{load:g}"
            agg = entry["points"][AGGREGATED].get(key)
            other = entry["points"][fleet].get(key)
            if agg is None or other is None:
                continue
            itl_speedup = _ratio(agg["itl_ms"]["p99"], other["itl_ms"]["p99"])
            tput = _ratio(other["output_tokens_per_s"], agg["output_tokens_per_s"])
            ratios.setdefault(fleet, {})[key] = {
                "itl_p99_speedup": itl_speedup,  # aggregated / this fleet: > 1 is this fleet's gain
                "itl_p50_speedup": _ratio(agg["itl_ms"]["p50"], other["itl_ms"]["p50"]),
                "ttft_p50_over_agg": _ratio(other["ttft_ms"]["p50"], agg["ttft_ms"]["p50"]),
                "ttft_p99_over_agg": _ratio(other["ttft_ms"]["p99"], agg["ttft_ms"]["p99"]),
                "throughput_over_agg": tput,
            }
            if fleet == CONTROL:
                continue
            equal = tput is not None and tput >= 1 - THROUGHPUT_TOLERANCE
            target.setdefault(fleet, {})[key] = {
                "target": f"itl_p99_speedup >= {TARGET_ITL_P99_SPEEDUP} with throughput_over_agg >= "
                f"{1 - THROUGHPUT_TOLERANCE:g}",
                "itl_p99_speedup": itl_speedup,
                "equal_throughput": equal,
                "met": itl_speedup is not None and itl_speedup >= TARGET_ITL_P99_SPEEDUP and equal,
            }
    return ratios, target


# --- output -----------------------------------------------------------------------------------------------------------


def _f(x: float | None, nd: int = 0, unit: str = "") -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def table(name: str, entry: dict[str, Any]) -> str:
    head = (
        f"{'fleet':<18} {'load':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'out tok/s':>9} "
        f"{'drained':>7} {'remote':>6} {'qwait p99':>9} {'preempt':>7}"
    )
    cap = entry["capacity_rps"]
    lines = [
        f"== {name}: {entry['requests']} requests; capacity (req/s) "
        + ", ".join(f"{f} {c:.3f}" for f, c in cap.items())
        + " (ms below)",
        head,
        "-" * len(head),
    ]
    for fleet, by_load in entry["points"].items():
        for load, r in by_load.items():
            pf = r.get("prefill", {})
            remote = pf.get("remote_fraction")
            lines.append(
                f"{fleet:<18} {load:>4} {_f(r['ttft_ms']['p50']):>9} {_f(r['ttft_ms']['p99']):>9} "
                f"{_f(r['itl_ms']['p50'], 1):>8} {_f(r['itl_ms']['p99'], 1):>8} {_f(r['output_tokens_per_s']):>9} "
                f"{'yes' if r['drained'] else 'NO':>7} {_f(None if remote is None else 100 * remote, 0, '%'):>6} "
                f"{_f(pf.get('queue_wait_ms', {}).get('p99')):>9} {r['preemptions']:>7}"
            )
    for fleet, by_load in entry["ratios"].items():
        for load, rt in by_load.items():
            met = entry["target"].get(fleet, {}).get(load, {}).get("met")
            lines.append(
                f"{fleet} at {load}: ITL p99 {rt['itl_p99_speedup']}x better than aggregated; TTFT p50 "
                f"x{rt['ttft_p50_over_agg']}, p99 x{rt['ttft_p99_over_agg']}, throughput x{rt['throughput_over_agg']}"
                + ("" if met is None else f": target met {met}")
            )
    return "\n".join(lines)


def plot(
    report: dict[str, Any], cdfs: dict[str, dict[str, dict[str, dict[str, list[float]]]]], path: str
) -> str | None:
    """TTFT and ITL CDFs (p1 to p99.9 on a logit axis, so that the tails the targets speak of are visible), one
    colour per fleet (aggregated blue, disaggregated orange, disaggregated_full red, the capped control green), one
    line style per load, one row per workload; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        return None
    names = list(report["workloads"])
    fig, axes = plt.subplots(len(names), 2, figsize=(11.0, 3.9 * len(names)), squeeze=False)
    styles = [":", "--", "-", "-."]
    colors = {AGGREGATED: "tab:blue", CONDITIONAL: "tab:orange", FULL: "tab:red", CONTROL: "tab:green"}
    for row, name in zip(axes, names, strict=True):
        entry = report["workloads"][name]
        d = entry["fleet"]
        for ax, metric, label in ((row[0], "ttft_s", "TTFT"), (row[1], "itl_s", "inter-token latency")):
            for fleet in cdfs[name]:
                for k, load in enumerate(cdfs[name][fleet]):
                    q = cdfs[name][fleet][load][metric]
                    if q:
                        ax.step([1000.0 * x for x in q], CDF_LEVELS, where="post", color=colors[fleet],
                                linestyle=styles[k % len(styles)], label=f"{fleet} {load}x")  # fmt: skip
            ax.axhline(0.99, color="grey", linewidth=0.8, alpha=0.6)
            ax.set_xscale("log")
            ax.set_yscale("logit")
            ax.set_yticks([0.01, 0.1, 0.5, 0.9, 0.99, 0.999])
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
            ax.set_xlabel(f"{label} (ms)")
            ax.set_ylabel("fraction at or below")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(
                f"{name}{' (held out)' if entry['held_out'] else ''}: {label}\n{d['workers']} aggregated vs "
                f"{d['prefill']}P+{d['decode']}D; loads x {entry['capacity_rps']['aggregated']:.2f} req/s "
                "(aggregated capacity)",
                fontsize=9,
            )
        row[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the benchmark ----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    specs = [
        WorkloadSpec(t, args.requests, args.min_prompt_tokens, args.seed, args.vocab_size, args.output_tokens, held)
        for t, held in args.trace
    ]
    fleets = {s: fleets_for(engine_for(build(s), args.num_gpu_blocks, args.block_size), args) for s in specs}
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(args.jobs) as pool:
        cap_tasks = [(s, f) for s in specs for f in fleets[s]]
        caps = pool.map(
            _call, [(_capacity_task, s, fleets[s][f], args.policy, args.seed) for s, f in cap_tasks], chunksize=1
        )
        capacity = dict(zip(cap_tasks, caps, strict=True))
        for s in specs:
            print(
                f"bench disagg: {s.label}: capacity "
                + ", ".join(f"{f} {capacity[s, f]['capacity_rps']:.3f} req/s" for f in fleets[s]),
                file=sys.stderr,
                flush=True,
            )
        tasks = [(s, f, load) for s in specs for load in args.loads for f in fleets[s]]
        results = pool.map(
            _call,
            [
                (
                    _run_task,
                    s,
                    fleets[s][f],
                    args.policy,
                    capacity[s, "aggregated"]["capacity_rps"] * load,
                    args.seed,
                )
                for s, f, load in tasks
            ],
            chunksize=1,
        )
    report: dict[str, Any] = {"bench": "disagg", "workloads": {}}
    cdfs: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    for s in specs:
        w = build(s)
        lengths = sorted(len(r.prompt) for r in w.requests)
        outs = sorted(r.max_tokens for r in w.requests)
        e = fleets[s][AGGREGATED].engine
        report["workloads"][s.label] = {
            "source": s.source,
            "held_out": s.held_out,
            "requests": len(w.requests),
            "min_prompt_tokens": s.min_prompt_tokens,
            "prompt_tokens": {
                "p50": lengths[len(lengths) // 2],
                "p90": lengths[int(0.9 * len(lengths))],
                "max": lengths[-1],
            },
            "prompts_over_max_local_prefill_length": round(
                sum(n > args.max_local_prefill_length for n in lengths) / len(lengths), 4
            ),
            "output_tokens": {"p50": outs[len(outs) // 2], "max": outs[-1]},
            "fleet": {
                "workers": args.workers,
                "prefill": args.prefill,
                "decode": args.decode,
                "policy": args.policy,
                "num_gpu_blocks": e.num_gpu_blocks,
                "max_model_len": e.max_model_len,
                "rules": {
                    f: {
                        "max_local_prefill_length": fleets[s][f].max_local_prefill_length,
                        "max_prefill_queue_size": fleets[s][f].max_prefill_queue_size,
                        "decode_long_prefill_token_threshold": fleets[s][f].decode_config.long_prefill_token_threshold,
                    }
                    for f in DISAGGREGATED
                    if f in fleets[s]
                },
            },
            "capacity_rps": {f: round(capacity[s, f]["capacity_rps"], 4) for f in fleets[s]},
            "capacity": {f: capacity[s, f] for f in fleets[s]},
            "points": {f: {} for f in fleets[s]},
        }
        cdfs[s.label] = {f: {} for f in fleets[s]}
    for (s, f, load), r in zip(tasks, results, strict=True):
        cdfs[s.label][f][f"{load:g}"] = r.pop("_cdf")
        report["workloads"][s.label]["points"][f][f"{load:g}"] = r
    for name, entry in report["workloads"].items():
        entry["ratios"], entry["target"] = compare(entry, args.loads)
        print(table(name, entry), file=sys.stderr, flush=True)
    report["target_met_at"] = {
        name: {f: [load for load, t in by_load.items() if t["met"]] for f, by_load in entry["target"].items()}
        for name, entry in report["workloads"].items()
    }
    report["loads"] = list(args.loads)
    report["load_basis"] = "fractions of the aggregated fleet's measured capacity (round-robin drain rate)"
    report["seed"] = args.seed
    report["jobs"] = args.jobs
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.png:
        drawn = plot(report, cdfs, args.png)
        report["png"] = drawn
        if drawn is None:
            print("bench disagg: matplotlib is not installed (pip install 'kvmesh[bench]'): no PNG", file=sys.stderr)
    return report


def _policy(s: str) -> str:
    if s not in POLICY_NAMES:
        raise argparse.ArgumentTypeError(f"unknown policy {s!r}; known: {sorted(POLICY_NAMES)}")
    return s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        action="append",
        default=None,
        help="a Mooncake, Azure or ShareGPT trace file (repeatable; default: the Azure and Mooncake conversation "
        "traces in ../shared/traces, plus ShareGPT as a held-out check)",
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per workload (the first N kept rows)")
    p.add_argument(
        "--min-prompt-tokens",
        type=int,
        default=MIN_PROMPT_TOKENS,
        help="keep only rows with a prompt of at least this many tokens, on every trace (0: all rows)",
    )
    p.add_argument("--loads", type=_floats, default=list(LOADS), help="fractions of the aggregated capacity")
    p.add_argument("--workers", type=int, default=4, help="engines in the aggregated fleet (= prefill + decode)")
    p.add_argument("--prefill", type=int, default=None, help="prefill engines of the disaggregated fleet (workers/2)")
    p.add_argument("--decode", type=int, default=None, help="decode engines of the disaggregated fleet (the rest)")
    p.add_argument("--policy", type=_policy, default="round_robin", help="router policy of both fleets")
    p.add_argument(
        "--max-local-prefill-length",
        type=int,
        default=DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
        help="the decode engines' rule: prefill remotely a prompt whose uncached part is longer than this many "
        "tokens (the worker flag's default, Dynamo's; 0: every prompt with an uncached token goes remote)",
    )
    p.add_argument(
        "--max-prefill-queue-size",
        type=int,
        default=DEFAULT_MAX_PREFILL_QUEUE_SIZE,
        help="the decode engines' rule: prefill remotely only while the queue holds fewer than this many items "
        "(the worker flag's default, Dynamo's)",
    )
    p.add_argument(
        "--full-queue-per-prefill-worker",
        type=int,
        default=FULL_QUEUE_PER_PREFILL_WORKER,
        help=f"also replay '{FULL}': every prompt with an uncached token prefilled remotely "
        "(max_local_prefill_length 0) while the queue holds fewer than this many items per prefill engine "
        "(0: do not replay it)",
    )
    p.add_argument(
        "--decode-long-prefill-threshold",
        type=int,
        default=0,
        help="the disaggregated decode engines' long_prefill_token_threshold, in tokens: the most prompt tokens one "
        "of their steps computes for one request while others run (0, the default: uncapped, like the aggregated "
        f"engines). When set, the aggregated fleet with the same cap is replayed too, as the control '{CONTROL}'",
    )
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=MockEngineConfig().num_gpu_blocks,
        help="KV cache blocks per engine (default: the mock engine's; raised to hold the longest request)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--vocab-size", type=int, default=MockEngineConfig().vocab_size, help="token ids of the prompts")
    p.add_argument("--output-tokens", type=int, default=256, help="output length where a trace gives none (ShareGPT)")
    p.add_argument("--seed", type=int, default=0, help="seeds the router and the prompts")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations run in parallel")
    p.add_argument("--png", default="bench-disagg.png", help="where to draw the TTFT and ITL CDFs ('' for none)")


def main(args: argparse.Namespace) -> int:
    if args.trace is None:
        args.trace = [(str(TRACE_DIR / t), False) for t in DEFAULT_TRACES]
        args.trace += [(str(TRACE_DIR / t), True) for t in HELD_OUT_TRACES if (TRACE_DIR / t).is_file()]
    else:
        args.trace = [(t, False) for t in args.trace]
    missing = [t for t, _ in args.trace if not Path(t).is_file()]
    if missing:
        print(f"kvmesh bench disagg: no trace file at {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.prefill is None and args.decode is None:
        args.prefill = args.workers // 2
    if args.prefill is None:
        args.prefill = args.workers - args.decode
    if args.decode is None:
        args.decode = args.workers - args.prefill
    if args.requests < 2 or args.jobs < 1 or args.prefill < 1 or args.decode < 1:
        print("kvmesh bench disagg: --requests must be >= 2, --jobs, --prefill and --decode >= 1", file=sys.stderr)
        return 2
    if args.decode_long_prefill_threshold < 0:
        print("kvmesh bench disagg: --decode-long-prefill-threshold must be >= 0 (0: no cap)", file=sys.stderr)
        return 2
    if args.prefill + args.decode != args.workers:
        print(
            f"kvmesh bench disagg: --prefill {args.prefill} + --decode {args.decode} must equal --workers "
            f"{args.workers} (the fleets are compared at the same number of engines)",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(run(args)), flush=True)
    return 0
