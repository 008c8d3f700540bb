"""The router: pure policies (``policies/``, by readable name) over ``WorkerSnapshot``s, and the ``Router`` adapter
the frontend calls. Imports no HTTP and no etcd or NATS client."""

from components.router.adapter import Router, make_policy
from components.router.errors import NoWorkersError, RouterError, UnknownPolicyError
from components.router.policies import POLICIES
from components.router.types import RouteDecision, RouteRequest, RoutingPolicy, WorkerSnapshot

__all__ = [
    "POLICIES",
    "NoWorkersError",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterError",
    "RoutingPolicy",
    "UnknownPolicyError",
    "WorkerSnapshot",
    "make_policy",
]
