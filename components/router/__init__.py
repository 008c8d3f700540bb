"""The router: pure policies (``policies/``, by readable name) over ``WorkerSnapshot``s; the ``Router`` adapter that
keeps those snapshots and asks a policy; ``feed.RouterFeed``, which feeds a ``Router`` from the mesh (load metrics,
KV events, discovery, replica sync); and the standalone ``kvmesh router`` (``service.RouterService``, ``main``).

This package's namespace exports only the parts without I/O (importing it loads no runtime, NATS, etcd or HTTP
client: tests/unit/test_layering.py checks it in a fresh interpreter). The mesh-facing parts are imported from their
modules: ``components.router.feed``, ``components.router.service``.

The frontend embeds a ``Router`` + ``RouterFeed``; ``RouterConfig`` holds every routing knob for both.

The names are loaded on first use (PEP 562 ``__getattr__``), not when the package is: ``components.router.config``
is the frontend's config and so a graph file's, imported by ``kvmesh serve``/``stop``/``logs`` and the planner, and
every policy module imports ``components.router.types``; through an eager ``__init__`` each of those also loaded the
``Router`` adapter, the KV index, the fleet and the protocol's messages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from components.router.adapter import Router, RouterStats, make_policy
    from components.router.config import LoadMetric, RouterConfig, RouterServiceConfig
    from components.router.errors import NoWorkersError, RouterError, RouterProtocolError, UnknownPolicyError
    from components.router.policies import ALIASES, POLICIES
    from components.router.types import RouteDecision, RouteRequest, RoutingPolicy, WorkerSnapshot

__all__ = [
    "ALIASES",
    "POLICIES",
    "LoadMetric",
    "NoWorkersError",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RouterError",
    "RouterProtocolError",
    "RouterServiceConfig",
    "RouterStats",
    "RoutingPolicy",
    "UnknownPolicyError",
    "WorkerSnapshot",
    "make_policy",
]

# Each public name and the module that defines it (tests/unit/test_lazy_packages.py checks this).
_WHERE = {
    **dict.fromkeys(("Router", "RouterStats", "make_policy"), "components.router.adapter"),
    **dict.fromkeys(("LoadMetric", "RouterConfig", "RouterServiceConfig"), "components.router.config"),
    **dict.fromkeys(
        ("NoWorkersError", "RouterError", "RouterProtocolError", "UnknownPolicyError"), "components.router.errors"
    ),
    **dict.fromkeys(("ALIASES", "POLICIES"), "components.router.policies"),
    **dict.fromkeys(("RouteDecision", "RouteRequest", "RoutingPolicy", "WorkerSnapshot"), "components.router.types"),
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
