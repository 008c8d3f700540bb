"""Which requests a worker moves when asked to migrate: a pure function over its engine's request table.

``select_requests(table, rule, value, order)`` follows the seed's semantics (Llumnix's migration frontend: a budget
spent over candidates in an order):

- **Budget** (``rule``, ``value``): ``num_requests`` (NUM_REQ) counts requests, ``value`` of them, and ``-1`` means
  every request, running and waiting, whatever the order (emptying a worker before it stops); ``tokens`` (TOKEN)
  counts tokens, prompt plus output, up to ``value``; ``kv_ratio`` (RATIO) counts tokens too, up to ``value`` times
  the engine's KV capacity (blocks x block size).
- **Candidates and order**: ``last_come_running`` (LCR) takes running requests newest first, ``first_come_running``
  (FCR) oldest first, ``longest_running`` (LR) most tokens first, ``shortest_running`` (SR) fewest first (ties keep
  the running order); ``first_come_waiting`` (FCW) takes waiting requests in queue order and no running one;
  ``first_come_waiting_then_shortest_running`` (FCWSR) takes waiting ones in queue order, then, while budget
  remains, running ones shortest first.
- **Skipped**: a running request that has produced no token yet (still prefilling: nothing to gain, and its first
  token is on its way), and any request already being migrated.
- **Spending**: the llumlet's rule (../shared/seeds/llumnix-llumlet.txt: "select requests until cumulative token
  count is closest to this value"), greedily in order: while the total taken is below the budget, a candidate is
  taken when taking it leaves the total closer to the budget than not taking it (its cost < 2 x what remains), and
  passed over otherwise (a later, smaller one may still fit). A budget of 100 tokens over requests of 60 and 60
  takes both (|120 - 100| < |60 - 100|); a 1,024-token budget takes a lone request of up to 2,047 tokens. Before
  this rule a candidate costing more than the whole budget was always passed over, so under Llumnix's defaults
  (TOKEN 1024, SR) a worker holding only requests longer than 1,024 tokens had nothing to move: 172 of 182 pairs on
  the short/long mix (kvmesh bench rescheduling, docs/rescheduler.md). Requests count (NUM_REQ) one each: the
  same as taking whole requests up to the count.

Pure: imports the standard library and this package's ``types``/``errors`` only; no clock, no randomness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from components.migration.errors import InvalidSelectionError
from components.migration.types import RequestTable, RequestView, SelectOrder, SelectRule, parse_order, parse_rule


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    """The requests to move, in the order they were taken, and how the budget went (``reason`` for logs)."""

    request_ids: tuple[str, ...]
    budget: float
    spent: float
    reason: str


def _budget(table: RequestTable, rule: SelectRule, value: float) -> float:
    if rule == SelectRule.NUM_REQUESTS:
        if value != -1 and value < 0:
            raise InvalidSelectionError(f"num_requests must be a count >= 0, or -1 for every request; got {value:g}")
        return float(int(value))
    if rule == SelectRule.TOKENS:
        if value < 0:
            raise InvalidSelectionError(f"a token budget must be >= 0, got {value:g}")
        return float(int(value))
    if not 0 <= value <= 1:
        raise InvalidSelectionError(f"kv_ratio must lie in [0, 1] (a fraction of the KV capacity), got {value:g}")
    return float(int(table.kv_capacity_tokens * value))


def _cost(request: RequestView, rule: SelectRule) -> int:
    return 1 if rule == SelectRule.NUM_REQUESTS else request.num_tokens


def _running_in_order(running: Sequence[RequestView], order: SelectOrder) -> list[RequestView]:
    if order == SelectOrder.LAST_COME_RUNNING:
        return list(reversed(running))
    if order in (SelectOrder.SHORTEST_RUNNING, SelectOrder.FIRST_COME_WAITING_THEN_SHORTEST_RUNNING):
        return sorted(running, key=lambda r: r.num_tokens)  # stable: ties keep the running order
    if order == SelectOrder.LONGEST_RUNNING:
        # Stable as well: reversed sort of the reversed list would put later requests first among equals.
        return sorted(running, key=lambda r: -r.num_tokens)
    return list(running)  # FIRST_COME_RUNNING


def _spend(
    candidates: Sequence[RequestView], budget: float, rule: SelectRule, running: bool, taken: list[str]
) -> float:
    """Take candidates in order (module docstring's spending rule); returns what was spent."""
    spent = 0.0
    for r in candidates:
        if spent >= budget:
            break
        if r.migrating or (running and r.num_output_tokens < 1):
            continue
        cost = _cost(r, rule)
        if cost >= 2 * (budget - spent):  # taking it would not bring the total closer to the budget
            continue
        taken.append(r.request_id)
        spent += cost
    return spent


def select_requests(table: RequestTable, rule: SelectRule | str, value: float, order: SelectOrder | str) -> Selection:
    """The requests to move (module docstring). Raises ``UnknownSelectionError`` for a rule or order it does not
    know, ``InvalidSelectionError`` for a value the rule cannot use."""
    rule = parse_rule(rule)
    order = parse_order(order)
    if rule == SelectRule.NUM_REQUESTS and value == -1:
        every = [r.request_id for r in (*table.running, *table.waiting) if not r.migrating]
        return Selection(tuple(every), -1.0, float(len(every)), f"every request ({len(every)}): num_requests = -1")
    budget = _budget(table, rule, value)
    taken: list[str] = []
    spent = 0.0
    if order in (SelectOrder.FIRST_COME_WAITING, SelectOrder.FIRST_COME_WAITING_THEN_SHORTEST_RUNNING):
        spent = _spend(table.waiting, budget, rule, False, taken)
        if order == SelectOrder.FIRST_COME_WAITING_THEN_SHORTEST_RUNNING and budget - spent > 0:
            spent += _spend(_running_in_order(table.running, order), budget - spent, rule, True, taken)
    else:
        spent = _spend(_running_in_order(table.running, order), budget, rule, True, taken)
    unit = "requests" if rule == SelectRule.NUM_REQUESTS else "tokens"
    reason = f"{order} under {rule} = {value:g}: {len(taken)} requests, {spent:g} of {budget:g} {unit}"
    return Selection(tuple(taken), budget, spent, reason)
