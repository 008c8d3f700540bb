"""What every planner connector is: the ``Connector`` protocol the loop (components/planner/loop.py) drives, and the
connectors' typed errors.

A connector sets an absolute worker count per pool (STYLE.md habit 4); ``set_pool_size`` returns once the change is
done (the new worker registered, the leaving one gone). The loop runs each call in a named task of its own and, while
that task runs, counts the pool as changing (``PoolView.starting``/``leaving`` by the difference asked for), which
pauses the policy's intervals; so "is a change still in progress" is "has ``set_pool_size`` returned", one rule for
every connector.

Imports only the planner's policy (for ``Pool``) and the standard library.
"""

from __future__ import annotations

from typing import Protocol

from components.planner.policy import Pool


class Connector(Protocol):
    """Sets the size of a deployment's pools."""

    name: str  # the --environment it implements: virtual, local, kubernetes

    async def start(self) -> None:
        """Pick up where a previous planner left off (the local connector removes watchers a planner stopped before
        it could remove them). Raises ``ConnectorError``; the planner runs on regardless."""
        ...

    async def set_pool_size(self, pool: Pool, count: int) -> None:
        """Make ``pool`` have ``count`` workers and return when it has (idempotent: the same count again is a no-op
        for the outside system). Raises ``ConnectorError`` when the change failed or did not finish in time."""
        ...

    async def pool_size(self, pool: Pool) -> int | None:
        """The count the outside system is set to now (local: the workers of the pool's active watchers; virtual:
        the outside system's last answer; kubernetes: the worker Deployments' ``spec.replicas``), None when unknown.
        The loop reads it while no change of its own runs: a count a person changed by hand is where the planner
        goes on from (it counts the difference as starting or leaving until the fleet shows it), never overwritten
        and never a reason to stop scaling. Raises ``ConnectorError`` when it cannot be read."""
        ...

    def gpus_per_worker(self, pool: Pool) -> int | None:
        """GPUs one worker of ``pool`` uses as the deployment says (a graph group's gpus_per_replica; 0 counts as 1
        in the budget), or None when the connector does not know (the policy then uses ``*_engine_num_gpu``)."""
        ...

    async def close(self) -> None:
        """Release what the connector holds (watches, clients); a change in flight is abandoned, not undone."""
        ...


class ConnectorError(Exception):
    """A pool size was not set. Recoverable: the planner logs it and decides again at a later interval."""

    def __init__(self, connector: str, pool: Pool, count: int | None, message: str) -> None:
        what = f"setting {pool} pool to {count} workers" if count is not None else f"{pool} pool"
        super().__init__(f"{connector} connector: {what}: {message}")
        self.connector = connector
        self.pool = pool
        self.count = count


class ScalingTimeoutError(ConnectorError, TimeoutError):
    """The outside system did not report the change done within the connector's timeout."""

    def __init__(self, connector: str, pool: Pool, count: int, timeout_s: float) -> None:
        super().__init__(connector, pool, count, f"not done within {timeout_s:g} s")
        self.timeout_s = timeout_s
