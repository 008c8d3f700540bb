"""Hot-prefix replication on real etcd and nats-server with in-process simulated workers: a prefix held by one
worker is copied to another through the ``import_prefix`` endpoint (off the request path: no request runs on the
destination), the router learns the new holder from its KV events, and a later request with that prefix routed by
``kv`` routing is served on the new holder from its prefix cache."""

from __future__ import annotations

import time

import pytest

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import TokenChunk
from components.rescheduler.replication import copy_prefix, import_prefix_client
from components.router import RouteRequest
from tests.integration.test_router import BS, MODEL, eventually, fleet, make_router, prompts  # noqa: F401

pytestmark = pytest.mark.integration


async def test_a_replicated_prefix_is_hit_on_its_new_holder(fleet, make_router, namespace):  # noqa: F811
    a, b = await fleet.add(2)
    router = await make_router(router_policy="kv")
    await eventually(lambda: router.members() == sorted([a.instance_id, b.instance_id]), what="discovery")
    prefix = prompts(1, 1024, seed=3)[0]  # 64 blocks of 16 tokens
    hashes = block_hashes(prefix, BS)
    await fleet.generate(a, prefix + [7] * 10, "warm")
    await eventually(lambda: router.index.overlaps(hashes).get(a.instance_id) == 64, what="a holds the prefix")
    assert router.index.overlaps(hashes).get(b.instance_id, 0) == 0

    client = await import_prefix_client(fleet.rt, namespace, "backend")
    try:
        reply = await copy_prefix(client, b.instance_id, a.instance_id, hashes, timeout_s=10.0)
        # A prefix its source does not hold is refused, not invented.
        refused = await copy_prefix(client, a.instance_id, b.instance_id, block_hashes(prompts(1, 64, 9)[0], BS), 10.0)
    finally:
        await client.close()
    assert (reply.error, reply.held_by_source, reply.imported) == ("", 64, 64)
    assert refused.imported == 0 and "holds none" in refused.error
    # The copy ran no request on b: its engine served nothing.
    assert b.engine.snapshot().num_running == 0
    await eventually(lambda: router.index.overlaps(hashes).get(b.instance_id) == 64, what="b seen as a holder")

    # The original holder leaves: kv routing now sends the prefix to b, where all 64 blocks (1,024 tokens) hit.
    await a.stop()
    await eventually(lambda: router.members() == [b.instance_id], what="a excluded")
    req = router.prepare(RouteRequest(prefix + [5] * 20, MODEL, time.monotonic()))
    d = router.select(req)
    assert (d.instance_id, d.overlap_blocks) == (b.instance_id, 64), d.reason
    router.on_routed("after", d, req)
    items = await fleet.generate(b, list(req.token_ids), "after")
    router.on_first_token("after")
    router.on_finished("after")
    assert TokenChunk.from_dict(items[0]).num_cached_tokens == 1024
