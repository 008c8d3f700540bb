"""A worker's role in disaggregated serving: its config (role, the decode thresholds and their checks), its flags, the
metadata it registers (role and remote_prefill_mode), and the mock engine's KV-transfer time model."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from components.cli.main import build_parser
from components.protocol.metadata import RemotePrefillMode, WorkerMetadata, WorkerRole
from components.runtime import InstanceInfo
from components.workers.config import WorkerConfig
from components.workers.engines.base import remote_prefill_mode_of
from components.workers.engines.mock import MockEngine, MockEngineConfig
from components.workers.engines.mock.perf_model import transfer_time_s
from components.workers.engines.vllm.engine import VllmEngine
from components.workers.main import worker_config_from_args
from components.workers.worker import Worker
from tests.support.mesh import Mesh

pytestmark = pytest.mark.unit

MIB = 1 << 20


# -- WorkerConfig ----------------------------------------------------------------------------------------------------


def test_a_decode_worker_takes_both_thresholds_with_dynamo_s_defaults():
    cfg = WorkerConfig(role=WorkerRole.DECODE)
    assert (cfg.max_local_prefill_length, cfg.max_prefill_queue_size) == (1000, 3)
    cfg = WorkerConfig(role="decode", max_local_prefill_length=0, max_prefill_queue_size=0)  # type: ignore[arg-type]
    assert (cfg.max_local_prefill_length, cfg.max_prefill_queue_size) == (0, 0)
    for name in ("max_local_prefill_length", "max_prefill_queue_size"):
        description = WorkerConfig.model_fields[name].description or ""
        assert description.startswith("Decode workers:")
    assert "tokens" in (WorkerConfig.model_fields["max_local_prefill_length"].description or "")
    assert "items" in (WorkerConfig.model_fields["max_prefill_queue_size"].description or "")


@pytest.mark.parametrize("name", ["max_local_prefill_length", "max_prefill_queue_size"])
def test_negative_thresholds_are_refused(name):
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        WorkerConfig(role=WorkerRole.DECODE, **{name: -1})


@pytest.mark.parametrize("role", [WorkerRole.PREFILL, WorkerRole.AGGREGATED])
def test_a_threshold_on_a_worker_that_never_decides_where_to_prefill_is_an_error(role):
    with pytest.raises(ValidationError) as exc:
        WorkerConfig(role=role, max_local_prefill_length=512)
    text = str(exc.value)
    assert f"max_local_prefill_length = 512: only decode workers read it (this worker's role is {role}" in text
    assert "set role to decode, or leave it out" in text
    with pytest.raises(ValidationError, match=r"max_local_prefill_length = 1, max_prefill_queue_size = 0: .* them"):
        WorkerConfig(role=role, max_local_prefill_length=1, max_prefill_queue_size=0)


def test_a_threshold_at_its_default_passes_on_any_role_so_a_config_survives_its_own_dump():
    for role in WorkerRole:
        cfg = WorkerConfig(role=role)
        assert WorkerConfig.model_validate(cfg.model_dump()) == cfg


# -- flags -----------------------------------------------------------------------------------------------------------


def test_kvmesh_worker_takes_the_role_and_thresholds_as_flags():
    args = build_parser().parse_args(["worker", "--role", "decode", "--max-local-prefill-length", "512"])
    cfg = worker_config_from_args(args)
    assert (cfg.role, cfg.max_local_prefill_length, cfg.max_prefill_queue_size) == (WorkerRole.DECODE, 512, 3)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--role", "prefill", "--max-prefill-queue-size", "5"],
            "kvmesh worker: max_prefill_queue_size = 5: only decode workers read it (this worker's role is prefill",
        ),
        (
            ["--role", "decode", "--max-local-prefill-length", "-3"],
            "kvmesh worker: --max-local-prefill-length: Input should be greater than or equal to 0 (got -3)",
        ),
        (["--role", "decoder"], "kvmesh worker: --role: Input should be 'aggregated', 'prefill' or 'decode'"),
    ],
)
def test_a_refused_flag_exits_with_its_name_and_why_not_a_traceback(argv, says):
    args = build_parser().parse_args(["worker", *argv])
    with pytest.raises(SystemExit) as exc:
        worker_config_from_args(args)
    assert str(exc.value.code).startswith(says)


# -- registered metadata ---------------------------------------------------------------------------------------------


def test_engines_declare_how_they_take_a_remote_prefill():
    assert MockEngine.remote_prefill_mode == RemotePrefillMode.KV_TRANSFER == "kv_transfer"
    assert VllmEngine.remote_prefill_mode == RemotePrefillMode.RECOMPUTE == "recompute"
    assert remote_prefill_mode_of(MockEngine(), WorkerRole.AGGREGATED) == ""
    assert remote_prefill_mode_of(MockEngine(), WorkerRole.PREFILL) == "kv_transfer"
    assert remote_prefill_mode_of(object(), WorkerRole.DECODE) == "recompute"  # declares nothing: no KV can arrive


@pytest.mark.parametrize(
    ("role", "mode"),
    [(WorkerRole.AGGREGATED, ""), (WorkerRole.PREFILL, "kv_transfer"), (WorkerRole.DECODE, "kv_transfer")],
)
async def test_a_worker_registers_its_configured_role_and_its_engine_s_mode(role, mode):
    mesh = Mesh()
    try:
        rt = await mesh.runtime()
        engine = MockEngine(MockEngineConfig(speedup_ratio=math.inf))
        worker = Worker(rt, WorkerConfig(namespace="ns", role=role), engine)
        await worker.start()
        try:
            listing = await rt.discovery.get_prefix("kvmesh/ns/instances/")
            infos = [InstanceInfo.from_json(v) for v in listing.values()]
        finally:
            await worker.stop()
    finally:
        await mesh.shutdown()
    # A prefill worker takes work from the prefill queue only; a decode worker also takes prefill results. Both
    # client-serving roles move requests (the simulated engine live: components/migration/agent.py).
    # Both also receive hot-prefix copies and their drops (import_prefix, drop_prefix: the simulated engine imports
    # KV with no request and evicts it again).
    migration = {"migrate", "migrate_in", "abort", "import_prefix", "drop_prefix"}
    endpoints = {WorkerRole.AGGREGATED: {"generate", "kv_state", *migration}, WorkerRole.PREFILL: {"kv_state"}}
    assert {i.endpoint for i in infos} == endpoints.get(role, {"generate", "kv_state", "prefill_result", *migration})
    for info in infos:
        assert info.metadata["role"] == str(role) and info.metadata["remote_prefill_mode"] == mode
        meta = WorkerMetadata.from_dict(info.metadata)
        assert (meta.role, meta.remote_prefill_mode) == (role, mode)
        assert meta.migration_mode == ("" if role == WorkerRole.PREFILL else "live")
        # A prefill worker is no end of a prefix copy; the others copy by the simulated engine's import.
        assert meta.prefix_copy_mode == ("" if role == WorkerRole.PREFILL else "simulated")


# -- KV transfer time ------------------------------------------------------------------------------------------------


def test_a_block_of_the_default_mock_model_is_llama_3_8b_s_2_mib():
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token, x 16 tokens = 2 MiB.
    assert MockEngineConfig().kv_bytes_per_block == 2 * MIB
    assert (
        MockEngineConfig(kv_cache_dtype_bytes=1, block_size=32).kv_bytes_per_block == 2 * MIB
    )  # fp8, twice the tokens
    assert MockEngineConfig(num_hidden_layers=80).kv_bytes_per_block == 5 * MIB  # Llama-3-70B's 80 layers


def test_transfer_time_is_a_fixed_latency_plus_the_bytes_at_the_bandwidth():
    c = MockEngineConfig()

    def t(n: int, **kw: float) -> float:
        params = {"bandwidth_gbps": c.kv_transfer_bandwidth_gbps, "latency_ms": c.kv_transfer_latency_ms} | kw
        return transfer_time_s(n, bytes_per_block=c.kv_bytes_per_block, **params)

    # An 8192-token prompt: 512 blocks x 2 MiB = 2**30 B = 8 * 2**30 bits at 400e9 bit/s = 21.47 ms, + 1 ms.
    assert t(512) == pytest.approx(1e-3 + 8 * 2**30 / 400e9)
    assert t(512) == pytest.approx(0.02247, abs=1e-5)
    assert t(1) == pytest.approx(1e-3 + 8 * 2 * MIB / 400e9)
    assert t(0) == 0.0  # nothing to send: no transfer at all, not even its latency
    assert t(512, latency_ms=0.0) * 2 == pytest.approx(t(1024, latency_ms=0.0))  # linear in the blocks
    assert t(512, bandwidth_gbps=800.0, latency_ms=0.0) == pytest.approx(t(512, latency_ms=0.0) / 2)
    with pytest.raises(ValueError, match="num_blocks cannot be negative"):
        t(-1)
    with pytest.raises(ValueError, match="bandwidth_gbps must be positive"):
        t(1, bandwidth_gbps=0.0)


def test_transfer_settings_are_validated_with_their_units():
    with pytest.raises(ValidationError, match="greater than 0"):
        MockEngineConfig(kv_transfer_bandwidth_gbps=0)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        MockEngineConfig(kv_transfer_latency_ms=-1)
    fields = MockEngineConfig.model_fields
    assert "gigabits per second" in (fields["kv_transfer_bandwidth_gbps"].description or "")
    assert "in ms" in (fields["kv_transfer_latency_ms"].description or "")
