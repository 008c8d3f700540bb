"""A fleet that the real planner resizes, on a virtual clock: what ``kvmesh bench planner`` measures.

The engines and the router are the simulator library's (``components.sim``; ``VirtualEngine``: the mock engine's own
scheduler and step-time model; ``components.router.Router`` placing every request, fed load reports every 100 ms and
KV events at each step's end).
On top of them, at every ``metric_pulling_interval``, the planner does what ``components/planner/loop.py``'s
``Planner.pull`` does, with the same pure functions:

* the pool from discovery: ``fleet_from_instances`` over the registered workers' ``InstanceInfo`` (as etcd lists them);
* each worker's latest ``LoadSnapshot`` stamped with its arrival time (a worker that left is forgotten), the pool's
  change in progress (``PendingChange``), ``build_observation``, ``pull_figures``, ``request_totals``;
* ``decide`` (components/planner/policy.py, the policy the live planner runs) with a ``PlannerConfig``; each applied
  decision becomes a ``PendingChange`` and a call of the modelled connector below, and the change is in progress
  until the connector says it is done, which pauses the policy exactly as the live loop's change task does.

``ModelledConnector`` is the local connector's behaviour (components/planner/connectors/local.py) with its delays made
explicit: a new worker is asked for at once, holds its GPU from that moment, and registers (joins routing and the
planner's pool) ``startup_s`` later; a removed worker is the pool's most recently added one (never the first), leaves
routing and the pool at the decision, finishes every request it holds, and exits when it has none left, which is
when its worker-seconds stop and the change is done.

A ``Controller`` (``ScalingSpec.controller``: the clairvoyant fleet, ``clairvoyant.Oracle``) can resize the pool
in the policy's place through the same connector, with the planner's cadence and optionally its loop's pause and
grace period.

What is left out: the network and the frontend (load reports and KV events arrive when sent), the time circus and
etcd take (a few ms to a few hundred ms against seconds of start-up), a worker that fails to start, and the
planner's own CPU time. Time is virtual, so a run's cost is the work it simulates, not its duration, and one
workload, configuration and seed always give the same numbers.

Also here, pure and tested on their own: the sinusoidal arrival schedule (``Sinusoid``, ``arrival_times``), the
request stream of a trace cycled past its end (``RequestSource``), worker-seconds (``worker_seconds``), SLO
attainment (``components.sim.report``), and a fixed-resolution histogram for the inter-token gaps (``GapHistogram``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from components.planner.config import PlannerConfig
from components.planner.loop import (
    PendingChange,
    build_observation,
    fleet_from_instances,
    request_totals,
)
from components.planner.policy import (
    NEW_DECODE_WORKER_GRACE_PERIOD,
    Adjustment,
    Direction,
    PlannerState,
    Pool,
    decide,
    pull_figures,
)
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.messages import GenerateRequest, LoadSnapshot, SamplingParams
from components.protocol.metadata import WorkerMetadata, WorkerRole
from components.router import Router, RouterConfig, RouteRequest
from components.runtime import InstanceInfo
from components.sim import MODEL, account_chunk
from components.sim.report import RequestTimes
from components.sim.traces import MooncakeBlocks, TraceRow, read_trace, token_ids
from components.workers.simulated import MockEngineConfig, StepOutput, VirtualEngine, step_time_of

# --- the load ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Sinusoid:
    """The offered load as a fraction of a reference rate: ``low`` at t = 0, ``high`` at half a period, back to
    ``low`` at each whole period (Dynamo's sin_synth shape: mid + amp * sin(2 pi t / P - pi / 2))."""

    period_s: float = 150.0
    duration_s: float = 600.0
    low: float = 0.25
    high: float = 1.0

    def __post_init__(self) -> None:
        if not (self.period_s > 0 and self.duration_s > 0 and 0 < self.low <= self.high):
            raise ValueError(f"bad sinusoid: {self}")

    @property
    def mean(self) -> float:
        """The mean fraction over whole periods."""
        return (self.low + self.high) / 2

    def fraction(self, t: float) -> float:
        mid, amp = (self.low + self.high) / 2, (self.high - self.low) / 2
        return mid - amp * math.cos(2 * math.pi * t / self.period_s)

    def expected_arrivals(self, peak_rps: float, t0: float, t1: float) -> float:
        """The integral of ``peak_rps * fraction`` over [t0, t1]: the expected number of arrivals."""
        mid, amp = (self.low + self.high) / 2, (self.high - self.low) / 2
        w = 2 * math.pi / self.period_s
        return peak_rps * (mid * (t1 - t0) - amp / w * (math.sin(w * t1) - math.sin(w * t0)))

    def scaled(self, factor: float) -> Sinusoid:
        """The same shape with its time axis divided by ``factor`` (time compression)."""
        return dataclasses.replace(self, period_s=self.period_s / factor, duration_s=self.duration_s / factor)


def arrival_times(sinusoid: Sinusoid, peak_rps: float, seed: int) -> list[float]:
    """Arrival times in [0, duration): a Poisson process whose rate at t is ``peak_rps * sinusoid.fraction(t)``, by
    thinning (candidates of a Poisson process at the highest rate, each kept with probability rate(t) / highest).
    Dynamo's generator draws a Poisson count per second and spreads it evenly; thinning is the exact process."""
    if peak_rps <= 0:
        raise ValueError(f"peak_rps must be > 0, got {peak_rps}")
    rng = random.Random(f"{seed}:sinusoid-arrivals")
    top = peak_rps * sinusoid.high
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= sinusoid.duration_s:
            return out
        if rng.random() * sinusoid.high < sinusoid.fraction(t):
            out.append(t)


class RequestSource:
    """Request ``k`` of a stream built from a trace's rows in file order: row ``k mod n`` of pass ``k div n``.

    A pass past the first gets prompts of the same lengths and the same sharing among themselves but none with an
    earlier pass, so cycling a trace adds no prefix-cache hits of its own: Mooncake hash ids are offset by the pass
    times (largest id + 1); Azure rows (random ids per row) take the pass in their seed; ShareGPT texts (byte ids) are
    shifted by ``pass * 1009`` modulo the vocabulary. Prompts are built when asked for, not kept (a 600 s run is
    tens of thousands of prompts)."""

    def __init__(self, rows: Sequence[TraceRow], name: str, *, vocab_size: int, seed: int, output_tokens: int) -> None:
        if not rows:
            raise ValueError(f"{name}: no requests")
        self.rows = list(rows)
        self.name = name
        self.vocab_size = vocab_size
        self.seed = seed
        self.output_tokens = output_tokens
        self._blocks = MooncakeBlocks(vocab_size, seed)
        self._id_span = 1 + max((h for r in self.rows for h in r.hash_ids), default=0)

    @classmethod
    def from_trace(
        cls, path: str | Path, *, vocab_size: int, seed: int, output_tokens: int, max_rows: int | None = None
    ) -> RequestSource:
        rows: list[TraceRow] = []
        for row in read_trace(path):
            rows.append(row)
            if max_rows is not None and len(rows) >= max_rows:
                break
        return cls(rows, Path(path).stem, vocab_size=vocab_size, seed=seed, output_tokens=output_tokens)

    def lengths(self, k: int) -> tuple[int, int]:
        """(prompt tokens, output tokens) of request ``k``."""
        row = self.rows[k % len(self.rows)]
        prompt = len(row.text.encode("utf-8")) if row.text is not None else max(1, row.input_length or 1)
        out = self.output_tokens if row.text is not None else max(1, row.output_length or self.output_tokens)
        return prompt, out

    def request(self, k: int) -> tuple[list[int], int]:
        """(prompt token ids, max_tokens) of request ``k``."""
        row = self.rows[k % len(self.rows)]
        cycle = k // len(self.rows)
        if row.text is not None:
            shift = cycle * 1009
            prompt = [(min(b, self.vocab_size - 1) + shift) % self.vocab_size for b in row.text.encode("utf-8")]
            return prompt, self.output_tokens
        n = max(1, row.input_length or 1)
        max_tokens = max(1, row.output_length or self.output_tokens)
        if row.hash_ids:
            ids = [h + cycle * self._id_span for h in row.hash_ids]
            return self._blocks.prompt(ids, n), max_tokens
        key = f"{self.seed}:{self.name}:{row.index}" + (f":{cycle}" if cycle else "")
        return token_ids(key, n, self.vocab_size), max_tokens

    def longest(self) -> int:
        """Most tokens (prompt + output) one request of the stream holds."""
        return max(sum(self.lengths(k)) for k in range(len(self.rows)))


# --- accounting ---------------------------------------------------------------------------------------------------


def worker_seconds(spans: Iterable[tuple[float, float | None]], t0: float, t1: float) -> float:
    """Worker-seconds held within [t0, t1]: each span (start, stop; None = still held) counts its overlap."""
    total = 0.0
    for start, stop in spans:
        end = t1 if stop is None else min(stop, t1)
        total += max(0.0, end - max(start, t0))
    return total


class GapHistogram:
    """Inter-token gaps in bins of ``bin_s`` (0.05 ms) up to ``max_s`` (10 s; longer ones kept exactly): a 600 s run
    has millions of gaps, too many to keep as Python floats. A percentile is exact to within one bin."""

    def __init__(self, bin_s: float = 5e-5, max_s: float = 10.0) -> None:
        self.bin_s = bin_s
        self.counts = [0] * (int(max_s / bin_s) + 1)
        self.over: list[float] = []
        self.n = 0

    def append(self, x: float) -> None:
        self.n += 1
        i = int(x / self.bin_s)
        if i < len(self.counts):
            self.counts[i] += 1
        else:
            self.over.append(x)

    def percentile(self, q: float) -> float | None:
        """The bin (its middle) holding the rank ``percentile`` would pick; exact beyond ``max_s``."""
        if self.n == 0:
            return None
        rank = min(self.n, max(1, math.ceil(q * self.n)))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return (i + 0.5) * self.bin_s
        return sorted(self.over)[rank - seen - 1]


# --- the connector, modelled ------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class WorkerSpan:
    """One worker's life: asked for (holds its GPU from then), registered, left routing, exited."""

    worker_id: int
    requested_s: float
    ready_s: float
    left_s: float | None = None
    exited_s: float | None = None

    def registered(self, now: float) -> bool:
        return self.ready_s <= now and self.left_s is None


class ModelledConnector:
    """The local connector's behaviour with its delays stated (module docstring). ``set_pool_size`` is the call the
    loop makes; the simulation tells it when a worker's start-up delay has passed (nothing to do: ``ready_s`` is
    known) and when a leaving worker ran out of work (``exited``); ``change_done`` is when ``set_pool_size`` would
    have returned."""

    def __init__(self, startup_s: float, first_id: int = 1) -> None:
        if startup_s < 0:
            raise ValueError(f"startup_s must be >= 0, got {startup_s}")
        self.startup_s = startup_s
        self.workers: list[WorkerSpan] = []
        self._next_id = first_id

    def start_fleet(self, n: int, now: float) -> list[WorkerSpan]:
        """The fleet the run starts with: registered at ``now``."""
        return [self._new(now, now) for _ in range(n)]

    def _new(self, now: float, ready_s: float) -> WorkerSpan:
        span = WorkerSpan(self._next_id, now, ready_s)
        self._next_id += 1
        self.workers.append(span)
        return span

    def active(self) -> list[WorkerSpan]:
        """Workers starting or registered (not asked to leave), oldest first: the pool as the connector counts it."""
        return [w for w in self.workers if w.left_s is None]

    def registered(self, now: float) -> list[WorkerSpan]:
        return [w for w in self.workers if w.registered(now)]

    def held(self, now: float) -> int:
        """Workers holding a GPU at ``now``: asked for and not exited."""
        return sum(1 for w in self.workers if w.requested_s <= now and (w.exited_s is None or w.exited_s > now))

    def set_pool_size(
        self, count: int, now: float, busy: Callable[[int], bool]
    ) -> tuple[list[WorkerSpan], list[WorkerSpan]]:
        """Make the pool ``count`` workers: (workers added, workers asked to leave). Added ones register
        ``startup_s`` later; leaving ones are the most recently added (never the first), leave routing now, and
        exit now if ``busy(worker_id)`` is False, else when ``exited`` is called. Unchanged: nothing."""
        if count < 1:
            raise ValueError(f"a pool keeps at least one worker, asked for {count}")
        active = self.active()
        added: list[WorkerSpan] = []
        leaving: list[WorkerSpan] = []
        if count > len(active):
            added = [self._new(now, now + self.startup_s) for _ in range(count - len(active))]
        elif count < len(active):
            for span in reversed(active[count:]):  # never active[0]: count >= 1
                span.left_s = now
                if not busy(span.worker_id):
                    span.exited_s = now
                leaving.append(span)
        return added, leaving

    def exited(self, worker_id: int, now: float) -> None:
        """A leaving worker finished its last request and exits."""
        span = next(w for w in self.workers if w.worker_id == worker_id)
        if span.left_s is None:
            raise ValueError(f"worker {worker_id} was not asked to leave")
        if span.exited_s is None:
            span.exited_s = now

    def change_done(self, now: float) -> bool:
        """No worker still starting, none left routing without having exited."""
        return all(w.ready_s <= now for w in self.active()) and all(
            w.exited_s is not None for w in self.workers if w.left_s is not None
        )

    def spans(self) -> list[tuple[float, float | None]]:
        return [(w.requested_s, w.exited_s) for w in self.workers]


# --- the simulation ---------------------------------------------------------------------------------------------------


class Controller(Protocol):
    """A schedule that resizes the pool in the planner's place (``clairvoyant.Oracle``), under the planner's rules:
    ``decide`` is called every ``interval_s`` and returns the pool size to set (one more, one fewer or the same) and
    why. With ``loop_rules`` the simulation also applies the planner loop's: no decision while a change is in
    progress, the next a whole interval after the first pull that finds the pool settled, and none that removes a
    worker (``may_remove`` False) in the ``NEW_DECODE_WORKER_GRACE_PERIOD`` decisions after an addition."""

    @property
    def interval_s(self) -> float: ...

    @property
    def loop_rules(self) -> bool: ...

    def decide(
        self, now: float, active: int, starting_ready_s: Sequence[float], may_remove: bool
    ) -> tuple[int, str]: ...


@dataclasses.dataclass(frozen=True)
class ScalingSpec:
    """One fleet's run: its engines, how many workers it starts with, and the planner that watches it
    (``planner.no_operation``: a fixed fleet, the planner only reporting what it would do, as Dynamo's benchmark ran
    its fixed baseline). With a ``controller``, that resizes the pool instead of the planner's policy, from
    ``planner_from_s``; the pulls still sample the fleet (KV use, pool sizes) at the planner's pulling interval."""

    engine: MockEngineConfig
    initial_workers: int
    planner: PlannerConfig
    startup_s: float = 30.0
    policy: str = "kv"
    metrics_interval_s: float = 0.1  # workers publish their LoadSnapshot this often (WorkerConfig.metrics_interval_ms)
    controller: Controller | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """The fleet at one planner pull."""

    t: float
    kv_usage: float | None  # the planner's figure: mean over the pool's fresh snapshots
    registered: int  # workers in the pool (routing)
    held: int  # workers holding a GPU (starting and draining ones too)
    running: int
    waiting: int


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One applied scaling decision: when it was decided, when the connector finished it, and why."""

    decided_s: float
    done_s: float | None
    direction: str
    before: int
    target: int
    reason: str


@dataclasses.dataclass
class ScalingResult:
    requests: list[RequestTimes]
    gaps: GapHistogram
    samples: list[Sample]
    actions: list[Action]
    would: dict[str, int]  # under no_operation: decisions the planner would have applied, by direction
    spans: list[tuple[float, float | None]]
    adjustments: int
    end_s: float  # when the last request finished
    preemptions: int
    output_tokens: int


_STEP, _READY, _ARRIVAL, _REPORT, _PULL = range(5)  # event kinds, in their order at one instant


def simulate(
    source: RequestSource,
    arrivals: Sequence[float],
    spec: ScalingSpec,
    *,
    planner_from_s: float = 0.0,
    planner_until_s: float,
    seed: int = 0,
) -> ScalingResult:
    """Replay request ``k`` of ``source`` at ``arrivals[k]`` (sorted) on ``spec``'s fleet, the planner pulling every
    ``metric_pulling_interval`` from ``planner_from_s`` until before ``planner_until_s`` (module docstring);
    deterministic for a seed. Before ``planner_from_s`` the fleet serves what arrives (a warm-up) unwatched."""
    cfg = spec.planner
    router = Router(RouterConfig(router_policy=spec.policy, router_seed=seed), rng=random.Random(seed))
    connector = ModelledConnector(spec.startup_s)
    engines: dict[int, VirtualEngine] = {}
    busy: dict[int, bool] = {}
    pending_out: dict[int, StepOutput] = {}
    meta = WorkerMetadata(
        model=MODEL,
        role=WorkerRole.AGGREGATED,
        engine="mock",
        block_size=spec.engine.block_size,
        max_model_len=spec.engine.max_model_len,
        step_time=step_time_of(spec.engine),
    ).to_dict()
    route_meta = {
        "model": MODEL,
        "block_size": spec.engine.block_size,
        "max_model_len": spec.engine.max_model_len,
        "step_time": step_time_of(spec.engine),
    }
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(t: float, kind: int, payload: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, kind, seq, payload))
        seq += 1

    def routing_changed(now: float) -> None:
        router.set_workers(MODEL, [(w.worker_id, dict(route_meta)) for w in connector.registered(now)])

    for span in connector.start_fleet(spec.initial_workers, 0.0):
        engines[span.worker_id] = VirtualEngine(spec.engine)
        busy[span.worker_id] = False
    routing_changed(0.0)

    tracks: dict[str, _Track] = {}
    ttft_sink: list[float] = []
    e2e_sink: list[float] = []
    gaps = GapHistogram()
    done: list[RequestTimes] = []
    output_tokens = 0
    for k, arrival_s in enumerate(arrivals):
        push(arrival_s, _ARRIVAL, k)
    push(0.0, _REPORT, 0)
    push(planner_from_s, _PULL, 0)
    remaining = len(arrivals)
    last_finish = 0.0
    loads: dict[int, tuple[LoadSnapshot, float]] = {}
    state = PlannerState()
    pending: dict[Pool, PendingChange] = {}
    samples: list[Sample] = []
    actions: list[Action] = []
    open_action: Action | None = None
    would: dict[str, int] = {"up": 0, "down": 0}
    adjustments = 0

    def start_step(wid: int, now: float) -> None:
        out = engines[wid].step(now)
        if out.batch_size == 0:
            raise RuntimeError(f"simulated worker {wid} has work but scheduled nothing at t={now:.3f}")
        pending_out[wid] = out
        busy[wid] = True
        push(now + out.step_time_s, _STEP, wid)

    def settle(now: float) -> None:
        """The connector's change finished: the loop's change task returns, the pool counts as settled."""
        nonlocal open_action
        if pending and connector.change_done(now):
            pending.clear()
            if open_action is not None:
                actions.append(dataclasses.replace(open_action, done_s=now))
                open_action = None

    def apply(adj: Adjustment, now: float) -> None:
        nonlocal open_action
        for d in adj.decisions:
            if d.direction != Direction.HOLD and d.no_operation:
                would[str(d.direction)] += 1
        for d in adj.changes():
            if d.pool != Pool.DECODE:
                continue
            pending[d.pool] = PendingChange(before=d.current, target=d.target)
            resize(d.target, now)
            open_action = Action(now, None, str(d.direction), d.current, d.target, d.reason)
            settle(now)

    def resize(target: int, now: float) -> list[WorkerSpan]:
        """The connector's call, and what the fleet does about it: the spans added or asked to leave."""
        added, leaving = connector.set_pool_size(target, now, lambda wid: engines[wid].has_work or busy[wid])
        for span in added:
            engines[span.worker_id] = VirtualEngine(spec.engine)
            busy[span.worker_id] = False
            push(span.ready_s, _READY, span.worker_id)
        if leaving:
            for span in leaving:
                loads.pop(span.worker_id, None)
            routing_changed(now)
        return added + leaving

    # The controller's cadence (Controller): the next decision's time; None while the loop rules wait for a settled
    # pool. Its changes run side by side (step rules), so each is recorded with its own span.
    control = spec.controller
    next_decision_s: float | None = planner_from_s
    grace = 0
    controlled: list[tuple[Action, WorkerSpan]] = []

    def control_step(now: float) -> None:
        nonlocal next_decision_s, grace, adjustments
        assert control is not None
        if control.loop_rules:
            if not connector.change_done(now):
                next_decision_s = None
                return
            if next_decision_s is None:
                next_decision_s = now + control.interval_s
        if next_decision_s is None or now < next_decision_s - 1e-9:
            return
        next_decision_s = (now if control.loop_rules else next_decision_s) + control.interval_s
        adjustments += 1
        active = connector.active()
        starting = [w.ready_s for w in active if w.ready_s > now]
        target, reason = control.decide(now, len(active), starting, may_remove=grace == 0)
        grace = max(0, grace - 1)
        if target == len(active):
            return
        if abs(target - len(active)) != 1:
            raise ValueError(f"a controller changes the pool by one worker at a time, asked {len(active)} -> {target}")
        direction = Direction.UP if target > len(active) else Direction.DOWN
        if direction == Direction.UP and control.loop_rules:
            grace = NEW_DECODE_WORKER_GRACE_PERIOD
        (span,) = resize(target, now)
        controlled.append((Action(now, None, str(direction), len(active), target, reason), span))

    while heap:
        now, kind, _, payload = heapq.heappop(heap)
        if kind == _STEP:
            wid = payload
            out = pending_out.pop(wid)
            busy[wid] = False
            for rid, chunk in out.chunks.items():
                track = tracks[rid]
                # Gaps of warm-up requests are not measured (nor is anything else of them: the caller filters).
                sink = gaps if track.arrival_s >= planner_from_s else _DISCARD
                if account_chunk(track, rid, chunk, now, router, ttft_sink, sink, e2e_sink):
                    del tracks[rid]
                    gap_n = track.output_tokens - 1
                    mean_itl = (track.last_s - track.first_s) / gap_n if gap_n > 0 else None
                    done.append(RequestTimes(track.arrival_s, track.first_s - track.arrival_s, mean_itl, wid))
                    output_tokens += track.output_tokens
                    remaining -= 1
                    last_finish = now
            events = engines[wid].take_kv_events()
            if events:
                router.apply_kv_events(wid, events)
            if engines[wid].has_work:
                start_step(wid, now)
            else:
                span = next(w for w in connector.workers if w.worker_id == wid)
                if span.left_s is not None and span.exited_s is None:
                    connector.exited(wid, now)
                    settle(now)
        elif kind == _READY:
            routing_changed(now)
            settle(now)
        elif kind == _ARRIVAL:
            k = payload
            prompt, max_tokens = source.request(k)
            rid = f"r{k}"
            req = router.prepare(RouteRequest(tuple(prompt), MODEL, now))
            decision = router.select(req)
            if decision.instance_id is None:
                raise RuntimeError(f"no worker to route request {k} to at t={now:.3f}: {decision.reason}")
            router.on_routed(rid, decision, req)
            wid = decision.instance_id
            tracks[rid] = _Track(now)
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            engines[wid].add(GenerateRequest(rid, prompt, sampling), now)
            if not busy[wid]:
                start_step(wid, now)
        elif kind == _REPORT:
            for span in connector.registered(now):
                snap = engines[span.worker_id].snapshot(now)
                router.apply_load(span.worker_id, snap, now)
                loads[span.worker_id] = (snap, now)
            if remaining > 0 or now < planner_until_s:
                push(now + spec.metrics_interval_s, _REPORT, 0)
        else:  # _PULL: Planner.pull, on the virtual clock
            instances = [
                InstanceInfo("sim", "backend", ENDPOINT_GENERATE, w.worker_id, "sim.backend.generate", meta)
                for w in connector.registered(now)
            ]
            fleet = fleet_from_instances(instances, MODEL)
            for iid in [i for i in loads if i not in fleet.decode]:
                del loads[iid]
            obs = build_observation(now, fleet, loads, None, dict(pending), {Pool.DECODE: None, Pool.PREFILL: None})
            figures = pull_figures(obs, cfg)
            running, waiting = request_totals(loads, fleet, now, cfg)
            samples.append(Sample(now, figures.kv_usage, len(fleet.decode), connector.held(now), running, waiting))
            if control is not None:
                if now >= planner_from_s:
                    control_step(now)
            else:
                adj, state = decide(state, obs, cfg)
                if adj is not None:
                    adjustments += 1
                    apply(adj, now)
            if now + cfg.metric_pulling_interval < planner_until_s:
                push(now + cfg.metric_pulling_interval, _PULL, 0)
    return ScalingResult(
        requests=done,
        gaps=gaps,
        samples=samples,
        actions=actions
        + ([open_action] if open_action is not None else [])
        + [
            dataclasses.replace(a, done_s=span.exited_s if a.direction == "down" else span.ready_s)
            for a, span in controlled
        ],
        would=would,
        spans=connector.spans(),
        adjustments=adjustments,
        end_s=last_finish,
        preemptions=sum(e.scheduler.num_preemptions for e in engines.values()),
        output_tokens=output_tokens,
    )


class _Discard:
    def append(self, x: float, /) -> None:
        pass


_DISCARD = _Discard()


@dataclasses.dataclass(slots=True)
class _Track:
    """``components.sim.Timed``: one request's times while it runs."""

    arrival_s: float
    first_s: float = -1.0
    last_s: float = -1.0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    output_tokens: int = 0
