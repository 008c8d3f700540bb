"""``WorkerTable`` (what the router hands a policy, with what a decision would otherwise walk every snapshot for) and
the policies' shortcuts over it: every decision must be the one the policy makes over a plain list of the same
snapshots, down to the reason and the random draws.

Also the lazy ``RouteDecision.reason``.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from components.router import POLICIES, RouterConfig, RouteRequest, WorkerSnapshot, make_policy
from components.router.policies import kv
from components.router.types import DecisionKind, RouteDecision, StepTime, WorkerTable, lazy_reason

pytestmark = pytest.mark.unit

NOW = 100.0
BS = 16
STEPS = [StepTime(), StepTime(prefill_ms_per_token=2e-2, decode_base_ms=7.0), StepTime(prefill_base_ms=30.0)]


def snapshot(rng: random.Random, iid: int, *, ties: bool, stale_ones: bool) -> WorkerSnapshot:
    """A worker as the router derives it, at a random load. ``ties``: loads from a few values and one step-time
    model, so that many workers cost exactly the same."""
    if ties:
        step, seqs, kv_tokens, queued = STEPS[0], rng.choice([0, 2]), 0, rng.choice([0, 0, 256, 1024])
    else:
        step, seqs, kv_tokens, queued = rng.choice(STEPS), rng.randrange(8), rng.randrange(60_000), rng.randrange(9000)
    received = NOW - rng.random() * 0.1
    stale_at = NOW - 1.0 if stale_ones and rng.random() < 0.1 else received + 0.5
    return WorkerSnapshot(
        iid,
        {"model": "m", "block_size": BS},
        active_requests=seqs,
        active_prompt_tokens=kv_tokens,
        active_prefill_tokens=queued,
        active_blocks=kv_tokens // BS,
        kv_usage=rng.random(),
        num_running=seqs,
        num_waiting=rng.randrange(3),
        num_waiting_prefill_tokens=queued,
        metrics_received_s=received,
        metrics_interval_s=0.1,
        metrics_stale_after_s=stale_at,
        queued_prefill_tokens=queued,
        prefill_ms_per_token=step.prefill_ms_per_prompt_token(seqs, kv_tokens),
        decode_step_ms=step.decode_ms(seqs + 1, kv_tokens + kv_tokens // max(1, seqs)),
    )


def check_table(table: WorkerTable, ws: list[WorkerSnapshot]) -> None:
    """The table's summaries are those of ``ws``, computed the slow way."""
    assert list(table) == ws and len(table) == len(ws) and table[3] == ws[3] and table[1:3] == ws[1:3]
    for now in (NOW - 2.0, NOW - 1.0, NOW, NOW + 0.45, NOW + 0.5):  # from the kept bound, then found again
        assert table.none_stale(now) == all(w.metrics_stale_after_s > now for w in ws), now
    assert table.min_stale_after_s() == min(w.metrics_stale_after_s for w in ws)
    assert table.load_range() == (min(w.active_requests for w in ws), max(w.active_requests for w in ws))
    pairs = list(table.by_queued_wait())
    assert sorted(i for _, i in pairs) == list(range(len(ws)))
    assert [wait for wait, _ in pairs] == sorted(wait for wait, _ in pairs)
    # The queue's wait: its tokens at the worker's rate, plus the step in progress's residual while any is queued.
    assert all(
        wait
        == (
            ws[i].prefill_ms_per_token * ws[i].queued_prefill_tokens + ws[i].step_residual_ms
            if ws[i].queued_prefill_tokens
            else 0.0
        )
        for wait, i in pairs
    )
    assert all(table.prefill_ms_floor <= w.prefill_ms_per_token for w in ws)
    assert all(table.decode_ms_floor <= w.decode_step_ms for w in ws)
    assert table.positions == {w.instance_id: i for i, w in enumerate(ws)}
    # kv's four numbers per position, side by side, as the snapshots have them (the residual only where prefill is
    # queued): one array, four entries a worker.
    terms = table.cost_terms
    assert len(terms) == 4 * len(ws)
    assert list(terms[0::4]) == [w.prefill_ms_per_token for w in ws]
    assert list(terms[1::4]) == [w.queued_prefill_tokens for w in ws]
    assert list(terms[2::4]) == [w.step_residual_ms if w.queued_prefill_tokens else 0.0 for w in ws]
    assert list(terms[3::4]) == [w.decode_step_ms for w in ws]


@pytest.mark.parametrize("ties", [False, True])
def test_a_table_keeps_its_summaries_as_snapshots_are_replaced(ties):
    rng = random.Random(11)
    ws = [snapshot(rng, iid, ties=ties, stale_ones=True) for iid in range(10, 74)]
    table = WorkerTable(ws)
    check_table(table, ws)
    for step in range(600):
        i = rng.randrange(len(ws))
        ws[i] = snapshot(rng, ws[i].instance_id, ties=ties, stale_ones=True)
        table.replace(i, ws[i])
        if step % 7 == 0:  # summaries read now and then, as decisions do: updates pile up in between
            check_table(table, ws)
    check_table(table, ws)


def test_an_empty_table_has_no_stale_worker_and_no_load():
    table = WorkerTable(())
    assert len(table) == 0 and table.min_stale_after_s() == math.inf and table.load_range() == (0, 0)
    assert table.none_stale(1e18)
    assert list(table.by_queued_wait()) == []


def decide(name: str, config: dict[str, Any], req: RouteRequest, workers: Any, seed: int) -> tuple[Any, ...]:
    p = make_policy(RouterConfig(router_policy=name, **config))
    rng = random.Random(seed)
    d, _ = p.select(req, workers, p.initial_state(), rng)
    return d.instance_id, d.overlap_blocks, d.kind, d.reason, rng.getstate()


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"decode_weight": 0.0},
        {"decode_weight": 4.0},
        {"successor_weight": 0.0},
        {"successor_weight": 2.5},
        {"router_temperature": 0.5},
        {"balance_abs_threshold": 2},
    ],
)
def test_every_policy_decides_the_same_over_a_table_as_over_a_list(ties, config):
    # The table's shortcuts (no stale worker: the candidates are the table; kv's lowest cost found by walking the
    # workers by queued wait) must reproduce the plain computation exactly: the worker, its overlap, the kind, the
    # reason (which prints the cost) and what was drawn from the random generator (ties).
    rng = random.Random(5 if ties else 6)
    checked = 0
    for trial in range(60):
        n = rng.choice([3, 8, 40, 256])
        ws = [snapshot(rng, 1000 + 7 * i, ties=ties, stale_ones=trial % 3 == 0) for i in range(n)]
        table = WorkerTable(ws)
        floor = rng.choice([0, 0, 32])
        holders = rng.sample(range(n), rng.choice([0, 1, 3, max(1, n // 4)]))
        overlaps = {ws[i].instance_id: floor + rng.randrange(1, 400) for i in holders}
        req = RouteRequest(
            list(range(rng.choice([100, 2048, 8192]))),
            "m",
            NOW,
            block_size=BS,
            overlap_blocks=overlaps,
            common_overlap_blocks=floor,
            excluded_instance_ids=frozenset([ws[0].instance_id]) if trial % 5 == 0 else frozenset(),
        )
        for name in sorted(POLICIES):
            seed = rng.randrange(1000)
            assert decide(name, config, req, table, seed) == decide(name, config, req, ws, seed), (name, trial)
            checked += 1
    assert checked == 60 * len(POLICIES)


def test_lowest_ttft_finds_every_tie_and_gives_up_when_all_tie():
    # Workers 0..39 idle and alike; 3 and 7 hold a 4-block overlap and tie below the rest: both are found. With no
    # overlap all 40 tie, more than the quarter it reads at most: lowest_ttft leaves it to ttft_costs.
    ws = [WorkerSnapshot(i, {}) for i in range(40)]
    table = WorkerTable(ws)
    req = RouteRequest(list(range(256)), "m", NOW, block_size=BS, overlap_blocks={3: 4, 7: 4})
    found = kv.lowest_ttft(req, table, 1.0)
    assert found is not None and found[0] == [3, 7]
    assert found[1] == kv.ttft_costs(req, ws, 1.0)[3] == min(kv.ttft_costs(req, ws, 1.0))
    assert kv.lowest_ttft(RouteRequest(list(range(256)), "m", NOW, block_size=BS), table, 1.0) is None


def test_lowest_ttft_reads_only_the_workers_that_can_win():
    # 256 idle workers of one speed with queues of 0, 100, ..., 25500 tokens.
    ws = [WorkerSnapshot(i, {}, queued_prefill_tokens=100 * i) for i in range(256)]
    req = RouteRequest(list(range(1024)), "m", NOW, block_size=BS)
    reads = 0

    class Counting(list):  # a worker's four numbers are read from the table's cost_terms
        def __getitem__(self, i):  # type: ignore[override]
            reads.add(i // 4)
            return list.__getitem__(self, i)

    reads: set[int] = set()
    table = WorkerTable(ws)
    table.cost_terms = Counting(table.cost_terms)  # type: ignore[assignment]
    found = kv.lowest_ttft(req, table, 1.0)
    assert found == ([0], min(kv.ttft_costs(req, ws, 1.0)))
    # Every worker runs at the floor rates here, so a worker's bound is its cost: the walk reads worker 0 and stops
    # at worker 1, whose bound is 100 tokens (~2 ms) above worker 0's cost.
    assert reads == {0}


def test_the_reason_is_formatted_once_and_only_when_read():
    calls = []

    def text() -> str:
        calls.append(1)
        return "because"

    d = RouteDecision(4, text, 2, DecisionKind.CACHE_HIT)
    assert calls == []
    assert d.reason == "because" and d.reason == "because" and calls == [1]
    assert "reason='because'" in repr(d)
    # Equality is the placement; the reason's wording is for logs.
    assert d == RouteDecision(4, "other words", 2, DecisionKind.CACHE_HIT) != RouteDecision(5, "because", 2)
    # lazy_reason binds its arguments when the decision is made, and formats inner reasons when read.
    n = 3
    why = lazy_reason("{} of {}: {}", n, 8, lazy_reason("cost {:.1f}", 2.25))
    n = 4
    assert RouteDecision(1, why).reason == "3 of 8: cost 2.2"


def test_the_load_range_follows_its_ends_as_workers_leave_and_reach_them():
    # load_range keeps its two ends: a worker reaching past one moves it; the last worker at an end leaving it makes
    # the table find that end again; a worker leaving an end others still share leaves it where it is.
    ws = [WorkerSnapshot(i, {}, active_requests=n) for i, n in enumerate([3, 5, 5, 9])]
    table = WorkerTable(ws)
    assert table.load_range() == (3, 9)
    table.replace(0, ws[0]._replace(active_requests=1))  # a new low end
    assert table.load_range() == (1, 9)
    table.replace(3, ws[3]._replace(active_requests=12))  # a new high end
    assert table.load_range() == (1, 12)
    table.replace(1, ws[1]._replace(active_requests=4))  # 5 still held by worker 2: no end moves
    assert table.load_range() == (1, 12)
    table.replace(0, ws[0]._replace(active_requests=6))  # the low end's last worker leaves it
    assert table.load_range() == (4, 12)
    table.replace(3, ws[3]._replace(active_requests=0))  # the high end's last worker becomes the low end
    assert table.load_range() == (0, 6)
    table.replace(2, ws[2]._replace(active_requests=20))  # from inside the range to past its high end
    assert table.load_range() == (0, 20)


def test_kv_decides_the_usual_case_over_a_table_in_one_step_and_every_other_case_as_before(monkeypatch):
    # The usual case (a table of 2+ workers, none stale, no pin, nothing excluded, no host tier, no busy thresholds,
    # temperature 0, no imbalance) is decided by ``kv._lowest_on_table`` without the general steps
    # (``common.prelude``, ``kv.choose``); any other case takes them. Either way the decision is the one over a plain
    # list: worker, overlap, kind, reason, and the random draws.
    from components.router.policies import common

    calls = {"prelude": 0, "choose": 0}

    def counting(name, f):
        def wrapped(*a, **k):
            calls[name] += 1
            return f(*a, **k)

        return wrapped

    monkeypatch.setattr(common, "prelude", counting("prelude", common.prelude))
    monkeypatch.setattr(kv, "choose", counting("choose", kv.choose))
    rng = random.Random(12)
    ws = [snapshot(rng, 1000 + 7 * i, ties=False, stale_ones=False) for i in range(40)]
    ws = [w._replace(active_requests=2, metrics_stale_after_s=NOW + 1.0) for w in ws]  # no imbalance, none stale
    overlaps = {ws[3].instance_id: 200, ws[9].instance_id: 100}

    def req(**fields: Any) -> RouteRequest:
        return RouteRequest(list(range(8192)), "m", NOW, block_size=BS, overlap_blocks=overlaps, **fields)

    def check(config: dict[str, Any], r: RouteRequest, fleet: list[WorkerSnapshot], general: int, chose: int = -1):
        calls.update(prelude=0, choose=0)
        over_table = decide("kv", config, r, WorkerTable(fleet), 3)
        assert calls == {"prelude": general, "choose": general if chose < 0 else chose}, config
        assert over_table == decide("kv", config, r, fleet, 3)

    check({}, req(common_overlap_blocks=32), ws, 0)
    check({"decode_weight": 0.0, "successor_weight": 2.0}, req(), ws, 0)
    check({}, req(pinned_instance_id=ws[5].instance_id), ws, 1, 0)  # (the pin wins: choose is not reached)
    check({}, req(excluded_instance_ids=frozenset([ws[3].instance_id])), ws, 1)
    check({}, req(host_overlap_blocks={ws[4].instance_id: 300}), ws, 1)
    check({"active_prefill_tokens_threshold": 4000}, req(), ws, 1)
    check({"router_temperature": 0.5}, req(), ws, 1)
    check({}, req(), [ws[0]._replace(metrics_stale_after_s=NOW - 1.0), *ws[1:]], 1)  # a stale worker
    check({}, req(), [ws[0]._replace(active_requests=0), *ws[1:-1], ws[-1]._replace(active_requests=40)], 1)
    check({}, req(), ws[:1], 1)
