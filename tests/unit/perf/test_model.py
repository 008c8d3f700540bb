"""The analytic step-time model (components/perf/model.py) against hand-computed values, and the one-copy claim: the
router's ``StepTime`` and the mock engine's charged step times are the same numbers on a grid."""

from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

import pytest

from components.perf.model import DEFAULT_MODEL, STEP_TIME_FIELDS, StepTimeModel, kv_bytes_per_block, transfer_time_s
from components.router.types import DEFAULT_STEP_TIME, StepTime
from components.workers.engines.mock.perf_model import step_time_ms
from components.workers.simulated import MockEngineConfig, step_time_of

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_prefill_decode_and_mixed_steps_match_hand_computed_values():
    m = StepTimeModel()
    # 16.5 + 0.01518 * 1000 + 4.21e-7 * 1e6 = 16.5 + 15.18 + 0.421 = 32.101
    assert m.prefill_ms(1000) == pytest.approx(32.101, rel=1e-12)
    # 8192 tokens: 16.5 + 124.35456 + 28.2524... (4.21e-7 * 67108864 = 28.25283174)
    assert m.prefill_ms(8192) == pytest.approx(16.5 + 124.35456 + 28.25283174, rel=1e-9)
    assert m.prefill_ms(0) == 0.0
    # 64 sequences of 2048 tokens: 5 + 1.28 + 3.93216 = 10.21216 (the docstring's "10.2 ms")
    assert m.decode_ms(64, 64 * 2048) == pytest.approx(10.21216, rel=1e-12)
    assert m.decode_ms(0, 500) == 0.0
    # A mixed step is the sum of its parts: 32.101 + 10.21216
    assert m.step_ms(1000, 64, 64 * 2048) == pytest.approx(42.31316, rel=1e-12)
    assert m.step_ms(0, 0, 0) == 0.0


def test_a_long_prompt_is_prefilled_in_full_chunks_then_the_rest():
    m = StepTimeModel(max_num_batched_tokens=1000)
    # 2500 tokens: two chunks of 1000 (32.101 each) and 500 (16.5 + 7.59 + 0.10525 = 24.19525)
    assert m.chunked_prefill_ms(2500) == pytest.approx(2 * 32.101 + 24.19525, rel=1e-12)
    assert m.chunked_prefill_ms(0) == m.prefill_ms(1)  # a fully cached prompt still computes its last token


def test_kv_transfer_and_host_load_times():
    assert kv_bytes_per_block() == 2 * 32 * 8 * 128 * 2 * 16 == 2 * 1024 * 1024
    # 512 blocks of 2 MiB at 400 Gb/s plus 1 ms: 1 ms + 1073741824 * 8 / 4e11 s = 1 ms + 21.47 ms
    assert transfer_time_s(512, bytes_per_block=2**21, bandwidth_gbps=400.0, latency_ms=1.0) == pytest.approx(
        0.001 + 2**30 * 8 / 4e11
    )
    assert transfer_time_s(0, bytes_per_block=2**21, bandwidth_gbps=400.0, latency_ms=1.0) == 0.0
    with pytest.raises(ValueError):
        transfer_time_s(-1, bytes_per_block=1, bandwidth_gbps=1.0, latency_ms=0.0)
    # 128 KiB a token at 50 GB/s: 131072 * 8 / 4e11 s = 2.62144 us
    assert DEFAULT_MODEL.host_load_ms_per_token == pytest.approx(2.62144e-3, rel=1e-12)
    assert DEFAULT_MODEL.host_load_ms(1000) == pytest.approx(2.62144, rel=1e-12)


def test_the_announcement_round_trips_and_bad_fields_keep_their_defaults():
    m = StepTimeModel(prefill_base_ms=7.0, max_num_batched_tokens=2048)
    assert StepTimeModel.from_mapping(m.to_mapping()) == m
    assert set(m.to_mapping()) == set(STEP_TIME_FIELDS)
    bad = {
        "prefill_base_ms": -1,
        "decode_base_ms": True,
        "decode_ms_per_seq": float("nan"),
        "max_num_batched_tokens": 0,
    }
    assert StepTimeModel.from_mapping(bad) == StepTimeModel()


# Prompt lengths (0, one token, a block, a chunk, past the budget), batch sizes and KV tokens in the batch.
PROMPTS = [0, 1, 16, 1000, 4096, 8192, 8193, 20000]
BATCHES = [0, 1, 7, 64, 256]
KV_TOKENS = [0, 1, 2048, 131072, 1_000_000]


@pytest.mark.parametrize(
    "config",
    [
        MockEngineConfig(),
        MockEngineConfig(prefill_base_ms=3.0, decode_ms_per_kv_token=1e-4, max_num_batched_tokens=512),
    ],
)
def test_the_router_and_the_mock_engine_agree_exactly_on_a_grid(config):
    # The router predicts with what the worker announces (step_time_of); with the defaults it needs no announcement.
    router = StepTime.from_mapping(step_time_of(config))
    if config == MockEngineConfig():
        assert router == DEFAULT_STEP_TIME
    for n, b, k in itertools.product(PROMPTS, BATCHES, KV_TOKENS):
        engine = step_time_ms(config, num_prefill_tokens=n, num_decode_seqs=b, num_decode_kv_tokens=k)
        assert engine == router.prefill_ms(n) + router.decode_ms(b, k)  # exactly: the same arithmetic
        assert engine == router.step_ms(n, b, k)


def test_the_defaults_are_defined_once():
    # The engine's fields and the router's StepTime take their defaults from components.perf.model.
    config = MockEngineConfig()
    for name in STEP_TIME_FIELDS:
        assert getattr(config, name) == getattr(DEFAULT_MODEL, name) == getattr(DEFAULT_STEP_TIME, name), name


def test_perf_imports_only_the_standard_library():
    offenders = []
    for path in sorted((ROOT / "components" / "perf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] not in sys.stdlib_module_names]
    assert offenders == []
