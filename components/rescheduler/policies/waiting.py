"""``waiting_fit`` (not Llumnix's): move waiting requests from an aggregated worker whose queue does not fit its free
KV to the one with the least of its queue left unadmitted (free KV to spare, or the shortest backlog).

Why: on the short/long output mix at the fleet's capacity the TTFT tail is the queue for KV (docs/rescheduler.md,
"TTFT on the short/long mix"): a request waits at a worker whose KV is full (a few long outputs hold it) while
another worker has free blocks. A waiting request holds no KV, so moving it copies nothing (the migration agent's
first_come_waiting order takes it; the simulator moves it at once). Llumnix's ``neutral_load`` pairs by projected KV
use, (used + waiting) / total, which cannot tell a worker with a queue it cannot admit from one that is merely full
of running requests (threshold 1.0 pairs only the former, but any destination below 1.0 will do, full or not;
threshold 0.7 pairs full workers with no queue, which have nothing waiting to move).

Per healthy aggregated worker (``common.healthy``), in KV blocks: ``free = total - used``; its queue needs
``waiting`` (``InstanceView.num_waiting_blocks``: the prompt tokens its waiting and partly prefilled requests still
need, over the block size); its **backlog** is ``waiting - free + headroom x total``
(``--rescheduling-waiting-fit-headroom``, default 0: blocks kept for its own running requests' growth): the part of
its queue it cannot admit now (negative: room to spare beyond its queue).

Workers by backlog, largest first: the upper half (those with a positive backlog: a queue that does not fit) are
sources, the lower half destinations, largest backlog paired with smallest (the i-th with the i-th; ties by instance
id), as Llumnix's unit scope pairs loads. A destination need not have free KV: when the whole fleet is short (at
capacity most of the tail's wait is such time, docs/rescheduler.md), a request waits least where the backlog ahead of
it is smallest, and the destination queues it by arrival (the engine's ``add_request_by_arrival``), so the oldest
requests of the fleet are admitted first wherever KV frees, as one pooled queue would admit them. A pair is made
when the gap exceeds ``--rescheduling-load-balance-threshold`` x the source's blocks; it moves waiting requests in
queue order (``first_come_waiting``) under a token budget of ``min(backlog_src, (backlog_src - backlog_dst) / 2)``
blocks x block size: half the gap (the two backlogs meet), and never more than the source cannot admit. Worked
example, 100 blocks each, 16-token blocks, headroom 0, threshold 0.01 (1 block):

=====  ====  =======  ====  =======  ===========================
 id    used  waiting  free  backlog  role
=====  ====  =======  ====  =======  ===========================
 1      98     40       2     38     source (largest)
 2      95     20       5     15     source
 3      90     20      10     10     destination
 4      70     20      30    -10     destination (smallest)
=====  ====  =======  ====  =======  ===========================

pairs 1 -> 4, budget min(38, (38 + 10) / 2 = 24) = 24 blocks = 384 tokens, and 2 -> 3, min(15, 2.5) = 2 blocks =
32 tokens (rounded down).

The block size is the views' (``InstanceView`` carries none): ``components.perf.model.BLOCK_SIZE`` unless given.

Pure: the standard library and this package only.
"""

from __future__ import annotations

from collections.abc import Sequence

from components.rescheduler.config import SELECT_ORDERS, Policy, ReschedulerConfig
from components.rescheduler.policies.common import fence, healthy
from components.rescheduler.types import InstanceView, MigrationPair, PolicyResult, Rejection, Role

FIRST_COME_WAITING = SELECT_ORDERS["FCW"]
TOKENS = "tokens"
BLOCK_SIZE = 16  # components.perf.model.BLOCK_SIZE (a policy imports only its own package)


def waiting_fit(views: Sequence[InstanceView], config: ReschedulerConfig, block_size: int = BLOCK_SIZE) -> PolicyResult:
    """The pairs ``waiting_fit`` proposes over ``views`` (module docstring)."""
    fenced = fence(views, config)
    by_model: dict[str, list[InstanceView]] = {}
    for v in views:
        if v.role == Role.AGGREGATED and v.num_total_blocks > 0 and healthy(v, config, fenced):
            by_model.setdefault(v.model, []).append(v)
    pairs: list[MigrationPair] = []
    rejected: list[Rejection] = []
    for model, members in sorted(by_model.items()):
        backlog = {
            v.instance_id: v.num_waiting_blocks
            - (v.num_total_blocks - v.num_used_blocks)
            + int(config.rescheduling_waiting_fit_headroom * v.num_total_blocks)
            for v in members
        }
        total = {v.instance_id: v.num_total_blocks for v in members}
        ranked = sorted(backlog, key=lambda i: (-backlog[i], i))
        half = len(ranked) // 2
        sources = [i for i in ranked[:half] if backlog[i] > 0]
        destinations = sorted(ranked[half:], key=lambda i: (backlog[i], i))
        for k, src in enumerate(sources):
            dst = destinations[k]
            gap = backlog[src] - backlog[dst]
            if gap <= config.rescheduling_load_balance_threshold * total[src]:
                rejected.append(
                    Rejection(
                        Policy.WAITING_FIT,
                        src,
                        dst,
                        f"backlog {backlog[src]} -> {backlog[dst]} blocks: gap {gap} <= load-balance threshold "
                        f"{config.rescheduling_load_balance_threshold:g} x {total[src]}",
                    )
                )
                continue
            blocks = min(backlog[src], gap // 2)
            if blocks <= 0:
                continue
            pairs.append(
                MigrationPair(
                    source_id=src,
                    destination_id=dst,
                    model=model,
                    policy=Policy.WAITING_FIT,
                    select_rule=TOKENS,
                    select_order=FIRST_COME_WAITING,
                    select_value=float(blocks * block_size),
                    reason=f"backlog {backlog[src]} -> {backlog[dst]} blocks (queue past free KV): {blocks} blocks "
                    "of waiting requests",
                )
            )
    return PolicyResult(tuple(pairs), tuple(rejected))
