"""The dispatch's retry rule (components/frontend/dispatch.py): a failed worker's process is suspect, and a retry
goes to another process while one exists. Pure parts only; the frontend's integration tests run the rest."""

from __future__ import annotations

import pytest

from components.frontend.dispatch import Suspects, avoid

pytestmark = pytest.mark.unit

# Two processes of 8 workers each on one node, and one worker on another node.
INSTANCES = {iid: ("node-a", 100) for iid in range(8)} | {iid: ("node-a", 200) for iid in range(8, 16)}
INSTANCES |= {16: ("node-b", 100)}


def process_of(info: tuple[str, int]) -> tuple[str, int]:
    return info


def test_a_retry_avoids_every_worker_of_the_process_that_failed():
    shunned = avoid(INSTANCES, {3}, {("node-a", 100)}, process_of)
    assert shunned == frozenset(range(8))
    # What is left: the other process on the same node, and the other node (same pid there: another process).
    assert set(INSTANCES) - shunned == set(range(8, 17))


def test_suspect_processes_are_only_avoided_while_another_can_serve():
    only_one = {iid: ("n", 1) for iid in range(4)}
    assert avoid(only_one, {0}, {("n", 1)}, process_of) == frozenset({0})  # better a suspect than no answer
    assert avoid(only_one, set(), set(), process_of) == frozenset()


def test_suspects_expire_and_an_anonymous_worker_makes_no_process_suspect():
    s = Suspects(hold_s=2.0)
    s.mark(("node-a", 100), now_s=10.0)
    s.mark(("", 0), now_s=10.0)  # no node/pid announced: nothing known to share its fault
    assert s.active(11.9) == {("node-a", 100)}
    assert s.active(12.0) == set()
