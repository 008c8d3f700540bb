"""Typed errors of the runtime: one small hierarchy, carrying the fields a caller needs to react.

Recoverable errors (``RecoverableError``) concern one request or one instance: the caller may retry elsewhere.
Fatal errors (``FatalError``) mean this runtime cannot go on (bad configuration, a server that never answered).
Timeouts inherit from both the package root and the built-in ``TimeoutError``, as nats.py does, so
``except TimeoutError`` works for callers who do not know kvmesh.

A handler's error crosses the wire as ``components.protocol.errors.ErrorPayload`` (a code, not a class name) and comes
back as ``RemoteHandlerError`` carrying it.
"""

from __future__ import annotations

from components.protocol.errors import ErrorCode, ErrorPayload


class RuntimeMeshError(Exception):
    """Root of every error raised by ``components.runtime``."""


class RecoverableError(RuntimeMeshError):
    """One request or one instance failed; the rest of the mesh is fine."""


class FatalError(RuntimeMeshError):
    """The runtime cannot continue."""


class ConfigError(FatalError):
    """A configuration value is invalid (an endpoint that does not parse, a TTL that is too short)."""


class ConnectError(FatalError):
    """etcd or NATS could not be reached at start-up."""

    def __init__(self, service: str, endpoint: str, reason: str) -> None:
        super().__init__(f"cannot reach {service} at {endpoint}: {reason}")
        self.service = service
        self.endpoint = endpoint
        self.reason = reason


class NoInstancesError(RecoverableError):
    """No instance serves this endpoint right now."""

    def __init__(self, endpoint_path: str) -> None:
        super().__init__(f"no instances serve {endpoint_path}")
        self.endpoint_path = endpoint_path


class InstanceGoneError(RecoverableError):
    """The chosen instance is not there (it exited, or never acknowledged the request). Nothing was generated."""

    def __init__(self, instance_id: int, reason: str) -> None:
        super().__init__(f"instance {instance_id:x} is gone: {reason}")
        self.instance_id = instance_id
        self.reason = reason


class InstanceDrainingError(RecoverableError):
    """The instance is draining and accepts no new requests; retry on another one."""

    def __init__(self, instance_id: int) -> None:
        super().__init__(f"instance {instance_id:x} is draining")
        self.instance_id = instance_id


class StreamInterruptedError(RecoverableError):
    """A stream that had started ended without its end-of-stream frame (the instance died, or frames were lost)."""

    def __init__(self, instance_id: int, request_id: str, num_frames: int, reason: str) -> None:
        super().__init__(
            f"stream {request_id} from instance {instance_id:x} interrupted after {num_frames} frames: {reason}"
        )
        self.instance_id = instance_id
        self.request_id = request_id
        self.num_frames = num_frames
        self.reason = reason


class RemoteHandlerError(RecoverableError):
    """The handler on the instance raised. ``payload`` says how, as the wire carries it (``ErrorPayload``): decide on
    ``code`` and ``recoverable``; ``error_type`` (the raising class's name) and ``message`` are for people."""

    def __init__(self, instance_id: int, payload: ErrorPayload) -> None:
        super().__init__(
            f"handler on instance {instance_id:x} failed: {payload.type or payload.code}: {payload.message}"
        )
        self.instance_id = instance_id
        self.payload = payload
        self.error_type = payload.type
        self.message = payload.message

    @property
    def code(self) -> ErrorCode:
        return self.payload.code

    @property
    def recoverable(self) -> bool:
        """Whether the same request may succeed on another instance."""
        return self.payload.recoverable


class RequestTimeoutError(RecoverableError, TimeoutError):
    """A request or a stream frame did not arrive in time."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} timed out after {timeout_s:g} s")
        self.what = what
        self.timeout_s = timeout_s


class BusUnavailableError(RecoverableError, TimeoutError):
    """NATS stayed unreachable for ``bus_wait_s``: the request was not sent."""

    def __init__(self, url: str, waited_s: float) -> None:
        super().__init__(f"NATS at {url} unreachable for {waited_s:g} s; the request was not sent")
        self.url = url
        self.waited_s = waited_s


class QueueFullError(RecoverableError):
    """A bounded work queue holds ``max_items`` items (waiting or in flight): the item was not enqueued. The caller
    decides what to do instead (a decode worker prefills locally)."""

    def __init__(self, queue: str, max_items: int | None) -> None:
        # max_items is None where another process set the bound (the last opener's limit applies to all).
        held = f"its maximum of {max_items} items" if max_items is not None else "as many items as its limit allows"
        super().__init__(
            f"work queue {queue!r} is full: it holds {held} (waiting or in flight); the item was not enqueued"
        )
        self.queue = queue
        self.max_items = max_items


class QueueUnavailableError(RecoverableError):
    """JetStream did not take the operation on a work queue: not enabled on the NATS server (``nats-server -js``),
    the stream gone, no answer in time, or the connection closed. ``maybe_enqueued`` is True where a push got no answer
    in time: the server may have stored the item all the same."""

    def __init__(self, queue: str, operation: str, reason: str, *, maybe_enqueued: bool = False) -> None:
        super().__init__(f"work queue {queue!r}: {operation} failed: {reason}")
        self.queue = queue
        self.operation = operation
        self.reason = reason
        self.maybe_enqueued = maybe_enqueued


class LeaseLostError(RecoverableError):
    """The primary lease expired on the server; the runtime re-acquires it and re-registers everything."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(f"lease {lease_id:x} lost")
        self.lease_id = lease_id


class ShutdownError(RuntimeMeshError):
    """The runtime is shutting down; no new work is accepted."""
