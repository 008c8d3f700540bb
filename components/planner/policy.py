"""The planner's decision policy: how many prefill and decode workers the fleet should have, as pure functions over
snapshots (STYLE.md habit 1). No I/O and no clock: time is ``Observation.now_s``; the loop that pulls metrics, the
connectors that start and stop workers, TensorBoard and Prometheus live elsewhere and call in here.

Imports only the standard library and this package's ``config`` (checked by tests/unit/test_layering.py), so the
loop's adapter turns the wire types (``LoadSnapshot``, ``PrefillQueueReport``) into the small dataclasses below.

API
---
``decide(state, observation, config) -> (Adjustment | None, state)``, called once per pull, is all a loop needs: it
records the pull (``observe``) and, once ``adjustment_interval`` has passed since the interval began, decides
(``adjust``) and starts the next interval. ``observe`` and ``adjust`` are public for tests and for a loop that wants
its own cadence. ``PlannerState`` is immutable; every function returns a new one.

What is measured (every pull)
-----------------------------
* Decode (or aggregated) KV-cache use: the mean ``kv_usage`` of the pool's workers whose latest snapshot is fresh by
  the fleet's one staleness rule (``components.fleet.rules``: 5 of the worker's observed report intervals, at least
  0.5 s, 10 s after a single report), i.e. ``now_s < WorkerLoad.stale_at_s`` (on the planner's clock; an engine's own
  ``LoadSnapshot.now_s`` is another process's monotonic clock and cannot be compared). A worker left out (stale, or a
  non-finite value) is named in the interval's decision. A pull where no worker is fresh adds no sample.
* Prefill queue size: the items *waiting* in the prefill queue (``PrefillQueueReport.waiting``), as the fleet view
  reads it from its alive prefill workers' reports (the queue rule: silent for 3 intervals, at least 1 s, a reporter
  stops counting); no alive reporter read it: no sample. Items in flight (in a prefill worker's hands) are not
  counted: a busy worker is not a backlog, and counting it would make any busy fleet look overloaded.

Prefill queue utilisation, as Dynamo's load planner defines it
--------------------------------------------------------------
    utilisation = mean(queue size over the interval's pulls) / number of prefill workers

i.e. items waiting per prefill worker, compared with ``prefill_queue_scale_up_threshold`` (0.5) and
``..._scale_down_threshold`` (0.2). Sources, all in ai-dynamo/dynamo's load planner
``examples/llm/components/planner.py``:

* at commit e3f4bfef70d4dcfd5a761e1029c23e10f21ef6a9 (the version with NEW_DECODE_WORKER_GRACE_PERIOD and
  NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD) each pull appends the NATS stream's queue size and the adjustment takes the
  plain mean; its later revision (seen in the fork linsj20/dynamo at 2c7e6a6ef7657512df8672657c58eb2162ff8738, whose
  ``--prefill-queue-scale-*-threshold`` help says "this threshold is per prefill worker") divides that mean by the
  number of prefill workers. We take the per-worker form: it is the one the thresholds' defaults fit. Dynamo's
  profiler (``utils/profile_sla``, docs/architecture/load_planner.md at 19d1fc5e) recommends the bounds as
  ``ttft_target * 1.2 / ttft_one_prefill - 1`` (and ``* 0.8``), which is the number of prompts one prefill worker may
  have queued ahead of a new one before time to first token passes 120% of target: a per-worker figure.
* Its first version compared a different quantity with the same 0.5/0.2 defaults: the fraction of pulls at which the
  queue was non-empty. Not followed: it cannot tell one waiting item from a hundred.

Decisions (every ``adjustment_interval``), in Dynamo's order
------------------------------------------------------------
1. Proposal per pool, strict comparisons as Dynamo's: decode ``up`` when the interval's mean KV use is above
   ``decode_kv_scale_up_threshold``, ``down`` when below ``decode_kv_scale_down_threshold``; prefill the same on
   utilisation. A value equal to a threshold holds. No samples in the interval: hold, with the reason (habit 3).
2. Prefill trend buffer: a prefill ``up`` is dropped when the queue, extrapolated linearly from the interval's first
   and last samples, is at or under the up-threshold (per worker) ``NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD`` (3)
   intervals after the last sample: by the time a new worker is up the backlog would be gone anyway.
   Where this differs from Dynamo: Dynamo adds 3 x (last - first) to the last raw queue size and compares that raw
   size with the threshold it otherwise applies per worker; here the slope is per second over the samples' own time
   span (first to last pull, which is shorter than the interval by one pull), projected 3 x ``adjustment_interval``
   ahead, floored at 0, and divided by the number of prefill workers like the utilisation it is compared with.
3. Scale-downs first (they free GPUs), then prefill up, then decode up (Dynamo's order: a backed-up prefill queue
   also raises KV use on decode workers, so the prefill pool is fixed first), each bounded:
   * a pool never goes below one worker, nor below ``min_gpu_budget`` GPUs (Dynamo's "minimum GPUs per worker type");
   * a scale-up that would take all pools together past ``max_gpu_budget`` GPUs is refused. GPUs are counted with
     this interval's earlier decisions applied. A fleet already past the budget (a worker added by hand) is not cut
     back, only not grown.
   * decode grace: after a decode worker is added, the next ``NEW_DECODE_WORKER_GRACE_PERIOD`` (3) adjustments do not
     scale decode down (its KV cache starts empty, which pulls the average down). Dynamo arms 3 and decrements in the
     same adjustment, so it holds 2 intervals after the addition; here it is the 3 the name says.
4. At most one worker per pool per interval: each decision is the current count +1, -1 or +0, given as an absolute
   ``target`` (habit 4: connectors set counts; a repeated decision is idempotent).

Change in progress: while any pool has a worker starting (asked for, not yet registered) or leaving (asked to go,
not yet gone), pulls are not recorded and each due adjustment holds every pool with reason "change in progress". The
first settled pull starts a fresh interval, so no average mixes two fleet sizes; the same happens when a pool's size
changes between pulls without the planner (a worker died or was added by hand), as Dynamo discards an interval whose
worker counts changed.

``no_operation``: decisions are computed and reported, flagged ``no_operation`` (``ScalingDecision.apply`` is
False): what the planner *would* do. It arms no grace period, since no worker was added.

Aggregated deployments (``Observation.prefill`` is None): only the decode pool, which is then the aggregated
workers, is scaled, on KV use.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from components.planner.config import PlannerConfig

# Dynamo's names and values (examples/llm/components/planner.py); see the module docstring for how each is used.
NEW_DECODE_WORKER_GRACE_PERIOD = 3  # adjustments without a decode scale-down after a decode worker is added
NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD = 3  # adjustment intervals the prefill queue's trend is projected ahead
# Float slack when comparing elapsed time with the interval: pulls at 0, 1, ..., 30 s must make 30 s, not 29.999...
_TIME_EPS_S = 1e-9


class Pool(enum.StrEnum):
    DECODE = "decode"  # decode workers, or the aggregated workers of a deployment without a prefill pool
    PREFILL = "prefill"


class Direction(enum.StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


# --------------------------------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass(frozen=True, slots=True)
class PoolView:
    """One pool as the connector and discovery see it now."""

    workers: int  # registered and serving (a leaving decode worker has already left discovery: not counted)
    starting: int = 0  # asked for, not registered yet
    leaving: int = 0  # asked to go, not gone yet
    gpus_per_worker: int | None = None  # the graph group's gpus_per_replica (0 counts as 1); None: the config's

    @property
    def changing(self) -> bool:
        return self.starting > 0 or self.leaving > 0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The latest load snapshot of one decode (or aggregated) worker."""

    worker_id: int
    kv_usage: float  # LoadSnapshot.kv_usage: active blocks / total blocks
    received_s: float  # when the planner received it, on the planner's clock (the one Observation.now_s is on)
    stale_at_s: float  # from when it counts as stale, by the fleet's rule (components.fleet.rules.stale_at)


@dataclasses.dataclass(frozen=True, slots=True)
class QueueReading:
    """The prefill queue as the freshest alive reporter read it (PrefillQueueReport); absent when none did."""

    waiting: int  # items not yet handed to a prefill worker: the queue size
    in_flight: int  # items in a prefill worker's hands (reported, not used by the rule)
    received_s: float  # planner's clock


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    """Everything one pull sees. ``prefill`` is None for an aggregated deployment."""

    now_s: float
    decode: PoolView
    prefill: PoolView | None = None
    loads: tuple[WorkerLoad, ...] = ()
    queue: QueueReading | None = None

    @property
    def aggregated(self) -> bool:
        return self.prefill is None


@dataclasses.dataclass(frozen=True, slots=True)
class PullFigures:
    """One pull's numbers (what a loop plots at every pull)."""

    now_s: float
    kv_usage: float | None  # mean over fresh decode workers; None: none fresh
    workers_reporting: int
    left_out: tuple[int, ...]  # decode worker ids left out of this pull: stale or non-finite
    queue_waiting: int | None  # None: no fresh report, or no prefill pool
    queue_utilisation: float | None  # queue_waiting / prefill workers; None: unknown or no prefill worker
    gpus: int  # GPUs the registered workers of all pools use


def worker_gpus(view: PoolView, engine_num_gpu: int) -> int:
    """GPUs one worker of ``view`` counts for in the budget: the deployment's figure if it gave one, else the config's
    ``*_engine_num_gpu``; 0 (a simulated worker on no GPU) counts as 1, so the budget still bounds the fleet."""
    return max(1, engine_num_gpu if view.gpus_per_worker is None else view.gpus_per_worker)


def _gpus(obs: Observation, config: PlannerConfig) -> tuple[int, int]:
    """(GPUs per decode worker, GPUs per prefill worker)."""
    prefill = worker_gpus(obs.prefill, config.prefill_engine_num_gpu) if obs.prefill else 0
    return worker_gpus(obs.decode, config.decode_engine_num_gpu), prefill


def gpus_in_use(obs: Observation, config: PlannerConfig) -> int:
    per_decode, per_prefill = _gpus(obs, config)
    return obs.decode.workers * per_decode + (obs.prefill.workers * per_prefill if obs.prefill else 0)


def pull_figures(obs: Observation, config: PlannerConfig) -> PullFigures:
    # Fresh strictly before stale_at_s: components.fleet.rules.is_fresh, inline (this module imports no package).
    fresh = [w.kv_usage for w in obs.loads if obs.now_s < w.stale_at_s and math.isfinite(w.kv_usage)]
    left_out = tuple(
        sorted(w.worker_id for w in obs.loads if not (obs.now_s < w.stale_at_s and math.isfinite(w.kv_usage)))
    )
    waiting: int | None = None
    if obs.prefill is not None and obs.queue is not None:
        waiting = obs.queue.waiting
    utilisation = None
    if waiting is not None and obs.prefill is not None and obs.prefill.workers > 0:
        utilisation = waiting / obs.prefill.workers
    return PullFigures(
        now_s=obs.now_s,
        kv_usage=sum(fresh) / len(fresh) if fresh else None,
        workers_reporting=len(fresh),
        left_out=left_out,
        queue_waiting=waiting,
        queue_utilisation=utilisation,
        gpus=gpus_in_use(obs, config),
    )


# --------------------------------------------------------------------------------------------------------------------
# State and outputs


@dataclasses.dataclass(frozen=True, slots=True)
class PlannerState:
    """What the planner carries between pulls. Start with ``PlannerState()``."""

    interval_start_s: float | None = None  # None: no pull yet
    fleet: tuple[int, int | None] | None = None  # (decode, prefill) workers the interval's samples describe
    kv: tuple[float, ...] = ()  # one mean KV use per pull that had a fresh decode worker
    queue: tuple[tuple[float, int], ...] = ()  # (now_s, waiting) per pull that had a fresh queue report
    pulls: int = 0  # pulls recorded this interval
    left_out: frozenset[int] = frozenset()  # decode workers left out of at least one pull this interval
    paused: bool = False  # a change is in progress: nothing is recorded
    decode_grace: int = 0  # adjustments left without a decode scale-down
    note: str = ""  # why the current interval started late (shown in the next adjustment)
    last_pull: PullFigures | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingDecision:
    """One pool's decision: an absolute ``target`` worker count, why, and the numbers behind it."""

    pool: Pool
    direction: Direction
    current: int
    target: int
    reason: str
    metrics: Mapping[str, float]
    no_operation: bool = False  # True: what the planner would do; nothing to apply

    @property
    def apply(self) -> bool:
        """Whether a connector should act on it."""
        return self.direction != Direction.HOLD and not self.no_operation

    def summary(self) -> str:
        if self.direction == Direction.HOLD:
            return f"{self.pool}: hold at {self.current} ({self.reason})"
        verb = "would scale" if self.no_operation else "scale"
        return f"{self.pool}: {verb} {self.direction} {self.current} -> {self.target} ({self.reason})"


@dataclasses.dataclass(frozen=True, slots=True)
class Adjustment:
    """One adjustment interval's decisions: one per pool (decode first, then prefill if there is a prefill pool)."""

    now_s: float
    decisions: tuple[ScalingDecision, ...]
    gpus_before: int
    gpus_after: int  # with the decisions applied (also under no_operation: what it would be)
    no_operation: bool
    note: str = ""

    def decision(self, pool: Pool) -> ScalingDecision | None:
        return next((d for d in self.decisions if d.pool == pool), None)

    def changes(self) -> tuple[ScalingDecision, ...]:
        """The decisions a connector should apply (none under no_operation)."""
        return tuple(d for d in self.decisions if d.apply)


# --------------------------------------------------------------------------------------------------------------------
# Per pull


def _fleet(obs: Observation) -> tuple[int, int | None]:
    return obs.decode.workers, None if obs.prefill is None else obs.prefill.workers


def _in_progress(obs: Observation) -> str:
    """'' when settled, else what is changing (for the reason)."""
    parts = []
    for pool, view in ((Pool.DECODE, obs.decode), (Pool.PREFILL, obs.prefill)):
        if view is not None and view.changing:
            parts.append(f"{pool} {view.starting} starting, {view.leaving} leaving")
    return "; ".join(parts)


def observe(state: PlannerState, obs: Observation, config: PlannerConfig) -> PlannerState:
    """Record one pull. While a change is in progress nothing is recorded; the first settled pull after it, or after
    the fleet changed size, starts a new interval."""
    if _in_progress(obs):
        start = state.interval_start_s if state.paused and state.interval_start_s is not None else obs.now_s
        return PlannerState(interval_start_s=start, paused=True, decode_grace=state.decode_grace)
    fleet = _fleet(obs)
    if state.paused or state.interval_start_s is None or state.fleet != fleet:
        note = ""
        if state.paused:
            note = f"interval started at {obs.now_s:g} s, when the change in progress completed"
        elif state.fleet is not None:
            note = f"interval restarted at {obs.now_s:g} s: workers (decode, prefill) went {state.fleet} -> {fleet}"
        state = PlannerState(interval_start_s=obs.now_s, fleet=fleet, decode_grace=state.decode_grace, note=note)
    figures = pull_figures(obs, config)
    return dataclasses.replace(
        state,
        kv=state.kv if figures.kv_usage is None else (*state.kv, figures.kv_usage),
        queue=state.queue if figures.queue_waiting is None else (*state.queue, (obs.now_s, figures.queue_waiting)),
        pulls=state.pulls + 1,
        left_out=state.left_out | frozenset(figures.left_out),
        last_pull=figures,
    )


def adjustment_due(state: PlannerState, now_s: float, config: PlannerConfig) -> bool:
    if state.interval_start_s is None:
        return False
    # Due at the pull scheduled one interval on: half a pull of slack, since a live pull's clock reading follows an
    # etcd round trip and one a few ms quicker than the interval's first would otherwise wait a whole pull (seen in
    # kvmesh bench planner-live: live decisions 11 s apart in about half of the 10 s intervals). Pulls on an exact
    # grid (the simulator) decide at the same pulls as with no slack.
    return now_s - state.interval_start_s >= config.adjustment_interval - _due_slack_s(config.metric_pulling_interval)


def _due_slack_s(pull_interval_s: float) -> float:
    return max(_TIME_EPS_S, 0.5 * pull_interval_s)


# --------------------------------------------------------------------------------------------------------------------
# Per interval


@dataclasses.dataclass(frozen=True, slots=True)
class _Proposal:
    direction: Direction
    reason: str
    metrics: dict[str, float]


def _decode_proposal(state: PlannerState, obs: Observation, config: PlannerConfig) -> _Proposal:
    who = "aggregated" if obs.aggregated else "decode"
    metrics: dict[str, float] = {
        "up_threshold": config.decode_kv_scale_up_threshold,
        "down_threshold": config.decode_kv_scale_down_threshold,
        "pulls": state.pulls,
        "pulls_with_kv": len(state.kv),
        "workers": obs.decode.workers,
        "workers_left_out": len(state.left_out),
    }
    left = f"; left out (stale snapshot by the fleet's staleness rule): workers {sorted(state.left_out)}"
    left = left if state.left_out else ""
    if not state.kv:
        return _Proposal(
            Direction.HOLD,
            f"missing metrics: no fresh KV-cache snapshot from any {who} worker in {state.pulls} pulls{left}",
            metrics,
        )
    kv = sum(state.kv) / len(state.kv)
    metrics["kv_usage"] = kv
    seen = f"average KV-cache use of {who} workers {kv:.3f} over {len(state.kv)} of {state.pulls} pulls"
    if kv > config.decode_kv_scale_up_threshold:
        return _Proposal(Direction.UP, f"{seen} > up-threshold {config.decode_kv_scale_up_threshold}{left}", metrics)
    if kv < config.decode_kv_scale_down_threshold:
        return _Proposal(
            Direction.DOWN, f"{seen} < down-threshold {config.decode_kv_scale_down_threshold}{left}", metrics
        )
    return _Proposal(
        Direction.HOLD,
        f"{seen} within [{config.decode_kv_scale_down_threshold}, {config.decode_kv_scale_up_threshold}]{left}",
        metrics,
    )


def _prefill_proposal(state: PlannerState, view: PoolView, config: PlannerConfig) -> _Proposal:
    up, down = config.prefill_queue_scale_up_threshold, config.prefill_queue_scale_down_threshold
    metrics: dict[str, float] = {
        "up_threshold": up,
        "down_threshold": down,
        "pulls": state.pulls,
        "pulls_with_queue": len(state.queue),
        "workers": view.workers,
    }
    if view.workers == 0:
        # Utilisation is per worker: undefined with none. Decode workers prefill locally while no prefill worker is
        # alive (router/policies/disagg.py), and the deployment restarts dead ones; nothing here to scale from.
        return _Proposal(Direction.HOLD, "no prefill worker registered: queue utilisation undefined", metrics)
    if not state.queue:
        return _Proposal(
            Direction.HOLD, f"missing metrics: no fresh prefill queue report in {state.pulls} pulls", metrics
        )
    sizes = [q for _, q in state.queue]
    mean = sum(sizes) / len(sizes)
    utilisation = mean / view.workers
    metrics |= {"queue_waiting": mean, "queue_utilisation": utilisation}
    seen = (
        f"prefill queue utilisation {utilisation:.3f} ({mean:.2f} items waiting on average / {view.workers} "
        f"workers, {len(sizes)} of {state.pulls} pulls)"
    )
    if utilisation > up:
        (t0, q0), (t1, q1) = state.queue[0], state.queue[-1]
        slope = (q1 - q0) / (t1 - t0) if t1 > t0 else 0.0
        horizon_s = NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD * config.adjustment_interval
        predicted = max(0.0, q1 + slope * horizon_s) / view.workers
        metrics |= {"queue_trend_per_s": slope, "predicted_utilisation": predicted}
        if predicted <= up:
            return _Proposal(
                Direction.HOLD,
                f"{seen} > up-threshold {up}, but the queue's trend ({q0} -> {q1} items, {slope:+.3f}/s) brings it "
                f"to {predicted:.3f} <= {up} within {NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD} intervals "
                f"({horizon_s:g} s)",
                metrics,
            )
        return _Proposal(
            Direction.UP,
            f"{seen} > up-threshold {up}; trend ({q0} -> {q1} items) keeps it at {predicted:.3f} in "
            f"{NEW_PREFILL_WORKER_QUEUE_BUFFER_PERIOD} intervals",
            metrics,
        )
    if utilisation < down:
        return _Proposal(Direction.DOWN, f"{seen} < down-threshold {down}", metrics)
    return _Proposal(Direction.HOLD, f"{seen} within [{down}, {up}]", metrics)


def adjust(state: PlannerState, obs: Observation, config: PlannerConfig) -> tuple[Adjustment, PlannerState]:
    """Decide for every pool from the interval's samples, and start the next interval at ``obs.now_s``."""
    now = obs.now_s
    gpus = gpus_in_use(obs, config)
    views = [(Pool.DECODE, obs.decode)] + ([(Pool.PREFILL, obs.prefill)] if obs.prefill is not None else [])
    changing = _in_progress(obs)
    if changing or state.paused:
        reason = f"change in progress: {changing}" if changing else "change in progress"
        holds = tuple(
            ScalingDecision(pool, Direction.HOLD, v.workers, v.workers, reason, {}, config.no_operation)
            for pool, v in views
        )
        # The next hold comes one interval later; the first settled pull starts a real interval (observe).
        paused = dataclasses.replace(state, interval_start_s=now, paused=True)
        return Adjustment(now, holds, gpus, gpus, config.no_operation, state.note), paused

    per_decode, per_prefill = _gpus(obs, config)
    per_worker = {Pool.DECODE: per_decode, Pool.PREFILL: per_prefill}
    proposals = {Pool.DECODE: _decode_proposal(state, obs, config)}
    if obs.prefill is not None:
        proposals[Pool.PREFILL] = _prefill_proposal(state, obs.prefill, config)
    current = {pool: v.workers for pool, v in views}
    final = {pool: (prop.direction, prop.reason) for pool, prop in proposals.items()}
    total = gpus

    # Scale-downs first: they free GPUs for this interval's scale-ups.
    for pool in (Pool.PREFILL, Pool.DECODE):
        if pool not in proposals or proposals[pool].direction != Direction.DOWN:
            continue
        reason = proposals[pool].reason
        remaining_gpus = (current[pool] - 1) * per_worker[pool]
        if pool == Pool.DECODE and state.decode_grace > 0:
            final[pool] = (
                Direction.HOLD,
                f"{reason}, but a decode worker was added recently: no decode scale-down for "
                f"{NEW_DECODE_WORKER_GRACE_PERIOD} intervals after one is added ({state.decode_grace} left, this "
                "one included)",
            )
        elif current[pool] - 1 < 1:
            final[pool] = (Direction.HOLD, f"{reason}, but the pool is at one worker, its floor")
        elif remaining_gpus < config.min_gpu_budget:
            final[pool] = (
                Direction.HOLD,
                f"{reason}, but {current[pool] - 1} workers would use {remaining_gpus} GPUs < min_gpu_budget "
                f"{config.min_gpu_budget}",
            )
        else:
            total -= per_worker[pool]

    # Then scale-ups, prefill before decode, within the budget.
    for pool in (Pool.PREFILL, Pool.DECODE):
        if pool not in proposals or proposals[pool].direction != Direction.UP:
            continue
        if total + per_worker[pool] > config.max_gpu_budget:
            final[pool] = (
                Direction.HOLD,
                f"{proposals[pool].reason}, but one more {pool} worker ({per_worker[pool]} GPUs) would use "
                f"{total + per_worker[pool]} GPUs > max_gpu_budget {config.max_gpu_budget}",
            )
        else:
            total += per_worker[pool]

    decisions = []
    for pool, view in views:
        direction, reason = final[pool]
        step = {Direction.UP: 1, Direction.DOWN: -1, Direction.HOLD: 0}[direction]
        metrics = {
            **proposals[pool].metrics,
            "gpus_per_worker": per_worker[pool],
            "gpus_before": gpus,
            "gpus_after": total,
            "max_gpu_budget": config.max_gpu_budget,
            "min_gpu_budget": config.min_gpu_budget,
        }
        if pool == Pool.DECODE:
            metrics["grace_left"] = state.decode_grace
        decisions.append(
            ScalingDecision(pool, direction, view.workers, view.workers + step, reason, metrics, config.no_operation)
        )

    added_decode = final[Pool.DECODE][0] == Direction.UP and not config.no_operation
    grace = NEW_DECODE_WORKER_GRACE_PERIOD if added_decode else max(0, state.decode_grace - 1)
    adjustment = Adjustment(now, tuple(decisions), gpus, total, config.no_operation, state.note)
    return adjustment, PlannerState(interval_start_s=now, fleet=_fleet(obs), decode_grace=grace)


def decide(state: PlannerState, obs: Observation, config: PlannerConfig) -> tuple[Adjustment | None, PlannerState]:
    """Call once per pull: records it, and returns an ``Adjustment`` when the adjustment interval has passed."""
    state = observe(state, obs, config)
    if not adjustment_due(state, obs.now_s, config):
        return None, state
    return adjust(state, obs, config)
