"""`python -m components.cli.main worker --engine vllm` as a process: it serves, drains on SIGTERM and leaves no vLLM
process behind (vLLM's engine-core and model processes are spawned children that a careless exit orphans)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import FinishReason, GenerateRequest, SamplingParams, TokenChunk
from tests.support.vllm import MODEL_DIR, ROOT, check_weights, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.integration, requires_vllm]


async def read_until(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    """The first stdout line starting with ``prefix`` (vLLM logs to stderr; stdout is the worker's own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {prefix!r} line in {timeout_s} s"
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), left)
        assert line, f"worker exited ({proc.poll()}) before printing {prefix!r}"
        if line.startswith(prefix):
            return line


async def test_vllm_worker_process_serves_drains_on_sigterm_and_leaves_no_orphans(
    make_runtime, runtime_config, namespace
):
    psutil = pytest.importorskip("psutil")  # a vLLM dependency
    check_weights()
    env = os.environ | {
        "KVMESH_ETCD_ENDPOINTS": runtime_config.etcd_endpoints[0],
        "KVMESH_NATS_URL": runtime_config.nats_url,
    }
    cmd = [sys.executable, "-m", "components.cli.main", "worker", "--engine", "vllm", "--namespace", namespace]
    cmd += ["--model-path", str(MODEL_DIR.relative_to(ROOT)), "--kv-cache-memory-bytes", str(4 * 2**20)]
    cmd += ["--max-model-len", "1024"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    children: list = []
    try:
        line = await read_until(proc, "READY", timeout_s=90)
        assert line.startswith("READY 1 workers")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # at least VLLM::EngineCore and VLLM::Worker

        rt = await make_runtime()
        client = await rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(1, timeout_s=10)
        [meta] = [i.metadata for i in client.instances()]
        # --model-path was relative: announced absolute, and the directory name is the served model name.
        assert meta["model_path"] == str(MODEL_DIR) and meta["model"] == "tiny-llama" and meta["engine"] == "vllm"

        req = GenerateRequest("drain-me", list(range(20, 120)), SamplingParams(max_tokens=300, ignore_eos=True))
        stream = await client.generate(req.to_dict())
        first = TokenChunk.from_dict(await stream.__anext__())
        proc.send_signal(signal.SIGTERM)  # mid-request: the worker must finish it before shutting vLLM down
        rest = [TokenChunk.from_dict(item) async for item in stream]
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 300
        assert rest[-1].finish_reason is FinishReason.LENGTH

        assert await asyncio.to_thread(proc.wait, 60) == 0
        assert proc.stdout.read().strip().endswith("STOPPED")
        _gone, alive = await asyncio.to_thread(psutil.wait_procs, children, 10)
        assert not alive, f"orphaned vLLM processes: {[(p.pid, p.name()) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in children:  # a failed test must not leave engines running for the rest of the suite
            if p.is_running():
                p.kill()
