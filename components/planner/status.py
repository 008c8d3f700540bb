"""Where the planner publishes its status for ``kvmesh status``: ``kvmesh/<namespace>/planner/status/<model>`` (the
model percent-encoded: a model name may hold '/'), under the planner's lease, so it vanishes with the planner. The
value is ``loop.status_payload``'s JSON. Standard library only: ``kvmesh status`` imports this, not the loop."""

from __future__ import annotations

from urllib.parse import quote


def status_prefix(namespace: str) -> str:
    return f"kvmesh/{namespace}/planner/status/"


def status_key(namespace: str, model: str) -> str:
    return status_prefix(namespace) + quote(model, safe="")
