"""The pure pieces of the vLLM adapter, without vLLM: sampling mapping, prompt validation, finish reasons, KV-event
translation (from messages recorded from vLLM 0.32.0 by scripts/record_vllm_kv_events.py), load snapshots, config."""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path

import pytest

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import FinishReason, KvEventKind, SamplingParams
from components.workers.engines.base import EngineRequestError
from components.workers.engines.vllm.config import VllmEngineConfig, apply_vllm_environment, engine_arguments
from components.workers.engines.vllm.convert import (
    KvEventTranslator,
    RequestProgress,
    TokenIdOutOfRangeError,
    VllmStats,
    decode_kv_event_batch,
    finish_reason,
    load_snapshot,
    sampling_kwargs,
    validate_prompt,
)

pytestmark = pytest.mark.unit

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_kv_events.json").read_text())
BS = RECORDED["block_size"]  # 32


# --- sampling, prompts, finish reasons ---------------------------------------------------------------------------


def test_sampling_params_map_field_by_field():
    p = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop_token_ids=[5, 6], ignore_eos=True
    )
    assert sampling_kwargs(p) == {
        "n": 1,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 3,
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
    }


def test_top_k_off_becomes_vllms_zero_and_stop_ids_are_copied():
    p = SamplingParams(top_k=-1, stop_token_ids=[1])
    kw = sampling_kwargs(p)
    assert kw["top_k"] == 0  # kvmesh -1 = off; vLLM's off is 0
    kw["stop_token_ids"].append(2)
    assert p.stop_token_ids == [1]  # a copy: the engine side never shares the caller's list


def test_prompt_ids_outside_the_vocabulary_are_refused_with_their_position():
    validate_prompt([0, 5, 383], vocab_size=384)
    with pytest.raises(TokenIdOutOfRangeError) as exc:
        validate_prompt([1, 2, 384, 3], vocab_size=384)
    assert (exc.value.token_id, exc.value.position, exc.value.vocab_size) == (384, 2, 384)
    assert isinstance(exc.value, EngineRequestError)  # recoverable: the worker keeps serving
    with pytest.raises(TokenIdOutOfRangeError) as exc:
        validate_prompt([7, -1], vocab_size=384)
    assert exc.value.position == 1
    with pytest.raises(EngineRequestError, match="no tokens"):
        validate_prompt([], vocab_size=384)


def test_finish_reasons_map_and_error_raises():
    assert finish_reason(None) is None
    assert finish_reason("stop") is FinishReason.STOP
    assert finish_reason("length") is FinishReason.LENGTH
    assert finish_reason("abort") is FinishReason.ABORT
    assert finish_reason("repetition") is FinishReason.STOP
    with pytest.raises(EngineRequestError, match="error"):
        finish_reason("error")


# --- KV events from recorded vLLM messages -------------------------------------------------------------------------


def replay(translator: KvEventTranslator, messages=None):
    out = []
    for _seq, payload in messages or RECORDED["messages"]:
        _ts, events = decode_kv_event_batch(bytes.fromhex(payload))
        out.append(translator.translate(events))
    return out


def test_recorded_block_stored_events_translate_to_kvmesh_hashes_of_the_whole_prompt():
    prompts = RECORDED["prompts"]
    t = KvEventTranslator(BS)
    batches = replay(t)
    a, b = prompts["a"], prompts["b"]
    # 1: A's 3 full blocks (100 tokens), at the start of a sequence.
    [first] = batches[0]
    assert first.kind is KvEventKind.BLOCK_STORED and first.parent_hash is None
    assert first.block_hashes == block_hashes(a, BS)
    assert first.num_tokens_per_block == BS
    # 2: B shares A's first 64 tokens: vLLM stores only B's third block, chained on A's second block.
    [second] = batches[1]
    assert second.parent_hash == block_hashes(a, BS)[1]
    assert second.block_hashes == block_hashes(b, BS)[2:]
    # 3-6: each 300-token prompt stores 9 blocks with the hashes block_hashes gives for it.
    stored_c = [e for batch in batches[2:6] for e in batch if e.kind is KvEventKind.BLOCK_STORED]
    assert [e.block_hashes for e in stored_c] == [block_hashes(prompts[f"c{i}"], BS) for i in range(4)]


def test_recorded_evictions_remove_only_what_was_stored_and_clear_empties_the_mirror():
    t = KvEventTranslator(BS)
    batches = replay(t)
    events = [e for batch in batches for e in batch]
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))  # contiguous, from 1
    stored: set[int] = set()
    removed: list[int] = []
    for e in events:
        if e.kind is KvEventKind.BLOCK_STORED:
            stored |= set(e.block_hashes)
        elif e.kind is KvEventKind.BLOCK_REMOVED:
            assert set(e.block_hashes) <= stored
            removed += e.block_hashes
        else:
            break
    assert len(removed) == 10  # 31 usable blocks, 3 + 1 + 4 x 9 = 40 stored: the 10 oldest evicted (LRU)
    assert set(block_hashes(RECORDED["prompts"]["a"], BS)) <= set(removed)
    # Last message: AllBlocksCleared (reset_prefix_cache), then A stored again into an empty cache.
    cleared, again = batches[-1]
    assert cleared.kind is KvEventKind.ALL_CLEARED
    assert again.block_hashes == block_hashes(RECORDED["prompts"]["a"], BS)
    state = t.kv_state()
    assert state.block_hashes == again.block_hashes and state.last_event_id == events[-1].event_id
    assert (t.num_unknown_parents, t.num_unknown_removals, t.num_skipped) == (0, 0, 0)


def test_kv_state_before_the_clear_is_stored_minus_removed():
    t = KvEventTranslator(BS)
    events = [e for batch in replay(t, RECORDED["messages"][:-1]) for e in batch]
    held: list[int] = []
    for e in events:
        if e.kind is KvEventKind.BLOCK_STORED:
            held += e.block_hashes
        else:
            held = [h for h in held if h not in e.block_hashes]
    assert t.kv_state().block_hashes == held
    assert len(held) == 31 - 1  # every usable block cached but one: the last prompt's partial block


def stored(hashes, tokens, parent=None, **extra):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes, **extra):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **extra}


def test_a_hash_held_twice_is_announced_removed_only_when_its_last_copy_goes():
    t = KvEventTranslator(2)
    kh = block_hashes([1, 2, 3, 4], 2)
    t.translate([stored([10, 11], [1, 2, 3, 4])])
    second = t.translate([stored([10], [1, 2])])  # a second physical copy of the first block
    assert second[0].block_hashes == kh[:1]
    assert t.translate([removed([10])]) == []  # one copy left: the router must keep believing in it
    [gone] = t.translate([removed([10, 11])])
    assert gone.kind is KvEventKind.BLOCK_REMOVED and gone.block_hashes == kh
    assert t.kv_state().block_hashes == []


def test_unknown_parents_other_tiers_and_malformed_events_are_skipped_and_counted():
    t = KvEventTranslator(2)
    assert t.translate([stored([20], [5, 6], parent=999)]) == []  # parent never seen: chain cannot continue
    assert t.num_unknown_parents == 1
    assert t.translate([stored([21], [5, 6], medium="CPU")]) == []  # an offloading tier, not the device cache
    assert t.translate([stored([22], [5, 6], group_idx=1)]) == []  # a second KV-cache group (hybrid models)
    assert t.translate([stored([23], [5, 6, 7])]) == []  # tokens do not fill the blocks
    assert t.translate([{"type": "SomethingNew"}]) == []
    assert t.num_skipped == 4
    assert t.translate([removed([404])]) == [] and t.num_unknown_removals == 1
    assert t.last_event_id == 0 and t.kv_state().block_hashes == []


def test_a_cached_prefix_maps_back_to_its_tokens_and_vllm_hashes_while_cached():
    # What a prefix copy's source answers from (hot-prefix replication): the prefix's kvmesh hashes -> the tokens its
    # blocks hold, the run from the first block only; a drop's vLLM hashes; both forget evicted and cleared blocks.
    t = KvEventTranslator(2)
    kh = block_hashes([1, 2, 3, 4, 5, 6], 2)
    t.translate([stored([10, 11], [1, 2, 3, 4]), stored([12], [5, 6], parent=11)])
    assert t.prefix_tokens(kh) == [1, 2, 3, 4, 5, 6]
    assert t.prefix_tokens([*kh[:2], 999, kh[2]]) == [1, 2, 3, 4]  # stops at the first block not cached
    assert t.prefix_tokens([kh[1]]) == [3, 4]  # a chained hash names its block (the caller passes from the start)
    assert sorted(t.vllm_hashes(kh[1:])) == [11, 12]
    t.translate([removed([11])])
    assert t.prefix_tokens(kh) == [1, 2] and t.vllm_hashes(kh) == [10, 12]
    t.translate([{"type": "AllBlocksCleared"}])
    assert t.prefix_tokens(kh) == [] and t.vllm_hashes(kh) == []


# --- load -----------------------------------------------------------------------------------------------------------


def sched(running=0, waiting=0, skipped=0, usage=0.0, details=None):
    return types.SimpleNamespace(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=skipped,
        kv_cache_usage=usage,
        iteration_details=details,
    )


def test_stats_sum_preemptions_and_take_the_batch_from_iteration_details():
    s = VllmStats(num_total_blocks=63)
    details = types.SimpleNamespace(num_ctx_requests=1, num_ctx_tokens=512, num_generation_requests=3, is_dummy=False)
    s.record(
        sched(running=4, waiting=2, skipped=1, usage=0.5, details=details), types.SimpleNamespace(num_preempted_reqs=2)
    )
    s.record(sched(running=3, waiting=3, usage=0.75), types.SimpleNamespace(num_preempted_reqs=1))
    assert (s.num_running, s.num_waiting, s.kv_usage, s.num_preemptions) == (3, 3, 0.75, 3)
    assert s.batch_size == 4  # the last step that had details
    assert s.num_prefill_tokens == 512  # its prompt tokens (vLLM's num_ctx_tokens): the step's chunk
    assert load_snapshot(s, [RequestProgress(num_prompt_tokens=100)], now_s=1.0).num_prefill_tokens == 512
    s.record(None, None)
    assert s.num_records == 3 and s.num_running == 3


def test_snapshot_derives_pending_prefill_and_kv_tokens_from_tracked_requests():
    s = VllmStats(num_total_blocks=63, kv_usage=20 / 63, num_running=2, num_waiting=1, num_preemptions=5)
    reqs = [
        RequestProgress(num_prompt_tokens=100, num_output_tokens=10, started=True),
        RequestProgress(num_prompt_tokens=50, num_output_tokens=1, started=True),
        RequestProgress(num_prompt_tokens=70),  # waiting: no output yet
    ]
    snap = load_snapshot(s, reqs, now_s=12.5)
    assert snap.now_s == 12.5 and snap.num_active_blocks == 20 and snap.num_total_blocks == 63
    assert snap.num_waiting_prefill_tokens == 70
    assert snap.num_kv_tokens == 110 + 51
    assert snap.batch_size == 2  # no iteration details yet: the running count
    idle = load_snapshot(VllmStats(num_total_blocks=63, batch_size=8), [], now_s=13.0)
    assert (idle.batch_size, idle.num_kv_tokens, idle.num_waiting_prefill_tokens) == (0, 0, 0)


# --- config -----------------------------------------------------------------------------------------------------


def test_engine_arguments_leave_unset_knobs_to_vllm():
    args = engine_arguments(VllmEngineConfig(model_path="/m"))
    assert args["skip_tokenizer_init"] is True and args["dtype"] == "float32" and args["block_size"] == 32
    assert args["kv_cache_memory_bytes"] == 64 * 2**20
    assert not {"max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"} & set(args)
    gpu = engine_arguments(VllmEngineConfig(model_path="/m", kv_cache_memory_bytes=0, max_model_len=4096))
    assert "kv_cache_memory_bytes" not in gpu and gpu["max_model_len"] == 4096
    with pytest.raises(ValueError):
        VllmEngineConfig(model_path="")


def test_environment_defaults_yield_to_the_operator_but_threads_follow_the_config():
    env = {"VLLM_HOST_IP": "10.0.0.5", "OMP_NUM_THREADS": "8"}
    changed = apply_vllm_environment(VllmEngineConfig(model_path="/m", num_omp_threads=1), env)
    assert env["VLLM_HOST_IP"] == "10.0.0.5"  # an explicit choice stays
    assert env["OMP_NUM_THREADS"] == "1" and changed["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"  # stdout carries the worker's READY line
    assert "VLLM_HOST_IP" not in changed


def test_the_adapter_and_the_worker_cli_import_vllm_only_inside_functions():
    """The mock path must never load vLLM (3 s and ~500 MB): no module-level import of vllm, torch or zmq. The one
    exception is the NIXL connector subclass, which vLLM loads itself in its own processes
    (``kv_connector_module_path``): no kvmesh module may import it."""
    root = Path(__file__).resolve().parents[3]
    vllm_dir = root / "components/workers/engines/vllm"
    connector = "components.workers.engines.vllm.nixl_connector"
    # hooks.py and nixl_connector.py run inside vLLM's own processes only (loaded there by name: config.SCHEDULER_CLS,
    # WORKER_EXTENSION_CLS, kv_connector_module_path) and import vLLM at the top; no module of kvmesh may import them.
    skip = {"hooks.py", "nixl_connector.py"}
    files = [p for p in sorted(vllm_dir.glob("*.py")) if p.name not in skip] + [root / "components/workers/main.py"]
    for path in sorted((root / "components").rglob("*.py")):
        source = path.read_text()
        assert connector not in source or path.name in {"nixl.py", "nixl_connector.py"}, f"{path} names {connector}"
        if path.name != "nixl.py":
            assert "nixl_connector import" not in source and "import nixl_connector" not in source, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                named = {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
                assert not any(n.endswith("hooks") and "vllm" in n for n in named) and not (
                    node.level and any(a.name == "hooks" for a in node.names) and "vllm" in str(path)
                ), f"{path} imports the vLLM-process hooks"
    for path in files:
        if path.name == "nixl_connector.py":
            continue
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            heavy = [n for n in names if n.split(".")[0] in {"vllm", "torch", "zmq"}]
            assert not heavy, f"{path.name} imports {heavy} at module level"


# --- migration: continuations (no vLLM needed: a stand-in for vllm.SamplingParams records the arguments) -----------


def _continuation_params(request):
    from components.workers.engines.vllm.config import SAMPLER_DRAWS_KEY
    from components.workers.engines.vllm.engine import VllmEngine

    made = []
    fake = types.SimpleNamespace(
        SamplingParams=lambda **kw: made.append(kw) or kw,
        RequestOutputKind=types.SimpleNamespace(DELTA="delta"),
        ClientError=ValueError,
    )
    engine = VllmEngine(VllmEngineConfig(model_path="/m"))
    engine.vocab_size = 1000
    run = engine._new_run(request, fake)
    return run, made[-1], SAMPLER_DRAWS_KEY


def test_a_continuation_asks_vllm_for_the_rest_and_a_seeded_one_for_the_draws_already_made():
    from components.protocol.messages import GenerateRequest

    seeded = GenerateRequest("r", [1, 2, 3, 40, 41], SamplingParams(max_tokens=10, seed=5), num_output_tokens=2)
    run, kw, key = _continuation_params(seeded)
    assert run.outputs == [40, 41] and run.request.prompt_token_ids == [1, 2, 3]
    assert kw["max_tokens"] == 8 and kw["extra_args"] == {key: 2} and kw["seed"] == 5
    greedy = GenerateRequest("g", [1, 2, 3, 40], SamplingParams(max_tokens=10, temperature=0.0), num_output_tokens=1)
    _, kw, _ = _continuation_params(greedy)
    assert kw["max_tokens"] == 9 and "extra_args" not in kw  # no generator to advance
    fresh = GenerateRequest("f", [1, 2, 3], SamplingParams(max_tokens=10, seed=5))
    _, kw, _ = _continuation_params(fresh)
    assert kw["max_tokens"] == 10 and "extra_args" not in kw
    with pytest.raises(EngineRequestError, match="nothing left to produce"):
        _continuation_params(GenerateRequest("x", [1, 2, 3], SamplingParams(max_tokens=2), num_output_tokens=2))
