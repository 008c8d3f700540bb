"""The etcd the tests start themselves: etcd's raft timings cut tenfold (``--heartbeat-interval 10
--election-timeout 100``, ``EtcdServer``'s docstring). A lone member turns healthy only after one election timeout:
a start took 0.33 s with etcd's defaults and 0.08 s with these on the 2-core machine, and a restart likewise. Loopback
and one member, so nothing here needs the defaults' tolerance of slow networks. ``kvmesh serve``'s embedded etcd,
which tests also start, keeps etcd's defaults (it is the production one)."""

from __future__ import annotations

from pathlib import Path

from components.runtime.servers import EtcdServer

HEARTBEAT_INTERVAL_MS = 10
ELECTION_TIMEOUT_MS = 100


def etcd_for_tests(data_dir: Path, port: int | None = None) -> EtcdServer:
    return EtcdServer(
        data_dir=data_dir,
        port=port,
        heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
        election_timeout_ms=ELECTION_TIMEOUT_MS,
    )
