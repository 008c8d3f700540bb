"""Which models this frontend serves, discovered, not configured.

Workers announce ``model``, ``model_path`` and ``max_model_len`` in the metadata of their ``generate`` instance. The
registry follows every configured component's ``generate`` instances through a runtime ``Client`` (an etcd watch):
a model exists while at least one worker announces it, so it appears in /v1/models with its first worker and
disappears with its last. Each model's tokenizer is loaded once per ``model_path``, in a thread, as soon as the model
appears; the model is listed (/v1/models) and the frontend healthy (/health) only once it is loaded, so the first
request does not pay the load (2-3 s with transformers' imports); requests that arrive meanwhile wait for it.

A model's ``max_model_len`` is the smallest its workers announce: a request accepted by the frontend must fit on
whichever worker the router picks.

Prefill workers (``role: prefill``) are not routed to: they serve the decode workers, not clients.

Owns: one runtime ``Client`` per component and one named task per tokenizer load (both in the runtime's supervisor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from components.frontend.errors import ModelUnavailableError
from components.frontend.tokenizer import Tokenizer, load_tokenizer
from components.protocol.endpoints import ENDPOINT_GENERATE
from components.protocol.metadata import WorkerMetadata, is_routable
from components.router import Router
from components.runtime import Client, InstanceInfo, Runtime

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Model:
    """A served model as the frontend knows it now."""

    name: str
    model_path: str
    max_model_len: int
    created: int  # Unix time the frontend first saw it (OpenAI's 'created')
    instances: dict[int, InstanceInfo]
    tokenizer_task: asyncio.Task[Tokenizer] | None = None

    @property
    def loading(self) -> bool:
        """Its tokenizer is still being loaded (the model is not listed until it is, so the first request does not
        wait seconds for it; a load that failed counts as done: the model is listed and answers model_unavailable)."""
        return self.tokenizer_task is not None and not self.tokenizer_task.done()

    async def tokenizer(self) -> Tokenizer:
        if self.tokenizer_task is None:
            raise ModelUnavailableError(f"model {self.name!r} announces no model_path, so it has no tokenizer")
        task = self.tokenizer_task
        if task.done() and not task.cancelled() and task.exception() is None:
            return task.result()  # loaded: every request but the first few (a shield costs a future and callbacks)
        try:
            # shield: a request cancelled while the tokenizer loads must not cancel the load for everyone else.
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # whatever transformers raised, told to the client as one error
            raise ModelUnavailableError(
                f"the tokenizer of model {self.name!r} could not be loaded from {self.model_path!r}: {e}"
            ) from e


class ModelRegistry:
    def __init__(
        self,
        runtime: Runtime,
        namespace: str,
        components: list[str],
        router: Router,
        tokenizer_loader: Callable[[str], Tokenizer] = load_tokenizer,
    ) -> None:
        self._runtime = runtime
        self._namespace = namespace
        self._component_names = components
        self._router = router
        self._load = tokenizer_loader
        self._clients: list[Client] = []
        self._client_of: dict[int, Client] = {}
        self.models: dict[str, Model] = {}
        self.seen: set[str] = set()  # every model that ever had a worker: a request for one now gone is a 503
        self._created: dict[str, int] = {}
        self._tokenizers: dict[str, asyncio.Task[Tokenizer]] = {}  # by model_path, kept when a model leaves
        self._changed = asyncio.Event()

    async def start(self) -> None:
        ns = self._runtime.namespace(self._namespace)
        for name in self._component_names:
            client = await ns.component(name).endpoint(ENDPOINT_GENERATE).client()
            client.on_change(self._rebuild)
            self._clients.append(client)
        self._rebuild()

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
        self._clients.clear()
        for task in self._tokenizers.values():
            task.cancel()

    def client_for(self, instance_id: int) -> Client | None:
        return self._client_of.get(instance_id)

    def num_workers(self) -> int:
        return len(self._client_of)

    async def wait_for_model(self, name: str, timeout_s: float = 30.0) -> Model:
        """Wait until ``name`` is served (tests and start-up scripts)."""

        async def wait() -> Model:
            while name not in self.models:
                self._changed.clear()
                await self._changed.wait()
            return self.models[name]

        async with asyncio.timeout(timeout_s):
            return await wait()

    def _rebuild(self) -> None:
        """Recompute models from every client's instance list; called on each discovery change."""
        by_model: dict[str, dict[int, InstanceInfo]] = {}
        client_of: dict[int, Client] = {}
        for client in self._clients:
            for info in client.instances():
                meta = WorkerMetadata.from_dict(info.metadata)
                name = meta.model
                if not is_routable(meta):
                    continue
                by_model.setdefault(name, {})[info.instance_id] = info
                client_of[info.instance_id] = client
        self._client_of = client_of
        old = self.models
        models: dict[str, Model] = {}
        for name, instances in by_model.items():
            models[name] = self._model(name, instances, old.get(name))
        for name in old.keys() - models.keys():
            logger.info("model %s is gone: its last worker left", name)
            self._router.set_workers(name, [])
        self.models = models
        self._changed.set()

    def _model(self, name: str, instances: dict[int, InstanceInfo], before: Model | None) -> Model:
        metas = [WorkerMetadata.from_dict(i.metadata) for i in instances.values()]
        paths = {m.model_path for m in metas}
        path = before.model_path if before is not None and before.model_path in paths else sorted(paths)[-1]
        if len(paths) > 1:
            logger.warning("workers of model %s announce different model paths %s; using %s", name, paths, path)
        max_model_len = min((m.max_model_len for m in metas if m.max_model_len > 0), default=0)
        if before is None:
            self.seen.add(name)
            self._created.setdefault(name, int(time.time()))
            logger.info("model %s is served (path %r, max_model_len %d)", name, path, max_model_len)
        if before is None or before.instances != instances:  # a worker joined, left, or changed its metadata
            self._router.set_workers(name, ((iid, i.metadata) for iid, i in instances.items()))
        return Model(name, path, max_model_len, self._created[name], instances, self._tokenizer_task(path))

    def _tokenizer_task(self, path: str) -> asyncio.Task[Tokenizer] | None:
        if not path:
            return None
        task = self._tokenizers.get(path)
        failed = task is not None and task.done() and not task.cancelled() and task.exception() is not None
        if task is None or failed:
            # A failed load (files not there yet, a broken tokenizer.json) is tried again at the next change of the
            # workers, not once per request.
            task = self._runtime.supervisor.spawn(asyncio.to_thread(self._load, path), name=f"tokenizer:{path}")
            self._tokenizers[path] = task
        return task
