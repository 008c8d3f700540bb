"""Floors of the KV-use imbalance (components/sim/balance.py) on hand-made instants whose answers are derived here."""

from __future__ import annotations

import pytest

from components.sim.balance import lone_move_narrows, sharing_groups, spread_bounds, spread_lower_bound


def test_items_that_split_evenly_reach_zero_where_longest_first_does_not():
    # 3, 3, 2, 2, 2 on 2 workers: longest first puts 3 | 3, then 2 | 2, then the last 2 on either: 7 | 5, spread 2.
    # {3, 3} | {2, 2, 2} is 6 | 6: the optimum is 0, which the search finds.
    b = spread_bounds([3, 3, 2, 2, 2], 2)
    assert (b.lower, b.best, b.exact) == (0.0, 0.0, True)


def test_one_request_larger_than_the_others_together_sets_the_floor():
    # 9, 1, 1, 1 on 4 workers: one worker holds the 9, each other at most... one 1 in the best placement: spread 8.
    # The bound: the largest worker >= 9, the total 12, so the emptiest <= (12 - 9) / 3 = 1: spread >= 8.
    assert spread_lower_bound([9, 1, 1, 1], 4) == pytest.approx(8.0)
    b = spread_bounds([9, 1, 1, 1], 4)
    assert (b.lower, b.best, b.exact) == (8.0, 8.0, True)


def test_three_equal_requests_on_two_workers_pigeonhole():
    # 5, 5, 5 on 2 workers: two share a worker (pigeonhole): the largest >= 10, the other <= 15 - 10 = 5: spread 5.
    assert spread_lower_bound([5, 5, 5], 2) == pytest.approx(5.0)
    assert spread_bounds([5, 5, 5], 2).best == pytest.approx(5.0)


def test_divisible_blocks_fill_the_emptiest_worker_first():
    # An 8-block request and 4 blocks that can go anywhere on 2 workers: 8 | 4 at best, spread 4 = (2 x 8 - 12) / 1.
    b = spread_bounds([8], 2, residual=4)
    assert (b.lower, b.best) == (pytest.approx(4.0), pytest.approx(4.0))
    # 12 divisible blocks on 2 workers against the same 8: 10 | 10 (the 12 fill 0 -> 8, then 2 each): spread 0.
    assert spread_bounds([8], 2, residual=12).best == pytest.approx(0.0)


def test_blocks_left_where_they_are_pin_the_spread():
    # 10 blocks pinned on worker 0, nothing on the other two, 6 divisible: 10 | 3 | 3, spread 7. The same 10 as a
    # movable item changes nothing here (it is alone on whichever worker holds it).
    b = spread_bounds([], 3, residual=6, preload=[10, 0, 0])
    assert b.best == pytest.approx(7.0)
    # Pinned 6 | 0 with items 4 and 2: the 4 and the 2 both onto worker 1 -> 6 | 6, spread 0.
    assert spread_bounds([4, 2], 2, preload=[6, 0]).best == pytest.approx(0.0)


def test_an_unfinished_search_says_so():
    # One node allowed: longest first's 7 | 5 is all it has; the lower bound 0 is not reached, so not exact.
    b = spread_bounds([3, 3, 2, 2, 2], 2, max_nodes=1)
    assert (b.lower, b.best, b.exact) == (0.0, 2.0, False)


def test_requests_that_share_a_block_form_one_group_of_their_distinct_blocks():
    # r0 = a b c, r1 = a b d share a and b; r3 = d g shares d with r1: one group {a, b, c, d, g} (5 blocks); r2 = e f
    # shares nothing: a group of 2.
    groups = sharing_groups([["a", "b", "c"], ["a", "b", "d"], ["e", "f"], ["d", "g"]])
    assert sorted(groups) == [2, 5]


def test_a_lone_move_narrows_only_a_gap_wider_than_the_request():
    # Moving s blocks across a gap g leaves |g - 2 s|: 7 across 6 leaves 8 (wider), across 8 leaves 6 (narrower).
    assert not lone_move_narrows([10, 7], 6)
    assert lone_move_narrows([10, 7], 8)
    assert not lone_move_narrows([], 8)


def test_a_tolerance_stops_the_search_within_it():
    # 3, 3, 2, 2, 2 on 2 workers: longest first's 7 | 5 (spread 2) is within a tolerance of 2 of the bound 0, so
    # no search: the optimum (0) lies in [lower, best] = [0, 2].
    b = spread_bounds([3, 3, 2, 2, 2], 2, tolerance=2)
    assert (b.lower, b.best, b.exact) == (0.0, 2.0, True)
    # With a tolerance of 1 longest first is not close enough; the search finds {3, 3} | {2, 2, 2}, spread 0.
    b = spread_bounds([3, 3, 2, 2, 2], 2, tolerance=1)
    assert (b.lower, b.best, b.exact) == (0.0, 0.0, True)
