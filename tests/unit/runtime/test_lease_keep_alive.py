"""The etcd lease keep-alive loop ends when it is cancelled, even when the cancel lands as a refresh completes.

On Python 3.11 ``asyncio.wait_for`` returns the inner result instead of raising when the outer task is cancelled in
the same loop iteration as the inner call completes (fixed in 3.12), so a ``while True`` loop around it runs on and
whoever awaits it after the cancel (``EtcdDiscovery.close``, ``revoke_lease``) waits forever. Seen in CI as a test
teardown hung in ``Runtime.shutdown`` past the 120 s timeout (tests/integration/test_runtime.py), and as a prefill
worker whose stop hung at revoking its lease (tests/integration/test_disagg.py, its log: "revoking lease of worker
...: discovery is closed" once the teardown closed discovery under it).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from components.runtime.config import RuntimeConfig
from components.runtime.discovery import EtcdDiscovery, _LeaseState

pytestmark = pytest.mark.unit


class RefreshOnDemand:
    """An etcd client stand-in whose lease refresh answers when the test says so."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.reply: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    async def refresh_lease(self, lease_id: int) -> object:
        self.called.set()
        return await self.reply


async def test_a_cancel_that_lands_as_a_refresh_completes_ends_the_keep_alive():
    d = EtcdDiscovery(RuntimeConfig(etcd_endpoints=["http://127.0.0.1:1"]))
    client = RefreshOnDemand()
    d._client = client  # type: ignore[assignment]
    st = _LeaseState(handle=1, ttl_s=1, server_id=7)  # refreshes every 1/3 s
    task = asyncio.ensure_future(d._keep_alive(st))
    await asyncio.wait_for(client.called.wait(), 5)
    # The reply and the cancel in one step: the loop sees both in the same iteration.
    client.reply.set_result(SimpleNamespace(TTL=1))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)  # the old loop swallowed the cancel and refreshed on: TimeoutError here
