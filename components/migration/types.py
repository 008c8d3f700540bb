"""The vocabulary of request selection: rules, orders, and the engine's request table as selection reads it.

Names are readable; the seed's abbreviations (Llumnix's ``MigrationType`` and ``RequestMigrationPolicy``) are
accepted as aliases, case-insensitively, wherever a rule or an order is parsed (a CLI flag, a ``MigrateRequest``).

Pure: the standard library only.
"""

from __future__ import annotations

import dataclasses
import enum

from components.migration.errors import UnknownSelectionError


class SelectRule(enum.StrEnum):
    """What the selection budget counts (``select_value`` is its size)."""

    NUM_REQUESTS = "num_requests"  # NUM_REQ: requests; -1 = every request (a worker being emptied)
    TOKENS = "tokens"  # TOKEN: tokens (prompt + output) of the selected requests
    KV_RATIO = "kv_ratio"  # RATIO: a fraction of the engine's KV capacity (blocks x block size), counted in tokens


class SelectOrder(enum.StrEnum):
    """Which requests are taken first."""

    LAST_COME_RUNNING = "last_come_running"  # LCR: running requests, newest first
    FIRST_COME_RUNNING = "first_come_running"  # FCR: running requests, oldest first
    LONGEST_RUNNING = "longest_running"  # LR: running requests, most tokens first
    SHORTEST_RUNNING = "shortest_running"  # SR: running requests, fewest tokens first
    FIRST_COME_WAITING = "first_come_waiting"  # FCW: waiting requests, in queue order
    FIRST_COME_WAITING_THEN_SHORTEST_RUNNING = "first_come_waiting_then_shortest_running"  # FCWSR


RULE_ALIASES: dict[str, SelectRule] = {
    "NUM_REQ": SelectRule.NUM_REQUESTS,
    "TOKEN": SelectRule.TOKENS,
    "RATIO": SelectRule.KV_RATIO,
}
ORDER_ALIASES: dict[str, SelectOrder] = {
    "LCR": SelectOrder.LAST_COME_RUNNING,
    "FCR": SelectOrder.FIRST_COME_RUNNING,
    "LR": SelectOrder.LONGEST_RUNNING,
    "SR": SelectOrder.SHORTEST_RUNNING,
    "FCW": SelectOrder.FIRST_COME_WAITING,
    "FCWSR": SelectOrder.FIRST_COME_WAITING_THEN_SHORTEST_RUNNING,
}


def parse_rule(text: str | SelectRule) -> SelectRule:
    """A rule from its readable name or the seed's abbreviation (any case). UnknownSelectionError otherwise."""
    if isinstance(text, SelectRule):
        return text
    key = text.strip()
    alias = RULE_ALIASES.get(key.upper())
    if alias is not None:
        return alias
    try:
        return SelectRule(key.lower())
    except ValueError:
        raise UnknownSelectionError("select rule", text, [r.value for r in SelectRule], list(RULE_ALIASES)) from None


def parse_order(text: str | SelectOrder) -> SelectOrder:
    """An order from its readable name or the seed's abbreviation (any case). UnknownSelectionError otherwise."""
    if isinstance(text, SelectOrder):
        return text
    key = text.strip()
    alias = ORDER_ALIASES.get(key.upper())
    if alias is not None:
        return alias
    try:
        return SelectOrder(key.lower())
    except ValueError:
        raise UnknownSelectionError("select order", text, [o.value for o in SelectOrder], list(ORDER_ALIASES)) from None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestView:
    """One request of an engine as selection sees it. ``num_output_tokens`` 0 on a running request means it is
    still prefilling (never selected: its first token is on its way). ``migrating``: a migration of it is already
    under way (never selected twice)."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_s: float = 0.0
    migrating: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: its KV footprint, and what TOKEN and RATIO budgets count."""
        return self.num_prompt_tokens + self.num_output_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class RequestTable:
    """An engine's requests at one instant: ``running`` in the engine's running order (oldest admitted first),
    ``waiting`` in queue order (next to be admitted first), and the KV capacity in tokens (RATIO's base)."""

    running: tuple[RequestView, ...] = ()
    waiting: tuple[RequestView, ...] = ()
    kv_capacity_tokens: int = 0
