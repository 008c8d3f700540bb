"""The router: pure policies (``policies/``, by readable name) over ``WorkerSnapshot``s; the ``Router`` adapter that
keeps those snapshots and asks a policy; ``feed.RouterFeed``, which feeds a ``Router`` from the mesh (load metrics,
KV events, discovery, replica sync); and the standalone ``kvmesh router`` (``service.RouterService``, ``main``).

This package's namespace exports only the parts without I/O (importing it loads no runtime, NATS, etcd or HTTP
client: tests/unit/test_layering.py checks it in a fresh interpreter). The mesh-facing parts are imported from their
modules: ``components.router.feed``, ``components.router.service``.

The frontend embeds a ``Router`` + ``RouterFeed``; ``RouterConfig`` holds every routing knob for both.
"""

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
