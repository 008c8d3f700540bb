"""Request selection (components/migration/policies/selection.py): every rule and order, with the seed's semantics.

The builder makes a table whose running requests are listed in admission order (oldest first) and whose waiting
requests are in queue order; each test derives its expected ids from the module docstring's rules.
"""

from __future__ import annotations

import pytest

from components.migration.errors import InvalidSelectionError, UnknownSelectionError
from components.migration.policies.selection import select_requests
from components.migration.types import (
    ORDER_ALIASES,
    RULE_ALIASES,
    RequestTable,
    RequestView,
    SelectOrder,
    SelectRule,
    parse_order,
    parse_rule,
)

pytestmark = pytest.mark.unit


def running(rid: str, prompt: int, output: int = 1, migrating: bool = False) -> RequestView:
    return RequestView(rid, prompt, output, migrating=migrating)


def waiting(rid: str, prompt: int) -> RequestView:
    return RequestView(rid, prompt, 0)


# Running, oldest first: tokens a=100+10, b=50+5, c=300+30, d=20+2 (still prefilling: 0 outputs -> never taken).
TABLE = RequestTable(
    running=(running("a", 100, 10), running("b", 50, 5), running("c", 300, 30), running("p", 20, 0)),
    waiting=(waiting("w1", 40), waiting("w2", 500), waiting("w3", 10)),
    kv_capacity_tokens=1000,
)


def ids(rule: str, value: float, order: str, table: RequestTable = TABLE) -> list[str]:
    return list(select_requests(table, rule, value, order).request_ids)


def test_aliases_and_readable_names_parse_to_the_same_member() -> None:
    assert {k: parse_rule(k) for k in RULE_ALIASES} == RULE_ALIASES
    assert {k: parse_order(k) for k in ORDER_ALIASES} == ORDER_ALIASES
    for member in SelectRule:
        assert parse_rule(member.value) is member
        assert parse_rule(member.value.upper()) is member
    for member in SelectOrder:
        assert parse_order(member.value) is member
    assert parse_order("fcwsr") is SelectOrder.FIRST_COME_WAITING_THEN_SHORTEST_RUNNING
    assert parse_rule(" num_req ") is SelectRule.NUM_REQUESTS


def test_unknown_rule_or_order_names_the_choices() -> None:
    with pytest.raises(UnknownSelectionError, match="LCR"):
        parse_order("newest")
    with pytest.raises(UnknownSelectionError, match="NUM_REQ"):
        select_requests(TABLE, "requests", 1, "SR")


# --- orders, under NUM_REQ ------------------------------------------------------------------------------------------


def test_lcr_takes_the_newest_running_first_skipping_one_still_prefilling() -> None:
    assert ids("NUM_REQ", 1, "LCR") == ["c"]  # p is newer but has no output yet
    assert ids("NUM_REQ", 2, "LCR") == ["c", "b"]


def test_fcr_takes_the_oldest_running_first() -> None:
    assert ids("NUM_REQ", 2, "FCR") == ["a", "b"]


def test_lr_takes_the_most_tokens_first() -> None:
    assert ids("NUM_REQ", 2, "LR") == ["c", "a"]  # 330, 110 (then b 55)


def test_sr_takes_the_fewest_tokens_first() -> None:
    assert ids("NUM_REQ", 2, "SR") == ["b", "a"]  # 55, 110


def test_sr_and_lr_keep_the_running_order_among_equals() -> None:
    table = RequestTable(running=(running("x", 10, 5), running("y", 12, 3), running("z", 1, 1)))
    assert ids("NUM_REQ", 3, "SR", table) == ["z", "x", "y"]
    assert ids("NUM_REQ", 3, "LR", table) == ["x", "y", "z"]


def test_fcw_takes_waiting_requests_in_queue_order_and_no_running_one() -> None:
    assert ids("NUM_REQ", 2, "FCW") == ["w1", "w2"]
    assert ids("NUM_REQ", 10, "FCW") == ["w1", "w2", "w3"]


def test_fcwsr_takes_waiting_first_then_the_shortest_running_while_budget_remains() -> None:
    assert ids("NUM_REQ", 2, "FCWSR") == ["w1", "w2"]
    assert ids("NUM_REQ", 5, "FCWSR") == ["w1", "w2", "w3", "b", "a"]
    no_waiting = RequestTable(running=TABLE.running)
    assert ids("NUM_REQ", 1, "FCWSR", no_waiting) == ["b"]


def test_num_req_minus_one_is_every_request_running_and_waiting_but_those_already_migrating() -> None:
    table = RequestTable(
        running=(running("a", 10), running("m", 10, migrating=True), running("p", 10, 0)), waiting=(waiting("w", 5),)
    )
    sel = select_requests(table, "NUM_REQ", -1, "SR")
    assert sel.request_ids == ("a", "p", "w")  # even the prefilling one: the worker is being emptied


def test_a_request_already_migrating_is_never_selected() -> None:
    table = RequestTable(running=(running("a", 10, migrating=True), running("b", 20)))
    assert ids("NUM_REQ", 2, "FCR", table) == ["b"]


def test_nothing_to_select_is_an_empty_selection_not_an_error() -> None:
    assert ids("NUM_REQ", 3, "SR", RequestTable()) == []
    assert ids("NUM_REQ", 0, "SR") == []


# --- TOKEN and RATIO budgets ----------------------------------------------------------------------------------------


def test_token_budget_counts_prompt_plus_output_and_may_end_past_it_with_the_last_request() -> None:
    # SR: b (55) then a (110): after b, 55 < 120, and a alone (110) fits 120: taken, spending 165.
    sel = select_requests(TABLE, "TOKEN", 120, "SR")
    assert sel.request_ids == ("b", "a")
    assert sel.spent == 165 and sel.budget == 120


def test_token_budget_stops_once_spent_reaches_it() -> None:
    # SR: b (55), a (110) -> 165 >= 160: c is not looked at.
    assert ids("TOKEN", 160, "SR") == ["b", "a"]
    # exactly reached: b alone 55 == 55, stop.
    assert ids("TOKEN", 55, "SR") == ["b"]


def test_a_request_is_taken_when_it_brings_the_total_closer_to_the_budget_and_passed_over_when_not() -> None:
    # The llumlet's "closest to this value". LR, 200: c (330) leaves the total 130 from 200, nothing leaves it 200
    # from it: taken, and 330 >= 200 ends it.
    assert ids("TOKEN", 200, "LR") == ["c"]
    # LR, 150: c (330) would leave it 180 away, nothing 150: passed over; a (110): 40 away, taken; b (55): 15 away
    # against 40: taken, 165.
    assert ids("TOKEN", 150, "LR") == ["a", "b"]


def test_ratio_budget_is_a_fraction_of_the_kv_capacity_in_tokens() -> None:
    # 0.2 x 1000 = 200 tokens: the same as TOKEN 200.
    sel = select_requests(TABLE, "RATIO", 0.2, "LR")
    assert sel.request_ids == ("c",)
    assert sel.budget == 200
    # 50 tokens: c (330) and a (110) would leave the total further from 50 than nothing does; b (55) 5 from it.
    assert ids("RATIO", 0.05, "LR") == ["b"]


def test_fcwsr_under_a_token_budget_gives_the_running_part_only_what_the_waiting_part_left() -> None:
    # 60: waiting w1 (40) taken (20 away against 60), w2 (500) passed over, w3 (10) taken (10 away against 20): 50
    # spent; the running part gets the 10 left: b (55) would leave it 45 away against 10, a and c more: nothing.
    assert ids("TOKEN", 60, "FCWSR") == ["w1", "w3"]
    # 100: waiting 50 again, the running part 50: b (55) is 5 away against 50: taken.
    assert ids("TOKEN", 100, "FCWSR") == ["w1", "w3", "b"]


def test_values_a_rule_cannot_use_are_refused() -> None:
    with pytest.raises(InvalidSelectionError):
        select_requests(TABLE, "RATIO", 1.5, "SR")
    with pytest.raises(InvalidSelectionError):
        select_requests(TABLE, "TOKEN", -5, "SR")
    with pytest.raises(InvalidSelectionError):
        select_requests(TABLE, "NUM_REQ", -2, "SR")
