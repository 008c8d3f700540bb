"""Where a rescheduler publishes its status for ``kvmesh status``: ``kvmesh/<namespace>/rescheduler/status/<id>``,
``<id>`` the hex of the rescheduler's runtime lease (a standalone one and one colocated in a frontend each have
their own key), under that lease, so it vanishes with the process. The value is ``loop.Rescheduler.status()``'s JSON:
where it runs, its interval and policies, the totals by policy, and the last cycle that chose or refused a pair.
Standard library only: ``kvmesh status`` imports this, not the loop."""

from __future__ import annotations


def status_prefix(namespace: str) -> str:
    return f"kvmesh/{namespace}/rescheduler/status/"


def status_key(namespace: str, lease: int) -> str:
    return f"{status_prefix(namespace)}{lease:x}"
