"""The router: pure policies (``policies/``, by readable name) over ``WorkerSnapshot``s; the ``Router`` adapter that
keeps those snapshots and asks a policy; ``RouterFeed``, which feeds a ``Router`` from the mesh (load metrics, KV
events, discovery, replica sync); and the standalone ``kvmesh router`` (``service.RouterService``, ``main``).

The frontend embeds a ``Router`` + ``RouterFeed``; ``RouterConfig`` holds every routing knob for both. Imports no HTTP,
and no etcd or NATS client: the mesh is reached through ``components.runtime``.
"""

from components.router.adapter import Router, RouterStats, make_policy
from components.router.config import LoadMetric, RouterConfig, RouterServiceConfig
from components.router.errors import NoWorkersError, RouterError, RouterProtocolError, UnknownPolicyError
from components.router.feed import RouterFeed
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
    "RouterFeed",
    "RouterProtocolError",
    "RouterServiceConfig",
    "RouterStats",
    "RoutingPolicy",
    "UnknownPolicyError",
    "WorkerSnapshot",
    "make_policy",
]
