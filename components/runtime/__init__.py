"""kvmesh's runtime: the only package that imports the etcd client (aetcd) and nats-py.

Public API: ``Runtime`` (namespace -> component -> endpoint), ``RuntimeConfig``, the typed errors, the event plane,
work queues (``Namespace.work_queue`` / ``Namespace.prefill_queue``: ``WorkQueue``, ``WorkItem``, ``QueueStats``) and
the in-memory twins for unit tests.
"""

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
