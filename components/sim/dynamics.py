"""What changes a simulated fleet while ``replay`` runs: workers started and stopped through a modelled connector, a
scaler (the planner, or any controller) that asks for pool sizes, and a rescheduler that moves running requests.

``replay`` (replay.py) owns the clock and the engines; this module holds the parts it calls, with their delays
stated:

* ``ModelledConnector``: the local connector's behaviour (components/planner/connectors/local.py) with its delays
  made explicit: a new worker is asked for at once, holds its GPU from that moment, and registers (joins routing and
  the fleet view) ``startup_s`` later; a removed worker is the pool's most recently added one (never the first),
  leaves routing and the fleet view at the decision, finishes every request it holds, and exits when it has none
  left, which is when its worker-seconds stop and the change is done. One per pool.
* ``Scaler``: called every ``interval_s`` from ``start_s`` until before ``until_s`` with the fleet view's snapshot
  (the same ``FleetSnapshot`` a live planner reads) and each pool's connector state; returns the pool sizes to set.
  ``FleetSpec.connector_delay_s`` after a decision the connector acts on it. The replay tells the scaler when a
  pool's change is done (``resize_done``), as a live connector's ``set_pool_size`` returns.
* ``Rescheduler``: called every ``interval_s`` with the snapshot and the requests each routed worker runs; returns
  migrations. A migration of a running request stops it at its worker's next step boundary, once the destination
  has reserved blocks for its context (a destination without room refuses, and the request stays where it is, as
  the live agent's "aborted by destination"), moves its KV (the prompt and the tokens generated so far, modelled as
  a KV transfer of that many tokens) and the request decodes on at the destination: the client sees every token
  once, in order, with the transfer as one longer gap. A migration
  of a waiting request (``RunningRequest.waiting``: never admitted, or preempted, so it holds no KV) moves it at
  once with nothing to transfer, into the destination's waiting queue in arrival order; the destination computes
  its prompt (and a preempted request's tokens so far) when it admits it, as its source would have.

Imports: ``components.fleet.model`` (the snapshot type) and the standard library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from components.fleet.model import FleetSnapshot

DECODE = "decode"  # the routed pool: aggregated workers, or a disaggregated fleet's decode workers
PREFILL = "prefill"
POOLS = (DECODE, PREFILL)


def worker_seconds(spans: Iterable[tuple[float, float | None]], t0: float, t1: float) -> float:
    """Worker-seconds held within [t0, t1]: each span (start, stop; None = still held) counts its overlap."""
    total = 0.0
    for start, stop in spans:
        end = t1 if stop is None else min(stop, t1)
        total += max(0.0, end - max(start, t0))
    return total


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
    loop makes; the simulation tells it when a leaving worker ran out of work (``exited``); ``change_done`` is when
    ``set_pool_size`` would have returned. ``new_id`` numbers the workers (the replay's one counter for all pools)."""

    def __init__(self, startup_s: float, first_id: int = 1, new_id: Callable[[], int] | None = None) -> None:
        if startup_s < 0:
            raise ValueError(f"startup_s must be >= 0, got {startup_s}")
        self.startup_s = startup_s
        self.workers: list[WorkerSpan] = []
        self._next_id = first_id
        self._new_id = new_id

    def start_fleet(self, n: int, now: float) -> list[WorkerSpan]:
        """The fleet the run starts with: registered at ``now``."""
        return [self._new(now, now) for _ in range(n)]

    def _new(self, now: float, ready_s: float) -> WorkerSpan:
        if self._new_id is not None:
            wid = self._new_id()
        else:
            wid = self._next_id
            self._next_id += 1
        span = WorkerSpan(wid, now, ready_s)
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


@dataclasses.dataclass(frozen=True, slots=True)
class PoolState:
    """One pool as its connector counts it at a scaler's pull."""

    active: int  # asked for and not asked to leave (starting ones included)
    registered: int  # serving: started and not leaving
    held: int  # holding a GPU: starting, serving, or leaving but not yet drained
    starting_ready_s: tuple[float, ...]  # when each worker still starting registers
    settled: bool  # no change of this pool in progress (the connector's set_pool_size would have returned)


@dataclasses.dataclass(frozen=True, slots=True)
class Resize:
    """A scaler's request: make ``pool`` ``target`` workers (it had ``current``), and why."""

    pool: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One resize as carried out: when it was decided, when the connector finished it (the added workers registered,
    or the removed ones drained; None: not by the end), and why."""

    pool: str
    decided_s: float
    done_s: float | None
    direction: str
    before: int
    target: int
    reason: str


class Scaler(Protocol):
    """What resizes the pools (module docstring): the planner (``components.planner.simulated``) or a schedule."""

    @property
    def interval_s(self) -> float: ...

    @property
    def start_s(self) -> float: ...

    @property
    def until_s(self) -> float: ...

    def pull(self, now_s: float, fleet: FleetSnapshot, pools: Mapping[str, PoolState]) -> Sequence[Resize]: ...

    def resize_done(self, pool: str, now_s: float) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request a routed worker holds, as a rescheduler sees it."""

    request_id: str
    worker: int
    prompt_tokens: int
    output_tokens: int  # generated so far
    max_tokens: int
    # In the worker's waiting queue, holding no KV (never admitted, or preempted): moving it copies nothing.
    waiting: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Migration:
    """Move ``request_id`` from worker ``src`` to worker ``dst`` (both routed workers of the fleet)."""

    request_id: str
    src: int
    dst: int


class Rescheduler(Protocol):
    """What moves running requests between routed workers (module docstring)."""

    @property
    def interval_s(self) -> float: ...

    def cycle(
        self, now_s: float, fleet: FleetSnapshot, running: Mapping[int, Sequence[RunningRequest]]
    ) -> Sequence[Migration]: ...
