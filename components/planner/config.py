"""The planner's decision knobs: one pydantic model, ``PlannerConfig``; ``kvmesh planner`` flags are derived from it
(components/runtime/flags.py), so every default lives here once.

Names and defaults are those of Dynamo's load planner (its ``--adjustment-interval`` 30, ``--metric-pulling-interval``
1, ``--max-gpu-budget`` 8, ``--min-gpu-budget`` 1, the four thresholds 0.9/0.5 and 0.5/0.2, one GPU per engine, as
ai-dynamo/dynamo docs/architecture/load_planner.md lists them at commit 19d1fc5e). Its two intervals carry no unit in
their names; STYLE.md habit 8 keeps a seed system's names, so the unit (seconds) is stated in each description
instead. Both are floats, not Dynamo's ints: the planner benchmark compresses time and scales the intervals with it.

What the thresholds are compared against is defined in ``components/planner/policy.py``'s docstring.

``PlannerRunConfig`` is the rest of ``kvmesh planner``'s own flags: which deployment and model, how pools are resized
(``--environment``), TensorBoard and Prometheus. Both models are also the ``planner:`` section of a graph file
(components/deploy/graph.py derives it from them, less what the graph itself decides), so this module is a leaf any
package may import (tests/unit/test_layering.py: a pure config module).

This module is read by the pure policy (its own package's config, STYLE.md habit 1); it imports only the standard
library and pydantic.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A change to a pool may take this long before it counts as failed: an outside system (virtual) that starts a real
# engine, or a new vLLM worker (local: model load, profiling, CUDA graphs) takes minutes; ten minutes covers it
# without leaving a planner paused forever on a worker that never comes up.
DEFAULT_SCALING_TIMEOUT_S = 600.0


class PlannerConfig(BaseModel):
    """How the planner decides: when it looks, when it acts, the thresholds it acts on and the GPU budget."""

    model_config = ConfigDict(extra="forbid")

    adjustment_interval: float = Field(
        default=30.0,
        gt=0,
        description="Seconds between scaling decisions. Each decision compares the averages of the pulls since the "
        "previous one with the thresholds, and changes each pool by at most one worker.",
    )
    metric_pulling_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between metric pulls (decode workers' KV-cache use, prefill queue size). A worker whose "
        "latest load snapshot is older than 3 pulls is left out of a pull's average.",
    )
    max_gpu_budget: int = Field(
        default=8,
        ge=1,
        description="Most GPUs all prefill and decode workers together may use; a scale-up that would pass it is "
        "refused. A simulated worker counts as its graph group's gpus_per_replica (0 counts as 1).",
    )
    min_gpu_budget: int = Field(
        default=1,
        ge=0,
        description="Fewest GPUs each pool (prefill, decode) keeps; a scale-down that would go under it is refused. "
        "A pool never goes below one worker whatever this says.",
    )
    decode_kv_scale_up_threshold: float = Field(
        default=0.9,
        ge=0,
        description="Add a decode (or aggregated) worker when the interval's average KV-cache use of those workers, "
        "a fraction 0..1 of their KV blocks, is above this.",
    )
    decode_kv_scale_down_threshold: float = Field(
        default=0.5,
        ge=0,
        description="Remove a decode (or aggregated) worker when the interval's average KV-cache use (fraction 0..1) "
        "is below this. Not within 3 intervals of adding one.",
    )
    prefill_queue_scale_up_threshold: float = Field(
        default=0.5,
        ge=0,
        description="Add a prefill worker when prefill queue utilisation, the interval's average number of items "
        "waiting in the prefill queue divided by the number of prefill workers (items per worker), is above this "
        "and the queue's trend does not bring it under this within 3 intervals.",
    )
    prefill_queue_scale_down_threshold: float = Field(
        default=0.2,
        ge=0,
        description="Remove a prefill worker when prefill queue utilisation (average items waiting per prefill "
        "worker over the interval) is below this.",
    )
    decode_engine_num_gpu: int = Field(
        default=1,
        ge=1,
        description="GPUs one decode (or aggregated) worker uses, for the budget, unless the deployment says "
        "(a graph group's gpus_per_replica).",
    )
    prefill_engine_num_gpu: int = Field(
        default=1,
        ge=1,
        description="GPUs one prefill worker uses, for the budget, unless the deployment says (a graph group's "
        "gpus_per_replica).",
    )
    no_operation: bool = Field(
        default=False,
        description="Observe and report what the planner would do (logs, TensorBoard, metrics), and change nothing.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> PlannerConfig:
        # A down-threshold at or above its up-threshold would make one average both add and remove (or flap every
        # interval): refused rather than silently ordered.
        pairs = (
            ("decode_kv_scale_down_threshold", "decode_kv_scale_up_threshold"),
            ("prefill_queue_scale_down_threshold", "prefill_queue_scale_up_threshold"),
        )
        for down, up in pairs:
            if getattr(self, down) >= getattr(self, up):
                raise ValueError(f"{down} ({getattr(self, down)}) must be below {up} ({getattr(self, up)})")
        if self.min_gpu_budget > self.max_gpu_budget:
            raise ValueError(
                f"min_gpu_budget ({self.min_gpu_budget}) must not exceed max_gpu_budget ({self.max_gpu_budget})"
            )
        if self.metric_pulling_interval > self.adjustment_interval:
            raise ValueError(
                f"metric_pulling_interval ({self.metric_pulling_interval} s) must not exceed adjustment_interval "
                f"({self.adjustment_interval} s): an interval needs at least one pull"
            )
        return self


class Environment(enum.StrEnum):
    LOCAL = "local"  # the circus arbiter `kvmesh serve` started, found through state/<namespace>.json
    VIRTUAL = "virtual"  # an outside system answers through etcd (tests, the fleet simulator)
    KUBERNETES = "kubernetes"  # its own issue: refused for now


class PlannerRunConfig(BaseModel):
    """Where the planner runs: the deployment, its model, how it changes the fleet and where it reports."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default="kvmesh", description="Namespace of the deployment to scale.")
    served_model_name: str = Field(
        default="mock-model",
        min_length=1,
        description="Served model name whose workers are scaled (the workers' --model).",
    )
    environment: Environment = Field(
        default=Environment.LOCAL,
        description="How pools are resized: local (the circus arbiter of the `kvmesh serve` deployment of this "
        "namespace, found through <state-dir>/<namespace>.json), virtual (target sizes written to etcd under "
        "kvmesh/<namespace>/planner/virtual/ for an outside system to apply and acknowledge), kubernetes (not "
        "implemented yet).",
    )
    state_dir: str | None = Field(
        default=None,
        description="local environment: the directory of kvmesh serve's state files; unset: $KVMESH_STATE_DIR, else "
        "./state. etcd and NATS endpoints are read from the state file unless given as flags or in the environment.",
    )
    log_dir: str | None = Field(
        default=None,
        description="Directory for TensorBoard event files (scalars at every pull and adjustment, decisions as "
        "text); none: no TensorBoard output.",
    )
    scaling_timeout_s: float = Field(
        default=DEFAULT_SCALING_TIMEOUT_S,
        gt=0,
        description="Seconds one pool change may take before it counts as failed: local, until a new worker has "
        "registered in etcd (a leaving one gets its watcher's graceful_timeout_s to drain instead); virtual, until "
        "the outside system reports it done.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address of the planner's Prometheus endpoint (GET /metrics); loopback unless said otherwise.",
    )
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="TCP port of the planner's Prometheus endpoint; 0: a free port, announced on the READY line and "
        "by `kvmesh status` (a fixed default would clash between the planners of two deployments on one machine).",
    )
