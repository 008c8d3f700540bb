"""Shared fixtures: real etcd and nats-server on free loopback ports with temporary data directories."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from components.runtime import Runtime, RuntimeConfig
from components.runtime.servers import EtcdServer, NatsServer


@pytest.fixture
def etcd_server(tmp_path) -> Iterator[EtcdServer]:
    server = EtcdServer(data_dir=tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def nats_server(tmp_path) -> Iterator[NatsServer]:
    server = NatsServer(data_dir=tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def runtime_config(etcd_server: EtcdServer, nats_server: NatsServer) -> RuntimeConfig:
    # A short lease keeps expiry tests quick; every other timing keeps its default.
    return RuntimeConfig(etcd_endpoints=[etcd_server.endpoint], nats_url=nats_server.url, lease_ttl_s=3)


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
