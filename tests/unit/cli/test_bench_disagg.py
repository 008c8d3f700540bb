"""The disaggregated-fleet simulator of ``kvmesh bench disagg``, on tiny workloads whose answers are known by
construction: where each prompt is prefilled, what the prefill queue does, what a decode batch waits for."""

from __future__ import annotations

import pytest

from components import sim
from components.cli.bench.disagg import DisaggSpec, compare, simulate_fleet
from components.protocol.messages import GenerateRequest, SamplingParams
from components.sim import NO_ROOM, FleetSpec, SimRequest, Workload
from components.sim.workloads import from_trace, synthetic
from components.workers.simulated import MockEngineConfig, VirtualEngine

pytestmark = pytest.mark.unit

ENGINE = MockEngineConfig(num_gpu_blocks=4096, max_model_len=16384)


def prompt(tag: int, n: int) -> tuple[int, ...]:
    """``n`` (< 20,000) token ids no other tag (0 to 5) shares: no prefix-cache hit between tags."""
    return tuple(20_000 * tag + k for k in range(n))


def workload(*reqs: tuple[float, tuple[int, ...], int]) -> Workload:
    return Workload("t", tuple(SimRequest(t, p, m) for t, p, m in reqs))


def prefill_s(n: int, c: MockEngineConfig = ENGINE) -> float:
    """One step that prefills ``n`` tokens (n <= max_num_batched_tokens) and decodes nothing."""
    return (c.prefill_base_ms + c.prefill_ms_per_token * n + c.prefill_ms_per_token_sq * n * n) / 1000


def transfer_s(n: int, c: MockEngineConfig = ENGINE) -> float:
    blocks = -(-n // c.block_size)
    return c.kv_transfer_latency_ms / 1000 + blocks * c.kv_bytes_per_block * 8 / (c.kv_transfer_bandwidth_gbps * 1e9)


# --- the virtual engine's remote-prefill wrappers ---------------------------------------------------------------------


def test_a_virtual_engine_reserves_commits_and_cancels_a_remote_prefill():
    e = VirtualEngine(MockEngineConfig(num_gpu_blocks=48, max_model_len=512))
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    assert e.reserve_remote_prefill(GenerateRequest("a", list(prompt(1, 500)), sampling), 0.0)
    assert e.num_reserved == 1 and not e.has_work  # reserved: nothing to compute here yet
    # 500 tokens hold 32 of 48 blocks: a second such prompt does not fit beside it, and nothing changes.
    assert not e.reserve_remote_prefill(GenerateRequest("b", list(prompt(2, 500)), sampling), 0.0)
    assert e.num_reserved == 1
    chunk = e.commit_remote_prefill("a", 7)
    assert chunk is not None and chunk.token_ids == [7] and chunk.num_prompt_tokens == 500
    assert e.has_work and e.cached_prefix_tokens(list(prompt(1, 500))) == 496  # 31 whole blocks, not the last token
    out = e.step(0.0)
    assert out.num_scheduled_tokens == {"a": 1} and out.num_prefill_tokens == 0  # a decode, the prompt was delivered
    assert e.reserve_remote_prefill(GenerateRequest("c", list(prompt(3, 100)), sampling), 0.0)
    assert e.cancel_remote_prefill("c") and e.num_reserved == 0
    assert e.step(0.0).num_scheduled_tokens == {"a": 1, "c": 100}  # prefilled here after all
    assert e.kv_transfer_time_s(500) == pytest.approx(transfer_s(500, e.config))


# --- the simulator ----------------------------------------------------------------------------------------------------


def test_without_prefill_engines_the_fleet_is_the_routing_benchmarks_fleet():
    w = synthetic("system_prompts", 60, vocab_size=1000, seed=2).at_rate(4.0)
    engine = MockEngineConfig(num_gpu_blocks=512)
    ours = simulate_fleet(w, DisaggSpec(0, 3, engine), "kv", seed=1)
    theirs = sim.simulate(w, "kv", FleetSpec(workers=3, engine=engine), seed=1)
    assert ours.ttft_s == theirs.ttft_s and ours.itl_s == theirs.itl_s and ours.e2e_s == theirs.e2e_s
    assert ours.cached_tokens == theirs.cached_tokens and ours.computed_tokens == theirs.computed_tokens
    assert ours.remote == 0 and ours.queue_wait_s == []


def test_a_long_prompt_is_prefilled_remotely_and_a_short_one_stays_on_the_decode_engine():
    long_, short = prompt(1, 4000), prompt(2, 200)
    res = simulate_fleet(workload((0.0, long_, 5), (0.0, short, 6)), DisaggSpec(1, 1, ENGINE))
    assert res.prefill_kinds == {"remote": 1, "short": 1} and res.remote == 1
    assert res.prefill_computed_tokens == [4000]  # the whole long prompt, on the prefill engine
    # The decode engine computed the short prompt and one token per decode step: 5 - 1 and 6 - 1 of them (each
    # request's first token came from a prefill), never the long prompt.
    assert res.computed_tokens == [200 + 4 + 5]
    assert res.output_tokens == 11 and len(res.e2e_s) == 2


def test_a_decode_batch_is_not_stalled_by_another_requests_long_prefill():
    # A decodes 200 tokens; B's 8000-token prompt arrives while A decodes. On one aggregated engine B's prefill step
    # (~170 ms) holds A's next token; with a prefill engine A's gaps stay decode steps (~5 ms).
    w = workload((0.0, prompt(1, 100), 200), (0.3, prompt(2, 8000), 20))
    agg = simulate_fleet(w, DisaggSpec(0, 1, ENGINE))
    dis = simulate_fleet(w, DisaggSpec(1, 1, ENGINE))
    assert max(agg.itl_s) >= prefill_s(8000)
    assert max(dis.itl_s) < 0.02
    assert dis.remote == 1
    # The trade-off: B's first token now also waits for its KV transfer.
    assert dis.ttft_s[1] >= prefill_s(8000) + transfer_s(8000)


def test_a_capped_decode_engine_prefills_a_fallen_back_long_prompt_in_small_chunks():
    # No room in the queue (max_prefill_queue_size 0), so B's 8000-token prompt falls back to the decode engine that
    # A decodes on. Uncapped, one step computes all of it and A waits ~170 ms; capped at 1000 tokens, no gap of A's
    # is longer than a step with 1000 prefill tokens plus A's decode, and B is prefilled in 8 chunks.
    w = workload((0.0, prompt(1, 100), 200), (0.3, prompt(2, 8000), 20))
    capped = ENGINE.model_copy(update={"long_prefill_token_threshold": 1000})
    uncapped = simulate_fleet(w, DisaggSpec(1, 1, ENGINE, max_prefill_queue_size=0))
    res = simulate_fleet(w, DisaggSpec(1, 1, ENGINE, max_prefill_queue_size=0, decode_engine=capped))
    assert uncapped.remote == res.remote == 0
    assert max(uncapped.itl_s) >= prefill_s(8000)
    one_chunk_step_s = prefill_s(1000) + 0.010  # + A's decode (5 ms base and its small context)
    assert prefill_s(1000) < max(res.itl_s) < one_chunk_step_s
    # B's first token waits for 8 capped steps instead of one: the cost of the cap, paid by the long prompt.
    assert res.ttft_s[1] >= 8 * prefill_s(1000)
    assert res.output_tokens == uncapped.output_tokens == 220


def test_the_prefill_queue_is_fifo_one_item_per_engine_and_charges_the_transfer():
    n = 4000
    per_item = prefill_s(n) + transfer_s(n)  # a prefill engine holds an item through its prefill and its transfer
    w = workload(*((0.0, prompt(k, n), 2) for k in range(5)))
    res = simulate_fleet(w, DisaggSpec(1, 1, ENGINE))
    # Decisions see the queue at 0 (popped at once), 0, 1, 2, then 3 = max_prefill_queue_size: the fifth is local.
    assert res.prefill_kinds == {"remote": 4, "queue_full": 1} and res.max_queue == 3
    assert res.queue_wait_s == pytest.approx([0.0, per_item, 2 * per_item, 3 * per_item])
    assert res.transfer_s == pytest.approx([transfer_s(n)] * 4)
    remote_first_tokens = sorted(res.ttft_s)[-4:]  # the local one, prefilled at once on the decode engine, is first
    assert remote_first_tokens == pytest.approx([per_item * (k + 1) for k in range(4)])
    assert res.prefill_busy_s == pytest.approx([4 * per_item])


def test_two_prefill_engines_pop_in_parallel():
    n = 4000
    w = workload(*((0.0, prompt(k, n), 2) for k in range(4)))
    res = simulate_fleet(w, DisaggSpec(2, 1, ENGINE))
    per_item = prefill_s(n) + transfer_s(n)
    assert res.queue_wait_s == pytest.approx([0.0, 0.0, per_item, per_item])


def test_a_reservation_the_decode_cache_cannot_hold_is_prefilled_locally():
    # 300 blocks of 16 tokens; each 2500-token prompt needs 157: the first is reserved, the second finds 143 free.
    engine = MockEngineConfig(num_gpu_blocks=300, max_model_len=4096)
    w = workload((0.0, prompt(1, 2500), 4), (0.0, prompt(2, 2500), 4))
    res = simulate_fleet(w, DisaggSpec(1, 1, engine))
    assert res.prefill_kinds == {"remote": 1, NO_ROOM: 1}
    assert len(res.e2e_s) == 2 and res.output_tokens == 8  # the local one waited for memory, then ran


def test_what_the_decode_engine_caches_is_not_prefilled_again():
    # The second request shares the first one's 3008-token prefix (188 whole blocks; delivered, so cached on the decode
    # engine) and adds 500 tokens: its uncached part is under max_local_prefill_length, so the decode engine prefills
    # it.
    shared = prompt(1, 3008)
    w = workload((0.0, shared + prompt(2, 100), 3), (5.0, shared + prompt(3, 500), 3))
    res = simulate_fleet(w, DisaggSpec(1, 1, ENGINE))
    assert res.prefill_kinds == {"remote": 1, "short": 1}
    assert res.cached_tokens == 3008  # the decode engine served the shared prefix to the local prefill


def test_both_fleets_serve_every_request_and_the_same_tokens():
    w = synthetic("documents", 40, vocab_size=1000, seed=1)
    engine = MockEngineConfig(num_gpu_blocks=8192, max_model_len=65536)
    w = w.at_rate(0.5 * sim.model_estimate(w, FleetSpec(workers=4, engine=engine)))
    agg = simulate_fleet(w, DisaggSpec(0, 4, engine))
    dis = simulate_fleet(w, DisaggSpec(2, 2, engine))
    assert len(agg.e2e_s) == len(dis.e2e_s) == 40
    assert agg.output_tokens == dis.output_tokens == sum(r.max_tokens for r in w.requests)
    assert dis.remote > 0 and sum(dis.prefill_kinds.values()) == 40
    assert simulate_fleet(w, DisaggSpec(2, 2, engine)).ttft_s == dis.ttft_s  # deterministic


def test_a_prompt_length_floor_keeps_the_first_rows_long_enough(tmp_path):
    csv = tmp_path / "azure.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{10 + i:02d}.0000000,{n},5" for i, n in enumerate((100, 900, 50, 1200, 700))]
    csv.write_text("\n".join(rows) + "\n")
    w = from_trace(csv, 2, vocab_size=1000, min_prompt_tokens=600)
    assert [len(r.prompt) for r in w.requests] == [900, 1200]
    unfiltered = from_trace(csv, 5, vocab_size=1000)
    assert w.requests[1].prompt == unfiltered.requests[3].prompt  # a kept row's prompt does not depend on the floor


def test_the_target_needs_both_the_itl_speedup_and_equal_throughput():
    def point(itl_p99: float, tput: float) -> dict:
        return {"ttft_ms": {"p50": 10.0, "p99": 20.0}, "itl_ms": {"p50": 5.0, "p99": itl_p99},
                "output_tokens_per_s": tput}  # fmt: skip

    entry = {
        "points": {
            "aggregated": {"0.5": point(90.0, 1000.0), "0.7": point(90.0, 1000.0), "0.9": point(90.0, 1000.0)},
            "disaggregated": {"0.5": point(30.0, 990.0), "0.7": point(70.0, 1000.0), "0.9": point(30.0, 800.0)},
            "disaggregated_full": {"0.5": point(45.0, 951.0), "0.7": point(59.0, 1000.0), "0.9": point(60.0, 949.0)},
            "aggregated_capped": {"0.5": point(45.0, 900.0)},
        }
    }
    ratios, target = compare(entry, [0.5, 0.7, 0.9])
    dis, full = target["disaggregated"], target["disaggregated_full"]
    assert ratios["disaggregated"]["0.5"]["itl_p99_speedup"] == 3.0
    assert ratios["disaggregated"]["0.5"]["ttft_p99_over_agg"] == 1.0
    assert [dis[k]["met"] for k in ("0.5", "0.7", "0.9")] == [True, False, False]  # 3x; 1.29x; 800/1000 tput
    assert dis["0.9"]["equal_throughput"] is False
    # 90/45 = 2x at 951/1000 (within 5%); 90/59 = 1.525x; 2x at 949/1000 (not within 5%).
    assert [full[k]["met"] for k in ("0.5", "0.7", "0.9")] == [True, True, False]
    # The control gets ratios, at the loads it was replayed at, and no target.
    control = {"itl_p99_speedup": 2.0, "itl_p50_speedup": 1.0, "ttft_p50_over_agg": 1.0, "ttft_p99_over_agg": 1.0}
    assert ratios["aggregated_capped"] == {"0.5": {**control, "throughput_over_agg": 0.9}}
    assert "aggregated_capped" not in target
