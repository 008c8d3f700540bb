"""The ``local`` connector on a served deployment (real circus, etcd, NATS, simulated workers), driven directly with
absolute pool sizes: GPUs handed to new replicas, names reused, nothing done for an unchanged size, and each failure
a typed ``ConnectorError`` that leaves the fleet as it was and the planner running.

``kvmesh serve`` runs under ``CUDA_VISIBLE_DEVICES=0,1`` (it hands out those two "GPUs"; the simulated engine does
not use them) with one replica of one GPU: one more replica fits, a third does not.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from components.deploy.circus import CircusController
from components.deploy.state import read_state, state_path, write_state
from components.planner.config import PlannerConfig
from components.planner.connectors.base import ScalingTimeoutError
from components.planner.connectors.local import (
    DeploymentUnavailableError,
    LocalConnector,
    NoFreeGpuError,
    NothingToScaleError,
)
from components.planner.loop import Planner
from components.planner.policy import Adjustment, Direction, Pool, ScalingDecision
from components.runtime import Runtime, RuntimeConfig
from components.runtime.servers import free_port
from tests.e2e.test_serve import Serve, serving
from tests.support.waiting import wait_until, wait_until_async

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NS = "mock"
MODEL = "tiny-llama"
FIRST, SECOND = f"{NS}-mock-0", f"{NS}-mock-1"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Serve]:
    mp = pytest.MonkeyPatch()
    mp.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # serve's own environment: the devices it may hand out
    state_dir = tmp_path_factory.mktemp("state")
    args = ["frontend.port=0", "workers[0].replicas=1", "workers[0].num_workers=1", "workers[0].gpus_per_replica=1"]
    try:
        with serving(state_dir, *[x for a in args for x in ("--set", a)]) as serve:
            serve.wait_ready()
            yield serve
    finally:
        mp.undo()


@pytest.fixture
async def runtime(served: Serve) -> AsyncIterator[Runtime]:
    st = served.state()
    rt = await Runtime.connect(RuntimeConfig(etcd_endpoints=st.etcd_endpoints, nats_url=st.nats_url))
    yield rt
    await rt.shutdown(drain_timeout_s=1.0)


def connector(rt: Runtime, serve: Serve, **kw: float) -> LocalConnector:
    return LocalConnector(rt, NS, MODEL, serve.state_dir, **kw)  # type: ignore[arg-type]


def names(serve: Serve) -> list[str]:
    return [w.name for w in serve.state().watchers]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def registered_pids(rt: Runtime) -> set[int]:
    return {int(i.metadata.get("pid", 0)) for i in await rt.namespace(NS).list_instances() if i.endpoint == "generate"}


async def test_a_new_replica_gets_a_free_gpu_and_a_reused_name_and_an_unchanged_size_does_nothing(served, runtime):
    c = connector(runtime, served)
    assert c.gpus_per_worker(Pool.DECODE) == 1 and c.gpus_per_worker(Pool.PREFILL) is None
    first = served.state().watcher(FIRST)
    assert first is not None and first.gpus == ["0"]

    await c.set_pool_size(Pool.DECODE, 2)
    st = served.state()
    added = st.watcher(SECOND)
    assert added is not None and added.added and added.group == "mock" and added.replica == 1
    assert added.gpus == ["1"] and added.cmd == first.cmd and added.role == "aggregated"
    [proc] = added.processes
    assert environ(proc.pid)["CUDA_VISIBLE_DEVICES"] == "1"  # what the process really got
    assert proc.pid in await registered_pids(runtime)  # set_pool_size returned once it had registered
    assert Path(added.log) == served.state_dir / "logs" / f"{SECOND}.log"

    # The same size again: nothing is asked of circus.
    await c.set_pool_size(Pool.DECODE, 2)
    assert (c.num_added, c.num_removed) == (1, 0) and served.state().watcher(SECOND).processes == [proc]  # type: ignore[union-attr]

    # Back to one: the added replica leaves (etcd first), exits and its watcher goes; its GPU is free again.
    await c.set_pool_size(Pool.DECODE, 1)
    assert names(served) == [f"{NS}-frontend", FIRST] and not proc.alive()
    assert proc.pid not in await registered_pids(runtime)
    # ... and the next replica takes the same name and GPU (its previous log kept as .log.1). Two such changes at
    # once run one after the other: the second finds the pool at its size (each would otherwise add a watcher).
    await asyncio.gather(c.set_pool_size(Pool.DECODE, 2), c.set_pool_size(Pool.DECODE, 2))
    assert c.num_added == 2 and names(served) == [f"{NS}-frontend", FIRST, SECOND]
    again = served.state().watcher(SECOND)
    assert again is not None and again.gpus == ["1"]
    assert (served.state_dir / "logs" / f"{SECOND}.log.1").exists()
    await c.set_pool_size(Pool.DECODE, 1)
    assert served.state().watcher(FIRST).processes == first.processes  # type: ignore[union-attr]  # never touched


async def test_each_failure_is_a_typed_connector_error_and_changes_nothing(served, runtime, tmp_path):
    c = connector(runtime, served)
    before = served.state().watchers

    await c.set_pool_size(Pool.DECODE, 2)
    with pytest.raises(NoFreeGpuError, match=r"needs 1 GPUs like mock-mock-0; free: none of 0,1"):
        await c.set_pool_size(Pool.DECODE, 3)
    assert names(served) == [f"{NS}-frontend", FIRST, SECOND]
    await c.set_pool_size(Pool.DECODE, 1)

    with pytest.raises(NothingToScaleError, match=r"only mock-mock-0 .* a pool's first watcher is never removed"):
        await c.set_pool_size(Pool.DECODE, 0)
    with pytest.raises(NothingToScaleError, match="runs prefill workers of model 'tiny-llama'"):
        await c.set_pool_size(Pool.PREFILL, 1)

    # A new worker that does not register in time is removed again: the fleet is as it was.
    with pytest.raises(ScalingTimeoutError, match=r"not done within 0\.05 s"):
        await connector(runtime, served, start_timeout_s=0.05).set_pool_size(Pool.DECODE, 2)
    assert [w.name for w in served.state().watchers] == [w.name for w in before]

    # No deployment in that state dir; a deployment whose circus does not answer.
    with pytest.raises(DeploymentUnavailableError, match="no such state file"):
        await LocalConnector(runtime, "nowhere", MODEL, tmp_path).set_pool_size(Pool.DECODE, 2)
    copy = tmp_path / "copy"
    copy.mkdir()
    st = read_state(state_path(served.state_dir, NS))
    assert st.circus is not None
    st.circus.endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    write_state(state_path(copy, NS), st)
    shutil.copytree(served.state_dir / "logs", copy / "logs")
    with pytest.raises(DeploymentUnavailableError, match="no answer"):
        await LocalConnector(runtime, NS, MODEL, copy, circus_timeout_s=0.5).set_pool_size(Pool.DECODE, 2)
    assert [w.name for w in served.state().watchers] == [w.name for w in before]


async def test_the_planner_runs_on_after_a_failed_change_and_says_why(served, runtime):
    cfg = PlannerConfig(metric_pulling_interval=0.1, adjustment_interval=60)
    planner = Planner(runtime, cfg, NS, MODEL, connector(runtime, served))
    await planner.start()
    try:
        up = ScalingDecision(Pool.DECODE, Direction.UP, 2, 3, "test: three workers", {})
        planner.apply(Adjustment(0.0, (up,), gpus_before=2, gpus_after=3, no_operation=False))
        await wait_until(lambda: planner.num_change_failures == 1, timeout_s=30)
        status = planner.status()
        assert "setting decode pool to 3 workers" in status["last_change_error"]
        assert status["changes_in_progress"] == {}
        # One more replica fitted the two GPUs; the third did not. The loop pulls on.
        pulls = planner.num_pulls
        await wait_until(lambda: planner.num_pulls > pulls + 3, timeout_s=10)
    finally:
        await planner.stop()
    assert names(served) == [f"{NS}-frontend", FIRST, SECOND]
    await connector(runtime, served).set_pool_size(Pool.DECODE, 1)
    assert names(served) == [f"{NS}-frontend", FIRST]


async def test_a_watcher_added_by_hand_counts_in_its_pool_and_is_where_the_next_change_starts(served, runtime):
    """A person adds a replica with circusctl, named as serve names them: serve records it as one of the group's,
    the connector counts it (the pool already has 2: nothing to add) and removes it first when the pool shrinks."""
    st = served.state()
    first = st.watcher(FIRST)
    assert st.circus is not None and first is not None
    by_hand = f"{NS}-mock-5"
    log = served.state_dir / "logs" / f"{by_hand}.log"
    ctl = CircusController(st.circus.endpoint)
    await asyncio.to_thread(ctl.add, by_hand, first.cmd, first.env, log, first.graceful_timeout_s)
    await wait_until(lambda: (w := served.state().watcher(by_hand)) is not None and bool(w.processes), timeout_s=10)
    recorded = served.state().watcher(by_hand)
    assert recorded is not None and (recorded.group, recorded.replica, recorded.model) == ("mock", 5, MODEL)
    [proc] = recorded.processes

    async def registered() -> bool:
        return proc.pid in await registered_pids(runtime)

    await wait_until_async(registered, timeout_s=60, step_s=0.1)

    c = connector(runtime, served)
    await c.set_pool_size(Pool.DECODE, 2)
    assert (c.num_added, c.num_removed) == (0, 0)  # two already: mock-0 and the one added by hand
    await c.set_pool_size(Pool.DECODE, 1)
    assert names(served) == [f"{NS}-frontend", FIRST] and not proc.alive()
