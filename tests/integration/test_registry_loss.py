"""etcd coming back without its data, and NATS restarting, on real servers: the mesh keeps serving.

- Registry loss: every registration vanishes with etcd's data while the instances still run. A client keeps them
  (it never sees an empty instance list), requests keep succeeding, and the instances re-register within about a
  second of etcd's return (keep-alive on its back-off, not after another TTL/3).
- An instance that died while the registry was gone is dropped as soon as the request plane says nobody serves it.
- A request made while nats-server is down waits for it and succeeds once it is back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from components.runtime import collect
from components.runtime.request_plane import RequestContext
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


async def counter(body: dict[str, int], ctx: RequestContext) -> AsyncIterator[dict[str, int]]:
    for i in range(body["n"]):
        yield {"i": i}


async def test_registry_loss_keeps_live_instances_routable_until_they_re_register(make_runtime, etcd_server, namespace):
    servers = [await make_runtime(), await make_runtime()]
    served = [await rt.namespace(namespace).component("backend").endpoint("generate").serve(counter) for rt in servers]
    ids = {s.instance_id for s in served}
    front = await make_runtime()
    client = await front.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(2)
    sizes: list[int] = []
    client.on_change(lambda: sizes.append(len(client.instance_ids())))

    results: list[int] = []
    failures: list[BaseException] = []
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            try:
                results.append(len(await collect(await client.generate({"n": 3}))))
            except Exception as e:  # noqa: BLE001 - counted and asserted on below
                failures.append(e)
            await asyncio.sleep(0.01)

    loader = asyncio.ensure_future(load())
    etcd_server.stop()
    etcd_server.wipe()
    await asyncio.sleep(0.5)  # the scenario: etcd is away for a while, then comes back empty
    etcd_server.start()
    back = time.monotonic()
    fresh = await make_runtime()

    async def registered() -> set[int]:
        return {i.instance_id for i in await fresh.namespace(namespace).list_instances()}

    while await registered() != ids:
        assert time.monotonic() - back < 5, "the instances did not re-register within 5 s of etcd's return"
        await asyncio.sleep(0.05)
    reregistered_s = time.monotonic() - back
    await wait_until(lambda: len(results) > 20, 5)
    stop.set()
    await loader

    assert failures == []
    assert results and set(results) == {3}
    assert 0 not in sizes, f"the client's instance list went empty: {sizes}"
    assert set(client.instance_ids()) == ids
    assert client.num_vanished_kept == 2
    # Keep-alive retries on its back-off (capped at reconnect_backoff_max_s, 2 s): not a TTL/3 plus back-off.
    assert reregistered_s < 3.0


async def test_an_instance_that_died_while_the_registry_was_gone_is_dropped_at_once(
    make_runtime, etcd_server, namespace
):
    alive_rt, dying_rt = await make_runtime(), await make_runtime()
    alive = await alive_rt.namespace(namespace).component("backend").endpoint("generate").serve(counter)
    dying = await dying_rt.namespace(namespace).component("backend").endpoint("generate").serve(counter)
    front = await make_runtime()
    client = await front.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(2)

    etcd_server.stop()
    etcd_server.wipe()
    # It dies while etcd is away: no keep-alive, no re-registration, nobody on its request-plane subject.
    await dying_rt.discovery.close(revoke=False)
    await dying.server.stop()
    etcd_server.start()
    await wait_until(lambda: client.instance_ids() == [alive.instance_id], 8)
    # The live one was kept all along and answers.
    assert [x["i"] for x in await collect(await client.generate({"n": 2}))] == [0, 1]
    assert dying.instance_id not in client.instance_ids()


async def test_a_request_made_while_nats_is_down_waits_for_it(make_runtime, nats_server, namespace):
    rt = await make_runtime()
    await rt.namespace(namespace).component("backend").endpoint("generate").serve(counter)
    front = await make_runtime(bus_wait_s=15.0)
    client = await front.namespace(namespace).component("backend").endpoint("generate").client()
    await client.wait_for_instances(1)

    nats_server.stop()
    await wait_until(lambda: not front.bus.is_connected, 5)
    pending = asyncio.ensure_future(collect(await_generate(client)))
    await asyncio.sleep(0.5)  # the scenario: the outage lasts a while
    assert not pending.done()
    nats_server.start()
    got = await asyncio.wait_for(pending, 15)
    assert [x["i"] for x in got] == [0, 1, 2]


async def await_generate(client) -> AsyncIterator[dict[str, int]]:
    stream = await client.generate({"n": 3})
    async for item in stream:
        yield item
