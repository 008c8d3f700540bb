"""The local connector's pure parts (components/planner/connectors/local.py): which watchers make a pool, how many to
add or which to remove for a target, the next replica's name, free GPUs and the new replica's environment. The
circus and etcd half is tested end to end on served graphs (tests/e2e/test_planner_local.py)."""

from __future__ import annotations

import pytest

from components.deploy.state import ProcessRecord, ServeState, WatcherState
from components.planner.connectors.local import (
    free_gpus,
    new_replica_env,
    next_replica,
    pool_layout,
    watchers_to_add,
    watchers_to_remove,
)
from components.planner.policy import Pool

pytestmark = pytest.mark.unit


def watcher(name: str, role: str | None = "aggregated", model: str = "m", workers: int = 1, **kw) -> WatcherState:
    kind = kw.pop("kind", "worker" if role else "frontend")
    env = kw.pop("env", {"KVMESH_NATS_URL": "nats://127.0.0.1:1"})
    return WatcherState(
        name=name,
        kind=kind,
        model=model if role else None,
        role=role,
        num_workers=workers if role else 0,
        cmd=["python", "-m", "components.cli.main", kind],
        env=env,
        log=f"/logs/{name}.log",
        graceful_timeout_s=75,
        **kw,
    )


def state(*watchers: WatcherState, gpus: list[str] | None = None) -> ServeState:
    return ServeState(
        namespace="ns",
        graph="/g.yaml",
        status="ready",
        serve=ProcessRecord(pid=1, create_time=0.0),
        started_at=0.0,
        etcd_endpoints=["http://127.0.0.1:2379"],
        nats_url="nats://127.0.0.1:4222",
        gpus_available=gpus or [],
        watchers=list(watchers),
    )


def test_a_pool_is_the_models_watchers_in_its_roles_in_state_order_and_counts_active_ones():
    st = state(
        watcher("ns-frontend", role=None),
        watcher("ns-p-0", role="prefill"),
        watcher("ns-d-0", role="decode", workers=2),
        watcher("ns-other-0", role="decode", model="other"),
        watcher("ns-d-1", role="decode", workers=2),
        watcher("ns-d-2", role="decode", workers=2),
        watcher("ns-gone-0", role="decode"),  # in the state file, no longer in circus: left out
        watcher("ns-planner", role=None, kind="planner"),
    )
    statuses = {"ns-frontend": "active", "ns-p-0": "active", "ns-d-0": "active", "ns-other-0": "active"}
    statuses |= {"ns-d-1": "stopped", "ns-d-2": "active", "ns-planner": "active"}
    decode = pool_layout(st, statuses, "m", Pool.DECODE)
    assert [w.name for w in decode.watchers] == ["ns-d-0", "ns-d-1", "ns-d-2"]
    assert decode.template is not None and decode.template.name == "ns-d-0"
    assert [w.name for w in decode.active] == ["ns-d-0", "ns-d-2"] and [w.name for w in decode.stopped] == ["ns-d-1"]
    assert decode.workers == 4  # two active watchers x 2 workers; the stopped one runs none
    prefill = pool_layout(st, statuses, "m", Pool.PREFILL)
    assert [w.name for w in prefill.watchers] == ["ns-p-0"] and prefill.workers == 1
    assert pool_layout(st, statuses, "nobody", Pool.DECODE).template is None


def test_aggregated_workers_are_the_decode_pool_and_names_compare_without_case():
    st = state(watcher("NS-Mock-0"), watcher("NS-Mock-1"))
    layout = pool_layout(st, {"ns-mock-0": "active", "ns-mock-1": "active"}, "m", Pool.DECODE)
    assert [w.name for w in layout.active] == ["NS-Mock-0", "NS-Mock-1"]


def test_up_adds_whole_watchers_until_the_target_is_reached():
    one = pool_layout(state(watcher("a-0"), watcher("a-1")), {"a-0": "active", "a-1": "active"}, "m", Pool.DECODE)
    assert (watchers_to_add(one, 3), watchers_to_add(one, 5), watchers_to_add(one, 2), watchers_to_add(one, 1)) == (
        1,
        3,
        0,
        0,
    )
    # Two workers per watcher: 2 -> 3 asks for one more worker; only a whole watcher can be added (4 workers).
    two = pool_layout(state(watcher("a-0", workers=2)), {"a-0": "active"}, "m", Pool.DECODE)
    assert (watchers_to_add(two, 3), watchers_to_add(two, 4), watchers_to_add(two, 5)) == (1, 1, 2)


def test_down_removes_the_last_active_watchers_never_the_first():
    st = state(*(watcher(f"a-{i}") for i in range(4)))
    statuses = {f"a-{i}": "active" for i in range(4)} | {"a-2": "stopped"}
    layout = pool_layout(st, statuses, "m", Pool.DECODE)  # active: a-0, a-1, a-3 (3 workers)
    assert [w.name for w in watchers_to_remove(layout, 2)] == ["a-3"]
    assert [w.name for w in watchers_to_remove(layout, 1)] == ["a-3", "a-1"]
    assert [w.name for w in watchers_to_remove(layout, 0)] == ["a-3", "a-1"]  # a-0, the template, stays
    assert watchers_to_remove(layout, 3) == []
    # Two workers per watcher: 4 -> 3 removes one watcher (2 workers left: at most the target).
    two = pool_layout(state(watcher("b-0", workers=2), watcher("b-1", workers=2)), {"b-0": "active", "b-1": "active"},
                      "m", Pool.DECODE)  # fmt: skip
    assert [w.name for w in watchers_to_remove(two, 3)] == ["b-1"]
    only = pool_layout(state(watcher("c-0", workers=2)), {"c-0": "active"}, "m", Pool.DECODE)
    assert watchers_to_remove(only, 1) == []  # the template is all there is


def test_next_replica_takes_the_smallest_free_index_from_one():
    assert next_replica(["ns-frontend", "ns-mock-0"], "ns", "mock") == ("ns-mock-1", 1)
    assert next_replica(["ns-mock-0", "ns-mock-1", "ns-mock-3"], "ns", "mock") == ("ns-mock-2", 2)
    # circus lists names lower-cased: a name that differs only in case is taken.
    assert next_replica(["NS-mock-0", "ns-mock-1"], "NS", "mock") == ("NS-mock-2", 2)


def test_free_gpus_are_those_no_watcher_holds_and_the_new_replica_gets_its_own():
    st = state(watcher("a-0", gpus=["0", "1"]), watcher("a-1", gpus=["3"]), gpus=["0", "1", "2", "3", "4"])
    assert free_gpus(st) == ["2", "4"]
    template = watcher("a-0", gpus=["0"], env={"CUDA_VISIBLE_DEVICES": "0", "X": "y"})
    assert new_replica_env(template, ["4"]) == {"CUDA_VISIBLE_DEVICES": "4", "X": "y"}
    assert new_replica_env(template, []) == {"X": "y"}
    assert template.env["CUDA_VISIBLE_DEVICES"] == "0"  # the template's record is not changed
