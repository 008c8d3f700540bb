"""The migration wire contract round-trips, and the fields migration added to the generation messages."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from components.protocol.messages import FinishReason, GenerateRequest, SamplingParams, TokenChunk
from components.protocol.metadata import WorkerMetadata
from components.protocol.migration import (
    AbortReply,
    AbortRequest,
    MigrateInMessage,
    MigrateInOp,
    MigrateInReply,
    MigrateRequest,
    MigratingRequest,
    MigrationMode,
    MigrationReport,
    WorkerStatus,
)

pytestmark = pytest.mark.unit


def wire(d: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(d), raw=False)


def test_every_migration_message_round_trips_through_msgpack() -> None:
    req = MigratingRequest(
        "r1",
        [1, 2, 3],
        [7, 8],
        SamplingParams(max_tokens=9, seed=5, temperature=0.7, stop_token_ids=[4]),
        num_computed_tokens=4,
        reply={"batch_subject": "_INBOX.x.b", "key": 3, "address": "127.0.0.1:5", "inbox": "_INBOX.x.3"},
        next_seq=12,
        arrival_s=1.5,
        num_cached_tokens=2,
    )
    assert req.position == 2 and req.all_token_ids == [1, 2, 3, 7, 8]
    msgs = [
        MigrateRequest(0x1234, "backend", "NUM_REQ", 2, "LCR", "balance", ["a"], "recompute"),
        MigrationReport("r1", "committed", mode="live", num_stages=2, downtime_s=0.01),
        req,
        MigrateInMessage(MigrateInOp.COMMIT, "m1", "r1", 5, "subj", 0, [], req),
        MigrateInMessage(MigrateInOp.COPY, "m1", "r1", first_block=2, token_ids=list(range(32))),
        MigrateInReply(False, "at capacity", 3),
        AbortRequest("r1", "client", 1),
        AbortReply(True, 77),
        WorkerStatus(False, "engine died", 3),
    ]
    for m in msgs:
        assert type(m).from_dict(wire(m.to_dict())) == m  # type: ignore[attr-defined]


def test_generate_request_continuation_says_which_tokens_are_outputs() -> None:
    r = GenerateRequest("r", [1, 2, 3, 9, 9], SamplingParams(max_tokens=4), num_output_tokens=2)
    assert r.prompt_token_ids == [1, 2, 3]
    back = GenerateRequest.from_dict(wire(r.to_dict()))
    assert back == r
    assert "num_output_tokens" not in GenerateRequest("r", [1]).to_dict()  # a new request's wire form is unchanged
    with pytest.raises(ValueError, match="num_output_tokens"):
        GenerateRequest.from_dict({"request_id": "r", "token_ids": [1, 2], "num_output_tokens": 2})


def test_token_chunk_carries_its_position_and_defaults_to_zero_from_an_older_peer() -> None:
    c = TokenChunk([5, 6], position=17)
    assert TokenChunk.from_dict(wire(c.to_dict())).position == 17
    assert TokenChunk.from_dict({"token_ids": [1], "finish_reason": None}).position == 0


def test_worker_metadata_announces_its_migration_mode() -> None:
    m = WorkerMetadata(model="m", migration_mode=MigrationMode.LIVE)
    d = m.to_dict()
    assert d["migration_mode"] == "live"
    assert WorkerMetadata.from_dict(d).migration_mode == "live"
    assert WorkerMetadata.from_dict({"model": "m"}).migration_mode == ""


def test_a_kv_transfer_commit_carries_the_hand_off_and_older_peers_read_none() -> None:
    handoff = {"do_remote_prefill": True, "remote_block_ids": ([1, 2, 3],), "remote_port": 41000, "tp_size": 1}
    req = MigratingRequest("r", [1] * 64, [2] * 8, SamplingParams(max_tokens=20), 72, kv_transfer_params=handoff)
    back = MigratingRequest.from_dict(wire(req.to_dict()))
    # msgpack turns vLLM's tuple of block lists into a list of lists (nixl.check_handoff reads either).
    assert back.kv_transfer_params == {**handoff, "remote_block_ids": [[1, 2, 3]]}
    old = req.to_dict()
    del old["kv_transfer_params"]
    assert MigratingRequest.from_dict(old).kv_transfer_params is None
    assert MigrateInReply.from_dict(wire(MigrateInReply(True, mode="kv_transfer").to_dict())).mode == "kv_transfer"
    assert MigrateInReply.from_dict({"ok": True}).mode == ""  # an older destination says nothing of its mode
    assert MigrationMode("kv_transfer") is MigrationMode.KV_TRANSFER


def test_sampling_params_wire_form_names_every_field_as_asdict_would() -> None:
    # to_dict is spelled out for speed (the frontend builds one per request): a field added to the dataclass and
    # forgotten there would silently fall back to its default on the worker.
    s = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=3, seed=7, stop_token_ids=[4], ignore_eos=True)
    assert s.to_dict() == dataclasses.asdict(s)
    assert s.to_dict()["stop_token_ids"] is not s.stop_token_ids  # a copy, as asdict gives
    assert SamplingParams.from_dict(wire(s.to_dict())) == s


def test_a_streamed_token_chunk_leaves_out_its_zero_counters_and_reads_back_the_same() -> None:
    later = TokenChunk([9], position=5)
    assert later.to_dict() == {"token_ids": [9], "finish_reason": None, "position": 5}  # per token: 3 keys
    first = TokenChunk([1], num_prompt_tokens=40, num_cached_tokens=32, num_host_cached_tokens=16)
    last = TokenChunk([], finish_reason=FinishReason.LENGTH, position=64)
    for c in (later, first, last):
        assert TokenChunk.from_dict(wire(c.to_dict())) == c
    assert first.to_dict()["num_cached_tokens"] == 32 and last.to_dict()["finish_reason"] == "length"
