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
2. The forecast: ``predict_ahead(lead + 1)`` for each series, ``lead = ceil(worker_startup_s /
   adjustment_interval)``; each interval's pool sizes from ``replicas.prefill_workers`` / ``decode_workers`` with the
   correction factors; ``startup.pool_to_request`` asks for the most any interval within the lead needs. A predicted
   rate of 0 needs ``min_endpoint``. A pool whose input is unknown (no output length heard yet) holds, saying so.
   Aggregated deployment (one pool, ``decode``): its workers do both, so it is sized on the sum of both demands'
   worker fractions, ``ceil(prefill demand / (rho x one worker's prefill throughput) + decode demand / one
   worker's decode throughput)``: a worker's time is shared between prefill chunks and decode steps, and a mixed
   step costs about the sum of its parts (``StepTimeModel.step_ms``; slightly conservative, since it counts the
   fixed cost of both).
3. Corrections (unless ``no_correction``): ``correction.update_correction`` with the interval's observed mean TTFT
   and ITL against the mean of what the fast loop predicted (uncorrected) at the interval's pulls: TTFT including
   queue wait, so the factor corrects the engine's speed and not queueing the model already counts.
4. Several workers per step: the new size is absolute (``pool_to_request``'s), not one worker at a time.

Fast loop (every pull)
----------------------
Each fresh worker's predicted TTFT for a prompt of the latest mean length, its queue wait included
(``components.perf.queueing.predicted_ttft_ms``: the router's model), and its predicted ITL (the decode step at its
reported ``batch_size`` and ``num_kv_tokens``), both corrected; the pool's figure is the mean over its fresh workers
(the router spreads the load; one busy worker is the router's business, a busy pool the planner's). When the mean
breaks a target, the pool is raised: TTFT, to the size at which the same backlog spread over more workers waits
within the target (``n' = ceil(n x wait / (target - own prefill))``; no size helps when a prompt alone is over
target, and the reason says so); ITL, to the smallest size whose per-worker share of the batch and KV steps within
target. Raised above the throughput loop's size, never below it; the next throughput decision may bring it back
down only through the consolidation check.

Scale-down
----------
Only through ``consolidation.consolidation_check``: from N, each survivor re-predicted with N/(N-1) of the load (KV
use, ITL, TTFT against target x ``scale_down_sensitivity``); repeated step by step (the survivors' loads scaled each
time) down to the wanted size or the first refusal, whose reason (naming the constraint: KV, ITL or TTFT) is the
decision's. While a change is in progress no removal is decided (the loads describe a fleet in motion).

Atomic budget
-------------
``budget.plan_budget`` turns the wanted sizes into counts within ``max_gpu_budget``/``min_gpu_budget`` and ordered
steps, removals first. A pool that was not cleared to shrink (by the consolidation check, at this decision) keeps at
least its current count in the plan, so a budget cut never removes what the check refused. The controller hands out
one step at a time: a step is issued only when no change is in progress (``change_ended`` closed the previous one), so
an addition never starts before the removal that frees its GPUs, and no step asks for GPUs the budget does not have
free, so none waits on a change that cannot complete. The remaining steps follow at the pulls after each change ends.

Emitted: an ``Adjustment`` at every throughput decision (holds included), when the fast loop raises a pool, and when
a waiting step can be issued; otherwise ``PullOutcome.adjustment`` is None. ``no_operation``: decisions are flagged,
nothing is applied, and no waiting step is re-issued.

Imports the fleet view's types (rank 3), this package's pure core and the load planner's policy/controller types.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from components.fleet.model import FleetInstance, FleetSnapshot
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
from components.planner.sla import consolidation, correction, replicas, startup
from components.planner.sla.budget import BudgetPlan, plan_budget
from components.planner.sla.config import SlaPlannerConfig
from components.planner.sla.figures import SlaFigures
from components.planner.sla.predictors import Predictor, make_predictor

__all__ = ["SlaController"]

_TIME_EPS_S = 1e-9  # pulls at 0, 1, ..., 30 s must make 30 s, not 29.999...
_FAST_MAX_FACTOR = 8  # the ITL raise looks at most this many times the pool (the budget bounds it anyway)


@dataclasses.dataclass(frozen=True, slots=True)
class _PoolLoad:
    """A pool's fresh load reports, as the fast loop and the consolidation check read them."""

    workers: tuple[FleetInstance, ...]  # the pool's registered workers
    fresh: tuple[FleetInstance, ...]  # those with a fresh load report


@dataclasses.dataclass(frozen=True, slots=True)
class _Fast:
    """One pool's fast-loop reading at this pull."""

    ttft_ms: float | None = None  # mean predicted TTFT over fresh workers, uncorrected
    itl_ms: float | None = None  # mean predicted ITL over fresh workers decoding, uncorrected
    need: int | None = None  # the size the fast loop asks for (None: no raise)
    reason: str = ""


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
        self.num_adjustments = 0
        self.interval_start_s: float | None = None
        self.ttft_correction = 1.0
        self.itl_correction = 1.0
        self.floor: dict[Pool, int] = {}  # the throughput loop's sizes
        self.target: dict[Pool, int] = {}  # what the planner steers to (floor, raised by the fast loop, budgeted)
        self._predicted: tuple[float, float | None, float | None] | None = None  # (rate, isl, osl) for this interval
        self._last_isl: float | None = None  # the latest prompt length heard (the fast loop's TTFT prompt)
        self._ttft_pred: list[float] = []  # this interval's fast-loop TTFT predictions (ms, uncorrected)
        self._itl_pred: list[float] = []  # and ITL

    # ----------------------------------------------------------------------------------------------------------------
    # The controller's surface (PlannerController's)

    def pull(self, snap: FleetSnapshot, gpus_per_worker: Mapping[Pool, int | None] | None = None) -> PullOutcome:
        """One pull at ``snap.now_s``: the fast loop, and the throughput loop when an interval has passed. The
        adjustment's changes (``Adjustment.changes()``) are the caller's to carry out, each announced with
        ``change_started`` and closed with ``change_ended``."""
        now = snap.now_s
        obs = build_observation(snap, self.model, self.pending, gpus_per_worker)
        figures = pull_figures(obs, self._gpu_config)
        running, waiting = request_totals(snap, self.model)
        self.num_pulls += 1
        loads = self._pool_loads(snap, obs)
        aggregated = obs.prefill is None
        fast = {pool: self._fast(pool, load, aggregated) for pool, load in loads.items()}
        for pool, f in fast.items():
            if f.ttft_ms is not None and self._ttft_pool(obs) == pool:
                self._ttft_pred.append(f.ttft_ms)
            if f.itl_ms is not None and pool == Pool.DECODE:
                self._itl_pred.append(f.itl_ms)

        adj: Adjustment | None = None
        sla = SlaFigures(now_s=now, interval=False)
        if self.interval_start_s is None:
            self.interval_start_s = now
        elif now - self.interval_start_s >= self.config.adjustment_interval - _TIME_EPS_S:
            adj, sla = self._throughput(snap, obs, loads, fast)
            self.interval_start_s = now
            self._ttft_pred, self._itl_pred = [], []
        if adj is None:
            adj = self._fast_raise(obs, fast)
        if adj is None:
            adj = self._waiting_step(obs)
        if adj is not None:
            self.num_adjustments += 1
        sla = dataclasses.replace(
            sla,
            predicted_ttft_s=self._corrected_s(fast, self._ttft_pool(obs), "ttft"),
            predicted_itl_s=self._corrected_s(fast, Pool.DECODE, "itl"),
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

    @staticmethod
    def _ttft_pool(obs: Observation) -> Pool:
        """The pool whose queue a new prompt waits in: prefill when there is one, else the aggregated pool."""
        return Pool.DECODE if obs.prefill is None else Pool.PREFILL

    def _corrected_s(self, fast: Mapping[Pool, _Fast], pool: Pool, what: str) -> float | None:
        f = fast.get(pool)
        if f is None:
            return None
        ms = f.ttft_ms if what == "ttft" else f.itl_ms
        factor = self.ttft_correction if what == "ttft" else self.itl_correction
        return None if ms is None else factor * ms / 1e3

    # ----------------------------------------------------------------------------------------------------------------
    # Fast loop

    def _fast(self, pool: Pool, load: _PoolLoad, aggregated: bool) -> _Fast:
        """The pool's mean predicted TTFT and ITL from its fresh load reports, and the size that brings a broken one
        back within target (module docstring)."""
        if not load.fresh:
            return _Fast()
        cfg = self.config
        n = len(load.workers)
        ttft_ms: float | None = None
        wait_ms = own_ms = 0.0
        isl = self._last_isl
        if (pool == Pool.PREFILL or aggregated) and isl is not None:
            n_isl = max(1, round(isl))
            totals, waits, owns = [], [], []
            for inst in load.fresh:
                assert inst.load is not None
                s = inst.load.snapshot
                perf = self._worker_perf(inst)
                seqs = 0 if pool == Pool.PREFILL else s.num_running
                kv = 0.0 if pool == Pool.PREFILL else float(s.num_kv_tokens)
                total = predicted_ttft_ms(perf, n_isl, s.num_waiting_prefill_tokens, seqs, kv)
                own = perf.chunked_prefill_ms(n_isl)
                totals.append(total)
                waits.append(total - own)
                owns.append(own)
            ttft_ms = sum(totals) / len(totals)
            wait_ms, own_ms = sum(waits) / len(waits), sum(owns) / len(owns)
        itl_ms: float | None = None
        batch = kv_tokens = 0.0
        if pool == Pool.DECODE:
            decoding = [i for i in load.fresh if i.load is not None and i.load.snapshot.batch_size > 0]
            if decoding:
                steps = []
                for inst in decoding:
                    assert inst.load is not None
                    s = inst.load.snapshot
                    steps.append(self._worker_perf(inst).decode_ms(s.batch_size, s.num_kv_tokens))
                itl_ms = sum(steps) / len(steps)
                batch = sum(i.load.snapshot.batch_size for i in decoding if i.load) / len(decoding)
                kv_tokens = sum(i.load.snapshot.num_kv_tokens for i in decoding if i.load) / len(decoding)

        need: int | None = None
        reasons: list[str] = []
        if ttft_ms is not None and self.ttft_correction * ttft_ms > cfg.ttft:
            target, own, wait = cfg.ttft, self.ttft_correction * own_ms, self.ttft_correction * wait_ms
            seen = f"predicted TTFT {self.ttft_correction * ttft_ms:.0f} ms > {target:g} ms target"
            if own >= target:
                reasons.append(f"{seen}, but a prompt alone takes {own:.0f} ms: more workers do not help")
            else:
                size = max(n + 1, math.ceil(n * wait / (target - own) - 1e-9))
                need = size
                reasons.append(f"{seen} ({wait:.0f} ms queue wait on {n}): {size} workers spread it within target")
        if itl_ms is not None and self.itl_correction * itl_ms > cfg.itl:
            seen = f"predicted ITL {self.itl_correction * itl_ms:.1f} ms > {cfg.itl:g} ms target"
            perf = self._pool_perf(load)
            found: int | None = None
            for m in range(n + 1, n * _FAST_MAX_FACTOR + 1):
                share = math.ceil(batch * n / m - 1e-9)
                if self.itl_correction * perf.decode_ms(share, kv_tokens * n / m) <= cfg.itl:
                    found = m
                    break
            if found is None:
                size = n * _FAST_MAX_FACTOR
                reasons.append(f"{seen}: no size up to {size} meets it; asking for {size}")
            else:
                size = found
                reasons.append(f"{seen} (batch {batch:.0f} on each of {n}): {size} workers step within target")
            need = max(need or 0, size)
        return _Fast(ttft_ms, itl_ms, need, "; ".join(reasons))

    def _fast_raise(self, obs: Observation, fast: Mapping[Pool, _Fast]) -> Adjustment | None:
        """At a pull between throughput decisions: raise a pool whose fast-loop need is over what the planner steers
        to, and issue the step if nothing is in progress."""
        current = self._current(obs)
        raised: dict[Pool, str] = {}
        for pool, f in fast.items():
            if f.need is None:
                continue
            steer = max(self.target.get(pool, current[pool]), current[pool])
            if f.need > steer:
                self.target[pool] = max(f.need, self.floor.get(pool, 0))
                raised[pool] = f"fast loop: {f.reason}"
        if not raised:
            return None
        return self._emit(obs, raised, allowed_down=set())

    # ----------------------------------------------------------------------------------------------------------------
    # Throughput loop

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
        if window.reports == 0:
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
            t = correction.update_correction(
                self.ttft_correction,
                window.mean_ttft_s,
                _mean_s(self._ttft_pred),
            )
            i = correction.update_correction(self.itl_correction, window.mean_itl_s, _mean_s(self._itl_pred))
            self.ttft_correction, self.itl_correction = t.factor, i.factor
            notes.append(f"TTFT correction {t.factor:.3f} ({t.reason}); ITL correction {i.factor:.3f} ({i.reason})")

        steps = self.lead + 1
        rates = self.rate.predict_ahead(steps)
        isls = self.isl.predict_ahead(steps) if self.isl.ready else None
        osls = self.osl.predict_ahead(steps) if self.osl.ready else None
        self._predicted = (rates[0], isls[0] if isls else None, osls[0] if osls else None)
        sla = dataclasses.replace(
            sla, next_request_rate=rates[0], next_isl=self._predicted[1], next_osl=osls[0] if osls else None
        )

        perf = {pool: self._pool_perf(load) for pool, load in loads.items()}
        wanted, why = self._throughput_sizes(obs, rates, isls, osls, perf)
        reasons: dict[Pool, str] = {}
        allowed_down: set[Pool] = set()
        for pool, cur in current.items():
            if pool not in wanted:
                reasons[pool] = why[pool]
                self.target.pop(pool, None)
                continue
            floor = wanted[pool]
            self.floor[pool] = floor
            want, reason = floor, why[pool]
            f = fast.get(pool)
            if f is not None and f.need is not None and f.need > want:
                want, reason = f.need, f"{reason}; fast loop: {f.reason}"
            if want < cur:
                want, reason = self._scale_down(pool, cur, want, loads[pool], perf[pool], reason, obs.prefill is None)
                if want < cur:
                    allowed_down.add(pool)
            self.target[pool] = want
            reasons[pool] = reason
        return self._emit(obs, reasons, allowed_down, note="; ".join(notes)), sla

    def _throughput_sizes(
        self,
        obs: Observation,
        rates: Sequence[float],
        isls: Sequence[float] | None,
        osls: Sequence[float] | None,
        perf: Mapping[Pool, PerfModel],
    ) -> tuple[dict[Pool, int], dict[Pool, str]]:
        """Each pool's size from the forecast with the start-up lead; a pool missing from the first mapping holds
        (its reason in the second)."""
        cfg = self.config
        pools = [Pool.DECODE] + ([Pool.PREFILL] if obs.prefill is not None else [])
        needs: dict[Pool, list[int]] = {p: [] for p in pools}
        first: dict[Pool, str] = {}
        missing: dict[Pool, str] = {}
        for k, rate in enumerate(rates):
            if rate <= 0:
                for p in pools:
                    needs[p].append(cfg.min_endpoint)
                    first.setdefault(p, "no requests predicted")
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
                first.setdefault(Pool.PREFILL, f"prefill: {sp.reason}")
            if osl is None:
                missing[Pool.DECODE] = "no output length heard yet (no request finished): holding"
                continue
            _, sd = replicas.decode_workers(rate, isl, osl, perf[Pool.DECODE], cfg.itl_s, self.itl_correction)
            if obs.prefill is not None:
                needs[Pool.DECODE].append(max(cfg.min_endpoint, sd.workers))
                first.setdefault(Pool.DECODE, f"decode: {sd.reason}")
                continue
            # Aggregated: one pool does both; the sum of both demands' worker fractions (module docstring).
            _, sp = replicas.prefill_workers(
                rate, isl, perf[Pool.DECODE], cfg.ttft_s, self.ttft_correction, queue_wait=cfg.queue_wait
            )
            pm, dm = sp.metrics, sd.metrics
            prefill_share = pm["demand_tokens_per_s"] / (pm["max_utilisation"] * pm["worker_tokens_per_s"])
            decode_share = dm["demand_tokens_per_s"] / dm["worker_tokens_per_s"]
            n = replicas.workers_for(prefill_share + decode_share, 1.0)
            needs[Pool.DECODE].append(max(cfg.min_endpoint, n))
            first.setdefault(
                Pool.DECODE,
                f"aggregated: prefill {prefill_share:.2f} + decode {decode_share:.2f} workers' worth = {n} "
                f"(prefill: {sp.reason}; decode: {sd.reason})",
            )
        sizes: dict[Pool, int] = {}
        reasons: dict[Pool, str] = {}
        for p in pools:
            if p in missing:
                reasons[p] = missing[p]
                continue
            lead = startup.pool_to_request(needs[p], self.config.worker_startup_s, self.config.adjustment_interval)
            sizes[p] = lead.workers
            predicted = f"predicted {rates[0]:.2f} req/s"
            if isls:
                predicted += f", ISL {isls[0]:.0f}"
            if osls:
                predicted += f", OSL {osls[0]:.0f}"
            reasons[p] = f"{predicted}; {first.get(p, '')}; {lead.reason}"
        return sizes, reasons

    def _scale_down(
        self, pool: Pool, current: int, wanted: int, load: _PoolLoad, perf: PerfModel, reason: str, aggregated: bool
    ) -> tuple[int, str]:
        """How far ``pool`` may shrink toward ``wanted`` through the consolidation check, step by step."""
        if self.pending:
            return current, f"{reason}; would shrink to {wanted}, but a change is in progress"
        cfg = self.config
        fresh = {i.instance_id for i in load.fresh}
        ws: list[consolidation.WorkerLoad] = []
        for inst in load.workers:
            if inst.instance_id not in fresh or inst.load is None:
                ws.append(consolidation.WorkerLoad(inst.instance_id))  # no report: the check refuses, saying so
                continue
            s = inst.load.snapshot
            ws.append(
                consolidation.WorkerLoad(
                    inst.instance_id,
                    kv_usage=s.kv_usage,
                    decode_seqs=s.num_running if pool == Pool.DECODE else 0,
                    kv_tokens=float(s.num_kv_tokens) if pool == Pool.DECODE else 0.0,
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

    @staticmethod
    def _current(obs: Observation) -> dict[Pool, int]:
        out = {Pool.DECODE: obs.decode.workers}
        if obs.prefill is not None:
            out[Pool.PREFILL] = obs.prefill.workers
        return out

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
        step = plan.steps[0] if plan.steps and not self.pending else None
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
                if self.pending:
                    wait = f"{', '.join(map(str, self.pending))} change in progress"
                else:
                    wait = f"after {step.pool} {step.workers_from} -> {step.workers_to}" if step else "waiting"
                reason = f"{reason}; {pool} {cur} -> {want} {wait}"
            decisions.append(ScalingDecision(pool, Direction.HOLD, cur, cur, reason, metrics, cfg.no_operation))
        gpus_after = step.gpus_after if step is not None else gpus_before
        return Adjustment(obs.now_s, tuple(decisions), gpus_before, gpus_after, cfg.no_operation, note)

    def _waiting_step(self, obs: Observation) -> Adjustment | None:
        """A step of the plan that waited on a change in progress, issued once that change has ended. A pool's
        target under its current count is not carried over (a removal is decided at its throughput decision only)."""
        if self.pending or self.config.no_operation or not self.target:
            return None
        current = self._current(obs)
        for pool, cur in current.items():
            if pool in self.target and self.target[pool] < cur:
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
