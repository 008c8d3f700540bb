"""What ``Planner.apply`` needs of a runtime, and a prefill/decode swap to hand it: shared by the planner's unit test
of the removals-first order and the k8s tier's swap at full budget. Pure: no etcd, NATS or clock."""

from __future__ import annotations

import asyncio
from typing import Any

from components.planner.policy import Adjustment, Direction, Pool, ScalingDecision


class _Supervisor:
    def spawn(self, coro: Any, name: str = "") -> Any:
        return asyncio.ensure_future(coro)


class _Discovery:
    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        pass  # the planner's status key: not what these tests are about


class ApplyOnlyRuntime:
    """What ``Planner.apply`` touches of a runtime: its supervisor (change tasks) and discovery (the status key)."""

    supervisor = _Supervisor()
    discovery = _Discovery()
    primary_lease = 0


def swap(decode: int, prefill: int, budget: int) -> Adjustment:
    """One adjustment that moves a worker from the prefill pool (``prefill`` -> ``prefill - 1``) to the decode pool
    (``decode`` -> ``decode + 1``) at a full ``budget``."""
    return Adjustment(
        now_s=0.0,
        decisions=(
            ScalingDecision(Pool.DECODE, Direction.UP, decode, decode + 1, "test: swap", {}),
            ScalingDecision(Pool.PREFILL, Direction.DOWN, prefill, prefill - 1, "test: swap", {}),
        ),
        gpus_before=budget,
        gpus_after=budget,
        no_operation=False,
    )
