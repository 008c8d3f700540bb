"""``kvmesh bench scale-down``'s pure pieces: the ABBA order, the gaps counted in the scale-down window, the
percentile, and the summary's medians and ratios (numbers derived in the comments)."""

from __future__ import annotations

import pytest

from components.cli.bench.scale_down import DRAIN, MIGRATE, abba, gaps_in, percentile, summarize

pytestmark = pytest.mark.unit


def test_sides_alternate_abba():
    assert abba(2) == [DRAIN, MIGRATE, MIGRATE, DRAIN]
    assert abba(3) == [DRAIN, MIGRATE, MIGRATE, DRAIN, DRAIN, MIGRATE]


def test_only_the_gaps_whose_later_chunk_arrived_in_the_window_count():
    # Chunks at 0, 1, 3, 6, 10: gaps 1, 2, 3, 4 ending at 1, 3, 6, 10; window [2, 6] keeps those ending at 3 and 6.
    assert gaps_in([0.0, 1.0, 3.0, 6.0, 10.0], 2.0, 6.0) == [2.0, 3.0]
    assert gaps_in([5.0], 0.0, 10.0) == []


def test_nearest_rank_percentile():
    values = [float(v) for v in range(1, 101)]  # 1..100: the 99th percentile is the 99th value, the 50th the 50th
    assert percentile(values, 99) == 99.0
    assert percentile(values, 50) == 50.0
    assert percentile([], 99) is None


def _round(i: int, side: str, s: float, failed: int = 0) -> dict:
    return {
        "round": i, "side": side, "scale_down_s": s, "failed": failed, "requests": 8, "new_requests": 4,
        "itl_during_p50_ms": 5.0, "itl_during_p99_ms": 9.0 if side == MIGRATE else 7.0, "max_gap_ms": 12.0,
        "new_ttft_p50_ms": None if i == 0 else 50.0,
    }  # fmt: skip


def test_summary_medians_spread_and_ratios():
    # ABBA: drain 10, migrate 1, migrate 2, drain 12. Medians: drain 11, migrate 1.5: ratio 11 / 1.5 = 7.33.
    # Pairs: (10 / 1) = 10.0 and (12 / 2) = 6.0.
    rounds = [
        _round(0, DRAIN, 10.0),
        _round(1, MIGRATE, 1.0),
        _round(2, MIGRATE, 2.0, failed=1),
        _round(3, DRAIN, 12.0),
    ]
    s = summarize(rounds)
    assert s[DRAIN]["scale_down_s"] == [10.0, 12.0]
    assert (s[DRAIN]["median_s"], s[DRAIN]["min_s"], s[DRAIN]["max_s"]) == (11.0, 10.0, 12.0)
    assert s[MIGRATE]["median_s"] == 1.5
    assert s["ratio_of_medians"] == round(11.0 / 1.5, 2) == 7.33
    assert s["ratio_per_pair"] == [10.0, 6.0]
    assert (s[MIGRATE]["failed"], s["failed"]) == (1, 1)
    assert s[DRAIN]["requests"] == 2 * (8 + 4)
    assert s[MIGRATE]["itl_during_p99_ms"] == 9.0
    assert s[DRAIN]["new_ttft_p50_ms"] == 50.0  # round 0 had none: only round 3's counts


def test_summary_of_serve_rounds_adds_the_connectors_call():
    # --via serve rounds carry set_pool_size_s: drain 8.0 and 8.4 (median 8.2), migrate 0.7 and 0.9 (median 0.8).
    rounds = [_round(0, DRAIN, 7.6), _round(1, MIGRATE, 0.4), _round(2, MIGRATE, 0.6), _round(3, DRAIN, 7.9)]
    for r, t in zip(rounds, (8.0, 0.7, 0.9, 8.4), strict=True):
        r["set_pool_size_s"] = t
    s = summarize(rounds)
    assert s[DRAIN]["set_pool_size_s"] == [8.0, 8.4] and s[DRAIN]["set_pool_size_median_s"] == pytest.approx(8.2)
    assert s[MIGRATE]["set_pool_size_median_s"] == pytest.approx(0.8)
    assert "set_pool_size_s" not in summarize([_round(0, DRAIN, 1.0)])[DRAIN]  # a processes round: none
