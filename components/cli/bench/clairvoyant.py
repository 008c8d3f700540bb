"""The clairvoyant fleet of ``kvmesh bench planner``: the best a planner bound by the planner's rules could do, given
a perfect signal.

It knows the load's rate function (the ``Sinusoid``) and the peak fleet's measured capacity per worker (the capacity
of ``peak_workers`` divided by that number), so it knows how many workers the load needs at any time at a stated
target utilisation ``u`` of that capacity:

    need(t) = ceil(fraction(t) x peak_workers / u), within [1, max_workers]

(the warm-up before ``load_start_s`` runs at the trough; after the load's end the need is the one-worker floor). At
each of its decisions it sets the pool size so that every worker is registered when the need asks for it, and no
worker is held longer than the need and the rules force, while obeying what the planner must:

* decisions every ``interval_s`` (the planner's adjustment interval), at most one worker added or removed at each;
* a new worker holds its GPU from the decision and takes requests ``startup_s`` later; a removed one leaves routing
  at once and holds its GPU until it has drained (the simulation's modelled connector does both, as for the
  planner);
* the GPU budget (``max_workers``) and the one-worker floor;
* with ``loop_rules`` also the planner loop's own: no decision while a change is in progress, the next one a whole
  interval after the first pull that finds the pool settled (so one addition per ``startup_s + interval_s``), and no
  scale-down in the ``NEW_DECODE_WORKER_GRACE_PERIOD`` (3) adjustments after an addition (the simulation enforces
  both; ``decide`` plans with the longer spacing between additions).

The schedule is greedy with exact lookahead over a grid of ``grid_s``: it adds a worker at a decision exactly when
waiting for the next decision would leave some future moment short of its need even with one addition at every
decision from then on ("just in time"), and removes one whenever the pool one smaller still meets every future need
with additions from the next decision on ("as early as allowed"). Adding later, or removing earlier, would leave some
moment short of its need. (With ``loop_rules`` the lookahead takes the next decision after a removal to come one
interval later; the drain before it is not known in advance: seconds here, against 10-30 s intervals.) The start fleet
is the smallest from which that schedule meets every need (``start_workers``): an operator who knows the load sets it
before the load starts.

Whether meeting the need at a utilisation also meets the latency SLO is what the simulation measures: a fleet run at
``u`` = 1.0 is, per worker, as loaded as the peak fleet at the peak that set the SLO.

Several workers per decision (``step_workers``: a number, or None for no limit) is the same schedule with each
addition and removal counted in up to that many workers: it adds at a decision the largest shortfall that waiting
for the next decision would leave (at most ``step_workers``), and removes as many as the pool can lose while later
additions still meet every need (at most ``step_workers``): the clairvoyant counterpart of the SLA planner, which
moves several workers per step. At ``step_workers`` 1 it is the schedule above, decision for decision.

Any ``scaling.LoadShape`` works as the load (the field keeps its first name, ``sinusoid``): the schedule reads only
its ``fraction``, ``duration_s`` and ``start``.

Pure: the simulation (``scaling.simulate``, through its ``Controller`` protocol) calls ``decide`` at each decision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from components.cli.bench.scaling import LoadShape, worker_seconds
from components.planner.policy import NEW_DECODE_WORKER_GRACE_PERIOD

_EPS = 1e-9


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The schedule ``decide`` makes on its own (``Oracle.plan``): the start pool, each decision's time and the pool
    size after it, and each worker's span (held from its addition until its removal: drained at once)."""

    start: int
    decisions: tuple[tuple[float, int], ...]
    spans: tuple[tuple[float, float | None], ...]

    def worker_seconds(self, t0: float, t1: float) -> float:
        return worker_seconds(self.spans, t0, t1)


@dataclasses.dataclass(frozen=True, slots=True)
class Oracle:
    """One clairvoyant schedule (module docstring); times are on the simulation's clock."""

    sinusoid: LoadShape  # the load, as a fraction of the peak fleet's measured capacity (any shape)
    load_start_s: float  # the simulation time of the sinusoid's t = 0 (the warm-up, at its trough, runs before)
    peak_workers: int  # the peak fleet whose capacity the sinusoid is a fraction of
    utilisation: float  # target load per worker, as a fraction of its measured capacity
    interval_s: float  # a decision every this often, one worker at most
    startup_s: float  # from an addition until the worker takes requests
    max_workers: int  # the GPU budget, in workers
    loop_rules: bool = False  # also the planner loop's pause while a change is in progress and its grace period
    grid_s: float = 0.1  # the lookahead's resolution
    step_workers: int | None = 1  # workers one decision may add or remove; None: any number
    # ``need`` by moment: the lookaheads of successive decisions overlap (a ~300 s horizon on a 0.1 s grid, a
    # decision every second at the finest), so most of their moments were computed before.
    _needs: dict[float, int] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (0 < self.utilisation <= 1.0):
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation}")
        if not (self.interval_s > 0 and self.startup_s >= 0 and self.grid_s > 0):
            raise ValueError(f"bad oracle timing: interval {self.interval_s}, startup {self.startup_s}")
        if self.peak_workers < 1 or self.max_workers < 1:
            raise ValueError(f"bad oracle fleet: peak {self.peak_workers}, max {self.max_workers}")
        if self.step_workers is not None and self.step_workers < 1:
            raise ValueError(f"step_workers must be >= 1 or None, got {self.step_workers}")

    @property
    def add_every_s(self) -> float:
        """The shortest time between two additions: one interval, or with the loop's pause the start-up too."""
        return self.interval_s + (self.startup_s if self.loop_rules else 0.0)

    def need(self, t: float) -> int:
        """Workers the load at simulation time ``t`` needs at the target utilisation (module docstring)."""
        got = self._needs.get(t)
        if got is not None:
            return got
        x = t - self.load_start_s
        if x >= self.sinusoid.duration_s:
            got = 1
        else:
            frac = self.sinusoid.start if x < 0 else self.sinusoid.fraction(x)
            got = min(self.max_workers, max(1, math.ceil(frac * self.peak_workers / self.utilisation - _EPS)))
        self._needs[t] = got
        return got

    def ready_by(self, t: float, first_s: float) -> int:
        """Workers registered by ``t`` when ``step_workers`` are added at ``first_s`` and at every chance after it
        (with no limit per step, the budget at the first chance: no need can ask for more)."""
        if t < first_s + self.startup_s - _EPS:
            return 0
        if self.step_workers is None:
            return self.max_workers
        return self.step_workers * (math.floor((t - first_s - self.startup_s) / self.add_every_s + _EPS) + 1)

    def horizon(self, now: float) -> list[float]:
        """The moments the lookahead checks: far enough that a need beyond it can still be met by later additions
        from an empty start (the start-up plus one addition per chance up to the budget)."""
        span = self.startup_s + self.add_every_s * (self.max_workers + 1)
        return [now + i * self.grid_s for i in range(math.ceil(span / self.grid_s) + 1)]

    def start_workers(self, first_decision_s: float) -> int:
        """The smallest pool at ``first_decision_s`` from which adding at every decision meets every need."""
        short = max(self.need(t) - self.ready_by(t, first_decision_s) for t in self.horizon(first_decision_s))
        return min(self.max_workers, max(1, short))

    def plan(self, first_decision_s: float, until_s: float) -> Plan:
        """The schedule from ``start_workers(first_decision_s)`` with a decision every interval (the loop rules:
        after an addition, its start-up and then an interval; no removal in the grace period) until ``until_s``,
        when a removed worker drains at once. The simulation makes the same decisions under the step rules, whose
        decisions do not depend on draining; only its held worker-seconds add the drains."""
        start = self.start_workers(first_decision_s)
        ready = [first_decision_s] * start  # registration times of the pool's workers, in the order added
        held = [first_decision_s] * start  # when each of them was asked for
        spans: list[tuple[float, float | None]] = []
        decisions: list[tuple[float, int]] = []
        t, grace = first_decision_s, 0
        while t < until_s - _EPS:
            starting = [r for r in ready if r > t + _EPS]
            target, _ = self.decide(t, len(ready), starting, may_remove=grace == 0)
            grace = max(0, grace - 1)
            nxt = t + self.interval_s
            if target > len(ready):
                for _ in range(target - len(ready)):
                    ready.append(t + self.startup_s)
                    held.append(t)
                if self.loop_rules:
                    grace = NEW_DECODE_WORKER_GRACE_PERIOD
                    nxt = t + self.startup_s + self.interval_s
            while target < len(ready):
                ready.pop()
                spans.append((held.pop(), t))
            decisions.append((t, len(ready)))
            t = nxt
        spans.extend((h, None) for h in held)
        return Plan(start, tuple(decisions), tuple(spans))

    def least_worker_seconds(self, t0: float, t1: float) -> float:
        """A lower bound on the worker-seconds within [t0, t1] of *any* schedule under these rules that routes at least
        ``need(t)`` workers at every t in [t0, t1] (not only this greedy one's), so ``1 - bound / peak`` bounds the
        saving from above.

        The routed count r changes only when a worker registers (additions are at least ``add_every_s`` apart, so at
        most ``floor(d / add_every_s) + 1`` registrations fall in any d seconds) or is removed (at most
        ``floor(d / interval_s) + 1``). So for s after t, r(t) >= need(s) - floor((s - t) / add_every_s) - 1, and
        for s before t, r(t) >= need(s) - floor((t - s) / interval_s) - 1: the envelope E(t) over s in [t0, t1].
        With ``step_workers`` m each of those counts is m times as many workers; with no limit, E(t) = need(t).
        A worker routed at t + startup_s was asked for by t and has not left, so it holds a GPU at t: the workers
        held at t are at least max(E(t), E(t + startup_s)). The bound is that integral, on the ``grid_s`` grid.
        """
        n = max(1, math.ceil((t1 - t0) / self.grid_s))
        dt = (t1 - t0) / n
        need = [self.need(t0 + (i + 0.5) * dt) for i in range(n)]
        top = max(need)
        lag = round(self.startup_s / dt)
        m = n + lag  # grid points up to t1 + startup_s; after t1 the need is the floor
        # last[v][i]: the latest point before i with need >= v (or None); first[v][i]: the earliest after i.
        last: dict[int, list[int | None]] = {}
        first: dict[int, list[int | None]] = {}
        for v in range(2, top + 1):
            lv: list[int | None] = [None] * m
            seen: int | None = None
            for i in range(m):
                lv[i] = seen
                if i < n and need[i] >= v:
                    seen = i
            fv: list[int | None] = [None] * m
            seen = None
            for i in range(m - 1, -1, -1):
                fv[i] = seen
                if i < n and need[i] >= v:
                    seen = i
            last[v], first[v] = lv, fv

        per = self.step_workers

        def envelope(i: int) -> int:
            best = need[i] if i < n else 1
            if per is None:
                return best
            for v in range(best + 1, top + 1):
                j, k = last[v][i], first[v][i]
                if j is not None:
                    best = max(best, v - per * (math.floor((i - j) * dt / self.interval_s + _EPS) + 1))
                if k is not None:
                    best = max(best, v - per * (math.floor((k - i) * dt / self.add_every_s + _EPS) + 1))
            return best

        env = [envelope(i) for i in range(m)]
        return sum(max(env[i], env[i + lag]) for i in range(n)) * dt

    def decide(self, now: float, active: int, starting_ready_s: Sequence[float], may_remove: bool) -> tuple[int, str]:
        """The pool size to set at the decision at ``now``, and why: ``active`` workers counted by the connector
        (starting ones included), ``starting_ready_s`` when the starting ones register, ``may_remove`` False in the
        loop rules' grace period."""

        def avail(t: float) -> int:
            if not starting_ready_s:  # most decisions: nothing starting (the sum below, skipped ~3,000 times a call)
                return active
            return active - sum(1 for r in starting_ready_s if r > t + _EPS)

        grid = self.horizon(now)
        nxt = now + self.interval_s
        step = self.max_workers if self.step_workers is None else self.step_workers
        # Only a moment an addition now can reach (its start-up from now) calls for one: before it, nothing helps.
        # ``need`` never exceeds the budget, and by then every starting worker has registered, so a moment short
        # means the pool is below the budget. One worker per step: the first moment short decides (and names the
        # reason); several: the largest shortfall.
        short, first = 0, ""
        reachable_s = now + self.startup_s - _EPS
        for t in grid:
            if t < reachable_s:
                continue
            n = self.need(t)
            gap = n - avail(t) - self.ready_by(t, nxt)
            if gap > 0:
                if not first:
                    first = f"{n} workers needed at {t - self.load_start_s:+.1f} s of the load"
                short = max(short, gap)
                if step == 1:
                    break
        if short > 0:
            target = min(active + min(short, step), self.max_workers)
            return target, f"add: {first}; waiting for the next decision is too late"
        if not may_remove:
            return active, "hold: no scale-down in the grace period after an addition"
        if active <= 1 or starting_ready_s:
            return active, "hold"
        # No worker is starting here, so avail(t) is ``active`` throughout. The spare counts only up to ``step``
        # (the cut is at most that) and only if it is at least 1 everywhere: stop at the first moment it is not (the
        # same decision, without the rest of a horizon of up to ~3,000 moments at 1 s intervals).
        spare = step
        for t in grid:
            spare = min(spare, active + self.ready_by(t, nxt) - self.need(t))
            if spare < 1:
                break
        cut = min(spare, step, active - 1)
        if cut >= 1:
            return (
                active - cut,
                f"remove: {active - cut} workers (and additions from the next decision) meet every need ahead",
            )
        return active, "hold"
