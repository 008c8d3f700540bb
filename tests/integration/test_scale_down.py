"""Migration-assisted scale-down (issue 26): a worker PROCESS told to leave as the planner's local connector tells it
(SIGTERM: components/planner/connectors/local.py) while long outputs run on it.

With a rescheduler (the ``Rescheduler`` class that ``kvmesh rescheduler``, a colocated frontend and a graph's
``rescheduler:`` section all run; here in the test's process, with its default policies) the worker says it is
unschedulable ("draining"), the failover policy of its role (``neutral_failover`` for aggregated workers) moves every
request to the staying worker, and the process exits as soon as it is empty: long before its requests end. Without
one the same SIGTERM is drain by waiting: the process stays until it has produced every token itself.

The leaving worker is a ``kvmesh worker`` subprocess (its real signal handling, drain and exit); the staying one runs
in this process. Clients stream from the leaving worker's ``generate`` directly (``Stream`` checks each chunk's
position on arrival), and every stream's tokens are compared with the same request run on an unmoved engine. Nothing
sleeps for a while: each step waits for its event (tokens arrived, the process exited, a stream ended).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest

from components.protocol.messages import GenerateRequest
from components.rescheduler.config import ReschedulerConfig
from components.rescheduler.loop import Rescheduler
from tests.integration.test_migration import (
    Stream,
    clients,
    gen_request,
    ready_instance_id,
    start_worker,
    unmoved,
    worker_process,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

# The leaving worker's speed: a modelled ~5 ms decode step sleeps 5 / 0.5 = ~10 ms, so 600 tokens take ~6 s or more
# of decoding; the rescheduler finds the draining worker within one 50 ms cycle of its status and moves 3 requests one
# at a time (max_migration_concurrency 1) in well under a second on this machine (docs/rescheduler.md).
SLOW = ("--speedup-ratio", "0.5", "--metrics-interval-ms", "50")
LONG_TOKENS = 600


async def leaving_worker(runtime_config: Any, namespace: str) -> tuple[Any, int]:
    proc = worker_process(runtime_config, namespace, *SLOW)
    return proc, await ready_instance_id(proc)


async def streams_on(crt: Any, namespace: str, src_id: int, requests: list[GenerateRequest]) -> list[Stream]:
    gen, _, _ = await clients(crt, namespace)
    await gen.wait_for_instances(2, timeout_s=10)
    streams = [Stream(await gen.direct(r.to_dict(), src_id)) for r in requests]
    await wait_until(lambda: all(len(s.tokens) >= 2 for s in streams), timeout_s=15)  # every one decoding
    return streams


async def exit_of(proc: Any) -> tuple[int, str]:
    """The process's exit code and its last line (``STOPPED`` after a drain)."""
    rc = await asyncio.to_thread(proc.wait, 60)
    assert proc.stdout is not None
    rest = await asyncio.to_thread(proc.stdout.read)
    return rc, rest.strip().splitlines()[-1] if rest.strip() else ""


async def test_a_leaving_worker_process_is_emptied_by_the_rescheduler_and_exits_long_before_its_requests_end(
    make_runtime, runtime_config, namespace
) -> None:
    proc, src_id = await leaving_worker(runtime_config, namespace)
    b = await start_worker(make_runtime, namespace, 1)
    crt = await make_runtime()
    requests = [gen_request(f"leave-{i}", 64 + 16 * i, LONG_TOKENS) for i in range(3)]
    expected = await unmoved(requests)
    # The default policy list (decode_load and the three failovers): scale-down needs no policy of its own.
    r = Rescheduler.from_config(
        await make_runtime(),
        namespace,
        ReschedulerConfig(enable_rescheduling=True, rescheduling_interval_ms=50, rescheduling_migrate_timeout_s=10.0),
    )
    await r.start()
    try:
        streams = await streams_on(crt, namespace, src_id, requests)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc, last = await exit_of(proc)
        exit_s = time.monotonic() - t_term
        at_exit = [len(s.tokens) for s in streams]
        assert (rc, last) == (0, "STOPPED")
        # Every request was still running when the process had gone: it did not wait for them.
        assert all(n < LONG_TOKENS for n in at_exit), (at_exit, exit_s)
        assert not any(s.task.done() for s in streams)
        # ... and each ends on the staying worker with every token once, in order (positions checked on arrival).
        for req, s in zip(requests, streams, strict=True):
            assert await s.done(timeout_s=60) == expected[req.request_id]
        moved = [p for c in r.history for p in c.results if p.num_committed]
        assert {(p.order.source_id, p.order.destination_id, p.order.policy) for p in moved} == {
            (src_id, b.instance_id, "neutral_failover")
        }
        assert all(p.order.reason.startswith("unschedulable (leaving: draining)") for p in moved), [
            p.order.reason for p in moved
        ]
        committed = sorted(rep.request_id for p in moved for rep in p.reports if rep.state == "committed")
        assert committed == sorted(q.request_id for q in requests)
    finally:
        if proc.poll() is None:
            proc.kill()
        await r.stop()
        await b.stop()


async def test_without_a_rescheduler_a_leaving_worker_process_drains_by_waiting(
    make_runtime, runtime_config, namespace
) -> None:
    proc, src_id = await leaving_worker(runtime_config, namespace)
    b = await start_worker(make_runtime, namespace, 1)
    crt = await make_runtime()
    # Shorter outputs than above (200 tokens, ~2 s at ~10 ms steps): this side waits for all of them.
    requests = [gen_request(f"wait-{i}", 64 + 16 * i, 200) for i in range(3)]
    expected = await unmoved(requests)
    try:
        streams = await streams_on(crt, namespace, src_id, requests)
        proc.send_signal(signal.SIGTERM)
        at_term = [len(s.tokens) for s in streams]
        rc, last = await exit_of(proc)
        assert (rc, last) == (0, "STOPPED")
        assert all(n < 200 for n in at_term), at_term
        # Nobody moved anything: the leaving worker produced every token itself before it exited.
        for req, s in zip(requests, streams, strict=True):
            assert await s.done(timeout_s=10) == expected[req.request_id]
        assert b.agent is not None
        assert b.agent.counters_report("mock-model").outcomes == []  # b took no migration, nor tried one
    finally:
        if proc.poll() is None:
            proc.kill()
        await b.stop()
