"""``kvmesh status``: every registered instance (component, id, model, role, load, age), from etcd and the event plane.

Where etcd and NATS are: ``--etcd``/``--nats`` or ``$KVMESH_ETCD_ENDPOINTS``/``$KVMESH_NATS_URL`` if given; otherwise
the live deployments' state files in the state dir (an embedded etcd listens on a port chosen at start, so only the
state file knows it; ``--namespace`` picks one). With neither, nothing is served from here: it says so and exits 0
rather than guess a port.

Each instance is shown with the watcher and pid of the process that runs it (its metadata's pid, matched against
the processes the state files record), so a line of ``kvmesh status`` leads to ``kvmesh logs WATCHER``.

Role is a worker's ``WorkerMetadata.role`` (aggregated, prefill, decode), as ``decode:recompute`` (or
``prefill:recompute``) when its engine cannot move KV and the decode worker recomputes remotely prefilled prompts.

Load is each worker's latest ``load_metrics`` event heard within ``--load-wait-s`` (workers publish every 100 ms by
default, so 1 s hears every live one); ``-`` when none arrived. Age counts from the ``started_at`` a worker puts in
its metadata when it registers.
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
from components.protocol.endpoints import TOPIC_LOAD_METRICS
from components.protocol.messages import LoadSnapshot
from components.protocol.metadata import RemotePrefillMode, WorkerMetadata
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
    p.add_argument("--load-wait-s", type=float, default=1.0, help="how long to listen for load metrics (0: skip)")
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


async def collect(cfg: RuntimeConfig, namespaces: Sequence[str], load_wait_s: float) -> list[dict[str, Any]]:
    """One row per instance id: its endpoints, metadata, latest load and age."""
    rt = await Runtime.connect(cfg, name="kvmesh-status")
    try:
        prefixes = [f"kvmesh/{ns}/instances/" for ns in namespaces] or ["kvmesh/"]
        infos: list[InstanceInfo] = []
        for prefix in prefixes:
            listing = await rt.discovery.get_prefix(prefix)
            infos += [InstanceInfo.from_json(v) for k, v in sorted(listing.items()) if "/instances/" in k]
        loads = await _latest_loads(rt, sorted({i.namespace for i in infos}), load_wait_s) if infos else {}
    finally:
        await rt.shutdown(drain_timeout_s=1.0)
    return rows_of(infos, loads, time.time())


def rows_of(
    infos: Sequence[InstanceInfo], loads: Mapping[tuple[str, int], dict[str, Any]], now: float
) -> list[dict[str, Any]]:
    """One row per instance id (its endpoints gathered), from what discovery lists and the loads heard."""
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
                "metadata": dict(info.metadata),
                "pid": meta.pid or None,
                "watcher": None,
                "load": loads.get((info.namespace, info.instance_id)),
                "age_s": _age(meta.started_at or None, now),
            },
        )
        row["endpoints"].append(info.endpoint)
    return list(rows.values())


async def _latest_loads(rt: Runtime, namespaces: list[str], wait_s: float) -> dict[tuple[str, int], dict[str, Any]]:
    if wait_s <= 0:
        return {}
    subs: dict[str, EventSubscription[Any]] = {
        ns: await rt.namespace(ns).events.subscribe(TOPIC_LOAD_METRICS, max_pending=100_000) for ns in namespaces
    }
    latest: dict[tuple[str, int], dict[str, Any]] = {}

    async def drain(ns: str, sub: EventSubscription[Any], deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = await sub.get(timeout_s=left)
            except TimeoutError:
                return
            with contextlib.suppress(KeyError, TypeError):  # a payload that is not a LoadSnapshot: no load shown
                latest[(ns, ev.source_id)] = LoadSnapshot.from_dict(ev.payload).to_dict()

    try:
        deadline = time.monotonic() + wait_s
        await asyncio.gather(*(drain(ns, sub, deadline) for ns, sub in subs.items()))
        return latest
    finally:
        for sub in subs.values():
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


def attach_watchers(rows: list[dict[str, Any]], states: Sequence[ServeState]) -> None:
    """Fill each row's ``watcher`` from the state files: the watcher whose process has the row's pid."""
    by_pid = {(st.namespace, p.pid): w.name for st in states for w in st.watchers for p in w.processes}
    for r in rows:
        if r.get("pid"):
            r["watcher"] = by_pid.get((r["namespace"], r["pid"]))


def render_table(rows: list[dict[str, Any]]) -> str:
    # ROLE after PID: scripts (and tests/e2e) read the first six columns by position.
    header = ("NAMESPACE", "COMPONENT", "INSTANCE", "MODEL", "WATCHER", "PID", "ROLE", "ENDPOINTS", "LOAD", "AGE")
    table = [header] + [
        (
            r["namespace"],
            r["component"],
            r["instance_id"],
            str(r["model"] or "-"),
            str(r.get("watcher") or "-"),
            str(r.get("pid") or "-"),
            format_role(r.get("role"), r.get("remote_prefill_mode")),
            ",".join(sorted(r["endpoints"])),
            format_load(r["load"]),
            format_age(r["age_s"]),
        )
        for r in sorted(rows, key=lambda r: (r["namespace"], r["component"], r.get("pid") or 0, r["instance_id"]))
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for cfg, namespaces in targets(args):
        rows += await collect(cfg, namespaces, args.load_wait_s)
    attach_watchers(rows, live_states(resolve_state_dir(args.state_dir)))
    return rows


def main(args: argparse.Namespace) -> int:
    try:
        rows = asyncio.run(_run(args))
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
