"""etcd and NATS with authentication on (as a cluster's would be), and the runtime's credentials from the environment
(components/runtime/credentials.py; on Kubernetes the rendered pods take them from a Secret): with them the runtime
registers and answers a request; without them it fails with an error that names the server."""

from __future__ import annotations

import json
import urllib.request

import pytest

from components.runtime import ConfigError, ConnectError, RuntimeConfig, collect
from components.runtime.credentials import etcd_credentials, nats_credentials
from components.runtime.runtime import Runtime
from components.runtime.servers import NatsServer
from tests.support.servers import etcd_for_tests

pytestmark = pytest.mark.integration

CREDS = {
    "KVMESH_ETCD_USERNAME": "root",
    "KVMESH_ETCD_PASSWORD": "etcd-secret",
    "KVMESH_NATS_USER": "kvmesh",
    "KVMESH_NATS_PASSWORD": "nats-secret",
}


class AuthNats(NatsServer):
    def command(self) -> list[str]:
        return [*super().command(), "--user", CREDS["KVMESH_NATS_USER"], "--pass", CREDS["KVMESH_NATS_PASSWORD"]]


def _etcd_post(endpoint: str, path: str, body: dict[str, str]) -> None:
    req = urllib.request.Request(f"{endpoint}/v3/{path}", json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


@pytest.fixture
def auth_servers(tmp_path):
    """etcd with user authentication enabled through its JSON gateway (a root user with the root role), and a
    nats-server that takes one user and password."""
    etcd = etcd_for_tests(tmp_path / "etcd")
    nats = AuthNats(data_dir=tmp_path / "nats")
    etcd.start()
    try:
        nats.start()
        try:
            _etcd_post(etcd.endpoint, "auth/role/add", {"name": "root"})
            _etcd_post(etcd.endpoint, "auth/user/add", {"name": "root", "password": CREDS["KVMESH_ETCD_PASSWORD"]})
            _etcd_post(etcd.endpoint, "auth/user/grant", {"user": "root", "role": "root"})
            _etcd_post(etcd.endpoint, "auth/enable", {})
            yield etcd, nats
        finally:
            nats.cleanup()
    finally:
        etcd.cleanup()


async def _echo(body, ctx):
    yield {"echo": body["x"]}


async def test_with_the_credentials_the_runtime_registers_and_serves(auth_servers, monkeypatch, namespace):
    etcd, nats = auth_servers
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    config = RuntimeConfig(etcd_endpoints=[etcd.endpoint], nats_url=nats.url, connect_timeout_s=3)
    server = await Runtime.connect(config, name="auth-server")
    client_rt = await Runtime.connect(config, name="auth-client")
    try:
        endpoint = server.namespace(namespace).component("c").endpoint("echo")
        await endpoint.serve(_echo)
        client = await client_rt.namespace(namespace).component("c").endpoint("echo").client()
        await client.wait_for_instances(1, timeout_s=10)
        assert await collect(await client.generate({"x": 7})) == [{"echo": 7}]
    finally:
        await client_rt.shutdown()
        await server.shutdown()


async def test_without_them_each_server_refuses_with_its_name(auth_servers, monkeypatch):
    etcd, nats = auth_servers
    for k in CREDS:
        monkeypatch.delenv(k, raising=False)
    config = RuntimeConfig(etcd_endpoints=[etcd.endpoint], nats_url=nats.url, connect_timeout_s=2)
    with pytest.raises(ConnectError) as refused:
        await Runtime.connect(config, name="no-creds")
    # "cannot reach etcd at http://...: InvalidArgumentError etcdserver: user name is empty"
    assert "etcd" in str(refused.value) and "user name" in str(refused.value), refused.value
    # etcd's right, NATS's wrong: NATS names itself.
    monkeypatch.setenv("KVMESH_ETCD_USERNAME", "root")
    monkeypatch.setenv("KVMESH_ETCD_PASSWORD", CREDS["KVMESH_ETCD_PASSWORD"])
    monkeypatch.setenv("KVMESH_NATS_USER", "kvmesh")
    monkeypatch.setenv("KVMESH_NATS_PASSWORD", "wrong")
    with pytest.raises(ConnectError) as nats_refused:
        await Runtime.connect(config, name="wrong-nats")
    assert "nats" in str(nats_refused.value).lower(), nats_refused.value


def test_half_a_pair_or_two_kinds_of_nats_credentials_are_refused_by_name():
    with pytest.raises(ConfigError, match="KVMESH_ETCD_USERNAME is set but KVMESH_ETCD_PASSWORD is not"):
        etcd_credentials({"KVMESH_ETCD_USERNAME": "u"})
    with pytest.raises(ConfigError, match="KVMESH_NATS_PASSWORD is set but KVMESH_NATS_USER is not"):
        nats_credentials({"KVMESH_NATS_PASSWORD": "p"})
    with pytest.raises(ConfigError, match="both set"):
        nats_credentials({"KVMESH_NATS_TOKEN": "t", "KVMESH_NATS_USER": "u", "KVMESH_NATS_PASSWORD": "p"})
    assert etcd_credentials({}) == {} and nats_credentials({}) == {}
    assert nats_credentials({"KVMESH_NATS_TOKEN": "t"}) == {"token": "t"}
