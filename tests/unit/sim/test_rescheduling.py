"""The live rescheduler's cycle in the simulator (components/sim/rescheduling.py): the policies' pair on a
hand-made fleet view, the migration agent's selection of what it moves, a pair in flight until its requests land,
and a replay where rescheduling moves requests with every token delivered once."""

from __future__ import annotations

import pytest

from components.fleet.state import FleetState
from components.protocol.messages import LoadSnapshot
from components.rescheduler.config import ReschedulerConfig
from components.sim import FleetSpec, SimRequest, Workload, replay
from components.sim.dynamics import Migration, RunningRequest
from components.sim.rescheduling import PolicyRescheduler
from components.workers.simulated import MockEngineConfig

pytestmark = pytest.mark.unit

NEUTRAL = ReschedulerConfig(rescheduling_policies=["neutral_load"])
META = {"model": "sim", "block_size": 16, "migration_mode": "live"}


def load(active: int, waiting_tokens: int = 0, total: int = 100) -> LoadSnapshot:
    return LoadSnapshot(0.0, active / total, total, active, 1, 0, waiting_tokens, 0, 1, active * 16)


def fleet_of(*loads: LoadSnapshot) -> FleetState:
    fleet = FleetState()
    fleet.set_members("sim", [(i + 1, dict(META)) for i in range(len(loads))])
    for i, snap in enumerate(loads):
        fleet.apply_load(i + 1, snap, 10.0)
    return fleet


def test_an_imbalanced_fleet_gets_the_policys_pair_and_the_agents_selection():
    # Projected KV use (blocks in use + waiting prompt tokens / 16, over 100 blocks): worker 1 (95 + 160 / 16) / 100
    # = 1.05, at or above neutral_load's threshold 1.0: the source; workers 2 (0.30) and 3 (0.50) below it, the
    # least loaded is the destination: 1 -> 2.
    fleet = fleet_of(load(95, 160), load(30), load(50))
    running = {
        1: [
            RunningRequest("a", 1, 100, 10, 100),  # 110 tokens
            RunningRequest("b", 1, 600, 5, 100),  # 605
            RunningRequest("c", 1, 2000, 3, 100),  # 2003: past the 1,024-token budget, but closer to it than 0
            RunningRequest("d", 1, 50, 0, 100),  # still prefilling: never selected
        ],
        2: [],
        3: [],
    }
    r = PolicyRescheduler(NEUTRAL)
    # The defaults: shortest_running under a 1,024-token budget, the total kept closest to it: d skipped, a (110),
    # then b (715: 309 from the budget against 914), c passed over (2,718 would be 1,694 from it against 309).
    moves = r.cycle(10.0, fleet.snapshot(10.0), running)
    assert list(moves) == [Migration("a", 1, 2), Migration("b", 1, 2)]
    assert r.in_flight == {(1, 2)}
    assert r.pairs_by_policy == {"neutral_load": 1} and r.migrations_by_policy == {"neutral_load": 2}
    # The pair is in flight until both requests landed: the policies are told and refuse a second pair from 1.
    still = {1: [running[1][2], running[1][3]], 2: [], 3: []}
    assert list(r.cycle(10.5, fleet.snapshot(10.5), still)) == []
    assert r.rejected_by_policy["neutral_load"] >= 1
    r.migration_done("a", 10.6)
    assert r.in_flight == {(1, 2)}
    r.migration_done("b", 10.7)
    assert r.in_flight == frozenset()
    # Next cycle: the same pair again; alone, c (2,003) leaves the total 979 from the budget against 1,024 with
    # nothing: it moves (d still prefilling).
    assert list(r.cycle(11.0, fleet.snapshot(11.0), still)) == [Migration("c", 1, 2)]
    assert r.pairs_by_policy == {"neutral_load": 2} and r.empty_pairs == 0


def test_a_balanced_fleet_gets_no_pair():
    fleet = fleet_of(load(60), load(55))
    r = PolicyRescheduler(NEUTRAL)
    assert list(r.cycle(10.0, fleet.snapshot(10.0), {1: [], 2: []})) == []
    assert r.pairs_by_policy == {}


ENGINE = MockEngineConfig(num_gpu_blocks=128, max_model_len=1024)


def test_a_replay_with_rescheduling_moves_requests_and_delivers_every_token_once():
    # Round robin on 2 workers: even requests (long: 300-token prompt, 400 tokens out) all go to worker 1, odd ones
    # (short: 50 + 5) to worker 2. Eight long requests need 8 x 700 = 5,600 tokens of KV; worker 1 holds 128 x 16 =
    # 2,048: it runs full with a queue (projected use > 1) while worker 2 empties, so neutral_load pairs 1 -> 2.
    reqs = tuple(
        SimRequest(0.05 * k, tuple(1000 * k + i for i in range(300 if k % 2 == 0 else 50)), 400 if k % 2 == 0 else 5)
        for k in range(16)
    )
    spec = FleetSpec(workers=2, engine=ENGINE)
    r = PolicyRescheduler(NEUTRAL)
    res = replay(Workload("w", reqs), spec, "round_robin", rescheduler=r)
    static = replay(Workload("w", reqs), spec, "round_robin")
    assert static.migrations == 0 and set(static.worker_by_request[0::2]) == {1}
    assert r.pairs_by_policy["neutral_load"] >= 1
    moved = r.migrations_by_policy["neutral_load"]
    assert moved >= 1 and res.migrations == moved  # every request selected landed
    assert 2 in res.worker_by_request[0::2]  # some long request finished on worker 2
    # Every token once: each request's client got exactly its max_tokens.
    assert res.output_tokens_by_request == [q.max_tokens for q in reqs]
    # In order: no gap between two consecutive tokens of a request is negative, and each request's first token
    # came before its last (e2e >= TTFT).
    assert min(res.itl_s) >= 0
    assert all(t >= 0 for t in res.ttft_by_request_s)
    assert r.in_flight == frozenset()  # every pair ended


class _MoveFirstWaiting:
    """A stub ``Rescheduler``: at its first cycle, records what the replay handed it and moves worker 1's first
    waiting request to worker 2; records when the replay says each move is over."""

    interval_s = 0.05

    def __init__(self) -> None:
        self.seen: dict[int, list[RunningRequest]] = {}
        self.cycle_s = -1.0
        self.done: dict[str, float] = {}

    def cycle(self, now_s, fleet, running):
        if self.cycle_s >= 0:
            return []
        self.cycle_s = now_s
        self.seen = {w: list(rs) for w, rs in running.items()}
        waiting = [r for r in running[1] if r.waiting]
        return [Migration(waiting[0].request_id, 1, 2)] if waiting else []

    def migration_done(self, request_id, now_s):
        self.done[request_id] = now_s


def test_a_waiting_request_moves_at_once_without_a_kv_transfer_and_is_admitted_by_the_destination():
    # Round robin on 2 workers of 128 x 16 = 2,048 tokens: even requests (1,000-token prompts, 20 out: 64 blocks
    # each) go to worker 1, which holds two; the third and fourth wait in its queue (no KV). Odd ones (16 + 2) go
    # to worker 2, which is idle after a few steps. At the first cycle (0.05 s after the first arrival) the replay
    # hands worker 1's queue over as waiting (r4, r6 in queue order), the stub moves r4 to worker 2: it lands in
    # the same instant (nothing to transfer: before, a waiting request was never handed over, and a migration was
    # a KV transfer of its context at its source's next step end) and worker 2 admits it at once.
    reqs = tuple(
        SimRequest(0.001 * k, tuple(10_000 * k + i for i in range(1000 if k % 2 == 0 else 16)), 20 if k % 2 == 0 else 2)
        for k in range(8)
    )
    spec = FleetSpec(workers=2, engine=ENGINE)
    stub = _MoveFirstWaiting()
    res = replay(Workload("w", reqs), spec, "round_robin", rescheduler=stub)
    static = replay(Workload("w", reqs), spec, "round_robin")
    on_1 = [r for r in stub.seen[1]]
    assert [r.request_id for r in on_1 if r.waiting] == ["r4", "r6"]
    assert all(r.output_tokens > 0 for r in on_1 if not r.waiting)  # running ones have their first token
    assert stub.done == {"r4": stub.cycle_s}  # landed in the cycle's instant: no transfer
    assert res.migrations == 1 and res.worker_by_request[4] == 2 and static.worker_by_request[4] == 1
    assert res.output_tokens_by_request == [q.max_tokens for q in reqs]
    # Admitted on worker 2 at once: its first token comes one prefill after the cycle, long before worker 1 would
    # have freed room for it.
    assert res.ttft_by_request_s[4] < static.ttft_by_request_s[4] - 0.05


def test_a_preempted_request_is_handed_over_as_waiting_not_running():
    # One worker of 8 blocks x 16 = 128 tokens, two requests of 16 + 100 tokens: both admitted, both decode, the
    # pool runs out and the newer (r1) is preempted back to the queue with its tokens so far and no KV. The replay
    # must list it as waiting (before, it listed it as running: a migration would have sent KV it no longer had).
    small = MockEngineConfig(num_gpu_blocks=8, max_model_len=128)
    reqs = (SimRequest(0.0, tuple(range(16)), 100), SimRequest(0.0, tuple(range(100, 116)), 100))
    seen: list[list[RunningRequest]] = []

    class Watch:
        interval_s = 0.02

        def cycle(self, now_s, fleet, running):
            seen.append(list(running[1]))
            return []

    res = replay(Workload("w", reqs), FleetSpec(workers=1, engine=small), "round_robin", rescheduler=Watch())
    assert res.preemptions >= 1
    preempted = [rs for rs in seen if any(r.request_id == "r1" and r.output_tokens > 0 and r.waiting for r in rs)]
    assert preempted, "r1 was never handed over as a waiting request with tokens"
    assert all(not (r.waiting and r.request_id == "r0") for rs in preempted for r in rs)


class _MoveOnceBothRun:
    """A stub ``Rescheduler``: once r0 (worker 1) and r1 (worker 2) both have a token, moves r0 to worker 2."""

    interval_s = 0.02

    def __init__(self) -> None:
        self.done: dict[str, float] = {}
        self.moved_s = -1.0

    def cycle(self, now_s, fleet, running):
        ids = {r.request_id for rs in running.values() for r in rs if not r.waiting and r.output_tokens > 0}
        if self.moved_s >= 0 or not {"r0", "r1"} <= ids:
            return []
        self.moved_s = now_s
        return [Migration("r0", 1, 2)]

    def migration_done(self, request_id, now_s):
        self.done[request_id] = now_s


def test_a_destination_without_room_refuses_and_the_request_stays_on_its_source():
    # Round robin on 2 workers of 128 blocks x 16 = 2,048 tokens: r0 (300-token prompt, 100 out) runs on worker 1,
    # r1 (1,900-token prompt, 60 out: 119 blocks at admission, 123 at its end) on worker 2, which has 9 blocks free
    # or fewer: r0's context (300 tokens and more: 19+ blocks) does not fit. As the live agent does (the destination
    # reserves before the source stops the request; a refusal is "aborted by destination" and the request resumes
    # where it was), r0 stays on worker 1 and decodes on. Before, worker 1 let r0 go first and worker 2, without
    # room, recomputed it: a preemption that no engine counted (res.preemptions stayed 0).
    reqs = (SimRequest(0.0, tuple(range(300)), 100), SimRequest(0.0, tuple(range(1000, 2900)), 60))
    spec = FleetSpec(workers=2, engine=ENGINE.model_copy(update={"max_model_len": 2048}))
    stub = _MoveOnceBothRun()
    res = replay(Workload("w", reqs), spec, "round_robin", rescheduler=stub)
    static = replay(Workload("w", reqs), spec, "round_robin")
    assert stub.moved_s >= 0 and "r0" in stub.done  # selected, and the move is over
    assert res.worker_by_request == [1, 2] == static.worker_by_request
    # Nothing recomputed: r0 finishes when it does without the rescheduler.
    assert res.finish_by_request_s == pytest.approx(static.finish_by_request_s)
    assert res.output_tokens_by_request == [100, 60]
    assert res.preemptions == 0
    assert res.migrations_refused == 1 and res.migrations == 0
