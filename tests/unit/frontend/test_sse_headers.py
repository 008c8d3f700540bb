"""An SSE response's headers leave with its first chunk, in one write (``app._EventStream``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from components.frontend.app import _EventStream

pytestmark = [
    pytest.mark.unit,
    # aiohttp < 3.12 writes a response's headers at prepare whatever the class says (nothing to hold back there).
    pytest.mark.skipif(not hasattr(StreamWriter, "send_headers"), reason="aiohttp < 3.12 sends headers at once"),
]


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


class _Gen:
    """A ``Generation`` whose outputs have all arrived (``poll`` gives them) or arrive one at a time (``poll`` gives
    nothing: each is awaited)."""

    def __init__(self, texts: list[str], ready: bool) -> None:
        self._texts = texts
        self._ready = ready
        self.num_output_tokens = 0
        self.num_prompt_tokens = 7
        self.num_cached_tokens = 0

    def _next(self) -> tuple[str, str | None]:
        i = self.num_output_tokens
        self.num_output_tokens += 1
        return self._texts[i], ("length" if i == len(self._texts) - 1 else None)

    def poll(self) -> tuple[str, str | None] | None:
        return self._next() if self._ready and self.num_output_tokens < len(self._texts) else None

    def __aiter__(self) -> _Gen:
        return self

    async def __anext__(self) -> tuple[str, str | None]:
        if self.num_output_tokens >= len(self._texts):
            raise StopAsyncIteration
        return self._next()


async def _stream_of(texts: list[str], ready: bool) -> list[bytes]:
    """The writes of ``FrontendApp._stream`` for a completion streaming ``texts``, one token each."""
    from types import SimpleNamespace

    from components.frontend.app import FrontendApp

    transport = _Transport()
    writer = StreamWriter(_Protocol(transport), asyncio.get_running_loop())  # type: ignore[arg-type]
    request = make_mocked_request("POST", "/v1/completions", writer=writer, transport=transport)
    req = SimpleNamespace(include_usage=True, continuous_usage=False)
    p = SimpleNamespace(request_id="r1", model=SimpleNamespace(name="m"))
    app = SimpleNamespace(config=SimpleNamespace(request_timeout_s=60.0), _error_event=FrontendApp._error_event)
    await FrontendApp._stream(app, request, req, p, _Gen(texts, ready), False, None)  # type: ignore[arg-type]
    return transport.calls


def _events(calls: list[bytes]) -> list[bytes]:
    body = b"".join(calls).partition(b"\r\n\r\n")[2]
    out, rest = b"", body
    while rest:  # undo the chunked encoding
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        out, rest = out + rest[:n], rest[n + 2 :]
    return [e for e in out.split(b"\n\n") if e]


async def test_tokens_that_arrived_together_leave_in_one_write() -> None:
    # 64 tokens already there when the first is read (a frontend behind its workers): every chunk, the usage and
    # [DONE] in one write with the headers; 16 chunks a write before (4 writes and the end).
    texts = [f" w{i}" for i in range(64)]
    calls = await _stream_of(texts, ready=True)
    assert len(calls) == 1
    events = _events(calls)
    assert len(events) == 64 + 2 and events[-1] == b"data: [DONE]"
    assert [e.split(b'"text":')[1].split(b",")[0] for e in events[:64]] == [f'"{t}"'.encode() for t in texts]


async def test_a_stream_far_behind_still_leaves_in_pieces_and_one_token_at_a_time_is_never_held() -> None:
    big = ["x" * 1000] * 100  # ~100 KB of chunks, all there: pieces of at most ~32 KiB (and one chunk more)
    calls = await _stream_of(big, ready=True)
    assert 3 <= len(calls) <= 5
    assert all(len(c) < 32 * 1024 + 1200 + 400 for c in calls[:-1])
    assert len(_events(calls)) == 100 + 2
    # Tokens arriving one at a time: each leaves at once, in its own write (the last with usage and [DONE]).
    calls = await _stream_of([f" w{i}" for i in range(5)], ready=False)
    assert len(calls) == 5
