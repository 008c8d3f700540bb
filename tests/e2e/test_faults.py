"""Faults under load, on a served simulated graph, through the official ``openai`` client (issues 17 and 18).

Each test serves ``graphs/mock_agg.yaml`` (frontend + 2 worker processes x 8 simulated workers, real etcd,
nats-server and circus), runs a bounded streaming load (``LOAD_REQUESTS`` requests, ``LOAD_CONCURRENCY`` at a time,
each a few hundred milliseconds of real-time decoding), injects one fault about a second in, and checks what a user
would: no request failed, the same instances are registered afterwards, and ``kvmesh stop`` ends everything in its
normal time. Through the server faults also run 5 long streams (``LongStreams``) that the client leaves afterwards,
4 first: their workers must stop each one within ``STOP_WITHIN_S`` of its client leaving while the fifth is served
on (``check_left``), watched on the workers' own load reports (``LoadWatch``).

Faults: the embedded etcd SIGKILLed; the embedded nats-server SIGKILLed (``kvmesh serve`` restarts both on the same
ports and data); an external etcd restarted with and without its data; an external nats-server restarted; and one
worker process (8 of 16 workers) SIGKILLed with ``max_retries`` 1: no request may fail for lack of a live instance
while the other process serves the model (streams cut mid-way on the killed process are the migration issue's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from components.deploy.state import ServeState
from components.protocol.endpoints import TOPIC_LOAD_METRICS
from components.runtime import EventSubscription, Runtime, RuntimeConfig
from components.runtime.request_plane import CANCEL_RESEND_S
from components.runtime.servers import NatsServer
from components.workers.simulated import MockEngineConfig
from tests.e2e.test_serve import MOCK_AGG, NS, ROOT, run_kvmesh, serving, wait_gone
from tests.support.servers import etcd_for_tests
from tests.support.waiting import wait_until

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
        self.mid_stream = 0  # requests that have received a token and not yet ended

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
                if got == 1:
                    self.mid_stream += 1
                    self.started.set()
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except (openai.APIError, openai.APIConnectionError) as e:
            (self.failed_mid_stream if got else self.failed_before_first_token).append(f"{type(e).__name__}: {e}")
            return
        finally:
            if got:
                self.mid_stream -= 1
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


# Long streams through the fault: ``ABANDONED`` that the client leaves once the load is over, and one it keeps reading
# meanwhile (another client, served on). The only things that end a request on its worker while its frontend lives:
# the CANCEL the frontend sends when its client leaves (Dispatch.close -> ResponseStream.aclose; a stream dropped
# unclosed sends it too, ResponseStream.__del__), the same CANCEL sent again when frames keep arriving for a stream
# given up on (ResponseMux._orphan_frame, at most every CANCEL_RESEND_S: a CANCEL lost while the bus was down), and
# its last token. (An instance also cancels the requests of a client *process* that is gone, InstanceServer.
# _check_clients: not this case.) Measured before these streams were long (issue 28): with the instance ignoring
# CANCEL, 1,500-token streams left after ~920 tokens simply ran to their end 2.9 s later, before the check looked.
ABANDONED = 4
# At least 60 s of decoding (below), so that they run far past the check however long the load before it took: on a
# 2-core machine shared with other work (load average 34) they had received ~4,300 tokens when the load was over.
LONG_TOKENS = 12_000
# More than the graph's max_model_len of 2048 (tiny-llama's) allows; the simulated engine has room for it.
LONG_CONTEXT = ["--set", "workers[0].max_model_len=16384"]
# No decode step of a simulated worker (speedup 1, the graph's) takes less than its step-time model's base (5 ms).
MIN_STEP_S = MockEngineConfig().step_time_model.decode_base_ms / 1000
# How soon a request must stop on its worker once its client has left: the frontend's CANCEL at once (one bus hop;
# the handler is cancelled at its next await, within one engine step) or, were that one lost, the one sent again with
# the stream's next frame CANCEL_RESEND_S later; then the worker's next load report (every 100 ms). 2 s more for a
# loaded 2-core machine. Measured on the 2-core machine (load average 11-35): 0.04-0.11 s; with the frontend's
# first CANCEL dropped (a throwaway edit: only the re-send reaches the worker) 1.03-1.10 s; with the instance
# ignoring CANCEL, all 5 still ran at the deadline.
STOP_WITHIN_S = CANCEL_RESEND_S + 2.0


class LoadWatch:
    """Every worker's latest load report (``num_running`` + ``num_waiting``), heard on the event plane as the workers
    publish them (every 100 ms): how many requests the fleet runs, without a ``kvmesh status`` per look."""

    def __init__(self, st: ServeState, num_workers: int) -> None:
        self.cfg = RuntimeConfig(etcd_endpoints=st.etcd_endpoints, nats_url=st.nats_url)
        self.num_workers = num_workers
        self.latest: dict[int, tuple[float, int]] = {}  # source id -> (when heard, requests it runs)

    async def __aenter__(self) -> LoadWatch:
        self.rt = await Runtime.connect(self.cfg, name="fault-test")
        self.sub: EventSubscription[dict[str, Any]] = await self.rt.namespace(NS).events.subscribe(TOPIC_LOAD_METRICS)
        self.task = asyncio.ensure_future(self._hear())
        await wait_until(lambda: len(self.latest) == self.num_workers, timeout_s=10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await self.sub.close()
        await self.rt.shutdown(drain_timeout_s=1.0)

    async def _hear(self) -> None:
        async for ev in self.sub:
            load = ev.payload
            self.latest[ev.source_id] = (time.monotonic(), load["num_running"] + load["num_waiting"])

    def running(self, since: float) -> int | None:
        """Requests the workers run, when every one has reported since ``since``; else None."""
        heard = self.latest.values()
        if len(heard) < self.num_workers or any(at < since for at, _ in heard):
            return None
        return sum(n for _, n in heard)

    async def until(self, count: int, since: float, timeout_s: float = STOP_WITHIN_S) -> tuple[float | None, int]:
        """(seconds from ``since`` until the workers' reports since then add up to ``count`` requests, or None if
        they did not within ``timeout_s``; the last count heard)."""
        last = -1
        while (now := time.monotonic()) - since <= timeout_s:
            n = self.running(since)
            if n is not None:
                last = n
                if n == count:
                    return now - since, n
            await asyncio.sleep(0.02)
        return None, last


@dataclasses.dataclass
class LeftStreams:
    """What ``LongStreams.leave_and_watch`` saw."""

    tokens: list[int]  # the tokens each abandoned stream had received when its client left
    running_before: int  # requests the workers ran just before (the long streams: nothing else runs then)
    stopped_s: float | None  # from the client's leaving until the workers ran only the stream still read
    running_then: int  # what they ran at that moment (or at the deadline)
    served_meanwhile: int  # tokens the stream still read received in that time
    last_stopped_s: float | None  # from its client's leaving too until the workers ran nothing
    running_last: int


class LongStreams:
    """``ABANDONED`` + 1 streams of ``LONG_TOKENS``: the first ``ABANDONED`` read until ``leave`` is set, then closed
    by their client mid-stream; the last one (``KEPT``) read on until ``release`` is set, then closed too."""

    KEPT = ABANDONED

    def __init__(self, url: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.leave = asyncio.Event()
        self.release = asyncio.Event()
        self.tokens: list[int] = [0] * (ABANDONED + 1)
        self.abandoned: asyncio.Future[Any] | None = None
        self.kept: asyncio.Future[Any] | None = None

    async def one(self, i: int) -> None:
        stream = await self.client.completions.create(
            model="tiny-llama",
            prompt=f"long {i}: tell me a long story",
            max_tokens=LONG_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        until = self.leave if i < ABANDONED else self.release
        async for _ in stream:
            self.tokens[i] += 1
            if until.is_set():
                break
        await stream.close()  # the client goes away mid-stream

    def start(self) -> None:
        self.abandoned = asyncio.gather(*(self.one(i) for i in range(ABANDONED)))
        self.kept = asyncio.ensure_future(self.one(self.KEPT))

    async def leave_and_watch(self, st: ServeState, num_workers: int) -> LeftStreams:
        """Leave the abandoned streams and watch the workers stop them while the kept one streams on; then leave
        that one too and watch it stop."""
        assert self.abandoned is not None and self.kept is not None
        try:
            async with LoadWatch(st, num_workers) as watch:
                running_before = (await watch.until(ABANDONED + 1, time.monotonic(), timeout_s=5))[1]
                self.leave.set()
                await asyncio.wait_for(self.abandoned, 10)  # all 4 closed by their client
                left_at, tokens, kept_then = time.monotonic(), self.tokens[:ABANDONED], self.tokens[self.KEPT]
                stopped_s, running_then = await watch.until(1, left_at)
                served_meanwhile = self.tokens[self.KEPT] - kept_then
                self.release.set()
                await asyncio.wait_for(self.kept, 10)
                last_stopped_s, running_last = await watch.until(0, time.monotonic())
        finally:
            self.leave.set()
            self.release.set()
            await self.client.close()
        return LeftStreams(
            tokens, running_before, stopped_s, running_then, served_meanwhile, last_stopped_s, running_last
        )


async def under_load(
    url: str,
    fault: Any,
    requests: int = LOAD_REQUESTS,
    max_tokens: int = MAX_TOKENS,
    long: LongStreams | None = None,
    strike_when: Callable[[Load], bool] | None = None,
) -> Load:
    """The load with the fault a second in, or as soon as ``strike_when(load)`` holds; ``long``: its streams too,
    started with the load (through the fault)."""
    load = Load(url, requests, max_tokens)
    task = asyncio.ensure_future(load.run())
    if long is not None:
        long.start()
    await asyncio.wait_for(load.started.wait(), 30)
    if strike_when is None:
        await asyncio.sleep(FAULT_AFTER_S)  # the scenario: the fault strikes with streams in flight
    else:
        await wait_until(lambda: strike_when(load), timeout_s=60)
    await asyncio.to_thread(fault)
    await asyncio.wait_for(task, 180)
    return load


def check_left(left: LeftStreams) -> None:
    """Nothing runs for a client that is gone, and only that stops: the abandoned streams were decoding when their
    client left, far from their end; their workers stopped them within ``STOP_WITHIN_S`` while the kept stream was
    served on; once its client left too, it stopped as soon."""
    print(f"long streams: {left}")  # pytest -s shows the figures
    assert len(left.tokens) == ABANDONED and all(t > 0 for t in left.tokens), left
    # Left to themselves they would decode for longer than twice the bound: a stop within it was no natural end.
    assert all((LONG_TOKENS - t) * MIN_STEP_S > 2 * STOP_WITHIN_S for t in left.tokens), left
    assert left.running_before == ABANDONED + 1, left  # the watch sees them running
    assert left.stopped_s is not None and left.running_then == 1, left
    assert left.served_meanwhile > 0, left
    assert left.last_stopped_s is not None and left.running_last == 0, left


def instances(state_dir: Path) -> list[dict[str, Any]]:
    # Only the registered instances (etcd) are read here, never their load: no window to hear load reports in (1 s
    # per call, two calls or more per test).
    done = run_kvmesh("status", "--state-dir", str(state_dir), "--namespace", NS, "--json", "--load-wait-s", "0")
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


def stop_in_normal_time(state_dir: Path, st: ServeState) -> float:
    t0 = time.monotonic()
    done = run_kvmesh("stop", NS, "--state-dir", str(state_dir), timeout_s=120)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert wait_gone(st.all_processes(), 10) == []
    # Workers drain in well under their 60 s timeout when nothing is left running (issue 18 measured 61 s).
    assert took < 30, f"kvmesh stop took {took:.1f} s; the processes' logs end:\n{stop_logs(state_dir)}"
    return took


def stop_logs(state_dir: Path, max_lines: int = 400) -> str:
    """What each process logged from its first slow-stop or slow-exit report on (``SLOW_STOP_REPORT_S`` into a stop:
    every task and where it waits; ``EXIT_REPORT_S`` after it: every thread's stack, faulthandler's "Timeout (...)!"),
    or its last 20 lines where it wrote neither: a CI run keeps only the test's output, and the two 76 s stops of
    issue 28 left nothing saying which wait held a worker."""
    out = []
    for log in sorted((state_dir / "logs").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if "still stopping after" in line or line.startswith("Timeout (")]
        shown = lines[starts[0] :][:max_lines] if starts else lines[-20:]
        out.append(f"--- {log.name}\n" + "\n".join(shown))
    return "\n".join(out)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("server", ["etcd", "nats"])
async def test_an_embedded_server_killed_under_load_is_restarted_and_costs_no_request(tmp_path, server):
    with serving(tmp_path, "--set", "frontend.port=0", *LONG_CONTEXT) as serve:
        url = serve.wait_ready()
        st = serve.state()
        before = {r["instance_id"] for r in instances(tmp_path)}
        assert len(before) == 16
        record = st.embedded_etcd if server == "etcd" else st.embedded_nats
        assert record is not None and record.process is not None
        long = LongStreams(url)
        load = await under_load(url, lambda: kill(record.process.pid), long=long)  # type: ignore[union-attr]
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
        check_left(await long.leave_and_watch(after_state, len(before)))
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
        with serving(tmp_path / "state", "--set", "frontend.port=0", *LONG_CONTEXT, graph=graph) as serve:
            url = serve.wait_ready()
            before = {r["instance_id"] for r in instances(tmp_path / "state")}

            def restart() -> None:
                target = etcd if server == "etcd" else nats
                target.kill()
                if not keep_data:
                    etcd.wipe()
                time.sleep(2.0)  # the scenario: the server is away for 2 s
                target.start()

            long = LongStreams(url)
            load = await under_load(url, restart, long=long)
            assert load.failed_before_first_token == [] and load.failed_mid_stream == []
            assert load.ok == LOAD_REQUESTS
            rows = registered_again(tmp_path / "state", before)
            assert {r["instance_id"] for r in rows} == before
            check_left(await long.leave_and_watch(serve.state(), len(before)))
            stop_in_normal_time(tmp_path / "state", serve.state())
    finally:
        etcd.cleanup()
        nats.cleanup()


# The killed-worker test's load: 96 requests of 96 tokens (~1.2 s each), 24 at a time, ~5 s in all. The kill comes
# once at least KILL_MID_STREAM of the 24 in flight are mid-stream: round robin put about half of them on the killed
# process, so some of its ~12 are. A fixed second after the first token was not enough on the 2-core machine shared
# with other work (load average 15-25): 2 of 2 failover runs cut no stream (they passed without a failover) and 1 of
# 2 without failover failed its own check. With this strike, 4 of 5 runs of each case cut 11-13 streams; the fifth
# cut none (not understood yet), and now says so instead of passing.
KILL_REQUESTS, KILL_TOKENS = 96, 96
KILL_MID_STREAM = LOAD_CONCURRENCY - 4


def failovers(url: str) -> float:
    """The frontend's count of streams re-issued on another worker (``kvmesh_frontend_migrations_total``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvmesh_frontend_migrations_total" and sample.labels.get("kind") == "failover"
    )


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
        load = await under_load(
            url,
            lambda: kill(victim.processes[0].pid),
            KILL_REQUESTS,
            KILL_TOKENS,
            strike_when=lambda ld: ld.mid_stream >= KILL_MID_STREAM,
        )
        failed = load.failed_before_first_token + load.failed_mid_stream
        if migration_limit:
            assert failed == [], failed[:3]
            assert load.ok == KILL_REQUESTS
            # And streams were cut: the frontend re-issued them (else the test showed nothing).
            assert failovers(url) > 0, "no stream was in flight on the killed process: the test shows nothing"
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
