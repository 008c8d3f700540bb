"""``waiting_fit`` (not Llumnix's): move waiting requests from an aggregated worker whose queue does not fit its free
KV to one whose free KV fits them.

Why: on the short/long output mix at the fleet's capacity the TTFT tail is the queue for KV (docs/rescheduler.md,
"TTFT on the short/long mix"): a request waits at a worker whose KV is full (a few long outputs hold it) while
another worker has free blocks. A waiting request holds no KV, so moving it copies nothing (the migration agent's
first_come_waiting order takes it; the simulator moves it at once). Llumnix's ``neutral_load`` pairs by projected KV
use, (used + waiting) / total, which cannot tell a worker with a queue it cannot admit from one that is merely full
of running requests (threshold 1.0 pairs only the former, but any destination below 1.0 will do, full or not;
threshold 0.7 pairs full workers with no queue, which have nothing waiting to move).

Per healthy aggregated worker (``common.healthy``), in KV blocks: ``free = total - used``; its queue needs
``waiting`` (``InstanceView.num_waiting_blocks``: the prompt tokens its waiting and partly prefilled requests still
need, over the block size);

- a **source** has ``waiting > free``: its queue does not fit what is free, so at least its tail waits for KV; its
  ``deficit = waiting - free``;
- a **destination** has ``spare = free - waiting - headroom x total > 0`` (``--rescheduling-waiting-fit-headroom``,
  default 0: the blocks kept for its own running requests' growth): room beyond its own queue.

Sources by deficit, largest first, are paired with destinations by spare, largest first (the i-th with the i-th;
ties by instance id). Each pair moves waiting requests in queue order (``first_come_waiting``) under a token budget
of ``min(deficit, spare) x block size``: no more than the source cannot admit and the destination can. Worked
example, 100 blocks each, 16-token blocks, headroom 0:

=====  ====  =======  ====  =======  =====
 id    used  waiting  free  deficit  spare
=====  ====  =======  ====  =======  =====
 1      98     40       2     38       -
 2      95     10       5      5       -
 3      50      0      50      -      50
 4      70     20      30      -      10
=====  ====  =======  ====  =======  =====

pairs 1 -> 3 (budget min(38, 50) x 16 = 608 tokens) and 2 -> 4 (min(5, 10) x 16 = 80 tokens).

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
        deficit: dict[int, int] = {}
        spare: dict[int, int] = {}
        for v in members:
            free = v.num_total_blocks - v.num_used_blocks
            if v.num_waiting_blocks > free:
                deficit[v.instance_id] = v.num_waiting_blocks - free
            else:
                room = free - v.num_waiting_blocks - int(config.rescheduling_waiting_fit_headroom * v.num_total_blocks)
                if room > 0:
                    spare[v.instance_id] = room
        sources = sorted(deficit, key=lambda i: (-deficit[i], i))
        destinations = sorted(spare, key=lambda i: (-spare[i], i))
        for k, src in enumerate(sources):
            if k >= len(destinations):
                rejected.append(
                    Rejection(
                        Policy.WAITING_FIT, src, None, f"queue {deficit[src]} blocks past free KV: no destination left"
                    )
                )
                continue
            dst = destinations[k]
            blocks = min(deficit[src], spare[dst])
            pairs.append(
                MigrationPair(
                    source_id=src,
                    destination_id=dst,
                    model=model,
                    policy=Policy.WAITING_FIT,
                    select_rule=TOKENS,
                    select_order=FIRST_COME_WAITING,
                    select_value=float(blocks * block_size),
                    reason=f"queue {deficit[src]} blocks past free KV on {src}; {spare[dst]} spare on {dst}: "
                    f"{blocks} blocks of waiting requests",
                )
            )
    return PolicyResult(tuple(pairs), tuple(rejected))
