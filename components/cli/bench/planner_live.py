"""``kvmesh bench planner-live``: the planner run live and simulated on one compressed sinusoid, decision by decision.

1. A trace (Mooncake jsonl, written into ``--out``): arrivals of a Poisson process whose rate follows Dynamo's
   sinusoid shape (``scaling.Sinusoid``: ``--low`` to ``--high`` of ``--peak-rps`` over ``--period-s``, for
   ``--duration-s``), each a prompt of ``--prompt-tokens`` unique tokens and ``--output-tokens`` outputs. The first
   arrival is shifted to t = 0, so the live and the simulated clock start together.
2. Live: ``kvmesh serve GRAPH --detach`` (default ``graphs/mock_planner.yaml``: simulated workers in real time, the
   planner as one more watcher with the local connector) with the planner's intervals, budget and the workers' KV
   cache set by flags, the planner's TensorBoard files written into ``--out``; the load generator replays the trace
   on its timestamps (open loop, loopback only); ``kvmesh stop``. The live planner's decisions are read back from
   its TensorBoard files (``adjustment/decisions``, wall time of each), its pool sizes from ``pull/decode_workers``.
3. The live workers' start-up, measured: from each scale-up decision to the first pull that counts the new worker.
4. Simulated: ``kvmesh simulate`` on the same graph and settings and the same trace, ``--startup-s`` set to the
   measured start-up (the median; the simulator's default of 30 s is a vLLM worker's, not a mock worker's). With
   ``--sim-inputs live`` (the sla mode's default) on what the live planner was fed instead (``simulated_inputs``):
   the load generator's actual sends, the planner started one adjustment interval before the live one's first
   decision (the live planner starts with the deployment, before the load, so its first decision reads a window
   that began before it), and the live frontend's request reports' phase, heard for ~3 s before the load (which
   arrivals each window counts), with the workers' load reports each on its own phase (``kvmesh simulate
   --staggered-load-reports``: live workers publish from their own start, so a pull reads each report at its own
   age). ``--resimulate`` runs a finished run's simulated side again with its arrivals jittered and a seed per draw:
   how many different decisions the simulated side itself makes on the same inputs.
5. The two sequences of scaling actions (pool, direction, from, to), decided within the load's span plus one
   adjustment interval, compared pair by pair: the same sequence, each pair within one adjustment interval of each
   other (the live planner's intervals start when it starts, before the load; the simulated one's at the first
   arrival, so their phases differ by up to one interval by construction).

JSON on stdout's last line (the load relative to one worker's KV capacity, both action lists, the pairs with their
time differences, the verdict, the live run's request outcomes); ``--png``: the decode pool over time, live and
simulated, over the offered load.

``--mode sla`` (the issue's live check of the SLA planner; ``--mode load``, the default, is the above unchanged):
the graph's planner runs in mode sla on both sides, with the same ``--set`` flags (``overrides``): the targets
(``--ttft``/``--itl``, Dynamo's 500 and 50 ms), ``--load-predictor`` (constant: the live planner hears zero-load
reports from its start until the first arrival and the simulated one does not, so a predictor with a longer memory
would start from two different histories), the start-up lead ``--worker-startup-s`` (given, so that the live planner
does not take another one from serve's state file), and the mock engines' step times at ``speedup_ratio`` 1 (the
SLA planner sizes with the step-time model the workers announce, which is the modelled time: a slowed engine would
leave its correction factors to learn the slow-down first). The defaults make one worker carry 1.63 requests/s of
700 + 100 tokens by the planner's own model (``one_worker_capacity``: a decode batch of 9 steps in 47.2 ms within
the 50 ms ITL, a 700-token prompt takes 80 ms); the peak is ``--peak-capacity`` (2.5) of those, so the throughput
loop wants 3 workers at the peak and 1 at the trough (0.625 workers' worth), the budget of 4 leaving the fast loop
room. The simulated side gets the measured start-up, as in the load mode. Added to the JSON: ``sla`` (the settings
and one worker's capacity), ``live.requests`` (each live request's life from the load generator's results: how many
failed, ended short, were in flight during a scale-down, and failed or ended short then), ``live.scale_downs`` (each
scale-down's window, from its decision in the TensorBoard text to the exit of the worker it removed, from the
planner's log) and ``verdict`` (``decisions_match`` with the pairs, ``failed_during_scale_down``).

What the simulation leaves out, and can make the two differ: the frontend and NATS (a few ms per request), the
load generator's own timing on a busy host, and the start-up's spread (one median for every worker). The live side
runs in real time on this machine: other work on it delays the mock engines' steps and moves the live KV use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from components.cli.bench.loadgen import LoadConfig, run_load
from components.cli.bench.loadgen.stats import RequestResult
from components.cli.bench.scaling import Sinusoid, arrival_times
from components.deploy.graph import load_graph, planner_watcher
from components.deploy.state import log_path, read_state, resolve_state_dir
from components.protocol.endpoints import ENDPOINT_GENERATE, TOPIC_REQUEST_STATS
from components.runtime import Runtime, RuntimeConfig
from components.runtime.events import EventSubscription
from components.sim.replay import REQUEST_STATS_INTERVAL_S

ROOT = Path(__file__).resolve().parents[3]
BLOCK_TOKENS = 512  # tokens per Mooncake hash id (components.sim.traces.MooncakeBlocks)
_DECISION = re.compile(r"^(decode|prefill): scale (up|down) (\d+) -> (\d+) \((.*)\)$")
# The local connector's log lines (components/planner/connectors/local.py) that bound a removal: the watchers a
# scale-down removes, and each one's exit.
_REMOVING = re.compile(r"(decode|prefill) pool: \d+ -> \d+ workers: removing (.+)$")
_REMOVED = re.compile(r"(decode|prefill) pool: (\S+) drained, exited and removed in ")
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
# A log line's time has whole milliseconds (truncated) and is written just after the TensorBoard wall time of the
# decision it follows: a line up to this much "before" the decision still follows it.
_LOG_SLACK_S = 0.005

_ACTION_FIELDS = ("pool", "direction", "from", "to", "decided_s", "reason")  # an action in the JSON, in this order
# Per mode, the defaults of the flags whose right value depends on it (None on the command line: this).
MODE_DEFAULTS: dict[str, dict[str, float]] = {
    # The load planner (KV-use thresholds): a 0.2x-speed worker, so that a few requests/s fill its cache.
    "load": {"period_s": 120.0, "duration_s": 240.0, "peak_rps": 8.0, "speedup_ratio": 0.2},
    # The SLA planner: real time (speedup_ratio 1), because the planner sizes pools with the step-time model the
    # workers announce, which is the modelled time, not the wall time a slowed engine takes; at 0.2x its correction
    # factors would have to learn 5x first. One cycle of the sinusoid (trough, peak, trough) in 120 s. The peak
    # comes from --peak-capacity (SLA_PEAK_CAPACITY), not a fixed rate.
    "sla": {"period_s": 120.0, "duration_s": 120.0, "speedup_ratio": 1.0},
}
# The mock engines' step-time coefficients the sla mode sets (--decode-base-ms and friends; the rest keep the
# defaults of components.perf.model), chosen so that one worker is worth a load this host can send (module docstring).
SLA_STEP_FIELDS = ("decode_base_ms", "decode_ms_per_seq", "prefill_base_ms", "prefill_ms_per_token")
SLA_PEAK_CAPACITY = 2.5  # the sinusoid's peak in workers' worth (one worker's capacity by the SLA planner's model)


def _kvmesh(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "components.cli.main", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def write_trace(path: Path, arrivals: list[float], prompt_tokens: int, output_tokens: int) -> int:
    """Mooncake rows at ``arrivals`` (shifted so the first is at 0), unique blocks each; returns the row count."""
    t0 = arrivals[0] if arrivals else 0.0
    blocks = math.ceil(prompt_tokens / BLOCK_TOKENS)
    with path.open("w") as f:
        for i, t in enumerate(arrivals):
            row = {
                "timestamp": round((t - t0) * 1000),
                "input_length": prompt_tokens,
                "output_length": output_tokens,
                "hash_ids": list(range(i * blocks, (i + 1) * blocks)),
            }
            f.write(json.dumps(row) + "\n")
    return len(arrivals)


def overrides(args: argparse.Namespace, log_dir: Path | None) -> list[str]:
    """The ``--set`` flags both sides get (``kvmesh serve`` and ``kvmesh simulate``), and the live planner's
    TensorBoard directory when ``log_dir`` is given. ``args`` as ``resolve_mode_defaults`` leaves them."""
    sets = [
        "frontend.port=0",
        f"workers[0].num_gpu_blocks={args.num_gpu_blocks}",
        f"workers[0].speedup_ratio={args.speedup_ratio}",
        f"planner.adjustment_interval={args.adjustment_interval}",
        f"planner.metric_pulling_interval={args.metric_pulling_interval}",
        f"planner.max_gpu_budget={args.max_gpu_budget}",
    ]
    if getattr(args, "mode", "load") == "sla":
        sets += [
            "planner.mode=sla",
            f"planner.ttft={args.ttft}",
            f"planner.itl={args.itl}",
            f"planner.load_predictor={args.load_predictor}",
            # Given, not left to the live planner's own reading of serve's state file: the simulated planner gets
            # the same lead from the same --set.
            f"planner.worker_startup_s={args.worker_startup_s}",
            *(f"workers[0].{name}={getattr(args, name)}" for name in SLA_STEP_FIELDS),
        ]
    if log_dir is not None:
        sets.append(f"planner.log_dir={log_dir}")
    return [x for s in sets for x in ("--set", s)]


def resolve_mode_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every flag left unset (None) at its mode's default (``MODE_DEFAULTS``); the sla mode's peak rate
    is ``--peak-capacity`` workers' worth of one worker's capacity (``one_worker_capacity``) unless ``--peak-rps``
    is given. Returns a new namespace."""
    out = argparse.Namespace(**vars(args))
    mode = getattr(out, "mode", "load")
    for name, value in MODE_DEFAULTS[mode].items():
        if getattr(out, name, None) is None:
            setattr(out, name, value)
    if mode == "sla" and out.peak_rps is None:
        out.peak_rps = round(out.peak_capacity * one_worker_capacity(out)["requests_per_s"], 3)
    return out


def one_worker_capacity(args: argparse.Namespace) -> dict[str, float]:
    """The requests/s one worker of the graph (as the overrides configure it) carries within the TTFT and ITL
    targets, by the SLA planner's own model: ``replicas.prefill_workers`` and ``replicas.decode_workers`` at 1
    request/s of ``--prompt-tokens``/``--output-tokens``, summed as ``SlaController`` sizes an aggregated pool
    (prefill demand over the utilisation that keeps the M/D/1 queue wait within the TTFT target, plus decode demand
    over the best batch's tokens/s within the ITL target); uncorrected (factors 1.0)."""
    from components.deploy.whatif import simulated_deployment
    from components.planner.config import SlaPlannerConfig
    from components.planner.sla import replicas

    perf = simulated_deployment(load_graph(ROOT / args.graph, overrides(args, None)[1::2])).fleet.decode_config
    model = perf.step_time_model
    queue_wait = SlaPlannerConfig().queue_wait  # the planner's default; the bench does not change it
    _, sp = replicas.prefill_workers(1.0, args.prompt_tokens, model, args.ttft / 1e3, queue_wait=queue_wait)
    _, sd = replicas.decode_workers(1.0, args.prompt_tokens, args.output_tokens, model, args.itl / 1e3)
    pm, dm = sp.metrics, sd.metrics
    prefill_share = pm["demand_tokens_per_s"] / (pm["max_utilisation"] * pm["worker_tokens_per_s"])
    decode_share = dm["demand_tokens_per_s"] / dm["worker_tokens_per_s"]
    return {
        "requests_per_s": round(1.0 / (prefill_share + decode_share), 4),
        "prefill_share": round(prefill_share, 4),  # workers' worth per request/s
        "decode_share": round(decode_share, 4),
        "prefill_ms": round(pm["prefill_s"] * 1e3, 3),
        "prefill_max_utilisation": round(pm["max_utilisation"], 4),
        "decode_batch": dm["batch"],
        "decode_step_ms": round(dm["step_s"] * 1e3, 3),
        "decode_tokens_per_s": round(dm["worker_tokens_per_s"], 2),
    }


def parse_decisions(texts: list[tuple[float, str]], t0: float) -> list[dict[str, Any]]:
    """The applied scaling actions in a planner's ``adjustment/decisions`` texts (wall time, text), times relative to
    ``t0``; holds and no-operation lines ("would scale") are not actions."""
    out = []
    for wall, text in texts:
        for line in text.split("  \n"):
            m = _DECISION.match(line.strip())
            if m:
                pool, direction, before, target, reason = m.groups()
                out.append(
                    {
                        "pool": pool,
                        "direction": direction,
                        "from": int(before),
                        "to": int(target),
                        "decided_s": round(wall - t0, 3),
                        "reason": reason,
                    }
                )
    return out


def startup_delays(actions: list[dict[str, Any]], pool_series: list[tuple[float, float]]) -> list[float]:
    """For each scale-up, the time from its decision to the first pull whose pool counts its target (an upper bound,
    by at most one pulling interval)."""
    out = []
    for a in actions:
        if a["direction"] != "up":
            continue
        seen = [t for t, n in pool_series if t > a["decided_s"] and n >= a["to"]]
        if seen:
            out.append(round(seen[0] - a["decided_s"], 3))
    return out


def log_time(line: str) -> float | None:
    """The wall time of a log line (``2026-11-28 14:03:37,123 INFO ...``, local time); None for another line."""
    m = _LOG_TIME.match(line)
    if m is None:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def scale_down_windows(
    actions: list[dict[str, Any]], log_lines: list[str], t0: float, end_s: float
) -> list[dict[str, Any]]:
    """Each scale-down in ``actions`` (times relative to ``t0``) as the span in which a request could be lost to it:
    from its decision to the exit of the last worker it removed. The local connector logs which watchers a removal
    takes ("pool: 3 -> 2 workers: removing X") and when each has "drained, exited and removed"; a decision takes the
    first removal line of its pool at or after it (each line once). A window whose exit the log does not show ends
    at ``end_s`` (the run's end): ``exit_seen`` False."""
    removing: list[tuple[float, str, list[str]]] = []
    removed: list[tuple[float, str]] = []  # (time, watcher): a name comes back when the pool grows again
    for line in log_lines:
        t = log_time(line)
        if t is None:
            continue
        if m := _REMOVING.search(line):
            removing.append((t - t0, m.group(1), [n.strip() for n in m.group(2).split(",")]))
        elif m := _REMOVED.search(line):
            removed.append((t - t0, m.group(2)))
    used: set[int] = set()
    out = []
    for a in actions:
        if a["direction"] != "down":
            continue
        found = next(
            (
                k
                for k, (t, pool, _) in enumerate(removing)
                if k not in used and pool == a["pool"] and t >= a["decided_s"] - _LOG_SLACK_S
            ),
            None,
        )
        names: list[str] = []
        exits: list[float | None] = []
        if found is not None:
            used.add(found)
            at, _, names = removing[found]
            # Each watcher's first exit after this removal began (not an earlier removal of the same name).
            exits = [next((t for t, n in removed if n == name and t >= at), None) for name in names]
        seen = bool(names) and all(e is not None for e in exits)
        exited = round(max(e for e in exits if e is not None), 3) if seen else None
        out.append(
            {
                "pool": a["pool"],
                "from": a["from"],
                "to": a["to"],
                "decided_s": a["decided_s"],
                "workers": names,
                "exited_s": exited,
                "exit_seen": seen,
                "end_s": exited if exited is not None else end_s,
            }
        )
    return out


def request_lives(
    results: list[dict[str, Any]], sends_s: list[float], t0: float, output_tokens: int
) -> list[dict[str, Any]]:
    """The live requests' lives relative to ``t0`` from the load generator's results (``RequestResult`` fields plus
    ``ended``, the wall time the result came back): a completed request starts ``e2e_s`` before it ended; a failed one
    (no ``e2e_s``) at its scheduled send, ``sends_s[index]`` (the real send is at most the dispatch lag later, so its
    life can only look longer). ``failed``: an error; ``short``: completed with fewer than ``output_tokens``."""
    out = []
    for r in sorted(results, key=lambda r: r["index"]):
        end = r["ended"] - t0
        start = end - r["e2e_s"] if r.get("e2e_s") is not None else sends_s[r["index"]]
        failed = r.get("error") is not None
        out.append(
            {
                "index": r["index"],
                "start_s": round(start, 3),
                "end_s": round(end, 3),
                "failed": failed,
                "short": not failed and r.get("output_tokens", 0) < output_tokens,
                "error": r.get("error"),
            }
        )
    return out


def scale_down_overlap(lives: list[dict[str, Any]], windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests whose life ``[start_s, end_s]`` overlaps a scale-down window ``[decided_s, end_s]``: how many, and
    how many of those failed or ended short (``failed_during_scale_down``), with the run's totals."""
    bad = [x for x in lives if x["failed"] or x["short"]]

    def overlaps(x: dict[str, Any]) -> bool:
        return any(x["start_s"] < w["end_s"] and x["end_s"] > w["decided_s"] for w in windows)

    during = [x for x in lives if overlaps(x)]
    bad_during = [x for x in during if x["failed"] or x["short"]]
    return {
        "requests": len(lives),
        "failed": sum(1 for x in lives if x["failed"]),
        "ended_short": sum(1 for x in lives if x["short"]),
        "in_flight_during_scale_down": len(during),
        "failed_during_scale_down": len(bad_during),
        "failed_examples": [{k: x[k] for k in ("index", "start_s", "end_s", "error")} for x in bad[:5]],
    }


def planner_phase_s(adjustments_s: list[float], adjustment_interval: float) -> float:
    """The live planner's adjustment phase relative to the load's start: its first adjustment's time (relative to the
    load, usually negative: the planner starts with the deployment) modulo the adjustment interval; 0 with none.
    The adjustment, not the first pull: the first pull can be written late (the planner's start-up), while the
    adjustments keep the loop's fixed cadence."""
    return round(adjustments_s[0] % adjustment_interval, 3) if adjustments_s else 0.0


def report_phase_s(walls: list[float], interval_s: float = REQUEST_STATS_INTERVAL_S) -> float | None:
    """The wall time (any one, on the frontend's cadence) at which the live frontend's request reports arrive, from
    the receive times of a few of them: the first, moved by the median of the others' offsets from its whole-interval
    grid (a report can come a few ms late under load; the cadence itself does not drift). None: none heard."""
    if not walls:
        return None
    ref = walls[0]
    offsets = [(w - ref) - round((w - ref) / interval_s) * interval_s for w in walls]
    return ref + statistics.median(offsets)


def simulated_inputs(
    lives: list[dict[str, Any]],
    t0: float,
    phase_s: float,
    adjustment_interval: float,
    report_wall_s: float | None,
    interval_s: float = REQUEST_STATS_INTERVAL_S,
) -> dict[str, Any]:
    """What the live run fed its planner, as the simulated side's inputs (``--sim-inputs live``): the arrivals at
    the load generator's actual sends (``request_lives``' ``start_s``, relative to ``t0``; sorted, so a trace of
    them starts at the first send), the planner's first pull one adjustment interval before its first decision at
    ``phase_s`` (the live planner starts with the deployment, before the load: its first decision reads an interval
    that began before the first arrival, which a simulated planner started at ``phase_s`` never makes), and the
    phase of the frontend's request reports (received at ``report_wall_s`` + whole intervals: which arrivals each
    of the planner's windows counts). ``planner_start_s`` and ``request_stats_offset_s`` are on the simulation's
    clock, whose 0 is the first send (``kvmesh simulate --planner-start-s``/``--request-stats-offset-s``); an offset
    of 0 when no report was heard (the simulator's own default)."""
    sends = sorted(x["start_s"] for x in lives)
    first = sends[0]
    offset = 0.0
    if report_wall_s is not None:
        offset = round((report_wall_s - t0 - first) % interval_s, 3)
        if offset >= interval_s:  # rounded up to a whole interval
            offset = 0.0
    return {
        "arrivals_s": sends,
        "first_send_s": first,
        "planner_start_s": round(phase_s - adjustment_interval - first, 3),
        "request_stats_offset_s": offset,
    }


def compare(live: list[dict[str, Any]], sim: list[dict[str, Any]], tolerance_s: float) -> dict[str, Any]:
    """Pair the two action lists in order: the same (pool, direction, from, to) and decided within ``tolerance_s``."""
    pairs = []
    for k in range(max(len(live), len(sim))):
        a = live[k] if k < len(live) else None
        b = sim[k] if k < len(sim) else None
        same = (
            a is not None
            and b is not None
            and all(a[f] == b[f] for f in ("pool", "direction", "from", "to"))
            and abs(a["decided_s"] - b["decided_s"]) <= tolerance_s + 1e-9
        )
        pairs.append(
            {
                "live": None if a is None else {f: a[f] for f in ("pool", "direction", "from", "to", "decided_s")},
                "sim": None if b is None else {f: b[f] for f in ("pool", "direction", "from", "to", "decided_s")},
                "dt_s": None if a is None or b is None else round(b["decided_s"] - a["decided_s"], 3),
                "match": same,
            }
        )
    return {
        "pairs": pairs,
        "tolerance_s": tolerance_s,
        "same_sequence": len(live) == len(sim) and all(p["match"] for p in pairs),
        "matched": sum(1 for p in pairs if p["match"]),
    }


def align(live: list[dict[str, Any]], sim: list[dict[str, Any]], tolerance_s: float) -> dict[str, Any]:
    """The most pairs of the same action (pool, direction, from, to) within ``tolerance_s`` that keep both lists'
    order, allowing an action on either side with no counterpart (a longest common subsequence): where ``compare``
    stops at the first difference, this says how much of the rest still agrees. Informational; the verdict is
    ``compare``'s."""
    keys = ("pool", "direction", "from", "to")

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return all(a[f] == b[f] for f in keys) and abs(a["decided_s"] - b["decided_s"]) <= tolerance_s + 1e-9

    n, m = len(live), len(sim)
    best = [[0] * (m + 1) for _ in range(n + 1)]  # best[i][j]: pairs within live[i:] and sim[j:]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = max(best[i + 1][j], best[i][j + 1], best[i + 1][j + 1] + 1 if same(live[i], sim[j]) else 0)
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if same(live[i], sim[j]) and best[i][j] == best[i + 1][j + 1] + 1:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    paired_live, paired_sim = {a for a, _ in pairs}, {b for _, b in pairs}
    return {
        "matched": len(pairs),
        "pairs": [[a, b] for a, b in pairs],  # indices into the live and simulated action lists
        "live_unmatched": [k for k in range(n) if k not in paired_live],
        "sim_unmatched": [k for k in range(m) if k not in paired_sim],
    }


def _read_board(log_dir: Path) -> tuple[list[tuple[float, str]], list[tuple[float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    texts = []
    if "adjustment/decisions/text_summary" in tags.get("tensors", []):
        texts = [
            (e.wall_time, e.tensor_proto.string_val[0].decode())
            for e in acc.Tensors("adjustment/decisions/text_summary")
        ]
    pools = (
        [(e.wall_time, e.value) for e in acc.Scalars("pull/decode_workers")]
        if "pull/decode_workers" in tags.get("scalars", [])
        else []
    )
    return texts, pools


async def _frontend_report_times(rt: Runtime, namespace: str, n: int = 3, timeout_s: float = 3.0) -> list[float]:
    """The wall times at which ``n`` of the frontend's request reports arrive (its cadence's phase: which arrivals
    each of the planner's windows counts), heard before the load; fewer when none comes within ``timeout_s``."""
    sub: EventSubscription[Any] = await rt.namespace(namespace).events.subscribe(TOPIC_REQUEST_STATS)
    walls: list[float] = []
    try:
        for _ in range(n):
            try:
                await sub.get(timeout_s)
            except TimeoutError:
                break
            walls.append(time.time())
    finally:
        await sub.close()
    return walls


def sim_inputs_of(args: argparse.Namespace) -> str:
    """``--sim-inputs``, or its mode's default: live for the sla mode, scheduled for the load mode (as before)."""
    chosen = getattr(args, "sim_inputs", None)
    return chosen if chosen is not None else ("live" if getattr(args, "mode", "load") == "sla" else "scheduled")


async def _live(args: argparse.Namespace, trace: Path, rows: int, out: Path) -> dict[str, Any]:
    state_dir = resolve_state_dir(out / "state")
    state_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out / "live-tensorboard"
    started = await asyncio.to_thread(
        _kvmesh, "serve", str(ROOT / args.graph), "--detach", "--state-dir", str(state_dir), *overrides(args, log_dir)
    )
    if started.returncode != 0:
        raise RuntimeError(f"kvmesh serve failed: {started.stdout[-2000:]}{started.stderr[-2000:]}")
    namespace = ""
    results: list[dict[str, Any]] = []
    report_walls: list[float] = []
    try:
        state = read_state(next(state_dir.glob("*.json")))
        namespace = state.namespace
        if not state.frontend_url:
            raise RuntimeError("the graph has no running frontend")
        rt = await Runtime.connect(
            RuntimeConfig(etcd_endpoints=state.etcd_endpoints, nats_url=state.nats_url), name="bench-planner-live"
        )
        try:
            client = await rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
            await client.wait_for_instances(1, timeout_s=60)
            if sim_inputs_of(args) == "live":
                report_walls = await _frontend_report_times(rt, namespace)
        finally:
            await rt.shutdown(drain_timeout_s=1)
        vocab = load_graph(ROOT / args.graph, overrides(args, None)[1::2]).workers[0]

        def ended(r: RequestResult) -> None:
            results.append(
                {"index": r.index, "ended": time.time(), "error": r.error, "e2e_s": r.e2e_s,
                 "output_tokens": r.output_tokens}
            )  # fmt: skip

        t0 = time.time()
        load = await run_load(
            on_result=ended,
            config=LoadConfig(
                url=state.frontend_url,
                model=args.model,
                trace=str(trace),
                max_requests=rows,
                duration_s=args.duration_s + 5,
                drain_timeout_s=120,
                request_timeout_s=args.duration_s + 120,
                vocab_size=min(256, int(getattr(vocab, "vocab_size", 256))),
                seed=args.seed,
                pids=[p.pid for p in state.all_processes()],
                progress=False,
            ),
        )
        # The planner decides on: give it one more adjustment interval after the load to make its last decision.
        await asyncio.sleep(args.adjustment_interval + args.metric_pulling_interval)
    finally:
        stopping = time.time()
        if namespace:
            stopped = await asyncio.to_thread(_kvmesh, "stop", namespace, "--state-dir", str(state_dir))
            if stopped.returncode != 0:
                print(f"bench planner-live: kvmesh stop {namespace}: {stopped.stderr[-1000:]}", file=sys.stderr)
    texts, pools = _read_board(log_dir)
    planner_log = log_path(state_dir, planner_watcher(namespace))
    return {
        "t0": t0,
        "load": load,
        "texts": texts,
        "pools": [(round(w - t0, 3), n) for w, n in pools],
        "results": results,
        "stopping_s": round(stopping - t0, 3),
        "report_walls": report_walls,
        "planner_log": planner_log.read_text(errors="replace").splitlines() if planner_log.exists() else [],
    }


def _simulate(
    args: argparse.Namespace,
    trace: Path,
    startup_s: float,
    start_s: float,
    out: Path,
    stats_offset_s: float = 0.0,
    staggered: bool = False,
    seed: int | None = None,
) -> dict[str, Any]:
    done = _kvmesh(
        "simulate", "--graph", str(ROOT / args.graph), "--trace", str(trace), *overrides(args, None),
        "--startup-s", str(startup_s), f"--planner-start-s={start_s}", f"--request-stats-offset-s={stats_offset_s}",
        *(["--staggered-load-reports"] if staggered else []),
        "--seed", str(args.seed if seed is None else seed), "--out", str(out), "--no-progress", "--no-png",
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"kvmesh simulate failed: {done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    _, pools = _read_board(out / "tensorboard")
    return {"summary": summary, "pools": pools}


def _draw(path: Path, arrivals: list[float], live_pools: list[tuple[float, float]], sim_pools, actions) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    span = max(arrivals[-1] if arrivals else 1.0, 1.0)
    bins = max(10, int(span / 5))
    ax0.hist(arrivals, bins=bins, weights=[bins / span] * len(arrivals), histtype="step")
    ax0.set_ylabel("offered load (requests/s)")
    if live_pools:
        ax1.step(*zip(*live_pools, strict=True), where="post", label="live (kvmesh serve)")
    if sim_pools:
        ax1.step(*zip(*sim_pools, strict=True), where="post", linestyle="--", label="simulated (kvmesh simulate)")
    for a in actions:
        ax1.axvline(a["decided_s"], color="grey", alpha=0.3)
    ax1.set_ylabel("decode workers")
    ax1.set_xlabel("seconds since the load started")
    ax1.legend(loc="upper right", fontsize=8)
    fig.suptitle("planner live vs simulated, one compressed sinusoid")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _alone_s(args: argparse.Namespace) -> float:
    """One request's time from arrival to last token on an idle simulated worker of the graph (as configured)."""
    from components.deploy.whatif import simulated_deployment
    from components.sim import FleetSpec, SimRequest, Workload, replay

    deployment = simulated_deployment(load_graph(ROOT / args.graph, overrides(args, None)[1::2]))
    fleet = FleetSpec(workers=1, engine=deployment.fleet.decode_config)
    one = Workload("one", (SimRequest(0.0, tuple(i % 256 for i in range(args.prompt_tokens)), args.output_tokens),))
    return replay(one, fleet).e2e_s[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    args = resolve_mode_defaults(args)
    sla = args.mode == "sla"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sin = Sinusoid(args.period_s, args.duration_s, args.low, args.high)
    arrivals = arrival_times(sin, args.peak_rps, args.seed)
    if not arrivals:
        raise ValueError("the sinusoid produced no arrival: raise --peak-rps or --duration-s")
    trace = out / "trace.jsonl"
    rows = write_trace(trace, arrivals, args.prompt_tokens, args.output_tokens)
    shifted = [t - arrivals[0] for t in arrivals]
    alone_s = _alone_s(args)  # before the live run: a graph the simulator refuses fails here, in a second
    t_start = time.perf_counter()
    live = asyncio.run(_live(args, trace, rows, out))
    live_actions = parse_decisions(live["texts"], live["t0"])
    window_end = shifted[-1] + args.adjustment_interval
    live_in = [a for a in live_actions if 0.0 <= a["decided_s"] <= window_end]
    delays = startup_delays(live_in, live["pools"])
    startup_s = statistics.median(delays) if delays else args.startup_s
    # The live planner started before the load: its adjustments fall at its first pull plus whole intervals. The
    # simulated one is started at the same phase, so that the two decide at the same instants until a change
    # restarts an interval.
    phase_s = planner_phase_s([w - live["t0"] for w, _ in live["texts"]], args.adjustment_interval)
    lives = request_lives(live["results"], shifted, live["t0"], args.output_tokens)
    inputs: dict[str, Any] = {"from": sim_inputs_of(args)}
    if inputs["from"] == "live" and lives:
        # The simulated side on what the live planner was fed (simulated_inputs): the sends, a planner started one
        # interval before its first decision, the frontend's report phase.
        wall = report_phase_s(live["report_walls"])
        got = simulated_inputs(lives, live["t0"], phase_s, args.adjustment_interval, wall)
        sim_trace = out / "sim-trace.jsonl"
        write_trace(sim_trace, got["arrivals_s"], args.prompt_tokens, args.output_tokens)
        lags = sorted(a - b for a, b in zip(sorted(x["start_s"] for x in lives), shifted, strict=False))
        inputs |= {
            "trace": str(sim_trace),
            "first_send_s": got["first_send_s"],
            "send_lag_ms": {"min": round(lags[0] * 1e3, 1), "median": round(statistics.median(lags) * 1e3, 1),
                            "max": round(lags[-1] * 1e3, 1)},
            "planner_start_s": got["planner_start_s"],
            "frontend_reports_heard": len(live["report_walls"]),
            "request_stats_offset_s": got["request_stats_offset_s"],
        }  # fmt: skip
        inputs["staggered_load_reports"] = True
        sim = _simulate(
            args, sim_trace, startup_s, got["planner_start_s"], out / "sim", got["request_stats_offset_s"], True
        )
        shift_s = got["first_send_s"]  # the simulation's clock starts at the first send: back onto the live one's
    else:
        inputs |= {"trace": str(trace), "planner_start_s": phase_s, "request_stats_offset_s": 0.0}
        sim = _simulate(args, trace, startup_s, phase_s, out / "sim")
        shift_s = 0.0
    sim_actions = [
        {f: round(a[f] + shift_s, 3) if f == "decided_s" else a[f] for f in _ACTION_FIELDS}
        for a in sim["summary"]["scaling_actions"]
        if a["decided_s"] + shift_s <= window_end
    ]
    verdict = compare(live_in, sim_actions, args.adjustment_interval)
    # One worker's KV capacity in requests at once, and the requests in flight the peak offers by Little's law with
    # the simulated request time: the load relative to what one worker's cache holds.
    per_request_tokens = args.prompt_tokens + args.output_tokens
    cache_requests = args.num_gpu_blocks * 16 / per_request_tokens
    load = live["load"]
    report: dict[str, Any] = {
        "bench": "planner-live",
        "graph": args.graph,
        "trace": str(trace),
        "sinusoid": {"period_s": args.period_s, "duration_s": args.duration_s, "low": args.low, "high": args.high},
        "peak_rps": args.peak_rps,
        "requests": rows,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "one_worker_cache_requests": round(cache_requests, 2),
        "one_request_alone_s": round(alone_s, 3),
        "peak_in_flight_offered": round(args.peak_rps * args.high * alone_s, 2),
        "trough_in_flight_offered": round(args.peak_rps * args.low * alone_s, 2),
        "planner": {
            "adjustment_interval": args.adjustment_interval,
            "metric_pulling_interval": args.metric_pulling_interval,
            "max_gpu_budget": args.max_gpu_budget,
        },
        "startup_s": {"measured": delays, "used": startup_s},
        "planner_phase_s": phase_s,
        "simulated_inputs": inputs,
        "live": {
            "actions": live_in,
            "actions_outside_window": len(live_actions) - len(live_in),
            "requests_completed": load.get("requests_completed"),
            "errors": load.get("errors"),
            "ttft_ms": load.get("ttft_ms"),
        },
        "simulated": {"actions": sim_actions, "ttft_ms": sim["summary"].get("ttft_ms")},
        "comparison": verdict,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    if sla:
        # Only the sla mode adds these (the load mode's JSON stays as it was).
        windows = scale_down_windows(live_in, live["planner_log"], live["t0"], live["stopping_s"])
        overlap = scale_down_overlap(lives, windows)
        # Each live request's life, for reading the verdict again (a window, an error) without another run.
        (out / "live-requests.json").write_text(json.dumps(lives) + "\n")
        capacity = one_worker_capacity(args)
        report["mode"] = "sla"
        report["sla"] = {
            "ttft_ms": args.ttft,
            "itl_ms": args.itl,
            "load_predictor": args.load_predictor,
            "worker_startup_s": args.worker_startup_s,
            "lead_intervals": math.ceil(args.worker_startup_s / args.adjustment_interval - 1e-9),
            "speedup_ratio": args.speedup_ratio,
            "step_time": {name: getattr(args, name) for name in SLA_STEP_FIELDS},
            "one_worker": capacity,
            "peak_capacity": round(args.peak_rps * args.high / capacity["requests_per_s"], 3),
            "trough_capacity": round(args.peak_rps * args.low / capacity["requests_per_s"], 3),
        }
        report["live"]["requests"] = overlap
        report["live"]["scale_downs"] = windows
        report["verdict"] = {
            "decisions_match": verdict["same_sequence"],
            "pairs": verdict["pairs"],
            "tolerance_s": verdict["tolerance_s"],
            "failed_during_scale_down": overlap["failed_during_scale_down"],
            "in_flight_during_scale_down": overlap["in_flight_during_scale_down"],
            "scale_down_exits_seen": all(w["exit_seen"] for w in windows),
            "aligned": align(live_in, sim_actions, args.adjustment_interval),
        }
    if args.png:
        png = out / "planner-live.png"
        sim_pools = [(t + shift_s, n) for t, n in sim["pools"]]
        report["png"] = str(png) if _draw(png, shifted, live["pools"], sim_pools, live_in) else None
    (out / "planner-live.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=("load", "sla"),
        default="load",
        help="the planner to check: load (Dynamo's KV-use thresholds, the default) or sla (TTFT and ITL targets; sets "
        "the graph's planner to mode sla with the --ttft/--itl targets and the mock engines' step times below)",
    )
    p.add_argument("--graph", default="graphs/mock_planner.yaml", help="graph with a planner: section to serve")
    p.add_argument("--model", default="tiny-llama", help="model name the graph serves")
    p.add_argument("--out", default="runs/planner-live", help="directory for the trace, TensorBoard files and JSON")
    p.add_argument("--period-s", type=float, default=None, help="sinusoid period, seconds (default 120)")
    p.add_argument(
        "--duration-s", type=float, default=None, help="load duration, seconds (default 240; sla: 120, one period)"
    )
    p.add_argument("--low", type=float, default=0.25, help="trough as a fraction of --peak-rps (default 0.25)")
    p.add_argument("--high", type=float, default=1.0, help="peak as a fraction of --peak-rps (default 1.0)")
    p.add_argument(
        "--peak-rps",
        type=float,
        default=None,
        help="arrival rate at the sinusoid's peak, requests/s (default 8; the JSON states the requests in flight it "
        "offers, by Little's law with one request's simulated time, against one worker's cache; sla: "
        "--peak-capacity workers' worth)",
    )
    p.add_argument(
        "--peak-capacity",
        type=float,
        default=SLA_PEAK_CAPACITY,
        help="sla, without --peak-rps: the peak in workers' worth of one worker's capacity as the SLA planner's model "
        "computes it (in the JSON: sla.one_worker); default 2.5: the throughput loop needs 3 workers at the peak and "
        "1 at the trough (25%% of it, 0.625 workers' worth), so the pool moves 1 -> 3 -> 1, and the budget of 4 "
        "leaves the fast loop one worker of room",
    )
    p.add_argument("--prompt-tokens", type=int, default=700, help="prompt tokens per request (default 700)")
    p.add_argument("--output-tokens", type=int, default=100, help="output tokens per request (default 100)")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=1024,
        help="KV blocks of 16 tokens per worker (default 1024, the graph's: 16,384 tokens, 20 requests of the "
        "defaults)",
    )
    p.add_argument(
        "--speedup-ratio",
        type=float,
        default=None,
        help="the mock engines' speed (default 0.2: five times slower than the modelled H100, so that a request "
        "lives seconds and a few requests/s fill a cache without making this host's frontend the bottleneck; sla: "
        "1, since the SLA planner sizes with the announced, modelled step times: the slow-down is in the step times)",
    )
    # The sla mode's targets and step times. Dynamo's default targets; step times ~4-8x an H100's decode, so that one
    # worker carries ~1.6 requests/s of 700 + 100 tokens (a batch of 9 within 50 ms: 20 + 3 x 9 + 0.03 us x 6750 KV
    # tokens = 47.2 ms; a 700-token prompt in 80 ms) and the sinusoid's peak of 2.5 workers' worth is ~4 requests/s,
    # less than the load planner's 8 that this host sends. The decode batch of 9 stays under the 21 requests one
    # worker's 1024-block cache holds (the SLA planner's decode sizing does not look at the cache).
    p.add_argument("--ttft", type=float, default=500.0, help="sla: TTFT target, ms (default 500, Dynamo's)")
    p.add_argument("--itl", type=float, default=50.0, help="sla: inter-token latency target, ms (default 50, Dynamo's)")
    p.add_argument(
        "--load-predictor",
        default="constant",
        choices=("constant", "holt-winters", "kalman"),
        help="sla: the planner's load predictor (default constant: the live planner hears zero-load reports from its "
        "start until the first arrival, the simulated one starts at the first arrival; a predictor that remembers "
        "more than the last interval would see two different histories)",
    )
    p.add_argument(
        "--worker-startup-s",
        type=float,
        default=5.0,
        help="sla: the planner's start-up lead, seconds, given to both sides (default 5: a mock worker here registers "
        "1-3 s after it is asked for; any value in (0, 10] is a lead of one 10-s interval)",
    )
    p.add_argument(
        "--decode-base-ms", type=float, default=20.0, help="sla: the mock step's decode base, ms (default 20)"
    )
    p.add_argument("--decode-ms-per-seq", type=float, default=3.0, help="sla: decode cost per sequence, ms (default 3)")
    p.add_argument("--prefill-base-ms", type=float, default=10.0, help="sla: the prefill base, ms (default 10)")
    p.add_argument(
        "--prefill-ms-per-token", type=float, default=0.1, help="sla: prefill cost per prompt token, ms (default 0.1)"
    )
    p.add_argument("--adjustment-interval", type=float, default=10.0, help="planner decisions every S s (default 10)")
    p.add_argument("--metric-pulling-interval", type=float, default=1.0, help="planner pulls every S s (default 1)")
    p.add_argument("--max-gpu-budget", type=int, default=4, help="most workers the planner may run (default 4)")
    p.add_argument(
        "--startup-s",
        type=float,
        default=3.0,
        help="worker start-up for the simulation when the live run measured none (no scale-up), seconds (default 3)",
    )
    p.add_argument(
        "--sim-inputs",
        choices=("live", "scheduled"),
        default=None,
        help="what the simulated side replays: live (the sla mode's default) the live run's inputs: the load "
        "generator's actual sends, a planner started one adjustment interval before the live one's first decision "
        "(as the live planner starts with the deployment, before the load) and the live frontend's request-report "
        "phase (heard for ~3 s before the load); scheduled (the load mode's default) the trace's scheduled "
        "arrivals, a planner started at the live one's phase, reports at whole seconds",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts (default 0)")
    p.add_argument(
        "--resimulate",
        action="store_true",
        help="no live run: the simulated side of the run already in --out (same flags as that run) again, --draws "
        "times, each arrival moved by up to +-(--jitter-ms): how many distinct action sequences the simulated side "
        "makes on the same inputs, and how many match the live run's (resimulated.json)",
    )
    p.add_argument("--draws", type=int, default=20, help="--resimulate: simulations (default 20)")
    p.add_argument(
        "--no-stagger",
        action="store_true",
        help="--resimulate: the workers' load reports all at one tick even where the run's simulated side "
        "staggered them (for comparison)",
    )
    p.add_argument(
        "--jitter-ms",
        type=float,
        default=2.0,
        help="--resimulate: each arrival moved by a uniform draw within +- this, ms (default 2: the load "
        "generator's sends here are 3-7 ms after their schedule, within 1-2 ms of their median lag)",
    )
    p.add_argument("--png", action=argparse.BooleanOptionalAction, default=True, help="write planner-live.png")


def jittered(arrivals_s: list[float], jitter_s: float, rng: random.Random) -> list[float]:
    """``arrivals_s``, each moved by a uniform draw within +-``jitter_s``, to the trace's millisecond, sorted."""
    return sorted(round(t + rng.uniform(-jitter_s, jitter_s), 3) for t in arrivals_s)


def spread(live: list[dict[str, Any]], draws: list[list[dict[str, Any]]], tolerance_s: float) -> dict[str, Any]:
    """The simulated side's action sequences over ``draws`` (each a list of actions, times on the live clock): every
    distinct sequence (its actions as ``pool:from->to@decided``), how many draws made it and whether it matches
    ``live`` by ``compare``'s rule; how many draws match; how many distinct sequences of actions with the times left
    out. Most frequent first."""
    seen: dict[str, dict[str, Any]] = {}
    shapes: set[str] = set()
    for acts in draws:
        key = " ".join(f"{a['pool']}:{a['from']}->{a['to']}@{a['decided_s']:.1f}" for a in acts)
        shapes.add(" ".join(f"{a['pool']}:{a['from']}->{a['to']}" for a in acts))
        if key not in seen:
            seen[key] = {"actions": key, "draws": 0, "matches_live": compare(live, acts, tolerance_s)["same_sequence"]}
        seen[key]["draws"] += 1
    sequences = sorted(seen.values(), key=lambda x: -x["draws"])
    # How often the simulated side agrees with itself: the share of pairs of draws that match each other by the same
    # rule; the live run matching a draw about as often is all a comparison against one draw can ask for.
    pairs = [(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :]]
    agreeing = sum(1 for a, b in pairs if compare(a, b, tolerance_s)["same_sequence"])
    return {
        "draws": len(draws),
        "matching_live": sum(x["draws"] for x in sequences if x["matches_live"]),
        "draw_pairs_matching": round(agreeing / len(pairs), 3) if pairs else None,
        "distinct_sequences": len(sequences),
        "distinct_without_times": len(shapes),
        "sequences": sequences,
    }


def resimulate(args: argparse.Namespace) -> dict[str, Any]:
    """``--resimulate``: the simulated side of the run in ``--out`` again, ``--draws`` times, each arrival moved by
    up to +-``--jitter-ms`` (seeded by ``--seed``) and each draw with its own simulation seed (``--seed`` + draw: the
    router's tie-breaks, the staggered load reports' phases), on the inputs that run's simulated side had
    (``simulated_inputs``; a run without them: the scheduled ones); ``spread`` of the outcomes against the live
    actions. Writes ``resimulated.json``; each draw's files under ``resim/``."""
    args = resolve_mode_defaults(args)
    out = Path(args.out).resolve()
    ran = json.loads((out / "planner-live.json").read_text())
    live = ran["live"]["actions"]
    scheduled = [row["timestamp"] / 1000 for row in map(json.loads, (out / "trace.jsonl").read_text().splitlines())]
    window_end = scheduled[-1] + args.adjustment_interval
    inputs = ran.get("simulated_inputs") or {"from": "scheduled"}
    phase_s, startup_s = ran["planner_phase_s"], ran["startup_s"]["used"]
    if inputs["from"] == "live":
        lives = json.loads((out / "live-requests.json").read_text())
        base = sorted(x["start_s"] for x in lives)
        # The report phase on the live clock (the simulation's clock starts at each draw's first send).
        report_s = inputs["request_stats_offset_s"] + inputs["first_send_s"]
    else:
        base, report_s = scheduled, 0.0
    rng = random.Random(args.seed)
    draws = []
    for d in range(args.draws):
        arrivals = jittered(base, args.jitter_ms / 1e3, rng)
        first = arrivals[0]
        trace = out / "resim" / f"trace-{d}.jsonl"
        trace.parent.mkdir(parents=True, exist_ok=True)
        write_trace(trace, arrivals, args.prompt_tokens, args.output_tokens)
        start_s = phase_s - (args.adjustment_interval if inputs["from"] == "live" else 0.0) - first
        offset_s = round((report_s - first) % REQUEST_STATS_INTERVAL_S, 3) % REQUEST_STATS_INTERVAL_S
        staggered = bool(inputs.get("staggered_load_reports", False)) and not args.no_stagger
        # Each draw its own simulation seed (the run's, then the next ones): the router's tie-breaks and, staggered,
        # the workers' report phases, which the live run does not fix either.
        sim = _simulate(
            args, trace, startup_s, round(start_s, 3), out / "resim" / str(d), offset_s, staggered, args.seed + d
        )
        acts = [
            {f: round(a[f] + first, 3) if f == "decided_s" else a[f] for f in _ACTION_FIELDS}
            for a in sim["summary"]["scaling_actions"]
            if a["decided_s"] + first <= window_end
        ]
        draws.append(acts)
    report = {
        "bench": "planner-live --resimulate",
        "run": str(out),
        "inputs": inputs["from"],
        "staggered_load_reports": bool(inputs.get("staggered_load_reports", False)) and not args.no_stagger,
        "jitter_ms": args.jitter_ms,
        "seed": args.seed,
        "live": " ".join(f"{a['pool']}:{a['from']}->{a['to']}@{a['decided_s']:.1f}" for a in live),
        "spread": spread(live, draws, args.adjustment_interval),
    }
    (out / "resimulated.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(args: argparse.Namespace) -> int:
    if args.resimulate:
        try:
            again = resimulate(args)
        except (RuntimeError, ValueError, OSError, KeyError) as e:
            print(f"kvmesh bench planner-live --resimulate: {e!r}", file=sys.stderr)
            return 1
        sp = again["spread"]
        print(
            f"{sp['draws']} draws (+-{args.jitter_ms:g} ms): {sp['distinct_sequences']} distinct sequences "
            f"({sp['distinct_without_times']} without times); {sp['matching_live']} match the live one; "
            f"two draws match each other {sp['draw_pairs_matching']}",
            file=sys.stderr,
        )
        print(json.dumps(again))
        return 0
    try:
        report = run(args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"kvmesh bench planner-live: {e}", file=sys.stderr)
        return 1
    v = report["comparison"]
    print(
        f"live {len(report['live']['actions'])} actions, simulated {len(report['simulated']['actions'])}: "
        f"{v['matched']} matched within {v['tolerance_s']:g} s; same sequence: {v['same_sequence']}",
        file=sys.stderr,
    )
    if "verdict" in report:
        r = report["live"]["requests"]
        print(
            f"live requests: {r['failed']} failed, {r['ended_short']} ended short of {r['requests']}; "
            f"{r['in_flight_during_scale_down']} in flight during a scale-down, "
            f"{r['failed_during_scale_down']} of them failed or short",
            file=sys.stderr,
        )
    print(json.dumps(report))
    return 0
