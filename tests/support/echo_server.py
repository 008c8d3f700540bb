"""A serving process for integration tests: serves ``<ns>/backend/generate`` and prints ``READY <instance hex>``.

The handler streams ``n`` items, one every ``delay_s``; it records cancellations by publishing on the event plane
topic ``handler_cancelled`` so a test in another process can see them.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from components.runtime import Runtime, RuntimeConfig


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--nats", required=True)
    ap.add_argument("--namespace", default="t")
    ap.add_argument("--lease-ttl-s", type=int, default=3)
    args = ap.parse_args()
    cfg = RuntimeConfig(etcd_endpoints=[args.etcd], nats_url=args.nats, lease_ttl_s=args.lease_ttl_s)
    rt = await Runtime.connect(cfg)
    ns = rt.namespace(args.namespace)

    async def handler(body, ctx):
        try:
            for i in range(body.get("n", 1)):
                if body.get("delay_s"):
                    await asyncio.sleep(body["delay_s"])
                yield {"i": i}
        except asyncio.CancelledError:
            await ns.events.publish("handler_cancelled", {"request_id": ctx.request_id})
            raise

    served = await ns.component("backend").endpoint("generate").serve(handler, metadata={"pid": "child"})
    # The handler before READY: a test may send SIGTERM as soon as it reads the line, and on a busy machine that
    # could reach this process before the next statement ran (the default action would kill it, lease and all).
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"READY {served.instance_id:x}", flush=True)
    await stop.wait()
    await rt.shutdown(drain_timeout_s=10)
    print("STOPPED", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
