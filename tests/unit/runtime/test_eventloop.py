"""Long-running components run on uvloop when it is installed, unless KVMESH_UVLOOP=0 (components.runtime.eventloop)."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from components.runtime import eventloop

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


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


def test_a_process_that_lingers_after_its_main_coroutine_dumps_its_threads_stacks():
    """Issue 28: a worker SIGKILLed at its 75 s graceful timeout said nothing about what held it. Here the
    interpreter's exit joins a thread that ends only after the report's time (``run_component`` arms the report as
    it returns): the dump names where that thread waits."""
    script = (
        "import threading\n"
        "from components.runtime import eventloop\n"
        "def held_at_exit():\n"
        "    threading.Event().wait(5)\n"
        "async def main():\n"
        "    threading.Thread(target=held_at_exit).start()\n"
        "    eventloop.report_a_slow_exit(0.5)\n"
        "eventloop.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "Timeout (0:00:00.500000)!" in done.stderr
    assert "in held_at_exit" in done.stderr


def test_a_process_that_exits_at_once_dumps_nothing():
    script = (
        "from components.runtime import eventloop\n"
        "async def main():\n"
        "    eventloop.report_a_slow_exit(0.5)\n"
        "eventloop.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stderr == ""
