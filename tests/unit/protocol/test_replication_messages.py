"""Hot-prefix replication's messages survive the trip through JSON (components/protocol/replication.py)."""

from __future__ import annotations

import json

from components.protocol.replication import ExportPrefixReply, ExportPrefixRequest


def test_an_export_request_and_its_reply_survive_the_trip_through_json():
    req = ExportPrefixRequest((2**64 - 1, 7))
    assert ExportPrefixRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    # vLLM's hand-off is opaque here; its block ids come back as lists (msgpack and JSON have no tuples).
    params = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]], "remote_port": 5600, "remote_num_tokens": 64}
    reply = ExportPrefixReply(2, tuple(range(64)), params)
    back = ExportPrefixReply.from_dict(json.loads(json.dumps(reply.to_dict())))
    assert back == reply and back.error == ""
    refused = ExportPrefixReply.from_dict(json.loads(json.dumps(ExportPrefixReply(error="no connector").to_dict())))
    assert refused == ExportPrefixReply(0, (), None, "no connector")
