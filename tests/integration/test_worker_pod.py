"""A ``kvmesh worker`` process as a pod rendered by ``kvmesh k8s render`` runs it (components/deploy/k8s.py): the
downward API's pod and node names in its registration (the rescheduler's failure domains), and the readiness file
its probe tests: present once the worker registered, gone once it drains."""

from __future__ import annotations

import asyncio
import signal

import pytest

from components.protocol.metadata import WorkerMetadata
from tests.integration.test_migration import ready_instance_id, worker_process
from tests.integration.test_scale_down import exit_of

pytestmark = pytest.mark.integration


async def test_a_worker_in_a_pod_names_its_pod_and_node_and_is_ready_only_while_registered(
    make_runtime, runtime_config, namespace, tmp_path, monkeypatch
):
    ready = tmp_path / "ready"
    monkeypatch.setenv("KVMESH_READY_FILE", str(ready))
    monkeypatch.setenv("KVMESH_POD_NAME", "demo-mock-5d8f-abcde")
    monkeypatch.setenv("KVMESH_NODE_NAME", "gpu-node-3")
    proc = worker_process(runtime_config, namespace)
    try:
        iid = await ready_instance_id(proc)  # printed after every engine registered
        assert ready.is_file()
        rt = await make_runtime()
        instances = await rt.namespace(namespace).list_instances()
        meta = WorkerMetadata.from_dict(next(i.metadata for i in instances if i.instance_id == iid))
        assert (meta.pod, meta.node) == ("demo-mock-5d8f-abcde", "gpu-node-3")
        assert meta.process_key[0] == "gpu-node-3/demo-mock-5d8f-abcde"
        proc.send_signal(signal.SIGTERM)
        rc, last = await exit_of(proc)
        assert (rc, last) == (0, "STOPPED")
        assert not ready.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
