"""Routing policies by readable name. Each module is pure: it imports only the standard library and
``components.router.types`` (checked by tests/unit/test_layering.py).

To add a policy: write ``policies/<name>.py`` with a class that satisfies ``types.RoutingPolicy`` and register it in
``POLICIES`` below under its readable name (and any alias a seed system used for it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from components.router.policies.round_robin import RoundRobinPolicy
from components.router.types import RoutingPolicy

POLICIES: dict[str, Callable[[], RoutingPolicy[Any]]] = {
    "round_robin": RoundRobinPolicy,
}
