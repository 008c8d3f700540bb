"""``kvmesh status``: every registered instance of a namespace (or all), from etcd."""

from __future__ import annotations

import argparse
import asyncio
import json

from components.runtime import Runtime, RuntimeConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default="", help="only this namespace (default: every namespace)")
    p.add_argument("--etcd", default=None, help="etcd endpoint (default: $KVMESH_ETCD_ENDPOINTS or 127.0.0.1:2379)")
    p.add_argument("--nats", default=None, help="NATS URL (default: $KVMESH_NATS_URL or 127.0.0.1:4222)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


async def _list(args: argparse.Namespace) -> list[dict[str, object]]:
    cfg = RuntimeConfig.from_env(etcd_endpoints=[args.etcd] if args.etcd else None, nats_url=args.nats)
    rt = await Runtime.connect(cfg, name="kvmesh-status")
    try:
        prefix = f"kvmesh/{args.namespace}/instances/" if args.namespace else "kvmesh/"
        listing = await rt.discovery.get_prefix(prefix)
    finally:
        await rt.shutdown()
    rows = []
    for key, value in sorted(listing.items()):
        if "/instances/" not in key:
            continue
        d = json.loads(value)
        rows.append(d)
    return rows


def main(args: argparse.Namespace) -> int:
    rows = asyncio.run(_list(args))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'namespace':<12} {'component':<12} {'endpoint':<10} {'instance':<17} metadata")
    for r in rows:
        meta = json.dumps(r.get("metadata") or {}, sort_keys=True)
        print(f"{r['namespace']:<12} {r['component']:<12} {r['endpoint']:<10} {r['instance_id']:<17x} {meta}")
    return 0
