"""State files (atomic writes, process identity, where they live), `kvmesh logs` following, `kvmesh status` cells."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from components.cli import logs
from components.cli.main import main as cli_main
from components.cli.status import attach_watchers, format_age, format_load, format_role, render_table, rows_of
from components.deploy.errors import StateError
from components.deploy.state import (
    ProcessRecord,
    ServeState,
    WatcherState,
    live_states,
    read_state,
    resolve_state_dir,
    state_path,
    write_state,
)
from tests.support.waiting import wait_until_sync

pytestmark = pytest.mark.unit

# Above the kernel's largest pid (pid_max is at most 2**22), so no process has it.
NO_SUCH_PID = 2**22 + 1


def make_state(namespace: str = "t", pid: int | None = None, num_watchers: int = 2) -> ServeState:
    return ServeState(
        namespace=namespace,
        graph="/g.yaml",
        status="ready",
        serve=ProcessRecord.of(pid or os.getpid()),
        started_at=time.time(),
        etcd_endpoints=["http://127.0.0.1:1"],
        nats_url="nats://127.0.0.1:2",
        watchers=[
            WatcherState(
                name=f"w-{i}", kind="worker", cmd=["x"] * 50, env={"K": "v" * 200}, log="/l", graceful_timeout_s=1
            )
            for i in range(num_watchers)
        ],
    )


def test_a_state_file_round_trips(tmp_path):
    path = state_path(tmp_path, "t")
    st = make_state()
    write_state(path, st)
    assert read_state(path) == st
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    path = state_path(tmp_path, "t")
    write_state(path, make_state(num_watchers=1))

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_state(path, make_state(num_watchers=3))
    monkeypatch.undo()
    assert len(read_state(path).watchers) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_a_reader_never_sees_a_partial_file_while_it_is_rewritten(tmp_path):
    # ~40 KB per file: a non-atomic write would be caught half-way by a reader in a tight loop.
    path = state_path(tmp_path, "t")
    write_state(path, make_state(num_watchers=100))
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            write_state(path, make_state(num_watchers=100 + n % 2))
            n += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        reads = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert len(read_state(path).watchers) in (100, 101)  # StateError on a torn read
            reads += 1
    finally:
        stop.set()
        t.join()
    assert reads > 10


def test_unreadable_state_files_are_state_errors(tmp_path):
    with pytest.raises(StateError, match="no such state file"):
        read_state(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"namespace": 1')
    with pytest.raises(StateError, match="not a kvmesh state file"):
        read_state(tmp_path / "bad.json")


def test_a_process_record_identifies_one_process_not_its_pid():
    me = ProcessRecord.of(os.getpid())
    assert me.alive()
    assert not ProcessRecord(pid=os.getpid(), create_time=me.create_time - 100).alive()  # same pid, other process
    assert not ProcessRecord(pid=NO_SUCH_PID, create_time=me.create_time).alive()


def test_live_states_skip_files_whose_serve_is_gone(tmp_path):
    write_state(state_path(tmp_path, "live"), make_state("live"))
    stale = make_state("stale")
    stale.serve = ProcessRecord(pid=NO_SUCH_PID, create_time=0.0)
    write_state(state_path(tmp_path, "stale"), stale)
    (tmp_path / "junk.json").write_text("[]")
    assert [s.namespace for s in live_states(tmp_path)] == ["live"]


def test_the_state_dir_is_the_flag_then_the_environment_then_dot_state(tmp_path, monkeypatch):
    monkeypatch.delenv("KVMESH_STATE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_state_dir(None) == tmp_path / "state"
    monkeypatch.setenv("KVMESH_STATE_DIR", "env-dir")
    assert resolve_state_dir(None) == tmp_path / "env-dir"
    assert resolve_state_dir("flag-dir") == tmp_path / "flag-dir"


# -- kvmesh logs ------------------------------------------------------------------------------------------------


def test_logs_tail_prints_the_last_lines(tmp_path):
    path = tmp_path / "w.log"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(10)))
    out = io.BytesIO()
    with open(path, "rb") as f:
        logs.print_existing(f, 3, out)
    assert out.getvalue() == b"line 7\nline 8\nline 9\n"


def test_following_a_log_survives_its_rotation(tmp_path):
    path = tmp_path / "w.log"
    path.write_bytes(b"old\n")
    out = io.BytesIO()
    f = open(path, "rb")  # follow() closes it
    f.read()
    t = threading.Thread(target=logs.follow, args=(path, f, out, 1.5))
    t.start()
    with open(path, "ab") as w:
        w.write(b"appended\n")
    wait_until_sync(lambda: out.getvalue() == b"appended\n")  # the follower read it before the rotation
    os.replace(path, tmp_path / "w.log.1")  # what circus does at 64 MiB
    path.write_bytes(b"after rotation\n")
    t.join()
    assert out.getvalue() == b"appended\nafter rotation\n"


def test_an_unknown_log_name_lists_the_known_ones(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "ns-mock-0.log").write_text("")
    with pytest.raises(Exception, match="logs here: ns-mock-0"):
        logs.find_log(tmp_path, "mock-9")


def test_a_short_log_name_works_when_one_deployment_has_it(tmp_path):
    (tmp_path / "logs").mkdir()
    for name in ("a-frontend", "a-mock-0", "b-frontend"):
        (tmp_path / "logs" / f"{name}.log").write_text("")
    assert logs.find_log(tmp_path, "mock-0") == tmp_path / "logs" / "a-mock-0.log"
    assert logs.find_log(tmp_path, "b-frontend") == tmp_path / "logs" / "b-frontend.log"
    with pytest.raises(Exception, match="several deployments have one: a-frontend, b-frontend"):
        logs.find_log(tmp_path, "frontend")


# -- kvmesh status ----------------------------------------------------------------------------------------------


def test_status_cells():
    assert [format_age(a) for a in (None, 5.9, 75, 7322)] == ["-", "5s", "1m15s", "2h02m"]
    assert format_load(None) == "-"
    assert format_load({"kv_usage": 0.126, "num_running": 3, "num_waiting": 1}) == "kv 13% run 3 wait 1"
    assert [format_role(None), format_role("aggregated", None), format_role("decode", "kv_transfer")] == [
        "-", "aggregated", "decode"
    ]  # fmt: skip
    assert format_role("decode", "recompute") == "decode:recompute"  # no KV moves: said where TTFT is read
    row: dict[str, Any] = {
        "namespace": "ns",
        "component": "backend",
        "instance_id": "abc",
        "model": "m",
        "role": "decode",
        "remote_prefill_mode": "kv_transfer",
        "migration_mode": "kv_transfer",
        "endpoints": ["kv_state", "generate"],
        "load": None,
        "age_s": 3.0,
        "metadata": {},
        "pid": 4242,
        "watcher": "ns-mock-1",
    }
    router = row | {"component": "router", "instance_id": "def", "model": None, "role": None, "pid": None}
    router |= {"remote_prefill_mode": None, "migration_mode": None, "watcher": None, "endpoints": ["route"]}
    header, line, router_line = render_table([row, router]).splitlines()
    assert header.split() == [
        "NAMESPACE", "COMPONENT", "INSTANCE", "MODEL", "WATCHER", "PID", "ROLE", "MIGRATION", "ENDPOINTS", "LOAD", "AGE"
    ]  # fmt: skip
    assert line.split() == [
        "ns", "backend", "abc", "m", "ns-mock-1", "4242", "decode", "kv_transfer", "generate,kv_state", "-", "3s"
    ]  # fmt: skip
    assert router_line.split()[6] == "-"  # not a worker: no role


def test_status_rows_carry_each_worker_s_role_and_none_for_other_instances():
    from components.protocol.metadata import WorkerMetadata, WorkerRole
    from components.runtime import InstanceInfo

    decode = WorkerMetadata(
        model="m", role=WorkerRole.DECODE, remote_prefill_mode="recompute", migration_mode="recompute", pid=7
    ).to_dict()
    infos = [InstanceInfo("ns", "backend", endpoint, 0xA, "s", decode) for endpoint in ("generate", "kv_state")] + [
        InstanceInfo("ns", "router", "route", 0xB, "s", {"kind": "router", "policy": "kv"})
    ]
    worker, router = rows_of(infos, {}, now=0.0)
    assert (worker["instance_id"], sorted(worker["endpoints"])) == ("a", ["generate", "kv_state"])
    assert (worker["role"], worker["remote_prefill_mode"]) == ("decode", "recompute")
    assert (router["role"], router["remote_prefill_mode"]) == (None, None)
    assert (worker["migration_mode"], router["migration_mode"]) == ("recompute", None)
    worker_line, router_line = render_table([worker, router]).splitlines()[1:]
    assert worker_line.split()[6:8] == ["decode:recompute", "recompute"]
    assert router_line.split()[6:8] == ["-", "-"]


def serve_state(**fields: Any) -> ServeState:
    """A ready deployment's state file of namespace ns, with ``fields`` on top."""
    base: dict[str, Any] = {
        "namespace": "ns",
        "graph": "/g.yaml",
        "status": "ready",
        "serve": ProcessRecord(pid=1, create_time=1.0),
        "started_at": 0.0,
        "etcd_endpoints": ["http://127.0.0.1:1"],
        "nats_url": "nats://127.0.0.1:2",
    }
    return ServeState(**(base | fields))


def test_status_names_the_watcher_and_pid_of_each_instance():
    def watcher(name: str, pids: list[int]) -> WatcherState:
        procs = [ProcessRecord(pid=p, create_time=1.0) for p in pids]
        return WatcherState(name=name, kind="worker", cmd=[], env={}, log="", graceful_timeout_s=1, processes=procs)

    st = serve_state(watchers=[watcher("ns-mock-0", [10]), watcher("ns-mock-1", [11])])
    rows: list[dict[str, Any]] = [
        {"namespace": "ns", "pid": 11},
        {"namespace": "ns", "pid": 99},  # not a process of this deployment (started by hand)
        {"namespace": "other", "pid": 10},  # the same pid in another namespace's etcd is not ours
        {"namespace": "ns", "pid": None},  # a router: no pid announced
    ]
    attach_watchers(rows, [st])
    assert [r.get("watcher") for r in rows] == ["ns-mock-1", None, None, None]


def test_status_with_nothing_served_says_so_instead_of_asking_a_default_port(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVMESH_ETCD_ENDPOINTS", raising=False)
    monkeypatch.delenv("KVMESH_NATS_URL", raising=False)
    rc = cli_main(["status", "--state-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 0
    assert f"nothing is served from {tmp_path}" in out.out
    assert "2379" not in out.out + out.err and "cannot reach" not in out.out + out.err
    rc = cli_main(["status", "--state-dir", str(tmp_path), "--namespace", "demo"])
    assert rc == 0 and f"namespace 'demo' is not served from {tmp_path}" in capsys.readouterr().out


def test_state_files_record_absolute_paths(tmp_path):
    # The detached serve and `kvmesh stop` may run from another directory than the one that started serving.
    assert Path(resolve_state_dir(str(tmp_path / "x" / ".." / "s"))) == tmp_path / "s"


def test_status_lists_embedded_servers_with_their_restarts():
    from components.cli.status import server_lines
    from components.deploy.local import exit_reason
    from components.deploy.state import ServerState

    st = serve_state(
        embedded_etcd=ServerState(
            endpoint="http://127.0.0.1:1",
            process=ProcessRecord(pid=7, create_time=1.0),
            data_dir="/d",
            log="/d/etcd.log",
            restarts=2,
            last_exit="2026-11-24 01:00:00 " + exit_reason(-9),
        ),
        embedded_nats=ServerState(endpoint="nats://127.0.0.1:2", process=None, data_dir="/n", log="/n/nats.log"),
    )
    assert server_lines([st]) == [
        "ns: embedded etcd http://127.0.0.1:1 pid 7, restarted 2 times (last exit: 2026-11-24 01:00:00 was killed "
        "by SIGKILL)",
        "ns: embedded nats nats://127.0.0.1:2 (not running)",
    ]
    assert exit_reason(1) == "exited with status 1"
    assert exit_reason(0) == "exited"  # reaped by circus's SIGCHLD handler before serve looked: no status known
