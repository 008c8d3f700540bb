"""``kvmesh k8s render|apply|delete GRAPH``: a graph on a Kubernetes cluster (docs/kubernetes.md).

- ``render`` prints the manifests (multi-document YAML) or writes them to ``-o DIR`` (one file per object, named
  ``NN-<kind>-<name>.yaml`` in apply order), without a cluster;
- ``apply`` renders and applies them (server-side apply, idempotent; a worker Deployment that exists keeps its
  replica count unless ``--reset-replicas``) and prints what each object did;
- ``delete`` removes them (a missing object counts as deleted).

etcd and NATS must be external (the graph's infrastructure section, or ``--etcd-endpoints``/``--nats-url``);
credentials from a Secret (``--credentials-secret``). The exit status is 2 for a graph that cannot be rendered, 1 for
an API error, with one readable message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from components.deploy.errors import DeployError
from components.deploy.graph import graph_base_dir, load_graph
from components.deploy.k8s import RenderOptions, render_manifests, to_yaml


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="k8s_command", required=True)
    for name, help_ in (
        ("render", "print the graph's manifests (or write them to -o DIR)"),
        ("apply", "apply the graph's manifests through the API server (server-side apply)"),
        ("delete", "delete the graph's objects"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("graph", help="graph file (graphs/*.yaml)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
        s.add_argument("--k8s-namespace", default="default", help="the Kubernetes namespace of every object")
        s.add_argument("--image", default="kvmesh:latest", help="the image every pod runs (kvmesh and the models)")
        s.add_argument("--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"])
        s.add_argument(
            "--image-root",
            default="/opt/kvmesh",
            help="where the graph's base directory is inside the image: model paths under it are rewritten there",
        )
        s.add_argument("--etcd-endpoints", default="", help="comma-separated etcd endpoints (replace the graph's)")
        s.add_argument("--nats-url", default=None, help="the NATS URL (replaces the graph's)")
        s.add_argument(
            "--credentials-secret",
            default=None,
            help="a Secret with optional keys etcd-username, etcd-password, nats-user, nats-password, nats-token",
        )
        s.add_argument(
            "--frontend-port", type=int, default=8000, help="the frontend's port when the graph's is 0 (a free one)"
        )
        if name == "render":
            s.add_argument("-o", "--output", default=None, help="write one file per object into this directory")
        else:
            s.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
            s.add_argument("--context", default=None, help="kubeconfig context")
        if name == "apply":
            s.add_argument(
                "--reset-replicas",
                action="store_true",
                help="set existing worker Deployments back to the graph's replicas (default: keep the live count)",
            )
    p.set_defaults(run=main)


def _render(args: argparse.Namespace) -> list[dict]:  # type: ignore[type-arg]
    path = Path(args.graph)
    graph = load_graph(path, args.overrides)
    options = RenderOptions(
        image=args.image,
        k8s_namespace=args.k8s_namespace,
        image_pull_policy=args.image_pull_policy,
        image_root=args.image_root,
        etcd_endpoints=tuple(e.strip() for e in args.etcd_endpoints.split(",") if e.strip()),
        nats_url=args.nats_url,
        credentials_secret=args.credentials_secret,
        frontend_port=args.frontend_port,
    )
    return render_manifests(graph, path.read_text(encoding="utf-8"), graph_base_dir(path, graph), options)


async def _apply_or_delete(args: argparse.Namespace, objects: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    from components.deploy.k8s_api import apply_objects, connect, delete_objects

    api = await connect(args.kubeconfig, args.context)
    try:
        if args.k8s_command == "apply":
            return await apply_objects(api, objects, reset_replicas=args.reset_replicas)
        return await delete_objects(api, objects)
    finally:
        await api.close()


def main(args: argparse.Namespace) -> int:
    try:
        objects = _render(args)
        if args.k8s_command == "render":
            if args.output:
                out = Path(args.output)
                out.mkdir(parents=True, exist_ok=True)
                for i, obj in enumerate(objects):
                    name = f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
                    (out / name).write_text(to_yaml([obj]), encoding="utf-8")
                print(f"{len(objects)} objects written to {out}")
            else:
                sys.stdout.write(to_yaml(objects))
            return 0
        results = asyncio.run(_apply_or_delete(args, objects))
    except DeployError as e:
        print(f"kvmesh k8s {args.k8s_command}: {e}", file=sys.stderr)
        return e.exit_code
    for r in results:
        print(f"{r['object']}: {r['action']}")
    print(json.dumps({"k8s": args.k8s_command, "objects": results}))
    return 0
