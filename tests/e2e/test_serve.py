"""`kvmesh serve` end to end: real etcd, nats-server, circus, workers and frontend on loopback, in a temporary state
directory, each on free ports (`--set frontend.port=0`; the embedded servers always take free ports).

Every wait is bounded; every test kills whatever its deployment left running, even when it fails, so one failure
does not leak processes into the next test.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from components.deploy.state import ProcessRecord, ServeState, read_state, state_path
from components.frontend.config import default_replicas

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
MOCK_AGG = ROOT / "graphs" / "mock_agg.yaml"
NS = "mock"  # graphs/mock_agg.yaml's namespace
FAST = ["--set", "frontend.port=0", "--set", "workers[0].speedup_ratio=.inf"]
SMALL = [*FAST, "--set", "workers[0].replicas=1", "--set", "workers[0].num_workers=2"]
START_TIMEOUT_S = 90.0  # two cores shared with other tests: imports alone take seconds per process
# The frontend's processes by default: one per core (at most 8), under a supervisor when there are several.
FRONTEND_PROCESSES = 1 + default_replicas() if default_replicas() > 1 else 1


def kvmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "components.cli.main", *args]


def clean_env() -> dict[str, str]:
    """The developer's KVMESH_* settings must not point a test at their own servers or state."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}


def run_kvmesh(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kvmesh(*args), cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout_s)


class Serve:
    """A foreground `kvmesh serve` subprocess whose stdout lines are read in a thread (so waits can time out)."""

    def __init__(self, state_dir: Path, *args: str, graph: Path = MOCK_AGG) -> None:
        self.state_dir = state_dir
        self.proc = subprocess.Popen(
            kvmesh("serve", str(graph), "--state-dir", str(state_dir), *args),
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                pytest.fail(f"kvmesh serve exited ({self.proc.wait()}) before READY:\n{''.join(self.output)}{err}")
            self.output.append(line)
            if line.startswith("READY"):
                return line[len("READY") :].strip()  # the frontend's URL; empty without a frontend
        pytest.fail(f"no READY line within {timeout_s} s:\n{''.join(self.output)}")

    def state(self, namespace: str = NS) -> ServeState:
        return read_state(state_path(self.state_dir, namespace))


def read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """What ``proc`` printed up to the first line containing ``marker`` (fails after ``timeout_s``)."""
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)
            if marker in line:
                break
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = out.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    pytest.fail(f"{marker!r} not printed within {timeout_s} s:\n{''.join(seen)}")


def kill_leftovers(state_dir: Path) -> list[int]:
    """SIGKILL every process a state file in ``state_dir`` still names (a failed test's deployment)."""
    killed = []
    for path in state_dir.glob("*.json"):
        with contextlib.suppress(Exception):
            for p in read_state(path).all_processes():
                if p.alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
                    killed.append(p.pid)
    return killed


@contextlib.contextmanager
def serving(state_dir: Path, *args: str, graph: Path = MOCK_AGG) -> Iterator[Serve]:
    serve = Serve(state_dir, *args, graph=graph)
    try:
        yield serve
    finally:
        if serve.proc.poll() is None:
            serve.proc.send_signal(signal.SIGTERM)
            try:
                serve.proc.wait(60)
            except subprocess.TimeoutExpired:
                serve.proc.kill()
                serve.proc.wait(10)
        kill_leftovers(state_dir)


def wait_gone(records: list[ProcessRecord], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p.pid for p in records if p.alive()]
        if not alive:
            return []
        time.sleep(0.1)
    return [p.pid for p in records if p.alive()]


def http_get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


# -- one served mock_agg for the read-only checks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mock_agg(tmp_path_factory) -> Iterator[tuple[Serve, str]]:
    state_dir = tmp_path_factory.mktemp("state")
    with serving(state_dir, *FAST) as serve:
        url = serve.wait_ready()
        yield serve, url


def test_the_served_graph_answers_the_official_openai_client(mock_agg):
    import openai

    _, url = mock_agg
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30, max_retries=0)
    assert "tiny-llama" in [m.id for m in client.models.list().data]

    done = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8, extra_body={"ignore_eos": True})
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_the_state_file_records_watchers_processes_and_endpoints(mock_agg):
    serve, url = mock_agg
    st = serve.state()
    assert st.status == "ready" and st.frontend_url == url
    assert st.serve.pid == serve.proc.pid and st.serve.alive()
    assert [(w.name, w.kind, w.num_workers) for w in st.watchers] == [
        ("mock-frontend", "frontend", 0),
        ("mock-mock-0", "worker", 8),
        ("mock-mock-1", "worker", 8),
    ]
    for w in st.watchers:
        assert len(w.processes) == (FRONTEND_PROCESSES if w.kind == "frontend" else 1)
        assert all(p.alive() for p in w.processes)
        assert w.env["KVMESH_ETCD_ENDPOINTS"] == st.etcd_endpoints[0]
        assert Path(w.log) == serve.state_dir / "logs" / f"{w.name}.log"
        assert w.gpus == []  # no GPU asked for
        if w.kind == "worker":
            # Start to registration, measured by serve (the SLA planner's start-up lead): positive, and no longer
            # than the process has been alive.
            assert w.startup_s is not None and 0 < w.startup_s <= time.time() - w.processes[0].create_time
        else:
            assert w.startup_s is None
    assert st.embedded_etcd and st.embedded_etcd.process and st.embedded_etcd.process.alive()
    assert st.embedded_nats and st.embedded_nats.process and st.embedded_nats.process.alive()
    assert st.circus and st.circus.endpoint.startswith("tcp://127.0.0.1:")
    assert http_get(f"{url}/health")[0] == 200


def test_every_process_shares_serves_session_in_its_own_process_group(mock_agg):
    # One session = one scheduling autogroup for the whole deployment (a session per process made relayed tokens
    # wait behind the engines' group: launcher module docstring); own process groups keep Ctrl-C away from them.
    serve, _ = mock_agg
    st = serve.state()
    session = os.getsid(serve.proc.pid)
    procs = [w.processes[0] for w in st.watchers]  # each watcher's own process
    procs += [st.embedded_etcd.process, st.embedded_nats.process]  # type: ignore[union-attr]
    assert len(procs) == 5
    for p in procs:
        assert os.getsid(p.pid) == session, p
        assert os.getpgid(p.pid) == p.pid, p
    # The frontend's replicas (when it has several) run in its process group: a signal to the group reaches them.
    frontend = next(w for w in st.watchers if w.kind == "frontend")
    for p in frontend.processes[1:]:
        assert os.getsid(p.pid) == session and os.getpgid(p.pid) == frontend.processes[0].pid, p


def test_the_circus_controller_lists_the_watchers(mock_agg):
    # The planner adds and removes watchers through this endpoint; here it only has to answer.
    from circus.client import CircusClient

    serve, _ = mock_agg
    st = serve.state()
    assert st.circus is not None
    client = CircusClient(endpoint=st.circus.endpoint, timeout=10)
    try:
        reply = client.call({"command": "list", "properties": {}})
    finally:
        client.stop()
    assert reply["status"] == "ok" and sorted(reply["watchers"]) == ["mock-frontend", "mock-mock-0", "mock-mock-1"]


def test_status_shows_every_worker_with_model_load_and_age(mock_agg):
    serve, _ = mock_agg
    done = run_kvmesh("status", "--state-dir", str(serve.state_dir), "--namespace", NS, "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    workers = [r for r in rows if r["component"] == "backend"]
    assert len(workers) == 16
    assert {r["model"] for r in workers} == {"tiny-llama"}
    # Simulated workers move requests too (components/migration/agent.py): migrate, migrate_in, abort; and receive
    # hot-prefix copies and their drops (components/workers/replication.py): import_prefix, drop_prefix.
    expected = ["abort", "drop_prefix", "generate", "import_prefix", "kv_state", "migrate", "migrate_in"]
    assert all(sorted(r["endpoints"]) == expected for r in workers)
    assert all(
        r["load"] is not None and 0.0 <= r["load"]["kv_usage"] <= 1.0 for r in workers
    )  # every 100 ms, heard in 1 s
    assert all(r["age_s"] is not None and 0.0 <= r["age_s"] < 600 for r in workers)
    table = run_kvmesh("status", "--state-dir", str(serve.state_dir), "--load-wait-s", "0").stdout
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["NAMESPACE", "COMPONENT", "INSTANCE", "MODEL", "WATCHER", "PID"]
    assert "16 instances" in lines
    assert [line.split()[:3] for line in lines[lines.index("16 instances") + 1 :]] == [
        ["mock:", "pools", "tiny-llama:"],
        ["mock:", "embedded", "etcd"],
        ["mock:", "embedded", "nats"],
    ]
    assert "mock: pools tiny-llama: aggregated 16 workers" in lines
    worker_rows = [line.split() for line in lines[1:17]]
    assert {row[4] for row in worker_rows} == {"mock-mock-0", "mock-mock-1"}  # each instance's watcher


def test_logs_prints_a_watchers_output_and_names_the_known_logs_otherwise(mock_agg):
    serve, _ = mock_agg
    done = run_kvmesh("logs", "mock-0", "--state-dir", str(serve.state_dir))
    assert done.returncode == 0 and "READY 8 workers" in done.stdout
    done = run_kvmesh("logs", "mock-mock-1", "--state-dir", str(serve.state_dir))
    assert done.returncode == 0 and "READY 8 workers" in done.stdout
    done = run_kvmesh("logs", "mock-7", "--state-dir", str(serve.state_dir))
    assert done.returncode == 1 and "mock-frontend, mock-mock-0, mock-mock-1" in done.stderr


# -- lifecycle -------------------------------------------------------------------------------------------------


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigterm_drains_the_workers_and_leaves_no_process_behind(tmp_path):
    with serving(tmp_path, *SMALL) as serve:
        serve.wait_ready()
        st = serve.state()
        records = st.all_processes()
        assert len(records) == 4 + FRONTEND_PROCESSES  # serve, frontend's, one worker replica, etcd, nats
        assert all(p.alive() for p in records)
        follower = subprocess.Popen(
            kvmesh("logs", "mock-0", "-f", "--state-dir", str(tmp_path)),
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            text=True,
            # Ctrl-C ends `logs -f`; a test run started in the background of a non-interactive shell has SIGINT
            # ignored, which every child would inherit (and the follower would outlive the test): reset it.
            preexec_fn=_default_sigint,
        )
        followed = ""
        try:
            serve.proc.send_signal(signal.SIGTERM)
            assert serve.proc.wait(60) == 0
            assert wait_gone(records, 10) == []
            followed = read_until(follower, "STOPPED", 10)  # -f sees the worker's last line, whenever it polls
        finally:
            follower.send_signal(signal.SIGINT)
            try:
                followed += follower.communicate(timeout=10)[0]
            finally:
                if follower.poll() is None:
                    follower.kill()
                    follower.wait()
        assert "draining 2 workers" in followed and "STOPPED" in followed  # the worker drained, and -f saw it
        assert follower.returncode == 0
        assert serve.state().status == "stopped"


def test_detach_returns_once_ready_and_stop_ends_everything(tmp_path):
    try:
        done = run_kvmesh(
            "serve", str(MOCK_AGG), "--detach", "--state-dir", str(tmp_path), *SMALL, timeout_s=START_TIMEOUT_S + 30
        )
        assert done.returncode == 0, done.stdout + done.stderr
        url = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("READY "))
        st = read_state(state_path(tmp_path, NS))
        assert st.status == "ready" and st.serve.alive() and st.serve.pid != os.getpid()
        assert st.serve_log == str(tmp_path / "logs" / f"{NS}.serve.log")
        assert http_get(f"{url}/health")[0] == 200

        again = run_kvmesh("serve", str(MOCK_AGG), "--state-dir", str(tmp_path), *SMALL)
        assert again.returncode == 1 and f"namespace 'mock' is already served by pid {st.serve.pid}" in again.stderr

        assert "READY " in run_kvmesh("logs", f"{NS}.serve", "--state-dir", str(tmp_path)).stdout

        stopped = run_kvmesh("stop", NS, "--state-dir", str(tmp_path), timeout_s=120)
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped {NS}" in stopped.stdout
        assert [p.pid for p in st.all_processes() if p.alive()] == []  # stop waited for all of them
        assert read_state(state_path(tmp_path, NS)).status == "stopped"
        assert "was not running" in run_kvmesh("stop", NS, "--state-dir", str(tmp_path)).stdout
    finally:
        kill_leftovers(tmp_path)


def test_frontend_replicas_share_the_port_and_stop_ends_every_one(tmp_path):
    try:
        done = run_kvmesh(
            "serve", str(MOCK_AGG), "--detach", "--state-dir", str(tmp_path), *SMALL, "--set", "frontend.replicas=2",
            timeout_s=START_TIMEOUT_S + 30,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        url = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("READY "))
        st = read_state(state_path(tmp_path, NS))
        frontend = next(w for w in st.watchers if w.kind == "frontend")
        assert "--replicas" in frontend.cmd and frontend.cmd[frontend.cmd.index("--replicas") + 1] == "2"
        # The watcher's process (the supervisor) and its two replicas are recorded: stop waits for all three.
        assert len(frontend.processes) == 3 and all(p.alive() for p in frontend.processes)
        # READY means every replica lists the model, not only the one serve's first probe reached.
        said = set()
        for _ in range(16):
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                health = json.loads(r.read())
            assert health["models"] == ["tiny-llama"] and health["replicas"] == 2
            said.add(health["replica"])
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
                assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-llama"]
        assert said <= {0, 1}
        answered = set()
        body = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()
        for _ in range(64):  # urllib opens a connection per request: the kernel spreads them over the replicas
            headers = {"Content-Type": "application/json"}
            req = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
            with urllib.request.urlopen(req, timeout=30) as r:
                answered.add(json.loads(r.read())["id"].split("-", 1)[1][:12])  # the answering process's id prefix
            if len(answered) == 2:
                break
        assert len(answered) == 2
        stopped = run_kvmesh("stop", NS, "--state-dir", str(tmp_path), timeout_s=120)
        assert stopped.returncode == 0, stopped.stderr
        assert [p.pid for p in frontend.processes if p.alive()] == []
        assert [p.pid for p in st.all_processes() if p.alive()] == []
    finally:
        kill_leftovers(tmp_path)


def test_stop_cleans_up_after_a_serve_that_was_killed(tmp_path):
    with serving(tmp_path, *SMALL) as serve:
        serve.wait_ready()
        records = serve.state().all_processes()
        serve.proc.kill()  # SIGKILL: circus gets no chance to stop its watchers
        serve.proc.wait(10)
        assert [p.pid for p in records[1:] if not p.alive()] == []  # the orphans still run
        again = run_kvmesh("serve", str(MOCK_AGG), "--state-dir", str(tmp_path), *SMALL)
        assert again.returncode == 1 and f"'kvmesh stop {NS}' ends them" in again.stderr
        stopped = run_kvmesh("stop", NS, "--state-dir", str(tmp_path), timeout_s=120)
        assert stopped.returncode == 0, stopped.stderr
        # 3 + FRONTEND_PROCESSES orphans (etcd, nats-server, worker, the frontend's); one fresh-clone CI run found
        # one fewer still running by the time stop looked (which one had exited went with the run's temporary
        # files). What this test is about: stop ends whatever is left, and nothing survives.
        left = re.search(r"stopped the (\d+) processes it left", stopped.stdout)
        assert left is not None and 1 <= int(left.group(1)) <= 3 + FRONTEND_PROCESSES, stopped.stdout
        assert wait_gone(records, 5) == []


def test_a_broken_graph_exits_nonzero_naming_file_line_and_field(tmp_path):
    graph = tmp_path / "graphs" / "broken.yaml"
    graph.parent.mkdir()
    graph.write_text(MOCK_AGG.read_text().replace("replicas: 2", "replicas: two"))
    line = next(i for i, s in enumerate(graph.read_text().splitlines(), 1) if "replicas: two" in s)
    done = run_kvmesh("serve", str(graph), "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2
    assert f"{graph}:{line}: workers[0].replicas: Input should be a valid integer" in done.stderr
    assert "(got 'two')" in done.stderr
    assert not (tmp_path / "state" / f"{NS}.json").exists()  # nothing was started


def test_a_worker_that_crashes_at_start_fails_serve_with_its_log_and_stops_the_rest(tmp_path):
    bad_env = "workers[0].env.KVMESH_LEASE_TTL_S=soon"  # the worker's RuntimeConfig.from_env rejects it
    done = run_kvmesh(
        "serve", str(MOCK_AGG), "--state-dir", str(tmp_path), *SMALL, "--set", bad_env, "--max-start-restarts", "0"
    )
    try:
        assert done.returncode == 1, done.stdout + done.stderr
        assert "mock-mock-0: exited once during start-up" in done.stderr
        assert "KVMESH_LEASE_TTL_S='soon' is not a whole number" in done.stderr  # the tail of its log
        st = read_state(state_path(tmp_path, NS))
        assert st.status == "failed" and "mock-mock-0" in st.reason
        assert [p.pid for p in st.all_processes() if p.alive()] == []
    finally:
        kill_leftovers(tmp_path)


def test_a_frontend_port_in_use_fails_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_kvmesh("serve", str(MOCK_AGG), "--state-dir", str(tmp_path), "--set", f"frontend.port={port}")
    assert done.returncode == 1
    assert f"frontend.port {port} on 127.0.0.1 cannot be bound" in done.stderr
    assert not (tmp_path / "logs").exists()  # no watcher was started


def test_a_workers_only_graph_joins_external_etcd_and_nats_and_leaves_them_running(tmp_path, etcd_server, nats_server):
    graph = tmp_path / "graphs" / "workers.yaml"
    graph.parent.mkdir()
    graph.write_text(
        f"""
namespace: extra
infrastructure:
  etcd: {{endpoints: ["{etcd_server.endpoint}"]}}
  nats: {{url: "{nats_server.url}"}}
frontend: {{enabled: false}}
workers:
  - {{name: more, engine: mock, model: tiny-llama, model_path: {ROOT / "models" / "tiny-llama"}, num_workers: 3}}
"""
    )
    with serving(tmp_path, graph=graph) as serve:
        assert serve.wait_ready() == ""
        st = serve.state("extra")
        assert st.embedded_etcd is None and st.embedded_nats is None
        assert st.etcd_endpoints == [etcd_server.endpoint] and st.nats_url == nats_server.url
        assert [w.name for w in st.watchers] == ["extra-more-0"]
        assert "frontend  none" in "".join(serve.output)
        records = st.all_processes()
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(60) == 0
        assert wait_gone(records, 10) == []
    assert etcd_server.proc is not None and etcd_server.proc.poll() is None  # not ours to stop
    assert nats_server.proc is not None and nats_server.proc.poll() is None


def test_two_namespaces_share_one_state_dir_and_stop_removes_the_embedded_servers_data(tmp_path):
    other = tmp_path / "graphs" / "other.yaml"
    other.parent.mkdir()
    other.write_text(MOCK_AGG.read_text().replace("namespace: mock", "namespace: other") + f"base_dir: {ROOT}\n")
    with serving(tmp_path, *SMALL) as first, serving(tmp_path, *SMALL, graph=other) as second:
        url_a, url_b = first.wait_ready(), second.wait_ready()
        assert url_a != url_b
        for url in (url_a, url_b):
            assert http_get(f"{url}/health")[0] == 200
        names = {w.name for w in first.state().watchers} | {w.name for w in second.state("other").watchers}
        assert names == {"mock-frontend", "mock-mock-0", "other-frontend", "other-mock-0"}
        etcd_data = Path(first.state().embedded_etcd.data_dir)  # type: ignore[union-attr]
        assert (etcd_data / "data").is_dir()
        # The same namespace again is refused, naming it and the serve that has it.
        done = run_kvmesh("serve", str(MOCK_AGG), "--state-dir", str(tmp_path), *SMALL)
        assert done.returncode == 1
        assert f"namespace 'mock' is already served by pid {first.proc.pid}" in done.stderr
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0
        assert not (etcd_data / "data").exists()  # 60 MB of WAL per deployment do not pile up
        assert (etcd_data / "etcd.log").is_file()  # the log stays
        assert http_get(f"{url_b}/health")[0] == 200  # the other deployment is untouched


def test_serve_says_what_it_is_still_waiting_for(tmp_path):
    with serving(tmp_path, *SMALL, "--progress-interval-s", "0.2") as serve:
        # The first progress line comes 0.2 s into the wait, seconds before READY: read up to it (or to READY, or to
        # the end, which fail below), then stop serve mid-start (serving's SIGTERM) instead of waiting out READY.
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = serve.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                break
            serve.output.append(line)
            if "still waiting for" in line or line.startswith("READY"):
                break
        waiting = [line for line in serve.output if "still waiting for" in line]
        assert waiting, "".join(serve.output)
        assert "mock-mock-0 (0/2 workers registered)" in waiting[0] or "mock-frontend" in waiting[0]
