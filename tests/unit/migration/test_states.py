"""The migration state machine and per-worker table (components/migration/states.py)."""

from __future__ import annotations

import pytest

from components.migration.errors import IllegalTransitionError
from components.migration.states import Direction, MigrationState, MigrationTable

pytestmark = pytest.mark.unit

S = MigrationState


def test_live_migration_path_and_its_downtime() -> None:
    t = MigrationTable(2)
    m = t.begin("m1", "r1", Direction.OUT, 7, now_s=10.0)
    assert m is not None and m.state == S.PENDING
    t.advance("m1", S.PRE_COPYING, 10.1)
    t.advance("m1", S.FINAL_STAGE, 10.5)
    done = t.advance("m1", S.COMMITTED, 10.52)
    assert done.downtime_s == pytest.approx(0.02)
    assert len(t) == 0 and not t.is_migrating("r1")
    assert t.counters() == {"out_committed": 1}


def test_recompute_skips_pre_copying() -> None:
    t = MigrationTable(1)
    t.begin("m", "r", Direction.OUT, 1, 0.0)
    t.advance("m", S.FINAL_STAGE, 1.0)
    t.advance("m", S.ABORTED_BY_DESTINATION, 2.0, "no room")
    assert t.counters() == {"out_aborted_by_destination": 1}


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ([], S.COMMITTED),  # pending -> committed: nothing was suspended or sent
        ([S.FINAL_STAGE], S.PRE_COPYING),  # no going back to pre-copy
        ([S.PRE_COPYING], S.PENDING),
    ],
)
def test_illegal_transitions_raise(path: list[MigrationState], bad: MigrationState) -> None:
    t = MigrationTable(1)
    t.begin("m", "r", Direction.OUT, 1, 0.0)
    for s in path:
        t.advance("m", s, 0.0)
    with pytest.raises(IllegalTransitionError):
        t.advance("m", bad, 0.0)


def test_a_terminal_migration_has_no_way_out() -> None:
    t = MigrationTable(1)
    t.begin("m", "r", Direction.IN, 1, 0.0)
    t.advance("m", S.ABORTED_BY_SOURCE, 0.0)
    with pytest.raises(IllegalTransitionError, match="not active"):
        t.advance("m", S.FINAL_STAGE, 0.0)
    assert all(s.is_terminal for s in (S.COMMITTED, S.ABORTED_BY_SOURCE, S.ABORTED_BY_DESTINATION))


def test_cap_counts_both_directions_and_one_migration_per_request() -> None:
    t = MigrationTable(2)
    assert t.begin("a", "r1", Direction.OUT, 1, 0.0) is not None
    assert t.begin("b", "r1", Direction.OUT, 2, 0.0) is None  # r1 already migrates
    assert t.begin("c", "r2", Direction.IN, 3, 0.0) is not None
    assert not t.has_slot()
    assert t.begin("d", "r3", Direction.IN, 3, 0.0) is None
    assert t.counters() == {"out_refused": 1, "in_refused": 1}
    t.advance("c", S.ABORTED_BY_SOURCE, 1.0)
    assert t.begin("d", "r3", Direction.IN, 3, 1.0) is not None


def test_stalled_lists_incoming_migrations_whose_source_went_silent() -> None:
    t = MigrationTable(3)
    t.begin("in1", "r1", Direction.IN, 1, 0.0)
    t.begin("in2", "r2", Direction.IN, 1, 0.0)
    t.begin("out", "r3", Direction.OUT, 1, 0.0)
    t.touch("in2", 8.0)
    assert [m.migration_id for m in t.stalled(10.0, 10.0)] == ["in1"]  # out is never the watchdog's
    assert t.stalled(9.9, 10.0) == []


def test_outcomes_are_counted_by_the_mode_that_ran_and_refusals_apart() -> None:
    t = MigrationTable(1)
    for i, (mode, end) in enumerate(
        [
            ("kv_transfer", S.COMMITTED),
            ("kv_transfer", S.COMMITTED),
            ("recompute", S.COMMITTED),
            ("kv_transfer", S.ABORTED_BY_DESTINATION),
        ]
    ):
        m = t.begin(f"m{i}", f"r{i}", Direction.OUT, 1, float(i))
        assert m is not None
        m.mode = mode  # the agent sets the mode tried, then the one that ran
        t.advance(m.migration_id, S.FINAL_STAGE, i + 0.1)
        t.advance(m.migration_id, end, i + 0.2)
    t.begin("x", "rx", Direction.IN, 2, 9.0)
    assert t.begin("y", "ry", Direction.IN, 2, 9.0) is None  # at the cap: refused
    assert t.outcome_counts() == [
        ("in", "refused", "", 1),
        ("out", "aborted_by_destination", "kv_transfer", 1),
        ("out", "committed", "kv_transfer", 2),
        ("out", "committed", "recompute", 1),
    ]
    assert t.counters()["out_committed"] == 3  # the flat counters are unchanged
