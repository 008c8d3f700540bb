"""The etcd and NATS servers a mesh benchmark runs against: the ones its ``--etcd``/``--nats`` name, or its own.

``kvmesh bench fleet``, ``migration``, ``scale-down``, ``startup`` and ``transport`` talk to a real mesh. Given no
endpoints, each starts an etcd and a nats-server of its own on free loopback ports for the run and stops them after
(``mesh_servers``), so a benchmark never touches a deployment the operator did not name.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any


def add_mesh_arguments(p: argparse.ArgumentParser) -> None:
    """``--etcd`` and ``--nats``: a running mesh to use instead of the benchmark's own servers."""
    p.add_argument("--etcd", default="", help="etcd endpoint; default: start one on a free loopback port")
    p.add_argument("--nats", default="", help="NATS URL; default: start one on a free loopback port")


@contextlib.contextmanager
def mesh_servers(etcd: str, nats_url: str) -> Iterator[tuple[str, str]]:
    """``(etcd endpoint, NATS URL)``: the ones given, and for each one left empty a server started now on a free
    loopback port (NATS without JetStream), stopped when the block ends, however it ends."""
    from components.runtime.servers import EtcdServer, NatsServer

    servers: list[Any] = []
    try:
        if not etcd:
            servers.append(e := EtcdServer())
            e.start()
            etcd = e.endpoint
        if not nats_url:
            servers.append(n := NatsServer(jetstream=False))
            n.start()
            nats_url = n.url
        yield etcd, nats_url
    finally:
        for s in servers:
            s.cleanup()
