"""``GET /metrics`` for a process that serves nothing else over HTTP (the planner, a standalone rescheduler): a small
aiohttp server that answers each scrape with what its metrics object renders (Prometheus' text format), on
``host:port`` (loopback by the callers' defaults; port 0: a free one, read back from ``url`` once started).

The frontend, which is an HTTP server already, serves its ``/metrics`` from its own app. Imports aiohttp and
prometheus_client only: nothing of the mesh (etcd, NATS) loads with it.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class Renders(Protocol):
    def render(self) -> bytes:
        """The metrics in Prometheus' text exposition format."""
        ...


class MetricsServer:
    """``GET /metrics`` on ``host:port`` (0: a free port) for one metrics object (``Renders``)."""

    def __init__(self, metrics: Renders, host: str, port: int) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Listen; returns (and keeps in ``url``) the scrape URL, with the port bound. Raises ``OSError`` when the
        address cannot be bound (nothing is left listening)."""
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in str(host) else host
        self.url = f"http://{shown}:{port}/metrics"
        return self.url

    async def _handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
