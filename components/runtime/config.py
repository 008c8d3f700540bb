"""Runtime configuration: where etcd and NATS are, lease timing, request-plane timing.

Defaults bind to loopback. Environment variables (``KVMESH_ETCD_ENDPOINTS``, ``KVMESH_NATS_URL``,
``KVMESH_LEASE_TTL_S``) override the defaults so a process started by ``kvmesh serve`` or by Kubernetes finds the
servers without flags.
"""

from __future__ import annotations

import os
from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, Field, field_validator

from components.runtime.errors import ConfigError

DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class RuntimeConfig(BaseModel):
    """Everything the runtime needs to join the mesh."""

    etcd_endpoints: list[str] = Field(
        default_factory=lambda: [DEFAULT_ETCD_ENDPOINT],
        description="etcd client URLs (http://host:port); the first reachable one is used. "
        "Environment: KVMESH_ETCD_ENDPOINTS.",
        json_schema_extra={"cli_aliases": ["--etcd"]},
    )
    nats_url: str = Field(
        default=DEFAULT_NATS_URL,
        description="NATS server URL, nats://host:port. Environment: KVMESH_NATS_URL.",
        json_schema_extra={"cli_aliases": ["--nats"]},
    )
    lease_ttl_s: int = Field(
        default=10,
        ge=2,
        description="TTL of the primary lease. An instance whose process dies vanishes from discovery after at most "
        "this long; keep-alives are sent every TTL/3, so a live instance survives two lost keep-alives.",
    )
    request_ack_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="How long a client waits for an instance to acknowledge a request before calling it gone. "
        "A missing subscriber is detected at once through NATS no-responders; this covers a hung process.",
    )
    stream_idle_probe_s: float = Field(
        default=0.5,
        gt=0,
        description="After this long without a frame, a client probes the instance; a probe with no responder or no "
        "answer ends the stream with StreamInterruptedError. Bounds detection of a killed worker mid-stream.",
    )
    probe_timeout_s: float = Field(default=1.0, gt=0, description="How long a liveness probe may take.")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="How long start-up waits for etcd and NATS.")
    reconnect_backoff_max_s: float = Field(
        default=2.0, gt=0, description="Upper bound of the exponential back-off between reconnection attempts."
    )
    bus_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="A request made while NATS is unreachable waits up to this long for the connection to come "
        "back (a restarting nats-server is back within a second or two) before failing with BusUnavailableError.",
    )
    client_check_s: float = Field(
        default=5.0,
        ge=0,
        description="How often an instance checks that the client of each request it runs still exists (one probe "
        "per client process); requests whose client is gone (no responders at two checks in a row) are cancelled. "
        "Bounds how long a dead frontend's requests keep running (2 checks). 0: never.",
    )
    vanished_instance_trust_s: float = Field(
        default=20.0,
        ge=0,
        description="When etcd comes back without its data, every registration vanishes while its instances still "
        "run. A client keeps such an instance for up to this long (2 lease TTLs by default; live instances "
        "re-register within about a second) and drops it sooner only when the request plane says it is gone.",
    )
    response_transport: Literal["tcp", "bus"] = Field(
        default="tcp",
        description="How instances send streamed responses to this process: 'tcp', a direct connection to a "
        "listener of this process (one hop less than through nats-server; falls back to the bus when it cannot "
        "be reached), or 'bus', through nats-server only.",
    )
    response_host: str = Field(
        default="127.0.0.1",
        description="Address the response listener binds and names in requests (with response_transport 'tcp'). "
        "Workers on other machines must be able to reach it: set the pod's or host's IP there.",
    )

    @field_validator("etcd_endpoints")
    @classmethod
    def _check_etcd(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one etcd endpoint is required")
        for ep in v:
            parse_host_port(ep, default_port=2379)
        return v

    @field_validator("nats_url")
    @classmethod
    def _check_nats(cls, v: str) -> str:
        parse_host_port(v, default_port=4222)
        return v

    @classmethod
    def from_env(cls, **overrides: object) -> RuntimeConfig:
        """Defaults, then environment variables, then explicit overrides (None means 'not given')."""
        values: dict[str, object] = {}
        if eps := os.environ.get("KVMESH_ETCD_ENDPOINTS"):
            values["etcd_endpoints"] = [e.strip() for e in eps.split(",") if e.strip()]
        if url := os.environ.get("KVMESH_NATS_URL"):
            values["nats_url"] = url
        if transport := os.environ.get("KVMESH_RESPONSE_TRANSPORT"):
            values["response_transport"] = transport
        if host := os.environ.get("KVMESH_RESPONSE_HOST"):
            values["response_host"] = host
        if ttl := os.environ.get("KVMESH_LEASE_TTL_S"):
            try:
                values["lease_ttl_s"] = int(ttl)
            except ValueError:  # int() would escape as a bare ValueError that names no variable
                raise ConfigError(f"KVMESH_LEASE_TTL_S={ttl!r} is not a whole number of seconds") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValueError as e:
            raise ConfigError(str(e)) from e


def parse_host_port(url: str, default_port: int) -> tuple[str, int]:
    """``http://h:p``, ``nats://h:p`` or ``h:p`` -> (host, port); a clear ConfigError otherwise."""
    text = url if "://" in url else f"tcp://{url}"
    try:
        parsed = urlparse(text)
        port = parsed.port or default_port
    except ValueError as e:
        raise ConfigError(f"endpoint {url!r} does not parse: {e}") from e
    if not parsed.hostname:
        raise ConfigError(f"endpoint {url!r} has no host")
    return parsed.hostname, port
