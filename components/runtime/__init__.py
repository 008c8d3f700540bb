"""kvmesh's runtime: the only package that imports the etcd client (aetcd) and nats-py.

Public API: ``Runtime`` (namespace -> component -> endpoint), ``RuntimeConfig``, the typed errors, the event plane,
work queues (``Namespace.work_queue`` / ``Namespace.prefill_queue``: ``WorkQueue``, ``WorkItem``, ``QueueStats``) and
the in-memory twins for unit tests.

The names are loaded on first use (PEP 562 ``__getattr__``), not when the package is: ``components.runtime.config``,
``errors``, ``flags`` and ``servers`` are imported by graph files, ``kvmesh serve``/``stop``/``logs``/``status``, the
planner and every other process, and importing any of them through an eager ``__init__`` also loaded nats-py (and
with it aiohttp) and the etcd client (grpc): ~0.28 s of the ~1 s a light ``kvmesh`` command spent importing on the
2-core machine. ``from components.runtime import Runtime`` still works, and loads what it names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from components.runtime.bus import QueueStats, WorkItem, WorkQueue
    from components.runtime.config import RuntimeConfig
    from components.runtime.errors import (
        BusUnavailableError,
        ConfigError,
        ConnectError,
        FatalError,
        InstanceDrainingError,
        InstanceGoneError,
        NoInstancesError,
        QueueFullError,
        QueueUnavailableError,
        RecoverableError,
        RemoteHandlerError,
        RequestTimeoutError,
        RuntimeMeshError,
        ShutdownError,
        StreamInterruptedError,
    )
    from components.runtime.events import Event, EventSubscription
    from components.runtime.request_plane import RequestContext, ResponseStream, collect, probe_instance
    from components.runtime.runtime import Client, Endpoint, InstanceInfo, RouterMode, Runtime, ServedEndpoint

__all__ = [
    "BusUnavailableError",
    "Client",
    "ConfigError",
    "ConnectError",
    "Endpoint",
    "Event",
    "EventSubscription",
    "FatalError",
    "InstanceDrainingError",
    "InstanceGoneError",
    "InstanceInfo",
    "NoInstancesError",
    "QueueFullError",
    "QueueStats",
    "QueueUnavailableError",
    "RecoverableError",
    "RemoteHandlerError",
    "RequestContext",
    "RequestTimeoutError",
    "ResponseStream",
    "RouterMode",
    "Runtime",
    "RuntimeConfig",
    "RuntimeMeshError",
    "ServedEndpoint",
    "ShutdownError",
    "StreamInterruptedError",
    "WorkItem",
    "WorkQueue",
    "collect",
    "probe_instance",
]

# Each public name and the module that defines it (tests/unit/test_lazy_packages.py checks this against __all__).
_WHERE = {
    **dict.fromkeys(("QueueStats", "WorkItem", "WorkQueue"), "components.runtime.bus"),
    "RuntimeConfig": "components.runtime.config",
    **dict.fromkeys(
        (
            "BusUnavailableError",
            "ConfigError",
            "ConnectError",
            "FatalError",
            "InstanceDrainingError",
            "InstanceGoneError",
            "NoInstancesError",
            "QueueFullError",
            "QueueUnavailableError",
            "RecoverableError",
            "RemoteHandlerError",
            "RequestTimeoutError",
            "RuntimeMeshError",
            "ShutdownError",
            "StreamInterruptedError",
        ),
        "components.runtime.errors",
    ),
    **dict.fromkeys(("Event", "EventSubscription"), "components.runtime.events"),
    **dict.fromkeys(
        ("RequestContext", "ResponseStream", "collect", "probe_instance"), "components.runtime.request_plane"
    ),
    **dict.fromkeys(
        ("Client", "Endpoint", "InstanceInfo", "RouterMode", "Runtime", "ServedEndpoint"), "components.runtime.runtime"
    ),
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
