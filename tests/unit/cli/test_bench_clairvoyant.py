"""The clairvoyant fleet of ``kvmesh bench planner`` (components/cli/bench/clairvoyant.py): its need, its lookahead,
the schedule it makes under the step rules and the planner loop's rules, and the simulation's cadence for a
controller; every expected count is derived here from the sinusoid's crossings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest

from components.cli.bench.clairvoyant import Oracle
from components.cli.bench.planner import need_worker_seconds, share_within
from components.cli.bench.scaling import RequestSource, ScalingSpec, Sinusoid, simulate
from components.planner.config import PlannerConfig
from components.planner.policy import NEW_DECODE_WORKER_GRACE_PERIOD
from components.sim.traces import TraceRow
from components.workers.simulated import MockEngineConfig

pytestmark = pytest.mark.unit

SIN = Sinusoid(period_s=150, duration_s=600, low=0.25, high=1.0)


def oracle(**kw) -> Oracle:
    base = dict(sinusoid=SIN, load_start_s=0.0, peak_workers=8, utilisation=1.0, interval_s=10.0, startup_s=30.0,
                max_workers=8)  # fmt: skip
    return Oracle(**(base | kw))


def crossing(workers: int, u: float = 1.0, peak: int = 8) -> float:
    """The first time in a period at which the need passes ``workers``: 8 f(t) / u > workers, with
    f(t) = 0.625 - 0.375 cos(2 pi t / 150)."""
    return 150 / (2 * math.pi) * math.acos((0.625 - workers * u / peak) / 0.375)


def test_the_need_is_the_load_in_workers_at_the_target_utilisation():
    o = oracle()
    assert o.need(0.0) == 2  # 0.25 x 8 = 2 exactly: no rounding up past it
    assert o.need(37.5) == 5  # 0.625 x 8
    assert o.need(75.0) == 8
    # The crossings, derived: need 8 from 54.92 s (f > 7/8), 7 from 45.61 s, 6 from 37.5 s, 5 from 29.39 s, 4 from
    # 20.08 s, 3 just after the trough.
    assert [round(crossing(w), 2) for w in (7, 6, 5, 4, 3)] == [54.92, 45.61, 37.5, 29.39, 20.08]
    assert o.need(crossing(7) - 0.01) == 7 and o.need(crossing(7) + 0.01) == 8
    assert o.need(crossing(4) + 0.01) == 5
    # Headroom: at u = 0.8, 0.625 x 8 / 0.8 = 6.25 -> 7; the peak's 10 is cut to the budget.
    assert oracle(utilisation=0.8).need(37.5) == 7 and oracle(utilisation=0.8).need(75.0) == 8
    w = oracle(load_start_s=60.0)
    assert w.need(10.0) == 2  # the warm-up runs at the trough
    assert w.need(60.0 + 600.0) == 1  # after the load: the floor
    with pytest.raises(ValueError):
        oracle(utilisation=1.2)


def test_ready_by_counts_one_addition_per_chance_after_its_start_up():
    o = oracle()  # every 10 s, 30 s start-up: additions at 0, 10, 20 ... register at 30, 40, 50 ...
    assert [o.ready_by(t, 0.0) for t in (29.9, 30.0, 39.9, 40.0, 55.0)] == [0, 1, 1, 2, 3]
    loop = oracle(loop_rules=True)  # the loop waits out the start-up and then an interval: one per 40 s
    assert loop.add_every_s == 40.0
    assert [loop.ready_by(t, 0.0) for t in (30.0, 69.9, 70.0, 110.0)] == [1, 1, 2, 3]


def test_the_start_pool_is_the_smallest_that_additions_at_every_decision_can_grow_into_the_need():
    # Step rules: by t the additions at 0, 10, ... have registered floor((t - 30) / 10) + 1 workers. Need 8 at
    # 54.92 s - 3 ready = 5; need 7 at 45.61 s - 2 = 5; 6 at 37.5 s - 1 = 5; 5 at 29.39 s - 0 = 5.
    assert oracle().start_workers(0.0) == 5
    # Loop rules, one addition per 40 s: 8 - 1 (54.92 s) = 7.
    assert oracle(loop_rules=True).start_workers(0.0) == 7
    # No start-up, one per 10 s: need 8 at 54.92 s - 6 ready (0..50) = 2 = the trough's need.
    assert oracle(startup_s=0.0).start_workers(0.0) == 2


def test_an_addition_comes_exactly_when_waiting_an_interval_would_be_too_late():
    o = oracle()
    # At 0 with 5 (the start pool): with additions from 10 on, 8 at 54.92 s needs 3 ready but gets 2: add now.
    assert o.decide(0.0, 5, [], may_remove=True)[0] == 6
    # At 0 with 6: additions from 10 (ready 40, 50) give 8 by 54.92 s: no need to add yet; nor to remove (5 + 2 < 8).
    assert o.decide(0.0, 6, [], may_remove=True) == (6, "hold")
    # A moment short before an addition now could register is no reason to add: nothing helps there.
    flat = oracle(sinusoid=Sinusoid(150, 600, 0.5, 0.5))  # need 4 throughout
    assert flat.decide(0.0, 4, [5.0], may_remove=True) == (4, "hold")  # 3 routed until 5 s: short, but hold
    assert flat.decide(0.0, 3, [], may_remove=True)[0] == 4  # short after 30 s: add
    target, reason = flat.decide(0.0, 5, [], may_remove=True)
    assert target == 4 and reason.startswith("remove")
    assert flat.decide(0.0, 5, [], may_remove=False)[0] == 5  # the loop rules' grace period
    assert flat.decide(0.0, 5, [20.0], may_remove=True)[0] == 5  # never while a worker is starting
    tiny = oracle(sinusoid=Sinusoid(150, 600, 0.1, 0.1))  # need 0.8 -> the floor of 1
    assert tiny.decide(0.0, 1, [], may_remove=True) == (1, "hold")


def registered_meets_need(o: Oracle, decisions: Sequence[tuple[float, int]], start: int, until: float) -> bool:
    """Whether, with additions registering start-up later and removals at once, the routed pool is at least the need
    at every 0.1 s from the first decision on."""
    ready = [-math.inf] * start
    events = list(decisions)
    t, i = events[0][0], 0
    while t < until:
        while i < len(events) and events[i][0] <= t + 1e-9:
            now, count = events[i]
            while len(ready) < count:
                ready.append(now + o.startup_s)
            del ready[count:]
            i += 1
        if sum(1 for r in ready if r <= t + 1e-9) < o.need(t):
            return False
        t += 0.1
    return True


def test_the_step_rule_schedule_follows_the_sinusoid_just_in_time():
    o = oracle()
    plan = o.plan(0.0, 600.0)
    counts = [c for _, c in plan.decisions]
    assert plan.start == 5 and [t for t, _ in plan.decisions[:3]] == [0.0, 10.0, 20.0]
    # Up to 8 by three additions at 0, 10, 20 (ready 30, 40, 50: in time for 54.92 s); 8 held while the need is 8
    # (until 150 - 54.92 = 95.08 s) and for the trough's lookahead.
    assert counts[:10] == [6, 7, 8, 8, 8, 8, 8, 8, 8, 8]
    # Down one per decision from 100 s: at 100 the need is 7 (until 104.39 s) and the next rise (8 again at
    # 204.92 s) is still reachable from 7 with additions from 110 on; down to 4 at 130 s, whose need is 3 and whose
    # 4 plus additions from 140 reach 5 by 179.39 s and 8 by 204.92 s. At 140, 4 plus additions from 150 (ready
    # 180, 190, 200) are one short of 8 at 204.92 s: add.
    assert counts[10:15] == [7, 6, 5, 4, 5]
    assert registered_meets_need(o, plan.decisions, plan.start, 600.0)
    # Every period repeats the first full one (from 100 s on).
    assert counts[10:25] == counts[25:40]
    assert all(abs(a - b) <= 1 for a, b in zip([plan.start, *counts], counts, strict=False))
    # Worker-seconds: each worker from its addition to its removal (drained at once).
    assert plan.worker_seconds(0.0, 600.0) == pytest.approx(sum(min(b if b is not None else 600.0, 600.0) - a
                                                                for a, b in plan.spans))  # fmt: skip


def test_with_30_s_intervals_the_schedule_cannot_come_down_from_the_peak():
    # One addition per 30 s with a 30 s start-up: 8 at 54.92 s needs the additions at 0 and 30 (ready 30 and 60 ->
    # only the first in time): start at 7. Coming down to 6 would need two additions before the next rise, i.e.
    # removals no later than 60 s before it: the pool never goes below 7.
    o = oracle(interval_s=30.0)
    plan = o.plan(0.0, 600.0)
    assert plan.start == 7
    assert min(c for _, c in plan.decisions) == 7
    assert registered_meets_need(o, plan.decisions, plan.start, 600.0)


def test_the_loop_rules_space_additions_by_start_up_plus_an_interval_and_hold_removals_in_the_grace_period():
    o = oracle(loop_rules=True)
    plan = o.plan(0.0, 600.0)
    times = [t for t, _ in plan.decisions]
    counts = [plan.start] + [c for _, c in plan.decisions]  # counts[i]: the pool before decision i
    adds = [i for i, (_, c) in enumerate(plan.decisions) if c > counts[i]]
    removals = [i for i, (_, c) in enumerate(plan.decisions) if c < counts[i]]
    assert adds and removals
    for i in adds:  # the next decision comes after the start-up and an interval
        assert i + 1 == len(times) or times[i + 1] == pytest.approx(times[i] + 40.0)
    for i in removals:  # never within the grace period's decisions after the last addition
        last_add = max((j for j in adds if j < i), default=None)
        assert last_add is None or i - last_add > NEW_DECODE_WORKER_GRACE_PERIOD
    assert registered_meets_need(o, plan.decisions, plan.start, 600.0)
    # It holds at least as many workers as the step rules allow.
    assert plan.worker_seconds(0.0, 600.0) >= oracle().plan(0.0, 600.0).worker_seconds(0.0, 600.0)


def test_the_lower_bound_holds_for_the_greedy_schedule_and_tightens_with_the_rules():
    # A flat need of 4: no schedule routing it holds fewer than 4 workers: 600 s x 4.
    assert oracle(sinusoid=Sinusoid(150, 600, 0.5, 0.5)).least_worker_seconds(0.0, 600.0) == pytest.approx(2400.0)
    # With an interval so long that one change is all a schedule could make, the routed pool is never below the
    # peak's 8 less one; 8 itself while the need is 8: from 54.92 s to 95.08 s of each of the 4 periods, on the
    # 0.1 s grid. No start-up: the held pool is the routed one.
    frozen = oracle(interval_s=1e6, startup_s=0.0)
    eight = 4 * (150 - 2 * crossing(7))
    assert frozen.least_worker_seconds(0.0, 600.0) == pytest.approx(7 * 600 + eight, abs=0.5)
    for kw in (dict(), dict(interval_s=30.0), dict(startup_s=0.0), dict(utilisation=0.9)):
        o = oracle(**kw)
        least = o.least_worker_seconds(0.0, 600.0)
        assert o.plan(0.0, 600.0).worker_seconds(0.0, 600.0) >= least - 1e-6  # achievable >= bound
        assert least >= need_worker_seconds(o) - 1e-6  # and the bound >= the need alone
        assert oracle(loop_rules=True, **kw).least_worker_seconds(0.0, 600.0) >= least - 1e-6
    # The figure the verdict rests on: one worker per 10 s with a 30 s start-up leaves under 25% to save.
    assert 1 - oracle().least_worker_seconds(0.0, 600.0) / 4800 < 0.25
    assert 1 - oracle(startup_s=0.0).least_worker_seconds(0.0, 600.0) / 4800 > 0.25


def test_the_ideal_need_and_the_share_of_requests_within_a_fixed_fleets_capacity():
    # Flat at 0.5 of 8 workers: the need is 4 throughout; 600 s x 4.
    assert need_worker_seconds(oracle(sinusoid=Sinusoid(150, 600, 0.5, 0.5))) == pytest.approx(2400.0)
    # The rate is at most 0.625 while cos >= 0: the first and last quarters of each period; their share of the
    # arrivals is 2 (0.625 x 37.5 - 0.375 x 150 / 2pi) / (0.625 x 150) = 0.309.
    expected = 2 * (0.625 * 37.5 - 0.375 * 150 / (2 * math.pi)) / (0.625 * 150)
    assert share_within(SIN, 0.625) == pytest.approx(expected, abs=1e-3)
    assert share_within(SIN, 1.0) == pytest.approx(1.0)


# --- the simulation's cadence for a controller -----------------------------------------------------------------------


@dataclasses.dataclass
class Scripted:
    """A controller that returns the next target of a script and records what it was shown."""

    interval_s: float
    loop_rules: bool
    script: list[int]
    step_workers: int | None = 1
    calls: list[tuple[float, int, tuple[float, ...], bool]] = dataclasses.field(default_factory=list)

    def decide(self, now: float, active: int, starting_ready_s: Sequence[float], may_remove: bool) -> tuple[int, str]:
        self.calls.append((round(now, 6), active, tuple(round(r, 6) for r in starting_ready_s), may_remove))
        return (self.script.pop(0) if self.script else active), "scripted"


ENGINE = MockEngineConfig(num_gpu_blocks=512, max_model_len=4096)
SOURCE = RequestSource([TraceRow(index=0, input_length=100, output_length=3)], "t", vocab_size=ENGINE.vocab_size,
                       seed=0, output_tokens=3)  # fmt: skip
PULLS = PlannerConfig(no_operation=True, adjustment_interval=1.0, metric_pulling_interval=0.5)


def test_under_the_step_rules_a_controller_decides_every_interval_and_changes_overlap():
    c = Scripted(interval_s=1.0, loop_rules=False, script=[2, 3, 2])
    spec = ScalingSpec(ENGINE, 1, PULLS, startup_s=2.5, controller=c)
    res = simulate(SOURCE, [0.2], spec, planner_from_s=1.0, planner_until_s=5.0)
    # Decisions at 1, 2, 3, 4 (pulls every 0.5 s from 1 s until before 5 s); the second comes while the first
    # worker added is still starting (ready at 3.5), the third removes the newest (added at 2, ready at 4.5).
    assert [call[0] for call in c.calls] == [1.0, 2.0, 3.0, 4.0]
    assert c.calls[1] == (2.0, 2, (3.5,), True)
    assert c.calls[2] == (3.0, 3, (3.5, 4.5), True)
    assert [(a.direction, a.before, a.target, a.decided_s) for a in res.actions] == [
        ("up", 1, 2, 1.0), ("up", 2, 3, 2.0), ("down", 3, 2, 3.0)]  # fmt: skip
    assert res.actions[0].done_s == 3.5 and res.actions[2].done_s == 3.0  # the removed one was idle: gone at once
    assert res.adjustments == 4
    # Each pull samples before the decision at its time: at 3.0 one routed, three held; at 3.5 the first addition
    # is routed and the removed worker is gone.
    by_t = {s.t: s for s in res.samples}
    assert (by_t[3.0].registered, by_t[3.0].held, by_t[3.5].registered, by_t[3.5].held) == (1, 3, 2, 2)


def test_under_the_loop_rules_a_controller_waits_for_a_settled_pool_and_its_grace_period():
    c = Scripted(interval_s=1.0, loop_rules=True, script=[2, 1, 1, 1, 1])
    spec = ScalingSpec(ENGINE, 1, PULLS, startup_s=2.5, controller=c)
    simulate(SOURCE, [0.2], spec, planner_from_s=1.0, planner_until_s=9.0)
    # Added at 1 (ready 3.5): the first settled pull is 3.5, the next decision one interval later, 4.5; then 5.5,
    # 6.5, 7.5, 8.5. The 3 decisions after the addition may not remove; the fourth may.
    assert [call[0] for call in c.calls] == [1.0, 4.5, 5.5, 6.5, 7.5, 8.5]
    assert [call[3] for call in c.calls] == [True, False, False, False, True, True]
    assert NEW_DECODE_WORKER_GRACE_PERIOD == 3


def test_a_controller_may_change_the_pool_by_one_worker_only():
    c = Scripted(interval_s=1.0, loop_rules=False, script=[3])
    with pytest.raises(ValueError, match="one worker at a time"):
        simulate(SOURCE, [0.2], ScalingSpec(ENGINE, 1, PULLS, controller=c), planner_from_s=1.0, planner_until_s=2.0)


def test_the_simulated_clairvoyant_fleet_makes_the_planned_decisions():
    # Step rules: decisions depend only on the oracle's own earlier ones, so the simulation reproduces the plan.
    o = oracle(sinusoid=Sinusoid(15, 30, 0.25, 1.0), peak_workers=4, max_workers=4, interval_s=1.0, startup_s=3.0,
               load_start_s=2.0, grid_s=0.01)  # fmt: skip
    plan = o.plan(2.0, 32.0)
    spec = ScalingSpec(ENGINE, plan.start, PULLS, startup_s=3.0, controller=o)
    res = simulate(SOURCE, [0.2, 5.0], spec, planner_from_s=2.0, planner_until_s=32.0)
    before = [plan.start] + [c for _, c in plan.decisions]
    changes = [(t, c) for (t, c), b in zip(plan.decisions, before, strict=False) if c != b]
    assert changes and [(a.decided_s, a.target) for a in res.actions] == [(pytest.approx(t), c) for t, c in changes]
