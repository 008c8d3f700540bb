"""What a worker announces about itself in its registration, and the rules every reader of it must share.

``WorkerMetadata`` is written by the worker (``to_dict``, into its etcd registration) and read by the frontend,
router, planner, rescheduler and ``kvmesh status`` (``from_dict``), instead of each reading an untyped dict by string
key. Reading is tolerant: a field a peer of another version did not send takes its default, a field it sent that
this version does not know is ignored.

The rule here is one several components must agree on, so it lives once: ``is_routable``, which workers take
client requests (not prefill workers: they serve decode workers). When a worker's last load report means it is
presumed dead is the fleet view's rule (``components.fleet.rules``).

Imports: the standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


class WorkerRole(enum.StrEnum):
    AGGREGATED = "aggregated"  # prefill and decode on the same engine
    PREFILL = "prefill"  # prefills prompts for decode workers; never routed to by clients
    DECODE = "decode"  # takes client requests, prefills remotely when worth it


class RemotePrefillMode(enum.StrEnum):
    """How a disaggregated (prefill or decode) worker's engine gets a remotely prefilled prompt's KV into the decode
    worker: the value of ``WorkerMetadata.remote_prefill_mode``. An aggregated worker announces ``""``."""

    KV_TRANSFER = "kv_transfer"  # the prefill worker's KV blocks are delivered to the decode worker
    RECOMPUTE = "recompute"  # no KV is delivered: the decode worker computes the prompt again itself


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerMetadata:
    """A worker's registration metadata. ``node``/``pid``/``unit`` are its failure domains: workers that share a
    pid share a process (they die together), workers that share a node share a machine."""

    model: str = ""  # served model name, as clients ask for it
    model_path: str = ""  # local model directory (tokenizer, config), absolute
    role: WorkerRole = WorkerRole.AGGREGATED
    # ``RemotePrefillMode``'s value for prefill and decode workers, "" for aggregated ones. A str, not the enum, so a
    # mode a newer peer announces is shown as it is rather than dropped.
    remote_prefill_mode: str = ""
    engine: str = ""  # mock, vllm
    block_size: int = 0  # tokens per KV block
    kv_hash_scheme: int | None = None  # how its KV events hash blocks (protocol.kv_hashing); None: not said
    max_model_len: int = 0  # prompt + output tokens one request may hold; 0: unknown
    node: str = ""  # host name (on Kubernetes: the node the pod runs on)
    pod: str = ""  # the Kubernetes pod the process runs in; "" elsewhere
    pid: int = 0  # process id on that node (in its pod: every pod's process may be pid 1)
    unit: int = 0  # index of the worker inside its process
    started_at: float = 0.0  # wall-clock registration time, seconds since the epoch
    # How its engine moves a running request to another worker (``protocol.migration.MigrationMode``'s value:
    # live or recompute); "" where it cannot (no migration agent). A str for the same reason as above.
    migration_mode: str = ""
    # How it takes part in a hot-prefix copy, either end (``protocol.replication.PrefixCopyMode``'s value);
    # "" where it cannot: a prefill worker, a vLLM engine without the NIXL connector or without prefix caching (it
    # would refuse every copy), a worker that does not say. A str for the same reason as above.
    prefix_copy_mode: str = ""
    # The engine's step-time model (components.perf.model.StepTimeModel's fields: ms per step by its shape), for the
    # kv router's predicted time to first token; empty: the router's defaults.
    step_time: dict[str, float] = dataclasses.field(default_factory=dict)
    # Which measured profile (``components.perf.profile.Profile.profile_id``) the step_time was fitted to; "" when
    # it is the engine's own model or the defaults.
    profile_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["role"] = str(self.role)
        d["remote_prefill_mode"] = str(self.remote_prefill_mode)  # a RemotePrefillMode member is written as its value
        d["migration_mode"] = str(self.migration_mode)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> WorkerMetadata:
        if not d:
            return cls()
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name == "step_time":
                if isinstance(v, Mapping):
                    kwargs[f.name] = {
                        str(k): float(x)
                        for k, x in v.items()
                        if isinstance(x, (int, float)) and not isinstance(x, bool)
                    }
                continue
            default = f.default
            if default is None:  # an optional int
                if isinstance(v, int) and not isinstance(v, bool):
                    kwargs[f.name] = v
                continue
            if f.name == "role":
                try:
                    kwargs["role"] = WorkerRole(v)
                except ValueError:
                    continue  # a role this version does not know: keep the default, not a crash
            elif isinstance(default, bool) or not isinstance(v, type(default)):
                if isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool):
                    kwargs[f.name] = float(v)
                continue  # wrong type from a foreign writer: keep the default
            else:
                kwargs[f.name] = v
        return cls(**kwargs)

    @property
    def process_key(self) -> tuple[str, int]:
        """(node, pid), with the pod beside the node where there is one (two pods on one node may both run their
        process as pid 1): workers with the same key share a process, and so its faults."""
        return (f"{self.node}/{self.pod}" if self.pod else self.node, self.pid)


def is_routable(meta: WorkerMetadata) -> bool:
    """Whether clients' requests may be routed to this worker: it names a model and is not a prefill worker."""
    return bool(meta.model) and meta.role != WorkerRole.PREFILL
