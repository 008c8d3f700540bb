"""The SLA planner's controller: one pull as a function of the fleet view, with no I/O. The same surface as the load
planner's ``components.planner.controller.PlannerController`` (``pull``, ``change_started``, ``change_ended``,
``pending``, ``num_pulls``, ``num_adjustments``, ``in_progress``, ``config.metric_pulling_interval``), so the live
loop and the simulator's ``SimulatedPlanner`` drive either, and it emits the same ``Adjustment``/``ScalingDecision``
(policy.py) so the board, ``kvmesh status`` and ``/metrics`` work unchanged; ``PullOutcome.sla`` adds its numbers.

Pools: ``decode`` is the model's serving workers (decode or aggregated), ``prefill`` its prefill workers when the
model is disaggregated (``FleetSnapshot.disaggregated``), as the load planner counts them.

Throughput loop (every ``adjustment_interval``)
-----------------------------------------------
1. The interval's request reports (``FleetSnapshot.request_window``). None heard (``reports == 0``): no throughput
   decision, every pool holds and the reason says so (STYLE.md habit 3: silence is not zero load). Otherwise the
   predictors observe the interval's request *rate* (requests/s: an interval a pull longer or shorter is not a load
   change), mean prompt length and mean output length (each only when the interval counted one).
2. The forecast: ``predict_ahead(lead + 2)`` interval means for each series, ``lead = ceil(worker_startup_s /
   adjustment_interval)``, read as a rate curve over the span the workers asked for now must serve:
   ``[0, adjustment_interval + worker_startup_s]`` from now (they serve from ``worker_startup_s``; the next
   decision's from ``adjustment_interval + worker_startup_s``; a worker removed now is gone from 0).
   ``startup.horizon_points`` interpolates linearly between the means at their intervals' midpoints (the last
   observed interval's rate before them) and reads the curve where it can peak: now, each midpoint in the span, its
   end. A load rising or falling through an interval is above the interval's mean at one edge (a 150 s sinusoid at
   30 s intervals: by up to 12% of its peak), and a 1.23 s start-up needs only the next 31.23 s covered, not a whole
   interval's lead more. Each point's pool sizes come from ``replicas.prefill_workers`` / ``decode_workers`` with
   the correction factors, and the pool asked for is the most any point needs. A predicted rate of 0 needs
   ``min_endpoint``. A pool whose input is unknown (no output length heard yet) holds, saying so. Predictors warmed
   from a trace (``warm_start``) decide at the first pull from the forecast alone (raising only).
   Aggregated deployment (one pool, ``decode``): its workers do both, so it is sized on the sum of both demands'
   worker fractions, ``ceil(prefill demand / (rho x one worker's prefill throughput) + decode demand / one
   worker's decode throughput)``: a worker's time is shared between prefill chunks and decode steps, and a mixed
   step costs about the sum of its parts (``StepTimeModel.step_ms``; slightly conservative, since it counts the
   fixed cost of both).
3. Corrections (unless ``no_correction``): ``correction.update_correction`` with the interval's observed mean TTFT
   and ITL against the mean of what the fast loop predicted (uncorrected) at the interval's pulls: TTFT including
   queue wait, so the factor corrects the engine's speed and not queueing the model already counts (the larger of
   the pools' TTFTs at each pull, for a disaggregated model); ITL as the mean step the tokens saw: its decode part
   from each worker's step in progress at each pull, weighted by the tokens it sends (``itl.py``: a mean over pulls
   weighs a step by its time, and a long prefill chunk step sends no more tokens than a short decode step), and its
   prefill chunks' part in expectation from the prompts the interval prefilled (``_predicted_itl_ms``,
   ``itl.expected_step_ms``; a disaggregated decode pool's chunks sampled from the reports). An interval without a
   prediction (no prompt length known yet) or an observation keeps the factor, and so does one in which any
   worker's predicted TTFT went over target at a pull: while a queue builds or drains, the first tokens sent in an
   interval are of prompts that waited behind an earlier queue than the pulls saw, so the ratio measures the
   queue's history (a draining backlog read 4x, the bound, on a 150 s sinusoid in the simulator), not the engine's
   speed. An interval whose pulls caught no worker decoding, though tokens were sent, predicts ITL as a lone
   sequence's step at the mean context (else a factor raised in a burst would stay up through the quiet after it).
   The ITL factor is applied through a deadband (``itl_correction_deadband``, ``correction.deadband``): within 5% of
   1 it sizes as 1, beyond by its excess. Its estimate is a handful of sampled steps, a few percent apart between
   runs 2 ms apart, and the batch that meets the target is a step function of it; the TTFT factor sizes prefill
   continuously (tokens/s at a utilisation), with no such step, and is applied as measured.
4. Several workers per step: the new size is absolute, not one worker at a time. A pool the throughput loop cannot
   size (no output length heard yet) holds at its decision, but the fast loop's raise at that pull stands.

Fast loop (every pull)
----------------------
Each fresh worker's predicted TTFT for a prompt of the latest mean length, its queue wait included
(``components.perf.queueing.predicted_ttft_ms``: the router's model), and its predicted ITL (the decode step at its
reported ``batch_size`` and ``num_kv_tokens``), both corrected; the pool's figure is the mean over its fresh workers
(the router spreads the load; one busy worker is the router's business, a busy pool the planner's). A
disaggregated model's prefill workers pull from one shared queue (``FleetSnapshot.queue``), so the prefill pool's
TTFT counts each worker an even share of its waiting prompts; its decode workers' TTFT is that of the prompts they
prefill themselves (short ones, and long ones the full queue turned away), which only they drain. When a pool's
mean breaks a target the pool is raised, above the throughput loop's size, never below it:

* TTFT: to the throughput sizing of the last ``FAST_WINDOW_PULLS`` pulls' request rate (3 s at the default pull: a
  step in the load is seen within seconds, not at the next decision), or of each frontend's latest report in it when
  that is higher (a step's first second: the 3 s window still holds the level before it, and read 4.0, 7.5, then
  11.5 requests/s on a step to 9.45, one decision a pull, where each second the pool is short queues ~9 long
  prompts on it). Before any request finished (no output length heard: a burst's first second on a cold pool)
  an aggregated pool is sized on its prompts' share alone, a lower bound: the queue that breaks TTFT is of prompts,
  and waiting for an output length let a burst's first prompts break the target before the raise.
  Not by spreading the queue: the queued prompts stay on the workers that hold them, so new workers only take new
  arrivals, and a pool sized for a backlog would be too large once it drains. But for the same reason the workers
  holding it are not there for new arrivals while they drain it, which a sizing on the rate alone counts them for
  (aggregated pools; a disaggregated prefill pool's queue is shared, and new prefill workers drain it too): until a
  worker asked for now comes, ``worker_startup_s`` on, every arrival goes to the current n workers, so they will
  hold ``B = queued prompts + (rate - n / r) x startup`` prompts then (``r``: one request's workers' worth, the
  sizing's own, linear in the rate; not below 0), and over the next ``adjustment_interval`` (the raised pool stands
  at least until the next decision) that backlog takes ``min(n, B x r / interval)`` workers' worth from new arrivals.
  The raise is ``ceil(rate x r + that)``, at most n more than on the rate alone. On the step (1 -> 10.3
  requests/s of 8,000-token prompts, 30 s start-up; ``kvmesh bench planner --load step --seed 4``) the first full
  second's report said 9.0 requests/s, 6.24 workers' worth: 7 of the 8 the load needs, and the 8th a pull later;
  the one worker would still hold 236 prompts when the new ones came, so 7.24 -> 8 at that pull. A 1.23 s start-up
  leaves a backlog of a few prompts, a small fraction of a worker over an interval.
  An aggregated pool's raise also reads the rate from its workers' load reports: they report at every pull, and no
  prompt leaves a queue but into service, so the prompts by which the queued prompt tokens grew since the last pull
  (same pool, every worker reporting) over its seconds are a floor on the arrival rate; and no request leaves an
  engine but by finishing, so the requests the workers hold, queued or running, grew by no more than the arrivals
  either. The raise takes the larger floor when it is above the reports' rate. The queue alone misses the prompts
  taken into service over the pull: on the step one worker prefills ~6 of the 8,000-token prompts a second, so its
  queue grew by 2.9-5.9 prompts in the step's first second where its requests grew by 9-12 (seeds 3-5).
  A frontend's report of the second that just ended may land just after the pull: on the
  step the pull a second after it read the second before (~0.4 requests/s, the pool "served") while 3-6 prompts had
  queued, and added one worker on the queue's trend (kvmesh bench planner --load step, seeds 3-5: then 1 -> 3, 4
  or 6 at that pull on the queue's 2.9-5.9 requests/s of growth; 1 -> 8, 7, 8 on the requests' 12, 9, 11).
  When that sizing says the pool
  suffices (or nothing was heard) but the queue will not
  be back within target an adjustment interval from now at its recent pace (the last ``FAST_TREND_PULLS`` pulls'
  mean wait against the 5 before's, extrapolated; same pool, every worker reporting, no change in progress): one
  more worker, and again only after another 10 settled pulls. That covers a model off for this engine (the queue
  grows where it should not) and a backlog the pool's spare capacity drains too slowly (a burst's, left on the
  workers that hold it: more workers take more of the new arrivals off them). No raise when a prompt alone is over
  the target (no pool size helps), with the reason.
* ITL: to the smallest size at which each worker's share of the pool's current batch and KV steps within target
  (the concurrency is what it is; spread over more workers each steps faster), at most ``_FAST_MAX_FACTOR`` x. The
  pool is counted as asked for: a worker of an addition in progress takes its share of the batch before it
  registers, as one that registered and decodes nothing yet does. A breach at the target's edge (one sequence fewer
  per worker steps within it) is raised only once it held ``ITL_RAISE_PULLS`` pulls at one size with every worker
  asked for registered; beyond the edge, at the pull that sees it. The trigger is the decode step alone, as the
  replica formula sizes it; the prefill chunk a worker's own queue adds to its steps is that backlog's, which the
  TTFT rule handles. The ITL reported (``SlaFigures.predicted_itl_s``) and compared with the frontends' for the
  correction is the whole step a token sees, the chunk the step computes included (the report's
  ``num_prefill_tokens``; the queue only where an engine does not say), weighted by the tokens each worker's step
  sends (``itl.py``), so that a prefill burst does not read as a slow decode engine.

The next throughput decision may bring a raised pool back down only through the consolidation check.

Scale-down
----------
Never below what the interval just observed needs: a removal is sized on the larger of the forecast and the
interval's observed rate, prompt and output length (the replica formulas on each, the larger pool), both times
``1 + scale_down_tolerance`` (10%, the Kubernetes autoscaler's tolerance: a need at a pool-size boundary, 7.0
workers' worth with a few percent of noise, would otherwise take the pool 7 -> 8 -> 7 -> 8), and never below what
the forecasts or fast-loop raises of the last ``scale_down_window`` intervals asked for (one by default: a
stabilisation window, as the Kubernetes autoscaler keeps one for scale-down; a Kalman forecast overshooting a step a
decision after the removal would put the worker back). A forecast
that lags a step (the Kalman filter, the interval after a step, still below the new level) would otherwise take
away workers the load is using, and the next decision, the forecast caught up, would add them back: up, down and up
at a constant load (``kvmesh bench planner --load step``, 1.23 s start-up: 8 -> 6 -> 8 in two decisions). Additions
still follow the forecast alone (ahead of the load). Then only through
``consolidation.consolidation_check``: from N, each survivor re-predicted with N/(N-1) of the load (KV
use, ITL, TTFT against target x ``scale_down_sensitivity``); repeated step by step (the survivors' loads scaled each
time) down to the wanted size or the first refusal, whose reason (naming the constraint: KV, ITL or TTFT) is the
decision's. A disaggregated prefill pool's workers are checked with their even shares of the shared queue (no
queue reading: refused, saying so). No removal is decided while a change is in progress (the loads describe a fleet
in motion), nor from a pool whose fast-loop TTFT or ITL is over target at that pull (the reason names it).

Atomic budget
-------------
``budget.plan_budget`` turns the wanted sizes into counts within ``max_gpu_budget``/``min_gpu_budget`` and ordered
steps, removals first. A pool that was not cleared to shrink (by the consolidation check, at this decision) keeps at
least its current count in the plan, so a budget cut never removes what the check refused. The controller hands out
one step at a time: a removal only when no change is in progress; nothing while a removal is (``change_ended``
closes it), so an addition never starts before the removal that frees its GPUs; an addition while only additions to
the other pool are in progress (their workers counted as there: they hold GPUs from the moment they are asked for),
so a prefill and a decode addition need not wait a start-up for each other (simulator, a 1 -> 24 requests/s step
with 4000-token prompts: the prefill pool's waited 30 s behind the decode pool's). One change per pool at a time,
as the live loop runs them. No step asks for GPUs the budget does not have free, so none waits on a change that
cannot complete. The remaining steps follow at the pulls after each change ends.

Emitted: an ``Adjustment`` at every throughput decision (holds included), when the fast loop raises a pool, and when
a waiting step can be issued; otherwise ``PullOutcome.adjustment`` is None. ``no_operation``: decisions are flagged,
nothing is applied, and no waiting step is re-issued.

Imports the fleet view's types (rank 3), this package's pure core and the load planner's policy/controller types.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence

from components.fleet.model import FleetInstance, FleetSnapshot, RequestRecord, RequestWindow
from components.perf.model import DEFAULT_MODEL
from components.perf.profile import PerfModel
from components.perf.queueing import predicted_ttft_ms
from components.planner.config import PlannerConfig
from components.planner.controller import PendingChange, PullOutcome, build_observation, request_totals
from components.planner.policy import (
    Adjustment,
    Direction,
    Observation,
    Pool,
    ScalingDecision,
    pull_figures,
    worker_gpus,
)
from components.planner.sla import consolidation, correction, itl, replicas, startup
from components.planner.sla.budget import BudgetPlan, plan_budget
from components.planner.sla.config import SlaPlannerConfig
from components.planner.sla.figures import SlaFigures
from components.planner.sla.predictors import Predictor, make_predictor

__all__ = ["SlaController"]

_TIME_EPS_S = 1e-9  # pulls at 0, 1, ..., 30 s must make 30 s, not 29.999...


def _due_slack_s(pull_interval_s: float) -> float:
    """Half a pull: a decision is due at the pull scheduled one interval on, even when a live pull's clock reading
    (after an etcd round trip) comes a few ms early (components/planner/policy.py ``adjustment_due``)."""
    return max(_TIME_EPS_S, 0.5 * pull_interval_s)


_FAST_MAX_FACTOR = 8  # the ITL raise looks at most this many times the pool (the budget bounds it anyway)
# The fast loop reads the load of the last 3 pulls (3 s at the default 1 s; frontends report every 1 s): short enough
# to see a step within seconds, long enough to hold a few reports of each frontend.
FAST_WINDOW_PULLS = 3
# The queue's pace (the model says the pool suffices, yet a backlog stays): the mean wait of the last 5 pulls against
# that of the 5 before, extrapolated an adjustment interval ahead. Means of 5, not one pull against the previous,
# which reads the queue's noise (at 80 requests/s in the simulator that added 4 workers to the 4 the load needed).
FAST_TREND_PULLS = 5
# The ITL raise acts on a breach at the target's edge (one sequence fewer per worker would step within it) only when
# it held this many pulls running at one pool size. One pull's batch is an instant: a decode pool sized at the edge
# read 50.2-54.6 ms on single pulls against a 50 ms target and fell back the next (kvmesh bench planner-live, seeds
# 0-2), so a one-pull raise decided on when the pull happened to land. A breach beyond the edge (a burst: batch 10
# where 7 fit, tests/e2e/test_planner_sla.py) is raised at the pull that sees it. Pulls with a worker of the pool still
# starting do not count: the pull a start-up after a raise to 3 read 29-30 sequences on the 2 registered workers, 1 ms
# before the third registered, and raised to 4 at once (15 a worker: beyond the edge of 2) in the draws whose ITL
# factor was applied as 1.000; over the 3 asked for that is 10 a worker, 50.2 ms against 50 (the edge), which fell
# within target two pulls later (planner-live --resimulate of /tmp/pl7/sla-s0, docs/sla-planner.md "A raise on a worker
# still starting").
ITL_RAISE_PULLS = 2


@dataclasses.dataclass(frozen=True, slots=True)
class _PoolLoad:
    """A pool's fresh load reports, as the fast loop and the consolidation check read them."""

    workers: tuple[FleetInstance, ...]  # the pool's registered workers
    fresh: tuple[FleetInstance, ...]  # those with a fresh load report


@dataclasses.dataclass(frozen=True, slots=True)
class _Fast:
    """One pool's fast-loop reading at this pull."""

    ttft_ms: float | None = None  # mean predicted TTFT over fresh workers, uncorrected
    # predicted ITL over fresh workers decoding, uncorrected: the mean step a token sees, each worker's step in
    # progress with its prefill chunk, weighted by the tokens it sends (``itl.ItlSum``: what the frontends observe;
    # the correction and the figures compare it)
    itl_ms: float | None = None
    # the samples behind ``itl_ms``, which the interval's prediction sums
    itl_sum: itl.ItlSum = dataclasses.field(default_factory=itl.ItlSum)
    # the same samples' decode parts alone (each report's step without its chunk), token-weighted: the interval's
    # prediction adds the chunk part in expectation to them (``itl.expected_step_ms``)
    itl_decode_sum: itl.ItlSum = dataclasses.field(default_factory=itl.ItlSum)
    need: int | None = None  # the size the fast loop asks for (None: no raise)
    reason: str = ""
    broken: str = ""  # which corrected prediction is over its target now ("" none): the pool may not shrink
    ttft_max_ms: float | None = None  # the largest worker's predicted TTFT, uncorrected


class SlaController:
    """The SLA planner for one model, without I/O (module docstring). ``perf``: the model to size with (a profile the
    caller read from ``profile_results_dir``); None: each pool's workers' announced step-time models. Not
    thread-safe: one loop owns it."""

    def __init__(self, config: SlaPlannerConfig, model: str, perf: PerfModel | None = None) -> None:
        self.config = config
        self.model = model
        self.perf = perf
        # The load planner's GPU accounting (worker_gpus, pull_figures) reads these fields only.
        self._gpu_config = PlannerConfig(
            adjustment_interval=config.adjustment_interval,
            metric_pulling_interval=config.metric_pulling_interval,
            max_gpu_budget=config.max_gpu_budget,
            min_gpu_budget=min(config.min_gpu_budget, config.max_gpu_budget),
            decode_engine_num_gpu=config.decode_engine_num_gpu,
            prefill_engine_num_gpu=config.prefill_engine_num_gpu,
            no_operation=config.no_operation,
        )
        params = {"season_length": config.load_predictor_season} if config.load_predictor_season else {}
        self.rate: Predictor = make_predictor(config.load_predictor.value, **params)
        self.isl: Predictor = make_predictor(config.load_predictor.value, **params)
        self.osl: Predictor = make_predictor(config.load_predictor.value, **params)
        self.lead = startup.lead_intervals(config.worker_startup_s, config.adjustment_interval)
        self.pending: dict[Pool, PendingChange] = {}
        self.num_pulls = 0
        # One decode worker's KV cache in tokens (the smallest a worker reported: the batch must fit it), kept from
        # the last pull that heard one; None: none heard yet (the batch is bounded by the ITL target alone).
        self._kv_capacity_tokens: float | None = None
        self.num_adjustments = 0
        self.interval_start_s: float | None = None
        self.ttft_correction = 1.0
        # The ITL factor as measured (smoothed: the state each interval updates), and as applied to every ITL
        # prediction and sizing: within ``itl_correction_deadband`` of 1 as 1 (``correction.deadband``).
        self.itl_correction_measured = 1.0
        self.itl_correction = 1.0
        self.floor: dict[Pool, int] = {}  # the throughput loop's sizes
        self.target: dict[Pool, int] = {}  # what the planner steers to (floor, raised by the fast loop, budgeted)
        self._predicted: tuple[float, float | None, float | None] | None = None  # (rate, isl, osl) for this interval
        self._last_isl: float | None = None  # the latest prompt length heard (the fast loop's TTFT prompt)
        self._last_osl: float | None = None  # the latest output length heard
        self._ttft_pred: list[float] = []  # this interval's fast-loop TTFT predictions (ms, uncorrected)
        self._ttft_max = 0.0  # the largest one worker's predicted TTFT at any of this interval's pulls (ms)
        self._itl_pred = itl.ItlSum()  # and ITL: this interval's token-weighted step samples (itl.py)
        self._itl_decode = itl.ItlSum()  # their decode parts alone
        # the decode pool's registered workers summed over this interval's pulls, and the pulls: its mean size, over
        # which the interval's prompts are shared (``_predicted_itl_ms``)
        self._worker_pulls, self._interval_pulls = 0, 0
        # each pool's (size, mean queue wait ms) at its last settled pulls, oldest first
        self._waits: dict[Pool, collections.deque[tuple[int, float]]] = {}
        self._itl_breaches: dict[Pool, tuple[int, int]] = {}  # pool -> (its size, pulls running over the ITL target)
        # An aggregated pool's (size, pull time, prompt tokens queued on its workers, requests on its workers, queued
        # or running) at the last pull every worker reported: their growth over a pull is a floor on the arrivals
        # (module docstring, "Fast loop").
        self._queued: dict[Pool, tuple[int, float, float, int]] = {}
        self._issued: dict[Pool, int] = {}  # each pool's count as last asked for by an issued step
        self._asked: dict[Pool, int] = {}  # the fast loop's largest need per pool since the last decision
        # Per pool, the most asked for (forecast sizing or fast-loop raise) in each of the last scale_down_window
        # intervals, oldest first.
        self._asks: dict[Pool, collections.deque[int]] = {}
        self._forecast: dict[Pool, int] = {}  # the throughput loop's sizes at the last decision
        self._held_for: dict[Pool, int] = {}  # at this decision: the most asked for within the window

    # ----------------------------------------------------------------------------------------------------------------
    # The controller's surface (PlannerController's)

    def pull(self, snap: FleetSnapshot, gpus_per_worker: Mapping[Pool, int | None] | None = None) -> PullOutcome:
        """One pull at ``snap.now_s``: the fast loop, and the throughput loop when an interval has passed. The
        adjustment's changes (``Adjustment.changes()``) are the caller's to carry out, each announced with
        ``change_started`` and closed with ``change_ended``."""
        now = snap.now_s
        obs = build_observation(snap, self.model, self.pending, gpus_per_worker)
        figures = pull_figures(obs, self._gpu_config)
        if self._last_isl is None or self._last_osl is None:
            # Before the first throughput decision: the lengths heard so far, so that the fast loop reads the
            # workers' queues from the first pull (a cold start on a rising load broke TTFT for a whole interval
            # while it waited for a prompt length).
            heard = snap.request_window(self.model, now - self.config.adjustment_interval, now)
            if self._last_isl is None and heard.mean_isl is not None:
                self._last_isl = heard.mean_isl
            if self._last_osl is None and heard.mean_osl is not None:
                self._last_osl = heard.mean_osl
        running, waiting = request_totals(snap, self.model)
        self.num_pulls += 1
        loads = self._pool_loads(snap, obs)
        self._kv_capacity_tokens = kv_capacity_tokens(snap.serving(self.model)) or self._kv_capacity_tokens
        perf_of = {pool: self._pool_perf(load) for pool, load in loads.items()}
        fast = {pool: self._fast(pool, loads, obs, snap, perf_of) for pool in loads}
        # The fleet's predicted TTFT: the larger of its pools' (a disaggregated model's prompts wait in the prefill
        # queue, or on a decode worker when prefilled there), the one the correction compares with the frontends'.
        ttfts = [f.ttft_ms for f in fast.values() if f.ttft_ms is not None]
        if ttfts:
            self._ttft_pred.append(max(ttfts))
        self._ttft_max = max([self._ttft_max, *(f.ttft_max_ms for f in fast.values() if f.ttft_max_ms is not None)])
        itl_ms = fast[Pool.DECODE].itl_ms
        self._itl_pred += fast[Pool.DECODE].itl_sum
        self._itl_decode += fast[Pool.DECODE].itl_decode_sum
        self._worker_pulls += len(loads[Pool.DECODE].workers)
        self._interval_pulls += 1

        adj: Adjustment | None = None
        sla = SlaFigures(now_s=now, interval=False)
        if self.interval_start_s is None:
            self.interval_start_s = now
            if self.rate.ready and self.isl.ready and self.osl.ready:
                adj, sla = self._warm_decision(snap, obs, loads)
        elif now - self.interval_start_s >= self.config.adjustment_interval - _due_slack_s(
            self.config.metric_pulling_interval
        ):
            adj, sla = self._throughput(snap, obs, loads, fast)
            self.interval_start_s = now
            self._ttft_pred, self._itl_pred, self._itl_decode, self._ttft_max = [], itl.ItlSum(), itl.ItlSum(), 0.0
            self._worker_pulls, self._interval_pulls = 0, 0
            self._asked = {}
        if adj is None:
            adj = self._fast_raise(obs, fast)
        if adj is None:
            adj = self._waiting_step(obs)
        if adj is not None:
            self.num_adjustments += 1
        sla = dataclasses.replace(
            sla,
            predicted_ttft_s=self.ttft_correction * max(ttfts) / 1e3 if ttfts else None,
            predicted_itl_s=self.itl_correction * itl_ms / 1e3 if itl_ms is not None else None,
            ttft_correction=self.ttft_correction,
            itl_correction=self.itl_correction,
            throughput_prefill=self.floor.get(Pool.PREFILL),
            throughput_decode=self.floor.get(Pool.DECODE),
            target_prefill=self.target.get(Pool.PREFILL) if obs.prefill is not None else None,
            target_decode=self.target.get(Pool.DECODE),
            prefill=obs.prefill.workers if obs.prefill is not None else None,
            decode=obs.decode.workers,
            lead_intervals=self.lead,
        )
        return PullOutcome(obs, figures, running, waiting, adj, sla)

    def warm_start(self, requests_per_s: Sequence[float], isl: Sequence[float] = (), osl: Sequence[float] = ()) -> None:
        """Feed the predictors a history, one value per adjustment interval, oldest first (e.g. the operator's trace
        cut into intervals: its request rate, mean prompt and output length), before the first live interval, so the
        first decisions predict from it (a seasonal predictor needs two seasons). The latest lengths also become
        the fast loop's prompt length until one is heard."""
        self.rate.warm_start(requests_per_s)
        self.isl.warm_start(isl)
        self.osl.warm_start(osl)
        if isl:
            self._last_isl = float(isl[-1])
        if osl:
            self._last_osl = float(osl[-1])

    def change_started(self, pool: Pool, before: int, target: int) -> None:
        """A pool change was handed to whoever carries it out: no further step until ``change_ended``."""
        self.pending[pool] = PendingChange(before=before, target=target)

    def change_ended(self, pool: Pool) -> None:
        """The pool's change finished (or failed): the next step may be issued."""
        self.pending.pop(pool, None)

    def in_progress(self) -> dict[Pool, PendingChange]:
        return dict(self.pending)

    # ----------------------------------------------------------------------------------------------------------------
    # Reading the fleet

    def _pool_perf(self, load: _PoolLoad) -> PerfModel:
        """The model a pool is sized with: the configured profile, else its lowest-id worker's announced model, else
        the defaults (an empty pool)."""
        if self.perf is not None:
            return self.perf
        return load.workers[0].perf if load.workers else DEFAULT_MODEL

    def _worker_perf(self, inst: FleetInstance) -> PerfModel:
        return self.perf if self.perf is not None else inst.perf

    def _pool_loads(self, snap: FleetSnapshot, obs: Observation) -> dict[Pool, _PoolLoad]:
        out: dict[Pool, _PoolLoad] = {}
        serving = tuple(snap.serving(self.model))
        out[Pool.DECODE] = _PoolLoad(serving, tuple(i for i in serving if i.fresh(snap.now_s)))
        if obs.prefill is not None:
            prefill = tuple(snap.prefill(self.model))
            out[Pool.PREFILL] = _PoolLoad(prefill, tuple(i for i in prefill if i.fresh(snap.now_s)))
        return out

    # ----------------------------------------------------------------------------------------------------------------
    # Fast loop

    def _ttft_reading(
        self, pool: Pool, loads: Mapping[Pool, _PoolLoad], obs: Observation, snap: FleetSnapshot, perf: PerfModel
    ) -> tuple[float, float, float, bool, float] | None:
        """(mean predicted TTFT, its queue wait, its own prefill, whether every worker was read, the largest worker's
        predicted TTFT) in ms, uncorrected,
        for a new prompt of the latest mean length; None: nothing to read it from.

        Aggregated, and a disaggregated model's decode pool: the pool's workers' own load reports (their queued prompt
        tokens, the sequences decoding beside). A decode worker of a disaggregated model queues prompts when it
        prefills locally: short ones, and long ones the full prefill queue turned away (its cap,
        components/router/policies/disagg.py); only that pool's workers drain that backlog, so it is that pool's
        reading. The prefill pool: its workers pull from one shared queue, each counting for an even share of its
        waiting prompts (``waiting x isl / n`` tokens, nothing decoding)."""
        if self._last_isl is None:
            return None
        n_isl = max(1, round(self._last_isl))
        if pool == Pool.DECODE:
            load = loads[Pool.DECODE]
            if not load.fresh:
                return None
            totals, owns = [], []
            for inst in load.fresh:
                assert inst.load is not None
                s = inst.load.snapshot
                p = self._worker_perf(inst)
                seqs, kv = s.num_running, float(s.num_kv_tokens)
                totals.append(predicted_ttft_ms(p, n_isl, s.num_waiting_prefill_tokens, seqs, kv))
                owns.append(p.chunked_prefill_ms(n_isl))
            total, own = sum(totals) / len(totals), sum(owns) / len(owns)
            return total, total - own, own, len(load.fresh) == len(load.workers), max(totals)
        view = snap.queue(self.model)
        n = len(loads[Pool.PREFILL].workers)
        if view is None or view.waiting is None or n == 0:
            return None
        own = perf.chunked_prefill_ms(n_isl)
        total = predicted_ttft_ms(perf, n_isl, view.waiting * n_isl / n)
        return total, total - own, own, view.prefill_workers == n, total

    def _fast(
        self,
        pool: Pool,
        loads: Mapping[Pool, _PoolLoad],
        obs: Observation,
        snap: FleetSnapshot,
        perf_of: Mapping[Pool, PerfModel],
    ) -> _Fast:
        """The pool's mean predicted TTFT and ITL from its fresh load reports (a disaggregated prefill pool: from the
        shared prefill queue), and the size that brings a broken one back within target (module docstring)."""
        cfg = self.config
        load = loads[pool]
        n = len(load.workers)
        # The pool as the ITL rule counts it: registered, or the target of an addition in progress (``_current``).
        asked = max(n, self._current(obs).get(pool, n))
        reading = self._ttft_reading(pool, loads, obs, snap, perf_of[pool])
        # A disaggregated prefill pool is also raised (on the recent rate) when the decode workers' own queues break
        # the target: the prefill queue's cap turns long prompts away to them when the prefill pool is short, so a
        # capped queue may look fine while prompts wait on the decode side (simulator, a 1 -> 24 requests/s step
        # with 4000-token prompts: the queue read 3 items, the decode workers' backlog seconds).
        trigger = reading[0] if reading is not None else None
        via = ""
        if pool == Pool.PREFILL:
            local = self._ttft_reading(Pool.DECODE, loads, obs, snap, perf_of[Pool.DECODE])
            if local is not None and (trigger is None or local[0] > trigger):
                trigger, via = local[0], " on the decode workers (prompts the full prefill queue turned away)"
        if reading is None and trigger is None and not load.fresh:
            return _Fast()
        ttft_ms, wait_ms, own_ms, settled, ttft_max_ms = (
            reading if reading is not None else (None, 0.0, 0.0, False, None)
        )
        itl_ms: float | None = None  # the decode step alone: what the ITL raise can spread
        sampled = itl.ItlSum()  # the steps the tokens see, each worker's step in progress with its chunk (itl.py)
        decode_sampled = itl.ItlSum()  # the same steps' decode parts alone
        batch = kv_tokens = 0.0
        if pool == Pool.DECODE:
            decoding = [i for i in load.fresh if i.load is not None and i.load.snapshot.batch_size > 0]
            if decoding:
                steps = []
                for inst in decoding:
                    assert inst.load is not None
                    s = inst.load.snapshot
                    p = self._worker_perf(inst)
                    steps.append(p.decode_ms(s.batch_size, s.num_kv_tokens))
                    free = (
                        max(0, s.num_total_blocks - s.num_active_blocks) * inst.meta.block_size
                        if inst.meta.block_size > 0 and s.num_total_blocks > 0
                        else None
                    )
                    ms = itl.step_ms(
                        p,
                        s.batch_size,
                        s.num_kv_tokens,
                        s.num_prefill_tokens,
                        waiting_prefill_tokens=s.num_waiting_prefill_tokens,
                        free_kv_tokens=free,
                    )
                    sampled = sampled.add(s.batch_size, ms)
                    decode_sampled = decode_sampled.add(s.batch_size, steps[-1])
                itl_ms = sum(steps) / len(steps)
                # The pool's batch and KV spread over all its n workers (the router spreads new requests over
                # every worker; running ones stay put, but each finishes within its output): a worker that just
                # joined and decodes nothing yet is part of the pool, not absent from it. Averaging over the decoding
                # workers only read one busy old worker's batch as every worker's, one pull after a scale-up, and
                # raised again (kvmesh bench planner-live, seed 0: "batch 14 on each of 2: 4 workers").
                # The same holds one step earlier for a worker asked for and still starting (an addition in
                # progress): the pool it is raised to takes the load once it registers, a start-up on.
                batch = sum(i.load.snapshot.batch_size for i in decoding if i.load) / asked
                kv_tokens = sum(i.load.snapshot.num_kv_tokens for i in decoding if i.load) / asked

        need: int | None = None
        reasons: list[str] = []
        wait = self.ttft_correction * wait_ms
        # Growth is read over the last 2 x FAST_TREND_PULLS pulls of one settled pool, every worker reporting (right
        # after workers join, the old workers' backlog still shows alone, which is no growth): the mean wait of the
        # later half over that of the earlier one. One pull against the previous would read the queue's noise
        # (at 80 requests/s in the simulator it added 4 workers to the 4 the load needed, one each start-up).
        settled = settled and not self.pending and ttft_ms is not None
        history = self._waits.setdefault(pool, collections.deque(maxlen=2 * FAST_TREND_PULLS))
        if not settled or (history and history[-1][0] != n):
            history.clear()
        if settled:
            history.append((n, wait))
        trend: tuple[float, float] | None = None
        if len(history) == history.maxlen:
            earlier = sum(w for _, w in list(history)[:FAST_TREND_PULLS]) / FAST_TREND_PULLS
            later = sum(w for _, w in list(history)[FAST_TREND_PULLS:]) / FAST_TREND_PULLS
            trend = (earlier, later)
        grown = self._queue_growth(pool, obs, load, snap.now_s)
        if trigger is not None and self.ttft_correction * trigger > cfg.ttft:
            own = self.ttft_correction * own_ms
            seen = f"predicted TTFT {self.ttft_correction * trigger:.0f} ms{via} > {cfg.ttft:g} ms target"
            recent = self._recent_load(snap)
            latest = self._recent_load(snap, latest=True)
            if latest is not None and (recent is None or latest[0] > recent[0]):
                recent, heard = latest, "the frontends' latest reports'"
            else:
                heard = f"the last {self._fast_window_s():g} s'"
            if grown is not None and self._last_isl is not None and (recent is None or grown > recent[0]):
                # The workers report at every pull; a frontend's report of the same second may land just after it.
                recent = (grown, self._last_isl, recent[2] if recent is not None else self._last_osl)
                heard = "the growth of the workers' queues or requests over the last pull (arrivals at least that):"
            size: int | None = None
            if own >= cfg.ttft:
                reasons.append(f"{seen}, but a prompt alone takes {own:.0f} ms: more workers do not help")
            else:
                if recent is not None:
                    rate, r_isl, r_osl = recent
                    # Without an output length (a burst's first second: none of its requests finished), the
                    # prompts' share alone: a burst's queue is what breaks TTFT, and waiting for its first request
                    # to finish let the first prompts' TTFT break the target first (kvmesh's SLA e2e burst under
                    # CPU load: 779 ms predicted at a pull 0.8 s before the first breach, no raise).
                    sizes, _ = self._throughput_sizes(
                        obs, [rate], [r_isl], [r_osl] if r_osl is not None else None, perf_of, prompts_only=True
                    )
                    size = sizes.get(pool)
                    said = f"{rate:.1f} requests/s need {size}"
                    held = self._backlog_held(pool, obs, load, rate, r_isl, r_osl, perf_of[pool])
                    if size is not None and held is not None:
                        # The queue the current workers will still hold when new ones come (module docstring).
                        worth, backlog, holders = held
                        with_backlog = min(size + n, replicas.workers_for(worth + holders, 1.0))
                        if with_backlog > size:
                            size = with_backlog
                            said = (
                                f"{rate:.1f} requests/s need {worth:.2f} workers' worth, and the {n} holding the "
                                f"queue will still hold {backlog:.0f} prompts when new workers come "
                                f"({cfg.worker_startup_s:g} s on), {holders:.2f} workers' worth of the next "
                                f"{cfg.adjustment_interval:g} s: {size}"
                            )
                    if size is not None and size > n:
                        reasons.append(f"{seen}; {heard} {said}")
                # Where the wait will be an adjustment interval from now at its recent pace (per pull: the halves'
                # means are FAST_TREND_PULLS pulls apart).
                projected = None
                if trend is not None:
                    pulls_ahead = cfg.adjustment_interval / cfg.metric_pulling_interval
                    projected = trend[1] + (trend[1] - trend[0]) / FAST_TREND_PULLS * pulls_ahead
                if (size is None or size <= n) and projected is not None and projected + own > cfg.ttft:
                    assert trend is not None
                    size = n + 1
                    pace = "grows" if trend[1] > trend[0] else "drains too slowly"
                    reasons.append(
                        f"{seen} and the queue wait {pace} (mean {trend[0]:.0f} -> {trend[1]:.0f} ms over the last "
                        f"{2 * FAST_TREND_PULLS} pulls, {max(0.0, projected):.0f} ms an interval from now) although "
                        f"the load {'seems served' if recent is not None else 'is unheard'}: one more, {size}"
                    )
                    self._waits[pool].clear()
                if size is not None and size > n:
                    need = size
        spread_ms = None
        if itl_ms is not None:
            spread_ms = self._pool_perf(load).decode_ms(math.ceil(batch - 1e-9), kv_tokens)
        breach = itl_ms is not None and spread_ms is not None and self.itl_correction * spread_ms > cfg.itl
        # Pulls running over the target at one pool size, counted once the workers asked for have registered: while
        # one is starting, the spread over the pool it will make is a hypothesis (the old workers' batch, which
        # arrivals will spread over the new one), not a reading of that pool, so it does not count toward holding.
        size_then, pulls = self._itl_breaches.get(pool, (asked, 0))
        if asked > n:
            pulls = 0
        else:
            pulls = pulls + 1 if breach and size_then == asked else int(breach)
        self._itl_breaches[pool] = (asked, pulls)
        # At the edge: one sequence fewer on each worker would step within target (an arrival landing before a
        # departure, the batch's own flicker). A breach beyond that is no flicker and is raised at once.
        edge = (
            breach
            and self.itl_correction * self._pool_perf(load).decode_ms(max(0, math.ceil(batch - 1e-9) - 1), kv_tokens)
            <= cfg.itl
        )
        if edge and pulls < ITL_RAISE_PULLS:
            assert itl_ms is not None and spread_ms is not None
            counted = (
                f"on {pulls} pull(s)"
                if asked == n
                else f"of {asked}, {asked - n} of them starting (pulls counted once they have registered)"
            )
            reasons.append(
                f"predicted ITL {self.itl_correction * spread_ms:.1f} ms > {cfg.itl:g} ms target with the load "
                f"spread over the pool {counted}, at its edge (one sequence fewer per worker steps within "
                f"it): raised after {ITL_RAISE_PULLS} pulls running"
            )
        elif breach:
            assert itl_ms is not None and spread_ms is not None
            seen = (
                f"predicted ITL {self.itl_correction * itl_ms:.1f} ms > {cfg.itl:g} ms target, "
                f"{self.itl_correction * spread_ms:.1f} ms with the load spread over the pool "
                f"({pulls} pulls running)"
                if asked == n
                else f"{self.itl_correction * spread_ms:.1f} ms with the load spread over the {asked} asked for"
            )
            perf = self._pool_perf(load)
            found: int | None = None
            for m in range(asked + 1, asked * _FAST_MAX_FACTOR + 1):
                share = math.ceil(batch * asked / m - 1e-9)
                if self.itl_correction * perf.decode_ms(share, kv_tokens * asked / m) <= cfg.itl:
                    found = m
                    break
            if found is None:
                size = asked * _FAST_MAX_FACTOR
                reasons.append(f"{seen}: no size up to {size} meets it; asking for {size}")
            else:
                size = found
                starting = f", {asked - n} of them starting" if asked > n else ""
                reasons.append(
                    f"{seen} (batch {batch:.0f} on each of {asked}{starting}): {size} workers step within target"
                )
            need = max(need or 0, size)
        broken = []
        if ttft_ms is not None and self.ttft_correction * ttft_ms > cfg.ttft:
            broken.append(f"predicted TTFT {self.ttft_correction * ttft_ms:.0f} ms > {cfg.ttft:g} ms")
        if itl_ms is not None and self.itl_correction * itl_ms > cfg.itl:
            broken.append(f"predicted ITL {self.itl_correction * itl_ms:.1f} ms > {cfg.itl:g} ms")
        return _Fast(
            ttft_ms,
            sampled.mean_ms,
            sampled,
            decode_sampled,
            need,
            "; ".join(reasons),
            " and ".join(broken),
            ttft_max_ms,
        )

    def _queue_growth(self, pool: Pool, obs: Observation, load: _PoolLoad, now_s: float) -> float | None:
        """Requests/s by which an aggregated pool's workers' load grew since its last pull (every worker reporting,
        the same pool), the larger of two floors on the arrivals: their queued prompt tokens over the prompt length
        (no prompt leaves a queue but into service), and their requests, queued or running (none leaves an engine
        but by finishing; a preempted one stays, queued again). The second counts the prompts the workers took into
        service over the pull, which the first misses. None: not known."""
        if pool != Pool.DECODE or obs.prefill is not None or not load.fresh or len(load.fresh) != len(load.workers):
            self._queued.pop(pool, None)
            return None
        n = len(load.workers)
        snaps = [i.load.snapshot for i in load.fresh if i.load is not None]
        tokens = float(sum(s.num_waiting_prefill_tokens for s in snaps))
        requests = sum(s.num_running + s.num_waiting for s in snaps)
        before = self._queued.get(pool)
        self._queued[pool] = (n, now_s, tokens, requests)
        if before is None or before[0] != n or now_s <= before[1] or not self._last_isl:
            return None
        span = now_s - before[1]
        return max((tokens - before[2]) / self._last_isl, float(requests - before[3])) / span

    def _backlog_held(
        self,
        pool: Pool,
        obs: Observation,
        load: _PoolLoad,
        rate: float,
        isl: float,
        osl: float | None,
        perf: PerfModel,
    ) -> tuple[float, float, float] | None:
        """For a TTFT raise of an aggregated pool at ``rate`` requests/s: (the rate's workers' worth, unrounded; the
        prompts its current workers will still hold when a worker asked for now comes, ``worker_startup_s`` on; the
        workers' worth of the next ``adjustment_interval`` that backlog takes), module docstring "Fast loop"; None
        where it does not apply (a disaggregated model: its prompts wait in one shared queue that new prefill workers
        drain too; no fresh report; no load)."""
        cfg = self.config
        if pool != Pool.DECODE or obs.prefill is not None or not load.fresh or rate <= 0 or isl <= 0:
            return None
        prefill_share, decode_share, _, _ = self._aggregated_worth(rate, isl, osl, perf)
        worth = prefill_share + decode_share
        if worth <= 0:
            return None
        per_request = worth / rate  # one request's share of a worker's second (the sizing's own, linear in rate)
        n = len(load.workers)
        tokens = sum(i.load.snapshot.num_waiting_prefill_tokens for i in load.fresh if i.load is not None)
        queued = tokens * n / len(load.fresh) / isl  # prompts; a worker without a fresh report counted as the mean
        # Until the new workers come, every arrival goes to the current n, which serve n / per_request a second.
        backlog = max(0.0, queued + (rate - n / per_request) * cfg.worker_startup_s)
        holders = min(float(n), backlog * per_request / cfg.adjustment_interval)
        return worth, backlog, holders

    def _fast_window_s(self) -> float:
        return FAST_WINDOW_PULLS * self.config.metric_pulling_interval

    def _recent_load(self, snap: FleetSnapshot, latest: bool = False) -> tuple[float, float, float | None] | None:
        """(requests/s, mean prompt length, mean output length or None) over the request reports received in the
        last ``FAST_WINDOW_PULLS`` pulls (``latest``: each frontend's last one of them); None when none was heard or
        no prompt length is known. Each frontend's rate is its requests over its reports' own intervals (a report
        covers its interval, not the window), summed over frontends."""
        now = snap.now_s
        records = [r for r in snap.requests.get(self.model, ()) if now - self._fast_window_s() < r.received_s <= now]
        if latest:
            last: dict[str, RequestRecord] = {}
            for r in records:
                if r.source not in last or r.received_s >= last[r.source].received_s:
                    last[r.source] = r
            records = list(last.values())
        if not records:
            return None
        counts: dict[str, list[float]] = {}
        for r in records:
            c = counts.setdefault(r.source, [0.0, 0.0])
            c[0] += r.report.requests
            c[1] += r.report.interval_s
        rate = sum(req / span for req, span in counts.values() if span > 0)
        requests = sum(r.report.requests for r in records)
        finished = sum(r.report.finished for r in records)
        isl = sum(r.report.prompt_tokens for r in records) / requests if requests else self._last_isl
        osl = sum(r.report.output_tokens for r in records) / finished if finished else self._last_osl
        if isl is None:
            return None
        return rate, isl, osl

    def _fast_raise(self, obs: Observation, fast: Mapping[Pool, _Fast]) -> Adjustment | None:
        """At a pull between throughput decisions: raise a pool whose fast-loop need is over what the planner steers
        to, and issue the step if nothing is in progress."""
        current = self._current(obs)
        raised: dict[Pool, str] = {}
        for pool, f in fast.items():
            if f.need is None:
                continue
            # Not again for a need already asked for since the last decision: one the budget cut would otherwise be
            # asked for, and refused, at every pull.
            steer = max(self.target.get(pool, current[pool]), current[pool], self._asked.get(pool, 0))
            if f.need > steer:
                self._asked[pool] = f.need
                self.target[pool] = max(f.need, self.floor.get(pool, 0))
                raised[pool] = f"fast loop: {f.reason}"
        if not raised:
            return None
        return self._emit(obs, raised, allowed_down=set())

    # ----------------------------------------------------------------------------------------------------------------
    # Throughput loop

    def _predicted_itl_ms(self, window: RequestWindow, loads: Mapping[Pool, _PoolLoad]) -> float | None:
        """The interval's predicted ITL, ms, uncorrected: what the correction divides the frontends' observed mean
        ITL by. None: nothing to predict it from (no pull caught a worker decoding and no lengths heard yet).

        Aggregated: the decode part sampled (each fresh worker's decode step at every pull, token-weighted,
        ``itl.ItlSum``: its spread between runs 2 ms apart is under 1%), and the prefill chunks' part in expectation
        (``itl.expected_step_ms``) from the prompts the interval prefilled, shared evenly over the pool's mean
        registered size. Reading the chunks from the 1-5 of an interval's 14-20 reports that landed in a chunk step
        made the prediction a lottery: 3.5-8% apart between re-simulated draws whose observed ITL agreed to 0.5 ms
        (docs/sla-planner.md, "The chunk part in expectation"). The prompts counted are the first tokens the
        frontends sent in the interval (``ttft_count``): a prompt's first token comes out of its last chunk step, so
        they are the prompts whose prefill ended in it, where the prompts handed to the router (``requests``) also
        count those still queued at its end. Their mean length is the interval's mean prompt (the latest heard when
        none was handed over). No pull caught a worker decoding (light load: short requests between pulls), yet tokens
        were sent: the decode part is a lone sequence's step at the mean context (without it, a factor raised in a
        burst would stay up through every quiet interval after it).

        Disaggregated (a prefill pool): the decode workers prefill only the prompts kept local, which the frontends'
        counts do not tell apart; their chunks stay sampled from the reports (``num_prefill_tokens``)."""
        perf = self._pool_perf(loads[Pool.DECODE])
        if Pool.PREFILL in loads and self._itl_pred.mean_ms is not None:
            return self._itl_pred.mean_ms
        decode_ms, batch = self._itl_decode.mean_ms, self._itl_decode.mean_batch
        if decode_ms is None or batch is None:
            if self._last_isl is None or self._last_osl is None:
                return None
            decode_ms, batch = perf.decode_ms(1, self._last_isl + self._last_osl / 2), 1.0
        isl = window.mean_isl if window.mean_isl is not None else self._last_isl
        workers = self._worker_pulls / self._interval_pulls if self._interval_pulls else 0.0
        if Pool.PREFILL in loads or isl is None or workers <= 0 or window.duration_s <= 0:
            return decode_ms
        prompts_per_s = window.ttft_count / window.duration_s / workers
        return itl.expected_step_ms(perf, decode_ms, batch, prompts_per_s, isl)

    def _throughput(
        self, snap: FleetSnapshot, obs: Observation, loads: Mapping[Pool, _PoolLoad], fast: Mapping[Pool, _Fast]
    ) -> tuple[Adjustment, SlaFigures]:
        cfg = self.config
        now = snap.now_s
        assert self.interval_start_s is not None
        window = snap.request_window(self.model, self.interval_start_s, now)
        predicted = self._predicted
        sla = SlaFigures(
            now_s=now,
            interval=True,
            predicted_request_rate=predicted[0] if predicted else None,
            predicted_isl=predicted[1] if predicted else None,
            predicted_osl=predicted[2] if predicted else None,
        )
        current = self._current(obs)
        # The interval just ended asked for the forecast at its start and any fast-loop raise in it: the removal
        # floor of scale_down_window (module docstring, "Scale-down").
        self._held_for = {}
        for pool in current:
            asks = self._asks.setdefault(pool, collections.deque(maxlen=cfg.scale_down_window))
            if cfg.scale_down_window and (pool in self._forecast or pool in self._asked):
                asks.append(max(self._forecast.get(pool, 0), self._asked.get(pool, 0)))
            if asks:
                self._held_for[pool] = max(asks)
        if window.reports == 0:
            self._forecast = {}
            reason = (
                f"no request reports heard in ({self.interval_start_s:g}, {now:g}] s: no throughput decision "
                "(silence is not zero load)"
            )
            # The fast loop still raises a pool whose workers' queues break the target.
            held = {pool: reason for pool in current}
            for pool, fp in fast.items():
                if fp.need is not None and fp.need > max(self.target.get(pool, current[pool]), current[pool]):
                    self.target[pool] = fp.need
                    held[pool] = f"{reason}; fast loop: {fp.reason}"
            return self._emit(obs, held, allowed_down=set(), note=reason), sla

        rate = window.request_rate or 0.0
        self.rate.observe(rate)
        if window.mean_isl is not None:
            self.isl.observe(window.mean_isl)
            self._last_isl = window.mean_isl
        if window.mean_osl is not None:
            self.osl.observe(window.mean_osl)
            self._last_osl = window.mean_osl
        sla = dataclasses.replace(
            sla,
            observed_request_rate=rate,
            observed_isl=window.mean_isl,
            observed_osl=window.mean_osl,
            observed_ttft_s=window.mean_ttft_s,
            observed_itl_s=window.mean_itl_s,
        )
        notes: list[str] = []
        if not cfg.no_correction:
            predicted_ttft_s = _mean_s(self._ttft_pred)
            if self.ttft_correction * self._ttft_max > cfg.ttft:
                # A queueing interval: the first tokens sent in it are of prompts that arrived earlier, behind a
                # different queue than the pulls saw (a backlog's drain reads as a slow engine, by up to the
                # factor's bound): they measure the queue's history, not the engine's speed.
                t = correction.Correction(
                    self.ttft_correction,
                    None,
                    f"a worker queued this interval (predicted TTFT up to {self.ttft_correction * self._ttft_max:.0f}"
                    f" ms > target): keeping {self.ttft_correction:.3f}",
                )
            else:
                t = correction.update_correction(self.ttft_correction, window.mean_ttft_s, predicted_ttft_s)
            itl_mean_ms = self._predicted_itl_ms(window, loads)
            predicted_itl_s = itl_mean_ms / 1e3 if itl_mean_ms is not None else None
            i = correction.update_correction(self.itl_correction_measured, window.mean_itl_s, predicted_itl_s)
            self.ttft_correction, self.itl_correction_measured = t.factor, i.factor
            self.itl_correction = correction.deadband(i.factor, cfg.itl_correction_deadband)
            applied = (
                f", applied as {self.itl_correction:.3f} (beyond {cfg.itl_correction_deadband:g} of 1 only)"
                if cfg.itl_correction_deadband > 0
                else ""
            )
            notes.append(
                f"TTFT correction {t.factor:.3f} ({t.reason}); ITL correction {i.factor:.3f} ({i.reason}){applied}"
            )

        means, rates, isls, osls, times = self._horizon(rate)
        self._predicted = (means[0], isls[0] if isls else None, osls[0] if osls else None)
        sla = dataclasses.replace(
            sla, next_request_rate=means[0], next_isl=self._predicted[1], next_osl=self._predicted[2]
        )

        perf = {pool: self._pool_perf(load) for pool, load in loads.items()}
        wanted, why = self._throughput_sizes(obs, rates, isls, osls, perf, times)
        # What the interval's observed load needs: no removal below it (module docstring, "Scale-down").
        seen_isl = window.mean_isl if window.mean_isl is not None else self._last_isl
        seen_osl = window.mean_osl if window.mean_osl is not None else self._last_osl
        seen: dict[Pool, int] = {}
        margin = 1.0 + cfg.scale_down_tolerance
        if seen_isl is not None:
            seen, _ = self._throughput_sizes(
                obs, [margin * rate], [seen_isl], [seen_osl] if seen_osl is not None else None, perf
            )
        if cfg.scale_down_tolerance > 0:
            tolerant, _ = self._throughput_sizes(obs, [margin * r for r in rates], isls, osls, perf, times)
            seen = {p: max(seen.get(p, 0), n) for p, n in tolerant.items()} | {
                p: n for p, n in seen.items() if p not in tolerant
            }
        reasons: dict[Pool, str] = {}
        allowed_down: set[Pool] = set()
        held_for = self._held_for
        self._forecast = dict(wanted)
        for pool, cur in current.items():
            f = fast.get(pool)
            if pool not in wanted:
                reasons[pool] = why[pool]
                self.target.pop(pool, None)
                if f is not None and f.need is not None and f.need > cur:
                    # The throughput loop cannot size the pool (a burst's first seconds: no request finished, no
                    # output length), but the fast loop's raise at this pull stands, as at any other pull. Dropped,
                    # it waited a pull (kvmesh's SLA e2e burst, under CPU load: 0.77 s, decided 0.43 s after the
                    # first TTFT breach).
                    self.target[pool] = f.need
                    reasons[pool] = f"fast loop: {f.reason}; throughput loop: {why[pool]}"
                continue
            floor = wanted[pool]
            self.floor[pool] = floor
            want, reason = floor, why[pool]
            if f is not None and f.need is not None and f.need > want:
                want, reason = f.need, f"{reason}; fast loop: {f.reason}"
            if want < cur and f is not None and f.broken:
                want, reason = cur, f"{reason}; scale-down to {want} refused: {f.broken} now"
            elif want < cur and held_for.get(pool, 0) > want:
                asked = held_for[pool]
                reason = (
                    f"{reason}; not below {min(cur, asked)}: {asked} asked for within the last "
                    f"{cfg.scale_down_window} interval(s) (scale_down_window)"
                )
                want = min(cur, asked)
            if want < cur and seen.get(pool, 0) > want:
                floor_seen = min(cur, seen[pool])
                reason = (
                    f"{reason}; not below {floor_seen}: a removal is sized for {margin:g} x the larger of the "
                    f"forecast and the interval's observed {rate:.2f} requests/s, which need {seen[pool]}"
                )
                want = floor_seen
            if want < cur:
                want, reason = self._scale_down(
                    pool, cur, want, loads[pool], perf[pool], reason, obs.prefill is None, snap
                )
                if want < cur:
                    allowed_down.add(pool)
            self.target[pool] = want
            reasons[pool] = reason
        return self._emit(obs, reasons, allowed_down, note="; ".join(notes)), sla

    def _horizon(
        self, observed: float | None
    ) -> tuple[list[float], list[float], list[float] | None, list[float] | None, list[float]]:
        """The forecast's interval means, and the rates (with their intervals' lengths and how far ahead) over the
        span the workers asked for now serve (``startup.horizon_points``; ``observed``: the last interval's rate, None:
        the first forecast stands for it)."""
        cfg = self.config
        n = self.lead + 2
        means = self.rate.predict_ahead(n)
        isl_i = self.isl.predict_ahead(n) if self.isl.ready else None
        osl_i = self.osl.predict_ahead(n) if self.osl.ready else None
        points = startup.horizon_points(
            means[0] if observed is None else observed, means, cfg.adjustment_interval, cfg.worker_startup_s
        )
        rates = [p.rate for p in points]
        isls = [isl_i[p.interval] for p in points] if isl_i else None
        osls = [osl_i[p.interval] for p in points] if osl_i else None
        return means, rates, isls, osls, [p.t_s for p in points]

    def _warm_decision(
        self, snap: FleetSnapshot, obs: Observation, loads: Mapping[Pool, _PoolLoad]
    ) -> tuple[Adjustment, SlaFigures]:
        """The first pull of warm-started predictors (``warm_start``, the warm-up trace): a throughput decision from
        the forecast alone, before any interval is observed, so that workers a start-up away are asked for now and
        not an interval late. It only raises (no observation to shrink on) and corrects nothing."""
        means, rates, isls, osls, times = self._horizon(None)
        self._predicted = (means[0], isls[0] if isls else None, osls[0] if osls else None)
        sla = SlaFigures(
            now_s=snap.now_s,
            interval=True,
            next_request_rate=means[0],
            next_isl=self._predicted[1],
            next_osl=self._predicted[2],
        )
        perf = {pool: self._pool_perf(load) for pool, load in loads.items()}
        wanted, why = self._throughput_sizes(obs, rates, isls, osls, perf, times)
        self._forecast = dict(wanted)
        current = self._current(obs)
        reasons: dict[Pool, str] = {}
        for pool, cur in current.items():
            if pool not in wanted:
                reasons[pool] = why[pool]
                continue
            self.floor[pool] = wanted[pool]
            self.target[pool] = max(cur, wanted[pool])
            reasons[pool] = f"warm start (the warm-up trace's forecast, nothing observed yet): {why[pool]}"
        return self._emit(obs, reasons, allowed_down=set()), sla

    def _throughput_sizes(
        self,
        obs: Observation,
        rates: Sequence[float],
        isls: Sequence[float] | None,
        osls: Sequence[float] | None,
        perf: Mapping[Pool, PerfModel],
        times: Sequence[float] | None = None,
        prompts_only: bool = False,
    ) -> tuple[dict[Pool, int], dict[Pool, str]]:
        """Each pool's size: the most any of ``rates`` (with their lengths; ``times``: how far ahead each is, for the
        reason) needs; a pool missing from the first mapping holds (its reason in the second). ``prompts_only``: an
        aggregated pool with no output length known is sized on its prefill share alone, a lower bound (else it is
        missing)."""
        cfg = self.config
        pools = [Pool.DECODE] + ([Pool.PREFILL] if obs.prefill is not None else [])
        needs: dict[Pool, list[int]] = {p: [] for p in pools}
        why_at: dict[Pool, list[str]] = {p: [] for p in pools}
        missing: dict[Pool, str] = {}
        for k, rate in enumerate(rates):
            if rate <= 0:
                for p in pools:
                    needs[p].append(cfg.min_endpoint)
                    why_at[p].append("no requests predicted")
                continue
            isl = isls[k] if isls else None
            osl = osls[k] if osls else None
            if isl is None:
                for p in pools:
                    missing[p] = "no prompt length heard yet: holding"
                continue
            if obs.prefill is not None:
                _, sp = replicas.prefill_workers(
                    rate, isl, perf[Pool.PREFILL], cfg.ttft_s, self.ttft_correction, queue_wait=cfg.queue_wait
                )
                needs[Pool.PREFILL].append(max(cfg.min_endpoint, sp.workers))
                why_at[Pool.PREFILL].append(f"prefill: {sp.reason}")
            if osl is None and prompts_only and obs.prefill is None:
                # Aggregated, no output length yet: the prefill share alone, a lower bound (the decode share only
                # adds to it), which is what the TTFT rule needs to know (module docstring, "Fast loop").
                prefill_share, _, sp, _ = self._aggregated_worth(rate, isl, None, perf[Pool.DECODE])
                n = replicas.workers_for(prefill_share, 1.0)
                needs[Pool.DECODE].append(max(cfg.min_endpoint, n))
                why_at[Pool.DECODE].append(
                    f"aggregated: prefill {prefill_share:.2f} workers' worth = {n} at least (no output length heard "
                    f"yet: the decode share is unknown) (prefill: {sp.reason})"
                )
                continue
            if osl is None:
                missing[Pool.DECODE] = "no output length heard yet (no request finished): holding"
                continue
            if obs.prefill is not None:
                _, sd = replicas.decode_workers(
                    rate,
                    isl,
                    osl,
                    perf[Pool.DECODE],
                    cfg.itl_s,
                    self.itl_correction,
                    kv_capacity_tokens=self._kv_capacity_tokens,
                )
                needs[Pool.DECODE].append(max(cfg.min_endpoint, sd.workers))
                why_at[Pool.DECODE].append(f"decode: {sd.reason}")
                continue
            # Aggregated: one pool does both; the sum of both demands' worker fractions (module docstring).
            prefill_share, decode_share, sp, sd_ = self._aggregated_worth(rate, isl, osl, perf[Pool.DECODE])
            assert sd_ is not None
            sd = sd_
            n = replicas.workers_for(prefill_share + decode_share, 1.0)
            needs[Pool.DECODE].append(max(cfg.min_endpoint, n))
            why_at[Pool.DECODE].append(
                f"aggregated: prefill {prefill_share:.2f} + decode {decode_share:.2f} workers' worth = {n} "
                f"(prefill: {sp.reason}; decode: {sd.reason})",
            )
        sizes: dict[Pool, int] = {}
        reasons: dict[Pool, str] = {}
        for p in pools:
            if p in missing:
                reasons[p] = missing[p]
                continue
            at = max(range(len(needs[p])), key=lambda k: (needs[p][k], -k))
            sizes[p] = needs[p][at]
            when = f" {times[at]:g} s ahead" if times is not None else ""
            sized = f"sized for {rates[at]:.2f} req/s{when}"
            if isls:
                sized += f", ISL {isls[at]:.0f}"
            if osls:
                sized += f", OSL {osls[at]:.0f}"
            span = (
                f"; the most needed over the next {times[-1]:g} s (start-up {self.config.worker_startup_s:g} s + "
                f"interval {self.config.adjustment_interval:g} s: until the next decision's workers serve)"
                if times is not None and len(times) > 1
                else ""
            )
            reasons[p] = f"{sized}; {why_at[p][at]}: {sizes[p]} workers{span}"
        return sizes, reasons

    def _aggregated_worth(
        self, rate: float, isl: float, osl: float | None, perf: PerfModel
    ) -> tuple[float, float, replicas.Sizing, replicas.Sizing | None]:
        """An aggregated pool's workers' worth at ``rate`` requests/s, unrounded: (prefill share, decode share, and
        the two sizings behind them); ``osl`` None: the prefill share alone (decode share 0, no decode sizing)."""
        cfg = self.config
        _, sp = replicas.prefill_workers(rate, isl, perf, cfg.ttft_s, self.ttft_correction, queue_wait=cfg.queue_wait)
        pm = sp.metrics
        prefill_share = pm["demand_tokens_per_s"] / (pm["max_utilisation"] * pm["worker_tokens_per_s"])
        if osl is None:
            return prefill_share, 0.0, sp, None
        _, sd = replicas.decode_workers(
            rate, isl, osl, perf, cfg.itl_s, self.itl_correction, kv_capacity_tokens=self._kv_capacity_tokens
        )
        dm = sd.metrics
        return prefill_share, dm["demand_tokens_per_s"] / dm["worker_tokens_per_s"], sp, sd

    def _scale_down(
        self,
        pool: Pool,
        current: int,
        wanted: int,
        load: _PoolLoad,
        perf: PerfModel,
        reason: str,
        aggregated: bool,
        snap: FleetSnapshot,
    ) -> tuple[int, str]:
        """How far ``pool`` may shrink toward ``wanted`` through the consolidation check, step by step."""
        if self.pending:
            return current, f"{reason}; would shrink to {wanted}, but a change is in progress"
        cfg = self.config
        fresh = {i.instance_id for i in load.fresh}
        ws: list[consolidation.WorkerLoad] = []
        if pool == Pool.PREFILL:
            # A disaggregated prefill pool: one shared queue, each worker an even share of it (``_ttft_reading``);
            # KV use only where a worker reports it (a prefill worker hands its KV on; absent, 0).
            view = snap.queue(self.model)
            if view is None or view.waiting is None or self._last_isl is None:
                return current, f"{reason}; scale-down to {wanted} refused: no prefill queue reading to re-predict"
            share = view.waiting * max(1, round(self._last_isl)) / len(load.workers)
            for inst in load.workers:
                kv = inst.load.snapshot.kv_usage if inst.instance_id in fresh and inst.load is not None else 0.0
                ws.append(consolidation.WorkerLoad(inst.instance_id, kv_usage=kv, queued_prefill_tokens=share))
        for inst in load.workers if pool == Pool.DECODE else ():
            if inst.instance_id not in fresh or inst.load is None:
                ws.append(consolidation.WorkerLoad(inst.instance_id))  # no report: the check refuses, saying so
                continue
            s = inst.load.snapshot
            ws.append(
                consolidation.WorkerLoad(
                    inst.instance_id,
                    kv_usage=s.kv_usage,
                    decode_seqs=s.num_running,
                    kv_tokens=float(s.num_kv_tokens),
                    queued_prefill_tokens=float(s.num_waiting_prefill_tokens),
                )
            )
        checks_itl = pool == Pool.DECODE
        checks_ttft = (pool == Pool.PREFILL or aggregated) and self._last_isl is not None
        size = len(ws)
        first = None
        refusal = None
        while size > wanted:
            v = consolidation.consolidation_check(
                ws,
                perf,
                itl_target_s=cfg.itl_s if checks_itl else None,
                ttft_target_s=cfg.ttft_s if checks_ttft else None,
                isl=self._last_isl if checks_ttft else None,
                sensitivity=cfg.scale_down_sensitivity,
                itl_correction=self.itl_correction,
                ttft_correction=self.ttft_correction,
            )
            first = first or v
            if not v.allowed:
                refusal = v
                break
            ws = [_scaled(w, v.factor) for w in ws[:-1]]
            size -= 1
        size = min(current, max(size, wanted))
        if size == current:
            why = refusal.reason if refusal else "no change"
            return current, f"{reason}; scale-down to {wanted} refused: {why}"
        tail = f"; stopped at {size}: {refusal.reason}" if refusal else ""
        return size, f"{reason}; consolidation check: {current} -> {size} allowed{tail}"

    # ----------------------------------------------------------------------------------------------------------------
    # Budget and steps

    def _current(self, obs: Observation) -> dict[Pool, int]:
        """Each pool's workers as the plan counts them: registered, or the target of an addition in progress (its
        workers hold their GPUs from the moment they are asked for)."""
        out = {Pool.DECODE: obs.decode.workers}
        if obs.prefill is not None:
            out[Pool.PREFILL] = obs.prefill.workers
        for pool, change in self.pending.items():
            if pool in out and change.target > change.before:
                out[pool] = max(out[pool], change.target)
        return out

    def _may_add(self, pool: Pool) -> bool:
        """Whether an addition to ``pool`` may be issued with changes in progress (additions only): the pool has
        none, or its own is an addition (which the new, larger count supersedes)."""
        change = self.pending.get(pool)
        return change is None or change.target > change.before

    def _removing(self) -> bool:
        """A removal is in progress: no step until it ends (what it frees may be what the next step needs)."""
        return any(c.target < c.before for c in self.pending.values())

    def _plan(self, obs: Observation, allowed_down: set[Pool]) -> BudgetPlan:
        """The budgeted counts and ordered steps from the current pools to the targets; a pool not cleared to shrink
        keeps at least its current count."""
        cfg = self.config
        current = self._current(obs)
        aggregated = obs.prefill is None
        gd = worker_gpus(obs.decode, cfg.decode_engine_num_gpu)
        gp = worker_gpus(obs.prefill, cfg.prefill_engine_num_gpu) if obs.prefill is not None else 1
        cur_p = 0 if aggregated else current[Pool.PREFILL]
        cur_d = current[Pool.DECODE]
        want_p = 0 if aggregated else self.target.get(Pool.PREFILL, cur_p)
        want_d = self.target.get(Pool.DECODE, cur_d)
        base_p = 0 if aggregated else cfg.min_endpoint
        min_p = base_p if Pool.PREFILL in allowed_down or aggregated else max(base_p, min(cur_p, want_p))
        min_d = cfg.min_endpoint if Pool.DECODE in allowed_down else max(cfg.min_endpoint, min(cur_d, want_d))
        kwargs = dict(
            gpus_per_prefill=gp,
            gpus_per_decode=gd,
            max_gpu_budget=cfg.max_gpu_budget,
            min_gpu_budget=cfg.min_gpu_budget,
        )
        try:
            return plan_budget(cur_p, cur_d, want_p, want_d, min_prefill=min_p, min_decode=min_d, **kwargs)
        except ValueError:
            # Keeping the current counts does not fit (a fleet over budget): the standard minimums, which must.
            return plan_budget(cur_p, cur_d, want_p, want_d, min_prefill=base_p, min_decode=cfg.min_endpoint, **kwargs)

    def _emit(
        self, obs: Observation, reasons: Mapping[Pool, str], allowed_down: set[Pool], note: str = ""
    ) -> Adjustment:
        """The adjustment for this pull: the budget plan's first step if nothing is in progress (the rest later),
        every other pool held with why."""
        cfg = self.config
        current = self._current(obs)
        try:
            plan = self._plan(obs, allowed_down)
        except ValueError as e:
            holds = tuple(
                ScalingDecision(p, Direction.HOLD, c, c, f"{reasons.get(p, '')}; budget: {e}", {}, cfg.no_operation)
                for p, c in self._ordered(current)
            )
            gpus = pull_figures(obs, self._gpu_config).gpus
            return Adjustment(obs.now_s, holds, gpus, gpus, cfg.no_operation, note)
        if Pool.PREFILL in current:
            self.target[Pool.PREFILL] = plan.prefill
        self.target[Pool.DECODE] = plan.decode
        gpus_before = int(plan.metrics["current_gpus"])
        step = None
        if not self.pending:
            step = plan.steps[0] if plan.steps else None
        elif not self._removing():
            # Additions in progress only: an addition to another pool may start now. The plan counts the pending
            # workers as there (``_current``), so it fits the budget with them; a removal waits for them to settle.
            # An addition in progress on the same pool may be raised too: the plan counts its workers as there, so
            # a step above that is a further addition (an absolute count the connector starts at once, beside the
            # workers already starting). Waiting for the first to register cost a whole start-up when the load
            # stepped up: issue 10528's step at a 30 s start-up went 1 -> 2 (fast loop, 1 s in), then only 30 s
            # later to the 6 the next pulls already asked for.
            step = next(
                (st for st in plan.steps if not st.is_removal and self._may_add(Pool(st.pool))),
                None,
            )
            if step is not None and plan.steps[0].is_removal:
                step = None
        if step is not None and not cfg.no_operation:
            self._issued[Pool(step.pool)] = step.workers_to
        metrics_common = {
            "ttft_correction": self.ttft_correction,
            "itl_correction": self.itl_correction,
            "max_gpu_budget": float(cfg.max_gpu_budget),
            "gpus_before": float(gpus_before),
        }
        decisions = []
        for pool, cur in self._ordered(current):
            want = plan.prefill if pool == Pool.PREFILL else plan.decode
            reason = reasons.get(pool, "")
            if plan.clamped:
                reason = f"{reason}; budget: {plan.reason}" if reason else f"budget: {plan.reason}"
            metrics = {
                **metrics_common,
                "throughput_workers": float(self.floor.get(pool, cur)),
                "target_workers": float(want),
            }
            if step is not None and step.pool == str(pool):
                direction = Direction.UP if step.workers_to > cur else Direction.DOWN
                decisions.append(
                    ScalingDecision(pool, direction, cur, step.workers_to, reason, metrics, cfg.no_operation)
                )
                continue
            if want != cur:
                if pool in self.pending or (self.pending and step is None):
                    wait = f"after the {', '.join(map(str, self.pending))} change in progress"
                else:
                    wait = f"after {step.pool} {step.workers_from} -> {step.workers_to}" if step else "waiting"
                reason = f"{reason}; {pool} {cur} -> {want} {wait}"
            decisions.append(ScalingDecision(pool, Direction.HOLD, cur, cur, reason, metrics, cfg.no_operation))
        gpus_after = step.gpus_after if step is not None else gpus_before
        return Adjustment(obs.now_s, tuple(decisions), gpus_before, gpus_after, cfg.no_operation, note)

    def _waiting_step(self, obs: Observation) -> Adjustment | None:
        """A step of the plan that waited on a change in progress, issued once that change has ended. A pool's
        target under its current count is not carried over (a removal is decided at its throughput decision only),
        unless it is a removal already issued (asked for again: a step is an absolute count)."""
        if self._removing() or self.config.no_operation or not self.target:
            return None
        current = self._current(obs)
        for pool, cur in current.items():
            # Not a removal already issued that discovery does not show yet (its worker left routing, not the
            # registry): undoing that target would add back the worker just removed.
            if pool in self.target and self.target[pool] < cur and self._issued.get(pool) != self.target[pool]:
                self.target[pool] = cur
        if all(self.target.get(pool, cur) == cur for pool, cur in current.items()):
            return None
        adj = self._emit(obs, {pool: "continuing the plan: the previous change ended" for pool in current}, set())
        return adj if adj.changes() else None

    @staticmethod
    def _ordered(current: Mapping[Pool, int]) -> list[tuple[Pool, int]]:
        """Decode first, then prefill (the ``Adjustment`` order)."""
        return [(p, current[p]) for p in (Pool.DECODE, Pool.PREFILL) if p in current]


def _mean_s(ms: Sequence[float]) -> float | None:
    return sum(ms) / len(ms) / 1e3 if ms else None


def _scaled(w: consolidation.WorkerLoad, f: float) -> consolidation.WorkerLoad:
    """A survivor's load after a removal from a balanced pool: every quantity x ``f``."""
    return consolidation.WorkerLoad(
        w.worker_id,
        kv_usage=None if w.kv_usage is None else w.kv_usage * f,
        decode_seqs=math.ceil(w.decode_seqs * f - 1e-9),
        kv_tokens=w.kv_tokens * f,
        queued_prefill_tokens=w.queued_prefill_tokens * f,
    )


def kv_capacity_tokens(instances: Sequence[FleetInstance]) -> float | None:
    """The smallest KV cache, in tokens, among ``instances`` that reported a load and announce a block size (their
    total blocks x tokens per block); None when none did. ``replicas.decode_workers`` keeps the batch it counts on
    within it: without it, a fast engine model (an H100's step times) counts a worker as decoding up to 1,024
    sequences within the ITL target while its cache holds a few dozen of them (kvmesh bench planner-live: 21)."""
    caps = [
        float(i.load.snapshot.num_total_blocks * i.meta.block_size)
        for i in instances
        if i.load is not None and i.meta.block_size > 0 and i.load.snapshot.num_total_blocks > 0
    ]
    return min(caps) if caps else None
