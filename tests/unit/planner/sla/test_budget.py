"""The atomic GPU budget: swaps remove before they add, wanted counts over budget are cut with the reason, no step ever
takes the fleet past the budget (checked on every small case), and nothing to do is a plan with no steps."""

from __future__ import annotations

import itertools

import pytest

from components.planner.sla.budget import Step, plan_budget

pytestmark = pytest.mark.unit


def test_a_swap_at_full_budget_removes_before_it_adds():
    # 2 prefill + 2 decode at 2 GPUs each = 8 GPUs = the budget. Wanted 1 prefill + 3 decode = 8 GPUs: fits at the
    # end, but only if the prefill worker goes first: adding first would hold 10 GPUs (issue 12428).
    plan = plan_budget(2, 2, 1, 3, gpus_per_prefill=2, gpus_per_decode=2, max_gpu_budget=8)
    assert plan.steps == (Step("prefill", 2, 1, 6), Step("decode", 2, 3, 8))
    assert plan.steps[0].is_removal and not plan.steps[1].is_removal
    assert (plan.prefill, plan.decode, plan.clamped) == (1, 3, False)
    assert plan.reason == "prefill 2 -> 1 (6 GPUs); then decode 2 -> 3 (8 GPUs)"


def test_a_swap_the_other_way_removes_decode_first():
    # 1 prefill worker of 4 GPUs + 4 decode workers of 1 GPU = 8 GPUs; wanted 2 prefill + 1 decode = 9 GPUs, the
    # budget. Decode gives back 3 GPUs first (1 x 4 + 1 x 1 = 5), then prefill takes 4 (2 x 4 + 1 = 9): never over 9.
    plan = plan_budget(1, 4, 2, 1, gpus_per_prefill=4, gpus_per_decode=1, max_gpu_budget=9)
    assert plan.steps == (Step("decode", 4, 1, 5), Step("prefill", 1, 2, 9))


def test_wanted_counts_over_the_budget_are_cut_by_the_same_fraction_with_the_reason():
    # Wanted 4 + 4 at 2 GPUs each = 16 GPUs, budget 8: both x 8/16 = 2 + 2 (8 GPUs).
    plan = plan_budget(2, 2, 4, 4, gpus_per_prefill=2, gpus_per_decode=2, max_gpu_budget=8)
    assert (plan.prefill, plan.decode, plan.clamped) == (2, 2, True)
    assert plan.steps == ()
    assert "= 16 GPUs, over the 8-GPU budget: both cut to ~50% (2 prefill, 2 decode, 8 GPUs)" in plan.reason
    # Wanted 3 prefill + 6 decode (1 GPU each) = 9, budget 6: x 2/3 = 2 + 4, each pool at 2/3 of what it wanted.
    plan = plan_budget(1, 1, 3, 6, max_gpu_budget=6)
    assert (plan.prefill, plan.decode) == (2, 4)
    assert plan.steps == (Step("decode", 1, 4, 5), Step("prefill", 1, 2, 6))


def test_a_minimum_pool_makes_the_other_give_way_and_leftovers_go_to_the_worse_served_pool():
    # Wanted 1 prefill + 10 decode, budget 5: x 0.5 gives floor(0.5) = 0 -> 1 prefill (minimum) and 5 decode = 6 > 5,
    # so decode (the only pool above its minimum) gives one up: 1 + 4.
    plan = plan_budget(1, 1, 1, 10, max_gpu_budget=5)
    assert (plan.prefill, plan.decode) == (1, 4)
    # Wanted 5 prefill + 5 decode at 1 GPU, budget 7: x 0.7 = floor(3.5) = 3 + 3 = 6, one GPU left: both at 3/5,
    # decode takes it on the tie: 3 + 4.
    plan = plan_budget(3, 3, 5, 5, max_gpu_budget=7)
    assert (plan.prefill, plan.decode) == (3, 4)
    assert plan.steps == (Step("decode", 3, 4, 7),)


def test_no_op_when_the_targets_are_the_current_counts():
    plan = plan_budget(2, 3, 2, 3, gpus_per_prefill=2, max_gpu_budget=8)
    assert plan.steps == ()
    assert not plan.clamped
    assert plan.reason == "no change: 2 prefill, 3 decode (7 GPUs)"


def test_a_fleet_over_the_budget_only_shrinks_back_into_it():
    # 3 + 3 = 6 GPUs added by hand over a budget of 4, wanted unchanged: cut to 2 + 2, removals only.
    plan = plan_budget(3, 3, 3, 3, max_gpu_budget=4)
    assert plan.steps == (Step("prefill", 3, 2, 5), Step("decode", 3, 2, 4))
    assert "the fleet was over the budget (6 > 4 GPUs)" in plan.reason


def test_the_minimum_budget_raises_the_pools_fewer_gpus_first_decode_on_a_tie():
    # Wanted 1 + 1 = 2 GPUs, minimum 4: decode 2 (tie), prefill 2 (fewer GPUs): 2 + 2.
    plan = plan_budget(1, 1, 1, 1, min_gpu_budget=4, max_gpu_budget=8)
    assert (plan.prefill, plan.decode, plan.clamped) == (2, 2, True)
    assert "under the 4-GPU minimum" in plan.reason


def test_an_aggregated_deployment_has_no_prefill_pool():
    plan = plan_budget(0, 2, 0, 5, min_prefill=0, max_gpu_budget=4)
    assert (plan.prefill, plan.decode) == (0, 4)
    assert plan.steps == (Step("decode", 2, 4, 4),)


def test_a_budget_that_cannot_hold_the_minimum_pools_is_refused():
    with pytest.raises(ValueError, match="cannot hold the minimum pools"):
        plan_budget(1, 1, 1, 1, gpus_per_prefill=2, gpus_per_decode=2, max_gpu_budget=3)


def test_no_step_ever_passes_the_budget_and_every_plan_ends_within_it():
    # Every current and wanted count 0..4 per pool (1 and 2 GPUs per worker), budgets 3..8: removals come first, an
    # addition never ends above the budget, the fleet never grows while above it, and the end is within it, at the
    # minimums or above, and reached by the last step.
    for cp, cd, tp, td, budget in itertools.product(range(5), range(5), range(5), range(5), range(3, 9)):
        plan = plan_budget(cp, cd, tp, td, gpus_per_prefill=1, gpus_per_decode=2, max_gpu_budget=budget)
        gpus = cp + 2 * cd
        seen_addition = False
        for s in plan.steps:
            if s.is_removal:
                assert not seen_addition, plan
                assert s.gpus_after < gpus
            else:
                seen_addition = True
                assert s.gpus_after <= budget, plan
            gpus = s.gpus_after
        assert plan.prefill + 2 * plan.decode <= budget
        assert plan.prefill >= 1 and plan.decode >= 1
        assert gpus == plan.prefill + 2 * plan.decode
