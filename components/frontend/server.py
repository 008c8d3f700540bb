"""``Frontend``: one frontend's parts wired together (model registry, router, service, HTTP server) over a runtime.

    frontend = Frontend(FrontendConfig(port=0), runtime)
    url = await frontend.start()      # listening; models appear as their workers register
    ...
    await frontend.stop()             # stop listening, let requests finish (shutdown_timeout_s), release the rest

The runtime is the caller's: ``stop`` does not shut it down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp import web

from components.fleet.live import LiveFleet
from components.frontend.app import FrontendApp
from components.frontend.config import FrontendConfig
from components.frontend.metrics import FrontendMetrics
from components.frontend.migration_counters import MigrationCountersFeed
from components.frontend.models import ModelRegistry
from components.frontend.request_stats import RequestStatsPublisher
from components.frontend.service import FrontendService
from components.frontend.tokenizer import Tokenizer, load_tokenizer
from components.router import Router
from components.router.feed import RouterFeed
from components.runtime import Runtime

logger = logging.getLogger(__name__)


class Frontend:
    def __init__(
        self,
        config: FrontendConfig,
        runtime: Runtime,
        tokenizer_loader: Callable[[str], Tokenizer] = load_tokenizer,
    ) -> None:
        self.config = config
        self.runtime = runtime
        self.router = Router(config)
        # The fleet view the router reads: load reports, worker statuses and the prefill workers' queue reports (the
        # prefill-queue gauges of /metrics read its queues); membership comes from the registry below.
        # Not the frontends' request reports: the planner reads those, the router does not.
        self.fleet = LiveFleet(
            runtime, config.namespace, state=self.router.fleet, watch_membership=False, follow_requests=False
        )
        # The fleet view (started and stopped with it), KV events (KV policies) and replica sync.
        self.feed = RouterFeed(runtime, self.router, config.namespace, config.components, fleet=self.fleet)
        self.metrics = FrontendMetrics(
            policy=self.router.policy.name,
            worker_metadata=self.router.worker_metadata,
            router_view=self.router.load_view,
            prefill_queues=self.fleet.state.queues,
        )
        # Workers' migration counters -> kvmesh_worker_migrations_total and friends.
        self.migration_counters = MigrationCountersFeed(runtime, config.namespace, self.metrics.migration_counters)
        self.registry = ModelRegistry(runtime, config.namespace, config.components, self.router, tokenizer_loader)
        self.service = FrontendService(config, self.registry, self.router, self.metrics)
        self.app = FrontendApp(config, self.service, self.registry, self.metrics)
        # This process's request reports for the SLA planner, under its router's replica id (one per replica).
        self.request_stats = RequestStatsPublisher(
            runtime,
            config.namespace,
            self.service.request_stats,
            lambda: self.registry.models.keys(),  # the registry replaces its dict on each change
            self.router.replica_id,
            config.request_stats_interval_s,
        )
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Follow the workers, then listen; returns the base URL (``http://host:port``, the real port if 0)."""
        await self.feed.start()  # first: workers the registry announces get their KV state fetched as they appear
        await self.migration_counters.start()
        await self.registry.start()
        await self.request_stats.start()
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its request upstream.
        runner = web.AppRunner(
            self.app.build(),
            handler_cancellation=True,
            access_log=None,  # one log line per request would cost more than the rest of the request's Python
            shutdown_timeout=self.config.shutdown_timeout_s,
        )
        await runner.setup()
        self._runner = runner
        # reuse_port: other replicas of this frontend listen on the same port (components/frontend/replicas.py).
        site = web.TCPSite(runner, self.config.host, self.config.port, reuse_port=self.config.reuse_port or None)
        await site.start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        logger.info("frontend for namespace %s listening on %s", self.config.namespace, self.url)
        return self.url

    async def stop(self) -> None:
        """Stop accepting connections, give requests in flight ``shutdown_timeout_s`` to finish, release the rest."""
        runner, self._runner = self._runner, None
        t0 = time.monotonic()
        try:
            if runner is not None:
                await runner.cleanup()
                logger.info("HTTP server closed after %.1f s", time.monotonic() - t0)
        finally:
            try:
                await self.registry.close()
            finally:
                try:
                    await self.request_stats.stop()  # after the server: the requests that drained are in its last
                finally:
                    try:
                        await self.feed.stop()
                    finally:
                        await self.migration_counters.stop()
                        logger.info("frontend stopped in %.1f s", time.monotonic() - t0)
