"""WorkerMetadata as it crosses etcd: to_dict/from_dict round trips, and tolerant reading of what peers of other
versions write (here: role and remote_prefill_mode)."""

from __future__ import annotations

import json

import pytest

from components.protocol.metadata import RemotePrefillMode, WorkerMetadata, WorkerRole, is_routable

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("role", "mode"),
    [
        (WorkerRole.AGGREGATED, ""),
        (WorkerRole.DECODE, RemotePrefillMode.KV_TRANSFER),
        (WorkerRole.PREFILL, RemotePrefillMode.RECOMPUTE),
    ],
)
def test_role_and_remote_prefill_mode_survive_the_trip_through_json(role, mode):
    meta = WorkerMetadata(model="m", role=role, remote_prefill_mode=mode, block_size=16, step_time={"a": 1.0})
    d = json.loads(json.dumps(meta.to_dict()))  # as etcd stores it
    assert d["role"] == str(role) and d["remote_prefill_mode"] == str(mode)
    assert type(d["remote_prefill_mode"]) is str
    back = WorkerMetadata.from_dict(d)
    assert back == meta
    assert back.remote_prefill_mode == mode


def test_a_peer_that_does_not_send_remote_prefill_mode_reads_as_aggregated():
    meta = WorkerMetadata.from_dict({"model": "m", "role": "aggregated", "block_size": 16})
    assert (meta.role, meta.remote_prefill_mode) == (WorkerRole.AGGREGATED, "")


def test_an_unknown_mode_is_kept_as_written_and_a_wrong_type_is_dropped():
    assert WorkerMetadata.from_dict({"remote_prefill_mode": "nixl_v2"}).remote_prefill_mode == "nixl_v2"
    assert WorkerMetadata.from_dict({"remote_prefill_mode": 3}).remote_prefill_mode == ""
    assert WorkerMetadata.from_dict({"role": "verifier"}).role == WorkerRole.AGGREGATED


def test_prefill_workers_are_not_routable_decode_workers_are():
    assert not is_routable(WorkerMetadata(model="m", role=WorkerRole.PREFILL))
    assert is_routable(WorkerMetadata(model="m", role=WorkerRole.DECODE))


def test_two_pods_on_one_node_are_two_processes_even_with_one_pid():
    # On Kubernetes each pod's process may be pid 1; the node alone would make two pods one failure domain.
    a = WorkerMetadata(model="m", node="node-1", pod="w-a", pid=1)
    b = WorkerMetadata(model="m", node="node-1", pod="w-b", pid=1)
    assert a.process_key == ("node-1/w-a", 1) and a.process_key != b.process_key
    assert WorkerMetadata(model="m", node="h", pid=7).process_key == ("h", 7)  # no pod: as before
    assert WorkerMetadata.from_dict(a.to_dict()).pod == "w-a"
    assert WorkerMetadata.from_dict({"model": "m", "node": "h"}).pod == ""  # an older worker's metadata
