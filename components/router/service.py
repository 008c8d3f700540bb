"""The standalone router (``kvmesh router``): a ``Router`` and its ``RouterFeed`` served on the mesh.

    service = RouterService(RouterServiceConfig(namespace="demo", router_policy="kv"), runtime)
    await service.start()        # follows the workers, serves 'route' and 'report' (protocol.py)
    ...
    await service.stop()         # deregisters, says bye to the other replicas, releases the feed

Callers place a request with ``route`` (``RouterClient.route``), send it to the chosen worker themselves, and
``report`` its first token and its end, so the router's load counts stay exact. Any replica may receive any call:
with ``router_replica_sync`` (on by default here, since replicas are the point of a standalone router) every replica
counts every replica's assignments.

``RouterClient`` is the caller's side: a runtime client of the ``route``/``report`` endpoints, any replica.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from components.router.adapter import Router
from components.router.config import RouterServiceConfig
from components.router.errors import NoWorkersError, RouterProtocolError
from components.router.feed import RouterFeed
from components.router.protocol import (
    ENDPOINT_REPORT,
    ENDPOINT_ROUTE,
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    EVENT_PROGRAM_END,
    RouteCall,
    decision_from_dict,
    decision_to_dict,
)
from components.router.types import DecisionKind, RouteDecision, RouteRequest
from components.runtime import Client, RequestContext, Runtime, ServedEndpoint, collect

logger = logging.getLogger(__name__)


class RouterService:
    def __init__(self, config: RouterServiceConfig, runtime: Runtime) -> None:
        self.config = config
        self.runtime = runtime
        # The replica id on the sync topic is the instance id on discovery: one name for one router.
        self.instance_id = secrets.randbits(63)
        self.router = Router(config, replica_id=self.instance_id)
        self.feed = RouterFeed(runtime, self.router, config.namespace, config.components, watch_workers=True)
        self._served: list[ServedEndpoint] = []

    async def start(self) -> None:
        await self.feed.start()
        comp = self.runtime.namespace(self.config.namespace).component(self.config.component)
        meta = {"kind": "router", "policy": self.config.router_policy, "components": self.config.components}
        for name, handler in ((ENDPOINT_REPORT, self._report), (ENDPOINT_ROUTE, self._route)):
            self._served.append(await comp.endpoint(name).serve(handler, metadata=meta, instance_id=self.instance_id))
        logger.info("router %x serving %s/%s", self.instance_id, self.config.namespace, self.config.component)

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        try:
            for served in reversed(self._served):  # route first: no new placements
                try:
                    await served.stop(drain_timeout_s=drain_timeout_s)
                except Exception as e:  # noqa: BLE001 - release the rest
                    logger.warning("stopping %s: %s", served.info.subject, e)
            self._served.clear()
        finally:
            await self.feed.stop()

    # --- handlers ---------------------------------------------------------------------------------------------------

    def route(self, call: RouteCall) -> RouteDecision:
        """Place one request (and record it, when the call names a request id)."""
        request = RouteRequest(
            call.token_ids,
            call.model,
            time.monotonic(),
            program_id=call.program_id,
            ends_program=call.ends_program,
            pinned_instance_id=call.pinned_instance_id,
            excluded_instance_ids=frozenset(call.excluded_instance_ids),
        )
        request = self.router.prepare(request)
        try:
            decision = self.router.select(request)
        except NoWorkersError as e:
            return RouteDecision(None, e.reason, kind=DecisionKind.NOWHERE)
        if call.request_id is not None:
            self.router.on_routed(call.request_id, decision, request)
        return decision

    async def _route(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        yield decision_to_dict(self.route(RouteCall.from_dict(body)))

    async def _report(self, body: Any, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        try:
            event = body["event"]
            if event == EVENT_PROGRAM_END:
                known = self.router.end_program(str(body["model"]), str(body["program_id"]))
            else:
                rid = str(body["request_id"])
                known = self.router.is_inflight(rid)
                if event == EVENT_FIRST_TOKEN:
                    self.router.on_first_token(rid)
                elif event == EVENT_FINISHED:
                    self.router.on_finished(rid)
                else:
                    raise RouterProtocolError(f"unknown report event {event!r}")
        except (KeyError, TypeError) as e:
            raise RouterProtocolError(f"malformed report: {e!r}") from None
        yield {"known": known}


class RouterClient:
    """Calls a namespace's standalone routers (any replica: they share their assignments)."""

    def __init__(self, client: Client, report_client: Client) -> None:
        self._route = client
        self._report = report_client

    @classmethod
    async def connect(
        cls, runtime: Runtime, namespace: str, component: str = "router", wait_s: float = 10.0
    ) -> RouterClient:
        comp = runtime.namespace(namespace).component(component)
        route = await comp.endpoint(ENDPOINT_ROUTE).client()
        report = await comp.endpoint(ENDPOINT_REPORT).client()
        await route.wait_for_instances(1, timeout_s=wait_s)
        return cls(route, report)

    async def route(
        self,
        model: str,
        token_ids: Sequence[int],
        request_id: str | None = None,
        *,
        program_id: str | None = None,
        ends_program: bool = False,
        pinned_instance_id: int | None = None,
        excluded_instance_ids: Sequence[int] = (),
        router_instance_id: int | None = None,
    ) -> RouteDecision:
        """Where to send a request; with ``request_id``, the router counts it until ``finished`` is reported."""
        call = RouteCall(
            model,
            list(token_ids),
            request_id,
            program_id,
            ends_program,
            pinned_instance_id,
            list(excluded_instance_ids),
        )
        [item] = await collect(await self._route.generate(call.to_dict(), instance_id=router_instance_id))
        return decision_from_dict(item)

    async def report(self, request_id: str, event: str, router_instance_id: int | None = None) -> bool:
        """``event`` is ``first_token`` or ``finished``; returns whether the router knew the request."""
        body = {"request_id": request_id, "event": event}
        [item] = await collect(await self._report.generate(body, instance_id=router_instance_id))
        return bool(item["known"])

    async def end_program(self, model: str, program_id: str) -> bool:
        body = {"event": EVENT_PROGRAM_END, "model": model, "program_id": program_id}
        [item] = await collect(await self._report.generate(body))
        return bool(item["known"])

    def instance_ids(self) -> list[int]:
        return self._route.instance_ids()

    async def close(self) -> None:
        await self._route.close()
        await self._report.close()
