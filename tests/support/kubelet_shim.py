"""What a kubelet would do for the ``k8s`` tier's Pods, as far as kvmesh's tests need it (no kubelet runs there: the
controller manager's Pods stay Pending): ``KubeletShim`` marks each Pod of a namespace Running and Ready (its
``status`` subresource, as a kubelet reports it), optionally after ``on_start(pod_name)`` returned (e.g. a simulated
worker started for it and registered: the rendered readiness), and calls ``on_stop(pod_name)`` when the Pod is
being deleted, then removes the Pod object (a kubelet confirms a deletion with a zero grace period once the
container exited). A polling loop over the namespace's Pods, every ``poll_s``."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException


class KubeletShim:
    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        *,
        label_selector: str = "",
        on_start: Callable[[str], Awaitable[None]] | None = None,
        on_stop: Callable[[str], Awaitable[None]] | None = None,
        poll_s: float = 0.1,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.label_selector = label_selector
        self.on_start = on_start
        self.on_stop = on_stop
        self.poll_s = poll_s
        self.ready: set[str] = set()
        self.started: list[str] = []
        self.stopped: list[str] = []
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.errors: list[str] = []

    async def __aenter__(self) -> KubeletShim:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in self._starting.values():
            t.cancel()
        await asyncio.gather(*self._starting.values(), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                pods = (await self.core.list_namespaced_pod(self.namespace, label_selector=self.label_selector)).items
                for pod in pods:
                    await self._step(pod)
                # A Pod never bound to a node is deleted at once (no kubelet to confirm): gone from the listing.
                names = {p.metadata.name for p in pods}
                for name in [n for n in self.started if n not in names and n not in self.stopped]:
                    await self._stopped(name)
            except ApiException as e:
                self.errors.append(f"{e.status} {e.reason}")
            await asyncio.sleep(self.poll_s)

    async def _step(self, pod: Any) -> None:
        name = pod.metadata.name
        if pod.metadata.deletion_timestamp is not None:
            if name in self.started and name not in self.stopped:
                await self._stopped(name)
            with contextlib.suppress(ApiException):
                await self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
            return
        if name in self.ready or name in self._starting:
            return
        self._starting[name] = asyncio.ensure_future(self._start(name))

    async def _stopped(self, name: str) -> None:
        if name in self._starting:
            self._starting.pop(name).cancel()
        self.stopped.append(name)
        self.ready.discard(name)
        if self.on_stop is not None:
            await self.on_stop(name)

    async def _start(self, name: str) -> None:
        self.started.append(name)
        if self.on_start is not None:
            await self.on_start(name)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                ],
            }
        }
        try:
            await self.core.patch_namespaced_pod_status(name, self.namespace, body)
            self.ready.add(name)
        except ApiException as e:
            self.errors.append(f"{name}: {e.status} {e.reason}")
        finally:
            self._starting.pop(name, None)
