"""Long-running components run on uvloop when it is installed, unless KVMESH_UVLOOP=0 (components.runtime.eventloop)."""

from __future__ import annotations

import asyncio
import importlib.util

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
