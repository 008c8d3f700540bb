"""A fleet that the real planner resizes, on a virtual clock: what ``kvmesh bench planner`` measures. A thin driver
over the simulator library's one replay loop (``components.sim.replay``: ``VirtualEngine``s, the mock engine's own
scheduler and step-time model, behind ``components.router.Router``, fed load reports every 100 ms and KV events at
each step's end), with a scaler:

* the planner: ``components.planner.simulated.SimulatedPlanner``, the live planner's controller
  (``components/planner/controller.py``, what ``Planner.pull`` calls) over the replay's fleet view on the virtual
  clock; each applied decision goes to the replay's modelled connector (``components.sim.dynamics``), and the change
  is in progress until the connector says it is done, which pauses the policy exactly as the live loop's change task
  does;
* or a ``Controller`` (``ScalingSpec.controller``: the clairvoyant fleet, ``clairvoyant.Oracle``), through
  ``ControllerScaler``: it resizes the pool in the policy's place through the same connector, with the planner's
  cadence and optionally its loop's pause and grace period.

``ModelledConnector`` (``components.sim.dynamics``) is the local connector's behaviour with its delays made explicit:
a new worker is asked for at once, holds its GPU from that moment, and registers ``startup_s`` later; a removed
worker is the pool's most recently added one (never the first), leaves routing and the pool at the decision,
finishes every request it holds, and exits when it has none left, which is when its worker-seconds stop and the
change is done.

What is left out: the network and the frontend (load reports and KV events arrive when sent), the time circus and
etcd take (a few ms to a few hundred ms against seconds of start-up), a worker that fails to start, and the
planner's own CPU time. Time is virtual, so a run's cost is the work it simulates, not its duration, and one
workload, configuration and seed always give the same numbers.

Also here, pure and tested on their own: the sinusoidal arrival schedule (``Sinusoid``, ``arrival_times``), the
request stream of a trace cycled past its end (``RequestSource``), SLO attainment (``components.sim.report``), and a
fixed-resolution histogram for the inter-token gaps (``GapHistogram``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, overload

from components.fleet.model import FleetSnapshot
from components.planner.config import PlannerConfig
from components.planner.controller import build_observation, request_totals
from components.planner.policy import NEW_DECODE_WORKER_GRACE_PERIOD, pull_figures
from components.planner.simulated import PlannerPull, SimulatedPlanner
from components.planner.sla.config import SlaPlannerConfig
from components.rescheduler.config import ReschedulerConfig
from components.sim import MODEL, FleetSpec, replay
from components.sim.dynamics import (
    DECODE,
    Action,
    ModelledConnector,
    PoolState,
    Resize,
    WorkerSpan,
    worker_seconds,
)
from components.sim.replay import REQUEST_STATS_INTERVAL_S
from components.sim.report import RequestTimes
from components.sim.rescheduling import PolicyRescheduler
from components.sim.traces import MooncakeBlocks, TraceRow, read_trace, token_ids
from components.sim.workload import SimRequest, Workload
from components.workers.simulated import MockEngineConfig

__all__ = [
    "Action",
    "ControllerScaler",
    "GapHistogram",
    "LoadShape",
    "ModelledConnector",
    "RequestSource",
    "ScalingResult",
    "ScalingSpec",
    "Sinusoid",
    "SourceRequests",
    "WorkerSpan",
    "arrival_times",
    "simulate",
    "worker_seconds",
]

# --- the load ---------------------------------------------------------------------------------------------------------


class LoadShape(Protocol):
    """The offered load over ``[0, duration_s)`` as a fraction of the peak fleet's measured capacity."""

    @property
    def duration_s(self) -> float: ...

    @property
    def high(self) -> float:
        """The largest fraction (thinning draws candidates at it)."""
        ...

    @property
    def start(self) -> float:
        """The fraction at t = 0: what the unmeasured warm-up before the load runs at."""
        ...

    @property
    def mean(self) -> float: ...

    def fraction(self, t: float) -> float: ...


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

    @property
    def start(self) -> float:
        """The trough, where it starts (``LoadShape``: the warm-up's level)."""
        return self.low

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


def arrival_times(sinusoid: LoadShape, peak_rps: float, seed: int) -> list[float]:
    """Arrival times in [0, duration): a Poisson process whose rate at t is ``peak_rps * sinusoid.fraction(t)`` (any
    ``LoadShape``; the seed's stream is the same for every shape), by
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

    @property
    def step_workers(self) -> int | None:
        """Workers one decision may add or remove (None: any number)."""
        ...

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
    planner: PlannerConfig | SlaPlannerConfig  # the load planner's config, or the SLA planner's
    startup_s: float = 30.0
    policy: str = "kv"
    metrics_interval_s: float = 0.1  # workers publish their LoadSnapshot this often (WorkerConfig.metrics_interval_ms)
    controller: Controller | None = None
    # The simulated frontend's request reports (the SLA planner's input), every this many virtual seconds.
    request_stats_interval_s: float = REQUEST_STATS_INTERVAL_S
    # With a config: the rescheduler's policies run beside the planner (a fresh ``PolicyRescheduler`` per replay,
    # its cycle every ``interval_s`` of the simulation's clock), moving requests between the pool's workers.
    rescheduler: ReschedulerConfig | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """The fleet at one planner pull."""

    t: float
    kv_usage: float | None  # the planner's figure: mean over the pool's fresh snapshots
    registered: int  # workers in the pool (routing)
    held: int  # workers holding a GPU (starting and draining ones too)
    running: int
    waiting: int


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
    # With a rescheduler: requests it moved, and its counters (``PolicyRescheduler.counters``).
    migrations: int = 0
    rescheduler: dict[str, object] | None = None


class SourceRequests(Sequence[SimRequest]):
    """Request ``k`` of ``source`` arriving at ``arrivals[k]``, built when the replay reads it (a 600 s run is tens of
    thousands of prompts: not kept)."""

    def __init__(self, source: RequestSource, arrivals: Sequence[float]) -> None:
        self.source = source
        self.arrivals = arrivals

    def __len__(self) -> int:
        return len(self.arrivals)

    @overload
    def __getitem__(self, k: int) -> SimRequest: ...

    @overload
    def __getitem__(self, k: slice) -> Sequence[SimRequest]: ...

    def __getitem__(self, k: int | slice) -> SimRequest | Sequence[SimRequest]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = k + len(self) if k < 0 else k
        prompt, max_tokens = self.source.request(k)
        return SimRequest(self.arrivals[k], tuple(prompt), max_tokens)


class ControllerScaler:
    """A ``Controller`` (the clairvoyant schedule) as the simulator's scaler of the decode pool, with the planner's
    cadence and, with ``loop_rules``, its loop's pause while a change is in progress and its grace period (the
    ``Controller`` docstring). Its pulls sample the fleet as the planner's would (``pulls``)."""

    def __init__(self, control: Controller, config: PlannerConfig, start_s: float, until_s: float) -> None:
        self.control = control
        self.config = config
        # The Scaler's cadence (components.sim.dynamics): a pull every interval_s from start_s until before until_s.
        self.interval_s = config.metric_pulling_interval
        self.start_s = start_s
        self.until_s = until_s
        self.next_decision_s: float | None = start_s
        self.grace = 0
        self.adjustments = 0
        self.samples: list[Sample] = []

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]:
        self.samples.append(_sample(now_s, fleet, pools, self.config))
        pool = pools[DECODE]
        control = self.control
        if control.loop_rules:
            if not pool.settled:
                self.next_decision_s = None
                return ()
            if self.next_decision_s is None:
                self.next_decision_s = now_s + control.interval_s
        if self.next_decision_s is None or now_s < self.next_decision_s - 1e-9:
            return ()
        self.next_decision_s = (now_s if control.loop_rules else self.next_decision_s) + control.interval_s
        self.adjustments += 1
        target, reason = control.decide(now_s, pool.active, pool.starting_ready_s, may_remove=self.grace == 0)
        self.grace = max(0, self.grace - 1)
        if target == pool.active:
            return ()
        step = control.step_workers
        if step == 1 and abs(target - pool.active) != 1:
            raise ValueError(f"a controller changes the pool by one worker at a time, asked {pool.active} -> {target}")
        if step is not None and abs(target - pool.active) > step:
            raise ValueError(
                f"a controller changes the pool by at most {step} workers, asked {pool.active} -> {target}"
            )
        if target > pool.active and control.loop_rules:
            self.grace = NEW_DECODE_WORKER_GRACE_PERIOD
        return (Resize(DECODE, pool.active, target, reason),)

    def resize_done(self, pool: str, now_s: float) -> None:
        pass


def _sample(now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState], config: PlannerConfig) -> Sample:
    """The fleet at one pull, with the planner's figures (its KV-use mean, its request totals)."""
    obs = build_observation(fleet, MODEL, {})
    running, waiting = request_totals(fleet, MODEL)
    decode = pools[DECODE]
    return Sample(now_s, pull_figures(obs, config).kv_usage, decode.registered, decode.held, running, waiting)


def simulate(
    source: RequestSource,
    arrivals: Sequence[float],
    spec: ScalingSpec,
    *,
    planner_from_s: float = 0.0,
    planner_until_s: float,
    seed: int = 0,
) -> ScalingResult:
    """Replay request ``k`` of ``source`` at ``arrivals[k]`` (sorted) on ``spec``'s fleet with ``components.sim``'s
    one replay loop, the planner (``components.planner.simulated``, the live planner's controller) or the
    ``spec.controller`` pulling every ``metric_pulling_interval`` from ``planner_from_s`` until before
    ``planner_until_s`` (module docstring); deterministic for a seed. Before ``planner_from_s`` the fleet serves what
    arrives (a warm-up) unwatched, and its requests' inter-token gaps are not measured."""
    fleet = FleetSpec(
        workers=spec.initial_workers,
        engine=spec.engine,
        metrics_interval_s=spec.metrics_interval_s,
        startup_s=spec.startup_s,
    )
    scaler: SimulatedPlanner | ControllerScaler
    if spec.controller is not None:
        if not isinstance(spec.planner, PlannerConfig):
            raise ValueError("a controller samples the fleet at a load planner's pulls: give it a PlannerConfig")
        scaler = ControllerScaler(spec.controller, spec.planner, planner_from_s, planner_until_s)
    else:
        scaler = SimulatedPlanner(spec.planner, start_s=planner_from_s, until_s=planner_until_s)
    gaps = GapHistogram()
    workload = Workload(source.name, SourceRequests(source, arrivals))
    resched = None if spec.rescheduler is None else PolicyRescheduler(spec.rescheduler)
    res = replay(
        workload,
        fleet,
        spec.policy,
        seed,
        scaler=scaler,
        rescheduler=resched,
        itl_sink=gaps,
        itl_from_s=planner_from_s,
        request_stats_interval_s=spec.request_stats_interval_s,
    )
    if isinstance(scaler, SimulatedPlanner):
        samples = [_planner_sample(p) for p in scaler.pulls]
        adjustments, would = len(scaler.adjustments), dict(scaler.would)
    else:
        samples, adjustments, would = scaler.samples, scaler.adjustments, {"up": 0, "down": 0}
    return ScalingResult(
        requests=[
            RequestTimes(arrivals[k], ttft, itl, wid)
            for k, (ttft, itl, wid) in enumerate(
                zip(res.ttft_by_request_s, res.mean_itl_by_request_s, res.worker_by_request, strict=True)
            )
        ],
        gaps=gaps,
        samples=samples,
        actions=res.actions,
        would=would,
        spans=res.spans[DECODE],
        adjustments=adjustments,
        end_s=res.last_finish_s,
        preemptions=res.preemptions,
        output_tokens=res.output_tokens,
        migrations=res.migrations,
        rescheduler=None if resched is None else resched.counters(),
    )


def _planner_sample(p: PlannerPull) -> Sample:
    out, decode = p.outcome, p.pools[DECODE]
    return Sample(p.now_s, out.figures.kv_usage, decode.registered, decode.held, out.running, out.waiting)
