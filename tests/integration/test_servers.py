"""The embedded etcd and nats-server start even when the port picked for them is taken before they bind it."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from components.runtime import servers
from components.runtime.errors import ConnectError
from components.runtime.servers import EtcdServer, NatsServer


@pytest.fixture
def occupied_port():
    # A listening socket holds the port the way another process's server would (an outgoing connection's ephemeral
    # port does the same to a bind without being connectable).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _picks_taken_port_first(monkeypatch, taken: int) -> list[int]:
    real = servers.free_port
    handed: list[int] = []

    def pick(host: str = "127.0.0.1") -> int:
        port = taken if not handed else real(host)
        handed.append(port)
        return port

    monkeypatch.setattr(servers, "free_port", pick)
    return handed


@pytest.mark.parametrize("cls", [EtcdServer, NatsServer])
def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(cls, tmp_path, monkeypatch, occupied_port):
    handed = _picks_taken_port_first(monkeypatch, occupied_port)
    server = cls(data_dir=tmp_path / cls.name)
    assert server.port == occupied_port
    try:
        server.start()
        assert server.port != occupied_port
        assert server.proc is not None and server.proc.poll() is None
        assert "address already in use" in server.log_path.read_text()
        assert len(handed) >= 2
        if cls is EtcdServer:
            with urllib.request.urlopen(f"{server.endpoint}/health", timeout=2) as r:
                assert b'"true"' in r.read()
        else:
            with socket.create_connection(("127.0.0.1", server.port), timeout=2) as c:
                assert c.recv(4).startswith(b"INFO")
    finally:
        server.cleanup()


def test_a_given_port_that_is_taken_is_a_clear_error_not_another_port(tmp_path, occupied_port):
    server = NatsServer(data_dir=tmp_path / "nats", port=occupied_port)
    try:
        with pytest.raises(ConnectError, match="address already in use"):
            server.start(timeout_s=10)
        assert server.port == occupied_port
    finally:
        server.cleanup()


@pytest.fixture
def bound_port():
    # Bound but not listening: how an outgoing connection holds an ephemeral port. Nothing answers a probe on it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("cls", [EtcdServer, NatsServer])
def test_a_port_taken_between_the_check_and_the_servers_own_bind_is_picked_again(
    cls, tmp_path, monkeypatch, bound_port
):
    handed = _picks_taken_port_first(monkeypatch, bound_port)
    monkeypatch.setattr(cls, "_check_ports_free", lambda self: None)  # the race: the check passed, then it was taken
    server = cls(data_dir=tmp_path / cls.name)
    try:
        server.start()
        assert server.port != bound_port and len(handed) >= 2
        assert server.proc is not None and server.proc.poll() is None
        log = server.log_path.read_text()
        assert "address already in use" in log and "kvmesh: cannot start" not in log  # the server's own words
    finally:
        server.cleanup()


def test_picked_ports_lie_below_the_ephemeral_range_where_no_outgoing_connection_is_placed():
    lo, hi = servers._ephemeral_range()
    assert 1024 < lo <= hi
    ports = {servers.free_port() for _ in range(50)}
    assert all(servers._LOWEST_PICKED_PORT <= p < lo for p in ports)
    assert len(ports) > 40  # at random, not one port over and over
    with socket.socket() as s:  # and free: bindable at once
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_someone_listens_on_is_never_picked(monkeypatch, occupied_port):
    monkeypatch.setattr(servers, "_ephemeral_range", lambda: (occupied_port + 1, occupied_port + 2))
    monkeypatch.setattr(servers, "_LOWEST_PICKED_PORT", occupied_port - 1)
    # The low range is [occupied - 1, occupied]: only occupied_port - 1 can be picked unless it is taken too.
    picks = {servers.free_port() for _ in range(20)}
    assert occupied_port not in picks


@pytest.mark.parametrize("cls", [EtcdServer, NatsServer])
def test_a_restart_comes_back_on_the_same_address_or_fails_never_moves(cls, tmp_path):
    server = cls(data_dir=tmp_path / cls.name)  # port picked by the server itself
    try:
        server.start()
        port = server.port
        server.kill()
        with socket.socket() as squatter:  # someone takes the address while it is down
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            with pytest.raises(ConnectError, match="address already in use"):
                server.start(timeout_s=10)
            assert server.port == port
        server.start()  # the address is free again: back where it was
        assert server.port == port and server.proc is not None and server.proc.poll() is None
    finally:
        server.cleanup()


def test_etcd_takes_raft_timings_only_when_given(tmp_path):
    # etcd's defaults (100 ms heartbeat, 1000 ms election timeout) unless asked: kvmesh serve's etcd keeps them.
    assert not {"--heartbeat-interval", "--election-timeout"} & set(EtcdServer(data_dir=tmp_path / "d").command())
    server = EtcdServer(data_dir=tmp_path / "fast", heartbeat_interval_ms=10, election_timeout_ms=100)
    cmd = server.command()
    assert cmd[cmd.index("--heartbeat-interval") + 1] == "10" and cmd[cmd.index("--election-timeout") + 1] == "100"
    try:
        server.start()  # etcd refuses an election timeout under 5 heartbeats: it starts, so it took these
        with urllib.request.urlopen(f"{server.endpoint}/health", timeout=2) as r:
            assert b'"true"' in r.read()
    finally:
        server.cleanup()
