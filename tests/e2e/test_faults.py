"""Faults under load, on a served simulated graph, through the official ``openai`` client (issues 17 and 18).

Each test serves ``graphs/mock_agg.yaml`` (frontend + 2 worker processes x 8 simulated workers, real etcd,
nats-server and circus), runs a bounded streaming load (``LOAD_REQUESTS`` requests, ``LOAD_CONCURRENCY`` at a time,
each a few hundred milliseconds of real-time decoding), injects one fault about a second in, and checks what a user
would: no request failed, the same instances are registered afterwards, no worker still runs a request nobody
waits for, and ``kvmesh stop`` ends everything in its normal time.

Faults: the embedded etcd SIGKILLed; the embedded nats-server SIGKILLed (``kvmesh serve`` restarts both on the same
ports and data); an external etcd restarted with and without its data; an external nats-server restarted; and one
worker process (8 of 16 workers) SIGKILLed with ``max_retries`` 1: no request may fail for lack of a live instance
while the other process serves the model (streams cut mid-way on the killed process are the migration issue's).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from components.deploy.state import ServeState
from components.runtime.servers import NatsServer
from tests.e2e.test_serve import MOCK_AGG, NS, ROOT, run_kvmesh, serving, wait_gone
from tests.support.servers import etcd_for_tests

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

LOAD_REQUESTS = 240
LOAD_CONCURRENCY = 24
MAX_TOKENS = 24  # ~0.3 s of decoding each at the simulator's real-time speed: streams are in flight at the fault
FAULT_AFTER_S = 1.0


class Load:
    """A bounded streaming load through the openai client; every outcome recorded."""

    def __init__(self, url: str, requests: int = LOAD_REQUESTS, max_tokens: int = MAX_TOKENS) -> None:
        self.requests = requests
        self.max_tokens = max_tokens
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.ok = 0
        self.failed_before_first_token: list[str] = []
        self.failed_mid_stream: list[str] = []
        self.started = asyncio.Event()
        self.abandoned: list[int] = []  # tokens each abandoned stream had received when its client left

    async def one(self, i: int) -> None:
        got = 0
        finish: str | None = None
        tokens: int | None = None
        try:
            stream = await self.client.completions.create(
                model="tiny-llama",
                prompt=f"request {i}: tell me something",
                max_tokens=self.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                got += 1
                self.started.set()
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except (openai.APIError, openai.APIConnectionError) as e:
            (self.failed_mid_stream if got else self.failed_before_first_token).append(f"{type(e).__name__}: {e}")
            return
        # A stream that ended without its finish reason or short of its tokens failed too, however quietly.
        if finish != "length" or tokens != self.max_tokens:
            self.failed_mid_stream.append(f"request {i}: ended with finish {finish!r} after {tokens} tokens")
            return
        self.ok += 1

    async def run(self) -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(self.requests):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                await self.one(queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(LOAD_CONCURRENCY)))
        await self.client.close()


# Streams the client gives up on once the fault is over: long enough (~19 s of decoding) to still be running when the
# test looks, unless the frontend cancelled them on their workers when their client left. With the load's own
# 24-token requests a request nobody waits for would have finished long before the check (issue 28).
ABANDONED = 4
ABANDONED_TOKENS = 1500
# The workers must have stopped them within this long of the check's start (they are cancelled at once: the first
# reading already shows none). Measured with the instance ignoring CANCEL (a throwaway edit): the 4 streams still ran
# 1.9 s into the check and stopped ~4 s in, by some other path, within this bound; with nothing stopping them they
# would run ~15 s more.
IDLE_WITHIN_S = 5.0


class Abandoned:
    """``ABANDONED`` long streams, read until ``leave`` is set, then closed by the client."""

    def __init__(self, url: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.leave = asyncio.Event()
        self.tokens: list[int] = [0] * ABANDONED

    async def one(self, i: int) -> None:
        stream = await self.client.completions.create(
            model="tiny-llama",
            prompt=f"abandoned {i}: tell me a long story",
            max_tokens=ABANDONED_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            self.tokens[i] += 1
            if self.leave.is_set():
                break
        await stream.close()  # the client goes away mid-stream

    async def run(self) -> None:
        try:
            await asyncio.gather(*(self.one(i) for i in range(ABANDONED)))
        finally:
            await self.client.close()


def instances(state_dir: Path) -> list[dict[str, Any]]:
    done = run_kvmesh("status", "--state-dir", str(state_dir), "--namespace", NS, "--json", "--load-wait-s", "1")
    assert done.returncode == 0, done.stderr
    return [r for r in json.loads(done.stdout) if r["component"] == "backend"]


def registered_again(state_dir: Path, before: set[str], timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """The fleet's rows once the same instances are registered again (after registry loss they re-register within
    a second or two of etcd's return; on a loaded machine the load may end before that)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = instances(state_dir)
        if {r["instance_id"] for r in rows} == before or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def running_requests(rows: list[dict[str, Any]]) -> int:
    return sum((r["load"] or {}).get("num_running", 0) + (r["load"] or {}).get("num_waiting", 0) for r in rows)


async def under_load(
    url: str, fault: Any, requests: int = LOAD_REQUESTS, max_tokens: int = MAX_TOKENS, abandon: bool = False
) -> Load:
    """The load with the fault a second in; ``abandon``: also ``ABANDONED`` long streams through the fault, which
    the client leaves once the load is over (``Load.abandoned``: the tokens each had received)."""
    load = Load(url, requests, max_tokens)
    task = asyncio.ensure_future(load.run())
    left = Abandoned(url) if abandon else None
    leaving = asyncio.ensure_future(left.run()) if left is not None else None
    await asyncio.wait_for(load.started.wait(), 30)
    await asyncio.sleep(FAULT_AFTER_S)  # the scenario: the fault strikes with streams in flight
    await asyncio.to_thread(fault)
    await asyncio.wait_for(task, 180)
    if left is not None and leaving is not None:
        left.leave.set()
        await asyncio.wait_for(leaving, 60)
        load.abandoned = list(left.tokens)
    return load


def idle_after(state_dir: Path, timeout_s: float = IDLE_WITHIN_S) -> int:
    """Requests the workers still run (their load reports), polled until none or ``timeout_s``: the last count."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = running_requests(instances(state_dir))
        if running == 0 or time.monotonic() > deadline:
            return running
        time.sleep(0.3)


def stop_in_normal_time(state_dir: Path, st: ServeState) -> float:
    t0 = time.monotonic()
    done = run_kvmesh("stop", NS, "--state-dir", str(state_dir), timeout_s=120)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert wait_gone(st.all_processes(), 10) == []
    # Workers drain in well under their 60 s timeout when nothing is left running (issue 18 measured 61 s).
    assert took < 30, f"kvmesh stop took {took:.1f} s"
    return took


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("server", ["etcd", "nats"])
async def test_an_embedded_server_killed_under_load_is_restarted_and_costs_no_request(tmp_path, server):
    with serving(tmp_path, "--set", "frontend.port=0") as serve:
        url = serve.wait_ready()
        st = serve.state()
        before = {r["instance_id"] for r in instances(tmp_path)}
        assert len(before) == 16
        record = st.embedded_etcd if server == "etcd" else st.embedded_nats
        assert record is not None and record.process is not None
        load = await under_load(url, lambda: kill(record.process.pid), abandon=True)  # type: ignore[union-attr]
        assert load.failed_before_first_token == [] and load.failed_mid_stream == []
        assert load.ok == LOAD_REQUESTS
        after_state = serve.state()
        after_record = after_state.embedded_etcd if server == "etcd" else after_state.embedded_nats
        assert after_state.status == "ready" and after_record is not None
        # "was killed by SIGKILL", or "exited" when circus's SIGCHLD handler reaped it before serve looked.
        assert after_record.restarts == 1 and (
            "killed by SIGKILL" in after_record.last_exit or "exited" in after_record.last_exit
        )
        assert after_record.endpoint == record.endpoint  # same port: every component reconnects by itself
        rows = registered_again(tmp_path, before)
        assert {r["instance_id"] for r in rows} == before
        # The abandoned streams were decoding (well short of their 1500 tokens) when their client left; their
        # workers stop them: nothing runs for a client that is gone.
        assert len(load.abandoned) == ABANDONED and all(0 < t < ABANDONED_TOKENS for t in load.abandoned)
        assert idle_after(tmp_path) == 0
        table = run_kvmesh("status", "--state-dir", str(tmp_path), "--load-wait-s", "0").stdout
        assert f"embedded {server}" in table and "restarted once" in table
        stop_in_normal_time(tmp_path, after_state)


@pytest.mark.parametrize(("server", "keep_data"), [("etcd", True), ("etcd", False), ("nats", True)])
async def test_an_external_server_restarted_under_load_costs_no_request(tmp_path, server, keep_data):
    etcd = etcd_for_tests(tmp_path / "ext-etcd")
    nats = NatsServer(data_dir=tmp_path / "ext-nats")
    etcd.start()
    nats.start()
    graph = tmp_path / "graphs" / "external.yaml"
    graph.parent.mkdir()
    text = (
        MOCK_AGG.read_text()
        .replace("  etcd: embedded", f"  etcd: {{endpoints: ['{etcd.endpoint}']}}")
        .replace("  nats: embedded", f"  nats: {{url: '{nats.url}'}}")
    )
    graph.write_text(text + f"base_dir: {ROOT}\n")
    try:
        with serving(tmp_path / "state", "--set", "frontend.port=0", graph=graph) as serve:
            url = serve.wait_ready()
            before = {r["instance_id"] for r in instances(tmp_path / "state")}

            def restart() -> None:
                target = etcd if server == "etcd" else nats
                target.kill()
                if not keep_data:
                    etcd.wipe()
                time.sleep(2.0)  # the scenario: the server is away for 2 s
                target.start()

            load = await under_load(url, restart, abandon=True)
            assert load.failed_before_first_token == [] and load.failed_mid_stream == []
            assert load.ok == LOAD_REQUESTS
            rows = registered_again(tmp_path / "state", before)
            assert {r["instance_id"] for r in rows} == before
            assert len(load.abandoned) == ABANDONED and all(0 < t < ABANDONED_TOKENS for t in load.abandoned)
            assert idle_after(tmp_path / "state") == 0  # nothing runs for a client that is gone
            stop_in_normal_time(tmp_path / "state", serve.state())
    finally:
        etcd.cleanup()
        nats.cleanup()


# The killed-worker test's load: 96 requests of 96 tokens (~1.2 s each), 24 at a time, ~5 s in all: at the fault (1 s
# after the first token) every one of the 24 in flight is mid-stream, about half of them on the killed process.
KILL_REQUESTS, KILL_TOKENS = 96, 96


@pytest.mark.parametrize("migration_limit", [3, 0], ids=["failover", "no-failover"])
async def test_a_killed_worker_process_costs_no_request(tmp_path, migration_limit):
    # Before the first token a failed worker's process siblings are avoided: the one retry lands on the other
    # process. Streams already running on the killed process are re-issued on the other one by failover (the
    # frontend's --migration-limit, default 3), continuing where they stopped: no request fails at all (issue 28:
    # this test tolerated up to LOAD_CONCURRENCY cut streams). With --migration-limit 0 (the behaviour the old
    # assertion allowed) the streams in flight on the killed process fail: the same load shows it.
    sets = ["--set", "frontend.port=0", "--set", "frontend.max_retries=1", "--set",
            f"frontend.migration_limit={migration_limit}"]  # fmt: skip
    with serving(tmp_path, *sets) as serve:
        url = serve.wait_ready()
        st = serve.state()
        victim = next(w for w in st.watchers if w.name == f"{NS}-mock-0")
        load = await under_load(url, lambda: kill(victim.processes[0].pid), KILL_REQUESTS, KILL_TOKENS)
        failed = load.failed_before_first_token + load.failed_mid_stream
        if migration_limit:
            assert failed == [], failed[:3]
            assert load.ok == KILL_REQUESTS
        else:
            # What the failover test would let through: streams cut on the killed process ("not re-issued
            # elsewhere: migration_limit is 0"; one run: 13 of them). Only that some fail is asserted here.
            assert load.failed_mid_stream, "no stream was in flight on the killed process: the test shows nothing"
            assert load.ok + len(failed) == KILL_REQUESTS


def test_an_embedded_server_that_cannot_come_back_fails_the_deployment_with_the_reason(tmp_path):
    import socket

    from components.deploy.state import read_state, state_path

    backoff = ["--server-restart-backoff-s", "0,0.2"]
    with serving(tmp_path, "--set", "frontend.port=0", "--set", "workers[0].replicas=1", *backoff) as serve:
        serve.wait_ready()
        st = serve.state()
        assert st.embedded_nats is not None and st.embedded_nats.process is not None
        port = int(st.embedded_nats.endpoint.rsplit(":", 1)[1])
        with socket.socket() as squatter:
            os.kill(st.embedded_nats.process.pid, signal.SIGKILL)
            # Take its port before serve restarts it: the restart cannot bind, both tries fail.
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            deadline = time.monotonic() + 5
            while True:
                try:
                    squatter.bind(("127.0.0.1", port))
                    break
                except OSError:  # the dying server still holds it for a moment
                    assert time.monotonic() < deadline, "the killed nats-server's port never freed"
                    time.sleep(0.005)
            squatter.listen()
            assert serve.proc.wait(60) == 1
        err = serve.proc.stderr.read() if serve.proc.stderr else ""
        assert "embedded nats " in err and "and did not come back after 2 tries" in err
        final = read_state(state_path(tmp_path, NS))
        assert final.status == "failed" and "did not come back" in final.reason
        assert [p.pid for p in final.all_processes() if p.alive()] == []
