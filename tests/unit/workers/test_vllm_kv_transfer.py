"""The pure half of vLLM's KV transfer (components/workers/engines/vllm/nixl.py and the adapter's counters): which
mode an engine takes, what a hand-off must hold to be pulled, the connector's config, what vLLM's stats add up to,
and the wire messages that carry the hand-off. Real engines moving real KV: tests/integration/test_vllm_disagg.py."""

from __future__ import annotations

import socket
import types

import pytest

from components.cli.bench.kv_transfer import ratios, round_orders, summary
from components.protocol.messages import GenerateRequest, RemotePrefillRequest, RemotePrefillResult
from components.protocol.metadata import WorkerRole
from components.runtime.codec import pack, unpack
from components.workers.config import WorkerConfig
from components.workers.engines.mock import MockEngine
from components.workers.engines.vllm.config import VllmEngineConfig
from components.workers.engines.vllm.convert import VllmStats
from components.workers.engines.vllm.engine import VllmEngine
from components.workers.engines.vllm.nixl import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    UCX_ENVIRONMENT,
    check_handoff,
    choose_migration_mode,
    choose_remote_prefill_mode,
    connector_role,
    free_loopback_port,
    kv_transfer_config,
)
from components.workers.replication import prefix_copy_mode
from components.workers.worker import Worker

pytestmark = pytest.mark.unit

BS = 32


def handoff(num_tokens: int, blocks: int | None = None, **over: object) -> dict:
    """A prefill engine's final kv_transfer_params as vLLM 0.32 writes them (recorded from a real run)."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": ([*range(1, 1 + (blocks if blocks is not None else -(-num_tokens // BS)))],),
        "remote_engine_id": "6e718c6b-b890-4a9e-84cb-fafcba66af84",
        "remote_request_id": "r1@prefill-960c6c17",
        "remote_host": "127.0.0.1",
        "remote_port": 58491,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    }
    params.update(over)
    return params


# --- which mode --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "configured", "unavailable", "want"),
    [
        ("decode", "auto", None, ("kv_transfer", "kv_consumer")),
        ("prefill", "auto", None, ("kv_transfer", "kv_producer")),
        ("decode", "kv_transfer", None, ("kv_transfer", "kv_consumer")),
        ("decode", "auto", "not installed", ("recompute", None)),
        ("prefill", "auto", "not installed", ("recompute", None)),
        ("decode", "recompute", None, ("recompute", None)),
        ("aggregated", "auto", None, ("recompute", None)),  # nothing would use a connector
        ("aggregated", "kv_transfer", "not installed", ("recompute", None)),  # nor need one
    ],
)
def test_the_mode_follows_the_role_the_config_and_nixl(role, configured, unavailable, want):
    mode, kv_role, reason = choose_remote_prefill_mode(role, configured, unavailable)
    assert (mode, kv_role) == want
    assert reason  # always said, for the log line
    if unavailable and role != "aggregated":
        assert unavailable in reason


def test_kv_transfer_required_without_nixl_is_an_error_that_says_why():
    with pytest.raises(ValueError, match="NIXL is unavailable: the nixl package is not installed"):
        choose_remote_prefill_mode("decode", "kv_transfer", "the nixl package is not installed")
    with pytest.raises(ValueError, match="expected auto, kv_transfer or recompute"):
        choose_remote_prefill_mode("decode", "nixl", None)


@pytest.mark.parametrize(
    ("role", "configured", "unavailable", "want"),
    [
        ("aggregated", "auto", None, "kv_transfer"),
        ("decode", "auto", None, "kv_transfer"),
        ("aggregated", "kv_transfer", None, "kv_transfer"),
        ("aggregated", "auto", "not installed", "recompute"),
        ("aggregated", "recompute", None, "recompute"),  # the way to turn the connector off
        ("prefill", "auto", None, "recompute"),  # serves no client stream: moves nothing
    ],
)
def test_the_migration_mode_follows_the_role_the_config_and_nixl(role, configured, unavailable, want):
    mode, reason = choose_migration_mode(role, configured, unavailable)
    assert mode == want and reason
    if unavailable:
        assert unavailable in reason
    with pytest.raises(ValueError, match="migration_mode = kv_transfer, but NIXL is unavailable: gone"):
        choose_migration_mode("aggregated", "kv_transfer", "gone")
    with pytest.raises(ValueError, match="expected auto, kv_transfer or recompute"):
        choose_migration_mode("aggregated", "live", None)


@pytest.mark.parametrize(
    ("prefill_role", "migrates", "want"),
    [
        (None, False, None),  # aggregated, recompute: no connector at all
        (None, True, "kv_both"),  # aggregated, kv_transfer migration: source and target of hand-offs
        ("kv_consumer", True, "kv_both"),  # a decode worker that also migrates by KV transfer
        ("kv_consumer", False, "kv_consumer"),
        ("kv_producer", False, "kv_producer"),
    ],
)
def test_the_connector_role_covers_both_uses(prefill_role, migrates, want):
    assert connector_role(prefill_role, migrates) == want


def test_the_config_field_refuses_unknown_modes_and_short_leases():
    with pytest.raises(ValueError):
        VllmEngineConfig(model_path="/m", remote_prefill_mode="nixl")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        VllmEngineConfig(model_path="/m", kv_transfer_lease_s=0)
    with pytest.raises(ValueError):
        VllmEngineConfig(model_path="/m", migration_mode="live")  # type: ignore[arg-type]
    cfg = VllmEngineConfig(model_path="/m")
    assert (cfg.remote_prefill_mode, cfg.kv_transfer_lease_s, cfg.kv_transfer_host) == ("auto", 10, "127.0.0.1")
    assert cfg.migration_mode == "auto"


def test_an_engine_announces_recompute_until_it_has_started_with_a_connector():
    engine = VllmEngine(VllmEngineConfig(model_path="/m"), role=WorkerRole.DECODE)
    assert engine.remote_prefill_mode == "recompute" and engine.kv_transfer_port == 0
    assert engine.migration_mode == "recompute" and engine.kv_role is None
    # Nor does it take part in a prefix copy (it would refuse): its worker announces none, so the rescheduler never
    # picks it for either end (components/workers/replication.py).
    assert prefix_copy_mode(engine) == ""
    engine.kv_role = "kv_both"  # as a start with the connector sets it
    assert prefix_copy_mode(engine) == "kv_transfer"


# --- the connector's config and environment ----------------------------------------------------------------------


def test_the_connector_config_names_kvmesh_s_subclass_and_recomputes_failed_pulls():
    kw = kv_transfer_config(kv_role="kv_consumer", host="127.0.0.1", port=41000, lease_s=10)
    assert (kw["kv_connector"], kw["kv_connector_module_path"]) == (CONNECTOR_CLASS, CONNECTOR_MODULE)
    assert kw["kv_role"] == "kv_consumer" and kw["kv_load_failure_policy"] == "recompute"
    assert kw["kv_connector_extra_config"] == {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 41000,
        "kv_lease_duration": 10,
        "backends": ["UCX"],
    }


def test_ucx_stays_on_loopback_and_loads_no_optional_module():
    assert dict(UCX_ENVIRONMENT) == {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^*"}


def test_a_free_loopback_port_can_be_bound_there():
    port = free_loopback_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --- what a hand-off must hold -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 31, 32, 33, 511, 512, 513, 600])
def test_a_hand_off_of_exactly_the_submitted_tokens_is_accepted(n):
    assert check_handoff(handoff(n), n, BS) is None


def test_a_hand_off_survives_the_wire():
    """vLLM writes block ids as a tuple of lists (one per KV-cache group); msgpack makes it a list of lists."""
    params = unpack(pack(handoff(600)))
    assert isinstance(params["remote_block_ids"], list)
    assert check_handoff(params, 600, BS) is None
    assert check_handoff(handoff(64, remote_block_ids=[1, 2]), 64, BS) is None  # a flat list: one group


@pytest.mark.parametrize(
    ("params", "n", "says"),
    [
        (None, 64, "no KV hand-off"),
        (handoff(64, do_remote_prefill=False), 64, "did not keep its KV"),
        (handoff(64, remote_host=""), 64, "lacks remote_host"),
        (handoff(64, remote_engine_id=None, remote_request_id=None), 64, "lacks remote_engine_id, remote_request_id"),
        (handoff(64, remote_port=0), 64, "bad handshake port"),
        (handoff(64, remote_port="5600"), 64, "bad handshake port"),
        # The migration crash: the target is given one token more than the source computed; at a block boundary
        # it needs a block more than the source exported.
        (handoff(64), 65, "the source computed 64 tokens, 65 would be submitted"),
        (handoff(63), 64, "the source computed 63 tokens, 64 would be submitted"),
        (handoff(64, blocks=3), 64, "exported [3] blocks per KV-cache group, 64 tokens need 2"),
        (handoff(64, remote_block_ids=([1, 2], [3])), 64, "exported [2, 1] blocks"),
        (handoff(64, remote_block_ids=[[1, "x"]]), 64, "not a list of block-id lists"),
        (handoff(64, remote_block_ids="1,2"), 64, "not a list of block-id lists"),
        (handoff(64, remote_block_ids=()), 64, "exported [0] blocks"),
    ],
)
def test_a_hand_off_that_does_not_match_is_refused_with_the_reason(params, n, says):
    problem = check_handoff(params, n, BS)
    assert problem is not None and says in problem


# --- vLLM's counters ---------------------------------------------------------------------------------------------


def test_stats_count_prompt_tokens_by_source_and_nixl_reads():
    s = VllmStats()
    sched = types.SimpleNamespace(
        kv_cache_usage=0.1,
        num_running_reqs=1,
        num_waiting_reqs=0,
        kv_connector_stats={
            "transfer_duration": [0.003, 0.004],
            "post_duration": [0.0001, 0.0001],
            "bytes_transferred": [1048576, 65536],
            "num_descriptors": [32, 2],
            "num_failed_transfers": [1],
            "num_failed_notifications": [],
            "num_failed_handshakes": [1],
            "num_kv_expired_reqs": [1, 1],
            "num_notifications_after_expiry": [],
        },
    )
    it = types.SimpleNamespace(
        num_preempted_reqs=0,
        prompt_token_stats=types.SimpleNamespace(computed=1, local_cache_hit=32, external_kv_transfer=567),
    )
    s.record(sched, it)
    s.record(types.SimpleNamespace(kv_cache_usage=0.0, num_running_reqs=0, num_waiting_reqs=0), it)
    assert (s.num_prompt_tokens_computed, s.num_prompt_tokens_local_hit, s.num_prompt_tokens_external) == (
        2,
        64,
        1134,
    )
    assert (s.num_kv_transfers, s.num_kv_bytes_received, s.num_kv_transfer_failures, s.num_kv_expired) == (
        2,
        1114112,
        2,
        2,
    )
    assert s.kv_transfer_s == pytest.approx(0.007)


def test_stats_of_another_connector_or_none_change_nothing():
    s = VllmStats()
    for payload in (None, {"lmcache": {"hits": 3}}, ["not", "a", "dict"]):
        s.record(
            types.SimpleNamespace(kv_cache_usage=0, num_running_reqs=0, num_waiting_reqs=0, kv_connector_stats=payload),
            None,
        )
    assert (s.num_kv_transfers, s.num_kv_transfer_failures, s.num_kv_expired, s.kv_transfer_s) == (0, 0, 0, 0.0)


# --- the wire ----------------------------------------------------------------------------------------------------


def test_the_queue_item_says_whether_the_decode_worker_pulls_and_old_items_read_as_no():
    item = RemotePrefillRequest(GenerateRequest("r", [1, 2]), 7, "backend", 10.0, 1.0, kv_transfer=True)
    assert RemotePrefillRequest.from_dict(unpack(pack(item.to_dict()))).kv_transfer is True
    old = item.to_dict()
    del old["kv_transfer"]  # a decode worker of the previous version
    assert RemotePrefillRequest.from_dict(old).kv_transfer is False


def test_the_result_carries_the_hand_off_and_old_results_read_as_none():
    result = RemotePrefillResult("r", 9, [5], 600, kv_transfer_params=handoff(600))
    back = RemotePrefillResult.from_dict(unpack(pack(result.to_dict())))
    assert back.kv_transfer_params is not None and check_handoff(back.kv_transfer_params, 600, BS) is None
    assert RemotePrefillResult.from_dict({"request_id": "r", "prefill_instance": 9}).kv_transfer_params is None


# --- the worker --------------------------------------------------------------------------------------------------


def test_a_worker_refuses_an_engine_built_for_another_role():
    engine = VllmEngine(VllmEngineConfig(model_path="/m"), role=WorkerRole.PREFILL)
    with pytest.raises(ValueError, match="a decode worker got an engine built for role prefill"):
        Worker(None, WorkerConfig(engine="vllm", role=WorkerRole.DECODE), engine)  # type: ignore[arg-type]
    Worker(None, WorkerConfig(engine="vllm", role=WorkerRole.PREFILL), engine)  # type: ignore[arg-type]
    Worker(None, WorkerConfig(role=WorkerRole.DECODE), MockEngine())  # type: ignore[arg-type]  # no role: any


# --- the benchmark's arithmetic ----------------------------------------------------------------------------------


def test_the_benchmark_alternates_abba_and_pairs_its_rounds():
    assert round_orders(4) == [("pull", "recompute"), ("recompute", "pull")] * 2
    assert ratios([10.0, 20.0], [40.0, 30.0]) == [4.0, 1.5]
    assert summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summary([]) == {"n": 0}
