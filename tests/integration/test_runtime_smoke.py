import pytest

from components.runtime import collect

pytestmark = pytest.mark.integration


async def test_serve_and_call(make_runtime, namespace):
    server_rt = await make_runtime()
    client_rt = await make_runtime()

    async def handler(body, ctx):
        for i in range(body["n"]):
            yield {"i": i, "rid": ctx.request_id}

    ep = server_rt.namespace(namespace).component("backend").endpoint("generate")
    served = await ep.serve(handler, metadata={"model": "m"})
    client = await client_rt.namespace(namespace).component("backend").endpoint("generate").client()
    ids = await client.wait_for_instances(1, timeout_s=5)
    assert ids == [served.instance_id]
    items = await collect(await client.generate({"n": 5}))
    assert [x["i"] for x in items] == [0, 1, 2, 3, 4]
