"""The frontend's configuration: one pydantic model; ``kvmesh frontend`` flags are derived from it
(components/runtime/flags.py), and so will be the graph file's ``frontend:`` section.

Flag names follow ``vllm serve`` where it has the knob (``--host``, ``--port``, ``--api-key``). The frontend routes
with an embedded router, so every ``RouterConfig`` knob is a frontend flag too (``--router-policy kv
--router-temperature 0.1``), as on Dynamo's frontend; they are inherited, so their defaults live in one place.
"""

from __future__ import annotations

import os

from pydantic import ConfigDict, Field

from components.router.config import RouterConfig

# The default number of frontend processes is one per two usable cores, at most this many. Half, because the
# frontend shares its machine with what it serves (workers, nats-server, etcd, often the clients): on 2 cores a
# second process had no idle core to use and cost 3-16% more CPU per request (docs/frontend.md), so a 2-core
# machine gets one process and a 16-core one 8. At most 8: one process serves several hundred streamed requests/s,
# and each holds its own tokenizer, KV index and connections (~130 MiB resident with transformers imported), so
# beyond 8 memory grows faster than anything a frontend would need.
MAX_DEFAULT_REPLICAS = 8


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_replicas() -> int:
    """Frontend processes when ``replicas`` is unset: half the usable cores, 1 to 8."""
    return max(1, min(usable_cores() // 2, MAX_DEFAULT_REPLICAS))


class FrontendConfig(RouterConfig):
    """The OpenAI-compatible HTTP frontend: where it listens, what it watches, how it routes and retries."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default="kvmesh", description="Namespace whose workers this frontend serves.")
    host: str = Field(
        default="127.0.0.1",
        description="Address to listen on. Loopback by default: anything reachable from elsewhere should set "
        "--api-key too.",
    )
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port to listen on; 0 picks a free one.")
    replicas: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Frontend processes accepting on the one port (SO_REUSEPORT: the kernel spreads connections "
        "over them), so the frontend uses more than one core; they share their routers' in-flight counts over "
        "NATS (router_replica_sync) and their /metrics. Unset: one per two usable cores, 1 to 8. 1: one process, "
        "no helper processes (vLLM's --api-server-count).",
        json_schema_extra={"cli_aliases": ["--api-server-count"]},
    )
    reuse_port: bool = Field(
        default=False,
        description="Bind the port with SO_REUSEPORT, so that other frontend processes of this user may accept on "
        "it too (--replicas sets it on its processes; set it by hand to run replicas under another supervisor).",
    )
    api_key: str | None = Field(
        default=None,
        description="If set, every request but GET /health must carry 'Authorization: Bearer <key>' (401 otherwise). "
        "Read from $KVMESH_API_KEY when not given, which keeps it out of the process list.",
    )
    components: list[str] = Field(
        default_factory=lambda: ["backend"],
        min_length=1,
        description="Components whose 'generate' instances serve requests; their metadata names the model.",
    )
    max_retries: int = Field(
        default=3,
        ge=0,
        le=64,
        description="Other workers to try when the chosen one is gone, draining or fails before the first token. "
        "Nothing has reached the client then, so a retry is invisible to it.",
    )
    migration_limit: int = Field(
        default=3,
        ge=0,
        le=64,
        description="How many times a running request whose worker dies (no responders, a cut stream, an engine "
        "that failed) is re-issued on another worker by recompute, continuing the client's stream where it stopped "
        "(Dynamo's name and meaning). 0: such requests fail with an error. Moves the workers make themselves "
        "(live migration) do not count.",
    )
    first_token_timeout_s: float = Field(
        default=300.0,
        ge=0,
        description="Longest wait for a request's first token (queueing + prefill) before it fails with 504; "
        "0: no limit. A dead worker is noticed by the runtime's probes within ~1.5 s, so this only bounds a live "
        "but stuck one.",
    )
    request_timeout_s: float = Field(
        default=900.0,
        ge=0,
        description="Longest a whole request may run; 0: no limit. An 8k-token answer at 10 tokens/s takes ~820 s.",
    )
    retry_after_s: int = Field(
        default=2,
        ge=1,
        description="Retry-After header of a 503 (no workers): the usual time for a worker that is starting to "
        "register, or for a draining one's replacement.",
    )
    default_max_tokens: int = Field(
        default=16,
        ge=1,
        description="max_tokens of a /v1/completions request that sets none (the OpenAI API's default). Chat "
        "requests without one may use the rest of the context, as in the OpenAI API.",
    )
    max_request_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Largest accepted request body (413 beyond). 32 MiB holds a 128k-token prompt as token ids.",
    )
    request_stats_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="How often this frontend (each replica) publishes, per served model, its requests' counts, "
        "token totals and latencies (TTFT, inter-token gaps) on the event plane, for the SLA planner "
        "(docs/fleet.md, 'Request reports'). 1 s: the planner's intervals are tens of seconds, and a report costs one "
        "small message per model.",
    )
    # 16: a report then carries at most 16 x 1,024 hashes (~300 KB of msgpack at worst), under NATS's 1 MB payload.
    request_stats_prefixes: int = Field(
        default=0,
        ge=0,
        le=16,
        description="Prefixes (KV blocks shared from a prompt's start) per request report: the ones most requests "
        "carried in the interval, each with its chained block hashes (up to 1,024 blocks) and its request count, "
        "for the rescheduler's prefix_replication policy (docs/rescheduler.md, 'Hot-prefix replication'). 0: none. "
        "Only a KV-aware router hashes prompts; with it, each request's prompt is hashed to its 1,024th full block "
        "rather than as far as the KV index search reads. A frontend with --colocated-rescheduling-mode and "
        "prefix_replication among its policies reports 16 unless this is set.",
    )
    shutdown_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM/SIGINT, how long requests in flight may finish before they are cancelled.",
    )
