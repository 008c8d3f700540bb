"""KvEvent as it crosses the event plane: ``from_dict`` reads what ``to_dict`` and msgpack give, every field, and
refuses an unknown kind (a router parses ~7 of them per request served, so the parsing takes shortcuts: the kind
through a dict, msgpack's list of hashes kept as it is)."""

import msgpack
import pytest

from components.protocol.messages import KV_MEDIUM_HOST, KvEvent, KvEventKind

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "ev",
    [
        KvEvent(7, KvEventKind.BLOCK_STORED, [1, 2**64 - 1], 5, 16),
        KvEvent(8, KvEventKind.BLOCK_STORED, [3], None, 16, KV_MEDIUM_HOST),
        KvEvent(9, KvEventKind.BLOCK_REMOVED, [4, 5]),
        KvEvent(10, KvEventKind.ALL_CLEARED),
    ],
)
def test_from_dict_reads_back_what_to_dict_sends_through_msgpack(ev):
    back = KvEvent.from_dict(msgpack.unpackb(msgpack.packb(ev.to_dict()), raw=False))
    assert back == ev
    assert back.kind is ev.kind and type(back.block_hashes) is list


def test_from_dict_fills_defaults_copies_a_non_list_and_refuses_an_unknown_kind():
    ev = KvEvent.from_dict({"event_id": 1, "kind": "removed", "block_hashes": (3, 4)})
    assert ev == KvEvent(1, KvEventKind.BLOCK_REMOVED, [3, 4], None, 0, None) and type(ev.block_hashes) is list
    assert KvEvent.from_dict({"event_id": 2, "kind": "cleared", "block_hashes": None}).block_hashes == []
    assert KvEvent.from_dict({"event_id": 3, "kind": KvEventKind.BLOCK_STORED}).kind is KvEventKind.BLOCK_STORED
    with pytest.raises(ValueError):
        KvEvent.from_dict({"event_id": 4, "kind": "evicted"})
    with pytest.raises(KeyError):
        KvEvent.from_dict({"kind": "stored"})
