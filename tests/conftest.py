"""Shared fixtures: real etcd and nats-server on free loopback ports with temporary data directories.

Two kinds of servers:

- ``etcd_server`` / ``nats_server``: the test's own, started for it and stopped after it. A test that stops, kills,
  restarts or wipes a server, or that needs an empty keyspace or a JetStream with no other stream, names these.
- The session's pair (``session_etcd`` / ``session_nats``): started once per test run and shared by every other test.
  Each test keeps to its own ``namespace`` (unique in the run): every etcd key (``kvmesh/<ns>/...``), NATS subject
  (``kvmesh.<ns>....``) and JetStream stream (derived from ``<ns>.<queue>``) the runtime makes is under it, and
  instance ids are etcd lease ids, unique per server, so whatever a test leaves behind (a SIGKILLed worker's lease
  running out, a stream) is invisible to the next one. Starting etcd took ~1 s of each of ~110 integration tests.

Every etcd here runs with shortened raft timings (tests/support/servers.py): a start or restart in 0.08 s, not 0.33 s.

``runtime_config`` points at the test's own server when the test names ``etcd_server`` or ``nats_server`` (each
separately), at the session's otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from components.runtime import Runtime, RuntimeConfig
from components.runtime.servers import EtcdServer, NatsServer
from tests.support.servers import etcd_for_tests

_namespaces = itertools.count(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How ``pytest -n N --dist loadgroup`` (pytest-xdist; scripts/dev.sh runs the suite so) shares the tests out:
    every test of one module goes to the same worker process, so a module's shared servers and deployments start
    once; every test marked ``k8s`` to one worker, so one kube-apiserver starts (tests/k8s/conftest.py); every test
    marked ``vllm`` or ``alone`` goes to one worker, so at most one set of vLLM engines (each ~0.6 GiB and a core or
    more while it runs) exists at a time and the vLLM modules' shared engines stay shared. Each worker has its own
    session etcd and nats-server (the fixtures below) and its own namespaces. Without xdist the marks do nothing."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        single = item.get_closest_marker("vllm") is not None or item.get_closest_marker("alone") is not None
        group = "vllm" if single else item.nodeid.split("::", 1)[0]
        if not single and item.get_closest_marker("k8s") is not None:
            group = "k8s"
        item.add_marker(pytest.mark.xdist_group(group))


S = TypeVar("S", EtcdServer, NatsServer)


def _running(server: S) -> Iterator[S]:
    """Start ``server``, hand it over, clean it up (its process and data directory) however the user ends."""
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def session_etcd(tmp_path_factory) -> Iterator[EtcdServer]:
    yield from _running(etcd_for_tests(tmp_path_factory.mktemp("session-etcd")))


@pytest.fixture(scope="session")
def session_nats(tmp_path_factory) -> Iterator[NatsServer]:
    yield from _running(NatsServer(data_dir=tmp_path_factory.mktemp("session-nats")))


@pytest.fixture
def namespace() -> str:
    """A namespace no other test of this run uses (runtime names allow letters, digits, '_' and '-')."""
    return f"t{next(_namespaces)}"


@pytest.fixture
def etcd_server(tmp_path) -> Iterator[EtcdServer]:
    yield from _running(etcd_for_tests(tmp_path / "etcd"))


@pytest.fixture
def nats_server(tmp_path) -> Iterator[NatsServer]:
    yield from _running(NatsServer(data_dir=tmp_path / "nats"))


@pytest.fixture
def mesh_servers(request) -> tuple[EtcdServer, NatsServer]:
    """(etcd, nats) this test's runtimes use: its own where it names ``etcd_server``/``nats_server``, else the
    session's."""
    names = request.fixturenames
    etcd = request.getfixturevalue("etcd_server" if "etcd_server" in names else "session_etcd")
    nats = request.getfixturevalue("nats_server" if "nats_server" in names else "session_nats")
    return etcd, nats


@pytest.fixture
def runtime_config(mesh_servers: tuple[EtcdServer, NatsServer]) -> RuntimeConfig:
    etcd, nats = mesh_servers
    # A short lease keeps expiry tests quick; every other timing keeps its default.
    return RuntimeConfig(etcd_endpoints=[etcd.endpoint], nats_url=nats.url, lease_ttl_s=3)


@pytest.fixture
async def make_runtime(runtime_config: RuntimeConfig) -> AsyncIterator[Callable[..., Awaitable[Runtime]]]:
    """Factory of connected runtimes; every one is shut down at the end of the test."""
    made: list[Runtime] = []

    async def make(**overrides: object) -> Runtime:
        cfg = runtime_config.model_copy(update=overrides)
        rt = await Runtime.connect(cfg)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        with contextlib.suppress(Exception):
            await rt.shutdown(drain_timeout_s=2.0)
