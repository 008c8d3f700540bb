"""Long-running components run on uvloop when it is installed, unless KVMESH_UVLOOP=0 (components.runtime.eventloop)."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import weakref

import pytest

from components.runtime import eventloop

pytestmark = pytest.mark.unit


async def _loop_class() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_switched_off_it_is_asyncios_own_loop(monkeypatch):
    monkeypatch.setenv("KVMESH_UVLOOP", "0")
    assert not eventloop.uvloop_wanted()
    assert eventloop.run(_loop_class()).startswith("asyncio")


def test_by_default_uvloop_runs_when_installed(monkeypatch):
    monkeypatch.delenv("KVMESH_UVLOOP", raising=False)
    assert eventloop.uvloop_wanted()
    expected = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    assert eventloop.run(_loop_class()).startswith(expected)


class _Node:
    pass


def test_freezing_the_start_up_heap_keeps_it_out_of_collections():
    node = _Node()
    node.self = node  # a cycle allocated during "start-up": only the cyclic collector could free it
    ref = weakref.ref(node)
    try:
        frozen = eventloop.freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: not even a full collection looks at it
    finally:
        gc.unfreeze()
    gc.collect()
    assert ref() is None
