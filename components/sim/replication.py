"""Hot-prefix replication in the simulator: ``PolicyReplicator``, the real policy (components/rescheduler/policies/
replication.py) over the simulated router's view, for ``replay(..., replicator=...)``.

Every ``interval_s`` the replay calls ``cycle(now_s, router, free_blocks)``: the replicator builds the policy's
snapshot from what a live adapter would read (the prefixes routed requests carried and their rates, from
``observe``, which the replay calls on every arrival with the request's block hashes; each prefix's holders from the
router's KV index; each worker's predicted TTFT as the router's ``queued_wait_ms``; its free KV blocks), runs
``plan_replication`` and returns the copies as ``PrefixCopy``s. The replay charges each copy the destination
engine's modelled transfer (``kv_transfer_time_s``), then caches the blocks on it (``BlockPool.import_prefix``) and
feeds the KV events to the router, and calls ``copy_done``. Drops are not carried out (a replica is cached free KV
the LRU evicts as any other): the policy forgets a replica its worker evicted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from components.rescheduler.config import ReplicationConfig
from components.rescheduler.policies.prefix_rates import PrefixRates
from components.rescheduler.policies.replication import (
    ActionKind,
    ReplicationState,
    WorkerLoad,
    copy_finished,
    plan_replication,
)
from components.router import Router
from components.router.types import queued_wait_ms


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixCopy:
    """Copy the prefix of ``block_hashes`` (chained, from its start) from worker ``src`` to worker ``dst``."""

    src: int
    dst: int
    block_hashes: tuple[int, ...]


class PolicyReplicator:
    def __init__(
        self, config: ReplicationConfig | None = None, model: str = "", interval_s: float = 0.5, window_s: float = 30.0
    ) -> None:
        self.config = config or ReplicationConfig()
        self.model = model
        self.interval_s = interval_s
        self.rates = PrefixRates(window_s)
        self.state = ReplicationState()
        self.copies = 0

    def observe(self, block_hashes: Sequence[int], now_s: float) -> None:
        self.rates.observe(block_hashes, now_s)

    def cycle(self, now_s: float, router: Router, free_blocks: Mapping[int, int]) -> list[PrefixCopy]:
        snaps = router.workers(self.model)
        index = router.index

        def holders_of(hashes: Sequence[int]) -> list[int]:
            # Holders by the workers' events only, as the live replicator's own index sees them (it routes nothing,
            # so it has no provisional blocks): a worker about to compute a prefix is no copy's source.
            return [w for w, n in index.overlaps(hashes).items() if n >= len(hashes) and index.none_routed(w, hashes)]

        prefixes = self.rates.loads(now_s, holders_of)
        workers = [
            WorkerLoad(
                s.instance_id, queued_wait_ms(s), free_blocks.get(s.instance_id, 0), s.instance_id in free_blocks
            )
            for s in snaps
        ]
        plan, self.state = plan_replication(prefixes, workers, self.state, self.config, now_s)
        out = []
        for a in plan.actions:
            if a.kind is ActionKind.COPY and a.source_id is not None:
                hashes = self.rates.block_hashes(a.prefix_hash)
                if hashes:
                    out.append(PrefixCopy(a.source_id, a.destination_id, hashes))
        return out

    def copy_done(self, copy: PrefixCopy, now_s: float, imported: int) -> None:
        self.copies += 1
        self.state = copy_finished(self.state, copy.block_hashes[-1], copy.dst, now_s, ok=imported >= 0)
