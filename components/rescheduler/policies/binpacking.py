"""Bin-packing on predicted TPOT (Llumnix's adaptive PD rescheduling): ``binpacking_mitigation`` and
``binpacking_consolidation``.

The metric is each worker's predicted TPOT (``InstanceView.predicted_tpot_ms``: its decode step time at its current
batch and KV tokens, by its announced performance model) against ``--tpot-slo`` (50 ms) times three fractions:

- ceiling, ``--tpot-migrate-out-ceil-threshold`` 0.95: 47.5 ms;
- dispatch, ``--tpot-slo-dispatch-threshold`` 0.85: 42.5 ms;
- floor, ``--tpot-migrate-out-floor-threshold`` 0.60: 30 ms.

Candidates: healthy (``common.healthy``) decode and aggregated workers (both run decode requests; prefill workers
never); a pair stays within one model and one role. At most one pair per policy per cycle.

- **mitigation**: sources at or above the ceiling, destinations below dispatch; the source with the highest TPOT
  goes to the destination with the highest TPOT below dispatch (the fullest that still has room, Llumnix's
  ``binPackingMitigationSelector``): D1 at 48 ms (>= 47.5) to D2 at 35 ms (< 42.5). It moves what
  ``--rescheduling-req-select-rule/-value`` say, in ``--rescheduling-req-select-order`` unless that order takes
  waiting requests (FCW, FCWSR): then shortest running first, decode requests only.
- **consolidation**: sources below the floor that run decode requests, destinations below dispatch that run decode
  requests too; the source with the lowest TPOT goes to the destination with the highest (the fullest): D3 at 25 ms
  (< 30) into D4 at 40 ms (< 42.5), freeing D3. It moves all of the source's running requests (``num_requests`` =
  its running decode requests, shortest first).

A destination is judged by its TPOT now, not after the move (Llumnix's destination filter): D4 at 40 ms takes D3's
requests although that puts it nearer the ceiling; mitigation moves them on if it passes it.

Pure: the standard library and this package only.
"""

from __future__ import annotations

from collections.abc import Sequence

from components.rescheduler.config import SELECT_RULES, Policy, ReschedulerConfig
from components.rescheduler.policies.common import SHORTEST_RUNNING, fence, healthy, running_order
from components.rescheduler.types import InstanceView, MigrationPair, PolicyResult, Rejection, Role

DECODE_ROLES = frozenset({Role.DECODE, Role.AGGREGATED})


def _candidates(views: Sequence[InstanceView], config: ReschedulerConfig) -> list[InstanceView]:
    fenced = fence(views, config)
    return [
        v for v in views if v.role in DECODE_ROLES and v.predicted_tpot_ms is not None and healthy(v, config, fenced)
    ]


def _tpot(v: InstanceView) -> float:
    return v.predicted_tpot_ms if v.predicted_tpot_ms is not None else 0.0


def _fullest_destination(
    src: InstanceView, candidates: Sequence[InstanceView], config: ReschedulerConfig, need_running: bool
) -> InstanceView | None:
    fitting = [
        v
        for v in candidates
        if v.instance_id != src.instance_id
        and v.model == src.model
        and v.role == src.role
        and _tpot(v) < config.tpot_dispatch_ms
        and (v.num_running_decode > 0 or not need_running)
    ]
    return max(fitting, key=lambda v: (_tpot(v), -v.instance_id), default=None)


def mitigation(views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    policy = Policy.BINPACKING_MITIGATION
    candidates = _candidates(views, config)
    sources = sorted(
        (v for v in candidates if _tpot(v) >= config.tpot_ceiling_ms), key=lambda v: (-_tpot(v), v.instance_id)
    )
    rejected: list[Rejection] = []
    for src in sources:  # the highest first; one pair at most
        dst = _fullest_destination(src, candidates, config, need_running=False)
        if dst is None:
            rejected.append(
                Rejection(
                    policy,
                    src.instance_id,
                    None,
                    f"predicted TPOT {_tpot(src):.1f} ms >= ceiling {config.tpot_ceiling_ms:.1f} ms; no "
                    f"{src.role} worker of {src.model!r} below dispatch {config.tpot_dispatch_ms:.1f} ms",
                )
            )
            continue
        pair = MigrationPair(
            source_id=src.instance_id,
            destination_id=dst.instance_id,
            model=src.model,
            policy=policy,
            select_rule=config.rescheduling_req_select_rule,
            select_order=running_order(config.rescheduling_req_select_order),
            select_value=config.rescheduling_req_select_value,
            reason=f"predicted TPOT {_tpot(src):.1f} ms >= ceiling {config.tpot_ceiling_ms:.1f} ms -> "
            f"{_tpot(dst):.1f} ms < dispatch {config.tpot_dispatch_ms:.1f} ms (SLO {config.tpot_slo:g} ms)",
        )
        return PolicyResult((pair,), tuple(rejected))
    return PolicyResult((), tuple(rejected))


def consolidation(views: Sequence[InstanceView], config: ReschedulerConfig) -> PolicyResult:
    policy = Policy.BINPACKING_CONSOLIDATION
    candidates = _candidates(views, config)
    sources = sorted(
        (v for v in candidates if _tpot(v) < config.tpot_floor_ms and v.num_running_decode > 0),
        key=lambda v: (_tpot(v), v.instance_id),
    )
    rejected: list[Rejection] = []
    for src in sources:  # the emptiest first; one pair at most
        dst = _fullest_destination(src, candidates, config, need_running=True)
        if dst is None:
            rejected.append(
                Rejection(
                    policy,
                    src.instance_id,
                    None,
                    f"predicted TPOT {_tpot(src):.1f} ms < floor {config.tpot_floor_ms:.1f} ms; no other "
                    f"{src.role} worker of {src.model!r} running decode requests below dispatch "
                    f"{config.tpot_dispatch_ms:.1f} ms",
                )
            )
            continue
        pair = MigrationPair(
            source_id=src.instance_id,
            destination_id=dst.instance_id,
            model=src.model,
            policy=policy,
            select_rule=SELECT_RULES["NUM_REQ"],
            select_order=SHORTEST_RUNNING,
            select_value=float(src.num_running_decode),
            reason=f"predicted TPOT {_tpot(src):.1f} ms < floor {config.tpot_floor_ms:.1f} ms, "
            f"{src.num_running_decode} decode requests -> {_tpot(dst):.1f} ms < dispatch "
            f"{config.tpot_dispatch_ms:.1f} ms (SLO {config.tpot_slo:g} ms)",
        )
        return PolicyResult((pair,), tuple(rejected))
    return PolicyResult((), tuple(rejected))
