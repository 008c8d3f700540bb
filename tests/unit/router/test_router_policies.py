"""Every routing policy as a pure function: rules they share (pins, retries, stale workers) and each one's own branches.

Builders: ``worker(iid, ...)`` makes a snapshot, ``request(...)`` a request; time is ``NOW`` and randomness a seeded
``random.Random`` passed in, so every expected decision below is derived from the inputs in a comment.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from components.router import POLICIES, RouterConfig, RouteRequest, WorkerSnapshot, make_policy
from components.router.policies import autellix, common, kv
from components.router.policies.autellix import AutellixPolicy, AutellixState
from components.router.policies.kv import KvDynamoPolicy, KvPolicy
from components.router.policies.kv_autellix import KvAutellixPolicy
from components.router.policies.least_loaded import LeastLoadedPolicy
from components.router.policies.power_of_two import PowerOfTwoPolicy
from components.router.policies.random_pick import RandomPolicy
from components.router.types import DecisionKind, StepTime

pytestmark = pytest.mark.unit

NOW = 100.0
BS = 16


def worker(iid: int, **fields: Any) -> WorkerSnapshot:
    return WorkerSnapshot(iid, {"model": "m", "block_size": BS}, **fields)


def fresh(iid: int, **fields: Any) -> WorkerSnapshot:
    """A worker whose last load report (0.1 s interval) arrived just now."""
    metrics: dict[str, Any] = {"kv_usage": 0.1, "num_running": 0, "num_waiting": 0, "num_waiting_prefill_tokens": 0}
    return worker(
        iid,
        **(
            metrics
            | {"metrics_received_s": NOW - 0.05, "metrics_interval_s": 0.1, "metrics_stale_after_s": NOW + 0.45}
            | fields
        ),
    )


def stale(iid: int, **fields: Any) -> WorkerSnapshot:
    """A worker whose reports stopped 2 s ago (stale since NOW - 1.5 at a 0.1 s interval)."""
    return fresh(iid, metrics_received_s=NOW - 2.0, metrics_stale_after_s=NOW - 1.5, **fields)


def request(n_tokens: int = 64, **fields: Any) -> RouteRequest:
    fields.setdefault("block_size", BS)
    return RouteRequest(list(range(n_tokens)), "m", NOW, **fields)


def policy(name: str, **config: Any) -> Any:
    return make_policy(RouterConfig(router_policy=name, **config))


def place(p: Any, req: RouteRequest, ws: list[WorkerSnapshot], seed: int = 0, state: Any = None) -> Any:
    decision, _ = p.select(req, ws, p.initial_state() if state is None else state, random.Random(seed))
    return decision


ALL = sorted(POLICIES)


# --- rules every policy shares -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_no_workers_is_a_decision_with_a_reason(name):
    d = place(policy(name), request(), [])
    assert d.instance_id is None and "no workers" in d.reason


@pytest.mark.parametrize("name", ALL)
def test_a_pinned_worker_wins_while_present_and_is_reported_when_gone(name):
    ws = [worker(1), worker(2, active_requests=50), worker(3)]
    d = place(policy(name), request(pinned_instance_id=2), ws)
    assert (d.instance_id, d.reason) == (2, "pinned")  # even though it is the busiest
    d = place(policy(name), request(pinned_instance_id=9), ws)
    assert d.instance_id is not None and "pinned worker gone" in d.reason
    d = place(policy(name), request(pinned_instance_id=2, excluded_instance_ids=frozenset({2})), ws)
    assert d.instance_id in (1, 3) and "pinned worker already tried" in d.reason


@pytest.mark.parametrize("name", ALL)
def test_a_pin_beats_stale_metrics(name):
    # A debugging client asked for this worker: its silence is not the router's call to make.
    d = place(policy(name), request(pinned_instance_id=1), [stale(1), fresh(2)])
    assert d.instance_id == 1


@pytest.mark.parametrize("name", ALL)
def test_workers_already_tried_are_never_chosen(name):
    p = policy(name)
    ws = [worker(1), worker(2), worker(3)]
    chosen = {place(p, request(excluded_instance_ids=frozenset({1, 3})), ws, seed=s).instance_id for s in range(20)}
    assert chosen == {2}
    d = place(p, request(excluded_instance_ids=frozenset({1, 2, 3})), ws)
    assert d.instance_id is None and "already tried" in d.reason


@pytest.mark.parametrize("name", ALL)
def test_a_stale_worker_is_skipped_while_a_fresh_one_remains(name):
    p = policy(name)
    # The stale worker is the idlest and holds the whole prompt: every policy would like it, none may pick it.
    ws = [stale(1), fresh(2, active_requests=3, active_blocks=30), fresh(3, active_requests=3, active_blocks=30)]
    req = request(overlap_blocks={1: 4})
    decisions = [place(p, req, ws, seed=s) for s in range(20)]
    assert {d.instance_id for d in decisions} <= {2, 3}
    assert all("1 stale worker(s) skipped" in d.reason for d in decisions)


@pytest.mark.parametrize("name", ALL)
def test_when_every_worker_is_stale_the_metrics_are_ignored_not_the_workers(name):
    d = place(policy(name), request(), [stale(1), stale(2)])
    assert d.instance_id in (1, 2) and "metrics of all 2 candidates stale" in d.reason


@pytest.mark.parametrize("name", ALL)
def test_unknown_metrics_are_not_stale(name):
    # A worker that has not reported yet (it just registered) gets requests like any other.
    chosen = {place(policy(name), request(), [worker(1), worker(2)], seed=s).instance_id for s in range(30)}
    assert chosen == {1, 2} or name in ("round_robin",)  # round robin from one state always starts at the first


@pytest.mark.parametrize("name", ALL)
def test_same_inputs_and_seed_give_the_same_decisions(name):
    ws = [fresh(i, active_requests=i % 2, num_running=i % 3) for i in range(1, 9)]

    def run(seed: int) -> list[int | None]:
        p, rng = policy(name), random.Random(seed)
        state = p.initial_state()
        out = []
        for k in range(30):
            d, state = p.select(request(64 + 2100 * (k % 2), program_id=f"p{k % 3}"), ws, state, rng)
            out.append(d.instance_id)
        return out

    assert run(7) == run(7)


def test_ties_break_uniformly_with_the_given_rng():
    # 4 tied values, 4000 draws: each index ~1000 (binomial sd ~27); 850 is more than 5 sd away.
    rng = random.Random(3)
    counts = Counter(common.pick_min([2.0, 1.0, 1.0, 5.0, 1.0, 1.0], rng)[0] for _ in range(4000))
    assert set(counts) == {1, 2, 4, 5} and min(counts.values()) > 850
    assert common.pick_min([3.0, 1.0, 2.0], rng) == (1, 1)


# --- random ---------------------------------------------------------------------------------------------------------


def test_random_spreads_uniformly_and_replays_with_the_same_seed():
    p = RandomPolicy()
    ws = [worker(i) for i in (1, 2, 3, 4)]
    rng = random.Random(11)
    counts = Counter(p.select(request(), ws, None, rng)[0].instance_id for _ in range(4000))
    assert set(counts) == {1, 2, 3, 4} and min(counts.values()) > 850  # ~1000 each, sd ~27
    a = [p.select(request(), ws, None, r)[0].instance_id for r in [random.Random(5)] * 10]
    b = [p.select(request(), ws, None, r)[0].instance_id for r in [random.Random(5)] * 10]
    assert a == b


# --- power of two ---------------------------------------------------------------------------------------------------


def test_power_of_two_takes_the_less_loaded_of_the_pair_by_reported_load():
    p = PowerOfTwoPolicy()
    # Two workers: every pair is {1, 2}. Worker 2 reports 1 running + 0 waiting, worker 1 reports 4 + 2.
    ws = [fresh(1, num_running=4, num_waiting=2), fresh(2, num_running=1, num_waiting=0, active_requests=9)]
    decisions = [place(p, request(), ws, seed=s) for s in range(20)]
    assert {d.instance_id for d in decisions} == {2}  # by what the workers report, not by this router's 9
    assert all("running + waiting reported" in d.reason for d in decisions)


def test_power_of_two_compares_by_own_counts_when_one_report_is_missing():
    p = PowerOfTwoPolicy()
    # Worker 1 never reported; worker 2 reports an idle engine but this router has 5 requests on it. Comparing 2's
    # report (0) against 1's missing one would favour 2 blindly; both are compared by routed counts: 0 vs 5.
    ws = [worker(1, active_requests=0), fresh(2, num_running=0, num_waiting=0, active_requests=5)]
    decisions = [place(p, request(), ws, seed=s) for s in range(20)]
    assert {d.instance_id for d in decisions} == {1}
    assert all("a report is missing or stale" in d.reason for d in decisions)


def test_power_of_two_with_one_candidate_takes_it():
    d = place(PowerOfTwoPolicy(), request(excluded_instance_ids=frozenset({1})), [worker(1), worker(2)])
    assert d.instance_id == 2 and "only candidate" in d.reason


# --- least loaded ---------------------------------------------------------------------------------------------------


def test_least_loaded_counts_requests_or_prompt_tokens_as_configured():
    # Worker 1: two short chats (2 requests, 200 tokens); worker 2: one 30k-token document (1 request).
    ws = [
        worker(1, active_requests=2, active_prompt_tokens=200),
        worker(2, active_requests=1, active_prompt_tokens=30000),
    ]
    by_requests = place(LeastLoadedPolicy(RouterConfig(least_loaded_metric="requests")), request(), ws)
    by_tokens = place(LeastLoadedPolicy(RouterConfig(least_loaded_metric="tokens")), request(), ws)
    assert (by_requests.instance_id, by_tokens.instance_id) == (2, 1)
    assert "1 requests in flight" in by_requests.reason and "200 tokens in flight" in by_tokens.reason


def test_least_loaded_breaks_ties_at_random_so_idle_workers_share():
    p = LeastLoadedPolicy()
    ws = [worker(1), worker(2), worker(3, active_requests=1)]
    counts = Counter(place(p, request(), ws, seed=s).instance_id for s in range(400))
    assert set(counts) == {1, 2} and min(counts.values()) > 150  # ~200 each, sd 10
    assert "2 tied" in place(p, request(), ws).reason


def test_least_used_alias_is_least_loaded():
    assert make_policy("least_used").name == "least_loaded"
    assert make_policy("kv_autellix").name == "kv+autellix"
    assert make_policy("round-robin").name == "round_robin"


# --- kv: predicted time to first token -------------------------------------------------------------------------------

STEP = StepTime()  # the default step-time model (an 8B model on an H100)


def timed(iid: int, queued: int = 0, step: StepTime = STEP, decoding: int = 0, kv_tokens: int = 0, **f: Any) -> Any:
    """A worker as the router derives it: queued prefill tokens, the prefill rate at its decode batch, the decode step
    a new request would share, the part of a step in progress a new prompt waits out (half its fixed cost)."""
    return worker(
        iid,
        queued_prefill_tokens=queued,
        prefill_ms_per_token=step.prefill_ms_per_prompt_token(decoding, kv_tokens),
        decode_step_ms=step.decode_ms(decoding + 1, kv_tokens),
        step_residual_ms=0.5 * step.prefill_base_ms,
        **f,
    )


def test_kv_a_cached_prefix_wins_over_a_slightly_lighter_worker_and_loses_to_a_much_lighter_one():
    # 4096-token prompt; worker 1 caches 2048 of it. Between workers of one speed the cached one wins exactly while its
    # queue is shorter than its cache advantage counted twice (this request's prefill and the delay it adds to the next
    # one there, successor_weight 1): cost_1 = m * (q1 + 2 * (4096 - 2048)) vs cost_2 = m * (q2 + 2 * 4096).
    req = request(4096, overlap_blocks={1: 2048 // BS})
    slightly = [timed(1, queued=3000), timed(2, queued=2000)]  # 1000 more queued, 2048 fewer to compute
    d = place(KvPolicy(), req, slightly)
    assert (d.instance_id, d.kind) == (1, DecisionKind.CACHE_HIT)
    much = [timed(1, queued=6600), timed(2, queued=2000)]  # 4600 more queued: the cache no longer pays
    d = place(KvPolicy(), req, much)
    assert (d.instance_id, d.kind) == (2, DecisionKind.LOAD)


@pytest.mark.parametrize("successor_weight", [0.0, 1.0])
@pytest.mark.parametrize("decoding", [0, 64])
def test_kv_switches_where_the_predicted_times_cross(decoding, successor_weight):
    # Worker 1 caches c tokens and is slowed by `decoding` sequences; worker 2 is idle. With s = 1 + successor_weight
    # the crossover queue on worker 1 is where m1 * (q + s * (P - c)) + r + d1 = m2 * s * P + d2 (successor_weight 0:
    # this request's predicted TTFT alone; r = half a prefill step's fixed cost, 8.25 ms, which a queue of any length
    # adds: the step in progress), derived here from the step-time model, not read off the policy.
    P, c = 8192, 4096
    s = 1.0 + successor_weight
    m1 = STEP.prefill_ms_per_prompt_token(decoding, decoding * 2048)
    m2 = STEP.prefill_ms_per_prompt_token(0, 0)
    d1, d2 = STEP.decode_ms(decoding + 1, decoding * 2048), STEP.decode_ms(1, 0)
    r = 0.5 * STEP.prefill_base_ms
    crossover = (m2 * s * P + d2 - d1 - r) / m1 - s * (P - c)
    assert 0 < crossover <= s * c  # decode load makes worker 1 slower: it wins only for queues shorter than s * c
    req = request(P, overlap_blocks={1: c // BS})
    policy = KvPolicy(RouterConfig(successor_weight=successor_weight))

    def chosen(q: int) -> int:
        ws = [timed(1, queued=q, decoding=decoding, kv_tokens=decoding * 2048), timed(2)]
        return int(place(policy, req, ws).instance_id)

    assert chosen(int(crossover) - 16) == 1
    assert chosen(int(crossover) + 16) == 2


def test_kv_a_queue_costs_the_rest_of_the_step_in_progress_so_a_short_cached_prefix_waits_less_on_an_idle_worker():
    # The short-system-prompt case (docs/router.md): a 1,000-token prompt whose first 600 tokens worker 1 caches; worker
    # 1 has prefill queued (a step in progress), worker 2 none. Worker 1's cost is m * (q + 2 * 400) + r, worker 2's
    # m * 2 * 1000, with r = 8.25 ms (half the 16.5 ms fixed cost of a prefill step): the crossover is at
    # q = 1200 - r / m = 800 tokens, where the per-token rate alone (r = 0) put it at 1,200.
    m = STEP.prefill_ms_per_prompt_token(0, 0)
    r = 0.5 * STEP.prefill_base_ms
    crossover = 2 * 1000 - 2 * 400 - r / m
    assert 790 < crossover < 810
    req = request(1000, overlap_blocks={1: 600 // BS})  # 37 blocks = 592 tokens
    crossover -= 2 * (600 - 592)  # whole blocks only: 8 more tokens to compute on worker 1, counted twice

    def chosen(q: int) -> int:
        return int(place(KvPolicy(), req, [timed(1, queued=q), timed(2)]).instance_id)

    assert chosen(int(crossover) - 8) == 1
    assert chosen(int(crossover) + 8) == 2
    assert chosen(1000) == 2  # between the two crossovers: the rate alone would have sent it to the busy holder


def test_kv_a_faster_engine_gets_the_request_at_equal_queues():
    fast = StepTime(prefill_ms_per_token=0.5 * STEP.prefill_ms_per_token, prefill_base_ms=8.0)
    assert place(KvPolicy(), request(2048), [timed(1, queued=1000), timed(2, queued=1000, step=fast)]).instance_id == 2


def test_kv_decode_weight_breaks_equal_ttfts_by_the_lighter_decode_batch():
    # Same queue and cache; worker 1 decodes 100 sequences (a slower step), worker 2 none. With decode_weight 0 and
    # equal prefill rates the two would tie; the decode term sends the request to the lighter batch.
    same_rate = STEP.prefill_ms_per_prompt_token(0, 0)
    heavy = worker(1, prefill_ms_per_token=same_rate, decode_step_ms=STEP.decode_ms(101, 400_000))
    light = worker(2, prefill_ms_per_token=same_rate, decode_step_ms=STEP.decode_ms(1, 0))
    assert place(KvPolicy(), request(1024), [heavy, light]).instance_id == 2
    ties = {
        place(KvPolicy(RouterConfig(decode_weight=0)), request(1024), [heavy, light], seed=s).instance_id
        for s in range(20)
    }
    assert ties == {1, 2}


def test_kv_with_a_common_prefix_decides_as_with_every_overlap_listed_and_by_time():
    ws = [timed(i, queued=(i * 700) % 3000) for i in range(1, 41)]
    deep = {4: 90, 17: 60, 30: 33}
    for listed in (deep, {**deep, **{i: 40 for i in range(5, 12)}}):
        everyone = {i: listed.get(i, 32) for i in range(1, 41)}
        a = place(KvPolicy(), request(2048, overlap_blocks=everyone), ws)
        b = place(KvPolicy(), request(2048, overlap_blocks=listed, common_overlap_blocks=32), ws)
        assert (a.instance_id, a.overlap_blocks, a.reason) == (b.instance_id, b.overlap_blocks, b.reason)
        # The expected worker, from the formula: the fewest queued + 2 x uncached tokens (all workers run at one speed;
        # successor_weight 1 counts the uncached prefill for this request and the next one there).
        # A worker with any prefill queued waits out half of the step in progress too (r ms = r / m tokens' worth).
        r_tokens = 0.5 * STEP.prefill_base_ms / STEP.prefill_ms_per_prompt_token(0, 0)
        want = min(
            range(1, 41),
            key=lambda i: ((i * 700) % 3000 + (r_tokens if (i * 700) % 3000 else 0) + 2 * (2048 - everyone[i] * BS), i),
        )
        assert a.instance_id == want


def test_kv_cost_in_dynamo_units_ignores_a_cache_at_high_load_where_kv_keeps_it():
    # The failure: at high load every worker holds many decoding requests. Worker 1 caches 6k of an 8k prompt
    # and has 40 requests decoding (their prompts: 40 * 512 blocks), worker 2 has 30; neither has prefill queued.
    # Dynamo's cost counts the decoding requests' blocks against the prefix, so worker 2 wins and the cache is
    # wasted; kv counts what actually delays the first token.
    req = request(8192, overlap_blocks={1: 6144 // BS})
    ws = [
        timed(1, decoding=40, kv_tokens=40 * 8192, active_blocks=40 * 512, active_requests=40),
        timed(2, decoding=30, kv_tokens=30 * 8192, active_blocks=30 * 512, active_requests=30),
    ]
    assert place(KvDynamoPolicy(), req, ws).instance_id == 2
    d = place(KvPolicy(), req, ws)
    assert (d.instance_id, d.kind) == (1, DecisionKind.CACHE_HIT)


# --- kv_dynamo: Dynamo's cost, the named alternative ------------------------------------------------------------------


def test_kv_dynamo_prefers_the_worker_that_caches_the_prefix():
    # 256 tokens = 16 blocks. Worker 2 caches 12: cost 1 * (16 - 12) + 0 = 4; workers 1 and 3: 16.
    ws = [worker(1), worker(2), worker(3)]
    d = place(KvDynamoPolicy(), request(256, overlap_blocks={2: 12}), ws)
    assert (d.instance_id, d.overlap_blocks) == (2, 12)
    assert d.reason.startswith("kv: 12/16 blocks cached, cost 4.0")


def test_kv_dynamo_cost_weighs_saved_prefill_against_decode_load():
    # Worker 2 caches 12 of 16 blocks but holds 20 active blocks: cost 4 + 20 = 24 > worker 1's 16 + 0.
    ws = [worker(1), worker(2, active_blocks=20)]
    assert place(KvDynamoPolicy(), request(256, overlap_blocks={2: 12}), ws).instance_id == 1
    # With overlap_weight 3 the saved prefill counts triple: worker 2 = 3 * 4 + 20 = 32 < worker 1's 3 * 16 = 48.
    assert (
        place(KvDynamoPolicy(RouterConfig(overlap_weight=3)), request(256, overlap_blocks={2: 12}), ws).instance_id == 2
    )
    # overlap_weight 0: load alone (0 vs 20 active blocks).
    assert (
        place(KvDynamoPolicy(RouterConfig(overlap_weight=0)), request(256, overlap_blocks={2: 12}), ws).instance_id == 1
    )


def test_kv_dynamo_counts_prefill_queued_ahead_on_each_worker():
    # No overlap anywhere; worker 1 has 320 prompt tokens still to prefill (20 blocks): 16 + 20 = 36 vs 16 + 4 = 20.
    ws = [worker(1, active_prefill_tokens=320), worker(2, active_blocks=4)]
    assert place(KvDynamoPolicy(), request(256), ws).instance_id == 2


def test_kv_dynamo_with_many_holders_uses_the_same_costs():
    # Every worker holds some of the prefix (the per-candidate lookup path): 10 blocks on worker 4 wins.
    ws = [worker(i) for i in range(1, 9)]
    overlaps = {i: (10 if i == 4 else 3) for i in range(1, 9)}
    d = place(KvDynamoPolicy(), request(256, overlap_blocks=overlaps), ws)
    assert (d.instance_id, d.overlap_blocks) == (4, 10) and "cost 6.0" in d.reason


def test_kv_dynamo_with_a_common_prefix_decides_as_with_every_overlap_listed():
    # Every worker caches a 32-block system prompt (common_overlap_blocks) and only those caching more are listed:
    # the same decision, costs and reported overlaps as with all of them listed, for the lookup and the bisect path.
    ws = [worker(i, active_blocks=(i * 7) % 5) for i in range(1, 41)]
    deep = {4: 90, 17: 60, 30: 33}
    full = {i: deep.get(i, 32) for i in range(1, 41)}
    for listed in (deep, {**deep, **{i: 40 for i in range(5, 12)}}):
        everyone = {i: listed.get(i, 32) for i in range(1, 41)}
        a = place(KvDynamoPolicy(), request(2048, overlap_blocks=everyone), ws)
        b = place(KvDynamoPolicy(), request(2048, overlap_blocks=listed, common_overlap_blocks=32), ws)
        assert (a.instance_id, a.overlap_blocks, a.reason) == (b.instance_id, b.overlap_blocks, b.reason)
    req = request(2048, overlap_blocks=deep, common_overlap_blocks=32)
    assert [req.overlap_of(i) for i in (4, 5)] == [90, 32] and full[5] == 32
    # Worker 4 has 90 of 128 blocks: 128 - 90 + 3 active blocks = 41, the lowest.
    assert place(KvDynamoPolicy(), req, ws).instance_id == 4
    # A pin or Autellix reports the common overlap of a worker that is not listed.
    assert (
        place(
            KvDynamoPolicy(), request(2048, overlap_blocks=deep, common_overlap_blocks=32, pinned_instance_id=5), ws
        ).overlap_blocks
        == 32
    )


def test_kv_dynamo_without_a_block_size_counts_default_blocks():
    d = place(KvDynamoPolicy(), request(256, block_size=0, overlap_blocks={1: 16}), [worker(1), worker(2)])
    assert d.instance_id == 1 and kv.DEFAULT_BLOCK_SIZE == 16 and "cost 0.0" in d.reason


def test_kv_temperature_zero_is_deterministic_and_ties_follow_the_seed():
    ws = [worker(i) for i in range(1, 5)]  # equal costs everywhere: a four-way tie
    p = KvPolicy()
    assert [place(p, request(), ws, seed=9).instance_id for _ in range(5)] == [
        place(p, request(), ws, seed=9).instance_id
    ] * 5
    spread = Counter(place(p, request(), ws, seed=s).instance_id for s in range(400))
    assert set(spread) == {1, 2, 3, 4} and min(spread.values()) > 60  # ~100 each, sd ~9
    assert "4 tied" in place(p, request(), ws).reason


def test_kv_temperature_samples_from_a_softmax_over_normalised_costs():
    # Costs 16 (worker 1) and 4 (worker 2, 12 blocks cached) normalise to 1 and 0: at T = 1 worker 1 has odds
    # e^-1 : 1, i.e. probability e^-1 / (1 + e^-1) = 0.269. 4000 draws: sd 0.007, so +-0.03 is > 4 sd.
    p = KvPolicy(RouterConfig(router_temperature=1.0))
    ws = [worker(1), worker(2)]
    rng = random.Random(1)
    picks = Counter(p.select(request(256, overlap_blocks={2: 12}), ws, None, rng)[0].instance_id for _ in range(4000))
    assert picks[1] / 4000 == pytest.approx(math.exp(-1) / (1 + math.exp(-1)), abs=0.03)
    # A low temperature is nearly greedy: e^-10 = 4.5e-5.
    cold = KvPolicy(RouterConfig(router_temperature=0.1))
    picks = Counter(
        cold.select(request(256, overlap_blocks={2: 12}), ws, None, rng)[0].instance_id for _ in range(2000)
    )
    assert picks[2] >= 1995
    # Equal costs: uniform.
    even = Counter(p.select(request(256), ws, None, rng)[0].instance_id for _ in range(2000))
    assert min(even.values()) > 900


def test_kv_skips_busy_workers_by_kv_usage_and_waiting_prefill():
    cfg = RouterConfig(active_decode_blocks_threshold=0.9, active_prefill_tokens_threshold=4096)
    p = KvPolicy(cfg)
    # Worker 1 caches everything but its KV cache is 95% full: skipped for worker 2.
    ws = [fresh(1, kv_usage=0.95), fresh(2, kv_usage=0.5)]
    d = place(p, request(256, overlap_blocks={1: 16}), ws)
    assert d.instance_id == 2 and "1 busy worker(s) skipped" in d.reason
    # By waiting prompt tokens instead.
    ws = [fresh(1, num_waiting_prefill_tokens=5000), fresh(2)]
    assert place(p, request(256, overlap_blocks={1: 16}), ws).instance_id == 2
    # Every worker busy: the request still goes somewhere, by cost.
    ws = [fresh(1, kv_usage=0.95), fresh(2, kv_usage=0.99)]
    d = place(p, request(256, overlap_blocks={1: 16}), ws)
    assert d.instance_id == 1 and "all 2 candidates busy" in d.reason
    # Unknown metrics are not busy.
    assert place(p, request(256, overlap_blocks={1: 16}), [worker(1), fresh(2)]).instance_id == 1
    # Thresholds unset (the default): kv usage is not looked at.
    assert place(KvPolicy(), request(256, overlap_blocks={1: 16}), [fresh(1, kv_usage=1.0), fresh(2)]).instance_id == 1


def test_kv_imbalance_override_needs_both_the_absolute_and_the_relative_gap():
    p = KvPolicy(RouterConfig(balance_abs_threshold=32, balance_rel_threshold=1.5))
    req = request(4096, overlap_blocks={1: 256})  # worker 1 caches the whole 256-block prompt
    # 40 vs 2 in flight: gap 38 > 32 and 40 > 1.5 * 2 -> least loaded (worker 2), overlap ignored.
    d = place(p, req, [worker(1, active_requests=40), worker(2, active_requests=2)])
    assert d.instance_id == 2 and d.reason.startswith("kv imbalance override: 40 vs 2")
    # Gap exactly 32: not more than the threshold -> cost decides (worker 1: 0 prefill blocks).
    assert place(p, req, [worker(1, active_requests=34), worker(2, active_requests=2)]).instance_id == 1
    # 100 vs 67: gap 33 > 32 but 100 < 1.5 * 67 = 100.5 -> no override.
    assert place(p, req, [worker(1, active_requests=100), worker(2, active_requests=67)]).instance_id == 1
    # 101 vs 67: both hold.
    assert place(p, req, [worker(1, active_requests=101), worker(2, active_requests=67)]).instance_id == 2


def test_kv_a_shared_system_prompt_cannot_herd_everything_onto_one_worker():
    """200 requests that all share a 4k-token prefix cached only on worker 1, each staying in flight.

    Each placed request is counted as a request in flight but adds no blocks, so the cost's own load term never
    pushes back (worker 1 always costs 256 blocks less): only the override can stop the herd."""

    def run(cfg: RouterConfig) -> Counter[int]:
        p, rng = KvPolicy(cfg), random.Random(0)
        load = Counter({1: 0, 2: 0, 3: 0, 4: 0})
        for _ in range(200):
            ws = [worker(i, active_requests=load[i]) for i in (1, 2, 3, 4)]
            d, _ = p.select(request(4096, overlap_blocks={1: 256}), ws, None, rng)
            load[d.instance_id] += 1
        return load

    herded = run(RouterConfig(balance_abs_threshold=10**6))
    assert herded[1] == 200  # cost alone: the shared prefix wins every time
    capped = run(RouterConfig(balance_abs_threshold=32, balance_rel_threshold=1.5))
    assert max(capped.values()) - min(capped.values()) <= 33  # never more than the threshold + the one just placed
    assert capped[1] < 200 and min(capped.values()) > 0


# --- autellix -------------------------------------------------------------------------------------------------------


def autellix_run(p: Any, reqs: list[RouteRequest], ws: list[WorkerSnapshot], state: Any = None, seed: int = 0):
    rng = random.Random(seed)
    state = p.initial_state() if state is None else state
    out = []
    for r in reqs:
        d, state = p.select(r, ws, state, rng)
        out.append(d)
    return out, state


def test_autellix_2048_tokens_go_to_the_least_used_2049_to_the_programs_worker():
    p = AutellixPolicy()  # locality_threshold_tokens = 2048
    ws = [worker(1, active_requests=3), worker(2, active_requests=0), worker(3, active_requests=1)]
    (small,), state = autellix_run(p, [request(2048, program_id="agent")], ws)
    assert small.instance_id == 2 and "2048 <= 2048 tokens" in small.reason
    assert state.programs == {} and state.stats.num_small == 1
    # 2049 tokens: the program's first long request is placed on the least used (2) and remembered.
    (large,), state = autellix_run(p, [request(2049, program_id="agent")], ws, state)
    assert large.instance_id == 2 and "assigned" in large.reason
    assert state.programs["agent"].instance_id == 2 and state.stats.num_assigns == 1
    # Worker 2 is now the busiest; the program's next long request still goes there (locality), a short one not.
    ws = [worker(1, active_requests=3), worker(2, active_requests=9), worker(3, active_requests=1)]
    (hit, short), state = autellix_run(
        p, [request(5000, program_id="agent"), request(100, program_id="agent")], ws, state
    )
    assert hit.instance_id == 2 and "locality hit" in hit.reason
    assert short.instance_id == 3
    s = state.stats
    assert (s.num_small, s.num_large, s.num_locality_hits, s.num_assigns) == (2, 2, 1, 1)


def test_autellix_threshold_is_configurable():
    p = AutellixPolicy(RouterConfig(locality_threshold_tokens=100))
    _, state = autellix_run(p, [request(101, program_id="x")], [worker(1), worker(2)])
    assert state.stats.num_large == 1 and "x" in state.programs


def test_autellix_long_requests_without_a_program_are_not_remembered():
    (d,), state = autellix_run(AutellixPolicy(), [request(4000)], [worker(1, active_requests=1), worker(2)])
    assert d.instance_id == 2 and "no program id" in d.reason
    assert state.programs == {} and state.stats.num_unaffiliated == 1


def test_autellix_a_removed_engines_programs_are_reassigned_on_their_next_request():
    p = AutellixPolicy()
    ws = [worker(1), worker(2, active_requests=5)]
    (d,), state = autellix_run(p, [request(3000, program_id="a")], ws)
    assert d.instance_id == 1
    # Worker 1 leaves; worker 3 joins idle. The program's next long request is reassigned to the least used.
    ws = [worker(2, active_requests=5), worker(3)]
    (d,), state = autellix_run(p, [request(3000, program_id="a")], ws, state)
    assert d.instance_id == 3 and "reassigned from worker 1" in d.reason
    assert state.programs["a"].instance_id == 3 and state.stats.num_reassigns == 1
    # A program whose worker went stale, or failed this request (a retry), is reassigned the same way.
    ws = [stale(3), fresh(2, active_requests=5), fresh(4)]
    (d,), state = autellix_run(p, [request(3000, program_id="a")], ws, state)
    assert d.instance_id == 4 and state.stats.num_reassigns == 2
    ws = [worker(2, active_requests=5), worker(4)]
    (d,), state = autellix_run(p, [request(3000, program_id="a", excluded_instance_ids=frozenset({4}))], ws, state)
    assert d.instance_id == 2 and state.stats.num_reassigns == 3


def test_autellix_assignments_expire_after_the_ttl():
    p = AutellixPolicy(RouterConfig(program_ttl_s=60))
    ws = [worker(1), worker(2)]

    def at(t: float, pid: str = "a") -> RouteRequest:
        return RouteRequest(list(range(3000)), "m", t, program_id=pid, block_size=BS)

    (d,), state = autellix_run(p, [at(0.0)], ws)
    home = d.instance_id
    # Still within the TTL at 59 s: a hit.
    (d,), state = autellix_run(p, [at(59.0)], ws, state)
    assert d.instance_id == home and state.stats.num_locality_hits == 1
    # 59 s > 60/8: the hit refreshed the assignment's time, so at 118 s (59 s later) it is still alive.
    assert state.programs["a"].last_used_s == 59.0
    (d,), state = autellix_run(p, [at(118.0)], ws, state)
    assert state.stats.num_locality_hits == 2
    # 61 s after its last use it has expired: placed afresh (an assignment, not a hit).
    (d,), state = autellix_run(p, [at(179.5)], ws, state)
    assert state.stats.num_expired == 1 and state.stats.num_assigns == 2 and state.stats.num_locality_hits == 2


def test_autellix_sweeps_expired_programs_once_per_ttl():
    p = AutellixPolicy(RouterConfig(program_ttl_s=10))
    ws = [worker(1), worker(2)]
    reqs = [RouteRequest(list(range(3000)), "m", float(i), program_id=f"p{i}", block_size=BS) for i in range(5)]
    _, state = autellix_run(p, reqs, ws)
    assert len(state.programs) == 5
    # 30 s later one short request (any program) triggers the sweep: all five were idle for over 10 s.
    _, state = autellix_run(p, [RouteRequest([1], "m", 30.0, block_size=BS)], ws, state)
    assert state.programs == {} and state.stats.num_expired == 5


def test_autellix_hits_do_not_copy_the_program_table():
    p = AutellixPolicy(RouterConfig(program_ttl_s=800))
    ws = [worker(1), worker(2)]
    _, state = autellix_run(p, [request(3000, program_id="a")], ws)
    table = state.programs
    # NOW + 50 s is under 800/8 = 100 s since the assignment: no refresh, same table object.
    later = RouteRequest(list(range(3000)), "m", NOW + 50, program_id="a", block_size=BS)
    _, state2 = autellix_run(p, [later], ws, state)
    assert state2.programs is table and state2.stats.num_locality_hits == 1


def test_autellix_never_mutates_the_state_it_is_given():
    p = AutellixPolicy()
    ws = [worker(1), worker(2)]
    _, s1 = autellix_run(p, [request(3000, program_id="a")], ws)
    before = (dict(s1.programs), s1.stats)
    _, s2 = autellix_run(p, [request(3000, program_id="b"), request(3000, program_id="a", ends_program=True)], ws, s1)
    assert (dict(s1.programs), s1.stats) == before
    assert set(s2.programs) == {"b"}


def test_autellix_forgets_a_program_when_it_ends():
    p = AutellixPolicy()
    ws = [worker(1), worker(2)]
    (d,), state = autellix_run(p, [request(3000, program_id="a", ends_program=True)], ws)
    assert d.instance_id in (1, 2) and state.programs == {} and state.stats.num_ended == 1
    _, state = autellix_run(p, [request(3000, program_id="b")], ws, state)
    state = autellix.end_program(state, "b")
    assert state.programs == {} and state.stats.num_ended == 2
    assert autellix.end_program(state, "unknown") is state


# --- kv+autellix ----------------------------------------------------------------------------------------------------


def test_kv_autellix_places_by_kv_cost_and_keeps_long_programs_home():
    p = KvAutellixPolicy()
    # Worker 1 caches a shared 2k-token prefix (128 blocks); worker 2 is idle and caches nothing.
    ws = [worker(1, active_requests=2), worker(2)]
    short = request(1024, program_id="a", overlap_blocks={1: 64})
    first_long = request(4096, program_id="a", overlap_blocks={1: 128})
    (d_short, d_long), state = autellix_run(p, [short, first_long], ws)
    # Autellix alone would pick the least used (2) for both; kv picks the cached prefix (no blocks in flight):
    # short: worker 1 = 64 - 64 = 0 < worker 2 = 64. long: worker 1 = 256 - 128 = 128 < worker 2 = 256.
    assert (d_short.instance_id, d_long.instance_id) == (1, 1)
    assert "kv:" in d_short.reason and "assigned, kv:" in d_long.reason
    # Now worker 2 caches more of the program's context, but the program stays home (locality hit).
    later = request(6000, program_id="a", overlap_blocks={2: 300, 1: 128})
    (d,), state = autellix_run(p, [later], ws, state)
    assert d.instance_id == 1 and "locality hit" in d.reason and d.overlap_blocks == 128
    assert autellix_run(AutellixPolicy(), [short], ws)[0][0].instance_id == 2


def test_kv_autellix_state_is_autellix_state():
    p = KvAutellixPolicy()
    assert isinstance(p.initial_state(), AutellixState)
    assert p.end_program(p.initial_state(), "x") == AutellixState()


# --- kv with host-memory tiers ---------------------------------------------------------------------------------------


def test_kv_a_host_tier_hit_costs_its_load_not_a_prefill_and_the_crossovers_follow():
    # 8192-token prompt. Worker 1 caches 4096 tokens on its device; worker 2 holds the whole prompt but 256 tokens in
    # its host tier only (it loads 8191 - 256 at l ms a token); worker 3 holds nothing. Same speed m, successor weight
    # 1 (s = 2): cost_i = m * q_i + (r if q_i else 0) + s * (m * uncached_i + l * loaded_i) + decode, with r half a
    # prefill step's fixed cost (the step in progress that a queue makes a new prompt wait out).
    P = 8192
    m = STEP.prefill_ms_per_prompt_token(0, 0)
    load = STEP.host_load_ms_per_token
    req = request(P, overlap_blocks={1: 4096 // BS, 2: 256 // BS}, host_overlap_blocks={2: P // BS})
    # Worker 2: uncached = 1 (the last token is computed), loaded = 8191 - 256. Worker 1: uncached 4096, none loaded.
    r = 0.5 * STEP.prefill_base_ms
    cost2 = lambda q: m * q + (r if q else 0.0) + 2 * (m * 1 + load * (P - 1 - 256))  # noqa: E731
    cost1 = lambda q: m * q + (r if q else 0.0) + 2 * (m * 4096)  # noqa: E731
    assert load < m / 4  # a load is far cheaper than computing
    d = place(KvPolicy(), req, [timed(1), timed(2), timed(3)])
    assert (d.instance_id, d.overlap_blocks, d.host_overlap_blocks, d.kind) == (2, 16, P // BS - 16,
                                                                                   DecisionKind.CACHE_HIT)  # fmt: skip
    assert "more in host memory" in d.reason
    # Worker 2's queue where it stops paying: cost2(q) = cost1(0), derived here from the costs, not the policy.
    q_cross = (cost1(0) - cost2(0) - r) / m
    assert place(KvPolicy(), req, [timed(1), timed(2, queued=int(q_cross) - 8), timed(3)]).instance_id == 2
    assert place(KvPolicy(), req, [timed(1), timed(2, queued=int(q_cross) + 8), timed(3)]).instance_id == 1
    # kv_dynamo counts device blocks only: worker 1 (256 device blocks) wins there, and no host load is predicted.
    d = place(KvDynamoPolicy(), req, [timed(1), timed(2), timed(3)])
    assert (d.instance_id, d.host_overlap_blocks) == (1, 0)


def test_kv_with_host_tiers_decides_over_a_table_as_over_a_list_and_by_the_formula():
    rng = random.Random(5)
    ws = [timed(i, queued=rng.randrange(6000)) for i in range(1, 65)]
    P = 4096
    dev = {i: rng.randrange(40, 200) for i in rng.sample(range(1, 65), 5)}
    host = {i: rng.randrange(100, 256) for i in rng.sample(range(1, 65), 5)}
    req = request(P, overlap_blocks=dev, common_overlap_blocks=32, host_overlap_blocks=host,
                  common_host_overlap_blocks=48)  # fmt: skip
    m, load = STEP.prefill_ms_per_prompt_token(0, 0), STEP.host_load_ms_per_token

    def cost(w: WorkerSnapshot) -> float:
        d, h = dev.get(w.instance_id, 32) * BS, host.get(w.instance_id, 48) * BS
        held = max(d, h)
        q = w.queued_prefill_tokens
        r = 0.5 * STEP.prefill_base_ms if q else 0.0  # the step in progress a queue makes it wait out (half)
        return m * q + r + 2 * (m * max(1, P - held) + load * max(0, min(held, P - 1) - d))

    want = min(ws, key=cost).instance_id
    from components.router.types import WorkerTable

    a = place(KvPolicy(), req, ws)
    b = place(KvPolicy(), req, WorkerTable(ws))
    assert a.instance_id == b.instance_id == want and a.reason == b.reason
    assert a.host_overlap_blocks == max(0, host.get(want, 48) - dev.get(want, 32))
