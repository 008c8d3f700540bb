"""No ``asyncio.wait_for`` in kvmesh's own code: ``async with asyncio.timeout(...)`` instead.

On Python 3.11 (the version kvmesh runs on) ``asyncio.wait_for`` returns the inner result instead of raising
``CancelledError`` when the task that awaits it is cancelled in the same loop iteration as the inner call completes
(CPython gh-86296, fixed in 3.12 by rebuilding ``wait_for`` on ``asyncio.timeout``). A loop around such a call then runs
on after its cancel, and whoever awaits the cancelled task waits for good: a worker's lease keep-alive did exactly
that (tests/unit/runtime/test_lease_keep_alive.py), hanging a worker's stop and a test teardown in CI.
``asyncio.timeout`` awaits the inner call in the same task, so a cancel cannot be lost. Checked on the source with
``ast`` (nothing is imported); tests may still use ``wait_for`` on their own awaits.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

COMPONENTS = Path(__file__).resolve().parents[2] / "components"


def wait_for_calls(path: Path) -> list[int]:
    """Lines of ``asyncio.wait_for(...)`` calls and of ``from asyncio import wait_for`` in ``path``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "wait_for":
            if isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio":
            if any(a.name == "wait_for" for a in node.names):
                lines.append(node.lineno)
    return lines


def test_the_check_finds_a_wait_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import asyncio\nfrom asyncio import wait_for\n\nasync def f(x):\n    return await asyncio.wait_for(x, 1)\n"
    )
    assert wait_for_calls(bad) == [2, 5]


def test_no_component_awaits_with_asyncio_wait_for():
    found = {
        str(p.relative_to(COMPONENTS.parent)): lines
        for p in sorted(COMPONENTS.rglob("*.py"))
        if (lines := wait_for_calls(p))
    }
    assert found == {}, f"use `async with asyncio.timeout(t): await ...` instead (this module's docstring): {found}"
