"""``components.cli.bench.mesh``: a mesh benchmark's etcd and NATS, its own (real servers on loopback, stopped after
the run however it ends) or the operator's (never started or stopped by the benchmark)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest

from components.cli.bench import mesh

pytestmark = pytest.mark.integration


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _host_port(endpoint: str) -> tuple[str, int]:
    u = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    assert u.hostname is not None and u.port is not None
    return u.hostname, u.port


def test_own_servers_run_on_loopback_during_the_block_and_stop_after_an_error():
    with pytest.raises(RuntimeError, match="the benchmark failed"), mesh.mesh_servers("", "") as (etcd, nats_url):
        started = [_host_port(etcd), _host_port(nats_url)]
        assert all(host == "127.0.0.1" for host, _ in started)
        assert all(_accepts(*hp) for hp in started)
        raise RuntimeError("the benchmark failed")
    assert not any(_accepts(*hp) for hp in started)


def test_given_endpoints_are_used_as_they_are(session_etcd, session_nats):
    with mesh.mesh_servers(session_etcd.endpoint, session_nats.url) as (etcd, nats_url):
        assert (etcd, nats_url) == (session_etcd.endpoint, session_nats.url)
    # Not the benchmark's to stop: the session's servers still serve.
    assert _accepts(*_host_port(session_etcd.endpoint)) and _accepts(*_host_port(session_nats.url))
