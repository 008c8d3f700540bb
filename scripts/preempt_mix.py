"""Preemptions and KV imbalance on the short/long mix at steady state (docs/rescheduler.md, "Preemptions and imbalance
at steady state: reach and configurations"): the cells of ``kvmesh bench rescheduling --workloads llumnix --requests
4000 --loads 0.8,1.0`` (its workload, fleet, ``run_cell`` and seed 0's steady-state capacity, given with
``--capacity``: the bench's search takes minutes) for several "on" configurations against one off side, and where a
run's preemptions and imbalance happen.

    PYTHONPATH=$PWD .venv/bin/python scripts/preempt_mix.py cells --seeds 3,4,5 --sides off,defaults,d07,d07wf
    PYTHONPATH=$PWD .venv/bin/python scripts/preempt_mix.py pooled --seeds 0,1,2
    PYTHONPATH=$PWD .venv/bin/python scripts/preempt_mix.py where --side off --dispatch least_loaded --load 1 --seed 3

``cells``: one JSON line per run (side, dispatch, load, seed and ``run_cell``'s figures), then per (dispatch, load,
side) the median and min-max over the seeds and the bench's verdicts (``judge``) of each "on" side against off.
Sides: ``off``; ``defaults`` (the bench's "on": ``neutral_load,binpacking_mitigation``, every field Llumnix's
default); ``d07`` (the same with ``rescheduling_neutral_load_threshold`` 0.7: run D of docs/rescheduler.md);
``d07wf`` (``waiting_fit`` in front of d07's policies); ``wf`` (``waiting_fit,neutral_load,binpacking_mitigation``,
the defaults: the judged run of "Waiting requests on the simulator").

``pooled``: the bench's pooled reference (``--pooled``, ``sim.pooled_fleet``) per seed and load: TTFT p99 and
preemptions.

``where``: one run of ``--side`` (off or any "on" side) with an observer at each load report (100 ms of virtual
time): each worker's preemptions since the last report, KV use, free blocks and the blocks its waiting prompts need.
Reported: the preemptions by the fleet's KV use at the report that follows them, and by whether the other workers had
"spare" blocks (free blocks less what their own waiting prompts need: KV a migration could fill without displacing
an admission they are about to make); the P95 of the KV imbalance (max - min of the workers' KV use) over all
reports, over the steady part (arrivals' second quarter to the last arrival) and over the drain after the last
arrival. Off only, a second replay with a recorder in the rescheduler's place (it moves nothing: its TTFT p99 and
preemptions are printed beside the run's, the same) for a granularity floor: at each record the imbalance of the
best placement found by longest first (each request's blocks, whole, onto the emptiest worker; the blocks the listed
requests do not account for spread evenly), i.e. what a rescheduler that re-placed every request at every record,
at no cost, would leave.

``table``: markdown rows from ``cells``' JSON lines (files given), for docs/rescheduler.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from components import sim
from components.cli.bench.rescheduling import (
    Spec,
    build,
    fleet_for,
    judge,
    kv_spread,
    pct,
    run_cell,
    spread,
)
from components.fleet.model import FleetSnapshot
from components.rescheduler.config import Policy, ReschedulerConfig
from components.sim import Sample
from components.sim.dynamics import Migration, RunningRequest
from components.sim.rescheduling import PolicyRescheduler
from components.workers.simulated import MockEngineConfig

N = 4000
VOCAB = MockEngineConfig().vocab_size
BENCH_SEEDS = (0, 1, 2)
FLEET = fleet_for([build(Spec("llumnix", N, s, VOCAB)) for s in BENCH_SEEDS], 4, 1280)
CAPACITY = 23.308660765493254  # the bench's seed-0 steady-state capacity (docs/rescheduler.md, "The pooled reference")
BASE = ("neutral_load", "binpacking_mitigation")
SIDES: dict[str, tuple[tuple[str, ...], dict[str, Any]] | None] = {
    "off": None,
    "defaults": (BASE, {}),
    "d07": (BASE, {"rescheduling_neutral_load_threshold": 0.7}),
    "d07wf": (("waiting_fit", *BASE), {"rescheduling_neutral_load_threshold": 0.7}),
    "wf": (("waiting_fit", *BASE), {}),
    # Variants of d07 tried on the exploration seeds (3-5): a larger budget, a budget of 10% of the KV, cycles 5x as
    # often.
    "d07_t4096": (BASE, {"rescheduling_neutral_load_threshold": 0.7, "rescheduling_req_select_value": 4096}),
    "d07_r01": (
        BASE,
        {
            "rescheduling_neutral_load_threshold": 0.7,
            "rescheduling_req_select_rule": "kv_ratio",
            "rescheduling_req_select_value": 0.1,
        },
    ),
    "d07_i100": (BASE, {"rescheduling_neutral_load_threshold": 0.7, "rescheduling_interval_ms": 100}),
    "d07_i100_r01": (
        BASE,
        {
            "rescheduling_neutral_load_threshold": 0.7,
            "rescheduling_interval_ms": 100,
            "rescheduling_req_select_rule": "kv_ratio",
            "rescheduling_req_select_value": 0.1,
        },
    ),
    # waiting_fit with d07_i100's balancing (docs/rescheduler.md, "TTFT and imbalance together"), tried on the
    # exploration seeds (3-5): waiting_fit first or last, its headroom; waiting_fit every 100 ms at Llumnix's threshold.
    "wfd07_i100": (
        ("waiting_fit", *BASE),
        {"rescheduling_neutral_load_threshold": 0.7, "rescheduling_interval_ms": 100},
    ),
    "d07wf_i100": (
        (*BASE, "waiting_fit"),
        {"rescheduling_neutral_load_threshold": 0.7, "rescheduling_interval_ms": 100},
    ),
    "wfd07_i100_h05": (
        ("waiting_fit", *BASE),
        {
            "rescheduling_neutral_load_threshold": 0.7,
            "rescheduling_interval_ms": 100,
            "rescheduling_waiting_fit_headroom": 0.05,
        },
    ),
    "wfd07_i100_h10": (
        ("waiting_fit", *BASE),
        {
            "rescheduling_neutral_load_threshold": 0.7,
            "rescheduling_interval_ms": 100,
            "rescheduling_waiting_fit_headroom": 0.1,
        },
    ),
    "wf_i100": (("waiting_fit", *BASE), {"rescheduling_interval_ms": 100}),
    # Llumnix's unit scope (no threshold: a unit's highest with its lowest, whatever their loads; the simulated
    # workers share one node, so one unit).
    "unit": (BASE, {"rescheduling_load_balance_scope": "unit"}),
    "unit_t4096": (BASE, {"rescheduling_load_balance_scope": "unit", "rescheduling_req_select_value": 4096}),
}
METRICS = ("ttft_p99_ms", "preemptions", "output_tokens_per_s", "kv_imbalance_p95", "hit_rate", "migrations")


def cell(task: tuple[str, str, float, int, float]) -> dict[str, Any]:
    side, dispatch, load, seed, capacity = task
    conf = SIDES[side]
    r = run_cell(
        Spec("llumnix", N, seed, VOCAB),
        FLEET,
        dispatch,
        None if conf is None else conf[0],
        capacity * load,
        None if conf is None else conf[1],
    )
    return {"side": side, "dispatch": dispatch, "load": load, "seed": seed} | r


def summarize(rows: Sequence[Mapping[str, Any]], sides: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["dispatch"], r["load"]) for r in rows})
    for dispatch, load in keys:
        by_side: dict[str, dict[str, Any]] = {}
        for side in sides:
            runs = sorted((r for r in rows if (r["dispatch"], r["load"], r["side"]) == (dispatch, load, side)),
                          key=lambda r: r["seed"])  # fmt: skip
            if not runs:
                continue
            by_side[side] = {
                "median": {m: spread([r.get(m) for r in runs])["median"] for m in (*METRICS, "migrations_refused")},
                "spread": {m: spread([r.get(m) for r in runs]) for m in (*METRICS, "migrations_refused")},
                "per_seed": {m: [r.get(m) for r in runs] for m in (*METRICS, "migrations_refused")},
                "seeds": [r["seed"] for r in runs],
            }
        verdicts = {}
        for side, s in by_side.items():
            if side != "off" and "off" in by_side:
                v = judge("llumnix", load, by_side["off"]["median"], s["median"], None)
                verdicts[side] = {k: x["status"] for k, x in v.items()}
        out.append({"dispatch": dispatch, "load": load, "sides": by_side, "verdicts": verdicts})
    return out


def pooled(task: tuple[int, Sequence[float], float]) -> dict[str, Any]:
    seed, loads, capacity = task
    w = build(Spec("llumnix", N, seed, VOCAB))
    pf = sim.pooled_fleet(FLEET)
    out: dict[str, Any] = {"seed": seed}
    for load in loads:
        res = sim.replay(w.at_rate(capacity * load), pf, "round_robin", seed)
        p99 = pct(res.ttft_s, 0.99)
        ms = None if p99 is None else round(1000 * p99, 1)
        out[f"{load:g}"] = {"ttft_p99_ms": ms, "preemptions": res.preemptions}
    return out


class Recorder:
    """A rescheduler that moves nothing: every ``interval_s`` it records the fleet (``where``'s docstring)."""

    interval_s = 0.1

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.records: list[dict[str, Any]] = []
        self._last_preempt: dict[int, int] = {}

    def cycle(
        self, now_s: float, fleet: FleetSnapshot, running: Mapping[int, Sequence[RunningRequest]]
    ) -> Sequence[Migration]:
        bs = self.block_size
        workers = []
        for iid in sorted(fleet.instances):
            inst = fleet.instances[iid]
            if inst.load is None:
                continue
            s = inst.load.snapshot
            pre = s.num_preemptions - self._last_preempt.get(iid, 0)
            self._last_preempt[iid] = s.num_preemptions
            held = [-(-(r.prompt_tokens + r.output_tokens) // bs) for r in running.get(iid, ()) if not r.waiting]
            workers.append({
                "iid": iid, "total": s.num_total_blocks, "active": s.num_active_blocks, "preempted": pre,
                "waiting_blocks": -(-s.num_waiting_prefill_tokens // bs), "num_waiting": s.num_waiting, "held": held,
            })  # fmt: skip
        self.records.append({"now_s": now_s, "workers": workers})
        return ()


def granularity_floor(workers: Sequence[Mapping[str, Any]]) -> float:
    """The imbalance left by placing every listed request's blocks whole, longest first, onto the emptiest worker
    (the blocks the list does not account for, e.g. prompts mid-prefill, spread evenly first)."""
    n = len(workers)
    total = workers[0]["total"]
    listed = [b for w in workers for b in w["held"]]
    rest = max(0, sum(w["active"] for w in workers) - sum(listed))
    bins = [rest / n] * n
    for b in sorted(listed, reverse=True):
        i = min(range(n), key=bins.__getitem__)
        bins[i] += b
    return (max(bins) - min(bins)) / total


class _Ticks:
    """``replay``'s observer: each load-report tick's workers, as ``Recorder`` keeps them (no request lists)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.records: list[dict[str, Any]] = []
        self._last_preempt: list[int] = []

    def __call__(self, s: Sample) -> None:
        if not s.loads:
            return
        if len(self._last_preempt) != len(s.loads):
            self._last_preempt = [0] * len(s.loads)
        workers = []
        for i, x in enumerate(s.loads):
            workers.append({
                "iid": i, "total": x.num_total_blocks, "active": x.num_active_blocks,
                "preempted": x.num_preemptions - self._last_preempt[i],
                "waiting_blocks": -(-x.num_waiting_prefill_tokens // self.block_size), "num_waiting": x.num_waiting,
            })  # fmt: skip
            self._last_preempt[i] = x.num_preemptions
        self.records.append({"now_s": s.now_s, "workers": workers})


def _analyse(records: Sequence[Mapping[str, Any]], q2: float, last: float, floor: bool) -> dict[str, Any]:
    """Preemptions by the fleet's KV use and by spare blocks elsewhere; imbalance P95 by phase (and the granularity
    floor's, with request lists)."""
    by_use = {"<0.80": 0, "0.80-0.90": 0, "0.90-0.95": 0, "0.95-0.98": 0, ">=0.98": 0}
    by_spare = {"no spare elsewhere": 0, "spare < 64 blocks": 0, "spare 64-255": 0, "spare >= 256": 0}
    spare_at: list[int] = []
    imb: dict[str, list[float]] = {"all": [], "steady": [], "drain": []}
    flo: dict[str, list[float]] = {"all": [], "steady": [], "drain": []}
    for r in records:
        ws = r["workers"]
        if not ws:
            continue
        uses = [x["active"] / x["total"] for x in ws]
        if any(x["active"] or x["num_waiting"] for x in ws):
            phase = "steady" if q2 <= r["now_s"] <= last else ("drain" if r["now_s"] > last else None)
            f = granularity_floor(ws) if floor else 0.0
            for key in ("all", phase):
                if key is not None:
                    imb[key].append(kv_spread(uses))
                    flo[key].append(f)
        fleet_use = sum(x["active"] for x in ws) / sum(x["total"] for x in ws)
        for x in ws:
            k = x["preempted"]
            if not k:
                continue
            bucket = ("<0.80" if fleet_use < 0.8 else "0.80-0.90" if fleet_use < 0.9 else "0.90-0.95"
                      if fleet_use < 0.95 else "0.95-0.98" if fleet_use < 0.98 else ">=0.98")  # fmt: skip
            by_use[bucket] += k
            spare = sum(max(0, y["total"] - y["active"] - y["waiting_blocks"]) for y in ws if y["iid"] != x["iid"])
            spare_at.extend([spare] * k)
            sb = ("no spare elsewhere" if spare == 0 else "spare < 64 blocks" if spare < 64 else "spare 64-255"
                  if spare < 256 else "spare >= 256")  # fmt: skip
            by_spare[sb] += k
    out: dict[str, Any] = {
        "preemptions_by_fleet_kv_use": by_use,
        "preemptions_by_spare_elsewhere": by_spare,
        "spare_elsewhere_median_blocks": statistics.median(spare_at) if spare_at else None,
        "imbalance_p95": {k: pct(v, 0.95) for k, v in imb.items()},
        "imbalance_ticks": {k: len(v) for k, v in imb.items()},
    }
    if floor:
        out["granularity_floor_p95"] = {k: pct(v, 0.95) for k, v in flo.items()}
    return out


def where(args: argparse.Namespace) -> dict[str, Any]:
    conf = SIDES[args.side]
    w = build(Spec("llumnix", N, args.seed, VOCAB)).at_rate(args.capacity * args.load)
    arrivals = [r.arrival_s for r in w.requests]
    q2, last = arrivals[len(arrivals) // 4], arrivals[-1]
    resched = None
    if conf is not None:
        resched = PolicyRescheduler(
            ReschedulerConfig(
                enable_rescheduling=True, rescheduling_policies=[Policy(p) for p in conf[0]], **dict(conf[1])
            )
        )
    ticks = _Ticks(FLEET.engine.block_size)
    res = sim.replay(w, FLEET, args.dispatch, args.seed, observer=ticks, rescheduler=resched)
    out: dict[str, Any] = {
        "side": args.side, "dispatch": args.dispatch, "load": args.load, "seed": args.seed,
        "run": {"ttft_p99_ms": round(1000 * (pct(res.ttft_s, 0.99) or 0), 1), "preemptions": res.preemptions,
                "migrations": res.migrations, "migrations_refused": res.migrations_refused},
        "window_s": {"steady_from": round(q2, 1), "last_arrival": round(last, 1)},
    } | _analyse(ticks.records, q2, last, floor=False)  # fmt: skip
    if conf is None:
        # The granularity floor needs each worker's requests: a recorder in the rescheduler's place (moves nothing;
        # the replay is the same, as the figures beside the run's show).
        rec = Recorder(FLEET.engine.block_size)
        rr = sim.replay(w, FLEET, args.dispatch, args.seed, rescheduler=rec)
        out["recorded"] = {"ttft_p99_ms": round(1000 * (pct(rr.ttft_s, 0.99) or 0), 1), "preemptions": rr.preemptions}
        a = _analyse(rec.records, q2, last, floor=True)
        out["granularity_floor_p95"] = a["granularity_floor_p95"]
        out["recorded_imbalance_p95"] = a["imbalance_p95"]
    return out


def _n(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(m: Mapping[str, Any], off: Mapping[str, Any] | None, side: str, k: str) -> str:
    if off is None or side == "off" or not off["median"][k] or m[k] is None:
        return ""
    return f"{m[k] / off['median'][k]:.2f}"


def table(paths: Sequence[str], sides: Sequence[str]) -> str:
    """Markdown rows from ``cells``' JSON lines in ``paths`` (a later line for the same run replaces an earlier
    one): per (dispatch, load, side) the medians over seeds, (min-max) and each seed's preemptions, and the verdicts
    on preemptions and imbalance against off."""
    runs: dict[tuple[str, str, float, int], dict[str, Any]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if "side" in r:
                    runs[r["side"], r["dispatch"], r["load"], r["seed"]] = r
    lines = [
        "| dispatch | load | side | preemptions, median (per seed) | on / off | P95 imbalance (per seed) | on / off | "
        "TTFT p99 ms (per seed) | tok/s | moved | refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summarize(list(runs.values()), sides):
        off = s["sides"].get("off")
        for side, v in s["sides"].items():
            m, ps = v["median"], v["per_seed"]

            verdict = s["verdicts"].get(side, {})
            pre = " / ".join(_n(x, "g") for x in ps["preemptions"])
            imb = " / ".join(_n(x, ".3f") for x in ps["kv_imbalance_p95"])
            ttft = " / ".join(_n(x, ".0f") for x in ps["ttft_p99_ms"])
            met_p = "**met**" if verdict.get("preemptions") == "met" else ""
            met_i = "**met**" if verdict.get("kv_imbalance_p95") == "met" else ""
            lines.append(
                f"| {s['dispatch']} | {s['load']:g} | {side} | {_n(m['preemptions'], 'g')} ({pre}) "
                f"| {_ratio(m, off, side, 'preemptions')} {met_p} | {_n(m['kv_imbalance_p95'], '.3f')} ({imb}) "
                f"| {_ratio(m, off, side, 'kv_imbalance_p95')} {met_i} | {_n(m['ttft_p99_ms'], '.0f')} ({ttft}) "
                f"| {_n(m['output_tokens_per_s'], '.0f')} | {_n(m['migrations'], 'g')} "
                f"| {_n(m['migrations_refused'], 'g')} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("cells", "pooled", "where", "table"))
    p.add_argument("files", nargs="*", help="table: JSON lines of cells runs")
    p.add_argument("--sides", default="off,defaults,d07,d07wf", help=f"cells: of {', '.join(SIDES)}")
    p.add_argument("--side", default="off", help="where: the side")
    p.add_argument("--seeds", default="3,4,5")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--loads", default="0.8,1.0")
    p.add_argument("--load", type=float, default=1.0)
    p.add_argument("--dispatch", default="least_loaded,kv")
    p.add_argument("--capacity", type=float, default=CAPACITY)
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    if args.part == "table":
        print(table(args.files, args.sides.split(",")))
        return
    if args.part == "where":
        print(json.dumps(where(args)), flush=True)
        return
    ctx = multiprocessing.get_context("fork")
    if args.part == "pooled":
        with ctx.Pool(args.jobs) as pool:
            for r in pool.imap(pooled, [(s, loads, args.capacity) for s in seeds]):
                print(json.dumps(r), flush=True)
        return
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"unknown sides {unknown}; known: {', '.join(SIDES)}")
    tasks = [(side, d, load, s, args.capacity) for load in loads for d in args.dispatch.split(",") for side in sides
             for s in seeds]  # fmt: skip
    rows = []
    with ctx.Pool(args.jobs) as pool:
        for r in pool.imap(cell, tasks):
            rows.append(r)
            print(json.dumps(r), flush=True)
    for s in summarize(rows, sides):
        print(json.dumps({"summary": s}), flush=True)


if __name__ == "__main__":
    main()
