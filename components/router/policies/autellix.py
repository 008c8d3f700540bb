"""Autellix's data-locality-aware load balancing (Algorithm 2 of "Autellix: An Efficient Serving Engine for LLM Agents
as General Programs", Luo et al., 2025).

An agent program issues many calls that share a growing context. Algorithm 2::

    if request.prefill_tokens <= locality_threshold:   # short: cheap to recompute anywhere
        engine = LEAST_USED(engines)
    elif request.program in table:                     # long, program seen: keep its KV cache warm
        engine = table[request.program]
    else:                                              # long, first time: place it, remember where
        engine = LEAST_USED(engines); table[request.program] = engine

kvmesh's additions, each a branch with its own test:
- the program id is ``RouteRequest.program_id`` (the frontend takes it from the ``x-program-id`` header, the OpenAI
  ``user`` field or an ``x-session-id`` header); a long request without one goes to LEAST_USED, unremembered;
- an assignment not used by a long request for ``program_ttl_s`` expires; ``ends_program`` (the frontend's
  ``x-program-end`` header) forgets it once that request is placed;
- a program whose engine left, was already tried for this request, or went stale is reassigned, to LEAST_USED, at its
  next long request;
- statistics: small and large requests, locality hits, assignments, reassignments, expiries, ends.

Parameters (``RouterConfig``): ``locality_threshold_tokens`` (2048, the paper's), ``program_ttl_s``,
``least_loaded_metric`` (what LEAST_USED counts).

The state is a value: ``select`` returns a new ``AutellixState`` and never mutates the one it got. The program table
is copied on write, and only when it changes: a locality hit refreshes the assignment's time only once it is older
than ``program_ttl_s / 8`` (so a TTL ends at most 12.5% late), which keeps a busy program's hits copy-free; copying
costs ~1 us per 100 programs. Expired assignments are swept once per ``program_ttl_s``.

``place`` is the algorithm with the placement rule as a parameter: ``kv+autellix`` passes the KV cost in place of
LEAST_USED.

Pure: imports only the standard library and ``components.router``'s ``types``/``config``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from components.router.config import RouterConfig
from components.router.policies import common
from components.router.types import DecisionKind, Reason, RouteDecision, RouteRequest, WorkerSnapshot, lazy_reason

# (candidates) -> (worker, why, its overlap in blocks, kind): how a request that affinity does not decide is placed.
Chooser = Callable[[Sequence[WorkerSnapshot]], tuple[WorkerSnapshot, Reason, int, DecisionKind]]

_REFRESH_FRACTION = 8  # a hit rewrites its assignment's time once it is older than ttl / 8


@dataclasses.dataclass(slots=True, frozen=True)
class Assignment:
    instance_id: int
    last_used_s: float  # the last long request of the program placed by this assignment (refreshed coarsely)


@dataclasses.dataclass(slots=True, frozen=True)
class AutellixStats:
    num_small: int = 0  # requests at or under the locality threshold (LEAST_USED)
    num_large: int = 0  # requests over it
    num_locality_hits: int = 0  # large requests sent to their program's engine
    num_assigns: int = 0  # programs placed at their first large request
    num_reassigns: int = 0  # programs moved because their engine left, failed or went stale
    num_expired: int = 0  # assignments dropped after program_ttl_s unused
    num_ended: int = 0  # assignments dropped because the program ended
    num_unaffiliated: int = 0  # large requests without a program id (LEAST_USED, not remembered)


@dataclasses.dataclass(slots=True, frozen=True)
class AutellixState:
    """The program table and counters. ``programs`` is never mutated once in a state (copy on write)."""

    programs: Mapping[str, Assignment] = dataclasses.field(default_factory=dict)
    stats: AutellixStats = AutellixStats()
    last_sweep_s: float = -math.inf


def _short(program_id: str) -> str:
    return repr(program_id if len(program_id) <= 40 else program_id[:37] + "...")


def _sweep(state: AutellixState, now_s: float, ttl_s: float) -> AutellixState:
    if now_s - state.last_sweep_s < ttl_s:
        return state
    live = {p: a for p, a in state.programs.items() if now_s - a.last_used_s <= ttl_s}
    expired = len(state.programs) - len(live)
    stats = dataclasses.replace(state.stats, num_expired=state.stats.num_expired + expired) if expired else state.stats
    return AutellixState(live if expired else state.programs, stats, now_s)


def end_program(state: AutellixState, program_id: str) -> AutellixState:
    """Forget a program's assignment (its last request was placed, or its caller says it is over)."""
    if program_id not in state.programs:
        return state
    programs = dict(state.programs)
    del programs[program_id]
    return dataclasses.replace(
        state, programs=programs, stats=dataclasses.replace(state.stats, num_ended=state.stats.num_ended + 1)
    )


def place(
    request: RouteRequest,
    workers: Sequence[WorkerSnapshot],
    state: AutellixState,
    config: RouterConfig,
    choose: Chooser,
    label: str = "autellix",
) -> tuple[RouteDecision, AutellixState]:
    """Algorithm 2 over ``workers`` with ``choose`` as the placement rule (LEAST_USED for ``autellix``)."""
    placed, cands, note = common.prelude(request, workers)
    if placed is not None:
        return placed, state
    now = request.now_s
    ttl = config.program_ttl_s
    state = _sweep(state, now, ttl)
    st = state.stats
    n = len(request.token_ids)
    threshold = config.locality_threshold_tokens
    pid = request.program_id
    programs = state.programs
    suffix = note

    if n <= threshold:
        w, why, overlap, kind = choose(cands)
        why = lazy_reason("{}: {} <= {} tokens, {}{}", label, n, threshold, why, suffix)
        decision = RouteDecision(w.instance_id, why, overlap, kind, request.host_extra_of(w.instance_id))
        st = dataclasses.replace(st, num_small=st.num_small + 1)
    elif pid is None:
        w, why, overlap, kind = choose(cands)
        why = lazy_reason("{}: {} tokens, no program id, {}{}", label, n, why, suffix)
        decision = RouteDecision(w.instance_id, why, overlap, kind, request.host_extra_of(w.instance_id))
        st = dataclasses.replace(st, num_large=st.num_large + 1, num_unaffiliated=st.num_unaffiliated + 1)
    else:
        st = dataclasses.replace(st, num_large=st.num_large + 1)
        a = programs.get(pid)
        if a is not None and now - a.last_used_s > ttl:
            st = dataclasses.replace(st, num_expired=st.num_expired + 1)
            programs = {p: x for p, x in programs.items() if p != pid}
            a = None
        home = common.find(cands, a.instance_id) if a is not None else None
        if a is not None and home is not None:
            overlap = request.overlap_of(home.instance_id)
            why = lazy_reason(
                "{}: {} tokens, program {} stays on its worker (locality hit){}", label, n, partial(_short, pid), suffix
            )
            decision = RouteDecision(
                home.instance_id, why, overlap, DecisionKind.AFFINITY, request.host_extra_of(home.instance_id)
            )
            st = dataclasses.replace(st, num_locality_hits=st.num_locality_hits + 1)
            if now - a.last_used_s > ttl / _REFRESH_FRACTION:
                programs = {**programs, pid: Assignment(home.instance_id, now)}
        else:
            w, why, overlap, kind = choose(cands)
            what: Reason
            if a is not None:
                what = lazy_reason("reassigned from worker {:x} (gone, tried or stale)", a.instance_id)
                st = dataclasses.replace(st, num_reassigns=st.num_reassigns + 1)
            else:
                what = "assigned"
                st = dataclasses.replace(st, num_assigns=st.num_assigns + 1)
            why = lazy_reason("{}: {} tokens, program {} {}, {}{}", label, n, partial(_short, pid), what, why, suffix)
            decision = RouteDecision(w.instance_id, why, overlap, kind, request.host_extra_of(w.instance_id))
            programs = {**programs, pid: Assignment(w.instance_id, now)}
    new = AutellixState(programs, st, state.last_sweep_s)
    if request.ends_program and pid is not None:
        new = end_program(new, pid)
    return decision, new


class AutellixPolicy:
    name = "autellix"
    uses_kv = False
    uses_inflight = True

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def initial_state(self) -> AutellixState:
        return AutellixState()

    def end_program(self, state: AutellixState, program_id: str) -> AutellixState:
        return end_program(state, program_id)

    def select(
        self, request: RouteRequest, workers: Sequence[WorkerSnapshot], state: AutellixState, rng: random.Random
    ) -> tuple[RouteDecision, AutellixState]:
        metric = self.config.least_loaded_metric

        def least_used(cands: Sequence[WorkerSnapshot]) -> tuple[WorkerSnapshot, Reason, int, DecisionKind]:
            w, why = common.least_used(cands, metric, rng)
            return w, why, request.overlap_of(w.instance_id), DecisionKind.LOAD

        return place(request, workers, state, self.config, least_used)
