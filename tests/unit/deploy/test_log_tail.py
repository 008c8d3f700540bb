"""The tail of a watcher's log read after its process exited: circus copies the output into the file on its own
schedule, so the reader waits until the file stops growing (bounded)."""

import asyncio
import time

from components.deploy.local import settled_tail, tail


def append(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


async def test_lines_written_after_the_read_begins_are_in_the_tail(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("starting\n")

    async def late_writer() -> None:
        await asyncio.sleep(0.1)  # the redirector drains the pipe a moment after the exit was seen
        append(log, "ValueError: KVMESH_LEASE_TTL_S='soon' is not a whole number\n")

    writer = asyncio.create_task(late_writer())
    got = await settled_tail(log, quiet_s=0.25, timeout_s=5.0)
    await writer
    assert tail(log) == got
    assert got.splitlines() == ["starting", "ValueError: KVMESH_LEASE_TTL_S='soon' is not a whole number"]


async def test_a_file_that_keeps_growing_is_read_at_the_deadline(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("")
    stop = asyncio.Event()

    async def chatty() -> None:
        n = 0
        while not stop.is_set():
            append(log, f"line {n}\n")
            n += 1
            await asyncio.sleep(0.02)

    task = asyncio.create_task(chatty())
    t0 = time.monotonic()
    got = await settled_tail(log, quiet_s=0.25, timeout_s=0.5)
    elapsed = time.monotonic() - t0
    stop.set()
    await task
    assert 0.5 <= elapsed < 5.0
    assert got.splitlines()[-1].startswith("line ")


async def test_a_missing_log_gives_an_empty_tail(tmp_path):
    assert await settled_tail(tmp_path / "absent.log", quiet_s=0.05, timeout_s=0.5) == ""
