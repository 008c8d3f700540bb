"""The fleet view's behaviours (tests/support/fleet.py) on the in-memory twin; tests/integration/test_fleet_live.py
runs the same ones on the live view."""

from __future__ import annotations

import pytest

from tests.support.fleet import BEHAVIOURS, MemoryDriver

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(BEHAVIOURS))
async def test_twin(name: str) -> None:
    await BEHAVIOURS[name](MemoryDriver())
