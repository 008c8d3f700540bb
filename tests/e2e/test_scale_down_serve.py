"""Migration-assisted scale-down end to end: ``kvmesh serve graphs/mock_scale_down.yaml`` (two simulated workers, a
round-robin frontend, the graph's ``rescheduler:`` section as its own watcher), long completions streamed through the
frontend, and the planner's local connector removing a worker (``set_pool_size(decode, 1)``).

The connector's call returns once the victim has exited and its watcher is gone; with the rescheduler that is while
every completion is still streaming (they are moved to the staying worker), and each then gets all its tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from components.cli.bench.scale_down import SseStream
from components.planner.connectors.local import LocalConnector
from components.planner.policy import Pool
from components.rescheduler.status import status_prefix
from components.runtime import Runtime, RuntimeConfig
from tests.e2e.test_serve import ROOT, Serve, serving
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

GRAPH = ROOT / "graphs" / "mock_scale_down.yaml"
NS, MODEL = "mock-scale-down", "tiny-llama"
# 1,500 outputs at the simulated engine's ~5.4 ms decode steps (docs/rescheduler.md) take ~8 s; the rescheduler's
# 100 ms cycles find the leaving worker within a cycle of its status and move 3 requests in well under a second.
TOKENS = 1500


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Serve]:
    state_dir = tmp_path_factory.mktemp("state")
    sets = ["rescheduler.rescheduling_interval_ms=100"]
    with serving(state_dir, *[x for s in sets for x in ("--set", s)], graph=GRAPH) as serve:
        serve.wait_ready()
        yield serve


async def test_a_planner_removing_a_worker_gets_it_emptied_by_migration_and_every_completion_ends_whole(served):
    import aiohttp

    st = served.state(NS)
    assert [w.name for w in st.watchers if w.kind == "worker"] == [f"{NS}-mock-0", f"{NS}-mock-1"]
    assert st.watcher(f"{NS}-rescheduler") is not None
    victim = st.watcher(f"{NS}-mock-1")  # the pool's last watcher: the one the connector removes
    assert victim is not None
    [proc] = victim.processes
    rt = await Runtime.connect(RuntimeConfig(etcd_endpoints=st.etcd_endpoints, nats_url=st.nats_url))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            body = {"model": MODEL, "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            # Six completions, round robin: three on each worker.
            streams = [
                SseStream(session, str(st.frontend_url), body | {"prompt": [1 + (7 * i + k) % 250 for k in range(64)]})
                for i in range(6)
            ]
            await wait_until(lambda: all(len(s.times) >= 4 for s in streams), timeout_s=60)
            await LocalConnector(rt, NS, MODEL, served.state_dir).set_pool_size(Pool.DECODE, 1)
            # The victim has exited and its watcher is gone, and not one completion has ended: it did not wait.
            assert not proc.alive()
            assert served.state(NS).watcher(victim.name) is None
            assert not any(s.task.done() for s in streams)
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 90)
        assert [(s.error, s.num_tokens) for s in streams] == [(None, TOKENS)] * 6
        # The rescheduler's own account (its status for kvmesh status): the victim's three requests, moved by the
        # aggregated workers' failover policy.
        [raw] = (await rt.discovery.get_prefix(status_prefix(NS))).values()
        totals = json.loads(raw)["totals"]
        assert totals["neutral_failover"]["committed"] == 3, totals
    finally:
        await rt.shutdown(drain_timeout_s=1.0)
