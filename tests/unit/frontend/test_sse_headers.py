"""An SSE response's headers leave with its first chunk, in one write (``app._EventStream``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from components.frontend.app import _EventStream

pytestmark = pytest.mark.unit


class _Transport:
    """Records each write call (one call: one syscall on a real socket)."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.calls.append(bytes(data))

    def writelines(self, data: Any) -> None:
        self.calls.append(b"".join(data))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Protocol:
    def __init__(self, transport: _Transport) -> None:
        self.transport = transport
        self._paused = False
        self._reading_paused = False

    async def _drain_helper(self) -> None:
        return None


async def _stream_writes(make: Any) -> tuple[int, list[bytes]]:
    """(writes made by ``prepare``, every write) for a response of class ``make`` streaming two chunks and [DONE]."""
    transport = _Transport()
    writer = StreamWriter(_Protocol(transport), asyncio.get_running_loop())  # type: ignore[arg-type]
    request = make_mocked_request("POST", "/v1/completions", writer=writer, transport=transport)
    response = make(status=200, headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    at_prepare = len(transport.calls)
    await response.write(b"data: first\n\n")
    await response.write(b"data: second\n\n")
    await response.write_eof(b"data: [DONE]\n\n")
    return at_prepare, transport.calls


async def test_headers_leave_with_the_first_chunk_in_one_write() -> None:
    at_prepare, calls = await _stream_writes(_EventStream)
    # prepare wrote nothing; then one write per call of write/write_eof: 3, where a StreamResponse takes 4.
    assert at_prepare == 0
    assert len(calls) == 3
    assert calls[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Type: text/event-stream\r\n" in calls[0]
    _, _, body = calls[0].partition(b"\r\n\r\n")
    assert body == b"d\r\ndata: first\n\n\r\n"  # chunked: the first chunk follows its headers in the same write
    assert calls[1] == b"e\r\ndata: second\n\n\r\n"
    assert calls[2].endswith(b"0\r\n\r\n")


async def test_the_bytes_on_the_wire_are_those_of_a_stream_response() -> None:
    from aiohttp import web

    ours = b"".join((await _stream_writes(_EventStream))[1])
    at_prepare, calls = await _stream_writes(web.StreamResponse)
    assert (at_prepare, len(calls)) == (1, 4)  # aiohttp's own: the headers alone at prepare, then three writes
    theirs = b"".join(calls)
    strip = [line for line in ours.split(b"\r\n") if not line.startswith(b"Date: ")]
    assert strip == [line for line in theirs.split(b"\r\n") if not line.startswith(b"Date: ")]
