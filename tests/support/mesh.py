"""A builder of runtimes over the in-memory twins: one MemoryStore and one MemoryBus shared by every runtime built,
so a "server" runtime and a "client" runtime talk as two processes would, minus the sockets (unit tests only)."""

from __future__ import annotations

from components.runtime import Runtime, RuntimeConfig
from components.runtime.memory import MemoryBus, MemoryDiscovery, MemoryStore


class Mesh:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.bus = MemoryBus(seed=0)
        self.runtimes: list[Runtime] = []

    async def runtime(self, **config: object) -> Runtime:
        # Responses over the bus unless a test asks for the direct connections: spies on the bus see them.
        config = {"response_transport": "bus", **config}
        rt = await Runtime.from_parts(RuntimeConfig(**config), MemoryDiscovery(self.store), self.bus)  # type: ignore[arg-type]
        self.runtimes.append(rt)
        return rt

    async def shutdown(self) -> None:
        for rt in self.runtimes:
            await rt.shutdown(drain_timeout_s=0.5)
