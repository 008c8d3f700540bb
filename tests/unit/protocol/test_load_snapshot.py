"""A worker's load report on the wire (components/protocol/messages.py, ``LoadSnapshot``)."""

from __future__ import annotations

import json

import pytest

from components.protocol.messages import LoadSnapshot

pytestmark = pytest.mark.unit


def test_a_load_report_round_trips_with_its_steps_prefill_chunk():
    snap = LoadSnapshot(1.5, 0.25, 1000, 250, 12, 3, 4000, 0, 12, 24_000, num_prefill_tokens=2048)
    assert LoadSnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap


def test_a_report_from_a_worker_that_predates_the_chunk_field_still_reads():
    # A worker of an older version sends no num_prefill_tokens: the report reads, the chunk unknown (None), which
    # the SLA planner replaces by the queue (components/planner/sla/itl.py).
    d = LoadSnapshot(1.5, 0.25, 1000, 250, 12, 3, 4000, 0, 12, 24_000, num_prefill_tokens=2048).to_dict()
    del d["num_prefill_tokens"]
    assert LoadSnapshot.from_dict(d).num_prefill_tokens is None
    del d["batch_size"]
    with pytest.raises(KeyError):  # a field without a default is still required
        LoadSnapshot.from_dict(d)
