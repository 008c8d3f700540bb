"""``kvmesh status``: every registered instance (component, id, model, role, load, age), from etcd and the event plane.

Where etcd and NATS are: ``--etcd``/``--nats`` or ``$KVMESH_ETCD_ENDPOINTS``/``$KVMESH_NATS_URL`` if given; otherwise
the live deployments' state files in the state dir (an embedded etcd listens on a port chosen at start, so only the
state file knows it; ``--namespace`` picks one). With neither, nothing is served from here: it says so and exits 0
rather than guess a port.

Each instance is shown with the watcher and pid of the process that runs it (its metadata's pid, matched against
the processes the state files record), so a line of ``kvmesh status`` leads to ``kvmesh logs WATCHER``.

Role is a worker's ``WorkerMetadata.role`` (aggregated, prefill, decode), as ``decode:recompute`` (or
``prefill:recompute``) when its engine cannot move KV and the decode worker recomputes remotely prefilled prompts.
Migration is its ``WorkerMetadata.migration_mode``: how it moves a running request to another worker (``kv_transfer``:
vLLM pulls the KV with NIXL; ``live``: the simulated engine copies it while decoding; ``recompute``: the destination
computes it again), ``-`` where it cannot (a prefill worker, a frontend); ``migration_mode`` in ``--json``.

Load is each worker's latest ``load_metrics`` event heard within ``--load-wait-s`` (workers publish every 100 ms by
default, so 1 s hears every live one); ``-`` when none arrived. Age counts from the ``started_at`` a worker puts in
its metadata when it registers.

Prefill queues (disaggregated serving) are heard in the same window, from the ``PrefillQueueReport``s prefill workers
publish on ``prefill_queue`` (every 100 ms by default): one line per model under the instance table, ``NS: prefill
queue MODEL: W waiting, F in flight, oldest A s, N prefill workers, R redelivered``, with the numbers of the freshest
report that read the queue and the workers alive by ``components.fleet.queues``'s rule (the one frontends'
``/metrics`` use). A model with prefill workers registered and no report heard says so. In ``--json`` (a list of
instance rows, as before) a worker row of a model with a prefill queue carries ``prefill_queue`` (the model's line as
a mapping), and a prefill worker's row ``prefill_report`` (its own last report: ``busy``, ``items_done``, ...).

Pools and the planner: one line per model with workers, ``NS: pools MODEL: decode 2 workers, prefill 1 worker``
(``aggregated`` for a model served without a prefill pool), counted from the registered instances; and, where a
planner runs for the model (its status at ``kvmesh/<ns>/planner/status/<model>``, components/planner/status.py),
``NS: planner MODEL (local connector, metrics URL): ...`` with its last decision, how long ago, each pool's decision
with its reason, the changes in progress and the last change that failed. In ``--json`` a worker row of such a model
carries ``planner`` (that status as the planner published it).

Reschedulers: one line per rescheduler running for a namespace (standalone, or colocated in a frontend; each puts its
status at ``kvmesh/<ns>/rescheduler/status/<lease>``, components/rescheduler/status.py), ``NS: rescheduler
(standalone, every 500 ms, policies ...): N cycles; last cycle #K T ago: POLICY SRC -> DST OUTCOME ...`` with the
last cycle that chose or refused a pair (each pair's outcome and reason, the candidates refused and why) and the
totals by policy. In ``--json`` a worker row of that namespace carries ``reschedulers`` (their statuses as
published).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from components.deploy.errors import DeployError
from components.deploy.state import ServeState, live_states, resolve_state_dir
from components.fleet.queues import PrefillQueues, PrefillQueueView, parse_report
from components.planner.status import status_prefix
from components.protocol.endpoints import TOPIC_LOAD_METRICS, TOPIC_PREFILL_QUEUE
from components.protocol.messages import LoadSnapshot
from components.protocol.metadata import RemotePrefillMode, WorkerMetadata, WorkerRole
from components.rescheduler.status import status_prefix as rescheduler_status_prefix
from components.runtime import EventSubscription, InstanceInfo, Runtime, RuntimeConfig, RuntimeMeshError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default="", help="only this namespace (default: every namespace)")
    p.add_argument(
        "--etcd", default=None, help="etcd endpoint (default: $KVMESH_ETCD_ENDPOINTS, a state file, 127.0.0.1:2379)"
    )
    p.add_argument("--nats", default=None, help="NATS URL (default: $KVMESH_NATS_URL, a state file, 127.0.0.1:4222)")
    p.add_argument(
        "--state-dir", default=None, help="where kvmesh serve keeps state files (default: $KVMESH_STATE_DIR or ./state)"
    )
    p.add_argument(
        "--load-wait-s",
        type=float,
        default=1.0,
        help="how long to listen for load metrics and prefill queue reports (0: skip)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


class NothingServedError(DeployError):
    """No endpoints were given and no live deployment's state file names any: there is nothing to ask."""

    exit_code = 0


def targets(args: argparse.Namespace) -> list[tuple[RuntimeConfig, list[str]]]:
    """(where to connect, namespaces to show there; empty: all) for each etcd/NATS pair to ask."""
    explicit = args.etcd or args.nats or os.environ.get("KVMESH_ETCD_ENDPOINTS") or os.environ.get("KVMESH_NATS_URL")
    namespaces = [args.namespace] if args.namespace else []
    if not explicit:
        found: dict[tuple[tuple[str, ...], str], list[str]] = {}
        state_dir = resolve_state_dir(args.state_dir)
        for st in live_states(state_dir):
            if not args.namespace or st.namespace == args.namespace:
                found.setdefault((tuple(st.etcd_endpoints), st.nats_url), []).append(st.namespace)
        if not found:
            what = f"namespace {args.namespace!r} is not" if args.namespace else "nothing is"
            raise NothingServedError(
                f"{what} served from {state_dir} (no live kvmesh serve there); to ask an etcd directly, give "
                "--etcd URL (and --nats URL for load), or set KVMESH_ETCD_ENDPOINTS"
            )
        return [
            (RuntimeConfig(etcd_endpoints=list(etcd), nats_url=nats), namespaces or nss)
            for (etcd, nats), nss in found.items()
        ]
    cfg = RuntimeConfig.from_env(etcd_endpoints=[args.etcd] if args.etcd else None, nats_url=args.nats)
    return [(cfg, namespaces)]


class Heard:
    """What the event plane said within the listening window: each worker's latest load, and each namespace's
    prefill queue reports (``PrefillQueues``, read at ``now_s`` on the same monotonic clock)."""

    def __init__(self) -> None:
        self.loads: dict[tuple[str, int], dict[str, Any]] = {}
        self.queues: dict[str, PrefillQueues] = {}
        self.now_s = 0.0
        self.listened = False  # False: --load-wait-s 0, or nothing registered to listen for

    def queue_views(self) -> dict[str, list[PrefillQueueView]]:
        return {ns: q.views(self.now_s) for ns, q in sorted(self.queues.items())}

    def prefill_reports(self) -> dict[tuple[str, int], dict[str, Any]]:
        out = {}
        for ns, q in self.queues.items():
            for iid in q.sources():
                report = q.latest(iid)
                if report is not None:
                    out[(ns, iid)] = report.to_dict()
        return out


async def collect(
    cfg: RuntimeConfig,
    namespaces: Sequence[str],
    load_wait_s: float,
    reschedulers: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per instance id: its endpoints, metadata, latest load and age; one row per prefill queue heard; one
    planner status per (namespace, model) a planner publishes). Given ``reschedulers``, the reschedulers' published
    statuses are appended to it (and attached to the worker rows of their namespace)."""
    rt = await Runtime.connect(cfg, name="kvmesh-status")
    try:
        prefixes = [f"kvmesh/{ns}/instances/" for ns in namespaces] or ["kvmesh/"]
        infos: list[InstanceInfo] = []
        for prefix in prefixes:
            listing = await rt.discovery.get_prefix(prefix)
            infos += [InstanceInfo.from_json(v) for k, v in sorted(listing.items()) if "/instances/" in k]
        planners: list[dict[str, Any]] = []
        for ns in sorted(set(namespaces) | {i.namespace for i in infos}):
            listing = await rt.discovery.get_prefix(status_prefix(ns))
            planners += planner_rows_of(ns, listing.values())
            if reschedulers is not None:
                listing = await rt.discovery.get_prefix(rescheduler_status_prefix(ns))
                reschedulers += rescheduler_rows_of(ns, listing.values())
        heard = await _listen(rt, sorted({i.namespace for i in infos}), load_wait_s) if infos else Heard()
    finally:
        await rt.shutdown(drain_timeout_s=1.0)
    rows = rows_of(infos, heard.loads, time.time(), heard.prefill_reports())
    queues = queue_rows_of(rows, heard.queue_views(), heard.listened)
    attach_queues(rows, queues)
    attach_planners(rows, planners)
    if reschedulers:
        attach_reschedulers(rows, reschedulers)
    return rows, queues, planners


def rescheduler_rows_of(namespace: str, values: Any) -> list[dict[str, Any]]:
    """The reschedulers' published statuses (JSON) in ``namespace``; unreadable values are skipped."""
    out = []
    for raw in values:
        with contextlib.suppress(ValueError, TypeError):
            row = json.loads(raw)
            if isinstance(row, dict) and "num_cycles" in row:
                out.append({**row, "namespace": namespace})
    return sorted(out, key=lambda r: (str(r.get("where", "")), str(r.get("walltime", ""))))


def attach_reschedulers(rows: Sequence[dict[str, Any]], reschedulers: Sequence[Mapping[str, Any]]) -> None:
    """Give each worker row the statuses of the reschedulers of its namespace (``reschedulers``) for ``--json``."""
    for r in rows:
        mine = [dict(x) for x in reschedulers if x["namespace"] == r["namespace"]]
        if r.get("role") and mine:
            r["reschedulers"] = mine


def format_rescheduler(p: Mapping[str, Any], now: float) -> str:
    """One rescheduler's status as a line: where it runs, its last cycle that chose or refused a pair (each pair
    with its outcome and reason, the refused candidates), the last that ran pairs when that is an earlier one, its
    totals by policy, and (with prefix_replication) its copies and drops by outcome and its last cycle's."""
    policies = ", ".join(str(x) for x in p.get("policies") or []) or "-"
    extra = f", metrics {p['metrics_url']}" if p.get("metrics_url") else ""
    interval = p.get("interval_ms")
    every = f"every {interval:g} ms, " if isinstance(interval, int | float) else ""
    head = f"{p['namespace']}: rescheduler ({p.get('where', '?')}, {every}policies {policies}{extra}):"
    parts = [f"{p.get('num_cycles', 0)} cycles"]
    last = p.get("last_cycle")
    if last:
        parts.append(_cycle_text("last cycle", last, now))
        moved = p.get("last_pairs_cycle")
        if moved and moved.get("number") != last.get("number"):
            parts.append(_cycle_text("last pairs", moved, now))
    else:
        parts.append("no pair chosen yet")
    totals = p.get("totals") or {}
    if totals:
        parts.append(
            "totals "
            + ", ".join(
                f"{policy} {c.get('committed', 0)} committed/{c.get('attempted', 0)} attempted"
                + (f" ({c['failed']} failed)" if c.get("failed") else "")
                + (f" ({c['timed_out']} timed out)" if c.get("timed_out") else "")
                for policy, c in totals.items()
            )
        )
    prefix = p.get("prefix_replication")
    if prefix:
        parts.append(_prefix_text(prefix))
    return f"{head} " + "; ".join(parts)


def _prefix_text(prefix: Mapping[str, Any]) -> str:
    """prefix_replication's totals by kind and outcome, then its last cycle's copies and drops."""
    totals = prefix.get("totals") or {}
    counts = [
        f"{kind} " + (", ".join(f"{n} {outcome}" for outcome, n in (totals.get(kind) or {}).items()) or "none")
        for kind in ("copy", "drop")
    ]
    text = "prefix replication: " + ", ".join(counts)
    last = prefix.get("last_cycle")
    if last:
        acts = [
            f"{a['kind']} {a['prefix']} ({a['num_blocks']} blocks) "
            f"{'-' if a.get('source') is None else format(int(a['source']), 'x')} -> {int(a['destination']):x} "
            f"{a['outcome']} ({a['detail']})"
            for a in last.get("prefix_actions", [])
        ]
        text += f"; last #{last.get('number', '?')}: " + "; ".join(acts)
    return text


def _cycle_text(what: str, cycle: Mapping[str, Any], now: float) -> str:
    """One recorded cycle: its pairs with their outcomes and reasons, then the candidates refused."""
    when = cycle.get("walltime")
    ago = f" {format_age(max(0.0, now - when))} ago" if isinstance(when, int | float) else ""
    pairs = [
        f"{x['policy']} {int(x['source']):x} -> {int(x['destination']):x} {x['outcome']}"
        f" ({x['committed']} committed, {x['aborted']} aborted{', ' + x['error'] if x.get('error') else ''})"
        + (f" [{x['reason']}]" if x.get("reason") else "")
        for x in cycle.get("pairs", [])
    ]
    rejected = [
        f"{x['policy']} {int(x['source']):x} -> "
        f"{'-' if x.get('destination') is None else format(int(x['destination']), 'x')}: {x['reason']}"
        for x in cycle.get("rejected", [])
    ]
    text = f"{what} #{cycle.get('number', '?')}{ago}: " + ("; ".join(pairs) or "no pair")
    return text + ("; refused " + "; ".join(rejected) if rejected else "")


def planner_rows_of(namespace: str, values: Any) -> list[dict[str, Any]]:
    """The planners' published statuses (JSON), each with its namespace; unreadable values are skipped."""
    out = []
    for raw in values:
        with contextlib.suppress(ValueError, TypeError):
            row = json.loads(raw)
            if isinstance(row, dict) and row.get("model"):
                out.append({"namespace": namespace, **row})
    return sorted(out, key=lambda r: str(r["model"]))


def attach_planners(rows: Sequence[dict[str, Any]], planners: Sequence[Mapping[str, Any]]) -> None:
    """Give each worker row of a model a planner scales that planner's status (``planner``) for ``--json``."""
    by_model = {(p["namespace"], p["model"]): dict(p) for p in planners}
    for r in rows:
        if r.get("role") and (r["namespace"], r["model"]) in by_model:
            r["planner"] = by_model[(r["namespace"], r["model"])]


def pool_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per (namespace, model) with workers: the size of each pool, from the registered instances."""
    pools: dict[tuple[str, str], dict[str, int]] = {}
    for r in rows:
        role = r.get("role")
        if not role or not r.get("model"):
            continue
        counts = pools.setdefault((r["namespace"], r["model"]), {})
        counts[role] = counts.get(role, 0) + 1
    out = []
    for (ns, model), counts in sorted(pools.items()):

        def n(k: str, c: Mapping[str, int] = counts) -> str:
            return f"{k} {c[k]} worker{'' if c[k] == 1 else 's'}"

        parts = [n(k) for k in (WorkerRole.AGGREGATED, WorkerRole.DECODE, WorkerRole.PREFILL) if k in counts]
        out.append(f"{ns}: pools {model}: {', '.join(parts)}")
    return out


def format_planner(p: Mapping[str, Any], now: float) -> str:
    """One planner's status as a line: its last decision (how long ago), each pool's with its reason, what is
    changing and the last change that failed."""
    extra = f", metrics {p['metrics_url']}" if p.get("metrics_url") else ""
    noop = ", no-operation" if p.get("no_operation") else ""
    mode = f"{p.get('mode', 'load')} mode, "
    head = f"{p['namespace']}: planner {p['model']} ({mode}{p.get('connector', '?')} connector{noop}{extra}):"
    parts = []
    last = p.get("last_decision")
    if last:
        when = last.get("walltime")
        ago = f" {format_age(max(0.0, now - when))} ago" if isinstance(when, int | float) else ""
        summaries = "; ".join(str(d.get("summary", "")) for d in last.get("decisions", []))
        parts.append(f"last decision{ago}: {summaries or '-'}")
        if last.get("note"):
            parts.append(f"note: {last['note']}")
    else:
        parts.append("no decision yet (the first comes one adjustment interval after it started)")
    sla = p.get("sla") or {}
    if sla:
        parts.append(_sla_numbers(sla))
    changing = p.get("changes_in_progress") or {}
    if changing:
        parts.append("changing " + ", ".join(f"{pool} {c['from']} -> {c['to']}" for pool, c in changing.items()))
    if p.get("last_change_error"):
        parts.append(f"last failed change: {p['last_change_error']}")
    return f"{head} " + "; ".join(parts)


def _sla_numbers(sla: Mapping[str, Any]) -> str:
    """The SLA planner's numbers behind its decisions: load observed and predicted, TTFT/ITL observed and
    predicted (ms), the correction factors, and each pool's throughput size against its target."""

    def num(key: str, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
        v = sla.get(key)
        return fmt.format(v * scale) if isinstance(v, int | float) else "-"

    return (
        f"load {num('observed_request_rate')} req/s (predicted {num('predicted_request_rate')}, next "
        f"{num('next_request_rate')}), TTFT {num('observed_ttft_s', 1e3)} ms observed / "
        f"{num('predicted_ttft_s', 1e3)} ms predicted, ITL {num('observed_itl_s', 1e3)} / "
        f"{num('predicted_itl_s', 1e3)} ms, corrections TTFT x{num('ttft_correction')} ITL x{num('itl_correction')}, "
        f"decode {num('throughput_decode', fmt='{:.0f}')} -> target {num('target_decode', fmt='{:.0f}')}, "
        f"prefill {num('throughput_prefill', fmt='{:.0f}')} -> target {num('target_prefill', fmt='{:.0f}')}"
    )


def rows_of(
    infos: Sequence[InstanceInfo],
    loads: Mapping[tuple[str, int], dict[str, Any]],
    now: float,
    prefill_reports: Mapping[tuple[str, int], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per instance id (its endpoints gathered), from what discovery lists and the loads heard; a prefill
    worker's row also carries its last prefill queue report (``prefill_report``, None when none was heard)."""
    prefill_reports = prefill_reports or {}
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for info in infos:
        meta = WorkerMetadata.from_dict(info.metadata)
        key = (info.namespace, info.component, info.instance_id)
        row = rows.setdefault(
            key,
            {
                "namespace": info.namespace,
                "component": info.component,
                "instance_id": f"{info.instance_id:x}",
                "endpoints": [],
                "model": meta.model or None,
                # Workers only: a frontend or router registers no role (WorkerMetadata would read it as aggregated).
                "role": str(meta.role) if "role" in info.metadata else None,
                "remote_prefill_mode": meta.remote_prefill_mode or None,
                # How it moves a running request (kv_transfer, live, recompute); None where it cannot.
                "migration_mode": meta.migration_mode or None,
                "metadata": dict(info.metadata),
                "pid": meta.pid or None,
                "watcher": None,
                "load": loads.get((info.namespace, info.instance_id)),
                "age_s": _age(meta.started_at or None, now),
            },
        )
        if row["role"] == WorkerRole.PREFILL:
            row["prefill_report"] = prefill_reports.get((info.namespace, info.instance_id))
        row["endpoints"].append(info.endpoint)
    return list(rows.values())


def queue_rows_of(
    rows: Sequence[Mapping[str, Any]], views: Mapping[str, Sequence[PrefillQueueView]], listened: bool
) -> list[dict[str, Any]]:
    """One row per (namespace, model) with a prefill queue: every model a report was heard for, and, when we
    listened, every model with prefill workers registered but silent (``heard: False``: all numbers None)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for ns, vs in views.items():
        for v in vs:
            out[(ns, v.model)] = {"namespace": ns, "heard": True, **v.to_dict()}
    if listened:
        for r in rows:
            key = (r["namespace"], r["model"])
            if r.get("role") == WorkerRole.PREFILL and r["model"] and key not in out:
                out[key] = {"namespace": key[0], "heard": False, **PrefillQueueView(key[1], 0).to_dict()}
    return [out[k] for k in sorted(out)]


def attach_queues(rows: Sequence[dict[str, Any]], queues: Sequence[Mapping[str, Any]]) -> None:
    """Give each worker row of a model with a prefill queue that queue's row (``prefill_queue``) for ``--json``."""
    by_model = {(q["namespace"], q["model"]): dict(q) for q in queues}
    for r in rows:
        if r.get("role") and (r["namespace"], r["model"]) in by_model:
            r["prefill_queue"] = by_model[(r["namespace"], r["model"])]


async def _listen(rt: Runtime, namespaces: list[str], wait_s: float) -> Heard:
    """Load metrics and prefill queue reports of ``namespaces``, heard for ``wait_s`` (both in the same window)."""
    heard = Heard()
    if wait_s <= 0:
        return heard
    subs: list[tuple[str, str, EventSubscription[Any]]] = []
    try:
        for ns in namespaces:
            for topic in (TOPIC_LOAD_METRICS, TOPIC_PREFILL_QUEUE):
                subs.append((ns, topic, await rt.namespace(ns).events.subscribe(topic, max_pending=100_000)))
        heard.listened = True

        async def drain(ns: str, topic: str, sub: EventSubscription[Any], deadline: float) -> None:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    ev = await sub.get(timeout_s=left)
                except TimeoutError:
                    return
                if topic == TOPIC_PREFILL_QUEUE:
                    report = parse_report(ev.payload)  # None: not a PrefillQueueReport, not shown
                    if report is not None:
                        heard.queues.setdefault(ns, PrefillQueues()).apply(ev.source_id, report, time.monotonic())
                    continue
                with contextlib.suppress(KeyError, TypeError):  # a payload that is not a LoadSnapshot: no load shown
                    heard.loads[(ns, ev.source_id)] = LoadSnapshot.from_dict(ev.payload).to_dict()

        deadline = time.monotonic() + wait_s
        await asyncio.gather(*(drain(ns, topic, sub, deadline) for ns, topic, sub in subs))
        heard.now_s = time.monotonic()
        return heard
    finally:
        for _, _, sub in subs:
            await sub.close()


def _age(started_at: Any, now: float) -> float | None:
    return max(0.0, now - started_at) if isinstance(started_at, int | float) else None


def format_age(age_s: float | None) -> str:
    if age_s is None:
        return "-"
    s = int(age_s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_load(load: dict[str, Any] | None) -> str:
    if not load:
        return "-"
    return f"kv {load['kv_usage'] * 100:.0f}% run {load['num_running']} wait {load['num_waiting']}"


def format_role(role: str | None, remote_prefill_mode: str | None = None) -> str:
    """A worker's role, with how its engine takes remote prefills when that is recompute (no KV is transferred: the
    decode worker computes the prompt again, which an operator reading TTFT needs to know); ``-`` for non-workers."""
    if not role:
        return "-"
    return f"{role}:{remote_prefill_mode}" if remote_prefill_mode == RemotePrefillMode.RECOMPUTE else role


def format_queue(q: Mapping[str, Any]) -> str:
    """One prefill queue row as a line: ``NS: prefill queue MODEL: 3 waiting, 1 in flight, oldest 0.4 s, 2 prefill
    workers, 0 redelivered``."""
    head = f"{q['namespace']}: prefill queue {q['model']}:"
    if not q.get("heard", True):
        return f"{head} no report heard from its prefill workers"
    workers = f"{q['prefill_workers']} prefill worker{'' if q['prefill_workers'] == 1 else 's'}"
    if q["waiting"] is None:
        why = f" ({q['stats_error']})" if q.get("stats_error") else ""
        return f"{head} depth unknown{why}, {workers}"
    return (
        f"{head} {q['waiting']} waiting, {q['in_flight']} in flight, oldest {q['oldest_age_s']:.1f} s, "
        f"{workers}, {q['redelivered']} redelivered"
    )


def attach_watchers(rows: list[dict[str, Any]], states: Sequence[ServeState]) -> None:
    """Fill each row's ``watcher`` from the state files: the watcher whose process has the row's pid."""
    by_pid = {(st.namespace, p.pid): w.name for st in states for w in st.watchers for p in w.processes}
    for r in rows:
        if r.get("pid"):
            r["watcher"] = by_pid.get((r["namespace"], r["pid"]))


def render_table(rows: list[dict[str, Any]]) -> str:
    # ROLE after PID: scripts (and tests/e2e) read the first seven columns by position. MIGRATION: how the worker
    # moves a running request (kv_transfer, live, recompute; - where it cannot).
    header = (
        "NAMESPACE",
        "COMPONENT",
        "INSTANCE",
        "MODEL",
        "WATCHER",
        "PID",
        "ROLE",
        "MIGRATION",
        "ENDPOINTS",
        "LOAD",
        "AGE",
    )
    table = [header] + [
        (
            r["namespace"],
            r["component"],
            r["instance_id"],
            str(r["model"] or "-"),
            str(r.get("watcher") or "-"),
            str(r.get("pid") or "-"),
            format_role(r.get("role"), r.get("remote_prefill_mode")),
            str(r.get("migration_mode") or "-"),
            ",".join(sorted(r["endpoints"])),
            format_load(r["load"]),
            format_age(r["age_s"]),
        )
        for r in sorted(rows, key=lambda r: (r["namespace"], r["component"], r.get("pid") or 0, r["instance_id"]))
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)


async def _run(
    args: argparse.Namespace, reschedulers: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    queues: list[dict[str, Any]] = []
    planners: list[dict[str, Any]] = []
    for cfg, namespaces in targets(args):
        more_rows, more_queues, more_planners = await collect(cfg, namespaces, args.load_wait_s, reschedulers)
        rows += more_rows
        queues += more_queues
        planners += more_planners
    attach_watchers(rows, live_states(resolve_state_dir(args.state_dir)))
    return rows, queues, planners


def main(args: argparse.Namespace) -> int:
    reschedulers: list[dict[str, Any]] = []
    try:
        rows, queues, planners = asyncio.run(_run(args, reschedulers))
    except NothingServedError as e:
        print(f"kvmesh status: {e}")
        return e.exit_code
    except DeployError as e:
        print(f"kvmesh status: {e}", file=sys.stderr)
        return e.exit_code
    except RuntimeMeshError as e:  # etcd or NATS unreachable: say where we looked
        print(f"kvmesh status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows))
    else:
        print(render_table(rows))
        print(f"{len(rows)} instances")
        for line in pool_lines(rows):
            print(line)
        now = time.time()
        for p in planners:
            print(format_planner(p, now))
        for r in reschedulers:
            print(format_rescheduler(r, now))
        for q in queues:
            print(format_queue(q))
        states = [st for st in live_states(resolve_state_dir(args.state_dir)) if args.namespace in ("", st.namespace)]
        for line in server_lines(states):
            print(line)
    return 0


def server_lines(states: Sequence[ServeState]) -> list[str]:
    """One line per embedded server of each live deployment: where it is, and how often serve restarted it."""
    out = []
    for st in states:
        for name, server in (("etcd", st.embedded_etcd), ("nats", st.embedded_nats)):
            if server is None:
                continue
            line = f"{st.namespace}: embedded {name} {server.endpoint}"
            line += f" pid {server.process.pid}" if server.process else " (not running)"
            if server.restarts:
                times = "once" if server.restarts == 1 else f"{server.restarts} times"
                line += f", restarted {times} (last exit: {server.last_exit})"
            out.append(line)
    return out
