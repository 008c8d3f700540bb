"""The simulator's replay loop on fleets whose answers are known by construction, and the floors it never beats.

Expected times are derived here from the engine's performance model (``MockEngineConfig.step_time_model``, the one
``components.perf`` model): with ``prefill_ms_per_token_sq`` 0 and no prefix caching, a step that computes ``n``
prompt tokens takes ``prefill_ms(n) = base + per_token * n``, and one decoding a sequence of context ``c`` takes
``decode_ms(1, c)``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from components import sim
from components.router import Router
from components.sim import FleetSpec, SimRequest, Workload, replay
from components.sim.workloads import synthetic
from components.workers.simulated import MockEngineConfig

pytestmark = pytest.mark.unit

P = 400  # prompt tokens of every request below
ENGINE = MockEngineConfig(
    prefill_ms_per_token_sq=0.0,
    max_num_batched_tokens=P,  # one prompt per step: requests queue one behind the other
    num_gpu_blocks=1024,
    enable_prefix_caching=False,
)
MODEL = ENGINE.step_time_model


def prompt(tag: int, n: int = P) -> tuple[int, ...]:
    return tuple(10_000 * tag + i for i in range(n))


def test_one_request_alone_takes_its_prefill_then_one_decode_step_per_token():
    res = replay(Workload("w", (SimRequest(0.0, prompt(1), 5),)), FleetSpec(workers=1, engine=ENGINE))
    assert res.ttft_s == [pytest.approx(MODEL.prefill_ms(P) / 1e3, rel=1e-12)]
    # Output token i + 1 (i >= 1) is decoded from token i over the whole context: the prompt and i outputs.
    assert res.itl_s == [pytest.approx(MODEL.decode_ms(1, P + i) / 1e3, rel=1e-12) for i in range(1, 5)]
    assert res.output_tokens == 5 and res.prompt_tokens == P


def test_requests_arriving_together_queue_one_prefill_step_each():
    # Four one-token requests at t = 0 on one worker whose step holds one prompt: request k's prompt is computed in
    # step k + 1, which also samples its only token, so its TTFT is (k + 1) prefill steps.
    n = 4
    w = Workload("w", tuple(SimRequest(0.0, prompt(k), 1) for k in range(n)))
    res = replay(w, FleetSpec(workers=1, engine=ENGINE))
    step_s = MODEL.prefill_ms(P) / 1e3
    assert res.ttft_by_request_s == [pytest.approx((k + 1) * step_s, rel=1e-12) for k in range(n)]
    assert res.last_finish_s == pytest.approx(n * step_s, rel=1e-12)


def test_a_request_arriving_during_a_prefill_waits_out_the_rest_of_that_step():
    step_s = MODEL.prefill_ms(P) / 1e3
    x = 0.3 * step_s
    w = Workload("w", (SimRequest(0.0, prompt(1), 1), SimRequest(x, prompt(2), 1)))
    res = replay(w, FleetSpec(workers=1, engine=ENGINE))
    assert res.ttft_by_request_s == [pytest.approx(step_s, rel=1e-12), pytest.approx(2 * step_s - x, rel=1e-12)]


def test_round_robin_over_two_workers_halves_the_queue():
    # The same four requests on two workers, placed alternately: each worker queues two.
    w = Workload("w", tuple(SimRequest(0.0, prompt(k), 1) for k in range(4)))
    res = replay(w, FleetSpec(workers=2, engine=ENGINE), "round_robin")
    step_s = MODEL.prefill_ms(P) / 1e3
    assert sorted(res.ttft_by_request_s) == pytest.approx([step_s, step_s, 2 * step_s, 2 * step_s], rel=1e-12)


def test_a_remote_prefill_reaches_the_client_after_its_prefill_and_kv_transfer():
    # One prefill + one decode engine, one long prompt (over the decode engine's 1000-token local limit): the
    # prefill engine computes it in chunks of the step budget, then the KV of the whole prompt is transferred;
    # the client's first token comes with the delivery.
    engine = ENGINE.model_copy(update={"max_num_batched_tokens": 2048, "max_model_len": 8192})
    m = engine.step_time_model
    n = 3000
    w = Workload("w", (SimRequest(0.0, prompt(1, n), 2),))
    res = replay(w, FleetSpec(workers=1, engine=engine, prefill=1))
    expected = (m.prefill_ms(2048) + m.prefill_ms(n - 2048)) / 1e3 + res.transfer_s[0]
    assert res.remote == 1 and res.ttft_s == [pytest.approx(expected, rel=1e-12)]
    blocks = -(-n // engine.block_size)
    assert res.transfer_s[0] == pytest.approx(
        engine.kv_transfer_latency_ms / 1e3
        + blocks * engine.kv_bytes_per_block * 8 / (engine.kv_transfer_bandwidth_gbps * 1e9),
        rel=1e-9,
    )


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv"])
@pytest.mark.parametrize("load", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("shape", ["system_prompts", "documents"])
def test_no_request_beats_its_floor_or_its_causal_floor(policy, load, shape):
    # The floors ("no router can do better", docs/router.md) rest on this: every simulated request's TTFT is at
    # least its time alone on an idle worker holding the infinite cache's prefix, and at least the causal version.
    engine = MockEngineConfig(num_gpu_blocks=2048, max_model_len=32768)
    fleet = FleetSpec(workers=3, engine=engine)
    base = synthetic(shape, 80, vocab_size=1000, seed=11)
    w = base.at_rate(load * sim.model_estimate(base, fleet))
    res = sim.simulate(w, policy, fleet, seed=5)
    blocks = sim.PromptBlocks([r.prompt for r in w.requests], engine.block_size)
    floor = sim.ttft_floor_s(w, fleet, blocks.hits_per_prompt())
    causal = sim.causal_ttft_floor_s(w, fleet, blocks.hashes)
    assert len(res.ttft_by_request_s) == len(w.requests)
    for i, t in enumerate(res.ttft_by_request_s):
        assert t >= floor[i] * (1 - 1e-9), (i, t, floor[i])
        assert t >= causal[i] * (1 - 1e-9), (i, t, causal[i])


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_a_policy_that_reads_no_kv_index_decides_the_same_with_the_engines_kv_events(policy, monkeypatch):
    # replay sends the engines' KV events to the router only for a policy that uses its KV index. A router made to
    # index them (and to look every prompt up in the index before the policy chooses) must give the very same run:
    # every field equal, floats included. Documents (8 shared prefixes of ~12k tokens) on 2,048-block caches (32k
    # tokens) make the engines evict, so the index sees removals too.
    engine = MockEngineConfig(num_gpu_blocks=2048, max_model_len=32768)
    fleet = FleetSpec(workers=3, engine=engine)
    base = synthetic("documents", 60, vocab_size=1000, seed=4)
    w = base.at_rate(sim.model_estimate(base, fleet))
    plain = replay(w, fleet, policy, seed=2)
    module = sys.modules["components.sim.replay"]  # the package exports the function under the module's name

    routers: list[Router] = []

    class IndexingRouter(Router):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.uses_kv = True
            routers.append(self)

    monkeypatch.setattr(module, "Router", IndexingRouter)
    indexed = replay(w, fleet, policy, seed=2)
    assert indexed == plain
    assert plain.cached_tokens > 0  # the shared prefixes hit the engines' caches
    index = routers[0].index
    assert index.num_blocks() > 0 and index.stats.num_blocks_removed > 0  # it did index them, evictions too


def test_a_request_with_no_worker_to_go_to_fails_the_run_instead_of_landing_on_worker_0():
    # Issue 28: a decision that found no instance must not be placed on some worker silently. With no worker serving
    # the model the router refuses the decision, and the replay stops with that error.
    from components.router.errors import NoWorkersError

    workload = Workload("one", (SimRequest(0.0, tuple(range(32)), 4),))
    for policy in ("round_robin", "least_loaded", "kv"):
        with pytest.raises(NoWorkersError, match="no workers serve model"):
            replay(workload, FleetSpec(workers=0, engine=MockEngineConfig()), policy, 0)
