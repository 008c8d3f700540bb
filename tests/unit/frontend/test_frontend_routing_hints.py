"""Routing hints the frontend takes from a request's headers and its OpenAI ``user`` field."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from components.frontend.errors import InvalidRequestError
from components.frontend.service import RoutingHints, routing_hints

pytestmark = pytest.mark.unit


def test_no_hints():
    assert routing_hints(CIMultiDict(), None) == RoutingHints()


def test_program_id_prefers_the_header_then_user_then_the_session_header():
    both = CIMultiDict({"X-Program-Id": "agent-7", "x-session-id": "s1"})
    assert routing_hints(both, "alice").program_id == "agent-7"
    assert routing_hints(CIMultiDict({"x-session-id": "s1"}), "alice").program_id == "alice"
    assert routing_hints(CIMultiDict({"x-session-id": "s1"}), None).program_id == "s1"
    assert routing_hints(CIMultiDict({"x-program-id": ""}), "") == RoutingHints()


def test_program_end_header():
    assert routing_hints(CIMultiDict({"x-program-end": "true"}), "u").ends_program
    assert routing_hints(CIMultiDict({"x-program-end": "1"}), "u").ends_program
    assert not routing_hints(CIMultiDict({"x-program-end": "no"}), "u").ends_program


def test_a_pin_is_a_hex_instance_id_as_kvmesh_status_prints_it():
    assert routing_hints(CIMultiDict({"X-Worker-Instance-Id": "7f3a"}), None).pinned_instance_id == 0x7F3A
    assert routing_hints(CIMultiDict({"x-worker-instance-id": "0x10"}), None).pinned_instance_id == 16
    with pytest.raises(InvalidRequestError, match="hex"):
        routing_hints(CIMultiDict({"x-worker-instance-id": "worker-3"}), None)
